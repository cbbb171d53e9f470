"""benchmarks/graph_head.py on the GPU: every variant's graph captures and replays, and the
staging graph moves the pinned inputs to the device."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_main_needs_cuda

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import graph_head  # noqa: E402


def test_without_cuda_it_says_so(capsys):
    assert_main_needs_cuda(graph_head.main, capsys)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_variant_replays_and_stages(tmp_path):
    out = tmp_path / "head.json"
    assert graph_head.main(["--rounds", "2", "--replays", "5", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["staged_check"] == {"input_ids": 7, "seq_lens": 513}
    assert set(result["us_per_replay_median"]) == set(graph_head.VARIANTS)
    assert all(v > 0 for v in result["us_per_replay_median"].values())
    assert set(result["paced_us_per_replay_median"]) == {
        "stage_event",
        "stage_event_branch",
        "copies_event",
    }

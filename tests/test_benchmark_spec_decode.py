"""benchmarks/spec_decode.py: the verify step with and without uniform_decode_query_len.

On the CPU the plumbing (no graphs: every row runs NONE); on the GPU each row runs the mode
it is meant to measure, and the two verify rows compute the same logits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import spec_decode  # noqa: E402


def _run(tmp_path):
    out = tmp_path / "spec.json"
    args = ["--smoke", "--batches", "1,3", "--k", "2", "--rounds", "1", "--out", str(out)]
    assert spec_decode.main(args) == 0
    return json.loads(out.read_text())


def test_smoke_runs_every_row_and_the_verify_rows_agree(tmp_path):
    result = _run(tmp_path)
    assert result["query_len"] == 3 and result["batches"] == [1, 3]
    for b in ("1", "3"):
        assert set(result["summary_ms"][b]) == set(spec_decode.ROWS)
        assert all(v > 0 for v in result["summary_ms"][b].values())
        # fp32 on the CPU (bf16 on the GPU): the other engines' logits of one verify batch
        for other in ("spec_prefill_tiles", "plain"):
            assert result["agree"][b][other]["same_argmax_fraction"] >= (
                1.0 if not torch.cuda.is_available() else 0.9
            )
    if not torch.cuda.is_available():
        assert {m for row in result["runtime_modes"].values() for m in row.values()} == {"NONE"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_each_row_runs_its_mode(tmp_path):
    result = _run(tmp_path)
    modes = result["runtime_modes"]
    assert modes["verify FULL"] == {"1": "FULL", "3": "FULL"}
    assert modes["verify FULL, prefill tiles"] == {"1": "FULL", "3": "FULL"}
    assert modes["verify PIECEWISE"] == {"1": "PIECEWISE", "3": "PIECEWISE"}
    assert modes["decode FULL"] == {"1": "FULL", "3": "FULL"}
    assert result["spec_capture"]["uniform_decode_query_len"] == 3

"""benchmarks/mla.py: TRITON_MLA's kernel against the reference, and an MLA model's decode
step per backend. CPU: the plumbing under the interpreter; GPU: the rows it exists for."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import mla  # noqa: E402


def test_smoke_times_both_parts_and_the_kernel_agrees(tmp_path):
    out = tmp_path / "mla.json"
    assert mla.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["batch"], r["context"]) for r in result["kernel"]] == [(1, 40), (3, 40)]
    assert all(r["rel_err"] < 1e-5 and r["triton_us"] > 0 for r in result["kernel"])
    (prefill,) = result["prefill"]
    assert (prefill["tokens"], prefill["context"]) == (9, 5)
    assert prefill["rel_err"] < 1e-5 and prefill["reference_ms"] > 0
    backends = {(r["backend"], r["batch"]) for r in result["engine"]}
    assert backends == {(b, n) for b in ("TRITON_MLA", "TORCH_REF_MLA") for n in (1, 3)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_triton_mla_decodes_replay_full_graphs(tmp_path):
    out = tmp_path / "mla.json"
    args = ["--batches", "1,8", "--contexts", "512", "--layers", "2", "--iters", "10"]
    args += ["--prefills", "256", "--prefill-context", "100"]
    assert mla.main([*args, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert all(r["rel_err"] < 2e-2 for r in result["kernel"] + result["prefill"])
    for r in result["engine"]:
        assert r["ran"] == (["FULL"] if r["backend"] == "TRITON_MLA" else ["PIECEWISE"]), r

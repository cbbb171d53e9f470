"""benchmarks/gemv_tiles.py: its chain runs each tiling it sweeps, and every tiling's chain
output stays within bf16 rounding of the base chain's (CPU: the Triton interpreter)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import gemv_tiles  # noqa: E402
from graphattn.kernels.gemv import GemvConfig  # noqa: E402


def test_smoke_sweep_runs_every_tiling(tmp_path):
    out = tmp_path / "tiles.json"
    argv = ["--smoke", "--linears", "o,gate_up", "--base", "qkv=2,32,4,2", "--out", str(out)]
    assert gemv_tiles.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["base_configs"]["qkv"] == GemvConfig(2, 32, 4, 2).label
    for name in ("o", "gate_up"):
        rows = result["sweeps"][name]["rows"]
        assert rows[0].get("base") and len(rows) == 3  # the base and two other tilings
        for row in rows:
            assert "unavailable" not in row, row
            assert row["max_abs_diff"] < 0.05, row  # a few bf16 units of outputs near 1


def test_base_names_must_be_linears():
    assert gemv_tiles.parse_configs("o=4,2048,8,3")["o"] == GemvConfig(4, 2048, 8, 3)
    with pytest.raises(SystemExit, match="unknown linear 'head'"):
        gemv_tiles.parse_configs("head=8,512,2,3")

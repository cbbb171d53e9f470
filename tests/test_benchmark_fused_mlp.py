"""benchmarks/fused_mlp.py: the fused MLP probe's kernel gives the library chain's output
within bf16 rounding for both W_down layouts and every tiling it runs (CPU: the Triton
interpreter), and its tiling option takes only what the kernel can run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import fused_mlp  # noqa: E402


def test_smoke_fused_chain_matches_the_library_chain(tmp_path):
    out = tmp_path / "fused.json"
    assert fused_mlp.main(["--smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    fused = [name for name in rows if name.startswith("fused ")]
    assert {name.split()[1] for name in fused} == {"transposed", "strided"}
    assert len(fused) == 2 * len(fused_mlp.parse_tilings(fused_mlp.SMOKE_TILINGS))
    for name in fused:
        assert "error" not in rows[name], rows[name]
        assert rows[name]["max_abs_diff"][0] < 0.05, (name, rows[name])  # a few bf16 units
    # without the atomic adds the partial sums are not the output: the check can fail
    stores = [name for name in rows if name.startswith("fused_store")]
    assert max(rows[name]["max_abs_diff"][0] for name in stores) > 0.1


def test_tilings_must_be_five_powers_of_two():
    assert fused_mlp.parse_tilings("32,128,256,4,2") == [fused_mlp.Tiling(32, 128, 256, 4, 2)]
    with pytest.raises(SystemExit, match="block_i,block_k,block_r,warps,stages"):
        fused_mlp.parse_tilings("32,128,256")
    with pytest.raises(SystemExit, match="powers of two"):
        fused_mlp.parse_tilings("24,128,256,4,2")

"""benchmarks/pdl_chain.py: its GEMV chain computes the fp32 chain, and (on a Hopper GPU)
the PDL launch computes exactly what the normal launch does."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import pdl_chain  # noqa: E402


def test_smoke_chain_matches_the_fp32_chain(tmp_path):
    out = tmp_path / "pdl.json"
    assert pdl_chain.main(["--smoke", "--out", str(out)]) == 0
    variants = json.loads(out.read_text())["variants"]
    for name in ("library", "library_no_pdl", "chain"):
        assert variants[name]["status"].startswith("ok")
        assert variants[name]["max_abs_err_vs_fp32"] < 0.05  # bf16 rounding of 8 outputs


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a CUDA device with PDL (compute capability >= 9)",
)
def test_pdl_launch_in_a_graph_equals_the_normal_launch():
    """Each checked replay starts from NaN outputs; the control that launches with PDL and
    never waits reads inputs before they are written, so the check can fail."""
    chain = pdl_chain.Chain(4, pdl_chain.LAYER, "cuda", seed=1)
    normal = pdl_chain.time_graph(chain, "chain", 3, "cuda")["output"]
    expected = chain.reference()
    assert (normal - expected).abs().max() < 0.05 * expected.abs().max()
    for variant in pdl_chain.PDL_VARIANTS:
        pdl = pdl_chain.time_graph(chain, variant, 3, "cuda")["output"]
        assert torch.equal(normal, pdl), variant
    library = pdl_chain.time_graph(chain, "library", 3, "cuda")["output"]  # graphattn's PDL
    assert torch.equal(library, pdl_chain.time_graph(chain, "library_no_pdl", 3, "cuda")["output"])
    racy = pdl_chain.time_graph(chain, "chain_pdl_nowait", 3, "cuda")["output"]
    assert not torch.equal(normal, racy)

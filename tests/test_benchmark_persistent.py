"""benchmarks/persistent_chain.py: the persistent kernel computes the fp32 GEMV chain (CPU: the
Triton interpreter, one program), and on a GPU its grid barrier orders the GEMVs: without it
the checked replay from NaN outputs carries NaN, with it the chain is exact to bf16 rounding,
and a grid the SMs cannot hold at once is refused before it is launched. The dataflow kernel
(ready counters instead of barriers) is held to the same checks."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import persistent_chain as pc  # noqa: E402


def test_smoke_chain_matches_the_fp32_chain(tmp_path):
    out = tmp_path / "persistent.json"
    assert pc.main(["--smoke", "--layer-scope", "--out", str(out)]) == 0
    variants = json.loads(out.read_text())["variants"]
    configs = pc.parse_configs(pc.DEFAULT_CONFIGS)
    flow = pc.parse_flow_configs(pc.DEFAULT_FLOW_CONFIGS)
    # library, step and layer, nosync, the dataflow kernel and its run without waits
    assert len(variants) == 1 + 2 * len(configs) + 1 + 2 * len(flow)
    assert sum(name.startswith("flow ") for name in variants) == len(flow)
    for name, entry in variants.items():
        assert entry["status"] == "ok", (name, entry)
        assert entry["max_abs_err_vs_fp32"] < 0.05, (name, entry)  # bf16 rounding of 8 outputs


def test_flow_configs_are_checked():
    (cfg,) = pc.parse_flow_configs("2,8,3,8192")
    assert cfg == pc.Config(2, 8, 3, False, 8192, scope="flow")
    assert cfg.label == "flow 2/w8/s3/t8192/k1/p0/sig0"
    assert pc.parse_flow_configs("4,4,3,4096,4")[0].ksteps == 4
    (cfg,) = pc.parse_flow_configs("4,4,3,4096,4,1,2")
    assert (cfg.ksteps, cfg.poll, cfg.signal) == (4, 1, 2)
    assert pc.parse_flow_configs("") == []
    for bad in ("2,8", "2,8,3,4096,3", "2,8,3,4096,4,3", "2,8,3,4096,4,1,3", "2,6,3", "2,8,3,1,x"):
        with pytest.raises(SystemExit, match=r"--(flow-)?configs"):
            pc.parse_flow_configs(bad)


def test_block_n_splits_rows_evenly_over_the_programs():
    assert pc.block_n(3072, 132) == 8  # 384 tiles: 3 a program at most, 2.9 on average
    assert pc.block_n(2048, 528) == 2  # 8 and 4 give fewer tiles than programs
    assert pc.block_n(3072, 528) == 2  # 4 would give 768 tiles: 2 for some, 1.45 on average
    with pytest.raises(ValueError, match="cannot give each of 600 programs a row"):
        pc.block_n(512, 600)


def test_configs_are_checked():
    (cfg,) = pc.parse_configs("2,8,3,1")
    assert cfg == pc.Config(2, 8, 3, True, pc.TILE_ELEMS, 0)
    assert pc.parse_configs("1,16,4,0,16384,2")[0].poll == 2
    for bad in ("2,8,3", "2,6,3,0", "0,4,3,0", "2,8,3,0,1000", "2,8,3,0,4096,4", "a,b,c,d"):
        with pytest.raises(SystemExit, match="--configs"):
            pc.parse_configs(bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grid_barrier_orders_the_chain():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    chain = pc.Chain(2, pc.LAYER, "cuda", seed=3)
    expected = chain.reference()

    def checked(cfg: pc.Config) -> torch.Tensor:
        variant = pc.Variant(cfg.label, lambda: chain.run_persistent(cfg, sms), chain)
        variant.build("cuda")
        return variant.checked_output("cuda")

    for cfg in (
        pc.Config(4, 4, 3, False),
        pc.Config(3, 4, 3, True, 4096, 1),
        pc.Config(4, 4, 3, False, 4096, 2),
        pc.Config(4, 4, 3, False, 4096, 3),
    ):
        for scope in ("step", "layer"):
            out = checked(dataclasses.replace(cfg, scope=scope))
            assert not out.isnan().any(), (cfg, scope)
            assert (out - expected).abs().max() < 0.05 * expected.abs().max(), (cfg, scope)
    for cfg in pc.parse_flow_configs("4,4,3;4,4,3,4096,4;4,4,3,4096,1,2,2;4,4,3,4096,4,2,2"):
        out = checked(cfg)
        assert not out.isnan().any(), cfg
        assert (out - expected).abs().max() < 0.05 * expected.abs().max(), cfg
    assert chain.err.item() == 0
    assert checked(pc.Config(4, 4, 3, False, sync=False)).isnan().any()  # the check can fail
    flow_nowait = pc.Config(4, 4, 3, False, scope="flow", sync=False)
    assert checked(flow_nowait).isnan().any()  # the counters are what orders the flow kernel
    with pytest.raises(RuntimeError, match="cannot be resident"):
        chain.run_persistent(pc.Config(8, 4, 3, False), sms)  # 3 fit (163 registers)

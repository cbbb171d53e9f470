"""benchmarks/cuda_chain.py: the ring kernel's schedule gives every output row of a GEMV to
exactly one block in whole-row chunks, configs and shapes outside the kernel's limits are
refused, and on a GPU the kernel computes the fp32 chain from NaN-filled outputs (its waits
order the GEMVs: without them the checked replay carries NaN)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import cuda_chain as cc  # noqa: E402


@pytest.mark.parametrize(("n", "k"), [(3072, 2048), (2048, 8192), (16384, 2048), (100, 2048)])
def test_schedule_gives_each_row_to_one_block_in_whole_row_chunks(n, k):
    stage = 16384
    sched = cc.schedule(n, k, 132, stage)
    rows = [r for chunks in sched for first, count in chunks for r in range(first, first + count)]
    assert rows == list(range(n))  # every row once, blocks in order, contiguous shares
    assert all(0 < count <= stage // 2 // k for chunks in sched for _, count in chunks)
    sizes = [sum(c for _, c in chunks) for chunks in sched]
    assert max(sizes) - min(sizes) <= 1  # balanced to a row


def test_configs_and_shapes_are_checked():
    (cfg,) = cc.parse_configs("256,8192,6")
    assert cfg == cc.RingConfig(256, 8192, 6)
    assert cfg.label == "t256/b8192/s6"
    assert cfg.shared_bytes(10) == 6 * 8192 + 4 * 10 * 8 + 16 * 6  # ring, partials, mbarriers
    assert cfg.block_threads == 256 + 32  # and the copy warp
    assert cc.max_chunks(cc.LAYER, 132, 16384) == 32  # gate_up: 125 rows, 4 a chunk
    for bad, match in (
        ("512,16384", "threads,stage_bytes,stages"),
        ("512,16384,8,1", "threads,stage_bytes,stages"),
        ("500,16384,4", "multiple of 32"),
        ("512,4096,4", "multiple of 16 x threads"),
        ("512,16384,1", "stages must be"),
    ):
        with pytest.raises(ValueError, match=match):
            cc.parse_configs(bad)
    cc.check_shapes(cc.LAYER, cc.RingConfig(512, 16384, 4))
    with pytest.raises(ValueError, match="down: K=8192 must divide the stage's 4096 elements"):
        cc.check_shapes(cc.LAYER, cc.RingConfig(512, 8192, 4))  # a down row is 16 KiB
    with pytest.raises(ValueError, match="K=2000"):
        cc.check_shapes([("odd", 64, 2000)], cc.RingConfig())
    with pytest.raises(ValueError, match=r"K=128 .* divides the 32 threads"):
        cc.check_shapes([("narrow", 64, 128)], cc.RingConfig(32, 16384, 2))  # 64 rows a chunk


def test_smoke_prints_the_schedule(capsys):
    assert cc.main(["--smoke"]) == 0
    text = capsys.readouterr().out
    assert "t512/b16384/s13: 215248 B of shared memory" in text
    assert "gate_up 16384x2048: rows a block 124-125" in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ring_kernel_computes_the_chain_and_its_waits_order_it():
    chain = cc.Chain(2, cc.LAYER, "cuda", seed=5)
    expected = chain.reference()
    scale = expected.abs().max()
    for config in (
        cc.RingConfig(512, 16384, 8),
        cc.RingConfig(256, 32768, 3),
        cc.RingConfig(256, 16384, 2),  # the copy warp waits on every slot
        cc.RingConfig(512, 16384, 13),
    ):
        for kind in ("ring", "ring-ll"):
            ring = cc.Ring(chain, config, kind)
            for _ in range(3):  # the counters are back at zero after each launch
                cc.time_graph(ring.run, chain.outs, 2)
                out = chain.outs[-1].float()
                assert not out.isnan().any(), (config, kind)
                assert (out - expected).abs().max() < 0.05 * scale, (config, kind)
            assert ring.err.item() == 0 and ring.ready.eq(0).all() and ring.done[0].item() == 0
            # every launch moves the tag on: 3 x (1 + 5 warm-up + 2 timed + 1 checked) launches
            assert ring.done[1].item() == 27
    racy = cc.Ring(chain, cc.RingConfig(512, 16384, 8), "ring-nosync")
    cc.time_graph(racy.run, chain.outs, 2)
    assert chain.outs[-1].isnan().any()  # the check can fail: without waits NaN comes through

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
    (mma,) = cc.parse_configs("512,16384,11,1")
    assert mma.mma == 1
    assert mma.label == "t512/b16384/s11/mma"
    # 11 padded slots of 8 rows, the bf16 input, 8 partials a warp and group, mbarriers
    assert mma.shared_bytes(16, 8192) == 11 * 8 * (2048 + 64) + 2 * 8192 + 4 * 16 * 16 * 8 + 176
    assert cc.partial_units(cc.LAYER, 132, mma) == 16  # gate_up: 125 rows, 8 a group
    packed = cc.RingConfig(512, 16384, 12, mma=2)
    assert packed.label == "t512/b16384/s12/mma-packed"
    assert packed.shared_bytes(16, 8192) == 12 * 16384 + 2 * 8192 + 4 * 16 * 16 * 8 + 192
    assert cc.partial_units(cc.LAYER, 132, packed) == 16  # 2048 groups: 15 or 16 a block
    with pytest.raises(ValueError, match="N=100 must be a multiple of 8"):
        cc.check_shapes([("odd", 100, 2048)], packed)
    with pytest.raises(ValueError, match="mma must be 0, 1 or 2"):
        cc.RingConfig(mma=3)
    with pytest.raises(ValueError, match="K=1536 must be a multiple of a chunk's 1024 columns"):
        cc.check_shapes([("odd", 64, 1536)], mma)
    assert cc.max_chunks(cc.LAYER, 132, 16384) == 32  # gate_up: 125 rows, 4 a chunk
    for bad, match in (
        ("512,16384", "threads,stage_bytes,stages"),
        ("512,16384,8,3", "threads,stage_bytes,stages"),
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
        cc.RingConfig(512, 16384, 11, mma=1),
        cc.RingConfig(256, 32768, 2, mma=1),  # 4 steps a warp, the copy warp waits often
        cc.RingConfig(512, 16384, 12, mma=2),
        cc.RingConfig(256, 32768, 3, mma=2),
    ):
        for kind, sleep in (
            (("ring", 0),) if config.mma else (("ring", 0), ("ring-ll", 0), ("ring-ll", 100))
        ):
            ring = cc.Ring(chain, config, kind, sleep)
            for _ in range(3):  # the counters are back at zero after each launch
                cc.time_graph(ring.run, chain.outs, 2)
                out = chain.outs[-1].float()
                assert not out.isnan().any(), (config, kind)
                assert (out - expected).abs().max() < 0.05 * scale, (config, kind)
            assert ring.err.item() == 0 and ring.ready.eq(0).all() and ring.done[0].item() == 0
            # every launch moves the tag on: 3 x (1 + 5 warm-up + 2 timed + 1 checked) launches
            assert ring.done[1].item() == 27
    for mma in (0, 1, 2):  # the check can fail: without waits NaN comes through
        racy = cc.Ring(chain, cc.RingConfig(512, 16384, 8, mma), "ring-nosync")
        cc.time_graph(racy.run, chain.outs, 2)
        assert chain.outs[-1].isnan().any(), mma

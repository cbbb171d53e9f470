"""benchmarks/cuda_chain.py: the ring kernel's schedule gives every output row of a GEMV to
exactly one block in whole-row chunks (whole groups of 8 for the packed mma consumer),
configs and shapes outside the kernel's limits are refused, numpy copies of the consumers'
index math (the row consumer's pieces and warps, the mma consumer's m16n8k16 fragments over
``pack``'s layout, the warp consumer's chunk a warp and its slots' owners) compute the
GEMV, and on a GPU the kernel computes the fp32 chain from
NaN-filled outputs (its waits order the GEMVs: without them the checked replay carries NaN;
ring-ll's tagged outputs are poisoned under their stale tags too)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
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
    odd = cc.RingConfig(96, 49152, 2)  # 3 warps: partials rounded up to keep mbarriers 8-aligned
    assert odd.shared_bytes(3) == 2 * 49152 + 4 * 10 + 16 * 2
    assert cfg.block_threads == 256 + 32  # and the copy warp
    (mma,) = cc.parse_configs("512,16384,11,1")
    assert mma.consumer == cc.MMA and mma.mma
    assert mma.label == "t512/b16384/s11/mma"
    # 11 padded slots of 8 rows, the bf16 input, 8 partials a warp and group, mbarriers
    assert mma.shared_bytes(16, 8192) == 11 * 8 * (2048 + 64) + 2 * 8192 + 4 * 16 * 16 * 8 + 176
    assert cc.partial_units(cc.LAYER, 132, mma) == 16  # gate_up: 125 rows, 8 a group
    packed = cc.RingConfig(512, 16384, 12, consumer=cc.MMA_PACKED)
    assert packed.label == "t512/b16384/s12/mma-packed"
    assert packed.shared_bytes(16, 8192) == 12 * 16384 + 2 * 8192 + 4 * 16 * 16 * 8 + 192
    assert cc.partial_units(cc.LAYER, 132, packed) == 16  # 2048 groups: 15 or 16 a block
    with pytest.raises(ValueError, match="N=100 must be a multiple of 8"):
        cc.check_shapes([("odd", 100, 2048)], packed)
    with pytest.raises(ValueError, match="consumer must be 0, 1, 2 or 3"):
        cc.RingConfig(consumer=4)
    (warp,) = cc.parse_configs("384,16384,12,3")  # 12 warps: not 16 bytes x threads a stage
    assert warp.consumer == cc.WARP and not warp.mma
    assert warp.label == "t384/b16384/s12/warp"
    # the ring, two bf16 inputs of the longest K, two mbarriers a stage
    assert warp.shared_bytes(0, 8192) == 12 * 16384 + 4 * 8192 + 16 * 12 <= cc.SHARED_LIMIT
    assert cc.partial_units(cc.LAYER, 132, warp) == 0
    cc.check_shapes(cc.LAYER, warp)
    with pytest.raises(ValueError, match="stages a multiple of its 12 warps"):
        cc.RingConfig(384, 16384, 8, consumer=cc.WARP)  # a slot would change warps
    with pytest.raises(ValueError, match="K=1536 must be a multiple of 512 that divides"):
        cc.check_shapes([("odd", 64, 1536)], warp)
    with pytest.raises(ValueError, match="K=256 must be a multiple of 512"):
        cc.check_shapes([("short", 64, 256)], warp)
    with pytest.raises(ValueError, match="K=1536 must be a multiple of a chunk's 1024 columns"):
        cc.check_shapes([("odd", 64, 1536)], mma)
    assert cc.max_chunks(cc.LAYER, 132, 16384) == 32  # gate_up: 125 rows, 4 a chunk
    for bad, match in (
        ("512,16384", "threads,stage_bytes,stages"),
        ("512,16384,8,4", "threads,stage_bytes,stages"),
        ("500,16384,4", "multiple of 32"),
        ("1024,16384,4", "the copy warp makes"),
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
    with pytest.raises(ValueError, match=r"K=128 .* whole warps of the 32 threads"):
        cc.check_shapes([("narrow", 64, 128)], cc.RingConfig(32, 16384, 2))  # 64 rows a chunk
    with pytest.raises(ValueError, match=r"K=2048 .* whole warps of the 256 threads"):
        cc.check_shapes(cc.LAYER, cc.RingConfig(256, 65536, 3))  # 16 rows: 16 threads a row


@pytest.mark.parametrize(
    ("n", "consumer"), [(3072, cc.MMA), (125, cc.MMA), (16384, cc.MMA_PACKED), (104, cc.MMA_PACKED)]
)
def test_row_groups_give_each_row_to_one_block(n, consumer):
    groups = cc.row_groups(n, 13, consumer)
    rows = [r for block in groups for first, count in block for r in range(first, first + count)]
    assert rows == list(range(n))
    assert all(0 < count <= 8 for block in groups for _, count in block)
    if consumer == cc.MMA_PACKED:  # whole groups, so a packed chunk is one copy
        assert all(first % 8 == 0 and count == 8 for block in groups for first, count in block)


def test_exit_status_holds_only_the_waiting_kinds_to_the_chain():
    ok, wrong = {"correct": True}, {"correct": False}
    assert cc.exit_status({"library": ok, "ring t": ok, "ring-nosync t": wrong}) == 0
    assert cc.exit_status({"ring t": ok, "ring-noinput t": wrong}) == 0
    assert cc.exit_status({"ring-copyonly t": wrong, "ring-ll/sleep50 t": ok}) == 0
    assert cc.exit_status({"library": ok, "ring-ll/sleep50 t": wrong}) == 1
    assert cc.exit_status({"ring t": {"status": "failed"}}) == 1  # no answer is no pass


def _row_consumer(w, x, blocks, config):
    """The row kernel's arithmetic in numpy: block shares, chunks of whole rows, thread t on
    row t // tpr at pieces t % tpr + j * tpr, warp sums, a thread a row at the end."""
    n, k = w.shape
    rows, nw = config.stage_bytes // 2 // k, config.threads // 32
    tpr, passes = config.threads // rows, config.stage_bytes // 16 // config.threads
    y = np.full(n, np.nan)
    for b, chunks in enumerate(cc.schedule(n, k, blocks, config.stage_bytes)):
        r0 = n * b // blocks
        part = np.zeros((len(chunks), nw))
        for c, (first_row, count) in enumerate(chunks):
            acc = np.zeros(config.threads)
            for t in range(config.threads):
                if t // tpr < count:
                    for j in range(passes):
                        p = t % tpr + j * tpr  # a 16-byte piece: 8 columns
                        acc[t] += w[first_row + t // tpr, 8 * p : 8 * p + 8] @ x[8 * p : 8 * p + 8]
            part[c] = acc.reshape(nw, 32).sum(axis=1)
        wpr = tpr // 32
        for i in range(sum(count for _, count in chunks)):
            y[r0 + i] = part[i // rows, (i % rows) * wpr : (i % rows + 1) * wpr].sum()
    return y


def _mma(d, a, b):
    """One mma.sync m16n8k16 (row.col) on per-lane fragments: a[lane] = 4 pairs, b[lane] =
    2 pairs, d[lane] = 4 floats (PTX ISA's fragment layout for .bf16)."""
    am, bm = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = divmod(lane, 4)
        for i, (row, col) in enumerate(
            ((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))
        ):
            am[row, col : col + 2] = a[lane][i]
        bm[2 * t : 2 * t + 2, g], bm[2 * t + 8 : 2 * t + 10, g] = b[lane]
    dm = am @ bm
    for lane in range(32):
        g, t = divmod(lane, 4)
        d[lane] += (dm[g, 2 * t], dm[g, 2 * t + 1], dm[g + 8, 2 * t], dm[g + 8, 2 * t + 1])


def _mma_consumer(w, x, blocks, config):
    """The mma kernel's arithmetic in numpy: 8-row groups, chunks of cols columns, thread
    (g, t) of a warp reading row g at columns c + 8t .. c + 8t + 7 (from ``pack``'s layout
    when packed), two mmas a step with x as A and the weights as B, lanes 0-3's D columns
    summed over the warps. Rows past a group's end are NaN in the slot, as stale data."""
    n, k = w.shape
    nw, cols = config.threads // 32, config.stage_bytes // 16
    steps, per_group = cols // 32 // nw, k // cols
    packed = (
        cc.pack(torch.from_numpy(w), cols).numpy().reshape(-1)
        if config.consumer == cc.MMA_PACKED
        else None
    )
    y = np.full(n, np.nan)
    for groups in cc.row_groups(n, blocks, config.consumer):
        for first_row, count in groups:
            d = np.zeros((nw, 32, 4))
            for cc_ in range(per_group):
                slot = np.full((8, cols), np.nan)
                slot[:count] = w[first_row : first_row + count, cc_ * cols : (cc_ + 1) * cols]
                chunk = first_row // 8 * per_group + cc_  # the packed chunk's index
                for warp in range(nw):
                    for s in range(steps):
                        xs, ws = [], []
                        for lane in range(32):
                            g, t = divmod(lane, 4)
                            c = (warp * steps + s) * 32 + 8 * t
                            if packed is None:
                                ws.append(slot[g, c : c + 8])
                            else:  # ((c / 8) * 8 + g) pieces of 8 into the chunk
                                at = chunk * cols * 8 + ((c // 8) * 8 + g) * 8
                                ws.append(packed[at : at + 8])
                            xs.append(x[cc_ * cols + c : cc_ * cols + c + 8])
                        for h in (0, 4):  # x.x, x.y with w.x, w.y; then x.z, x.w with w.z, w.w
                            a = [
                                (v[h : h + 2], v[h : h + 2], v[h + 2 : h + 4], v[h + 2 : h + 4])
                                for v in xs
                            ]
                            _mma(d[warp], a, [(v[h : h + 2], v[h + 2 : h + 4]) for v in ws])
            rows = d[:, :4, :2].reshape(nw, 8).sum(axis=0)  # lane t: rows 2t, 2t + 1
            y[first_row : first_row + count] = rows[:count]
    return y


def _warp_consumer_chain(gemvs, blocks, config):
    """The warp kernel's arithmetic in numpy over a chain of (w, x) GEMVs: each block's
    running chunk number ``seq`` over the chain, chunk seq to warp seq % W and slot seq % S,
    lane l on pieces l + 64i (first sum) and l + 32 + 64i (second) of each row, then the
    lanes summed. Also checks what the kernel's waits rely on: every use of a slot, over the
    whole chain, goes to one warp, which meets the uses in order (phase by phase)."""
    nw, stages = config.threads // 32, config.stages
    ys = [np.full(w.shape[0], np.nan) for w, _ in gemvs]
    for b in range(blocks):
        seq, owner, seen = 0, {}, {}  # slot -> its warp; slot -> the last use met
        for (w, x), y in zip(gemvs, ys):
            n, k = w.shape
            chunks = cc.schedule(n, k, blocks, config.stage_bytes)[b]
            met = []
            for warp in range(nw):
                for c in range(((warp - seq) % nw + nw) % nw, len(chunks), nw):
                    met.append((seq + c, warp, c))
            for s, warp, c in sorted(met):  # the order the copy warp fills the slots
                slot, use = s % stages, s // stages
                assert owner.setdefault(slot, warp) == warp  # a slot never changes warps
                assert seen.get(slot, use - 1) == use - 1  # its uses, one at a time
                seen[slot] = use
                first_row, count = chunks[c]
                for q in range(count):
                    row = w[first_row + q]
                    lanes = np.zeros((32, 2))
                    for lane in range(32):
                        for p in range(lane, k // 8, 64):
                            for half, piece in ((0, p), (1, p + 32)):
                                cols = slice(8 * piece, 8 * piece + 8)
                                lanes[lane, half] += row[cols] @ x[cols]
                    y[first_row + q] = lanes.sum()
            assert sorted(c for _, _, c in met) == list(range(len(chunks)))  # each chunk once
            seq += len(chunks)
    return ys


@pytest.mark.parametrize(
    ("shapes", "config"),
    [
        ([(300, 512)], cc.RingConfig(64, 4096, 4, consumer=cc.WARP)),  # 4 rows a chunk
        ([(37, 1024), (61, 2048)], cc.RingConfig(96, 4096, 3, consumer=cc.WARP)),  # 1 row
        ([(70, 512), (33, 1024), (90, 512)], cc.RingConfig(128, 8192, 8, consumer=cc.WARP)),
    ],
)
def test_warp_consumer_computes_each_gemv_of_a_chain(shapes, config):
    cc.check_shapes([("t", n, k) for n, k in shapes], config)
    rng = np.random.default_rng(len(shapes))
    gemvs = [(rng.standard_normal((n, k)), rng.standard_normal(k)) for n, k in shapes]
    for (w, x), y in zip(gemvs, _warp_consumer_chain(gemvs, 5, config)):
        np.testing.assert_allclose(y, w @ x, atol=1e-9)


@pytest.mark.parametrize(
    ("n", "k", "config"),
    [
        (300, 256, cc.RingConfig(128, 2048, 2)),  # 4 rows a chunk, 32 threads a row
        (37, 1024, cc.RingConfig(64, 2048, 2)),  # 1 row a chunk, 2 pieces a thread
        (61, 1024, cc.RingConfig(64, 2048, 2, consumer=cc.MMA)),  # a partial last group
        (104, 512, cc.RingConfig(64, 4096, 2, consumer=cc.MMA_PACKED)),
    ],
)
def test_consumers_index_math_computes_the_gemv(n, k, config):
    cc.check_shapes([("t", n, k)], config)
    rng = np.random.default_rng(n)
    w, x = rng.standard_normal((n, k)), rng.standard_normal(k)
    consumer = _mma_consumer if config.mma else _row_consumer
    np.testing.assert_allclose(consumer(w, x, 5, config), w @ x, atol=1e-9)


def test_noinput_kind_is_the_row_consumers_and_drops_its_input_loads():
    row = cc.RingConfig(512, 16384, 13)
    plain = cc.render_source(row, "ring-nosync", 32, 8192, 0)
    noinput = cc.render_source(row, "ring-noinput", 32, 8192, 0)
    assert "#define NOX 0" in plain and "#define NOX 1" in noinput
    assert "#define SYNC 0" in noinput and "#define COMPUTE 1" in noinput
    assert set(cc.ROW_ONLY_KINDS) <= set(cc.KINDS)


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
        cc.RingConfig(512, 16384, 11, consumer=cc.MMA),
        cc.RingConfig(256, 32768, 2, consumer=cc.MMA),  # 8 steps a warp, the copy warp waits
        cc.RingConfig(512, 16384, 12, consumer=cc.MMA_PACKED),
        cc.RingConfig(256, 32768, 3, consumer=cc.MMA_PACKED),
        cc.RingConfig(384, 16384, 12, consumer=cc.WARP),
        cc.RingConfig(128, 16384, 4, consumer=cc.WARP),  # the copy warp waits on every slot
        cc.RingConfig(192, 32768, 6, consumer=cc.WARP),  # 8 rows a chunk at K 2048
    ):
        lone = config.consumer != cc.ROW  # ring-ll has only the row consumer
        for kind, sleep in (
            (("ring", 0),) if lone else (("ring", 0), ("ring-ll", 0), ("ring-ll", 100))
        ):
            ring = cc.Ring(chain, config, kind, sleep)
            for _ in range(3):
                # the checked replay starts from NaN outputs and NaN under ring-ll's old tags
                cc.time_graph(ring.run, chain.outs, 2, ring.poison_tags)
                out = chain.outs[-1].float()
                assert not out.isnan().any(), (config, kind)
                assert (out - expected).abs().max() < 0.05 * scale, (config, kind)
                assert ring.err.item() == 0, (config, kind)  # no wait gave up
                assert ring.ready.eq(0).all(), (config, kind)  # back at zero after each launch
                assert ring.done[0].item() == 0, (config, kind)
            # every launch moves the tag on: 3 x (1 + 5 warm-up + 2 timed + 1 checked) launches
            assert ring.done[1].item() == 27
    # the check can fail: without waits NaN comes through (a race, seen in all ten calls of
    # round 34: the first reads come well before the GEMV before has written)
    for racy_config in (
        cc.RingConfig(512, 16384, 8, cc.ROW),
        cc.RingConfig(512, 16384, 8, cc.MMA),
        cc.RingConfig(512, 16384, 8, cc.MMA_PACKED),
        cc.RingConfig(384, 16384, 12, cc.WARP),
    ):
        racy = cc.Ring(chain, racy_config, "ring-nosync")
        cc.time_graph(racy.run, chain.outs, 2)
        assert chain.outs[-1].isnan().any(), racy_config

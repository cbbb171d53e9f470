"""What a persistent kernel would buy the batch-1 decode step: the step's 64 one-row GEMVs
as graphattn launches them (64 kernels, PDL between them) against one long-lived kernel
that runs them all and waits on a grid-wide barrier between two GEMVs instead of a launch
boundary.

    python benchmarks/persistent_chain.py --out $OUT/persistent_chain.json   # a GPU (~1-2 min)
    TRITON_INTERPRET=1 python benchmarks/persistent_chain.py --smoke         # CPU: the plumbing

Round 23 put the batch-1 step's loss at its 96 kernel boundaries: against the rate the
head's long GEMV reaches, the 16 layers' GEMVs lose 9 us a layer to ramp and drain, and
nothing tried within the boundaries (L2 prefetch, earlier signals, more reads before the PDL
wait, one launch for the MLP) paid. This measures the design that has no boundaries: a
kernel with one program per SM slot, all resident at once, that computes a GEMV, arrives at
a counter in global memory (a release atomic), spins until every program has arrived (an
acquire atomic), and goes on to the next GEMV. What it costs is the barrier; what it saves
is the launch, the ramp of a fresh grid and the drain of the last programs.

The chain is pdl_chain.py's: 16 layers of qkv 3072x2048, o 2048x2048, gate_up 16384x2048,
down 2048x8192 (1.95 GB of bf16 weights, far beyond L2), GEMV i reading the first K outputs
of GEMV i-1. Variants, each a CUDA graph replayed after warm-up (median of CUDA-event
timings), alternated over ``--rounds`` rounds:
- ``library``: ``graphattn.kernels.gemv``, as the step runs it (PDL on Hopper);
- ``step P/wW/sS/tT pre``: one launch for the 64 GEMVs, P programs per SM, W warps, S
  pipeline stages, T weight elements per loop step; ``pre``: each program loads its first tile of the next GEMV's weight between its
  arrival and its wait (the weights are written by nobody, so the tile cannot be stale);
- ``... ld`` / ``asm`` / ``asm1``: the barrier polls with volatile loads, or with a tight
  ``ld.acquire`` loop in inline PTX on every thread / on thread 0 alone (else with acquire
  atomics, which Triton runs on one thread);
- ``layer ...``: one launch a layer (4 GEMVs, 3 barriers; 16 launches);
- ``flow P/wW/sS/tT/kK/pP/sigS``: no barrier; ready counters per 128 output rows, polled by
  each GEMV's first tile for the rows its K step reads (``_flow_stage``; ``--flow-configs``),
  and ``flow-nowait ...`` the same without the polls (a wrong answer, the sync's bound);
- ``nosync ...``: the step kernel without its barriers: a wrong answer (a GEMV reads its
  input before it is written), timed to show what the barriers cost, and the control that
  shows the poisoned-replay check below can fail.
A program owns whole output rows of a GEMV (``BLOCK_N`` of them per tile, tiles dealt out
round-robin) and streams their weight in one software-pipelined loop over all its tiles'
K steps, so the pipeline does not restart at each tile. ``BLOCK_N`` is chosen per GEMV so
the tiles split evenly over the programs. Every variant's output of one more replay,
started with every output set to NaN, is checked against an fp32 reference of the chain.
The kernel here is a measurement, not part of graphattn.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import statistics
import sys
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import attention as ab  # noqa: E402
from benchmarks.pdl_chain import LAYER, SMOKE_LAYER  # noqa: E402  (name, N, K) a layer
from graphattn.kernels.gemv import gemv  # noqa: E402

TILE_ELEMS = 4096  # weight elements a program loads per loop step (8 KiB of bf16)
# polls before a barrier gives up and flags a hang instead of hanging (a real wait is us)
SPIN_LIMIT = tl.constexpr(1 << 17)
MAX_IMBALANCE = 1.07  # most tiles a program gets / the mean, for the BLOCK_N choice
SANE_REL_ERR = 0.05  # largest |chain output - fp32 reference| / largest |reference|
# programs per SM, warps, stages, preload[, tile elements, poll with loads]
DEFAULT_FLOW_CONFIGS = "4,4,3;4,4,3,4096,1,0,2;4,4,3,4096,1,2,2;4,4,3,4096,4,2,2"
DEFAULT_CONFIGS = "4,4,3,0;2,8,3,0,8192;1,16,3,0,16384;3,4,3,1;4,4,3,0,4096,1;4,4,3,0,4096,3"


# A tight poll in PTX: ld.acquire until the count reaches the grid ($2) or the limit ($3).
# FIRST_THREAD: only thread 0 of the program polls; the others return the grid size at once
# and wait at the barrier after it.
def _poll_asm(first_thread: bool) -> str:
    skip = (
        "mov.u32 %t, %tid.x;\nsetp.ne.u32 %p0, %t, 0;\nmov.u32 $0, $2;\n@%p0 bra DONE${:uid};\n"
        if first_thread
        else ""
    )
    return (
        "{\n.reg .pred %pl, %pc, %pw, %p0;\n.reg .u32 %n, %t;\n" + skip + "mov.u32 %n, 0;\n"
        "POLL${:uid}:\nld.acquire.gpu.global.u32 $0, [$1];\nadd.u32 %n, %n, 1;\n"
        "setp.lt.u32 %pl, $0, $2;\nsetp.lt.u32 %pc, %n, $3;\nand.pred %pw, %pl, %pc;\n"
        "@%pw bra POLL${:uid};\nDONE${:uid}:\n}"
    )


_POLL_ASM_ALL = tl.constexpr(_poll_asm(False))
_POLL_ASM_ONE = tl.constexpr(_poll_asm(True))


@triton.jit
def _grid_barrier(sync_ptr, err_ptr, nprog, SYNC: tl.constexpr, POLL: tl.constexpr):
    """Every program of the grid arrives, then waits until all have. One counter per barrier
    (zeroed before the launch): a release add publishes this program's stores, an acquire
    read makes the others' visible. ``POLL``: 0 polls with acquire atomics (Triton runs a
    scalar atomic on one thread and broadcasts it through shared memory); 1 with volatile
    loads and one acquire at the end; 2 with a tight ``ld.acquire`` loop in PTX on every
    thread; 3 the same loop on thread 0 alone."""
    if SYNC:
        tl.debug_barrier()  # this program's threads have all stored
        tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
        spins = 0
        if POLL >= 2:
            seen = tl.inline_asm_elementwise(
                _POLL_ASM_ONE if POLL == 3 else _POLL_ASM_ALL,
                "=r,l,r,r",
                [
                    sync_ptr + tl.zeros([1], dtype=tl.int32),
                    tl.zeros([1], dtype=tl.int32) + nprog,
                    tl.full([1], SPIN_LIMIT, dtype=tl.int32),
                ],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
            if tl.max(seen, axis=0) < nprog:
                tl.atomic_max(err_ptr, 1)
        else:
            if POLL == 1:
                seen = tl.load(sync_ptr, volatile=True)
                while (seen < nprog) & (spins < SPIN_LIMIT):
                    seen = tl.load(sync_ptr, volatile=True)
                    spins += 1
                tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
            else:
                seen = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
                while (seen < nprog) & (spins < SPIN_LIMIT):
                    seen = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
                    spins += 1
            if spins >= SPIN_LIMIT:
                tl.atomic_max(err_ptr, 1)
        tl.debug_barrier()


@triton.jit
def _first_tile(w_ptr, pid, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rows = pid * BN + tl.arange(0, BN)
    return tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + tl.arange(0, BK)[None, :])


@triton.jit
def _gemv_stage(
    x_ptr,
    w_ptr,
    y_ptr,
    pid,
    nprog,
    w_first,  # the program's first weight tile when PRELOADED, else unused
    N: tl.constexpr,
    K: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    STAGES: tl.constexpr,
    PRELOADED: tl.constexpr,
):
    """y[N] = w[N, K] @ x[:K]: this program's tiles pid, pid + nprog, ... of BN rows, all
    their K steps in one pipelined loop."""
    KI: tl.constexpr = K // BK
    my_tiles = (N // BN - pid + nprog - 1) // nprog
    cols = tl.arange(0, BK)
    lane = tl.arange(0, BN)
    acc = tl.zeros([BN], dtype=tl.float32)
    start = 0
    if PRELOADED:
        x = tl.load(x_ptr + cols, cache_modifier=".cg")
        acc = tl.sum(w_first.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        if KI == 1:
            tl.store(y_ptr + pid * BN + lane, acc.to(y_ptr.dtype.element_ty))
            acc = tl.zeros([BN], dtype=tl.float32)
        start = 1
    for it in tl.range(start, my_tiles * KI, num_stages=STAGES):
        rows = (pid + (it // KI) * nprog) * BN + lane
        k0 = (it % KI) * BK
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + k0 + cols[None, :])
        x = tl.load(x_ptr + k0 + cols, cache_modifier=".cg")  # written by other programs: L2
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        last = (it % KI) == KI - 1
        tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=(lane < BN) & last)
        acc = tl.where(last, 0.0, acc)


@triton.jit
def _persistent_chain_kernel(
    x0_ptr,
    wq_ptr,
    wo_ptr,
    wgu_ptr,
    wd_ptr,
    yq_ptr,
    yo_ptr,
    ygu_ptr,
    yd_ptr,
    sync_ptr,  # int32 [barriers], zeroed before the launch
    err_ptr,  # int32 [1]: set when a barrier gave up
    layer_begin,
    layer_end,
    HIDDEN: tl.constexpr,
    QKV: tl.constexpr,
    GATE_UP: tl.constexpr,
    MLP: tl.constexpr,
    BN_Q: tl.constexpr,
    BK_Q: tl.constexpr,
    BN_O: tl.constexpr,
    BK_O: tl.constexpr,
    BN_GU: tl.constexpr,
    BK_GU: tl.constexpr,
    BN_D: tl.constexpr,
    BK_D: tl.constexpr,
    STAGES: tl.constexpr,
    PRELOAD: tl.constexpr,
    SYNC: tl.constexpr,
    POLL: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    w_next = tl.zeros([BN_Q, BK_Q], dtype=wq_ptr.dtype.element_ty)
    if PRELOAD:
        w_next = _first_tile(wq_ptr + layer_begin * QKV * HIDDEN, pid, HIDDEN, BN_Q, BK_Q)
    for layer in range(layer_begin, layer_end):  # int32 offsets: the largest is 0.5e9 here
        x_ptr = yd_ptr + (layer - 1) * HIDDEN  # the layer before's down output
        if layer == 0:
            x_ptr = x0_ptr
        wq = wq_ptr + layer * QKV * HIDDEN
        wo = wo_ptr + layer * HIDDEN * HIDDEN
        wgu = wgu_ptr + layer * GATE_UP * HIDDEN
        wd = wd_ptr + layer * HIDDEN * MLP
        yq = yq_ptr + layer * QKV
        yo = yo_ptr + layer * HIDDEN
        ygu = ygu_ptr + layer * GATE_UP
        yd = yd_ptr + layer * HIDDEN
        bar = sync_ptr + layer * 4
        _gemv_stage(x_ptr, wq, yq, pid, nprog, w_next, QKV, HIDDEN, BN_Q, BK_Q, STAGES, PRELOAD)
        w_o = tl.zeros([BN_O, BK_O], dtype=wo_ptr.dtype.element_ty)
        if PRELOAD:
            w_o = _first_tile(wo, pid, HIDDEN, BN_O, BK_O)
        _grid_barrier(bar, err_ptr, nprog, SYNC, POLL)
        _gemv_stage(yq, wo, yo, pid, nprog, w_o, HIDDEN, HIDDEN, BN_O, BK_O, STAGES, PRELOAD)
        w_gu = tl.zeros([BN_GU, BK_GU], dtype=wgu_ptr.dtype.element_ty)
        if PRELOAD:
            w_gu = _first_tile(wgu, pid, HIDDEN, BN_GU, BK_GU)
        _grid_barrier(bar + 1, err_ptr, nprog, SYNC, POLL)
        _gemv_stage(yo, wgu, ygu, pid, nprog, w_gu, GATE_UP, HIDDEN, BN_GU, BK_GU, STAGES, PRELOAD)
        w_d = tl.zeros([BN_D, BK_D], dtype=wd_ptr.dtype.element_ty)
        if PRELOAD:
            w_d = _first_tile(wd, pid, MLP, BN_D, BK_D)
        _grid_barrier(bar + 2, err_ptr, nprog, SYNC, POLL)
        _gemv_stage(ygu, wd, yd, pid, nprog, w_d, HIDDEN, MLP, BN_D, BK_D, STAGES, PRELOAD)
        if layer + 1 < layer_end:
            if PRELOAD:
                w_next = _first_tile(wq + QKV * HIDDEN, pid, HIDDEN, BN_Q, BK_Q)
            _grid_barrier(bar + 3, err_ptr, nprog, SYNC, POLL)


# The dataflow kernel: a ready counter for every FLOW_GROUP output rows of every GEMV.
FLOW_GROUP = 128  # at most (the gcd of the chain's N with it); a multiple of every BLOCK_N
FLOW_PROBE = 128  # counters one poll can cover: >= the most a GEMV has (16384 / 128)
FLOW_READY = 1 << 20  # the count of the counter row read by the first GEMV: always ready
FLOW_PAD = 32  # int32s from one counter to the next: each on its own 128-byte line


# A poll in PTX, on every thread for its own counter: ld.acquire until the count reaches $2,
# or the limit ($4); a lane with $3 == 0 returns $2 at once. One instruction to the compiler,
# so the K loop around it keeps its software pipelining (a loop in Triton there does not).
_FLOW_POLL_ASM = tl.constexpr(
    "{\n.reg .pred %pi, %pl, %pc;\n.reg .u32 %n;\nsetp.eq.u32 %pi, $3, 0;\nmov.u32 $0, $2;\n"
    "@%pi bra DONE${:uid};\nmov.u32 %n, 0;\nPOLL${:uid}:\nld.acquire.gpu.global.u32 $0, [$1];\n"
    "add.u32 %n, %n, 1;\nsetp.lt.u32 %pl, $0, $2;\nsetp.lt.u32 %pc, %n, $4;\n"
    "and.pred %pl, %pl, %pc;\n@%pl bra POLL${:uid};\nDONE${:uid}:\n}"
)


@triton.jit
def _flow_stage(
    x_ptr,
    w_ptr,
    y_ptr,
    in_cnt,  # the producer's ready counters (its rows in FLOW_GROUPs)
    out_cnt,  # this GEMV's
    err_ptr,
    pid,
    nprog,
    N: tl.constexpr,
    K: tl.constexpr,
    N_IN: tl.constexpr,  # the producer's rows
    BN_IN: tl.constexpr,  # the producer's rows per tile
    BN: tl.constexpr,
    BK: tl.constexpr,
    STAGES: tl.constexpr,
    GROUP: tl.constexpr,
    PROBE: tl.constexpr,
    WAIT: tl.constexpr,
    POLL: tl.constexpr,  # 0: a loop of acquire atomics in Triton; 1: _FLOW_POLL_ASM per lane;
    # 2: a loop of volatile loads, then one acquire atomic
    SIGNAL: tl.constexpr,  # 0: sync + one release add in an if; 1: the same, no if; 2: per row
    PAD: tl.constexpr,  # counter i at in_cnt + i * PAD
):
    """y[N] = w[N, K] @ x[:K] as ``_gemv_stage`` streams it, synchronised by data instead of
    by a barrier. In its first tile this program's K step [k0, k0 + BK) waits until the
    producer's rows [0, (k0 + BK) * N_IN / K) are written: the input as if each of x's values
    came from N_IN / K of the producer's rows, as the model's do (gate and up for one SiLU-mul
    value; q, k and v for an attention output). Later tiles find those counters full. After
    the last K step of each tile it publishes the tile's rows (``SIGNAL``): the program's
    threads sync and one thread adds 1 to the rows' counter with release semantics, or every
    thread that stored a row adds 1 for it."""
    KI: tl.constexpr = K // BK
    FULL: tl.constexpr = GROUP if SIGNAL == 2 else GROUP // BN_IN  # arrivals a counter gets
    my_tiles = (N // BN - pid + nprog - 1) // nprog
    cols = tl.arange(0, BK)
    lane = tl.arange(0, BN)
    probe = tl.arange(0, PROBE)
    acc = tl.zeros([BN], dtype=tl.float32)
    known = 0  # POLL 0: the producer's counters this program has seen full
    short = 0  # POLL 1: polls that gave up
    for it in tl.range(0, my_tiles * KI, num_stages=STAGES):
        tile = pid + (it // KI) * nprog
        rows = tile * BN + lane
        k0 = (it % KI) * BK
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + k0 + cols[None, :])
        need = ((k0 + BK) * N_IN + K * GROUP - 1) // (K * GROUP)
        limit = tl.full([], BK, tl.int32)  # x's load depends on the poll, so it stays after it
        if WAIT and POLL == 1:
            m = (probe < need) & (it < KI)
            seen = tl.inline_asm_elementwise(
                _FLOW_POLL_ASM,
                "=r,l,r,r,r",
                [
                    in_cnt + probe * PAD,
                    tl.full([PROBE], FULL, tl.int32),
                    m.to(tl.int32),
                    tl.full([PROBE], SPIN_LIMIT, tl.int32),
                ],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
            ready = tl.min(seen, axis=0) >= FULL  # every lane's poll, before any thread reads
            limit = tl.where(ready, BK, 0).to(tl.int32)
            short += tl.where(ready, 0, 1)
        if WAIT and POLL == 0 and need > known:
            c = known + probe
            m = c < need
            seen = tl.atomic_add(in_cnt + c * PAD, 0, mask=m, sem="acquire", scope="gpu")
            missing = tl.sum(tl.where(m & (seen < FULL), 1, 0), axis=0)
            spins = 0
            while (missing > 0) & (spins < SPIN_LIMIT):
                seen = tl.atomic_add(in_cnt + c * PAD, 0, mask=m, sem="acquire", scope="gpu")
                missing = tl.sum(tl.where(m & (seen < FULL), 1, 0), axis=0)
                spins += 1
            if missing > 0:
                tl.atomic_max(err_ptr, 1)
            limit = tl.where(missing == 0, BK, 0).to(tl.int32)
            known = need
        if WAIT and POLL == 2 and need > known:
            c = known + probe
            m = c < need
            seen = tl.load(in_cnt + c * PAD, mask=m, other=FULL, volatile=True)
            missing = tl.sum(tl.where(seen < FULL, 1, 0), axis=0)
            spins = 0
            while (missing > 0) & (spins < SPIN_LIMIT):
                seen = tl.load(in_cnt + c * PAD, mask=m, other=FULL, volatile=True)
                missing = tl.sum(tl.where(seen < FULL, 1, 0), axis=0)
                spins += 1
            if missing > 0:
                tl.atomic_max(err_ptr, 1)
            tl.atomic_add(in_cnt, 0, sem="acquire", scope="gpu")  # the others' stores, seen
            limit = tl.where(missing == 0, BK, 0).to(tl.int32)
            known = need
        x = tl.load(x_ptr + k0 + cols, mask=cols < limit, other=0.0, cache_modifier=".cg")
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        last = (it % KI) == KI - 1
        tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=(lane < BN) & last)
        if SIGNAL == 0:
            if last:
                tl.debug_barrier()  # every thread's stores of the tile precede the release
                tl.atomic_add(out_cnt + (tile * BN) // GROUP * PAD, 1, sem="release", scope="gpu")
        elif SIGNAL == 1:
            tl.debug_barrier()
            tl.atomic_add(
                out_cnt + (tile * BN) // GROUP * PAD, 1, mask=last, sem="release", scope="gpu"
            )
        else:  # the thread that stored a row releases it (the store's and the add's layout)
            tl.atomic_add(
                out_cnt + rows // GROUP * PAD,
                1,
                mask=(lane < BN) & last,
                sem="release",
                scope="gpu",
            )
        acc = tl.where(last, 0.0, acc)
    if short > 0:
        tl.atomic_max(err_ptr, 1)


@triton.jit
def _flow_chain_kernel(
    x0_ptr,
    wq_ptr,
    wo_ptr,
    wgu_ptr,
    wd_ptr,
    yq_ptr,
    yo_ptr,
    ygu_ptr,
    yd_ptr,
    cnt_ptr,  # int32 [1 + 4 * layers, PROBE * PAD]: row 0 reads FLOW_READY, the others zeroed
    err_ptr,  # int32 [1]: set when a poll gave up
    layers,
    HIDDEN: tl.constexpr,
    QKV: tl.constexpr,
    GATE_UP: tl.constexpr,
    MLP: tl.constexpr,
    BN_Q: tl.constexpr,
    BK_Q: tl.constexpr,
    BN_O: tl.constexpr,
    BK_O: tl.constexpr,
    BN_GU: tl.constexpr,
    BK_GU: tl.constexpr,
    BN_D: tl.constexpr,
    BK_D: tl.constexpr,
    STAGES: tl.constexpr,
    GROUP: tl.constexpr,
    PROBE: tl.constexpr,
    WAIT: tl.constexpr,
    POLL: tl.constexpr,
    SIGNAL: tl.constexpr,
    PAD: tl.constexpr,
):
    """The chain of ``_persistent_chain_kernel`` with no barrier: each GEMV's K steps wait
    for the producer rows they read (``_flow_stage``), so a program goes on to the next GEMV
    as soon as its own tiles are done, while the other programs finish theirs."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for layer in range(0, layers):
        x_ptr = yd_ptr + (layer - 1) * HIDDEN
        if layer == 0:
            x_ptr = x0_ptr
        cnt = cnt_ptr + (1 + layer * 4) * PROBE * PAD  # this layer's qkv counters; row 0 first
        yq = yq_ptr + layer * QKV
        yo = yo_ptr + layer * HIDDEN
        ygu = ygu_ptr + layer * GATE_UP
        yd = yd_ptr + layer * HIDDEN
        wq = wq_ptr + layer * QKV * HIDDEN
        wo = wo_ptr + layer * HIDDEN * HIDDEN
        wgu = wgu_ptr + layer * GATE_UP * HIDDEN
        wd = wd_ptr + layer * HIDDEN * MLP
        # the first qkv reads row 0 (always full); its N_IN / BN_IN then do not matter
        _flow_stage(x_ptr, wq, yq, cnt - PROBE * PAD, cnt, err_ptr, pid, nprog, QKV, HIDDEN,
                    HIDDEN, BN_D, BN_Q, BK_Q, STAGES, GROUP, PROBE, WAIT, POLL, SIGNAL, PAD)  # fmt: skip
        _flow_stage(yq, wo, yo, cnt, cnt + PROBE * PAD, err_ptr, pid, nprog, HIDDEN, HIDDEN,
                    QKV, BN_Q, BN_O, BK_O, STAGES, GROUP, PROBE, WAIT, POLL, SIGNAL, PAD)  # fmt: skip
        _flow_stage(yo, wgu, ygu, cnt + PROBE * PAD, cnt + 2 * PROBE * PAD, err_ptr, pid, nprog, GATE_UP,
                    HIDDEN, HIDDEN, BN_O, BN_GU, BK_GU, STAGES, GROUP, PROBE, WAIT, POLL, SIGNAL, PAD)  # fmt: skip
        _flow_stage(ygu, wd, yd, cnt + 2 * PROBE * PAD, cnt + 3 * PROBE * PAD, err_ptr, pid, nprog, HIDDEN,
                    MLP, GATE_UP, BN_GU, BN_D, BK_D, STAGES, GROUP, PROBE, WAIT, POLL, SIGNAL, PAD)  # fmt: skip


@dataclass(frozen=True)
class Config:
    per_sm: int  # programs per SM (all must be resident at once)
    warps: int
    stages: int
    preload: bool
    tile: int = TILE_ELEMS  # weight elements a program loads per loop step
    poll: int = 0  # the barrier polls with 0 atomics, 1 loads, 2 / 3 ld.acquire (all / one)
    scope: str = "step"  # "step": one launch; "layer": one launch a layer; "flow": dataflow
    sync: bool = True
    ksteps: int = 1  # flow: at least this many K steps a GEMV (BK <= K / ksteps)
    signal: int = 0  # flow: how a tile is published (_flow_stage's SIGNAL)

    @property
    def label(self) -> str:
        if self.scope == "flow":
            name = "flow" if self.sync else "flow-nowait"
            return (
                f"{name} {self.per_sm}/w{self.warps}/s{self.stages}/t{self.tile}/k{self.ksteps}"
                f"/p{self.poll}/sig{self.signal}"
            )
        name = self.scope if self.sync else "nosync"
        pre = " pre" if self.preload else ""
        poll = ("", " ld", " asm", " asm1")[self.poll]
        return f"{name} {self.per_sm}/w{self.warps}/s{self.stages}/t{self.tile}{pre}{poll}"


def parse_configs(text: str) -> list[Config]:
    """``per_sm,warps,stages,preload[,tile[,poll]];...`` (warps and tile powers of two)."""
    out = []
    for part in filter(None, text.split(";")):
        try:
            fields = [int(v) for v in part.split(",")]
        except ValueError:
            fields = []
        if not 4 <= len(fields) <= 6 or min(fields) < 0:
            raise SystemExit(
                f"--configs: expected per_sm,warps,stages,preload[,tile[,poll]] "
                f"(integers >= 0), got {part!r}"
            )
        per_sm, warps, stages, pre, tile, poll = fields + [TILE_ELEMS, 0][len(fields) - 4 :]
        if (
            per_sm < 1
            or stages < 1
            or warps < 1
            or warps & (warps - 1)
            or tile & (tile - 1)
            or poll > 3
        ):
            raise SystemExit(
                f"--configs: per_sm and stages must be >= 1, warps and tile powers of two, "
                f"poll 0 to 3, got {part!r}"
            )
        out.append(Config(per_sm, warps, stages, bool(pre), tile, poll))
    return out


def parse_flow_configs(text: str) -> list[Config]:
    """``per_sm,warps,stages[,tile[,ksteps[,poll[,signal]]]];...`` for the dataflow kernel
    (ksteps a power of two, poll 0 to 2, signal 0 to 2)."""
    defaults = ["1", "0", "0"]  # ksteps, poll, signal
    out = []
    for part in filter(None, text.split(";")):
        fields = part.split(",")
        given = fields[4:7]
        ksteps, poll, signal = (
            int(v) if v.isdigit() else -1 for v in given + defaults[len(given) :]
        )
        if (
            not 3 <= len(fields) <= 7
            or ksteps < 1
            or ksteps & (ksteps - 1)
            or poll not in (0, 1, 2)
            or signal not in (0, 1, 2)
        ):
            raise SystemExit(
                "--flow-configs: expected per_sm,warps,stages[,tile[,ksteps[,poll[,signal]]]] "
                f"(ksteps a power of two, poll 0-2, signal 0-2), got {part!r}"
            )
        (cfg,) = parse_configs(",".join(fields[:3] + ["0"] + fields[3:4]))
        out.append(dataclasses.replace(cfg, scope="flow", ksteps=ksteps, poll=poll, signal=signal))
    return out


def block_n(n: int, nprog: int) -> int:
    """Rows per tile for an N-row GEMV over nprog programs: the largest of 8, 4, 2, 1 whose
    tiles number at least nprog and split nearly evenly (else the most even)."""
    best, best_ratio = 1, float("inf")
    for bn in (8, 4, 2, 1):
        tiles = n // bn
        if n % bn or tiles < nprog:
            continue
        ratio = -(-tiles // nprog) * nprog / tiles
        if ratio <= MAX_IMBALANCE:
            return bn
        if ratio < best_ratio:
            best, best_ratio = bn, ratio
    if n < nprog:
        raise ValueError(f"a GEMV of {n} rows cannot give each of {nprog} programs a row")
    return best


def resident_per_sm(compiled, warps: int, device: torch.device) -> int:
    """How many programs of a compiled kernel one SM holds at once (registers are allocated
    per warp in units of 256)."""
    props = torch.cuda.get_device_properties(device)
    regs_per_warp = -(-compiled.n_regs * 32 // 256) * 256
    by_regs = props.regs_per_multiprocessor // (regs_per_warp * warps)
    by_threads = props.max_threads_per_multi_processor // (32 * warps)
    shared = compiled.metadata.shared + 1024  # the runtime reserves 1 KiB a block
    by_shared = props.shared_memory_per_multiprocessor // shared
    return min(by_regs, by_threads, by_shared, 32)


class Chain:
    """The 16 layers' weights, stacked per kind, and their outputs."""

    def __init__(self, layers: int, shapes, device: str, seed: int) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        self.layers, self.shapes, self.device = layers, shapes, device
        self.w, self.y = {}, {}
        for name, n, k in shapes:
            w = torch.randn(layers, n, k, generator=gen, device=device) / k**0.5
            self.w[name] = w.to(torch.bfloat16)
            self.y[name] = torch.empty(layers, n, dtype=torch.bfloat16, device=device)
        self.x = torch.randn(shapes[0][2], generator=gen, device=device).to(torch.bfloat16)
        self.bytes = sum(w.numel() * w.element_size() for w in self.w.values())
        self.sync = torch.zeros(layers * 4, dtype=torch.int32, device=device)
        self.flow = torch.zeros(
            1 + layers * 4, FLOW_PROBE * FLOW_PAD, dtype=torch.int32, device=device
        )
        self.err = torch.zeros(1, dtype=torch.int32, device=device)
        self.checked: dict[Config, dict] = {}  # the compiled kernel's resources per config

    @property
    def out(self) -> torch.Tensor:
        return self.y[self.shapes[-1][0]][-1]

    def run_library(self) -> None:
        prev = self.x
        for layer in range(self.layers):
            for name, _, k in self.shapes:
                y = self.y[name][layer]
                gemv(prev[None, :k], self.w[name][layer], y[None, :])
                prev = y

    def run_persistent(self, cfg: Config, num_sms: int) -> None:
        (_, qkv, hidden), _, (_, gate_up, _), (_, _, mlp) = self.shapes
        nprog = num_sms * cfg.per_sm if num_sms > 1 else 1
        tiles = {}
        for name, n, k in self.shapes:
            bn = block_n(n, nprog)
            bk = min(cfg.tile // bn, k // cfg.ksteps)
            if k % bk:
                raise ValueError(f"{name}: K={k} is not a multiple of the tile's {bk}")
            tiles[name] = (bn, bk)
        args = (
            self.x,
            self.w["qkv"],
            self.w["o"],
            self.w["gate_up"],
            self.w["down"],
            self.y["qkv"],
            self.y["o"],
            self.y["gate_up"],
            self.y["down"],
            self.flow if cfg.scope == "flow" else self.sync,
            self.err,
        )
        meta = dict(
            HIDDEN=hidden,
            QKV=qkv,
            GATE_UP=gate_up,
            MLP=mlp,
            BN_Q=tiles["qkv"][0],
            BK_Q=tiles["qkv"][1],
            BN_O=tiles["o"][0],
            BK_O=tiles["o"][1],
            BN_GU=tiles["gate_up"][0],
            BK_GU=tiles["gate_up"][1],
            BN_D=tiles["down"][0],
            BK_D=tiles["down"][1],
            STAGES=cfg.stages,
            num_warps=cfg.warps,
            num_stages=cfg.stages,
        )
        if cfg.scope == "flow":
            group = math.gcd(FLOW_GROUP, *(n for _, n, _ in self.shapes))
            if any(group % bn for bn, _ in tiles.values()) or any(
                n // group > FLOW_PROBE for _, n, _ in self.shapes
            ):
                raise ValueError(f"no counter size fits the tiles {tiles} and {self.shapes}")
            kernel, extra = _flow_chain_kernel, (self.layers,)
            meta |= dict(
                GROUP=group,
                PROBE=FLOW_PROBE,
                WAIT=cfg.sync,
                POLL=0 if nprog == 1 and cfg.poll == 1 else cfg.poll,  # the interpreter: no PTX
                SIGNAL=cfg.signal,
                PAD=FLOW_PAD,
            )
        else:
            kernel, extra = _persistent_chain_kernel, (0, 1)
            meta |= dict(
                PRELOAD=cfg.preload,
                SYNC=cfg.sync,
                POLL=cfg.poll if nprog > 1 else min(cfg.poll, 1),  # the interpreter runs no PTX
            )
        if nprog > 1 and cfg not in self.checked:
            # A program that is not resident never arrives: the others would spin until the
            # limit. Compile without launching and refuse a grid the SMs cannot hold at once.
            compiled = kernel.warmup(*args, *extra, grid=(nprog,), **meta)
            compiled._init_handles()  # loads the module; sets n_regs
            fits = resident_per_sm(compiled, cfg.warps, torch.device(self.device))
            self.checked[cfg] = {
                "regs": compiled.n_regs,
                "shared": compiled.metadata.shared,
                "fits": fits,
                # whether Triton software-pipelined a loop through shared memory
                "async_copies": compiled.asm["ttgir"].count("async_copy_global_to_local"),
                "tiles": tiles,
            }
            if fits < cfg.per_sm:
                raise RuntimeError(
                    f"{cfg.per_sm} programs per SM cannot be resident: {fits} fit "
                    f"({compiled.n_regs} registers a thread, {compiled.metadata.shared} B shared)"
                )
        if cfg.scope == "flow":
            self.flow.zero_()
            self.flow[0].fill_(FLOW_READY)
            kernel[(nprog,)](*args, self.layers, **meta)
            return
        self.sync.zero_()
        spans = (
            [(0, self.layers)] if cfg.scope == "step" else [(i, i + 1) for i in range(self.layers)]
        )
        for begin, end in spans:
            _persistent_chain_kernel[(nprog,)](*args, begin, end, **meta)

    def reference(self) -> torch.Tensor:
        """The chain in fp32 with each output rounded to bf16, as the kernels store it."""
        prev = self.x.float()
        for layer in range(self.layers):
            for name, _, k in self.shapes:
                prev = (self.w[name][layer].float() @ prev[:k]).to(torch.bfloat16).float()
        return prev

    def poison(self) -> None:
        for y in self.y.values():
            y.fill_(float("nan"))


class Variant:
    def __init__(self, label: str, run, chain: Chain) -> None:
        self.label, self.run, self.chain = label, run, chain
        self.graph: torch.cuda.CUDAGraph | None = None

    def build(self, device: str) -> None:
        self.run()  # compile outside the graph
        torch.cuda.synchronize(device)
        if self.chain.err.item():
            self.chain.err.zero_()
            raise RuntimeError("a barrier gave up: not every program arrived")
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.run()
        for _ in range(5):
            self.graph.replay()

    def time(self, reps: int) -> list[float]:
        assert self.graph is not None
        return [ab._event_seconds(self.graph.replay) for _ in range(reps)]

    def checked_output(self, device: str) -> torch.Tensor:
        """One replay from poisoned outputs: a GEMV that read its input before it was
        written carries NaN to the end."""
        self.chain.poison()
        if self.graph is not None:
            self.graph.replay()
        else:
            self.run()
        if device == "cuda":
            torch.cuda.synchronize(device)
        return self.chain.out.float().clone()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one program; no timings")
    p.add_argument("--reps", type=int, default=30, help="timed replays per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help="per_sm,warps,stages,preload[,tile[,poll]];...",
    )
    p.add_argument("--layer-scope", action="store_true", help="also one launch a layer")
    p.add_argument(
        "--flow-configs",
        default=DEFAULT_FLOW_CONFIGS,
        help="the dataflow kernel: per_sm,warps,stages[,tile[,ksteps[,poll[,signal]]]];... "
        "('' for none)",
    )
    p.add_argument("--out", help="JSON path")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    smoke = a.smoke or device == "cpu"
    shapes = SMOKE_LAYER if smoke else LAYER
    chain = Chain(2 if smoke else 16, shapes, device, seed=0)
    # The interpreter runs programs one after another: a second program would never arrive
    # at the first one's barrier, so the smoke run has one program whatever the config says.
    num_sms = 1 if smoke else torch.cuda.get_device_properties(device).multi_processor_count
    expected = chain.reference()
    configs = parse_configs(a.configs)
    if a.layer_scope:
        configs += [dataclasses.replace(c, scope="layer") for c in configs]
    configs.append(dataclasses.replace(configs[0], sync=False))
    flow = parse_flow_configs(a.flow_configs)
    if flow:
        configs += flow + [dataclasses.replace(c, sync=False) for c in flow]

    variants = [Variant("library", chain.run_library, chain)]
    variants += [
        Variant(c.label, lambda c=c: chain.run_persistent(c, num_sms), chain) for c in configs
    ]
    entries: dict[str, dict] = {}
    live = []
    for v in variants:
        try:
            if not smoke:
                v.build(device)
            out = v.checked_output(device)
            err = float((out - expected).abs().max()) if not out.isnan().any() else float("nan")
            rel = err / float(expected.abs().max())
            entries[v.label] = {
                "status": "ok",
                "max_abs_err_vs_fp32": err,
                "rel_err_vs_fp32": rel,
                "times_s": [],
            }
            live.append(v)
            print(f"  built {v.label}: err {err:.4g}", flush=True)
        except Exception as e:  # a variant that cannot run is recorded; the others go on
            entries[v.label] = {"status": f"unavailable: {type(e).__name__}: {e}"[:400]}
            traceback.print_exc()
    hung = bool(chain.err.item())
    if not smoke:
        for _ in range(a.rounds):
            for v in live:
                entries[v.label]["times_s"] += v.time(a.reps)
    for v in live:
        e = entries[v.label]
        if e["times_s"]:
            e["seconds"] = statistics.median(e["times_s"])
            e["TB_per_s"] = chain.bytes / e["seconds"] / 1e12
            e["us_per_gemv"] = e["seconds"] / (chain.layers * len(shapes)) * 1e6
    result = {
        "meta": {
            "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
            "sms": num_sms,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "gemvs": chain.layers * len(shapes),
            "weight_bytes": chain.bytes,
            "smoke": smoke,
            "barrier_gave_up": hung,
            "resources": {c.label: r for c, r in chain.checked.items()},
            "method": __doc__,
        },
        "variants": entries,
    }
    print_table(result)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    bad = [
        k
        for k, e in entries.items()
        if e["status"] == "ok"
        and not k.startswith(("nosync", "flow-nowait"))
        and not e["rel_err_vs_fp32"] <= SANE_REL_ERR
    ]
    return 1 if bad or hung else 0


def print_table(result: dict) -> None:
    m = result["meta"]
    print(
        f"one-row GEMV chain: {m['gemvs']} GEMVs, {m['weight_bytes'] / 1e9:.3f} GB of weights; "
        f"{m['device']} ({m['sms']} SMs), torch {m['torch']}, triton {m['triton']}, {m['date']}"
    )
    if m["barrier_gave_up"]:
        print("  A BARRIER GAVE UP (programs not all resident?): the timings are not valid")
    print(f"  {'variant':22s} {'us/chain':>9s} {'us/GEMV':>8s} {'TB/s':>6s} {'err vs fp32':>12s}")
    for name, e in result["variants"].items():
        if e["status"] != "ok":
            print(f"  {name:22s} {e['status']}")
            continue
        secs = e.get("seconds")
        print(
            f"  {name:22s} {secs * 1e6 if secs else float('nan'):9.1f} "
            f"{e.get('us_per_gemv', float('nan')):8.2f} {e.get('TB_per_s', float('nan')):6.2f} "
            f"{e['max_abs_err_vs_fp32']:12.4g}"
        )


if __name__ == "__main__":
    sys.exit(main())

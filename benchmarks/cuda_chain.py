"""Whether a hand-written CUDA persistent kernel would take the batch-1 step's GEMV chain
below what Triton launches with PDL reach: the step's 64 one-row GEMVs (pdl_chain.py's chain)
as graphattn runs them, against one CUDA kernel whose weight stream does not stop at a GEMV
boundary.

    python benchmarks/cuda_chain.py --out $OUT/cuda_chain.json   # a Hopper GPU (~30 s)
    python benchmarks/cuda_chain.py --smoke                      # CPU: the schedule only

Rounds 24 and 33 measured persistent Triton kernels for this chain: a grid barrier between
two GEMVs (round 24) and ready counters polled per K step (round 33) both cost more than
the 1.1 us of a PDL boundary, because in Triton the wait also stops the weight stream: the
software pipeline lives inside one loop, and a barrier in or between loops drains it.

This kernel keeps the stream going across the wait. One block per SM, all resident. Each
block owns a balanced, contiguous range of output rows of every GEMV, so its share of each
weight is one contiguous byte range, cut into stage-sized chunks of whole rows. One warp
of the block copies: it walks the chunks of all 64 GEMVs in order and copies each into a
ring of ``STAGES`` shared-memory slots with one bulk copy (``cp.async.bulk``, Hopper's TMA
unit) counted on the slot's ``full`` mbarrier, waiting only for the slot's ``empty``
mbarrier. The other threads multiply: they wait for GEMV i-1's last block (a release add
per block and GEMV; thread 0 polls with ``ld.acquire``), load their columns of its output
into registers (through L2, ``ld.global.cg``), and then for each chunk wait on ``full``,
sum a warp's products of it (shuffles) into shared memory and free the slot (one arrival a
warp).
While they wait for GEMV i-1, the copy warp keeps filling the ring with GEMV i's weights.
Once a block's chunks of a GEMV are done, a thread a row adds its warps' partials and
stores the row in bf16. The last block to finish sets the counters back to zero, so every replay
starts clean.

Variants, each a CUDA graph replayed after warm-up (median of CUDA-event timings), in one
process, alternated over ``--rounds``:
- ``library``: ``graphattn.kernels.gemv`` as the step runs it (64 launches, PDL on Hopper);
- ``ring tT/bB/sS``: the kernel above, T multiplying threads a block, S slots of B bytes;
- ``ring-ll[/sleepN] ...``: no counters: each output is also stored as one 32-bit word, its bf16
  bits under the launch's tag (NCCL's low-latency protocol uses the same idea), and each
  thread polls its own input words until all carry the tag, so a GEMV's wait is one read
  of the data it needs instead of a counter read, a barrier and then the data
  (``/sleepN``: the reader sleeps N ns between polls, ``--ll-sleeps``);
- ``ring .../mma``: the same ring, but the products on the tensor cores: a chunk is 8 rows
  x ``B / 16`` columns (one bulk copy a row), and each warp runs ``mma.sync`` m16n8k16 with
  the 8 weight rows as B and the input as A (the same on all 16 rows of A), so D holds the
  8 rows' dot products; the row consumer spends two instructions an element (unpack, FMA)
  and an mma covers 128 weights; ``.../mma-packed``: the same over a copy of the weights
  packed so that each chunk is one contiguous bulk copy (``pack``), with whole groups of
  8 rows a block;
- ``ring .../warp``: the row consumer's chunks, but each chunk is one warp's alone (chunk i
  goes to warp i mod W, and a slot always to the same warp): a warp's wait, loads, products
  and shuffles for one chunk overlap the other warps' chunks, where the row consumer has
  every warp touch every chunk; the input sits in shared memory, double-buffered, and each
  warp signals its own end of a GEMV;
- ``ring-nosync ...``: the same without the waits: a wrong answer (a GEMV reads its input
  before it is written), timed as the bound of what synchronisation costs;
- ``ring-noinput ...``: the row consumer without the waits and without loading each GEMV's
  input (it multiplies by ones): a wrong answer, timed to show what the input loads at each
  GEMV's start cost;
- ``ring-copyonly ...``: without the waits and without the products: what the weight
  stream and the work at each GEMV's end (partials summed, rows stored) cost alone.
Every variant's output of one more replay, started from NaN-filled outputs, is compared
with the fp32 reference of the chain (each output rounded to bf16, as the kernels store it).
The kernel is a measurement, not part of graphattn: the library is Triton, and a CUDA
decode path (attention, norms and rotary in the same kernel) would be a different design.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import sys
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import attention as ab  # noqa: E402
from benchmarks.pdl_chain import LAYER, SMOKE_LAYER, Chain  # noqa: E402

SHARED_LIMIT = 227 * 1024  # an H100/H200 block's opt-in shared memory
MAX_THREADS = 992  # multiplying threads a block: with the copy warp, 1024
DEFAULT_CONFIGS = "512,16384,13;512,16384,12,2;512,16384,8,2;256,16384,12,2;512,32768,6,2"
SMOKE_BLOCKS = 132  # an H100/H200's SMs, for the smoke run's schedule
SANE_REL_ERR = 0.05  # largest |output - fp32 reference| / largest |reference|
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
# ring: the kernel, waiting on a counter a GEMV; ring-ll: waiting on tagged outputs instead;
# ring-nosync: without waits; ring-copyonly: without waits or products (the weight stream and
# the GEMV boundaries' work alone); ring-noinput: the row consumer without waits and without
# loading each GEMV's input (ones instead), so what the input loads cost shows
KINDS = ("ring", "ring-ll", "ring-nosync", "ring-copyonly", "ring-noinput")
ROW_ONLY_KINDS = ("ring-ll", "ring-noinput")

# Device helpers every kernel uses; then _ROWS (whole-row chunks and the copy loop, for the row and
# warp consumers) and each kernel's body (_ROW_BODY, _MMA_BODY, _WARP_BODY).
_HELPERS = r"""
#define NT __THREADS__
#define STAGES __STAGES__
#define STAGE_BYTES __STAGE_BYTES__
#define MAX_CHUNKS __MAX_CHUNKS__
#define SYNC __SYNC__
#define COMPUTE __COMPUTE__
#define NOX __NOX__  /* ring-noinput: no waits, no input loads (the row consumer multiplies by ones) */
#define LL __LL__  /* 1: each output carries the launch's tag; readers poll the data itself */
#define LL_SLEEP __LL_SLEEP__  /* ns between a reader's polls (0: none) */
#define NW (NT / 32)
#define STAGE_ELEMS (STAGE_BYTES / 2)
#define PIECES (STAGE_BYTES / 16)  /* 16-byte pieces (8 bf16) a stage holds */
#define PASSES (PIECES / NT)       /* pieces a thread multiplies per chunk */
#define SPIN_LIMIT (1u << 22)

typedef unsigned int u32;
typedef long long i64;
struct __align__(16) U4 { u32 x, y, z, w; };

__device__ __forceinline__ u32 shared_addr(const void* p) {
    u32 a;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }"
                 : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void bar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void bar_wait(u32 bar, u32 parity) {
    u32 ok;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;"
                     " selp.u32 %0, 1, 0, p; }" : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
    } while (!ok);
}
/* `bar`'s phase completes once `bytes` more have landed (and its one arrival is this). */
__device__ __forceinline__ void expect_bytes(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(bar), "r"(bytes) : "memory");
}
/* A bulk copy (the TMA unit) of `bytes` into shared memory, counted on `bar`. */
__device__ __forceinline__ void copy_bytes(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1], %2, [%3];" :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
/* One bulk copy that completes `bar`'s phase alone. */
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    expect_bytes(bar, bytes);
    copy_bytes(dst, src, bytes, bar);
}
/* The copy warp's chunk `seq` goes to slot seq % STAGES once the slot's previous use has
   been freed (its `empty` mbarrier); returns the slot. */
__device__ __forceinline__ int claim_slot(u32 empty, int seq) {
    const int slot = seq % STAGES, use = seq / STAGES;
    if (use > 0) bar_wait(empty + 8 * slot, (use - 1) & 1);
    return slot;
}
__device__ __forceinline__ void consumers_sync() {  /* the NT threads that multiply */
    asm volatile("bar.sync 1, %0;" :: "n"(NT) : "memory");
}
__device__ __forceinline__ U4 load_shared(u32 addr) {
    U4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ u32 load_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void add_release(u32* p, u32 v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ U4 load_l2(const void* p) {
    U4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ U4 load_relaxed(const void* p) {  /* ring-ll's polls */
    U4 v;
    asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void store_relaxed(u32* p, u32 v) {  /* ring-ll's tagged values */
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ float lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ float dot8(U4 w, const float* x, float acc) {
    acc += lo(w.x) * x[0]; acc += hi(w.x) * x[1]; acc += lo(w.y) * x[2]; acc += hi(w.y) * x[3];
    acc += lo(w.z) * x[4]; acc += hi(w.z) * x[5]; acc += lo(w.w) * x[6]; acc += hi(w.w) * x[7];
    return acc;
}
__device__ __forceinline__ unsigned short to_bf16(float f) {  /* round to nearest even */
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

/* Thread 0 waits until GEMV g's release adds reach `arrivals` (one a block, or one a warp
   of every block); then the consumers' barrier passes the news on. */
__device__ __forceinline__ void wait_for_gemv(const u32* ready, int g, u32 arrivals, u32* err) {
    if (threadIdx.x == 0) {
        u32 spins = 0;
        while (load_acquire(ready + g) < arrivals) {
            if (++spins == SPIN_LIMIT) { atomicExch(err, 1u); break; }
        }
    }
    consumers_sync();
}

/* Row g of the kernel's table: weight, x, y, N, K, tagged x, tagged y. */
struct Gemv {
    const char* w; const char* x; unsigned short* y; const u32* xt; u32* yt; int n, k;
};

__device__ __forceinline__ Gemv gemv_of(const i64* table, int g) {
    const i64* t = table + 7 * g;
    Gemv m;
    m.w = (const char*)t[0];
    m.x = (const char*)t[1];
    m.y = (unsigned short*)t[2];
    m.n = (int)t[3];
    m.k = (int)t[4];
    m.xt = (const u32*)t[5];  /* the input with tags (GEMV g-1's), null for the first */
    m.yt = (u32*)t[6];
    return m;
}

/* This block's balanced share [first, end) of `units` units (rows, or groups of 8 rows). */
struct Range { int first, end; };

__device__ __forceinline__ Range block_range(int units) {
    Range r;
    r.first = (int)((i64)units * blockIdx.x / gridDim.x);
    r.end = (int)((i64)units * (blockIdx.x + 1) / gridDim.x);
    return r;
}

/* The last block out sets the counters back and moves the tag on (done[1] cycles through
   0..65534; a launch's tag is done[1] + 1, never 0, the tagged buffers' first value). */
__device__ __forceinline__ void finish_launch(u32* ready, int num_gemvs, u32* done) {
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(done, 1u) == gridDim.x - 1) {
            for (int g = 0; g < num_gemvs; ++g) ready[g] = 0;
            done[0] = 0;
            done[1] = (done[1] + 1u) % 65535u;
            __threadfence();
        }
    }
}
"""

_ROWS = r"""
/* Block b's rows of GEMV g: [r0, r1), in chunks of `rows` whole rows (k elements each). */
struct Share {
    const char* w; const char* x; unsigned short* y; const u32* xt; u32* yt;
    int k, r0, r1, rows, chunks;
};

__device__ __forceinline__ Share share_of(const i64* table, int g) {
    const Gemv m = gemv_of(table, g);
    const Range range = block_range(m.n);
    Share s;
    s.w = m.w; s.x = m.x; s.y = m.y; s.xt = m.xt; s.yt = m.yt; s.k = m.k;
    s.r0 = range.first;
    s.r1 = range.end;
    s.rows = STAGE_ELEMS / s.k;
    s.chunks = (s.r1 - s.r0 + s.rows - 1) / s.rows;
    return s;
}

/* The copy warp's lane 0: every chunk of the chain in order, one bulk copy each into slot
   seq % STAGES once the slot's previous use has been freed. */
__device__ __forceinline__ void copy_chunks(const i64* table, int num_gemvs, u32 ring,
                                            u32 full, u32 empty) {
    int seq = 0;
    for (int g = 0; g < num_gemvs; ++g) {
        Share sh = share_of(table, g);
        for (int c = 0; c < sh.chunks; ++c, ++seq) {
            const int slot = claim_slot(empty, seq);
            int r = sh.r0 + c * sh.rows;
            u32 bytes = (u32)(min(sh.rows, sh.r1 - r) * sh.k * 2);
            bulk_copy(ring + (u32)slot * STAGE_BYTES, sh.w + (i64)r * sh.k * 2, bytes,
                      full + 8 * slot);
        }
    }
}
"""

_ROW_BODY = r"""
/* Warp NT / 32 copies; threads 0..NT-1 multiply. In a chunk of `rows` rows, thread t works
   on row t / tpr (tpr = NT / rows threads a row), pieces t % tpr + j * tpr of it; a warp's
   threads share a row, so each warp sums its partial of the chunk at once (shuffles) into
   shared memory, and a thread a row adds the warps' partials once the block's chunks of
   the GEMV are done. */
extern "C" __global__ void __launch_bounds__(NT + 32, 1) ring_chain(
    const i64* table,  /* [G, 7]: weight, x, y pointers, N, K, tagged x and y pointers */
    int num_gemvs,
    u32* ready,        /* [G] blocks done with each GEMV, zero at the launch */
    u32* done,         /* [2]: blocks done with the chain, launches so far */
    u32* err)          /* set when a wait gives up */
{
    extern __shared__ __align__(16) char smem[];
    float* part = (float*)(smem + STAGES * STAGE_BYTES);  /* [MAX_CHUNKS][NW] */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid / 32;
    const u32 ring = shared_addr(smem);
    /* [STAGES] mbarriers, 8-byte aligned: the partials rounded up to an even count */
    const u32 full = shared_addr(part + ((MAX_CHUNKS * NW + 1) & ~1));
    const u32 empty = full + 8 * STAGES;                   /* [STAGES] mbarriers */
    /* this launch's tag, 1..65535: the last block of the previous launch moved it on */
    const u32 tag = LL ? load_acquire(done + 1) + 1u : 0u;

    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            bar_init(full + 8 * s, 1);
            bar_init(empty + 8 * s, NT / 32);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (tid >= NT) {  /* the copy warp: every chunk of the chain, up to a ring ahead */
        if (tid == NT) copy_chunks(table, num_gemvs, ring, full, empty);
        return;
    }

    int seq = 0;  /* the sequence number of the chunk multiplied next */
    for (int g = 0; g < num_gemvs; ++g) {
        Share sh = share_of(table, g);
        if (sh.chunks > 0) {
            const int tpr = NT / sh.rows, row_in = tid / tpr, first = tid % tpr;
            if (SYNC && g > 0) wait_for_gemv(ready, g - 1, gridDim.x, err);
            float x[PASSES][8];  /* this thread's columns of the input, the same every chunk */
            #pragma unroll
            for (int j = 0; j < PASSES; ++j) {
                if (LL && sh.xt) {  /* until all 8 values carry this launch's tag */
                    const u32* src = sh.xt + (first + j * tpr) * 8;
                    U4 a, b;
                    for (u32 spins = 0;; ++spins) {
                        a = load_relaxed(src);
                        b = load_relaxed(src + 4);
                        u32 t = (a.x >> 16 == tag) & (a.y >> 16 == tag) & (a.z >> 16 == tag)
                              & (a.w >> 16 == tag) & (b.x >> 16 == tag) & (b.y >> 16 == tag)
                              & (b.z >> 16 == tag) & (b.w >> 16 == tag);
                        if (t) break;
                        if (spins == SPIN_LIMIT) { atomicExch(err, 1u); break; }
                        if (LL_SLEEP) __nanosleep(LL_SLEEP);  /* less traffic on L2 */
                    }
                    x[j][0] = lo(a.x); x[j][1] = lo(a.y); x[j][2] = lo(a.z); x[j][3] = lo(a.w);
                    x[j][4] = lo(b.x); x[j][5] = lo(b.y); x[j][6] = lo(b.z); x[j][7] = lo(b.w);
                } else {
                    U4 v = NOX ? U4{0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u}
                               : load_l2(sh.x + (i64)(first + j * tpr) * 16);
                    x[j][0] = lo(v.x); x[j][1] = hi(v.x); x[j][2] = lo(v.y); x[j][3] = hi(v.y);
                    x[j][4] = lo(v.z); x[j][5] = hi(v.z); x[j][6] = lo(v.w); x[j][7] = hi(v.w);
                }
            }
            const int nrows = sh.r1 - sh.r0;
            for (int c = 0; c < sh.chunks; ++c, ++seq) {
                const int slot = seq % STAGES;
                bar_wait(full + 8 * slot, (seq / STAGES) & 1);
                const u32 row = ring + (u32)slot * STAGE_BYTES + (u32)row_in * sh.k * 2;
                float acc = 0.f;
                if (COMPUTE && c * sh.rows + row_in < nrows) {
                    float a[PASSES];  /* independent sums, added at the end */
                    #pragma unroll
                    for (int j = 0; j < PASSES; ++j)
                        a[j] = dot8(load_shared(row + (first + j * tpr) * 16), x[j], 0.f);
                    #pragma unroll
                    for (int j = 0; j < PASSES; ++j) acc += a[j];
                }
                #pragma unroll
                for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
                if (lane == 0) part[c * NW + warp] = acc;
                __syncwarp();
                if (lane == 0) bar_arrive(empty + 8 * slot);
            }
            consumers_sync();  /* every partial of this GEMV written */
            const int wpr = tpr / 32;  /* a thread a row: its warps' partials */
            for (int i = tid; i < nrows; i += NT) {
                const float* p = part + (i / sh.rows) * NW + (i % sh.rows) * wpr;
                float s = 0.f;
                for (int q = 0; q < wpr; ++q) s += p[q];
                unsigned short v = to_bf16(s);
                sh.y[sh.r0 + i] = v;
                if (LL) store_relaxed(sh.yt + sh.r0 + i, v | (tag << 16));  /* value and flag */
            }
        }
        consumers_sync();  /* every row of this block stored, the partials read */
        if (tid == 0 && !LL) add_release(ready + g, 1u);
    }
    finish_launch(ready, num_gemvs, done);
}
"""


# The tensor-core consumer: chunks of 8 rows x COLS columns (one bulk copy a row), and a
# warp's products as mma.sync m16n8k16 with the weights as B (8 rows = n) and the input as
# A, the same on all 16 rows of m: D[m][n] is then row n's dot product on every m.
_MMA_BODY = r"""
#define COLS (STAGE_BYTES / 16)         /* columns of a chunk: 8 rows of COLS bf16 */
#define PACKED __PACKED__              /* 1: the weights prepacked, a chunk contiguous */
#define PITCH (COLS * 2 + 64)           /* bytes between a slot's rows (spreads the banks) */
#define SLOT (PACKED ? STAGE_BYTES : 8 * PITCH)
#define STEPS (COLS / 32 / NW)          /* 32-column steps of a warp in a chunk */
#define MAX_GROUPS __MAX_GROUPS__
#define MAX_K __MAX_K__

struct Groups {  /* block b's rows [r0, r1) of GEMV g, in groups of 8, each in k / COLS chunks */
    const char* w; const char* x; unsigned short* y; int k, r0, r1, groups, per_group, chunks;
};

__device__ __forceinline__ Groups groups_of(const i64* table, int g) {
    const Gemv m = gemv_of(table, g);
    Groups s;
    s.w = m.w; s.x = m.x; s.y = m.y; s.k = m.k;
    if (PACKED) {  /* whole groups of 8 rows a block */
        const Range range = block_range(m.n / 8);
        s.r0 = range.first * 8;
        s.r1 = range.end * 8;
    } else {
        const Range range = block_range(m.n);
        s.r0 = range.first;
        s.r1 = range.end;
    }
    s.groups = (s.r1 - s.r0 + 7) / 8;
    s.per_group = s.k / COLS;
    s.chunks = s.groups * s.per_group;
    return s;
}

__device__ __forceinline__ void mma_bf16(float* d, u32 a0, u32 a1, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a0), "r"(a1), "r"(a1), "r"(b0), "r"(b1));
}

/* Thread (g = lane / 4, t = lane % 4) of a warp reads 16 bytes of row g of the chunk at
   columns c + 8t .. c + 8t + 7 and the input's same 8 columns: the first 4 are its k slots
   2t, 2t+1, 2t+8, 2t+9 of one mma, the last 4 of a second. Summing over k does not care
   which column sits in which slot as long as A and B agree. */
extern "C" __global__ void __launch_bounds__(NT + 32, 1) ring_chain(
    const i64* table, int num_gemvs, u32* ready, u32* done, u32* err)
{
    extern __shared__ __align__(16) char smem[];
    char* xs = smem + STAGES * SLOT;                         /* [MAX_K] bf16: the input */
    float* part = (float*)(xs + 2 * MAX_K);                  /* [MAX_GROUPS][NW][8] */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid / 32;
    const u32 ring = shared_addr(smem), xsa = shared_addr(xs);
    const u32 full = shared_addr(part + MAX_GROUPS * NW * 8);
    const u32 empty = full + 8 * STAGES;

    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            bar_init(full + 8 * s, 1);
            bar_init(empty + 8 * s, NW);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (tid >= NT) {  /* the copy warp: one bulk copy a row of each chunk, a ring ahead */
        if (tid == NT) {
            int seq = 0;
            for (int g = 0; g < num_gemvs; ++g) {
                Groups sh = groups_of(table, g);
                for (int c = 0; c < sh.chunks; ++c, ++seq) {
                    const int slot = claim_slot(empty, seq);
                    u32 bar = full + 8 * slot, dst = ring + (u32)slot * SLOT;
                    if (PACKED) {  /* chunk (group, column chunk): STAGE_BYTES in a row */
                        const char* src = sh.w + ((i64)(sh.r0 / 8) * sh.per_group + c) * STAGE_BYTES;
                        bulk_copy(dst, src, STAGE_BYTES, bar);
                        continue;
                    }
                    int r = sh.r0 + (c / sh.per_group) * 8, col = (c % sh.per_group) * COLS;
                    int nr = min(8, sh.r1 - r);
                    expect_bytes(bar, (u32)(nr * COLS * 2));  /* one copy a row */
                    for (int i = 0; i < nr; ++i)
                        copy_bytes(dst + i * PITCH, sh.w + ((i64)(r + i) * sh.k + col) * 2,
                                   COLS * 2, bar);
                }
            }
        }
        return;
    }

    const int gq = lane / 4, tq = lane % 4;
    int seq = 0;
    for (int g = 0; g < num_gemvs; ++g) {
        Groups sh = groups_of(table, g);
        if (sh.chunks > 0) {
            if (SYNC && g > 0) wait_for_gemv(ready, g - 1, gridDim.x, err);
            for (int i = tid; i < sh.k / 8; i += NT)  /* the input, once, through L2 */
                *(U4*)(xs + i * 16) = load_l2(sh.x + (i64)i * 16);
            consumers_sync();
            for (int grp = 0; grp < sh.groups; ++grp) {
                float d[4] = {0.f, 0.f, 0.f, 0.f};
                for (int cc = 0; cc < sh.per_group; ++cc, ++seq) {
                    const int slot = seq % STAGES;
                    bar_wait(full + 8 * slot, (seq / STAGES) & 1);
                    if (COMPUTE) {
                        #pragma unroll
                        for (int s = 0; s < STEPS; ++s) {
                            const int c = (warp * STEPS + s) * 32 + 8 * tq;  /* in the chunk */
                            /* packed: [piece of 8 columns][row][8], so a warp's 32 loads
                               are 512 consecutive bytes */
                            const u32 at = PACKED ? ((c / 8) * 8 + gq) * 16 : gq * PITCH + c * 2;
                            U4 w = load_shared(ring + (u32)slot * SLOT + at);
                            U4 x = load_shared(xsa + (cc * COLS + c) * 2);
                            mma_bf16(d, x.x, x.y, w.x, w.y);
                            mma_bf16(d, x.z, x.w, w.z, w.w);
                        }
                    }
                    __syncwarp();
                    if (lane == 0) bar_arrive(empty + 8 * slot);
                }
                if (gq == 0) {  /* lanes 0-3 hold rows 2t and 2t + 1 of the group */
                    part[(grp * NW + warp) * 8 + 2 * tq] = d[0];
                    part[(grp * NW + warp) * 8 + 2 * tq + 1] = d[1];
                }
            }
            consumers_sync();
            for (int i = tid; i < sh.r1 - sh.r0; i += NT) {  /* a thread a row */
                const float* p = part + (i / 8) * NW * 8 + (i % 8);
                float s = 0.f;
                for (int q = 0; q < NW; ++q) s += p[q * 8];
                sh.y[sh.r0 + i] = to_bf16(s);
            }
        }
        consumers_sync();
        if (tid == 0) add_release(ready + g, 1u);
    }
    finish_launch(ready, num_gemvs, done);
}
"""


# The warp consumer: a chunk (the row consumer's: whole rows, one bulk copy) is one warp's
# alone, so a warp's wait, loads, products and sums for one chunk overlap the other warps'
# chunks instead of every warp touching every chunk; rows need no partials across warps.
_WARP_BODY = r"""
#define MAX_K __MAX_K__
#define MAX_ROWS __MAX_ROWS__  /* rows a chunk holds at the chain's smallest K */

/* Chunk seq goes to warp seq % NW and slot seq % STAGES; STAGES is a multiple of NW, so a
   slot always goes to the same warp, which waits for the slot's uses one after another (a
   wait never looks more than one phase of the slot's mbarrier ahead). Lane l multiplies the
   16-byte pieces l, l + 32, ... of each row of the chunk with the same pieces of the input,
   which the block keeps in shared memory, double-buffered: a block loads GEMV g's input
   while its slower warps may still read GEMV g-1's. Each warp signals its own end of a
   GEMV (a release add), so a GEMV is done at NW adds a block. */
extern "C" __global__ void __launch_bounds__(NT + 32, 1) ring_chain(
    const i64* table, int num_gemvs, u32* ready, u32* done, u32* err)
{
    extern __shared__ __align__(16) char smem[];
    char* xs = smem + STAGES * STAGE_BYTES;  /* [2][MAX_K] bf16: the input */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid / 32;
    const u32 ring = shared_addr(smem), xsa = shared_addr(xs);
    const u32 full = xsa + 4 * MAX_K;  /* [STAGES] mbarriers */
    const u32 empty = full + 8 * STAGES;

    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            bar_init(full + 8 * s, 1);
            bar_init(empty + 8 * s, 1);  /* the slot's warp */
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (tid >= NT) {
        if (tid == NT) copy_chunks(table, num_gemvs, ring, full, empty);
        return;
    }

    int seq = 0;  /* the sequence number of this block's first chunk of GEMV g */
    for (int g = 0; g < num_gemvs; ++g) {
        Share sh = share_of(table, g);
        if (SYNC && g > 0) wait_for_gemv(ready, g - 1, gridDim.x * NW, err);
        const u32 xb = xsa + (u32)(g & 1) * 2 * MAX_K;
        for (int i = tid; i < sh.k / 8; i += NT)  /* the input, once, through L2 */
            *(U4*)(xs + (g & 1) * 2 * MAX_K + i * 16) = load_l2(sh.x + (i64)i * 16);
        consumers_sync();
        const int pieces = sh.k / 8;  /* 16-byte pieces a row: a multiple of 64 */
        for (int c = ((warp - seq) % NW + NW) % NW; c < sh.chunks; c += NW) {
            const int s = seq + c, slot = s % STAGES;
            bar_wait(full + 8 * slot, (s / STAGES) & 1);
            const int r = sh.r0 + c * sh.rows, nr = min(sh.rows, sh.r1 - r);
            if (COMPUTE) {
                const u32 base = ring + (u32)slot * STAGE_BYTES;
                float acc[MAX_ROWS][2];  /* two sums a row: pieces p and p + 32 */
                #pragma unroll
                for (int q = 0; q < MAX_ROWS; ++q) acc[q][0] = acc[q][1] = 0.f;
                for (int p = lane; p < pieces; p += 64) {
                    float x0[8], x1[8];
                    const U4 a = load_shared(xb + p * 16), b = load_shared(xb + (p + 32) * 16);
                    x0[0] = lo(a.x); x0[1] = hi(a.x); x0[2] = lo(a.y); x0[3] = hi(a.y);
                    x0[4] = lo(a.z); x0[5] = hi(a.z); x0[6] = lo(a.w); x0[7] = hi(a.w);
                    x1[0] = lo(b.x); x1[1] = hi(b.x); x1[2] = lo(b.y); x1[3] = hi(b.y);
                    x1[4] = lo(b.z); x1[5] = hi(b.z); x1[6] = lo(b.w); x1[7] = hi(b.w);
                    #pragma unroll
                    for (int q = 0; q < MAX_ROWS; ++q) {
                        if (q < nr) {
                            const u32 row = base + (u32)(q * pieces) * 16;
                            acc[q][0] = dot8(load_shared(row + p * 16), x0, acc[q][0]);
                            acc[q][1] = dot8(load_shared(row + (p + 32) * 16), x1, acc[q][1]);
                        }
                    }
                }
                #pragma unroll
                for (int q = 0; q < MAX_ROWS; ++q) {
                    float v = acc[q][0] + acc[q][1];
                    #pragma unroll
                    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                    if (lane == 0 && q < nr) sh.y[r + q] = to_bf16(v);
                }
            }
            __syncwarp();
            if (lane == 0) bar_arrive(empty + 8 * slot);
        }
        seq += sh.chunks;
        __syncwarp();  /* the warp's rows stored before its lane 0 releases them */
        if (lane == 0) add_release(ready + g, 1u);
    }
    consumers_sync();  /* every warp's last add in before the last block resets the counters */
    finish_launch(ready, num_gemvs, done);
}
"""


# The consumers by their config code: 0 the row consumer (_ROW_BODY); 1 the tensor-core
# consumer (_MMA_BODY), a bulk copy a row of a chunk; 2 the same over weights prepacked so
# that a chunk is one contiguous copy; 3 the warp consumer (_WARP_BODY), a chunk a warp.
ROW, MMA, MMA_PACKED, WARP = range(4)
CONSUMER_SUFFIX = ("", "/mma", "/mma-packed", "/warp")


@dataclass(frozen=True)
class RingConfig:
    threads: int = 512
    stage_bytes: int = 16384
    stages: int = 8
    consumer: int = ROW  # ROW, MMA, MMA_PACKED or WARP

    @property
    def mma(self) -> bool:
        """Whether the tensor-core consumer multiplies (chunks of 8 rows)."""
        return self.consumer in (MMA, MMA_PACKED)

    def __post_init__(self) -> None:
        if self.threads % 32 or not 32 <= self.threads <= MAX_THREADS:
            raise ValueError(
                f"threads must be a multiple of 32 in [32, {MAX_THREADS}] (the copy warp makes "
                f"the block 32 more), got {self.threads}"
            )
        if self.consumer != WARP and self.stage_bytes % (16 * self.threads):
            raise ValueError(
                f"stage_bytes must be a multiple of 16 x threads ({16 * self.threads}), "
                f"got {self.stage_bytes}"
            )
        if self.consumer not in (ROW, MMA, MMA_PACKED, WARP):
            raise ValueError(f"consumer must be 0, 1, 2 or 3, got {self.consumer}")
        if self.stages < 2:
            raise ValueError(f"stages must be >= 2, got {self.stages}")
        if self.consumer == WARP and self.stages % (self.threads // 32):
            raise ValueError(
                f"the warp consumer needs stages a multiple of its {self.threads // 32} warps "
                f"(a slot always goes to one warp), got {self.stages}"
            )

    @property
    def label(self) -> str:
        suffix = CONSUMER_SUFFIX[self.consumer]
        return f"t{self.threads}/b{self.stage_bytes}/s{self.stages}{suffix}"

    @property
    def block_threads(self) -> int:
        return self.threads + 32  # and the copy warp

    def shared_bytes(self, max_chunks: int, max_k: int = 0) -> int:
        """The row consumer: the ring, then one fp32 partial per warp of each of a block's
        chunks of one GEMV (``max_chunks`` at most), then two mbarriers a stage. The mma
        consumer (``max_chunks`` counts groups of 8 rows there): the ring of padded 8-row
        slots, the input in bf16, 8 partials per warp and group, the mbarriers. The warp
        consumer: the ring, two bf16 inputs, the mbarriers."""
        warps = self.threads // 32
        if self.consumer == WARP:
            return self.stages * self.stage_bytes + 2 * 2 * max_k + 16 * self.stages
        if self.mma:
            slot = (
                self.stage_bytes
                if self.consumer == MMA_PACKED
                else 8 * (self.stage_bytes // 8 + 64)
            )
            return self.stages * slot + 2 * max_k + 4 * max_chunks * warps * 8 + 16 * self.stages
        partials = max_chunks * warps + (max_chunks * warps) % 2  # even: mbarriers 8-aligned
        return self.stages * self.stage_bytes + 4 * partials + 16 * self.stages


def max_chunks(shapes, blocks: int, stage_bytes: int) -> int:
    """The most chunks a block gets of one GEMV of ``shapes``."""
    return max(len(chunks) for _, n, k in shapes for chunks in schedule(n, k, blocks, stage_bytes))


def partial_units(shapes, blocks: int, config: RingConfig) -> int:
    """What a block keeps partials for, at most, in one GEMV: its chunks (the row
    consumer) or its groups of 8 rows (the mma consumer); the warp consumer keeps none."""
    if config.consumer == WARP:
        return 0
    if not config.mma:
        return max_chunks(shapes, blocks, config.stage_bytes)
    return max(
        len(groups) for _, n, _ in shapes for groups in row_groups(n, blocks, config.consumer)
    )


def row_groups(n: int, blocks: int, consumer: int) -> list[list[tuple[int, int]]]:
    """Each block's groups of up to 8 rows of an N-row GEMV as (first row, rows), as the mma
    kernel cuts them: a balanced range of rows (``MMA``) or of whole groups (``MMA_PACKED``)."""
    out = []
    for b in range(blocks):
        if consumer == MMA_PACKED:
            r0, r1 = (n // 8) * b // blocks * 8, (n // 8) * (b + 1) // blocks * 8
        else:
            r0, r1 = n * b // blocks, n * (b + 1) // blocks
        out.append([(r, min(8, r1 - r)) for r in range(r0, r1, 8)])
    return out


def parse_configs(text: str) -> list[RingConfig]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        fields = [int(f) for f in part.split(",")]
        if len(fields) not in (3, 4) or fields[3:] not in ([], [0], [1], [2], [3]):
            raise ValueError(
                f"a config is threads,stage_bytes,stages[,consumer 0/1/2/3]; got {part!r}"
            )
        out.append(RingConfig(*fields))
    return out


def check_shapes(shapes, config: RingConfig) -> None:
    """The kernel's limits on a GEMV. Row consumer: a stage holds whole rows (K divides its
    elements) and each row gets whole warps (a warp's shuffles sum one row). Mma consumer:
    K is whole chunks of columns, and packing needs whole groups of 8 rows. Warp consumer:
    a stage holds whole rows, of whole 512-column steps (a lane's two 16-byte pieces)."""
    elems = config.stage_bytes // 2
    if config.consumer == WARP:
        for name, _, k in shapes:
            if k <= 0 or k % 512 or elems % k:
                raise ValueError(
                    f"{name}: K={k} must be a multiple of 512 that divides the stage's "
                    f"{elems} elements"
                )
        return
    if config.mma:  # chunks of 8 rows x cols (a multiple of the threads: whole warp steps)
        cols = config.stage_bytes // 16
        for name, n, k in shapes:
            if k % cols:
                raise ValueError(f"{name}: K={k} must be a multiple of a chunk's {cols} columns")
            if config.consumer == MMA_PACKED and n % 8:
                raise ValueError(f"{name}: N={n} must be a multiple of 8 to pack")
        return
    for name, _, k in shapes:
        rows = elems // k if k and not elems % k else 0
        if k % 8 or not rows or config.threads % (32 * rows):
            raise ValueError(
                f"{name}: K={k} must divide the stage's {elems} elements into a number of rows "
                f"that gives each row whole warps of the {config.threads} threads"
            )


def schedule(n: int, k: int, blocks: int, stage_bytes: int) -> list[list[tuple[int, int]]]:
    """Each block's chunks of one GEMV as (first row, rows), as the kernel cuts them."""
    rows = stage_bytes // 2 // k
    out = []
    for b in range(blocks):
        r0, r1 = n * b // blocks, n * (b + 1) // blocks
        out.append([(r, min(rows, r1 - r)) for r in range(r0, r1, rows)])
    return out


class Ring:
    """The compiled kernel for one config, its descriptor table and counters for a chain."""

    def __init__(
        self, chain: Chain, config: RingConfig, kind: str = "ring", ll_sleep: int = 0
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        shapes = [(f"gemv{i}", w.shape[0], w.shape[1]) for i, w in enumerate(chain.weights)]
        check_shapes(shapes, config)
        self.blocks = torch.cuda.get_device_properties().multi_processor_count
        if config.consumer != ROW and kind in ROW_ONLY_KINDS:
            raise ValueError(f"{kind} has only the row consumer")
        max_k = max(k for _, _, k in shapes)
        chunks = partial_units(shapes, self.blocks, config)
        self.shared = config.shared_bytes(chunks, max_k)
        if self.shared > SHARED_LIMIT:
            raise ValueError(f"{config.label} needs {self.shared} B of shared memory")
        max_rows = config.stage_bytes // 2 // min(k for _, _, k in shapes)
        source = render_source(config, kind, chunks, max_k, ll_sleep, max_rows)
        # torch.cuda._compile_kernel (NVRTC, private): present in torch 2.11 (the device
        # machine's, where this ran) and 2.13
        self.kernel = torch.cuda._compile_kernel(source, "ring_chain")
        _allow_shared(self.kernel, self.shared)
        # ring-ll: every output also as (tag << 16 | bf16 bits), the input's the GEMV before's
        self.tagged = [
            torch.zeros(w.shape[0], dtype=torch.int32, device="cuda") for w in chain.weights
        ]
        # mma 2: [group of 8 rows][chunk of cols][8 columns][row][8], a chunk contiguous
        self.packed = [pack(w, config.stage_bytes // 16) if config.consumer == MMA_PACKED else w
                       for w in chain.weights]  # fmt: skip
        rows = [  # the kernel's table: weight, x, y, N, K, tagged x, tagged y
            [self.packed[i].data_ptr(), x.data_ptr(), y.data_ptr(), w.shape[0], w.shape[1],
             self.tagged[i - 1].data_ptr() if i else 0, self.tagged[i].data_ptr()]
            for i, (x, w, y) in enumerate(chain.inputs())
        ]  # fmt: skip
        self.table = torch.tensor(rows, dtype=torch.int64, device="cuda")
        self.ready = torch.zeros(len(rows), dtype=torch.int32, device="cuda")
        self.done = torch.zeros(2, dtype=torch.int32, device="cuda")  # arrivals, launches
        self.err = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.config = config

    def poison_tags(self) -> None:
        """NaN in the tagged outputs' value bits under their last tags: a reader that took
        a stale tag for this launch's would carry NaN to the end."""
        for t in self.tagged:
            t.bitwise_and_(-65536).bitwise_or_(0x7FC0)

    def run(self) -> None:
        self.kernel(
            grid=(self.blocks, 1, 1),
            block=(self.config.block_threads, 1, 1),
            args=[self.table, self.table.shape[0], self.ready, self.done, self.err],
            shared_mem=self.shared,
        )


def render_source(
    config: RingConfig, kind: str, units: int, max_k: int, ll_sleep: int, max_rows: int = 1
) -> str:
    """The CUDA source of one variant: the helpers, the consumer's body, the constants.
    ``units``: the most chunks (row consumer) or groups of 8 rows (mma) a block's GEMV has;
    ``max_rows``: the most rows a chunk holds (the warp consumer's sums)."""
    consts = {
        "__THREADS__": config.threads,
        "__STAGES__": config.stages,
        "__STAGE_BYTES__": config.stage_bytes,
        "__MAX_CHUNKS__": units,
        "__MAX_GROUPS__": units,
        "__MAX_K__": max_k,
        "__SYNC__": int(kind == "ring"),
        "__COMPUTE__": int(kind != "ring-copyonly"),
        "__NOX__": int(kind == "ring-noinput"),
        "__LL__": int(kind == "ring-ll"),
        "__LL_SLEEP__": ll_sleep,
        "__PACKED__": int(config.consumer == MMA_PACKED),
        "__MAX_ROWS__": max_rows,
    }
    body = {ROW: _ROWS + _ROW_BODY, MMA: _MMA_BODY, MMA_PACKED: _MMA_BODY, WARP: _ROWS + _WARP_BODY}
    source = _HELPERS + body[config.consumer]
    for name, value in consts.items():
        source = source.replace(name, str(value))
    return source


def pack(w: torch.Tensor, cols: int) -> torch.Tensor:
    """``w`` [N, K] as [N / 8, K / cols, cols / 8, 8, 8]: groups of 8 rows, chunks of
    ``cols`` columns, and in a chunk each 8 columns of the 8 rows together, so that a warp's
    16-byte loads of 8 rows x 32 columns are 512 consecutive bytes."""
    n, k = w.shape
    return w.view(n // 8, 8, k // cols, cols // 8, 8).permute(0, 2, 3, 1, 4).contiguous()


def _allow_shared(kernel, nbytes: int) -> None:
    """Opt the kernel in to more than 48 KiB of dynamic shared memory."""
    if hasattr(kernel, "set_shared_memory_config"):
        kernel.set_shared_memory_config(nbytes)
        return
    lib = torch.cuda._utils._get_gpu_runtime_library()
    rc = lib.cuFuncSetAttribute(
        kernel.func, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_int(nbytes)
    )
    if rc != 0:
        raise RuntimeError(f"cuFuncSetAttribute(max dynamic shared = {nbytes}) returned {rc}")


def time_graph(run, outs: list[torch.Tensor], reps: int, poison=None) -> dict:
    """Median of ``reps`` replays of a CUDA graph of ``run``; then one more replay from NaN
    outputs (and whatever ``poison`` spoils) for the check."""
    run()  # compile / first launch outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(5):
        graph.replay()
    times = [ab._event_seconds(graph.replay) for _ in range(reps)]
    for y in outs:  # a kernel that read its input before it was written carries NaN
        y.fill_(float("nan"))
    if poison is not None:
        poison()
    graph.replay()
    torch.cuda.synchronize()
    return {"seconds": statistics.median(times), "min_s": min(times)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the schedule only (no GPU)")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="threads,stage_bytes,stages;...")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--kinds", default=",".join(KINDS), help="which of " + ", ".join(KINDS))
    p.add_argument(
        "--ll-sleeps", default="0,100", help="ns a ring-ll reader sleeps between polls; one each"
    )
    p.add_argument("--out", help="JSON path")
    a = p.parse_args(argv)
    configs = parse_configs(a.configs)
    kinds = [k for k in a.kinds.split(",") if k]
    if not kinds or set(kinds) - set(KINDS):
        p.error(f"--kinds takes some of {', '.join(KINDS)}, got {a.kinds!r}")
    sleeps = [int(v) for v in a.ll_sleeps.split(",") if v]
    if a.smoke or not torch.cuda.is_available():
        return _smoke(configs)
    from graphattn.kernels.gemv import gemv

    chain = Chain(a.layers, LAYER, "cuda", seed=0)
    expected = chain.reference()
    scale = float(expected.abs().max())

    def library() -> None:
        for x, w, y in chain.inputs():
            gemv(x[None, :], w, y[None, :])

    variants: dict = {"library": (library, None)}
    result: dict = {"meta": _meta(chain), "variants": {}}
    for config in configs:
        for kind in kinds:
            if config.consumer != ROW and kind in ROW_ONLY_KINDS:
                continue
            for sleep in sleeps if kind == "ring-ll" else [0]:
                name = f"{kind}{f'/sleep{sleep}' if sleep else ''} {config.label}"
                try:
                    ring = Ring(chain, config, kind, sleep)
                    variants[name] = (ring.run, ring)  # the run, and what it checks
                except Exception as e:
                    status = f"unavailable: {type(e).__name__}: {e}"[:400]
                    result["variants"][name] = {"status": status}
                    traceback.print_exc()
    for _ in range(a.rounds):
        for name, entry in variants.items():
            run, ring = entry
            row = result["variants"].setdefault(name, {"status": "ok", "rounds_us": []})
            try:
                timed = time_graph(run, chain.outs, a.reps, ring.poison_tags if ring else None)
            except Exception as e:
                row["status"] = f"failed: {type(e).__name__}: {e}"[:400]
                traceback.print_exc()
                continue
            out = chain.outs[-1].float()
            row["rounds_us"].append(timed["seconds"] * 1e6)
            row["TB_per_s"] = chain.bytes / timed["seconds"] / 1e12
            row["nan"] = bool(out.isnan().any())
            row["rel_err_vs_fp32"] = float((out - expected).abs().max()) / scale
            row["correct"] = not row["nan"] and row["rel_err_vs_fp32"] <= SANE_REL_ERR
            if ring is not None:
                row["wait_gave_up"] = bool(ring.err.item())
                row["shared_bytes"] = ring.shared
    print_table(result)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    return exit_status(result["variants"])


def exit_status(variants: dict) -> int:
    """1 if a variant that waits (the library, ring, ring-ll) missed the fp32 chain; the
    others are wrong by design."""
    waiting = ("library", "ring", "ring-ll")
    synced = [r for n, r in variants.items() if n.split()[0].split("/")[0] in waiting]
    return 0 if all(r.get("correct") for r in synced) else 1


def _smoke(configs: list[RingConfig]) -> int:
    """No GPU: the kernel's schedule for the chain's shapes and the configs' limits."""
    for config in configs:
        check_shapes(LAYER, config)
        chunks = partial_units(LAYER, SMOKE_BLOCKS, config)
        max_k = max(k for _, _, k in LAYER)
        print(f"{config.label}: {config.shared_bytes(chunks, max_k)} B of shared memory")
    for name, n, k in LAYER + SMOKE_LAYER:
        sched = schedule(n, k, SMOKE_BLOCKS, configs[0].stage_bytes if configs else 16384)
        rows = [sum(r for _, r in chunks) for chunks in sched]
        print(f"{name} {n}x{k}: rows a block {min(rows)}-{max(rows)}")
    return 0


def _meta(chain: Chain) -> dict:
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "launches": len(chain.weights),
        "weight_bytes": chain.bytes,
        "method": __doc__,
    }


def print_table(result: dict) -> None:
    meta = result["meta"]
    print(
        f"one-row GEMV chain: {meta['launches']} GEMVs, {meta['weight_bytes'] / 1e9:.3f} GB; "
        f"{meta['device']}, torch {meta['torch']}, {meta['date']}"
    )
    print(f"  {'variant':34s} {'us per round':>24s} {'TB/s':>6s} {'rel err':>9s}  status")
    for name, row in result["variants"].items():
        rounds = " / ".join(f"{u:.1f}" for u in row.get("rounds_us", []))
        print(
            f"  {name:34s} {rounds:>24s} {row.get('TB_per_s', float('nan')):6.2f} "
            f"{row.get('rel_err_vs_fp32', float('nan')):9.2g}  {row['status']}"
            f"{'' if row.get('correct', True) else ' (WRONG)'}"
        )


if __name__ == "__main__":
    sys.exit(main())

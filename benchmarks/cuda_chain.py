"""Whether a hand-written CUDA persistent kernel would take the batch-1 step's GEMV chain
below what Triton launches with PDL reach: the step's 64 one-row GEMVs (pdl_chain.py's chain)
as graphattn runs them, against one CUDA kernel whose weight stream does not stop at a GEMV
boundary.

    python benchmarks/cuda_chain.py --out $OUT/cuda_chain.json   # a CUDA GPU (~1 minute)
    python benchmarks/cuda_chain.py --smoke                      # CPU: the schedule only

Rounds 24 and 33 measured persistent Triton kernels for this chain: a grid barrier between
two GEMVs (round 24) and ready counters polled per K step (round 33) both cost more than
the 1.1 us of a PDL boundary, because in Triton the wait also stops the weight stream: the
software pipeline lives inside one loop, and a barrier in or between loops drains it.

This kernel keeps the stream going across the wait. One block per SM, all resident. Each
block owns a balanced, contiguous range of output rows of every GEMV, so its share of each
weight is one contiguous byte range, cut into stage-sized chunks of whole rows. The block
runs one ring of ``STAGES`` shared-memory buffers over the chunks of all 64 GEMVs in order:
it issues ``cp.async`` copies ``STAGES - 1`` chunks ahead of the chunk it multiplies, so
while it waits for GEMV i-1's last block (a release add per block and GEMV; thread 0 polls
with ``ld.acquire``), the first chunks of GEMV i's weights keep arriving. The rows' input
(GEMV i-1's output, read through L2 with ``ld.global.cg``) goes to shared memory as fp32
once per GEMV. A chunk's products are summed per warp, then per row; the row's thread
stores it in bf16. The last block to finish sets the counters back to zero, so every replay
starts clean.

Variants, each a CUDA graph replayed after warm-up (median of CUDA-event timings), in one
process, alternated over ``--rounds``:
- ``library``: ``graphattn.kernels.gemv`` as the step runs it (64 launches, PDL on Hopper);
- ``ring tT/bB/sS``: the kernel above, T threads a block, B-byte stages, S of them;
- ``ring-nosync ...``: the same without the waits: a wrong answer (a GEMV reads its input
  before it is written), timed as the bound of what synchronisation costs.
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
DEFAULT_CONFIGS = "512,16384,11;512,32768,6;256,16384,11;512,16384,4"
SMOKE_BLOCKS = 132  # an H100/H200's SMs, for the smoke run's schedule
SANE_REL_ERR = 0.05  # largest |output - fp32 reference| / largest |reference|
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8

_SOURCE = r"""
#define NT __THREADS__
#define STAGES __STAGES__
#define STAGE_BYTES __STAGE_BYTES__
#define MAX_K __MAX_K__
#define SYNC __SYNC__
#define STAGE_ELEMS (STAGE_BYTES / 2)
#define PIECES (STAGE_BYTES / 16)  /* 16-byte pieces (8 bf16) a stage holds */
#define PASSES (PIECES / NT)
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
__device__ __forceinline__ void copy16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void wait_ring() {
    asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 2) : "memory");
}
__device__ __forceinline__ u32 load_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ U4 load_l2(const void* p) {
    U4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ float lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ unsigned short to_bf16(float f) {  /* round to nearest even */
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

/* Block b's rows of GEMV g: [r0, r1), in chunks of `rows` whole rows (k elements each). */
struct Share { const char* w; const char* x; unsigned short* y; int k, r0, r1, rows, chunks; };

__device__ __forceinline__ Share share_of(const i64* table, int g) {
    const i64* t = table + 5 * g;
    Share s;
    s.w = (const char*)t[0];
    s.x = (const char*)t[1];
    s.y = (unsigned short*)t[2];
    int n = (int)t[3];
    s.k = (int)t[4];
    s.r0 = (int)((i64)n * blockIdx.x / gridDim.x);
    s.r1 = (int)((i64)n * (blockIdx.x + 1) / gridDim.x);
    s.rows = STAGE_ELEMS / s.k;
    s.chunks = (s.r1 - s.r0 + s.rows - 1) / s.rows;
    return s;
}

extern "C" __global__ void __launch_bounds__(NT, 1) ring_chain(
    const i64* table,  /* [G, 5]: weight, x, y pointers, N, K */
    int num_gemvs,
    u32* ready,        /* [G] blocks done with each GEMV, zero at the launch */
    u32* done,         /* blocks done with the chain */
    u32* err)          /* set when a wait gives up */
{
    extern __shared__ __align__(16) char smem[];
    char* ring = smem;
    float* xs = (float*)(smem + STAGES * STAGE_BYTES);
    float* red = xs + MAX_K;
    const int tid = threadIdx.x, lane = tid & 31;
    const u32 slot0 = shared_addr(ring);

    /* the issue cursor: GEMV ig, chunk ic of it; sequence number is_ */
    int ig = 0, ic = 0, is_ = 0;
    Share isr = share_of(table, 0);
    /* issues the next chunk into its slot (or nothing past the last); always one group */
#define ISSUE()                                                                          \
    {                                                                                    \
        while (ig < num_gemvs && ic >= isr.chunks) {                                     \
            ++ig; ic = 0;                                                                \
            if (ig < num_gemvs) isr = share_of(table, ig);                               \
        }                                                                                \
        if (ig < num_gemvs) {                                                            \
            int r = isr.r0 + ic * isr.rows;                                              \
            int nr = min(isr.rows, isr.r1 - r);                                          \
            const char* src = isr.w + (i64)r * isr.k * 2;                                \
            u32 dst = slot0 + (u32)(is_ % STAGES) * STAGE_BYTES;                         \
            int pieces = nr * isr.k / 8;                                                 \
            for (int p = tid; p < pieces; p += NT) copy16(dst + p * 16, src + (i64)p * 16); \
            ++ic; ++is_;                                                                 \
        }                                                                                \
        commit();                                                                        \
    }
    for (int s = 0; s < STAGES - 1; ++s) ISSUE();

    int cs = 0;  /* the sequence number of the chunk multiplied next */
    for (int g = 0; g < num_gemvs; ++g) {
        Share sh = share_of(table, g);
        if (sh.chunks > 0) {
            if (SYNC && g > 0) {  /* GEMV g-1 complete: every block has added its arrival */
                if (tid == 0) {
                    u32 spins = 0;
                    while (load_acquire(ready + g - 1) < gridDim.x) {
                        if (++spins == SPIN_LIMIT) { atomicExch(err, 1u); break; }
                    }
                }
                __syncthreads();
            }
            for (int i = tid; i < sh.k / 8; i += NT) {
                U4 v = load_l2(sh.x + (i64)i * 16);
                float* d = xs + i * 8;
                d[0] = lo(v.x); d[1] = hi(v.x); d[2] = lo(v.y); d[3] = hi(v.y);
                d[4] = lo(v.z); d[5] = hi(v.z); d[6] = lo(v.w); d[7] = hi(v.w);
            }
            const int row_pieces = sh.k / 8, groups_per_row = sh.k / 256;
            for (int c = 0; c < sh.chunks; ++c, ++cs) {
                wait_ring();
                __syncthreads();  /* this chunk landed for every thread; the slot ISSUE
                                     refills was finished with last iteration; xs written */
                ISSUE();
                const U4* stage = (const U4*)(ring + (cs % STAGES) * STAGE_BYTES);
                int r = sh.r0 + c * sh.rows;
                int nr = min(sh.rows, sh.r1 - r);
                int valid = nr * row_pieces;
                #pragma unroll
                for (int j = 0; j < PASSES; ++j) {
                    int p = tid + j * NT;
                    float acc = 0.f;
                    if (p < valid) {
                        U4 w = stage[p];
                        const float* xv = xs + (p % row_pieces) * 8;
                        acc = lo(w.x) * xv[0] + hi(w.x) * xv[1] + lo(w.y) * xv[2]
                            + hi(w.y) * xv[3] + lo(w.z) * xv[4] + hi(w.z) * xv[5]
                            + lo(w.w) * xv[6] + hi(w.w) * xv[7];
                    }
                    #pragma unroll
                    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
                    if (lane == 0) red[p / 32] = acc;
                }
                __syncthreads();
                if (tid < nr) {
                    float s = 0.f;
                    for (int q = 0; q < groups_per_row; ++q) s += red[tid * groups_per_row + q];
                    sh.y[r + tid] = to_bf16(s);
                }
            }
        }
        __syncthreads();  /* every row of this block stored (and xs read) */
        if (tid == 0) {
            __threadfence();
            atomicAdd(ready + g, 1u);
        }
    }
    if (tid == 0) {  /* the last block out sets the counters back for the next launch */
        __threadfence();
        if (atomicAdd(done, 1u) == gridDim.x - 1) {
            for (int g = 0; g < num_gemvs; ++g) ready[g] = 0;
            *done = 0;
            __threadfence();
        }
    }
}
"""


@dataclass(frozen=True)
class RingConfig:
    threads: int = 512
    stage_bytes: int = 16384
    stages: int = 11

    def __post_init__(self) -> None:
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {self.threads}")
        if self.stage_bytes % (16 * self.threads):
            raise ValueError(
                f"stage_bytes must be a multiple of 16 x threads ({16 * self.threads}), "
                f"got {self.stage_bytes}"
            )
        if self.stages < 2:
            raise ValueError(f"stages must be >= 2, got {self.stages}")

    @property
    def label(self) -> str:
        return f"t{self.threads}/b{self.stage_bytes}/s{self.stages}"

    def shared_bytes(self, max_k: int) -> int:
        return self.stages * self.stage_bytes + 4 * max_k + 4 * (self.stage_bytes // 16 // 32)


def parse_configs(text: str) -> list[RingConfig]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        fields = [int(f) for f in part.split(",")]
        if len(fields) != 3:
            raise ValueError(f"a config is threads,stage_bytes,stages; got {part!r}")
        out.append(RingConfig(*fields))
    return out


def check_shapes(shapes, config: RingConfig) -> None:
    """The kernel's limits on a GEMV: K a multiple of 256 (whole warps of 16-byte pieces
    per row) dividing the stage's elements (whole rows per chunk)."""
    elems = config.stage_bytes // 2
    for name, _, k in shapes:
        if k % 256 or elems % k:
            raise ValueError(
                f"{name}: K={k} must be a multiple of 256 dividing the stage's {elems} elements"
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

    def __init__(self, chain: Chain, config: RingConfig, sync: bool) -> None:
        shapes = [(f"gemv{i}", w.shape[0], w.shape[1]) for i, w in enumerate(chain.weights)]
        check_shapes(shapes, config)
        max_k = max(k for _, _, k in shapes)
        self.shared = config.shared_bytes(max_k)
        if self.shared > SHARED_LIMIT:
            raise ValueError(f"{config.label} needs {self.shared} B of shared memory")
        source = (
            _SOURCE.replace("__THREADS__", str(config.threads))
            .replace("__STAGES__", str(config.stages))
            .replace("__STAGE_BYTES__", str(config.stage_bytes))
            .replace("__MAX_K__", str(max_k))
            .replace("__SYNC__", "1" if sync else "0")
        )
        self.kernel = torch.cuda._compile_kernel(source, "ring_chain")
        _allow_shared(self.kernel, self.shared)
        rows = [  # the kernel's table: weight, x, y, N, K
            [w.data_ptr(), x.data_ptr(), y.data_ptr(), w.shape[0], w.shape[1]]
            for x, w, y in chain.inputs()
        ]
        self.table = torch.tensor(rows, dtype=torch.int64, device="cuda")
        self.ready = torch.zeros(len(rows), dtype=torch.int32, device="cuda")
        self.done = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.err = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.config = config
        self.blocks = torch.cuda.get_device_properties().multi_processor_count

    def run(self) -> None:
        self.kernel(
            grid=(self.blocks, 1, 1),
            block=(self.config.threads, 1, 1),
            args=[self.table, self.table.shape[0], self.ready, self.done, self.err],
            shared_mem=self.shared,
        )


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


def time_graph(run, outs: list[torch.Tensor], reps: int) -> dict:
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
    p.add_argument("--out", help="JSON path")
    a = p.parse_args(argv)
    configs = parse_configs(a.configs)
    if a.smoke or not torch.cuda.is_available():
        return _smoke(configs)
    from graphattn.kernels.gemv import gemv

    chain = Chain(a.layers, LAYER, "cuda", seed=0)
    expected = chain.reference()
    scale = float(expected.abs().max())

    def library() -> None:
        for x, w, y in chain.inputs():
            gemv(x[None, :], w, y[None, :])

    variants: dict = {"library": library}
    result: dict = {"meta": _meta(chain), "variants": {}}
    for config in configs:
        for sync in (True, False):
            name = f"ring{'' if sync else '-nosync'} {config.label}"
            try:
                ring = Ring(chain, config, sync)
                variants[name] = (ring.run, ring)
            except Exception as e:
                result["variants"][name] = {"status": f"unavailable: {type(e).__name__}: {e}"[:400]}
                traceback.print_exc()
    for _ in range(a.rounds):
        for name, entry in variants.items():
            run, ring = entry if isinstance(entry, tuple) else (entry, None)
            row = result["variants"].setdefault(name, {"status": "ok", "rounds_us": []})
            try:
                timed = time_graph(run, chain.outs, a.reps)
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
    synced = [r for n, r in result["variants"].items() if not n.startswith("ring-nosync")]
    return 0 if all(r.get("correct") for r in synced) else 1


def _smoke(configs: list[RingConfig]) -> int:
    """No GPU: the kernel's schedule for the chain's shapes and the configs' limits."""
    for config in configs:
        check_shapes(LAYER, config)
        max_k = max(k for _, _, k in LAYER)
        print(f"{config.label}: {config.shared_bytes(max_k)} B of shared memory")
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

"""What one launch for the whole MLP would buy the batch-1 decode step: the 16 layers'
gate_up and down GEMVs as the step launches them, against one kernel a layer that does both.

    python benchmarks/fused_mlp.py --out $OUT/fused_mlp.json      # a GPU (H200: ~1 minute)
    TRITON_INTERPRET=1 python benchmarks/fused_mlp.py --smoke     # CPU: the plumbing only

At one token a layer's MLP is two launches: ``rms_norm_gemv(..., epilogue="silu_mul")``
(residual add, RMSNorm, the 16384x2048 gate_up GEMV, SiLU-and-multiply) and ``gemv`` over
its product (down, 2048x8192). Round 16's profile put the two at 27.6 us of the step a layer
against the 24.1 their 101 MB need at the copy bandwidth; one launch boundary sits between
them. The fused kernel here splits the MLP's inner dimension instead of down's output: a
program computes ``BLOCK_I`` values of ``silu(gate) * up`` as the library's gate_up does
(same prologue, same roundings), multiplies them at once by the matching ``BLOCK_I``
columns of W_down, and adds its 2048 partial outputs into an fp32 accumulator with relaxed
atomic adds. No program waits for another, so down's weight streams right after gate_up's.
The next layer reads the accumulator (rounded to bf16, as the graph stores down's output).

The costs this measures: 2048 atomic adds a program, a zeroed accumulator a layer (one
memset of all 16 at the chain's start, inside the timed graph), and down's weight read by
column slices (``--down-layout strided``: 64-128-byte pieces of each row of the
nn.Linear weight) or from a transposed copy (``transposed``: each program's rows
contiguous, as a library would have to keep them). fp32 atomic sums are not reproducible
bit for bit from run to run, which a library kernel would have to document; the check here
is the output's distance from the library chain's.

Variants (each a CUDA graph of the 16 layers' launches, PDL as the library decides; median
of ``--reps`` CUDA-event timings of replays after warm-up, the variants alternated over
``--rounds`` rounds): ``library``; ``fused <tiling>`` for each tiling of ``--tilings``;
``fused_store <tiling>``: the same kernel storing its partials to a workspace instead of
adding them (a wrong answer: what the atomics cost). The chain's input is fresh random data
each round. The kernel here is a measurement, not part of graphattn.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import attention as ab  # noqa: E402
from benchmarks.gemv_tiles import ab_meta  # noqa: E402
from graphattn.kernels.gemv import gemv  # noqa: E402
from graphattn.kernels.pdl import launch_options  # noqa: E402
from graphattn.kernels.prologue_gemv import rms_norm_gemv  # noqa: E402

HIDDEN, MLP, LAYERS = 2048, 8192, 16
EPS = 1e-5
SANE_DIFF = 0.1  # largest |fused chain output - library chain output| (outputs ~1-2)
SMOKE = {"hidden": 64, "mlp": 128, "layers": 2}
# block_i, block_k, block_r, num_warps, num_stages
DEFAULT_TILINGS = "32,128,256,4,2;64,64,256,4,2;64,128,256,8,2;16,256,256,4,2;32,128,512,8,3"
SMOKE_TILINGS = "16,32,32,4,1;32,16,64,4,2"


@dataclass(frozen=True)
class Tiling:
    block_i: int  # inner (MLP) columns a program owns: 2 * block_i rows of gate_up
    block_k: int  # gate_up's K tile
    block_r: int  # down's output rows per atomic add
    num_warps: int
    num_stages: int

    @property
    def label(self) -> str:
        return (
            f"i{self.block_i} k{self.block_k} r{self.block_r} w{self.num_warps} s{self.num_stages}"
        )


def parse_tilings(text: str) -> list[Tiling]:
    tilings = []
    for item in filter(None, (t.strip() for t in text.split(";"))):
        try:
            values = [int(v) for v in item.split(",")]
            tiling = Tiling(*values)
        except (TypeError, ValueError):
            raise SystemExit(
                f"--tilings: expected 'block_i,block_k,block_r,warps,stages' items separated "
                f"by ';', got {item!r}"
            ) from None
        if any(v < 1 or v & (v - 1) for v in values[:4]):
            raise SystemExit(
                f"--tilings: block sizes and warps must be powers of two, got {item!r}"
            )
        tilings.append(tiling)
    return tilings


@triton.jit
def _fused_mlp_kernel(
    x_ptr,  # [H] fp32: the previous layer's accumulator (or the chain's input)
    res_ptr,  # [H] bf16 residual
    h_ptr,  # [H] bf16 out: bf16(x) + residual, the next residual (program 0 writes it)
    norm_w_ptr,  # [H]
    gu_ptr,  # [2 N_INNER, H]: gate rows, then up rows
    dw_ptr,  # [H, N_INNER] (the nn.Linear weight) or [N_INNER, H] (DOWN_T)
    acc_ptr,  # [H] fp32, zero on entry (ATOMIC) or the workspace [programs, H]
    H,
    N_INNER,
    eps,
    BLOCK_I: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOWN_T: tl.constexpr,
    ATOMIC: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    inner = pid * BLOCK_I + tl.arange(0, BLOCK_I)  # [BI]; N_INNER is whole programs
    cols = tl.arange(0, BLOCK_K)
    g_ptrs = gu_ptr + inner.to(tl.int64)[:, None] * H + cols[None, :]  # [BI, BK]
    u_ptrs = g_ptrs + tl.cast(N_INNER, tl.int64) * H
    acc_g = tl.zeros([BLOCK_I, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I, BLOCK_K], dtype=tl.float32)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    h_len = tl.where(pid == 0, H, 0)
    dtype = res_ptr.dtype.element_ty
    k_first = 0
    if PDL:  # the first tile's weights before the wait (no kernel writes them)
        wg = tl.load(g_ptrs)
        wu = tl.load(u_ptrs)
        tl.extra.cuda.gdc_wait()
        a, a_sq = _norm_input(x_ptr, res_ptr, h_ptr, norm_w_ptr, cols, h_len, dtype)
        sq += a_sq
        acc_g += wg.to(tl.float32) * a[None, :]
        acc_u += wu.to(tl.float32) * a[None, :]
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
        k_first = BLOCK_K
    for k in tl.range(k_first, H, BLOCK_K, num_stages=STAGES):
        a, a_sq = _norm_input(x_ptr, res_ptr, h_ptr, norm_w_ptr, k + cols, h_len, dtype)
        sq += a_sq
        acc_g += tl.load(g_ptrs).to(tl.float32) * a[None, :]
        acc_u += tl.load(u_ptrs).to(tl.float32) * a[None, :]
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    scale = tl.rsqrt(tl.sum(sq, 0) / H + eps)
    gate = (tl.sum(acc_g, axis=1) * scale).to(dtype).to(tl.float32)
    up = (tl.sum(acc_u, axis=1) * scale).to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    s = (silu * up).to(dtype).to(tl.float32)  # [BI], rounded as the graph stores it
    # down: this program's BLOCK_I columns of W_down times s, BLOCK_R outputs at a time,
    # starting at a row tile of its own so the programs' atomics spread over the accumulator
    rr = tl.arange(0, BLOCK_R)
    tiles = H // BLOCK_R
    first = pid % tiles
    if ATOMIC:
        dst_ptr = acc_ptr
    else:
        dst_ptr = acc_ptr + pid.to(tl.int64) * H
    for t in tl.range(0, tiles, num_stages=STAGES):
        r = ((first + t) % tiles) * BLOCK_R
        if DOWN_T:
            w = tl.load(dw_ptr + inner.to(tl.int64)[:, None] * H + (r + rr)[None, :])  # [BI, BR]
            part = tl.sum(w.to(tl.float32) * s[:, None], axis=0)
        else:
            w = tl.load(
                dw_ptr + (r + rr).to(tl.int64)[:, None] * N_INNER + inner[None, :]
            )  # [BR, BI]
            part = tl.sum(w.to(tl.float32) * s[None, :], axis=1)
        if ATOMIC:
            tl.atomic_add(dst_ptr + r + rr, part, sem="relaxed")
        else:
            tl.store(dst_ptr + r + rr, part)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _norm_input(x_ptr, res_ptr, h_ptr, norm_w_ptr, offs, h_len, dtype: tl.constexpr):
    """One K tile of the GEMV's input: ``h = bf16(x) + residual`` (stored by program 0),
    ``h * norm_w`` in fp32, and ``h^2`` for the row's rsqrt."""
    x = tl.load(x_ptr + offs).to(dtype).to(tl.float32)
    h = (x + tl.load(res_ptr + offs).to(tl.float32)).to(dtype)
    tl.store(h_ptr + offs, h, mask=offs < h_len)
    hf = h.to(tl.float32)
    return hf * tl.load(norm_w_ptr + offs).to(tl.float32), hf * hf


@dataclass
class Layer:
    gate_up: torch.Tensor  # [2 * MLP, H]
    down: torch.Tensor  # [H, MLP]
    down_t: torch.Tensor  # [MLP, H], the same values
    norm: torch.Tensor  # [H]


class Chain:
    """The weights and buffers of ``layers`` MLPs; ``library()`` and ``fused(...)`` launch
    the chain once and return its output."""

    def __init__(self, layers: int, hidden: int, mlp: int, device: str) -> None:
        gen = torch.Generator(device=device).manual_seed(0)
        self.gen = gen

        def rand(*shape: int) -> torch.Tensor:
            fan_in = shape[-1] if len(shape) > 1 else 1
            t = torch.randn(*shape, generator=gen, device=device) / fan_in**0.5
            return t.to(torch.bfloat16)

        self.layers = []
        for _ in range(layers):
            down = rand(hidden, mlp)
            self.layers.append(
                Layer(rand(2 * mlp, hidden), down, down.t().contiguous(), 1 + 0.1 * rand(hidden))
            )
        self.hidden, self.mlp, self.device = hidden, mlp, device
        self.x = torch.empty(1, hidden, dtype=torch.bfloat16, device=device)
        self.x32 = torch.empty(1, hidden, dtype=torch.float32, device=device)  # x, for fused
        self.residual = torch.empty_like(self.x)
        self.refill()
        self.acc = torch.zeros(layers, hidden, dtype=torch.float32, device=device)
        self.workspace: dict[int, torch.Tensor] = {}
        self.bytes = sum((layer.gate_up.numel() + layer.down.numel()) * 2 for layer in self.layers)

    def refill(self) -> None:
        """Fresh random input and residual (bf16 values near 1), in place."""
        self.x.copy_(torch.randn(self.x.shape, generator=self.gen, device=self.device))
        self.residual.copy_(torch.randn(self.x.shape, generator=self.gen, device=self.device))
        self.x32.copy_(self.x)

    def library(self) -> torch.Tensor:
        x, residual = self.x, self.residual
        for layer in self.layers:
            s, residual = rms_norm_gemv(
                x, layer.gate_up, layer.norm, EPS, residual, epilogue="silu_mul"
            )
            x = gemv(s, layer.down)
        return x

    def fused(self, tiling: Tiling, down_t: bool, atomic: bool = True) -> torch.Tensor:
        programs = self.mlp // tiling.block_i
        if (
            self.mlp % tiling.block_i
            or self.hidden % tiling.block_r
            or self.hidden % tiling.block_k
        ):
            raise ValueError(f"tiling {tiling.label} does not divide H={self.hidden}, I={self.mlp}")
        if atomic:
            self.acc.zero_()
            dst = list(self.acc)
        else:
            ws = self.workspace.get(programs)
            if ws is None:
                ws = torch.zeros(programs, self.hidden, dtype=torch.float32, device=self.device)
                self.workspace[programs] = ws
            dst = [ws] * len(self.layers)
        x, residual = self.x32, self.residual
        pdl = launch_options(self.x.device)
        for i, layer in enumerate(self.layers):
            h = torch.empty_like(residual)
            _fused_mlp_kernel[(programs,)](
                x, residual, h, layer.norm, layer.gate_up,
                layer.down_t if down_t else layer.down, dst[i],
                self.hidden, self.mlp, EPS,
                BLOCK_I=tiling.block_i, BLOCK_K=tiling.block_k, BLOCK_R=tiling.block_r,
                DOWN_T=down_t, ATOMIC=atomic, STAGES=tiling.num_stages, PDL=bool(pdl),
                num_warps=tiling.num_warps, num_stages=tiling.num_stages, **pdl,
            )  # fmt: skip
            x = dst[i] if atomic else dst[i][0]
            residual = h
        return x.view(1, -1)  # fp32: the next layer rounds it to bf16 as it reads it


def measure(chain: Chain, run, reps: int, smoke: bool) -> tuple[float | None, torch.Tensor]:
    """A CUDA graph of ``run``'s launches: the median replay seconds and the output of a
    replay on fresh input."""
    out = run()  # compile outside the graph
    if smoke:
        return None, out
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(5):
        graph.replay()
    times = [ab._event_seconds(graph.replay) for _ in range(reps)]
    chain.refill()
    graph.replay()
    torch.cuda.synchronize()
    del graph
    return statistics.median(times), out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes; no timings")
    p.add_argument("--reps", type=int, default=50, help="timed replays per variant and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds over the variants")
    p.add_argument("--tilings", default=None, help=f"default: {DEFAULT_TILINGS!r}")
    p.add_argument("--down-layout", default="transposed,strided",
                   help="which W_down layouts the fused kernel reads")  # fmt: skip
    p.add_argument("--out", help="JSON path")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    smoke = a.smoke or device == "cpu"
    start = time.perf_counter()
    tilings = parse_tilings(a.tilings or (SMOKE_TILINGS if smoke else DEFAULT_TILINGS))
    layouts = [v for v in a.down_layout.split(",") if v]
    if any(v not in ("transposed", "strided") for v in layouts):
        raise SystemExit(f"--down-layout: expected 'transposed' and/or 'strided', got {layouts}")
    if smoke:
        chain = Chain(SMOKE["layers"], SMOKE["hidden"], SMOKE["mlp"], device)
    else:
        chain = Chain(LAYERS, HIDDEN, MLP, device)
    variants = {"library": chain.library}
    for tiling in tilings:
        for layout in layouts:
            t = layout == "transposed"
            variants[f"fused {layout} {tiling.label}"] = lambda tiling=tiling, t=t: chain.fused(
                tiling, t
            )
        t = layouts[0] == "transposed"
        variants[f"fused_store {layouts[0]} {tiling.label}"] = lambda tiling=tiling, t=t: (
            chain.fused(tiling, t, atomic=False)
        )
    rows: dict[str, dict] = {name: {"seconds": [], "max_abs_diff": []} for name in variants}
    for rnd in range(1 if smoke else a.rounds):
        names = list(variants) if rnd % 2 == 0 else list(reversed(variants))
        for name in names:
            try:
                seconds, out = measure(chain, variants[name], a.reps, smoke)
            except Exception as e:  # one variant's failure is a result
                rows[name]["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
                continue
            ref_out = chain.library().float() if name != "library" else out.float()
            rows[name]["seconds"].append(seconds)
            got = out.to(torch.bfloat16).float()
            rows[name]["max_abs_diff"].append(float((got - ref_out).abs().max()))
        print(f"[{time.perf_counter() - start:6.1f}s] round {rnd + 1} done", file=sys.stderr)
    base = rows["library"]["seconds"]
    for row in rows.values():
        timed = [s for s in row["seconds"] if s is not None]
        row["median_s"] = statistics.median(timed) if timed else None
        if timed and base and base[0] is not None:
            row["vs_library_us_per_layer"] = [
                (s - b) * 1e6 / len(chain.layers) for s, b in zip(row["seconds"], base)
            ]
    result = {
        "meta": {**ab_meta(device), "smoke": smoke, "layers": len(chain.layers),
                 "weight_bytes": chain.bytes, "reps": a.reps, "method": __doc__},
        "rows": rows,
    }  # fmt: skip
    print_table(result)
    if a.out:
        result["wall_seconds"] = time.perf_counter() - start
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1, default=str))
    return 0 if all("error" not in r for r in rows.values()) else 1


def print_table(result: dict) -> None:
    meta = result["meta"]
    print(f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['layers']} "
          f"layers of MLP, {meta['weight_bytes'] / 1e6:.0f} MB of weights")  # fmt: skip
    print(
        f"{'variant':48s} {'chain us (rounds)':>30s} {'TB/s':>6s} {'us/layer vs library':>22s} diff"
    )
    for name, row in result["rows"].items():
        if "error" in row:
            print(f"{name:48s} error: {row['error']}")
            continue
        secs = [s for s in row["seconds"] if s is not None]
        chain = " / ".join(f"{s * 1e6:.1f}" for s in secs) or "-"
        med = row["median_s"]
        tbps = f"{meta['weight_bytes'] / med / 1e12:.2f}" if med else "-"
        delta = row.get("vs_library_us_per_layer")
        delta_s = " / ".join(f"{d:+.2f}" for d in delta) if delta else "-"
        diff = max(row["max_abs_diff"]) if row["max_abs_diff"] else None
        print(f"{name:48s} {chain:>30s} {tbps:>6s} {delta_s:>22s} {diff}")


if __name__ == "__main__":
    sys.exit(main())

"""The decode step's small fused kernels against what they replace, on Llama-3.2-1B's shapes.

    python benchmarks/fused_ops.py --out $OUT/fused_ops.json      # a GPU (under a minute)
    TRITON_INTERPRET=1 python benchmarks/fused_ops.py --smoke     # CPU, interpreter: no results

1. Prologue GEMVs (``graphattn/kernels/prologue_gemv.py``, one row, bf16): per linear,
   the plain Triton ``gemv``, cuBLAS, the unfused pair the graph would run (the op before
   the linear compiled by Inductor into one kernel, then ``gemv``) and the fused kernel:
   - qkv 3072x2048 and gate_up 16384x2048 after residual add + RMSNorm (``rms_norm_gemv``);
   - down 2048x8192 after SiLU-and-multiply (``silu_mul_gemv``);
   - gate_up also with the SiLU-and-multiply after it: the fused norm GEMV then Inductor's
     SiLU-mul kernel (the step up to round 7) against the GEMV with the SiLU-mul epilogue
     (``rms_norm_gemv(..., epilogue="silu_mul")``).
2. Greedy sampling over [B, 128256] bf16 logits, B = 1, 8, 32, 128: ``torch.argmax`` and
   ``graphattn.greedy`` (the Triton ``kernels.argmax`` on CUDA).

Timing: ``benchmarks/attention.time_rotating``, a CUDA graph of 256 calls (the same for
every variant) over input sets of fresh random values, replayed after warm-up; per-call
time = median replay / 256. The linears' weight copies total at least twice the L2 cache,
so no call finds its weight there; the argmax rotates 8 logits tensors, which fit in L2
for B <= 8 (2-16 MB), as logits fresh from the head would. Each call in the graph runs
after the one before, so a removed launch shows as its kernel time plus its gap.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import attention as ab  # noqa: E402

DTYPE = torch.bfloat16
EPS = 1e-5
LINEARS = {"qkv": (3072, 2048, "norm"), "gate_up": (16384, 2048, "norm"), "down": (2048, 8192, "silu")}  # fmt: skip
SMOKE_LINEARS = {"qkv": (48, 64, "norm"), "down": (40, 96, "silu")}
VOCAB, SMOKE_VOCAB = 128256, 300
ROWS, SMOKE_ROWS = (1, 8, 32, 128), (1, 3)
GRAPH_CALLS = 256  # calls per graph replay, the same for every variant (~1-10 ms a replay)


def add_rms_norm(x, residual, norm_weight):
    """A Llama decoder layer's residual add + RMSNorm, as the model writes it."""
    h = x + residual
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight.float()
    return normed.to(x.dtype), h


def silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate.float()).to(gate.dtype) * up


def linear_rows(device, smoke: bool, reps: int, l2: int) -> list[dict]:
    compiled_norm = torch.compile(add_rms_norm) if not smoke else add_rms_norm
    compiled_silu = torch.compile(silu_mul) if not smoke else silu_mul
    rows = []
    for name, (n, k, prologue) in (SMOKE_LINEARS if smoke else LINEARS).items():
        unfused = compiled_norm if prologue == "norm" else compiled_silu
        rows += linear_case(f"{name} {n}x{k}", n, k, prologue, unfused, device, smoke, reps, l2)
        ab._release(device)
    return rows


def linear_case(label, n, k, prologue, unfused, device, smoke, reps, l2) -> list[dict]:
    """Every variant of one linear: ``prologue`` is "norm" or "silu"; ``unfused`` the op
    before the linear as the graph would compile it."""
    from graphattn.kernels.gemv import gemv
    from graphattn.kernels.prologue_gemv import rms_norm_gemv, silu_mul_gemv

    count = 2 if smoke else max(2, min(64, math.ceil(2 * l2 / (n * k * DTYPE.itemsize))))
    gen = torch.Generator(device=device).manual_seed(n + k)
    weights = [ab._randn((n, k), DTYPE, device, gen) for _ in range(count)]
    width = 2 * k if prologue == "silu" else k
    xs = [ab._randn((1, width), DTYPE, device, gen) for _ in weights]
    residuals = [ab._randn((1, k), DTYPE, device, gen) for _ in weights]
    norm_w = (1 + 0.1 * torch.randn(k, device=device, generator=gen)).to(DTYPE)
    sets = list(zip(xs, residuals, weights))

    def calls(fn: Callable[..., Any]) -> list[Callable[[], Any]]:
        return [lambda x=x, r=r, w=w: fn(x, r, w) for x, r, w in sets]

    variants = {
        "gemv (input ready)": calls(lambda x, r, w: gemv(x[:, :k], w)),
        "cuBLAS (input ready)": calls(lambda x, r, w: torch.nn.functional.linear(x[:, :k], w)),
    }
    if prologue == "norm":
        variants["unfused: Inductor add+norm, gemv"] = calls(
            lambda x, r, w: gemv(unfused(x, r, norm_w)[0], w)
        )
        variants["fused: rms_norm_gemv"] = calls(
            lambda x, r, w: rms_norm_gemv(x, w, norm_w, EPS, r)
        )
        if n == LINEARS["gate_up"][0] or smoke:  # the MLP's first linear: SiLU-mul after it
            after = torch.compile(silu_mul) if not smoke else silu_mul
            variants["fused: rms_norm_gemv, Inductor silu-mul"] = calls(
                lambda x, r, w: after(rms_norm_gemv(x, w, norm_w, EPS, r)[0])
            )
            variants["fused: rms_norm_gemv + silu_mul epilogue"] = calls(
                lambda x, r, w: rms_norm_gemv(x, w, norm_w, EPS, r, epilogue="silu_mul")
            )
    else:
        variants["unfused: Inductor silu-mul, gemv"] = calls(lambda x, r, w: gemv(unfused(x), w))
        variants["fused: silu_mul_gemv"] = calls(lambda x, r, w: silu_mul_gemv(x, w))
    rows = []
    for variant, fns in variants.items():
        timing = ab.time_rotating(fns, device, reps, smoke, GRAPH_CALLS)
        rows.append({"part": "prologue_gemv", "case": label, "variant": variant,
                     "us": timing["seconds"] * 1e6, **timing})  # fmt: skip
    return rows


def argmax_rows(device, smoke: bool, reps: int) -> list[dict]:
    import graphattn as ga
    from graphattn.kernels.argmax import argmax

    vocab = SMOKE_VOCAB if smoke else VOCAB
    rows = []
    for b in SMOKE_ROWS if smoke else ROWS:
        gen = torch.Generator(device=device).manual_seed(b)
        sets = [ab._randn((b, vocab), DTYPE, device, gen) for _ in range(8)]
        for logits in sets:  # the answers first
            if not torch.equal(argmax(logits), logits.argmax(-1)):
                raise AssertionError(f"kernels.argmax differs from torch.argmax at B={b}")
        for variant, fn in (
            ("torch.argmax", lambda t: t.argmax(-1)),
            ("graphattn.greedy", ga.greedy),
        ):
            calls = [lambda t=t, fn=fn: fn(t) for t in sets]
            timing = ab.time_rotating(calls, device, reps, smoke, GRAPH_CALLS)
            rows.append({"part": "argmax", "case": f"[{b}, {vocab}]", "variant": variant,
                         "us": timing["seconds"] * 1e6, **timing})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="JSON path (default $OUT/fused_ops.json; none for --smoke)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    p.add_argument("--reps", type=int, default=30, help="timed graph replays per measurement")
    args = p.parse_args(argv)
    device = ab.bench_device(args.smoke)
    if device is None:
        return 2
    start = time.perf_counter()
    rows = linear_rows(device, args.smoke, args.reps, ab.l2_bytes(device))
    rows += argmax_rows(device, args.smoke, args.reps)
    for r in rows:
        print(f"{r['part']:14s} {r['case']:18s} {r['variant']:34s} {r['us']:9.2f} us")
    if args.smoke:
        print("smoke run: timings are one interpreted call each, not results")
    if args.out or not args.smoke:
        settings = ab.Settings(device, DTYPE, args.reps, args.smoke, ab.l2_bytes(device))
        meta = ab.meta(settings, None)
        for key in ("shape", "formulas", "copy_TBps"):  # attention.py's, not this benchmark's
            meta.pop(key, None)
        meta["timing"] = __doc__.split("Timing: ")[1].replace("\n", " ").strip()
        path = Path(args.out or Path(os.environ.get("OUT", ".")) / "fused_ops.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"meta": meta, "rows": rows,
                                    "wall_seconds": time.perf_counter() - start}, indent=1, default=str))  # fmt: skip
        print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

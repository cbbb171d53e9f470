"""Few-row GEMV benchmark: graphattn's Triton ``gemv`` against cuBLAS on Llama-3.2-1B's
decode linears.

    python benchmarks/gemv.py --out $OUT/gemv.json         # a GPU (an H200: about a minute)
    TRITON_INTERPRET=1 python benchmarks/gemv.py --smoke   # CPU, interpreter: every path, no results

Weights (N x K, bf16): qkv 3072x2048, o 2048x2048, gate_up 16384x2048, down 2048x8192,
lm_head 128256x2048; x has M = 1, 2, 4, 8 rows. Per case:
- cuBLAS: ``torch.mm(x, w.T)`` and ``F.linear(x, w)`` (what the model calls);
- ``gemv`` with ``choose_gemv_config`` ("auto");
- a sweep in two rounds. First every (block_n, block_k) at 4 warps, 3 stages and split_k
  1, for both paths (CUDA-core products, tensor cores), within twice the heuristic's
  register budget (CUDA cores) or its shared-memory budget (tensor cores), leaving out
  grids of fewer programs than half the SMs. Then the best so far with num_warps 2 / 8,
  split_k 2 / 4 and other num_stages.
TB/s = weight bytes (N * K * 2) / time; x and out are too small to count.

Timing: ``benchmarks/attention.time_rotating``: a CUDA graph of k calls that rotate over
weight copies (fresh random values) totalling at least twice the L2 cache, so no call
finds its weight in L2, replayed after warm-up; per-call time = median replay / k.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import attention as ab  # noqa: E402

SHAPES = {  # name: (N, K) of the weight
    "qkv": (3072, 2048),
    "o": (2048, 2048),
    "gate_up": (16384, 2048),
    "down": (2048, 8192),
    "lm_head": (128256, 2048),
}
ROWS = (1, 2, 4, 8)
SMOKE_SHAPES = {"qkv": (96, 64), "down": (40, 256)}
SMOKE_ROWS = (1, 3)
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class SweepSpace:
    """The values each round of the sweep tries."""

    block_n: tuple[int, ...] = (4, 8, 16, 32, 64)
    block_k: tuple[int, ...] = (128, 256, 512)
    num_warps: tuple[int, ...] = (2, 4, 8)
    split_k: tuple[int, ...] = (2, 4)
    stages_fma: tuple[int, ...] = (1, 2, 4)  # the first round runs 3; 1 = no pipelining
    stages_dot: tuple[int, ...] = (2, 4)


SMOKE_SPACE = SweepSpace(block_n=(4, 16), block_k=(16, 32), stages_fma=(1,), stages_dot=(2,))


@dataclass(frozen=True)
class Case:
    shape: str
    m: int
    n: int
    k: int

    @property
    def weight_bytes(self) -> int:
        return self.n * self.k * DTYPE.itemsize

    def row(self, impl: str, variant: str) -> dict:
        return {"shape": self.shape, "M": self.m, "N": self.n, "K": self.k,
                "impl": impl, "variant": variant}  # fmt: skip


@dataclass
class Settings:
    device: torch.device
    reps: int
    smoke: bool
    l2_bytes: int
    num_sms: int
    space: SweepSpace
    deadline: float  # perf_counter time after which no sweep round starts


# -- the sweep ------------------------------------------------------------------------------


def first_round(case: Case, st: Settings) -> list:
    """Every (block_n, block_k) of both paths within twice the heuristic's budgets."""
    from graphattn.kernels import gemv as g

    block_m = 1 << (case.m - 1).bit_length()
    k_pad = max(16, 1 << (case.k - 1).bit_length())
    configs = []
    for dot in (False, True):
        for bn in st.space.block_n:
            for bk in st.space.block_k:
                if (dot and bn < 16) or bk > k_pad or -(-case.n // bn) < st.num_sms // 2:
                    continue
                if dot and bn * bk > g.DOT_TILE_ELEMS:  # beyond, 3 stages overflow shared memory
                    continue
                if not dot and block_m * bn * bk > 2 * g.FMA_ELEMS_PER_THREAD * 32 * 4:
                    continue
                configs.append(g.GemvConfig(bn, bk, 4, 3, 1, dot))
    return configs


def second_round(best, case: Case, st: Settings) -> list:
    """``best`` with other warps, K splits (two K tiles a split) and stages."""
    sp = st.space
    variants = [replace(best, num_warps=w) for w in sp.num_warps]
    variants += [replace(best, split_k=s) for s in sp.split_k if case.k >= 2 * s * best.block_k]
    variants += [
        replace(best, num_stages=s) for s in (sp.stages_dot if best.dot else sp.stages_fma)
    ]
    return list(dict.fromkeys(v for v in variants if v != best))


def run_case(case: Case, weights: list[torch.Tensor], st: Settings) -> list[dict]:
    """cuBLAS, the heuristic's config and the sweep on one (shape, M); a row per measurement."""
    from graphattn.kernels.gemv import choose_gemv_config, gemv

    gen = torch.Generator(device=st.device).manual_seed(case.m)
    sets = [(ab._randn((case.m, case.k), DTYPE, st.device, gen), w,
             torch.empty(case.m, case.n, dtype=DTYPE, device=st.device)) for w in weights]  # fmt: skip
    x0, w0, out0 = sets[0]  # [M, K], [N, K], [M, N]
    reference = x0.float() @ w0.float().T  # [M, N]

    def measure(impl: str, variant: str, make_call: Callable[..., Callable[[], Any]]) -> dict:
        """``make_call(x, w, out)`` gives a call returning its [M, N] result."""
        row = case.row(impl, variant)
        try:
            calls = [make_call(*s) for s in sets]
            out0.fill_(float("nan"))  # an element a call leaves unwritten shows in the error
            row["rel_err_vs_fp32"] = ab.rel_err(calls[0](), reference)
            timing = ab.time_rotating(calls, st.device, st.reps, st.smoke)
            row.update(timing, us=timing["seconds"] * 1e6)
            row["TBps"] = case.weight_bytes / timing["seconds"] / 1e12
        except Exception as e:  # a config that does not compile or fit is a result too
            row["unavailable"] = (
                f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            )
            row["traceback"] = traceback.format_exc(limit=4)
        return row

    def triton(variant: str, config) -> dict:
        row = measure("triton", variant, lambda x, w, o: lambda: gemv(x, w, o, config=config))
        return {**row, "config": asdict(config)}

    rows = [
        measure("cublas", "torch.mm", lambda x, w, o: lambda: torch.mm(x, w.T, out=o)),
        measure("cublas", "F.linear", lambda x, w, o: lambda: torch.nn.functional.linear(x, w)),
    ]  # fmt: skip
    auto = choose_gemv_config(case.m, case.n, case.k, st.num_sms)
    rows.append(triton(f"auto {auto.label}", auto))
    for first in (True, False):
        if time.perf_counter() > st.deadline:
            rows.append({**case.row("triton", "sweep"), "unavailable": "skipped: time limit"})
            break
        configs = first_round(case, st) if first else second_round(best_config(rows), case, st)
        rows += [triton(c.label, c) for c in configs]
    return rows


def best_config(rows: list[dict]):
    """The fastest gemv config of ``rows`` (the heuristic's if none ran)."""
    from graphattn.kernels.gemv import GemvConfig

    triton = [r for r in rows if r["impl"] == "triton"]
    timed = [r for r in triton if "us" in r]
    return GemvConfig(**min(timed or triton, key=lambda r: r.get("us", 0))["config"])


# -- inputs ---------------------------------------------------------------------------------


def weight_copies(n: int, k: int, st: Settings) -> list[torch.Tensor]:
    """Enough [N, K] copies (fresh random values) that they exceed twice the L2 cache."""
    count = (
        2 if st.smoke else max(1, min(64, math.ceil(2 * st.l2_bytes / (n * k * DTYPE.itemsize))))
    )
    gen = torch.Generator(device=st.device).manual_seed(n + k)
    return [ab._randn((n, k), DTYPE, st.device, gen) for _ in range(count)]


# -- report ---------------------------------------------------------------------------------


def summary_rows(rows: list[dict]) -> list[dict]:
    """Per (shape, M): the cuBLAS rows, auto, and the best sweep config."""
    out = []
    for key in dict.fromkeys((r["shape"], r["M"]) for r in rows):
        case_rows = [r for r in rows if (r["shape"], r["M"]) == key]
        out += [r for r in case_rows if r["impl"] == "cublas" or r["variant"].startswith("auto")]
        timed = [r for r in case_rows if r["impl"] == "triton" and "us" in r]
        if timed:
            out.append({**min(timed, key=lambda r: r["us"]), "best": True})
    return out


def best_per_shape(rows: list[dict]) -> list[dict]:
    """Per shape: the config with the least total time over every M it was measured at all
    of, and the best per M with its speed-up over the faster cuBLAS call."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        mine = [r for r in rows if r["shape"] == shape and "us" in r]
        ms = sorted({r["M"] for r in mine})
        totals: dict[str, list[float]] = {}
        for r in mine:
            if r["impl"] == "triton":
                totals.setdefault(r["variant"].removeprefix("auto "), []).append(r["us"])
        common = {v: sum(t) for v, t in totals.items() if len(t) >= len(ms)}
        per_m = []
        for m in ms:
            at_m = [r for r in mine if r["M"] == m]
            cublas = min((r["us"] for r in at_m if r["impl"] == "cublas"), default=math.nan)
            best = min(
                (r for r in at_m if r["impl"] == "triton"), key=lambda r: r["us"], default=None
            )
            if best:
                per_m.append({"M": m, "variant": best["variant"], "us": best["us"],
                              "TBps": best["TBps"], "cublas_us": cublas,
                              "speedup_vs_cublas": cublas / best["us"]})  # fmt: skip
        out.append({"shape": shape, "best_over_all_M": min(common, key=common.get) if common else None,
                    "per_M": per_m})  # fmt: skip
    return out


def table(rows: list[dict], copy_tbps: float | None) -> str:
    head = f"{'shape':8s} {'M':>2s} {'impl':7s} {'variant':38s} {'us':>8s} {'TB/s':>6s} {'% copy':>7s} {'rel err':>8s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        variant = ("* " if r.get("best") else "") + r["variant"]
        if "unavailable" in r:
            lines.append(
                f"{r['shape']:8s} {r['M']:2d} {r['impl']:7s} {variant:38s} {r['unavailable']}"
            )
            continue
        share = f"{100 * r['TBps'] / copy_tbps:6.1f}%" if copy_tbps else ""
        lines.append(
            f"{r['shape']:8s} {r['M']:2d} {r['impl']:7s} {variant:38s} {r['us']:8.2f} "
            f"{r['TBps']:6.2f} {share:>7s} {r['rel_err_vs_fp32']:8.1e}"
        )
    return "\n".join(lines)


def print_report(result: dict) -> None:
    m = result["meta"]
    ab.print_header(m)
    print(
        "TB/s = weight bytes / time; '* ' = the best sweep config of the case (all rows in the JSON)"
    )
    print(table(result["summary"], m["copy_TBps"]))
    print("\nbest config per shape (speed-up = faster cuBLAS call / best gemv):")
    for s in result["best_per_shape"]:
        print(f"  {s['shape']}: over all M: {s['best_over_all_M']}")
        for b in s["per_M"]:
            print(f"    M={b['M']:2d} {b['variant']:36s} {b['us']:8.2f} us {b['TBps']:5.2f} TB/s "
                  f"x{b['speedup_vs_cublas']:.2f}")  # fmt: skip
    print(f"wall time {result['wall_seconds']:.0f} s")


# -- main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = ab.bench_device(args.smoke)
    if device is None:
        return 2
    start = time.perf_counter()
    cuda = device.type == "cuda"
    st = Settings(
        device,
        args.reps,
        args.smoke,
        ab.l2_bytes(device),
        ab.num_sms(device) if cuda else 4,
        SMOKE_SPACE if args.smoke else SweepSpace(),
        start + args.time_limit,
    )
    copy_tbps = None
    if cuda:
        from benchmarks.decode import copy_bandwidth

        copy_tbps = copy_bandwidth("cuda", 2**30) / 1e12
    shapes = SMOKE_SHAPES if args.smoke else {s: SHAPES[s] for s in args.shapes.split(",")}
    ms = SMOKE_ROWS if args.smoke else tuple(int(m) for m in args.rows.split(","))
    out_path = None  # a smoke run writes nothing unless asked to
    if args.out or not args.smoke:
        out_path = Path(args.out or Path(os.environ.get("OUT", ".")) / "gemv.json")
        out_path.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for name, (n, k) in shapes.items():
        weights = weight_copies(n, k, st)
        for m in ms:
            print(f"[{time.perf_counter() - start:6.1f}s] {name} {n}x{k} M={m}", file=sys.stderr)
            rows += run_case(Case(name, m, n, k), weights, st)
            write_result(out_path, rows, st, copy_tbps, start)  # kept if the run is cut short
        del weights
        ab._release(device)
    print_report(write_result(out_path, rows, st, copy_tbps, start))
    if out_path is not None:
        print(f"JSON: {out_path}")
    return 0


def write_result(path: Path | None, rows: list[dict], st: Settings, copy_tbps, start) -> dict:
    meta = ab.meta(ab.Settings(st.device, DTYPE, st.reps, st.smoke, st.l2_bytes), copy_tbps)
    meta.pop("shape")
    meta.update(num_sms=st.num_sms, shapes=SHAPES, timing=__doc__.split("Timing: ")[1].split("\n\n")[0].replace("\n", " "),
                sweep_space=asdict(st.space), formulas={"TBps": "N * K * 2 bytes / time"})  # fmt: skip
    result = {"meta": meta, "summary": summary_rows(rows), "best_per_shape": best_per_shape(rows),
              "rows": rows, "wall_seconds": time.perf_counter() - start}  # fmt: skip
    if path is not None:
        path.write_text(json.dumps(result, indent=1, default=str))
    return result


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--out", help="JSON path (default $OUT/gemv.json, else ./gemv.json; none for --smoke)"
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU interpreter; no results"
    )
    p.add_argument("--reps", type=int, default=20, help="timed graph replays per measurement")
    p.add_argument(
        "--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ",".join(SHAPES)
    )
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="values of M")
    p.add_argument("--time-limit", type=float, default=150.0,
                   help="seconds after which no sweep round starts (cuBLAS and auto still run)")  # fmt: skip
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())

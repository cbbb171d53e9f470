"""Which tiling each of the batch-1 step's linear layers should get: the step's 64 one-row
GEMV launches, as a FULL step launches them, with one linear's config changed at a time.

    python benchmarks/gemv_tiles.py --out $OUT/gemv_tiles.json      # a GPU (H200: about a minute)
    TRITON_INTERPRET=1 python benchmarks/gemv_tiles.py --smoke      # CPU: the plumbing only

The chain is 16 layers of the four launches the rewritten step runs per layer, each reading
the one before (as the step does, minus the attention in between):
- ``qkv``: ``rms_norm_gemv(x, w_qkv, norm_w, eps, residual)`` (add, RMSNorm, 3072x2048);
- ``o``: ``gemv`` over the first 2048 outputs of qkv (2048x2048);
- ``gate_up``: ``rms_norm_gemv(o, w_gate_up, norm_w, eps, residual, epilogue="silu_mul")``
  (16384x2048, stores the 8192-wide SiLU product);
- ``down``: ``gemv`` over the product (2048x8192), whose output is the next layer's x.
Weights are fresh random bf16 (1.95 GB, far beyond L2). The chain is captured in a CUDA
graph (PDL as the library decides) and timed as the median of CUDA-event timings of
``--reps`` replays after warm-up.

The sweep changes one linear's config, keeping the others at the base configs (the
library's choice, or ``--base``), so the chain's time minus the base chain's (measured again
before each linear's sweep) is what that config alone would change in a step. Round one: every (block_n, block_k) with
1024 <= block_n * block_k <= 16384 at 4 warps and 3 stages; round two, around the three best
so far (the base included): every warps x stages (2, 4, 8 x 2, 3, 4) of the best two, other
warps or stages for the third, and the best's tile reshaped at the same size; a config is
measured once. Last, the chain with every linear at its best against the base chain,
alternated ``--final-pairs`` times, in turn first. Every config's chain output comes from a
replay that starts with every buffer the chain writes set to NaN, and must stay within
``SANE_DIFF`` of the base chain's (another K order rounds a few bf16 units differently; a
missed column or K tile moves it by more); a config that does not is no candidate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import attention as ab  # noqa: E402
from graphattn.kernels.gemv import GemvConfig, choose_gemv_config, gemv  # noqa: E402
from graphattn.kernels.prologue_gemv import choose_prologue_config, rms_norm_gemv  # noqa: E402

HIDDEN, QKV, MLP = 2048, 3072, 8192
LINEARS = ("qkv", "o", "gate_up", "down")
EPS = 1e-5
BLOCK_N = (1, 2, 4, 8, 16, 32, 64)
BLOCK_K = (256, 512, 1024, 2048, 4096)
TILE_ELEMS = (1024, 16384)  # block_n * block_k bounds of round one
SANE_DIFF = 0.1  # largest |chain output - base chain output| of a candidate (outputs ~1-2)
SMOKE = {"hidden": 64, "qkv": 96, "mlp": 128, "layers": 2}


@dataclass
class Layer:
    qkv: torch.Tensor  # [QKV, H]
    o: torch.Tensor  # [H, H]
    gate_up: torch.Tensor  # [2 * MLP, H]
    down: torch.Tensor  # [H, MLP]
    norm1: torch.Tensor  # [H]
    norm2: torch.Tensor


class Chain:
    """The weights and buffers; ``run(configs)`` launches the 64 GEMVs once."""

    def __init__(self, layers: int, hidden: int, qkv: int, mlp: int, device: str) -> None:
        gen = torch.Generator(device=device).manual_seed(0)

        def rand(*shape: int) -> torch.Tensor:
            fan_in = shape[-1] if len(shape) > 1 else 1
            t = torch.randn(*shape, generator=gen, device=device) / fan_in**0.5
            return t.to(torch.bfloat16)

        self.layers = [
            Layer(rand(qkv, hidden), rand(hidden, hidden), rand(2 * mlp, hidden),
                  rand(hidden, mlp), 1 + 0.1 * rand(hidden), 1 + 0.1 * rand(hidden))
            for _ in range(layers)
        ]  # fmt: skip
        self.x = rand(1, hidden)
        self.residual = rand(1, hidden)
        self.bytes = sum(
            w.numel() * w.element_size()
            for layer in self.layers
            for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )

    def shapes(self) -> dict[str, tuple[int, int]]:
        first = self.layers[0]
        return {name: tuple(getattr(first, name).shape) for name in LINEARS}

    def run(self, configs: dict[str, GemvConfig | None]) -> torch.Tensor:
        """The chain's output; ``self.written`` holds every tensor this run wrote."""
        x, residual = self.x, self.residual
        hidden = x.shape[1]
        self.written = []
        for layer in self.layers:
            qkv, residual = rms_norm_gemv(
                x, layer.qkv, layer.norm1, EPS, residual, config=configs.get("qkv")
            )
            o = gemv(qkv[:, :hidden], layer.o, config=configs.get("o"))
            s, residual2 = rms_norm_gemv(
                o, layer.gate_up, layer.norm2, EPS, residual, epilogue="silu_mul",
                config=configs.get("gate_up"),
            )  # fmt: skip
            x = gemv(s, layer.down, config=configs.get("down"))
            self.written += [qkv, residual, o, s, residual2, x]
            residual = residual2
        return x


def library_config(name: str, shape: tuple[int, int]) -> GemvConfig:
    """The config the library picks for linear ``name`` (all four are one-row GEMVs)."""
    if name in ("qkv", "gate_up"):
        return choose_prologue_config(*shape, glu=name == "gate_up")
    return choose_gemv_config(1, *shape, 1)


def round_one(name: str, shape: tuple[int, int], smoke: bool) -> list[GemvConfig]:
    k = shape[1]
    if smoke:
        return [GemvConfig(2, 32, 4, 1), GemvConfig(4, 64, 2, 2)]
    configs = []
    for bn in BLOCK_N:
        if name == "gate_up" and bn < 2:  # the epilogue streams block_n / 2 rows of each half
            continue
        for bk in BLOCK_K:
            if bk <= k and TILE_ELEMS[0] <= bn * bk <= TILE_ELEMS[1]:
                configs.append(GemvConfig(bn, bk, 4, 3))
    return configs


def round_two(best: list[GemvConfig]) -> list[GemvConfig]:
    """Around round one's best three: every warps x stages of the best two, other warps or
    stages for the third, and the best's tile reshaped at the same size."""
    out = []
    for i, c in enumerate(best):
        if i < 2:
            out += [replace(c, num_warps=w, num_stages=s) for w in (2, 4, 8) for s in (2, 3, 4)]
        else:
            out += [replace(c, num_warps=w) for w in (2, 8)]
            out += [replace(c, num_stages=s) for s in (2, 4)]
    if best:
        c = best[0]
        out += [replace(c, block_n=c.block_n * 2, block_k=c.block_k // 2)]
        if c.block_n > 1:
            out += [replace(c, block_n=c.block_n // 2, block_k=c.block_k * 2)]
    return list(dict.fromkeys(c for c in out if c not in best))


def parse_configs(text: str) -> dict[str, GemvConfig]:
    """``qkv=4,1024,4,2;o=...``: block_n, block_k, num_warps, num_stages per linear."""
    out = {}
    for item in filter(None, text.split(";")):
        name, _, values = item.partition("=")
        if name not in LINEARS:
            raise SystemExit(f"--base: unknown linear {name!r}, expected one of {LINEARS}")
        fields = values.split(",")
        if len(fields) != 4 or not all(f.strip().isdigit() for f in fields):
            raise SystemExit(
                f"--base: {name} needs four integers block_n,block_k,num_warps,num_stages, "
                f"got {values!r}"
            )
        out[name] = GemvConfig(*(int(f) for f in fields))
    return out


class Timer:
    def __init__(self, chain: Chain, reps: int, smoke: bool, reference: torch.Tensor | None):
        self.chain, self.reps, self.smoke = chain, reps, smoke
        self.reference = reference

    def measure(self, configs: dict[str, GemvConfig | None]) -> dict:
        """Median chain seconds of ``configs`` and its output's error against the reference."""
        run = self.chain.run
        out = run(configs)  # compile outside the graph
        if self.smoke:
            return {"seconds": None, "max_abs_diff": self._diff(out)}
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(configs)
        for _ in range(5):
            graph.replay()
        times = [ab._event_seconds(graph.replay) for _ in range(self.reps)]
        for t in self.chain.written:  # the checked replay must write each of them again
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        result = {"seconds": statistics.median(times), "max_abs_diff": self._diff(out)}
        del graph
        return result

    def _diff(self, out: torch.Tensor) -> float | None:
        if self.reference is None:
            return None
        return float((out.float() - self.reference.float()).abs().max())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes; no timings")
    p.add_argument("--reps", type=int, default=30, help="timed replays per chain")
    p.add_argument("--final-pairs", type=int, default=5, help="base/best alternations")
    p.add_argument("--linears", default=",".join(LINEARS), help="which linears to sweep")
    p.add_argument("--time-limit", type=float, default=300.0,
                   help="seconds after which no further config is measured")  # fmt: skip
    p.add_argument("--base", default="",
                   help="the other linears' configs while one is swept, and the reference of "
                        "the final comparison (e.g. 'qkv=4,1024,4,2;o=4,2048,8,3'); default: "
                        "the library's")  # fmt: skip
    p.add_argument("--out", help="JSON path")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    smoke = a.smoke or device == "cpu"
    start = time.perf_counter()
    if smoke:
        chain = Chain(SMOKE["layers"], SMOKE["hidden"], SMOKE["qkv"], SMOKE["mlp"], device)
    else:
        chain = Chain(16, HIDDEN, QKV, MLP, device)
    shapes = chain.shapes()
    base_configs = parse_configs(a.base)
    start_configs = {name: library_config(name, shapes[name]) for name in LINEARS}
    start_configs.update(base_configs)
    reference = chain.run(base_configs).clone()
    timer = Timer(chain, a.reps, smoke, reference)
    result: dict = {
        "meta": {**ab_meta(device), "weight_bytes": chain.bytes, "smoke": smoke, "base": a.base,
                 "base_configs": {k: c.label for k, c in start_configs.items()}, "method": __doc__},
        "sweeps": {},
    }  # fmt: skip
    linears = a.linears.split(",")
    unknown = [n for n in linears if n not in LINEARS]
    if unknown:
        raise SystemExit(f"--linears: unknown {unknown}, expected some of {LINEARS}")
    best: dict[str, GemvConfig] = {}
    for name in linears:
        base = timer.measure(base_configs)
        rows = [{"config": start_configs[name].label, "base": True, **base,
                 "_config": start_configs[name]}]  # fmt: skip
        print(f"[{time.perf_counter() - start:6.1f}s] {name} {shapes[name]}: base "
              f"{start_configs[name].label} chain {_us(base['seconds'])}", file=sys.stderr)  # fmt: skip
        for configs in (round_one(name, shapes[name], smoke), None):
            if configs is None:  # round two around the best three so far (the base included)
                sane = [r for r in rows if r.get("seconds") and _sane(r, smoke)]
                timed = sorted(sane, key=lambda r: r["seconds"])
                configs = round_two([r["_config"] for r in timed[:3]])
            for config in configs:
                measured = {r["_config"] for r in rows}
                if config in measured or time.perf_counter() - start > a.time_limit:
                    continue
                row = {"config": config.label, "_config": config}
                try:
                    row.update(timer.measure({**base_configs, name: config}))
                except Exception as e:  # a config that does not compile or fit is a result
                    row["unavailable"] = f"{type(e).__name__}: {str(e)[:200]}"
                    traceback.print_exc(limit=2)
                rows.append(row)
        usable = [r for r in rows if r.get("seconds") and _sane(r, smoke)]
        if usable:
            top = min(usable, key=lambda r: r["seconds"])
            best[name] = top.get("_config", start_configs[name])
        for r in rows:
            r.pop("_config", None)
            if r.get("seconds") and base.get("seconds"):
                r["delta_us"] = (r["seconds"] - base["seconds"]) * 1e6
        result["sweeps"][name] = {"shape": list(shapes[name]), "rows": rows,
                                  "best": best.get(name, start_configs[name]).label}  # fmt: skip
        print_sweep(name, rows)
        _write(a.out, result, start)
    if not smoke and best:
        tuned_configs = {**base_configs, **best}  # linears not swept keep their base config
        pairs = []
        for i in range(a.final_pairs):  # each side first in turn
            if i % 2:
                tuned = timer.measure(tuned_configs)
                pairs.append((timer.measure(base_configs), tuned))
            else:
                pairs.append((timer.measure(base_configs), timer.measure(tuned_configs)))
        lib = [p[0]["seconds"] for p in pairs]
        tuned = [p[1]["seconds"] for p in pairs]
        result["final"] = {
            "best": {k: c.label for k, c in best.items()},
            "base_us": [s * 1e6 for s in lib],
            "best_us": [s * 1e6 for s in tuned],
            "best_max_abs_diff": pairs[-1][1]["max_abs_diff"],
        }
        print(f"final: base {statistics.median(lib) * 1e6:.1f} us, best "
              f"{statistics.median(tuned) * 1e6:.1f} us per chain "
              f"({', '.join(f'{k} {c.label}' for k, c in best.items())})")  # fmt: skip
    _write(a.out, result, start)
    return 0


def _sane(row: dict, smoke: bool) -> bool:
    """A config whose output is NaN or far from the base chain's is not a candidate."""
    diff = row.get("max_abs_diff")
    return smoke or (diff is not None and diff == diff and diff < SANE_DIFF)


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f} us"


def print_sweep(name: str, rows: list[dict]) -> None:
    print(f"{name}: config, chain us, change us, max |diff| against the base chain")
    for r in sorted(rows, key=lambda r: r.get("seconds") or float("inf")):
        tag = " (base)" if r.get("base") else ""
        if "unavailable" in r:
            print(f"  {r['config']:28s} {r['unavailable']}")
            continue
        delta = r.get("delta_us")
        print(f"  {r['config'] + tag:38s} {_us(r['seconds']):>12s} "
              f"{'' if delta is None else f'{delta:+8.1f}'} {r['max_abs_diff']}")  # fmt: skip


def ab_meta(device: str) -> dict:
    import platform
    from datetime import datetime, timezone

    import triton

    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _write(path: str | None, result: dict, start: float) -> None:
    result["wall_seconds"] = time.perf_counter() - start
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())

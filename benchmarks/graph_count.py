"""Does a FULL graph replay slower once the process holds other graphs? (CUDA)

Times one engine's decode step (``--target``, default FULL; median of the decode benchmark's
timed steps, CUDA events) in a process that first built, ran and deleted the ``--before``
engines, then profiles 30 steps and prints the kernels, the largest gaps between them and
what each kind of kernel adds to the step's span (``critical_path``: under PDL a kernel's
own duration includes the wait for the kernels before it); the JSON also holds one step's
kernels with their start and end (``one_step``).
``--target-first`` also times the target before anything else is built and again after,
so one engine is compared with itself (it stays alive to the end, beside the engines built
after it); ``--dummy-graphs N`` captures (and replays once) N
graphs of 18 small kernels (six rounds of multiply, add, relu) at that point, kept alive with ``--keep-dummies``;
``--replay-piecewise`` runs one step at each of the target's PIECEWISE sizes before timing
it (FULL_AND_PIECEWISE: do its own piecewise graphs, once replayed, slow its FULL steps?).

    python benchmarks/graph_count.py                              # FULL alone
    python benchmarks/graph_count.py --before eager,NONE,PIECEWISE
    python benchmarks/graph_count.py --target-first --dummy-graphs 1000
    python benchmarks/graph_count.py --target FULL_AND_PIECEWISE --replay-piecewise
    python benchmarks/graph_count.py --smoke --target eager --before eager  # CPU plumbing

The engines, model and decode steps are the decode benchmark's (``benchmarks/decode.py``).
docs/performance-history.md ("Graphs in the process") has what it measured.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import warnings
import weakref
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

import graphattn as ga

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))
from benchmarks import decode as D  # noqa: E402
from benchmarks.profile_decode import _short  # noqa: E402

PROFILED_STEPS = 30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", default="", help="engines built, run and deleted first")
    p.add_argument("--target", default="FULL", help="the engine timed last")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--target-first", action="store_true", help="also time the target first")
    p.add_argument("--dummy-graphs", type=int, default=0, help="small graphs to capture (CUDA)")
    p.add_argument("--keep-dummies", action="store_true")
    p.add_argument(
        "--replay-piecewise",
        action="store_true",
        help="before timing the target, run one step at each of its PIECEWISE capture sizes",
    )
    p.add_argument("--cache-dir", default=None, help="graphattn cache_dir (default: none)")
    p.add_argument("--smoke", action="store_true", help="the decode benchmark's tiny model")
    p.add_argument("--out", help="JSON path")
    return p.parse_args(argv)


class Probe:
    def __init__(self, a: argparse.Namespace) -> None:
        self.batches = [int(b) for b in a.batches.split(",")]
        args = ["--parts", "latency", "--baselines", "", "--batch-sizes", a.batches]
        self.s = D.settings_from_args(
            D.parse_args([*args, "--modes", a.target, *(["--smoke"] if a.smoke else [])])
        )
        self.cache_dir = a.cache_dir
        self.model = D.build_model(self.s)

    def engine(self, key: str):
        """Build ``key``'s engine and prefill the rows the batches decode."""
        D.release(self.s.device)
        spec = D.ENGINE_SPECS[key]
        engine = ga.compile(self.model, **self.s.engine_kwargs(spec), cache_dir=self.cache_dir)
        rng = np.random.default_rng(0)
        pool = D.RequestPool(engine, self.s)
        pool.prefill(engine, list(range(max(self.batches))), rng, self.s)
        return engine, pool, rng

    def time(self, engine, pool, rng) -> dict[int, float]:
        return {
            b: D.time_graphattn_batch(engine, pool, b, self.s, rng)["median_ms"]
            for b in self.batches
        }

    def run_and_delete(self, key: str) -> dict:
        engine, pool, rng = self.engine(key)
        self.time(engine, pool, rng)
        alive = weakref.ref(engine)
        del engine, pool
        D.release(self.s.device)
        with warnings.catch_warnings():  # isinstance on some torch objects warns
            warnings.simplefilter("ignore")
            graphs = sum(isinstance(o, torch.cuda.CUDAGraph) for o in gc.get_objects())
        state = {"engine_alive": alive() is not None, "live_cuda_graphs": graphs}
        if self.s.device == "cuda":
            state["allocated_mib"] = torch.cuda.memory_allocated() / 2**20
        return state

    def profile(self, engine, pool, rng, b: int) -> dict:
        """Kernels and the gaps between consecutive kernels, per step, over 30 steps."""
        tokens = D.random_tokens(rng, self.model.vocab_size, (PROFILED_STEPS + 10, b))
        step = D.graphattn_decode(engine, pool, slice(0, b), tokens)
        for i in range(10):
            step(i)
        kernels = []
        if self.s.device == "cuda":
            found = D.device_kernels(step, 10, PROFILED_STEPS)
            kernels = [(start, end, _short(name)) for start, end, name in found]
        by_name, gaps = defaultdict(list), defaultdict(list)
        for start, end, name in kernels:
            by_name[name].append(end - start)
        for (_, end, first), (start, _, then) in itertools.pairwise(kernels):
            gaps[f"{first[:40]} -> {then[:40]}"].append(start - end)
        return {
            "kernels": per_step(by_name),
            "gaps": per_step(gaps),
            "critical": critical_path(kernels, PROFILED_STEPS),
            "one_step": one_step(kernels, PROFILED_STEPS),
        }


def replay_piecewise(probe: Probe, engine, pool, rng) -> int:
    """One prefill step at each PIECEWISE capture size of ``engine`` (chunks of at most the
    context, rows from 0); returns how many steps ran PIECEWISE (a one-token step is a
    uniform decode, which FULL_AND_PIECEWISE runs FULL)."""
    before = engine.stats.runtime_modes["PIECEWISE"]
    context = probe.s.context
    for size in engine.report.capture.get("sizes", {}).get("PIECEWISE", []):
        chunks = prefill_chunks(size, context)
        tokens = D.random_tokens(rng, probe.model.vocab_size, size)
        engine.step(pool.chunk_batch(chunks, tokens))
    D.synchronize(probe.s.device)
    return engine.stats.runtime_modes["PIECEWISE"] - before


def prefill_chunks(size: int, context: int) -> list[tuple[int, int, int]]:
    """``size`` prompt tokens as (row, computed, length) chunks of at most ``context``, one
    row each from row 0 (RequestPool.chunk_batch's form)."""
    return [(row, 0, min(context, size - done)) for row, done in enumerate(range(0, size, context))]


def per_step(times: dict[str, list[float]]) -> list[dict]:
    rows = [
        {"name": k, "per_step": len(v) / PROFILED_STEPS, "us_per_step": sum(v) / PROFILED_STEPS}
        for k, v in times.items()
    ]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def _additions(kernels: list[tuple[float, float, str]]):
    """(start, end, name, added) per kernel in start order: ``added`` is how far its end
    passes the latest end of the kernels before it, counting only time after its own start."""
    latest = None
    for start, end, name in kernels:
        floor = start if latest is None else max(latest, start)
        yield start, end, name, max(0.0, end - floor)
        latest = end if latest is None else max(latest, end)


def critical_path(kernels: list[tuple[float, float, str]], steps: int) -> list[dict]:
    """What each kernel adds to the step's span, by name, per step (``_additions``). Under
    PDL a kernel starts early and waits, so its duration includes the kernels before it;
    this does not. Summed over the kernels it is the span less the idle time. Rows sorted by
    that time (us_per_step is the plain duration, for comparison)."""
    added, took, count = defaultdict(float), defaultdict(float), defaultdict(int)
    for start, end, name, adds in _additions(kernels):
        added[name] += adds
        took[name] += end - start
        count[name] += 1
    rows = [
        {
            "name": name,
            "per_step": count[name] / steps,
            "critical_us_per_step": added[name] / steps,
            "us_per_step": took[name] / steps,
        }
        for name in added
    ]
    return sorted(rows, key=lambda r: -r["critical_us_per_step"])


def one_step(kernels: list[tuple[float, float, str]], steps: int) -> list[dict]:
    """The kernels of the middle profiled step, times from its first kernel's start (us):
    start, end and what each adds to the span (``_additions``). Empty unless the profile
    holds the same number of kernels in every step."""
    if not kernels or len(kernels) % steps:
        return []
    n = len(kernels) // steps
    step = kernels[n * (steps // 2) : n * (steps // 2 + 1)]
    t0 = step[0][0]
    return [
        {"name": name, "start_us": start - t0, "end_us": end - t0, "adds_us": adds}
        for start, end, name, adds in _additions(step)
    ]


def capture_dummy_graphs(n: int) -> list[torch.cuda.CUDAGraph]:
    """``n`` graphs of 18 pointwise kernels each (six rounds of multiply, add, relu), each
    replayed once."""
    x = torch.randn(64, 64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm the kernels outside any capture
        (x * 2 + 1).relu()
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for _ in range(n):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = x
            for _ in range(6):
                y = (y * 1.001 + 0.5).relu()
        graph.replay()
        graphs.append(graph)
    torch.cuda.synchronize()
    return graphs


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.dummy_graphs and not torch.cuda.is_available():
        raise SystemExit("--dummy-graphs needs CUDA")
    probe = Probe(a)
    out: dict = {"before": a.before, "target": a.target, "device": probe.s.device}
    if a.target_first:
        first = probe.engine(a.target)
        out["target_first_ms"] = probe.time(*first)
        print(f"{a.target} first: {out['target_first_ms']} ms")
    dummies = capture_dummy_graphs(a.dummy_graphs) if a.dummy_graphs else []
    if not a.keep_dummies:
        dummies.clear()
    out["after"] = {key: probe.run_and_delete(key) for key in a.before.split(",") if key}
    for key, state in out["after"].items():
        print(f"after {key}: {state}")
    if a.target_first:
        out["target_again_ms"] = probe.time(*first)
        print(f"{a.target} again: {out['target_again_ms']} ms")
    engine, pool, rng = probe.engine(a.target)
    if a.replay_piecewise:
        out["piecewise_steps"] = replay_piecewise(probe, engine, pool, rng)
        print(f"{a.target}: {out['piecewise_steps']} PIECEWISE steps at its capture sizes")
    out["by_batch"] = {}
    for b, ms in probe.time(engine, pool, rng).items():
        entry = {"median_ms": ms} | probe.profile(engine, pool, rng, b)
        out["by_batch"][str(b)] = entry
        kernel_us = sum(r["us_per_step"] for r in entry["kernels"])
        count = sum(r["per_step"] for r in entry["kernels"])
        print(
            f"{a.before or 'alone'} -> {a.target} bs {b}: {ms:.4f} ms; kernels {count:.0f}, {kernel_us:.1f} us"
        )
        for r in entry["kernels"][:10]:
            print(f"   {r['us_per_step']:8.1f} us {r['per_step']:5.1f}x {r['name']}")
        for r in entry["gaps"][:10]:
            print(f"   gap {r['us_per_step']:6.1f} us {r['per_step']:5.1f}x {r['name']}")
        for r in entry["critical"][:12]:
            print(
                f"   adds {r['critical_us_per_step']:7.1f} us {r['per_step']:5.1f}x {r['name']}"
                f" (runs {r['us_per_step']:.1f} us)"
            )
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

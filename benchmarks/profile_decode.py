"""Where a decode step's time goes: kernels, their count and the gaps between them (CUDA).

Builds the Llama-3.2-1B-shaped engine in FULL_AND_PIECEWISE, prefills ``--context`` random
tokens per request, then records ``--steps`` decode steps (engine.step + compute_logits +
graphattn.greedy) under torch.profiler. Prints per-step wall time (CUDA events), the summed kernel
time, the kernel count, and the kernels that take the most time, grouped by name.

    python benchmarks/profile_decode.py --batch 1 --out $OUT/profile.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

import graphattn as ga
from graphattn.models import LlamaConfig, LlamaForCausalLM, init_random_weights


def build(batch: int, context: int, tiny: bool) -> tuple[ga.CompiledModel, list[list[int]]]:
    cfg = LlamaConfig.tiny() if tiny else LlamaConfig.llama_3_2_1b()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = init_random_weights(LlamaForCausalLM(cfg).to(device, dtype))
    engine = ga.compile(
        model,
        cudagraph_mode="FULL_AND_PIECEWISE",
        max_num_seqs=max(batch, 8),
        max_num_tokens=4096,
        max_model_len=2048,
        num_blocks=batch * 40 + 64,
    )
    blocks = [engine.kv_cache.allocate(-(-(context + 64) // 16)) for _ in range(batch)]
    rng = np.random.default_rng(0)
    for i in range(batch):
        prompt = rng.integers(1, model.vocab_size, context).tolist()
        engine.step(ga.Batch.from_requests([ga.Request(prompt, 0, blocks[i])]))
    return engine, blocks


def decode_step(engine, blocks, context: int, rng) -> torch.Tensor:
    n = len(blocks)
    tokens = rng.integers(1, engine.model.vocab_size, n)
    table = np.array(blocks, dtype=np.int32)
    batch = ga.Batch.from_arrays(tokens, np.ones(n, np.int32), np.full(n, context, np.int32), table)
    hidden = engine.step(batch, clone=False)  # as the decode benchmark steps
    return ga.greedy(engine.compute_logits(hidden))


def kernel_table(prof, steps: int) -> tuple[list[dict], float, int]:
    by_name: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            by_name[_short(event.name)].append(event.device_time)
    rows = [
        {"kernel": k, "calls_per_step": len(v) / steps, "us_per_step": sum(v) / steps}
        for k, v in by_name.items()
    ]
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    count = sum(len(v) for v in by_name.values()) / steps
    return rows, total, count


def host_profile(engine, blocks, context: int, rng, steps: int) -> dict:
    """Host microseconds of ``engine.step`` (GPU idle before each: synchronized), then the
    same steps under cProfile: the functions with the most own time, per step.
    """
    import cProfile
    import pstats

    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.append(root)
    from benchmarks.decode import host_step_times  # the decode benchmark's host timing

    n = len(blocks)
    table = np.array(blocks, dtype=np.int32)
    batches = [
        ga.Batch.from_arrays(
            rng.integers(1, engine.model.vocab_size, n),
            np.ones(n, np.int32),
            np.full(n, context, np.int32),
            table,
        )
        for _ in range(steps)
    ]
    times = host_step_times(engine, batches, "cuda" if torch.cuda.is_available() else "cpu")
    profiler = cProfile.Profile()
    for batch in batches:
        _sync()
        profiler.enable()
        engine.step(batch, clone=False)
        profiler.disable()
    _sync()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    rows = [
        {
            "function": f"{Path(k[0]).name}:{k[1]}({k[2]})",
            "calls_per_step": v[1] / steps,
            "own_us_per_step": 1e6 * v[2] / steps,
            "cum_us_per_step": 1e6 * v[3] / steps,
        }
        for k, v in stats.items()
    ]
    rows.sort(key=lambda r: -r["own_us_per_step"])
    median_us = 1e6 * float(np.median(times))
    print(f"host: engine.step at {n} requests: {median_us:.1f} us median over {steps} steps")
    print(f"{'function (cProfile, own time)':<70}{'calls':>7}{'own us':>9}{'cum us':>9}")
    for r in rows[:25]:
        print(
            f"{r['function'][:69]:<70}{r['calls_per_step']:>7.1f}"
            f"{r['own_us_per_step']:>9.1f}{r['cum_us_per_step']:>9.1f}"
        )
    return {"step_us_median": median_us, "functions": rows[:60]}


def _timed(fn) -> float:
    """Milliseconds of ``fn``: CUDA events on the GPU (the host clock only for a CPU smoke)."""
    if not torch.cuda.is_available():
        import time

        t = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _activities() -> list:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _short(name: str) -> str:
    name = re.sub(r"<.*>", "<>", name)
    return name[:70]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--tiny", action="store_true", help="a tiny model (a smoke run)")
    p.add_argument(
        "--host-steps",
        type=int,
        default=0,
        help="also profile engine.step's host work (cProfile) over this many steps",
    )
    a = p.parse_args(argv)
    engine, blocks = build(a.batch, a.context, a.tiny)
    rng = np.random.default_rng(1)
    for _ in range(10):
        decode_step(engine, blocks, a.context, rng)
    host = host_profile(engine, blocks, a.context, rng, a.host_steps) if a.host_steps else None
    times = [_timed(lambda: decode_step(engine, blocks, a.context, rng)) for _ in range(50)]
    with torch.profiler.profile(activities=_activities()) as prof:
        for _ in range(a.steps):
            decode_step(engine, blocks, a.context, rng)
        _sync()
    rows, kernel_us, count = kernel_table(prof, a.steps)
    step_ms = float(np.median(times))
    print(
        f"decode step, batch {a.batch}, context {a.context}: {step_ms:.3f} ms median "
        f"(CUDA events, {len(times)} steps); runtime modes {dict(engine.stats.runtime_modes)}"
    )
    print(
        f"kernels per step: {count:.0f}; summed kernel time {kernel_us / 1e3:.3f} ms; "
        f"the rest ({step_ms - kernel_us / 1e3:.3f} ms) is gaps between kernels and host work"
    )
    print(f"{'kernel':<72}{'calls':>7}{'us/step':>10}")
    for r in rows[:25]:
        print(f"{r['kernel']:<72}{r['calls_per_step']:>7.0f}{r['us_per_step']:>10.1f}")
    if a.out:
        Path(a.out).write_text(
            json.dumps(
                {
                    "batch": a.batch,
                    "context": a.context,
                    "step_ms": step_ms,
                    "kernel_ms": kernel_us / 1e3,
                    "kernels_per_step": count,
                    "kernels": rows,
                    "host": host,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

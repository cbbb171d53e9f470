"""The decode benchmark: graphattn against eager PyTorch, torch.compile and reduce-overhead, in one run.

    python benchmarks/decode.py --out $OUT/decode.json --plot $OUT/decode.png   # a GPU
    python benchmarks/decode.py --smoke          # CPU: tiny model, every code path, no results
    python -m graphattn bench [the same arguments]

Parts (``--parts``, default all): floor, latency, trace, mixed, host, startup. What each
measures and how is in benchmarks/README.md and in the JSON's ``method`` entries. A
configuration that cannot run (a mode not built yet, an out-of-memory) is recorded as
"unavailable: <reason>" and the run goes on. The JSON is rewritten after every engine, so
a run cut short keeps what it measured; the table comes last.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import gc
import hashlib
import io
import itertools
import json
import os
import platform
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

import graphattn as ga
from graphattn.envs import prefetch_mib
from graphattn.kernels.attention_plan import describe_merge
from graphattn.kernels.pdl import use_pdl
from graphattn.models import LlamaConfig, LlamaForCausalLM, init_random_weights

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # for benchmarks.baseline, also under runpy and subprocesses

from benchmarks.baseline import StaticLlama  # noqa: E402
from benchmarks.profile_decode import _short  # noqa: E402

PARTS = ("floor", "latency", "trace", "mixed", "host", "startup")
# graphattn's environment variables that say where a run keeps its files, not what a step
# runs: every other GRAPHATTN_ variable set is recorded in meta.env (run_variables)
PLACE_VARIABLES = ("GRAPHATTN_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
BASELINES = ("eager", "compile", "reduce-overhead")
BLOCK_SIZE = 16
STEP_DEFINITION = (
    "graphattn: engine.step(Batch.from_arrays(...), clone=False) on B one-token decode "
    "requests + engine.compute_logits + graphattn.greedy (argmax) (clone=False: the step's "
    "rows are read where the graph left them, as the baseline's compiled graph leaves its "
    "output); baseline: forward(tokens [B], "
    "positions [B]) (lm_head included) + argmax, the argmax inside the compiled function "
    "for torch.compile and reduce-overhead (so it is captured with the graph). Every step decodes one fresh random token per request at position "
    "CONTEXT over CONTEXT cached tokens written by a real prefill of random tokens (the step "
    "rewrites slot CONTEXT), so every timed step sees the same context."
)
SMOKE_NOTE = "smoke run: timings are not performance results"


# -- settings -------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineSpec:
    """One graphattn configuration."""

    key: str
    label: str
    mode: str
    compile_backend: str


ENGINE_SPECS = {
    "eager": EngineSpec("eager", "graphattn eager", "NONE", "none"),
    "NONE": EngineSpec("NONE", "graphattn NONE", "NONE", "inductor"),
    "PIECEWISE": EngineSpec("PIECEWISE", "graphattn PIECEWISE", "PIECEWISE", "inductor"),
    "FULL": EngineSpec("FULL", "graphattn FULL", "FULL", "inductor"),
    "FULL_AND_PIECEWISE": EngineSpec(
        "FULL_AND_PIECEWISE", "graphattn FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE", "inductor"
    ),
}


@dataclass(frozen=True)
class Settings:
    """Everything one run uses; ``--smoke`` changes the defaults, flags override them."""

    smoke: bool
    device: str
    dtype: torch.dtype
    parts: tuple[str, ...]
    modes: tuple[str, ...]  # ENGINE_SPECS keys timed by the latency part
    baselines: tuple[str, ...]
    attention_backend: str | None
    batch_sizes: tuple[int, ...]
    context: int
    warmup: int
    steps: int
    trace_steps: int
    trace_max_batch: int
    trace_budget_s: float
    mixed_decodes: tuple[int, int]  # decodes per mixed step, inclusive range
    mixed_chunks: tuple[int, int]  # prefill chunks per mixed step
    mixed_chunk_len: tuple[int, int]  # tokens per chunk
    host_sizes: tuple[int, ...]
    host_iters: int
    max_num_tokens: int
    seed: int
    startup_timeout_s: float
    time_limit_s: float
    max_seqs: int | None = None  # max_num_seqs; None: the most requests a part puts in a step
    profile_startup: str | None = None  # folder for the start-up processes' cProfile output
    isolate: bool = False  # each configuration in its own process (see ISOLATION)
    config_timeout_s: float = 900.0  # --isolate: a configuration's process is killed after it
    extra_passes: tuple[str, ...] = ()  # post-grad passes after the defaults (opt-in ones)

    @property
    def part_engines(self) -> dict[str, tuple[str, ...]]:
        """Which graphattn engines serve each part (smoke: the eager engine stands in)."""
        fap = ("eager",) if self.smoke else ("FULL_AND_PIECEWISE",)
        mixed = ("eager",) if self.smoke else ("PIECEWISE", "FULL_AND_PIECEWISE")
        return {"latency": self.modes, "trace": fap, "mixed": mixed, "host": fap, "startup": fap}

    @property
    def blocks_per_request(self) -> int:
        return -(-(self.context + 1) // BLOCK_SIZE)

    @property
    def decode_rows(self) -> int:
        """Requests of the decode pool: the largest batch any part decodes."""
        return max(*self.batch_sizes, self.trace_max_batch, self.mixed_decodes[1], *self.host_sizes)

    @property
    def max_num_seqs(self) -> int:
        needed = max(self.decode_rows, self.mixed_decodes[1] + self.mixed_chunks[1])
        return self.max_seqs or needed

    @property
    def max_model_len(self) -> int:
        return self.blocks_per_request * BLOCK_SIZE

    @property
    def num_blocks(self) -> int:
        return (self.decode_rows + self.mixed_chunks[1]) * self.blocks_per_request + 1

    def engine_kwargs(self, spec: EngineSpec) -> dict[str, Any]:
        """``ga.compile`` keywords for ``spec`` (every engine of a run has the same sizes)."""
        return dict(
            cudagraph_mode=spec.mode,
            compile_backend=spec.compile_backend,
            attention_backend=self.attention_backend,
            max_num_seqs=self.max_num_seqs,
            max_num_tokens=self.max_num_tokens,
            max_model_len=self.max_model_len,
            block_size=BLOCK_SIZE,
            num_blocks=self.num_blocks,
            passes=(*ga.CompileConfig().passes, *self.extra_passes),
        )


FULL_DEFAULTS = dict(
    modes="eager,NONE,PIECEWISE,FULL,FULL_AND_PIECEWISE",
    attention_backend="TRITON",
    batch_sizes="1,8,32,128",
    context=512,
    warmup=10,
    steps=50,
    trace_steps=200,
    trace_max_batch=128,
    trace_budget=90.0,
    host_sizes="1,32,256",
    host_iters=200,
    max_num_tokens=2048,
    mixed=((8, 64), (1, 3), (64, 256)),
)
SMOKE_DEFAULTS = dict(
    modes="eager,NONE",
    attention_backend="auto",
    batch_sizes="1,4",
    context=64,
    warmup=2,
    steps=5,
    trace_steps=20,
    trace_max_batch=8,
    trace_budget=60.0,
    host_sizes="1,4,8",
    host_iters=20,
    max_num_tokens=256,
    mixed=((1, 4), (1, 2), (8, 32)),
)


def model_config(smoke: bool) -> LlamaConfig:
    """Llama-3.2-1B's shape (untied head), or a tiny one for the smoke run."""
    if smoke:
        return LlamaConfig.tiny(num_hidden_layers=2, hidden_size=128, intermediate_size=256)
    return LlamaConfig.llama_3_2_1b()


# -- results ----------------------------------------------------------------------------


class Results:
    """The run's JSON document, saved after every engine so a cut-short run keeps its numbers."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {"meta": meta, "errors": [], "wall_seconds": {}}
        self.start = time.perf_counter()

    def put(self, part: str, key: str, value: Any) -> None:
        self.data.setdefault(part, {})[key] = value

    def add_row(self, part: str, row: dict[str, Any]) -> None:
        self.data.setdefault(part, {}).setdefault("rows", []).append(row)

    def error(self, where: str, exc: BaseException) -> str:
        """Record ``exc`` with its traceback; returns the "unavailable: ..." status."""
        status = unavailable(exc)
        tb = traceback.format_exc()[-6000:]
        self.data["errors"].append({"where": where, "status": status, "traceback": tb})
        log(f"{where}: {status}")
        return status

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


def failure(where: str, exc: BaseException) -> dict:
    """A configuration that failed inside a part: its status and traceback (also logged)."""
    status = unavailable(exc)
    log(f"{where}: {status}")
    return {"status": status, "traceback": traceback.format_exc()[-4000:]}


def unavailable(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    first = lines[0][:300] if lines else ""
    return f"unavailable: {type(exc).__name__}: {first}"


_LOG_START = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _LOG_START:7.1f} s] {message}", file=sys.stderr, flush=True)


# -- timing -----------------------------------------------------------------------------


def run_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """Every ``GRAPHATTN_`` and ``TORCHINDUCTOR_`` variable set but the ones that only place
    files: graphattn's documented ones (envs.py, kernels/pdl.py, kernels/attention_plan.py),
    Inductor's (``TORCHINDUCTOR_ENABLE_PDL``...) and any an experiment adds, so an A/B run's
    JSON says what each process ran with."""
    return {
        k: v
        for k, v in sorted(environ.items())
        if k.startswith(("GRAPHATTN_", "TORCHINDUCTOR_")) and k not in PLACE_VARIABLES
    }


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(step: Callable[[int], Any], warmup: int, steps: int, device: str) -> dict:
    """Run ``step(i)`` for i < warmup untimed, then ``steps`` times timed one by one.

    On CUDA each step is bracketed by events (the device time from the first kernel the
    host could launch to the step's last, host stalls included); ``mean_ms`` is the wall
    time of the timed steps run back to back, divided by their number.
    """
    start = time.perf_counter()
    step(0)
    synchronize(device)
    first_call_s = time.perf_counter() - start
    for i in range(1, warmup):
        step(i)
    synchronize(device)
    per_step: list[float] = []
    events = []
    wall = time.perf_counter()
    for i in range(warmup, warmup + steps):
        if device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step(i)
            end.record()
            events.append((begin, end))
        else:
            t = time.perf_counter()
            step(i)
            per_step.append((time.perf_counter() - t) * 1e3)
    synchronize(device)
    wall = time.perf_counter() - wall
    if events:
        per_step = [b.elapsed_time(e) for b, e in events]
    out = summarize_ms(per_step) | {
        "mean_ms": wall / steps * 1e3,
        "first_call_s": first_call_s,
        "warmup": warmup,
    }
    clock = sm_clock_mhz(device)
    if clock is not None:
        out["sm_clock_mhz"] = clock
    return out


CLOCK_CYCLES = 2_000_000  # about 1 ms of spinning at an H200's clocks


def sm_clock_mhz(device: str, repeats: int = 5) -> float | None:
    """The SM clock now: a one-thread kernel that spins CLOCK_CYCLES cycles of its SM's
    clock (``torch.cuda._sleep``), timed with CUDA events, the median of ``repeats`` after
    one warm-up (``clock_mhz``; the launch adds microseconds to the millisecond, so it reads
    a little low). Taken right after each batch's timed steps, so a process whose steps ran
    slower shows whether its clock was lower. None off CUDA."""
    if device != "cuda":
        return None
    times = []
    for _ in range(repeats + 1):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        torch.cuda._sleep(CLOCK_CYCLES)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return clock_mhz(CLOCK_CYCLES, times[1:])


def clock_mhz(cycles: int, elapsed_ms: list[float]) -> float:
    """Cycles per microsecond over the median of ``elapsed_ms``."""
    return cycles / (statistics.median(elapsed_ms) * 1e3)


def summarize_ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median_ms": statistics.median(ordered),
        "p10_ms": ordered[len(ordered) // 10],
        "p90_ms": ordered[(9 * len(ordered)) // 10],
        "steps": len(ordered),
    }


def run_trace(
    step: Callable[[int], Any],
    num_steps: int,
    device: str,
    budget_s: float | None = None,
    progress: Callable[[dict], None] | None = None,
    progress_every_s: float = 5.0,
) -> dict:
    """Steps 0..num_steps-1 back to back (synchronized after the first, the 100th and the
    last); stops before a step once ``budget_s`` seconds have passed since the first began.

    ``progress``, if given, gets what is known so far (steps done, the first step's seconds,
    the first 100 steps' seconds once reached, seconds since the start by the host's clock)
    after the first step, the 100th, and after any step that ends ``progress_every_s`` or
    more after the last report: a process stopped from outside inside a long trace can still
    say how far it got.
    """
    start = time.perf_counter()
    step(0)
    synchronize(device)
    first = time.perf_counter()
    mark = None
    done = 1

    def report() -> float:
        now = time.perf_counter()
        progress(
            {
                "steps_done": done,
                "first_step_s": first - start,
                "first_100_s": (mark - start) if mark else None,
                "elapsed_s": now - start,
            }
        )
        return now

    reported = report() if progress else first
    for i in range(1, num_steps):
        if budget_s is not None and time.perf_counter() - start > budget_s:
            break
        step(i)
        done += 1
        if done == 100:
            synchronize(device)
            mark = time.perf_counter()
        if progress and (done == 100 or time.perf_counter() - reported >= progress_every_s):
            reported = report()
    synchronize(device)
    end = time.perf_counter()
    out = {
        "steps_done": done,
        "steps_planned": num_steps,
        "total_s": end - start,
        "first_step_s": first - start,
        "first_100_s": (mark - start) if mark else None,
        "ms_per_step_after_100": (end - mark) / (done - 100) * 1e3 if mark and done > 100 else None,
        "ms_per_step_all": (end - start) / done * 1e3,
    }
    if budget_s is not None:
        out["budget_s"] = budget_s
        out["stopped_by_budget"] = done < num_steps
    return out


# -- the model ----------------------------------------------------------------------------


def build_model(s: Settings) -> LlamaForCausalLM:
    """The benchmark's Llama with random weights, on the run's device and dtype."""
    torch.manual_seed(s.seed)
    with torch.device(s.device):
        model = LlamaForCausalLM(model_config(s.smoke))
    init_random_weights(model, seed=s.seed)
    return model.to(dtype=s.dtype).eval()


def random_tokens(rng: np.random.Generator, vocab: int, shape) -> np.ndarray:
    """Token ids in [1, vocab): fresh random data, never zeros."""
    return rng.integers(1, vocab, size=shape, dtype=np.int64)


def release(device: str) -> None:
    """Drop what the last configuration left (compiled code, graphs, caches)."""
    torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# -- part: floor --------------------------------------------------------------------------


def measure_floor(model: LlamaForCausalLM, s: Settings) -> dict:
    """Weight bytes over the device's measured copy bandwidth, and per batch with the KV read."""
    cfg = model.config
    params = list(model.parameters())  # tied weights appear once
    all_bytes = sum(p.numel() * p.element_size() for p in params)
    embed = model.embed_tokens.weight
    gathered = 0 if cfg.tie_word_embeddings else embed.numel() * embed.element_size()
    read_bytes = all_bytes - gathered  # the embedding table is only gathered, B rows a step
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.kv_heads * cfg.head_size * embed.element_size()
    bandwidth = copy_bandwidth(s.device, 64 << 20 if s.smoke else 1 << 30)
    per_batch = {
        str(b): (read_bytes + b * (s.context + 1) * kv_per_token) / bandwidth * 1e3
        for b in s.batch_sizes
    }
    return {
        "weight_bytes": all_bytes,
        "weight_bytes_read_per_step": read_bytes,
        "kv_bytes_per_token": kv_per_token,
        "copy_bytes_per_s": bandwidth,
        "floor_all_weights_ms": all_bytes / bandwidth * 1e3,
        "floor_weights_read_ms": read_bytes / bandwidth * 1e3,
        "floor_ms_by_batch": per_batch,
        "method": "bandwidth = (bytes read + bytes written) / median time of 20 device-to-device "
        "copies of a random buffer (after 3 warm-up); floor_all_weights_ms = every weight byte "
        "(the issue's definition); floor_weights_read_ms leaves out the embedding table, of which "
        "a decode step reads B rows; floor_ms_by_batch adds the step's KV-cache read",
    }


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes read plus written per second by a large device-to-device copy (median of 20)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for i in range(23):
        if device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = begin.elapsed_time(end) / 1e3
        else:
            t = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t
        if i >= 3:
            times.append(seconds)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


# -- graphattn: requests ------------------------------------------------------------------


class RequestPool:
    """Requests of one engine, each with blocks for CONTEXT + 1 tokens: rows of one block table.

    Rows ``0 .. decode_rows-1`` decode; the rows after them carry the mixed part's prefill
    chunks. A decode step of rows R decodes one token at position CONTEXT for each.
    """

    def __init__(self, engine: ga.CompiledModel, s: Settings) -> None:
        self.context = s.context
        rows = s.decode_rows + s.mixed_chunks[1]
        width = s.blocks_per_request
        ids = engine.kv_cache.allocate(rows * width)
        self.block_table = np.array(ids, dtype=np.int32).reshape(rows, width)  # [N, W]
        self.decode_rows = s.decode_rows
        self.ones = np.ones(rows, np.int32)
        self.computed = np.full(rows, s.context, np.int32)
        self.widths = np.full(rows, width, np.int32)

    def decode_batch(self, rows: np.ndarray | slice, tokens: np.ndarray) -> ga.Batch:
        """One-token decodes at position CONTEXT for ``rows``; tokens: [B]."""
        b = len(tokens)
        table = self.block_table[rows]
        return ga.Batch.from_arrays(
            tokens, self.ones[:b], self.computed[:b], table, self.widths[:b]
        )

    def prefill(self, engine, rows: list[int], rng: np.random.Generator, s: Settings) -> None:
        """Write CONTEXT random tokens into each row, as steps of at most max_num_tokens
        tokens and max_num_seqs requests (a long prompt goes in chunks over several steps).
        """
        vocab = engine.model.vocab_size
        pending: list[tuple[int, int, int]] = []  # (row, computed, length)
        budget = s.max_num_tokens
        for row in rows:
            done = 0
            while done < self.context:
                n = min(self.context - done, budget)
                pending.append((row, done, n))
                done, budget = done + n, budget - n
                if budget == 0 or len(pending) == s.max_num_seqs:
                    self._run_chunks(engine, pending, rng, vocab)
                    pending, budget = [], s.max_num_tokens
        if pending:
            self._run_chunks(engine, pending, rng, vocab)
        synchronize(s.device)

    def chunk_batch(self, chunks: list[tuple[int, int, int]], tokens: np.ndarray) -> ga.Batch:
        """Requests (row, computed, length) with ``tokens`` [sum of lengths] back to back."""
        rows = [c[0] for c in chunks]
        return ga.Batch.from_arrays(
            tokens,
            np.array([c[2] for c in chunks], np.int32),
            np.array([c[1] for c in chunks], np.int32),
            self.block_table[rows],
            self.widths[rows],
        )

    def _run_chunks(self, engine, chunks, rng, vocab) -> None:
        tokens = random_tokens(rng, vocab, sum(c[2] for c in chunks))
        engine.step(self.chunk_batch(chunks, tokens))


# -- graphattn: engines ---------------------------------------------------------------------


def run_graphattn(model, key: str, parts: list[str], s: Settings, res: Results, cache_dir: str):
    """Build one engine, prefill what its parts need, run them, and let it go."""
    spec = ENGINE_SPECS[key]
    release(s.device)
    start = time.perf_counter()
    log(f"{spec.label}: building ({', '.join(parts)})")
    try:
        engine = ga.compile(model, **s.engine_kwargs(spec), cache_dir=cache_dir)
    except Exception as e:
        status = res.error(f"{spec.label}: build", e)
        for part in parts:
            place(res, part, spec, {"status": status})
        return
    info = engine_info(engine, spec, time.perf_counter() - start)
    log(f"{spec.label}: requested {spec.mode} -> resolved {info['resolved_mode']}")
    res.put("engines", spec.label, info)
    rng = np.random.default_rng(s.seed)
    pool = RequestPool(engine, s)
    try:
        pool.prefill(engine, rows_to_prefill(parts, s), rng, s)
    except Exception as e:
        status = res.error(f"{spec.label}: prefill", e)
        for part in parts:
            place(res, part, spec, {"status": status})
        return
    placed = {}
    for part in parts:
        t = time.perf_counter()
        try:
            entry = GRAPHATTN_PARTS[part](engine, pool, s, rng)
            entry["status"] = "ok"
        except Exception as e:
            entry = {"status": res.error(f"{spec.label}: {part}", e)}
        placed[part] = place(res, part, spec, entry | {"stats_after": stats_of(engine)})
        res.data["wall_seconds"][f"{spec.label}: {part}"] = time.perf_counter() - t
        res.save()  # a process that dies in a later part keeps this one
    if "latency" in placed:  # last: nothing of this process is timed after the profiler
        profile_first_batch(engine, pool, s, rng, res, placed["latency"])
        res.save()
    info["stats"] = stats_of(engine)
    res.data["wall_seconds"][spec.label] = time.perf_counter() - start
    res.save()
    del engine, pool
    release(s.device)


def rows_to_prefill(parts: list[str], s: Settings) -> list[int]:
    """Decode rows the parts read (all of them for host), then the mixed part's chunk rows."""
    used = [s.trace_max_batch] if "trace" in parts else []
    used += list(s.batch_sizes) if "latency" in parts else []
    used += [s.mixed_decodes[1]] if "mixed" in parts else []
    used += list(s.host_sizes) if "host" in parts else []
    rows = list(range(max(used, default=0)))
    if "mixed" in parts:
        rows += range(s.decode_rows, s.decode_rows + s.mixed_chunks[1])
    return rows


def engine_info(engine: ga.CompiledModel, spec: EngineSpec, seconds: float) -> dict:
    report = engine.report
    return {
        "requested_mode": spec.mode,
        "resolved_mode": str(engine.resolved_mode),
        "compile_backend": spec.compile_backend,
        "attention_backends": sorted({g.backend for g in report.groups}),
        "build_seconds": seconds,
        "report": report.to_dict(),
        "device_memory_allocated_mib": torch.cuda.memory_allocated() / 2**20
        if torch.cuda.is_available()
        else None,
    }


def stats_of(engine: ga.CompiledModel) -> dict:
    st = engine.stats
    return {
        "steps": st.steps,
        "runtime_modes": dict(st.runtime_modes),
        "fallbacks": dict(st.fallbacks),
        "recompiles": st.recompiles,
        "captures_after_startup": st.captures_after_startup,
    }


@contextlib.contextmanager
def stats_delta(engine: ga.CompiledModel) -> Iterator[dict]:
    """Yields a dict filled, on exit, with what the engine's counters did inside the block."""
    before = stats_of(engine)
    out: dict = {}
    yield out
    after = stats_of(engine)
    for key in ("runtime_modes", "fallbacks"):
        out[key] = dict(Counter(after[key]) - Counter(before[key]))
    for key in ("steps", "recompiles", "captures_after_startup"):
        out[key] = after[key] - before[key]


def place(res: Results, part: str, spec: EngineSpec, entry: dict) -> dict:
    """Put a graphattn part's entry where the table and the plot look for it; returns the
    entry as stored."""
    entry = {
        "label": spec.label,
        "system": "graphattn",
        "requested_mode": spec.mode,
        "compile_backend": spec.compile_backend,
    } | entry
    info = res.data.get("engines", {}).get(spec.label)
    if info:
        entry["resolved_mode"] = info["resolved_mode"]
        entry["attention_backends"] = info["attention_backends"]
    if part in ("latency", "mixed"):
        res.add_row(part, entry)
    elif part == "trace":
        res.put("trace", "graphattn", entry)
    else:
        res.put(part, "graphattn", entry)
    return entry


# -- graphattn: parts ---------------------------------------------------------------------


def graphattn_decode(engine, pool: RequestPool, rows, tokens: np.ndarray) -> Callable[[int], Any]:
    """``step(i)``: one decode step of ``rows`` with tokens[i] (step, logits, argmax)."""

    def step(i: int):
        hidden = engine.step(pool.decode_batch(rows, tokens[i]), clone=False)
        return ga.greedy(engine.compute_logits(hidden))

    return step


def time_graphattn_batch(engine, pool, b: int, s: Settings, rng) -> dict:
    tokens = random_tokens(rng, engine.model.vocab_size, (s.warmup + s.steps, b))
    with stats_delta(engine) as delta:
        timing = time_steps(
            graphattn_decode(engine, pool, slice(0, b), tokens), s.warmup, s.steps, s.device
        )
    return timing | {"stats": delta}


PROFILED_STEPS = 20


def device_kernels(step: Callable[[int], Any], first: int, steps: int) -> list[tuple]:
    """``step(first)`` .. ``step(first + steps - 1)`` under torch.profiler (CUDA): every
    kernel and copy as (start us, end us, name), in start order."""
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(first, first + steps):
            step(i)
        torch.cuda.synchronize()
    return sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0
    )


def kernel_summary(engine, pool, b: int, rng) -> dict:
    """Per step of ``b`` requests, over PROFILED_STEPS profiled steps: ``summarize_kernels``.
    A process whose step is slower shows here whether its kernels or the gaps between them
    took the time, and between which kernels the gaps are."""
    n = PROFILED_STEPS
    tokens = random_tokens(rng, engine.model.vocab_size, (n + 5, b))
    step = graphattn_decode(engine, pool, slice(0, b), tokens)
    for i in range(5):
        step(i)
    return summarize_kernels(device_kernels(step, 5, n), n)


LARGEST_GAPS = 5


def summarize_kernels(kernels: list[tuple[float, float, str]], steps: int) -> dict:
    """``kernels`` (start us, end us, name) in start order over ``steps`` steps, per step:
    their count and summed time, the idle time between consecutive kernels, how many start
    before the one before has ended (programmatic dependent launch at work), the span, and
    the LARGEST_GAPS pairs of consecutive kernels (by name) with the most idle time between
    them."""
    pairs = list(itertools.pairwise(kernels))
    gaps = [nxt[0] - cur[1] for cur, nxt in pairs]
    by_pair: dict[str, list[float]] = defaultdict(list)
    for (cur, nxt), gap in zip(pairs, gaps, strict=True):
        if gap > 0:
            by_pair[f"{_short(cur[2])[:40]} -> {_short(nxt[2])[:40]}"].append(gap)
    largest = sorted(by_pair.items(), key=lambda kv: -sum(kv[1]))[:LARGEST_GAPS]
    return {
        "steps": steps,
        "kernels_per_step": len(kernels) / steps,
        "kernel_us_per_step": sum(end - start for start, end, _ in kernels) / steps,
        "idle_us_per_step": sum(g for g in gaps if g > 0) / steps,
        "overlapping_per_step": sum(g < 0 for g in gaps) / steps,
        "span_us_per_step": (kernels[-1][1] - kernels[0][0]) / steps if kernels else 0.0,
        "largest_gaps": [
            {"between": pair, "us_per_step": sum(v) / steps, "per_step": len(v) / steps}
            for pair, v in largest
        ],
    }


def graphattn_latency(engine, pool, s: Settings, rng) -> dict:
    """Decode step latency at each batch size (the first B requests of the pool); the first
    batch size's kernels come later (``profile_first_batch``)."""
    per_batch, ms = {}, {}
    for b in s.batch_sizes:
        try:
            per_batch[str(b)] = time_graphattn_batch(engine, pool, b, s, rng)
            ms[str(b)] = per_batch[str(b)]["median_ms"]
        except Exception as e:
            per_batch[str(b)] = failure(f"graphattn bs {b}", e)
            ms[str(b)] = None
    return {"ms": ms, "by_batch": per_batch}


def profile_first_batch(engine, pool, s: Settings, rng, res: Results, latency: dict) -> None:
    """On CUDA with graphs, the first batch size's kernels (``kernel_summary``) into the
    latency entry, as ``by_batch[B]["kernels"]``. Run after every other part of the engine's
    process: after a torch.profiler session the process's graph launches stay slower (on
    the H200 a FULL step's launch took 62-100 us of host time after one, 19-34 us before
    it in the same process, round 17), which the host part and the host-bound steps of the
    traces would count.
    """
    b = s.batch_sizes[0]
    row = (latency.get("by_batch") or {}).get(str(b)) or {}
    if s.device != "cuda" or engine.report.resolved_mode == "NONE" or "median_ms" not in row:
        return
    try:
        row["kernels"] = kernel_summary(engine, pool, b, rng)
    except Exception as e:
        row["kernels"] = {"status": res.error(f"{latency['label']}: bs {b} kernels", e)}


def trace_plan(s: Settings) -> np.ndarray:
    """The trace's batch sizes: uniform in 1..trace_max_batch, seeded."""
    return np.random.default_rng(s.seed).integers(1, s.trace_max_batch + 1, size=s.trace_steps)


def graphattn_trace(engine, pool, s: Settings, rng) -> dict:
    """The continuous-batching trace: each step decodes a fresh random subset of the pool."""
    sizes = trace_plan(s)
    rows = [np.sort(rng.choice(s.trace_max_batch, size=b, replace=False)) for b in sizes]
    tokens = [random_tokens(rng, engine.model.vocab_size, b) for b in sizes]

    def step(i: int):
        hidden = engine.step(pool.decode_batch(rows[i], tokens[i]), clone=False)
        return ga.greedy(engine.compute_logits(hidden))

    with stats_delta(engine) as delta:
        out = run_trace(step, len(sizes), s.device)
    # the fixed-size step at the mean batch of the steps the per-step time covers (steps
    # 100 on; their mean differs from the whole trace's, 71.6 against 69.3 at the defaults)
    done = out["steps_done"]
    timed = sizes[100:done] if out["ms_per_step_after_100"] else sizes[:done]
    mean_b = round(float(timed.mean()))
    fixed = time_graphattn_batch(engine, pool, mean_b, s, rng)
    after = out["ms_per_step_after_100"] or out["ms_per_step_all"]
    return out | {
        "stats": delta,
        "distinct_sizes": len(set(sizes.tolist())),
        "mean_batch": float(sizes.mean()),
        "mean_batch_timed": float(timed.mean()),
        "fixed_mean_batch": {"batch": mean_b} | fixed,
        "ratio_to_fixed": after / fixed["mean_ms"],
    }


def mixed_plan(s: Settings, vocab: int, rng) -> list[tuple[list, np.ndarray]]:
    """Steps of decodes (random pool rows) followed by prefill chunks at random offsets of
    the chunk rows (their earlier tokens are cached): (requests, tokens) per step.
    """
    plan = []
    for _ in range(s.warmup + s.steps):
        d = int(rng.integers(s.mixed_decodes[0], s.mixed_decodes[1] + 1))
        k = int(rng.integers(s.mixed_chunks[0], s.mixed_chunks[1] + 1))
        requests = [(int(r), s.context, 1) for r in rng.choice(s.mixed_decodes[1], d, False)]
        for j in range(k):
            n = int(rng.integers(s.mixed_chunk_len[0], s.mixed_chunk_len[1] + 1))
            offset = int(rng.integers(0, s.context - n + 1))
            requests.append((s.decode_rows + j, offset, n))
        plan.append((requests, random_tokens(rng, vocab, sum(r[2] for r in requests))))
    return plan


def graphattn_mixed(engine, pool, s: Settings, rng) -> dict:
    """Mixed steps (prefill chunks with decodes): step + logits of each request's last token."""
    plan = mixed_plan(s, engine.model.vocab_size, rng)
    batches = [pool.chunk_batch(requests, tokens) for requests, tokens in plan]
    ends = [
        torch.from_numpy(np.cumsum(b.query_lens) - 1).to(s.device) for b in batches
    ]  # [R]: each request's last token

    def step(i: int):
        hidden = engine.step(batches[i], clone=False)
        return ga.greedy(engine.compute_logits(hidden.index_select(0, ends[i])))

    with stats_delta(engine) as delta:
        timing = time_steps(step, s.warmup, s.steps, s.device)
    timed = batches[s.warmup :]
    tokens = sum(b.num_tokens for b in timed)
    return timing | {
        "stats": delta,
        "tokens_per_s": tokens / (timing["mean_ms"] * s.steps / 1e3),
        "mean_tokens_per_step": tokens / len(timed),
        "mean_requests_per_step": sum(b.num_reqs for b in timed) / len(timed),
    }


# check_batch: the batch's checks, the module function the runner's execute calls first
# (check_step since round 42, which also hands the decode blocks to prepare_inputs; the
# phase keeps its name so the JSON compares with earlier rounds)
HOST_PHASES = (
    "check_batch",
    "prepare_inputs",
    "common_metadata",
    "build_metadata",
    "forward",
    "restore_order",
)
_CHECK_FUNCTION = "check_step"  # the runner module's name for the check_batch phase
NESTED_PHASE = "graph_replay"  # timed within the forward phase, not summed with the others
_AFTER_FORWARD = HOST_PHASES.index("forward") + 1
HOST_COLUMNS = (*HOST_PHASES[:_AFTER_FORWARD], NESTED_PHASE, *HOST_PHASES[_AFTER_FORWARD:], "other")


def _timed(fn: Callable, out: list[float]) -> Callable:
    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            out.append(time.perf_counter() - t)

    return timed


@contextlib.contextmanager
def phase_timers(runner) -> Iterator[dict[str, list[float]]]:
    """Wrap the runner's step phases that exist (its methods, and the module's
    ``check_batch``) with host timers (seconds per call)."""
    times: dict[str, list[float]] = {}
    saved, module = {}, sys.modules[type(runner).__module__]
    for name in HOST_PHASES:
        owner, attr = (module, _CHECK_FUNCTION) if name == "check_batch" else (runner, name)
        fn = getattr(owner, attr, None)
        if not callable(fn):
            continue
        saved[attr] = (owner, owner.__dict__.get(attr))
        times[name] = []
        setattr(owner, attr, _timed(fn, times[name]))
    # Inside the forward phase: the graph replay itself (the driver's cudaGraphLaunch), timed
    # on the class so every captured graph's replay counts.
    graph_class = torch.cuda.CUDAGraph
    replay = graph_class.__dict__.get("replay")
    if replay is not None:
        times[NESTED_PHASE] = []
        graph_class.replay = _timed(replay, times[NESTED_PHASE])
    try:
        yield times
    finally:
        for name, (owner, original) in saved.items():
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        if replay is not None:
            graph_class.replay = replay


def host_step_times(
    engine, batches: list[ga.Batch], device: str, clone: bool = False
) -> list[float]:
    """Host seconds of engine.step per batch, each started on an idle GPU (synchronized
    before), so no wait on earlier device work is counted; the step's GPU work runs after.
    """
    out = []
    for batch in batches:
        synchronize(device)
        t = time.perf_counter()
        engine.step(batch, clone=clone)
        out.append(time.perf_counter() - t)
    synchronize(device)
    return out


# The host part's sizes take turns over this many rounds: on the H200's leases the host
# changed speed 2-3x between passes of 200 steps (round 20), and a size whose steps all ran
# in one pass took whatever state that pass fell in.
HOST_ROUNDS = 5


def graphattn_host(engine, pool, s: Settings, rng) -> dict:
    """Host overhead per decode step at each request count (see ``method``)."""
    vocab = engine.model.vocab_size
    tokens = {n: random_tokens(rng, vocab, (s.host_iters + 20, n)) for n in s.host_sizes}
    batches = {n: [pool.decode_batch(slice(0, n), t) for t in tokens[n]] for n in s.host_sizes}
    runs = {n: _HostRuns() for n in s.host_sizes}
    for n in s.host_sizes:
        with stats_delta(engine) as delta:
            host_step_times(engine, batches[n][:20], s.device)
        runs[n].add_stats(delta)
    for chunk in host_rounds(s.host_iters, HOST_ROUNDS):
        for n in s.host_sizes:
            runs[n].run(engine, [batches[n][20 + i] for i in chunk], s.device)
    by_size = {}
    for n in s.host_sizes:
        by_size[str(n)] = runs[n].summary() | {
            "from_arrays_us": time_batch_building(pool, tokens[n], n, arrays=True),
            "from_requests_us": time_batch_building(pool, tokens[n], n, arrays=False),
        }
    return {
        "by_requests": by_size,
        "method": "engine.step on decode batches prebuilt with Batch.from_arrays, timed with "
        "perf_counter on the host, each step started after torch.cuda.synchronize() so the "
        "GPU is idle and nothing waits on earlier device work; the time is batch "
        "preparation, validation, metadata build and dispatch (launching the graph or "
        "kernels) without the GPU work, with clone=False as the latency steps run it "
        "(step_cloned_us: the same steps with the default clone=True, which copies a "
        "graph's output rows into a new tensor). Median of host_iters steps after 20 "
        f"warm-up. The sizes take turns over {HOST_ROUNDS} rounds, each running a share "
        "of every size's steps three times (plain, cloned, phase-timed), so a host that "
        "changes speed during the part weighs on every size alike; step_us_by_round: "
        "each round's median of the plain steps. "
        "Phases come from the phase-timed runs, with timers wrapped around the runner's "
        "methods and the check_batch call (other = step - phases: the copies-done wait, "
        "the inference-mode guard, the stats and the timers' own calls); graph_replay, "
        "within the forward phase, is CUDAGraph.replay alone (the driver's graph launch), "
        "where a step replays one graph. "
        "from_arrays/from_requests: the caller's batch building, timed apart.",
    }


def host_rounds(iters: int, rounds: int) -> list[range]:
    """``range(iters)`` cut into at most ``rounds`` consecutive chunks of near-equal size."""
    rounds = max(1, min(rounds, iters))
    bounds = [iters * r // rounds for r in range(rounds + 1)]
    return [range(lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo]


class _HostRuns:
    """One request count's host timings, gathered over the part's rounds."""

    def __init__(self) -> None:
        self.totals: list[float] = []
        self.cloned: list[float] = []
        self.wrapped: list[float] = []
        self.phases: dict[str, list[float]] = {}
        self.dropped: set[str] = set()  # phases not called once a step in some round
        self.round_medians: list[float] = []
        self.stats: dict = {}

    def run(self, engine, batches: list[ga.Batch], device: str) -> None:
        with stats_delta(engine) as delta:
            totals = host_step_times(engine, batches, device)
            self.cloned += host_step_times(engine, batches, device, clone=True)
            with phase_timers(engine.runner) as phases:
                wrapped = host_step_times(engine, batches, device)
        self.add_stats(delta)
        self.totals += totals
        self.round_medians.append(statistics.median(totals) * 1e6)
        for name, values in phases.items():
            if len(values) == len(wrapped):  # one call a step (a replay per FULL step)
                self.phases.setdefault(name, []).extend(values)
            else:
                self.dropped.add(name)
        self.wrapped += wrapped

    def add_stats(self, delta: dict) -> None:
        for key, value in delta.items():
            if isinstance(value, dict):
                counts = Counter(self.stats.get(key, {}))
                counts.update(value)
                self.stats[key] = dict(counts)
            else:
                self.stats[key] = self.stats.get(key, 0) + value

    def summary(self) -> dict:
        out = {
            "step_us": us_summary(self.totals),
            "step_cloned_us": us_summary(self.cloned),
            "step_us_by_round": self.round_medians,
            "stats": self.stats,
            "phases_us": {},
        }
        complete = {
            k: v
            for k, v in self.phases.items()
            if k not in self.dropped and len(v) == len(self.wrapped)
        }
        for name, values in complete.items():
            out["phases_us"][name] = statistics.median(values) * 1e6
        summed = [p for p in complete if p != NESTED_PHASE]
        if summed:
            sums = np.sum([complete[p] for p in summed], axis=0)
            out["phases_us"]["other"] = float(np.median(np.array(self.wrapped) - sums)) * 1e6
        return out


def us_summary(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "median": statistics.median(ordered) * 1e6,
        "p10": ordered[len(ordered) // 10] * 1e6,
        "p90": ordered[(9 * len(ordered)) // 10] * 1e6,
    }


def time_batch_building(pool: RequestPool, tokens: np.ndarray, n: int, arrays: bool) -> float:
    """Median microseconds of Batch.from_arrays (or from_requests) for n decode requests."""
    table = pool.block_table[:n]
    requests = [
        [ga.Request([int(t)], pool.context, table[i].tolist()) for i, t in enumerate(row)]
        for row in tokens
    ]
    times = []
    for row, reqs in zip(tokens, requests):
        t = time.perf_counter()
        if arrays:
            pool.decode_batch(slice(0, n), row)
        else:
            ga.Batch.from_requests(reqs)
        times.append(time.perf_counter() - t)
    return statistics.median(times[len(times) // 10 :]) * 1e6


GRAPHATTN_PARTS = {
    "latency": graphattn_latency,
    "trace": graphattn_trace,
    "mixed": graphattn_mixed,
    "host": graphattn_host,
}


# -- baseline -----------------------------------------------------------------------------

BASELINE_LABELS = {
    "eager": "baseline eager",
    "compile": "baseline torch.compile",
    "reduce-overhead": "baseline reduce-overhead",
}


class CudagraphCounter:
    """Counts CUDA graphs recorded by torch.compile's cudagraph trees while installed."""

    def __init__(self) -> None:
        self.recordings = 0
        self.available = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[CudagraphCounter]:
        try:
            from torch._inductor.cudagraph_trees import CUDAGraphTreeManager
        except ImportError:
            yield self
            return
        original = CUDAGraphTreeManager.record_function
        counter = self

        def record_function(manager, *args, **kwargs):
            counter.recordings += 1
            return original(manager, *args, **kwargs)

        CUDAGraphTreeManager.record_function = record_function
        self.available = True
        try:
            yield self
        finally:
            CUDAGraphTreeManager.record_function = original


def inductor_counter(group: str, name: str) -> int:
    from torch._dynamo.utils import counters

    return int(counters[group][name])


def baseline_step_fn(base: StaticLlama, kind: str, dynamic: bool, device: str):
    """``step(tokens, positions) -> next tokens`` for the baseline under ``kind``."""
    if kind == "reduce-overhead" and device != "cuda":
        raise RuntimeError("reduce-overhead records CUDA graphs; it needs CUDA")

    def forward_argmax(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return base(tokens, positions).argmax(-1)

    if kind == "eager":
        fn = forward_argmax
    else:  # the argmax compiled (and captured) with the model, as a user would write it
        mode = "default" if kind == "compile" else kind
        fn = torch.compile(forward_argmax, mode=mode, fullgraph=True, dynamic=dynamic)
    mark = kind == "reduce-overhead"

    def step(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if mark:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            return fn(tokens, positions)

    return step


def build_baseline(model: LlamaForCausalLM, s: Settings, rng) -> StaticLlama:
    """The static-cache copy of ``model``, its rows prefilled with CONTEXT random tokens."""
    rows = max(*s.batch_sizes, s.trace_max_batch)
    max_len = -(-(s.context + 1) // BLOCK_SIZE) * BLOCK_SIZE
    base = StaticLlama.from_graphattn(model, max_batch=rows, max_len=max_len)
    for t in [*base.cache_tensors(), base.cos_sin]:
        torch._dynamo.mark_static_address(t)  # graphs read the caches in place
    vocab = model.vocab_size
    for first in range(0, rows, 16):
        n = min(16, rows - first)
        prompt = torch.from_numpy(random_tokens(rng, vocab, (n, s.context))).to(s.device)
        base.prefill(prompt, first_row=first)
    synchronize(s.device)
    return base


def baseline_latency(base: StaticLlama, kind: str, s: Settings, rng, deadline: Deadline) -> dict:
    """Step latency at each batch size, compiled afresh per size (fixed shapes)."""
    row = {"label": BASELINE_LABELS[kind], "system": "baseline", "mode": kind, "ms": {}}
    row["by_batch"] = {}
    for b in s.batch_sizes:
        key = str(b)
        if deadline.passed():
            row["by_batch"][key], row["ms"][key] = {"status": deadline.status}, None
            continue
        try:
            row["by_batch"][key] = time_baseline_batch(base, kind, b, s, rng)
            row["ms"][key] = row["by_batch"][key]["median_ms"]
        except Exception as e:
            row["by_batch"][key] = failure(f"{row['label']} bs {b}", e)
            row["ms"][key] = None
    ok = [v for v in row["ms"].values() if v is not None]
    row["status"] = "ok" if ok else next(iter(row["by_batch"].values()))["status"]
    return row


def time_baseline_batch(base: StaticLlama, kind: str, b: int, s: Settings, rng) -> dict:
    release(s.device)
    step = baseline_step_fn(base, kind, dynamic=False, device=s.device)
    vocab = base.config.vocab_size
    n = s.warmup + s.steps
    tokens = [torch.from_numpy(t).to(s.device) for t in random_tokens(rng, vocab, (n, b))]
    positions = torch.full((b,), s.context, device=s.device)
    skips = inductor_counter("inductor", "cudagraph_skips")
    with CudagraphCounter().installed() as graphs:
        timing = time_steps(lambda i: step(tokens[i], positions), s.warmup, s.steps, s.device)
    timing["cudagraph_skips"] = inductor_counter("inductor", "cudagraph_skips") - skips
    if graphs.available:
        timing["cudagraph_recordings"] = graphs.recordings
    return timing


def baseline_trace(
    base: StaticLlama,
    s: Settings,
    rng,
    deadline: Deadline,
    progress: Callable[[dict], None] | None = None,
) -> dict:
    """The trace under reduce-overhead with a dynamic batch (rows 0..B-1), within a budget:
    ``--trace-budget``, cut to what ``--time-limit`` leaves (at least 30 s). ``progress`` is
    ``run_trace``'s.

    Without CUDA (smoke) torch.compile's default mode with a dynamic batch stands in.
    """
    budget = min(s.trace_budget_s, max(30.0, deadline.left()))
    kind = "reduce-overhead" if s.device == "cuda" else "compile"
    release(s.device)
    step = baseline_step_fn(base, kind, dynamic=True, device=s.device)
    sizes = trace_plan(s)
    vocab = base.config.vocab_size
    tokens = [torch.from_numpy(random_tokens(rng, vocab, b)).to(s.device) for b in sizes]
    positions = torch.full((s.trace_max_batch,), s.context, device=s.device)
    graphs_before = inductor_counter("stats", "unique_graphs")
    with CudagraphCounter().installed() as graphs:
        out = run_trace(
            lambda i: step(tokens[i], positions[: sizes[i]]),
            len(sizes),
            s.device,
            budget,
            progress,
        )
    done = sizes[: out["steps_done"]]
    out |= {
        "label": f"baseline {kind} dynamic=True",
        "system": "baseline",
        "mode": kind,
        "status": "ok",
        "distinct_sizes_done": len(set(done.tolist())),
        "dynamo_graphs_compiled": inductor_counter("stats", "unique_graphs") - graphs_before,
    }
    if graphs.available:
        out["cudagraph_recordings"] = graphs.recordings
    if kind != "reduce-overhead":
        out["note"] = "smoke stand-in: reduce-overhead needs CUDA"
    return out


def run_baselines(model, s: Settings, res: Results, deadline: Deadline) -> None:
    """The selected baselines, most needed first (the issue's targets compare against
    reduce-overhead): eager, reduce-overhead and torch.compile latency, then the
    reduce-overhead trace, so that ``--time-limit`` cuts the least needed. The trace goes
    last because its budget is checked between steps and its first step (a compile for
    dynamic shapes) took 100-150 s on the H200 machine, past any budget: run before
    torch.compile's latency, it left that no time in rounds 14 and 15.
    """
    kinds = s.baselines if "latency" in s.parts else ()
    trace = "trace" in s.parts and "reduce-overhead" in s.baselines
    if not kinds and not trace:
        return
    release(s.device)
    rng = np.random.default_rng(s.seed + 1)
    start = time.perf_counter()
    try:
        base = build_baseline(model, s, rng)
    except Exception as e:
        status = res.error("baseline: build", e)
        for kind in kinds:
            res.add_row("latency", {"label": BASELINE_LABELS[kind], "status": status})
        if trace:
            res.put("trace", "baseline", {"label": "baseline", "status": status})
        return
    jobs = [k for k in ("eager", "reduce-overhead", "compile") if k in kinds] + ["trace"] * trace
    for job in jobs:
        t = time.perf_counter()
        log(f"baseline: {job}")
        if job == "trace":
            # Saved first: if the process is stopped inside the trace (--config-timeout; its
            # first step is a long compile), the parent says how far it had got.
            res.put(
                "trace",
                "baseline",
                {"label": "baseline", "status": RUNNING, "began_s": t - deadline.start},
            )
            res.save()
            res.put("trace", "baseline", baseline_trace_entry(base, s, rng, deadline, res))
        else:
            res.add_row("latency", baseline_latency(base, job, s, rng, deadline))
        res.data["wall_seconds"][f"baseline {job}"] = time.perf_counter() - t
        res.save()
    res.data["wall_seconds"]["baseline"] = time.perf_counter() - start
    del base
    release(s.device)


RUNNING = "running"  # a trace row's status while it runs (run_baselines)


def stopped_while_running(res: Results, status: str, now_s: float) -> None:
    """Replace a baseline trace row left ``RUNNING`` by a process stopped from outside with
    ``status`` and how long the trace had run (``now_s``: seconds since the run began, as the
    row's ``began_s``)."""
    row = res.data.get("trace", {}).get("baseline")
    if not row or row.get("status") != RUNNING:
        return
    ran = now_s - row["began_s"]
    got = ""
    if sofar := row.get("progress"):
        got = f" ({sofar['steps_done']} step(s) done, the first in {sofar['first_step_s']:.1f} s"
        if sofar.get("first_100_s") is not None:
            got += f", the first 100 in {sofar['first_100_s']:.1f} s"
        got += ")"
    res.put(
        "trace",
        "baseline",
        row
        | {
            "status": f"{status}: stopped {ran:.0f} s into the trace, before it ended{got}",
            "ran_s": ran,
        },
    )


def baseline_trace_entry(base, s: Settings, rng, deadline: Deadline, res: Results) -> dict:
    if deadline.left() < 30:
        return {"label": "baseline", "status": deadline.status}

    def progress(sofar: dict) -> None:
        # the row saved as running (run_baselines) gains how far the trace has got
        res.put("trace", "baseline", res.data["trace"]["baseline"] | {"progress": sofar})
        res.save()

    try:
        return baseline_trace(base, s, rng, deadline, progress)
    except Exception as e:
        return {"label": "baseline", "status": res.error("baseline: trace", e)}


# -- start-up -------------------------------------------------------------------------------


# The start-up processes: name -> whether Python may cache bytecode under the cache folder.
STARTUP_PROCESSES = (("cold", True), ("warm", True), ("warm_no_pyc", False))


def run_startup(s: Settings, res: Results, root: Path) -> None:
    """Cold and warm start of the startup engine, each in a fresh process (see ``method``).

    ``root`` must be empty; the caches the processes leave in it stay there.
    """
    spec = ENGINE_SPECS[s.part_engines["startup"][0]]
    base = os.environ | {
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "TRITON_CACHE_DIR": str(root / "triton"),
    }
    base.pop("PYTHONDONTWRITEBYTECODE", None)
    job = {"settings": settings_to_json(s), "spec": spec.key, "cache_dir": str(root / "graphattn")}
    out: dict[str, Any] = {"label": spec.label, "requested_mode": spec.mode}
    try:
        for name, pyc in STARTUP_PROCESSES:
            log(f"start-up: {name} process")
            profile = (
                {"profile": f"{s.profile_startup}/startup-{name}"} if s.profile_startup else {}
            )
            if pyc:  # Python's bytecode cache under the fresh root: the cold process fills it
                env = base | {"PYTHONPYCACHEPREFIX": str(root / "pycache")}
            else:  # the GPU machine's own state: no bytecode written, only what the install has
                env = {k: v for k, v in base.items() if k != "PYTHONPYCACHEPREFIX"}
                env["PYTHONDONTWRITEBYTECODE"] = "1"
            cubins = count_cubins(root / "triton")
            out[name] = run_child(job | profile, env, s.startup_timeout_s)
            # a warm process that writes kernels to Triton's cache compiled them (round 26:
            # a ptxas that changed between processes made the warm one compile 15 again)
            out[name]["triton_compiles"] = count_cubins(root / "triton") - cubins
        failed = [out[n]["status"] for n, _ in STARTUP_PROCESSES if out[n].get("status") != "ok"]
        out["status"] = failed[0] if failed else "ok"
    except Exception as e:
        out["status"] = res.error("startup", e)
    out["method"] = (
        "fresh processes build the same engine (model init not counted) with one new, empty "
        "cache folder: graphattn's cache_dir, TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR and "
        "Python's bytecode cache (PYTHONPYCACHEPREFIX) all under it. cold = the first process, "
        "warm = the second. The prefix makes Python ignore every __pycache__ folder, so the "
        "cold process compiles (and writes) the bytecode of every module it imports, the "
        "standard library's included. warm_no_pyc = a third process without the prefix and "
        "with PYTHONDONTWRITEBYTECODE=1: Python reads only the .pyc files the installs hold "
        "and writes none, the GPU machine's own setting (its torch install holds none, so "
        "every torch module is compiled from source in every process). compile/capture "
        "seconds and graph MiB are the engine's report; ga_compile_s is the wall time of "
        "ga.compile; process_s the child's whole life (imports, CUDA init); triton_compiles "
        "the .cubin files the process added to Triton's cache (kernels it compiled: a warm "
        "process should add none)."
    )
    res.put("startup", "graphattn", out)
    res.save()


def count_cubins(folder: Path) -> int:
    """Compiled kernels in a Triton cache folder (one ``.cubin`` per kernel compiled)."""
    return sum(1 for _ in folder.rglob("*.cubin")) if folder.is_dir() else 0


def run_child(job: dict, env: dict, timeout_s: float) -> dict:
    """Run this script in ``--startup-child`` mode; returns the JSON it printed last."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--startup-child", json.dumps(job)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": f"unavailable: no answer within --startup-timeout {timeout_s:.0f} s"}
    seconds = time.perf_counter() - start
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("STARTUP_JSON ")]
    if proc.returncode != 0 or not lines:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return {"status": f"unavailable: child exited {proc.returncode}: {tail[:400]}"}
    return json.loads(lines[-1].removeprefix("STARTUP_JSON ")) | {"process_s": seconds}


def startup_child(job_json: str) -> int:
    """Build the engine once and print what start-up took as one JSON line."""
    job = json.loads(job_json)
    s = settings_from_json(job["settings"])
    limit_cpu_threads(s)
    spec = ENGINE_SPECS[job["spec"]]
    model = build_model(s)
    synchronize(s.device)
    profiler = cProfile.Profile() if job.get("profile") else None
    start = time.perf_counter()
    try:
        if profiler is not None:
            profiler.enable()
        engine = ga.compile(model, **s.engine_kwargs(spec), cache_dir=job["cache_dir"])
    except Exception as e:
        print("STARTUP_JSON " + json.dumps({"status": unavailable(e)}), flush=True)
        return 0
    finally:
        if profiler is not None:
            profiler.disable()
    synchronize(s.device)
    seconds = time.perf_counter() - start
    if profiler is not None:
        write_profile(profiler, Path(job["profile"]))
    report = engine.report
    out = {
        "status": "ok",
        "resolved_mode": str(engine.resolved_mode),
        "ga_compile_s": seconds,
        "compile": report.compile,
        "capture": report.capture,
        "compile_s": report.compile.get("seconds"),
        "compile_warm": report.compile.get("warm"),
        "capture_s": report.capture.get("seconds"),
        "graph_memory_mib": report.capture.get("graph_memory_mib"),
        "capture_sizes": report.capture.get("sizes"),
        "startup_seconds": report.startup_seconds,
        "fallbacks": [str(f) for f in report.fallbacks],
    }
    print("STARTUP_JSON " + json.dumps(out, default=str), flush=True)
    return 0


def write_profile(profiler: cProfile.Profile, path: Path) -> None:
    """``path``.txt: the top functions by cumulative and by own time; ``path``.prof: the
    whole profile (``pstats.Stats(path)``, for callers and callees)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(f"{path}.prof")
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(80)
    stats.sort_stats("tottime").print_stats(40)
    Path(f"{path}.txt").write_text(text.getvalue())


def limit_cpu_threads(s: Settings) -> None:
    """One intra-op thread for a CPU run: its timings are no results anyway, and on a small
    shared machine a second thread waiting for a busy core made the smoke run 10x slower.
    """
    if s.device == "cpu":
        torch.set_num_threads(1)


def settings_to_json(s: Settings) -> dict:
    return dataclasses.asdict(s) | {"dtype": str(s.dtype).removeprefix("torch.")}


def settings_from_json(d: dict) -> Settings:
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in fields}
    values["dtype"] = getattr(torch, d["dtype"])
    return Settings(**values)


# -- the run --------------------------------------------------------------------------------


def run(s: Settings, out_path: Path, plot_path: Path | None) -> int:
    """Every selected part, start-up first: its processes get the GPU to themselves and
    leave a warm graphattn compile cache that the engines built after them then load.
    """
    if s.smoke:
        print(SMOKE_NOTE, flush=True)
    res = Results(out_path, run_meta(s))
    deadline = Deadline(s.time_limit_s, res.start)
    root = Path(tempfile.mkdtemp(prefix="graphattn-bench-"))
    try:
        if "startup" in s.parts:
            run_startup(s, res, root)
        if {"floor", "latency", "trace", "mixed", "host"} & set(s.parts):
            run_configs = run_isolated if s.isolate else run_in_process
            run_configs(s, res, deadline, str(root / "graphattn"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    log("done")
    res.data["wall_seconds"]["total"] = time.perf_counter() - res.start
    res.data["targets"] = check_targets(res.data)
    res.save()
    if plot_path is not None:
        write_plot(res.data, plot_path)
    print_table(res.data, out_path)
    return 0


ISOLATION = (
    "each configuration (the floor, each graphattn engine, the baselines together) ran in "
    "its own process, one after another: a CUDA graph replays slower in a process that has "
    "captured many other graphs (the PIECEWISE engine's hundreds made a FULL engine built "
    "after it 1-3% slower at batch 1 and 5-7% at batch 8 on an H200; docs/performance-history.md, "
    "'Graphs in the process'), so no configuration pays for the graphs of the ones before it"
)


def configurations(s: Settings) -> list[str]:
    """The run's configurations in order: "floor", "engine:KEY"..., "baselines"."""
    jobs = ["floor"] if "floor" in s.parts else []
    jobs += [f"engine:{key}" for key, _ in engine_schedule(s)]
    if ("latency" in s.parts and s.baselines) or (
        "trace" in s.parts and "reduce-overhead" in s.baselines
    ):
        jobs.append("baselines")
    return jobs


def run_config(model, job: str, s: Settings, res: Results, deadline: Deadline, cache_dir: str):
    """One configuration of ``configurations(s)``, in this process."""
    kind, _, key = job.partition(":")
    if kind == "floor":
        try:
            res.put("floor", "result", measure_floor(model, s))
        except Exception as e:
            res.put("floor", "result", {"status": res.error("floor", e)})
        res.save()
    elif kind == "engine":
        if deadline.passed():
            skip_engine(res, s, key, deadline.status)
        else:
            run_graphattn(model, key, engine_parts(s, key), s, res, cache_dir)
    else:
        run_baselines(model, s, res, deadline)


def engine_parts(s: Settings, key: str) -> list[str]:
    """The parts engine ``key`` serves in this run (``engine_schedule``)."""
    return dict(engine_schedule(s))[key]


def skip_engine(res: Results, s: Settings, key: str, status: str) -> None:
    for part in engine_parts(s, key):
        place(res, part, ENGINE_SPECS[key], {"status": status})


def run_in_process(s: Settings, res: Results, deadline: Deadline, cache_dir: str) -> None:
    """Every configuration in this process (``--no-isolate``; the smoke run's default)."""
    model = build_model(s)
    for job in configurations(s):
        run_config(model, job, s, res, deadline, cache_dir)
    del model
    release(s.device)


def run_isolated(s: Settings, res: Results, deadline: Deadline, cache_dir: str) -> None:
    """Every configuration in a fresh process of this script (``--config-child``), its
    results merged into ``res`` (see ``ISOLATION``). The processes share the run's clock:
    ``--time-limit`` counts from the run's start in each of them."""
    res.data["meta"]["isolation"] = ISOLATION
    run_start_wall = time.time() - (time.perf_counter() - deadline.start)
    child_settings = settings_to_json(dataclasses.replace(s, isolate=False))
    work = Path(tempfile.mkdtemp(prefix="graphattn-configs-"))
    try:
        for n, job in enumerate(configurations(s)):
            kind, _, key = job.partition(":")
            if kind == "engine" and deadline.passed():
                skip_engine(res, s, key, deadline.status)
                continue
            out = work / f"{n}.json"
            spec = {
                "settings": child_settings,
                "job": job,
                "cache_dir": cache_dir,
                "run_start_wall": run_start_wall,
            }
            log(f"{job}: own process")
            status = run_config_process(spec, out, s.config_timeout_s)
            if out.exists():
                child = json.loads(out.read_text())
                merge_child(res, child)
                res.data["meta"].setdefault("config_pids", {})[job] = child["meta"].get("pid")
                if status:
                    stopped_while_running(res, status, time.perf_counter() - deadline.start)
                    status += " after writing what it measured"
            if status:
                fail_config(res, job, s, status)
            res.save()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_config_process(spec: dict, out: Path, timeout_s: float) -> str | None:
    """Run ``--config-child`` for ``spec``; None when it exited 0, else why not."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--config-child", json.dumps(spec)]
    # its own session: on a timeout the whole group goes (Inductor's compile workers too)
    proc = subprocess.Popen(
        [*cmd, "--out", str(out)], stdout=subprocess.DEVNULL, start_new_session=True
    )
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return f"unavailable: no answer within --config-timeout {timeout_s:.0f} s"
    return None if code == 0 else f"unavailable: its process exited {code}"


def config_child(spec_json: str, out: Path) -> int:
    """``--config-child``: run one configuration; its results go to ``out`` (JSON)."""
    global _LOG_START
    spec = json.loads(spec_json)
    s = settings_from_json(spec["settings"])
    limit_cpu_threads(s)
    # the run's clock: its deadline and log times go on from the parent's
    _LOG_START = time.perf_counter() - (time.time() - spec["run_start_wall"])
    res = Results(out, {"config": spec["job"], "pid": os.getpid()})
    deadline = Deadline(s.time_limit_s, _LOG_START)
    model = build_model(s)
    run_config(model, spec["job"], s, res, deadline, spec["cache_dir"])
    res.save()
    return 0


def merge_child(res: Results, child: dict) -> None:
    """A configuration process's results into the run's: rows appended, entries set."""
    for part, entry in child.items():
        if part == "meta":
            continue
        if part == "errors":
            res.data["errors"] += entry
        elif isinstance(entry, dict):
            for key, value in entry.items():
                if key == "rows":
                    res.data.setdefault(part, {}).setdefault("rows", []).extend(value)
                else:
                    res.put(part, key, value)


def fail_config(res: Results, job: str, s: Settings, status: str) -> None:
    """Mark what ``job`` should have measured and did not write as ``status``."""
    res.data["errors"].append({"where": job, "status": status, "traceback": ""})
    log(f"{job}: {status}")
    kind, _, key = job.partition(":")
    if kind == "floor":
        res.data.setdefault("floor", {}).setdefault("result", {"status": status})
    elif kind == "engine":
        spec = ENGINE_SPECS[key]
        for part in engine_parts(s, key):
            done = {r.get("label") for r in res.data.get(part, {}).get("rows", [])}
            if part in ("latency", "mixed") and spec.label in done:
                continue
            if part in ("trace", "host") and "graphattn" in res.data.get(part, {}):
                continue
            place(res, part, spec, {"status": status})
    else:
        done = {r.get("label") for r in res.data.get("latency", {}).get("rows", [])}
        if "latency" in s.parts:
            for baseline in s.baselines:
                if BASELINE_LABELS[baseline] not in done:
                    res.add_row("latency", {"label": BASELINE_LABELS[baseline], "status": status})
        trace = res.data.get("trace", {})
        if "trace" in s.parts and "reduce-overhead" in s.baselines and "baseline" not in trace:
            res.put("trace", "baseline", {"label": "baseline", "status": status})


@dataclass
class Deadline:
    """``--time-limit``: no configuration starts after it; what is left is marked skipped."""

    limit_s: float
    start: float

    def left(self) -> float:
        return self.limit_s - (time.perf_counter() - self.start)

    def passed(self) -> bool:
        return self.left() <= 0

    @property
    def status(self) -> str:
        return f"skipped: --time-limit {self.limit_s:.0f} s reached"


def engine_schedule(s: Settings) -> list[tuple[str, list[str]]]:
    """Each graphattn engine the selected parts need, once, with the parts it serves."""
    order = ["eager", "NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE"]
    plan = []
    for key in order:
        parts = [
            p
            for p in ("latency", "trace", "mixed", "host")
            if p in s.parts and key in s.part_engines[p]
        ]
        if parts:
            plan.append((key, parts))
    return plan


def run_meta(s: Settings) -> dict:
    cfg = model_config(s.smoke)
    return {
        "smoke": s.smoke,
        "note": SMOKE_NOTE if s.smoke else "",
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name()
        if s.device == "cuda"
        else f"cpu ({platform.machine()})",
        "torch": torch.__version__,
        "triton": _version("triton"),
        "graphattn": ga.__version__,
        "commit": _git_commit(),
        # the library's own files as they ran: the commit above is the checkout's git, which
        # a copied tree may not have brought up to date (round 12's device copies did not)
        "source_sha256": _source_digest(),
        # programmatic dependent launch in graphattn's kernels (kernels/pdl.py; GRAPHATTN_PDL)
        "pdl": use_pdl(torch.device(s.device)),
        # graphattn's variables that may change what runs, where set (run_variables)
        "env": run_variables(os.environ),
        # what the opt-in prefetch_next_weight pass asks for, set or not (envs.py)
        "prefetch_mib": prefetch_mib(),
        # where split-KV results merge: in the attention launch or a reduction kernel
        "split_kv_merge": describe_merge(),
        "python": platform.python_version(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "model": dataclasses.asdict(cfg),
        "settings": settings_to_json(s),
        "step_definition": STEP_DEFINITION.replace("CONTEXT", str(s.context)),
        "timing": "CUDA events around each step after warm-up; medians; fresh random token "
        "ids every step; JSON mean_ms = wall time of the timed steps back to back / steps",
    }


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or None
    except Exception:
        return None


def _source_digest() -> str:
    """sha256 (first 16 hex digits) of graphattn's Python sources: every ``.py`` file under
    graphattn/, passes/ and capture/ of the checkout, its relative path and bytes, in sorted
    order (two trees with the same digest ran the same library code)."""
    digest = hashlib.sha256()
    for folder in ("graphattn", "passes", "capture"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


# -- targets, table, plot -------------------------------------------------------------------


def latency_ms(data: dict, label: str, batch: int) -> float | None:
    for row in data.get("latency", {}).get("rows", []):
        if row.get("label") == label:
            return (row.get("ms") or {}).get(str(batch))
    return None


def check_targets(data: dict) -> list[dict]:
    """The issue's targets, each met / missed / n/a with the measured value (a smoke run's
    verdicts say so; a FULL row whose mode was lowered says to what).
    """
    full = "graphattn FULL"
    ro = BASELINE_LABELS["reduce-overhead"]
    resolved = (data.get("engines", {}).get(full) or {}).get("resolved_mode")
    lowered = f" (FULL resolved to {resolved})" if resolved not in (None, "FULL") else ""
    smoke = " (smoke)" if data["meta"].get("smoke") else ""
    targets = []

    def add(name: str, value, limit, ok: bool | None):
        verdict = "n/a" if ok is None else ("met" if ok else "missed")
        if name.startswith("FULL"):
            name += lowered
        verdict += smoke
        targets.append({"target": name, "value": value, "limit": limit, "verdict": verdict})

    f1, r1 = latency_ms(data, full, 1), latency_ms(data, ro, 1)
    add("FULL bs1 <= 1.0 ms", f1, 1.0, None if f1 is None else f1 <= 1.0)
    ratio = f1 / r1 if f1 is not None and r1 else None
    add("FULL bs1 <= 0.7 x reduce-overhead", ratio, 0.7, None if ratio is None else ratio <= 0.7)
    for b in (32, 128):
        f, r = latency_ms(data, full, b), latency_ms(data, ro, b)
        ok = None if f is None or r is None else f <= r
        add(f"FULL bs{b} <= reduce-overhead", f, r, ok)
    trace = data.get("trace", {}).get("graphattn", {})
    ratio = trace.get("ratio_to_fixed")
    add("trace per step <= 1.2 x fixed at mean batch", ratio, 1.2, _le(ratio, 1.2))
    caps = (trace.get("stats") or {}).get("captures_after_startup")
    add("trace captures after start-up == 0", caps, 0, None if caps is None else caps == 0)
    host = data.get("host", {}).get("graphattn", {}).get("by_requests", {}).get("256", {})
    us = (host.get("step_us") or {}).get("median")
    add("host overhead at 256 requests <= 100 us", us, 100, _le(us, 100))
    startup = data.get("startup", {}).get("graphattn", {})
    cold, warm = startup.get("cold") or {}, startup.get("warm") or {}
    add("cold compile <= 30 s", cold.get("compile_s"), 30, _le(cold.get("compile_s"), 30))
    add(
        "warm start (compile from a warm cache) <= 5 s",
        warm.get("compile_s"),
        5,
        _le(warm.get("compile_s"), 5),
    )
    add("capture <= 10 s", cold.get("capture_s"), 10, _le(cold.get("capture_s"), 10))
    return targets


def _le(value, limit) -> bool | None:
    return None if value is None else value <= limit


def _f(value, fmt: str = ".2f") -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)):
        return format(value, fmt)
    return str(value)


def _rows_table(header: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]


def _mode_of(row: dict) -> str:
    if row.get("system") != "graphattn":
        return row.get("mode", "-")
    requested, resolved = row.get("requested_mode"), row.get("resolved_mode")
    if resolved is None or resolved == requested:
        return resolved or "-"
    return f"{requested}->{resolved}"


def table_latency(data: dict) -> list[str]:
    lat = data.get("latency", {})
    s = data["meta"]["settings"]
    sizes = [str(b) for b in s["batch_sizes"]]
    lines = [
        f"decode step latency, ms (median of {s['steps']} timed steps after {s['warmup']} "
        f"warm-up; context {s['context']})",
        "  step: engine.step of B one-token decodes + compute_logits + greedy argmax (baseline: "
        "forward + argmax, compiled together); fresh random tokens; JSON meta.step_definition",
        "  processes: "
        + (
            "one per configuration (JSON meta.isolation)"
            if data["meta"].get("isolation")
            else "every configuration in one process"
        ),
    ]
    rows = []
    for row in sorted(lat.get("rows", []), key=row_order):
        cells = [_f((row.get("ms") or {}).get(b)) for b in sizes]
        backends = ",".join(row.get("attention_backends", [])) or "-"
        rows.append([row.get("label"), _mode_of(row), backends, *cells, latency_note(row)])
    floor = data.get("floor", {}).get("result", {})
    if "floor_ms_by_batch" in floor:
        by = floor["floor_ms_by_batch"]
        rows.append(["floor (weights read + KV)", "-", "-", *[_f(by.get(b)) for b in sizes], ""])
    header = ["config", "mode", "attention", *[f"bs={b}" for b in sizes], "note"]
    return (
        lines
        + _rows_table(header, rows)
        + kernel_lines(lat.get("rows", []), sizes[:1])
        + clock_lines(lat.get("rows", []), sizes)
    )


def clock_lines(rows: list[dict], sizes: list[str]) -> list[str]:
    """The SM clock read after each batch's timed steps (``sm_clock_mhz``), a line per row
    that has any (CUDA only)."""
    lines = []
    for row in sorted(rows, key=row_order):
        by = row.get("by_batch") or {}
        clocks = [(by.get(b) or {}).get("sm_clock_mhz") for b in sizes]
        if any(c is not None for c in clocks):
            shown = " / ".join("-" if c is None else f"{c:.0f}" for c in clocks)
            lines.append(f"  {row['label']}: SM clock after the timed steps {shown} MHz")
    return lines


def kernel_lines(rows: list[dict], sizes: list[str]) -> list[str]:
    """The profiled steps of each graph row (``kernel_summary``), one line each."""
    lines = []
    for row in sorted(rows, key=row_order):
        for b in sizes:
            k = ((row.get("by_batch") or {}).get(b) or {}).get("kernels")
            if k and "status" in k:
                lines.append(f"  {row['label']} bs={b}, profiled steps: {k['status']}")
            elif k:
                lines.append(
                    f"  {row['label']} bs={b}, per profiled step: {k['kernels_per_step']:.0f} "
                    f"kernels, {k['kernel_us_per_step']:.1f} us in kernels, "
                    f"{k['idle_us_per_step']:.1f} us idle between them, "
                    f"{k['overlapping_per_step']:.0f} started before the one before ended, "
                    f"first start to last end {k['span_us_per_step']:.1f} us"
                )
                for g in k.get("largest_gaps", [])[:3]:
                    lines.append(
                        f"    idle {g['us_per_step']:.1f} us a step ({g['per_step']:.1f}x) "
                        f"between {g['between']}"
                    )
    return lines


def row_order(row: dict) -> int:
    """graphattn configurations in ENGINE_SPECS order, then the baselines in BASELINES order."""
    labels = [e.label for e in ENGINE_SPECS.values()] + [BASELINE_LABELS[k] for k in BASELINES]
    return labels.index(row["label"]) if row.get("label") in labels else len(labels)


def latency_note(row: dict) -> str:
    """The row's status, a batch size that did not run and why, or what the steps ran:
    graphattn's runtime modes, reduce-overhead's CUDA graphs recorded per batch size.
    """
    if row.get("status", "ok") != "ok":
        return row["status"][:80]
    by_batch = row.get("by_batch") or {}
    for b, entry in by_batch.items():
        if entry.get("status", "ok") != "ok":
            return f"bs={b}: {entry['status'][:70]}"
    if row.get("system") == "graphattn":
        modes = [
            ",".join((v.get("stats") or {}).get("runtime_modes", {})) for v in by_batch.values()
        ]
        return "ran " + ("/".join(modes) if len(set(modes)) > 1 else modes[0] if modes else "?")
    if row.get("mode") == "reduce-overhead":
        recorded = "/".join(str(v.get("cudagraph_recordings", "?")) for v in by_batch.values())
        skips = sum(v.get("cudagraph_skips", 0) for v in by_batch.values())
        return f"graphs recorded {recorded}" + (f"; {skips} SKIPPED: no graphs" if skips else "")
    return ""


def table_trace(data: dict) -> list[str]:
    trace = data.get("trace")
    if not trace:
        return []
    s = data["meta"]["settings"]
    lines = [
        f"continuous-batching trace ({s['trace_steps']} steps, batch uniform in "
        f"1..{s['trace_max_batch']}, seed {s['seed']}; baseline budget {s['trace_budget_s']:.0f} s)"
    ]
    rows, notes = [], []
    for key in ("graphattn", "baseline"):
        e = trace.get(key)
        if not e:
            continue
        if e.get("status", "ok") != "ok":
            rows.append([e.get("label"), e["status"][:70], "", "", "", ""])
            if len(e["status"]) > 70:
                notes.append(f"  {e.get('label')}: {e['status']}")
            continue
        if key == "graphattn":
            graphs = (
                f"captures after start-up: {(e.get('stats') or {}).get('captures_after_startup')}"
            )
        else:
            graphs = f"graph recordings: {e.get('cudagraph_recordings', '?')}"
        rows.append(
            [
                e.get("label"),
                f"{e['steps_done']}/{e['steps_planned']}",
                _f(e["total_s"]),
                _f(e.get("first_100_s")),
                _f(e.get("ms_per_step_after_100"), ".3f"),
                graphs,
            ]
        )
    header = ["config", "steps", "total s", "first 100 s", "ms/step after 100", "graphs"]
    lines += _rows_table(header, rows) + notes
    g = trace.get("graphattn") or {}
    fixed = g.get("fixed_mean_batch")
    if fixed:
        lines.append(
            f"  graphattn fixed batch {fixed['batch']} (mean of the timed steps "
            f"{g.get('mean_batch_timed', g['mean_batch']):.1f}): "
            f"{fixed['mean_ms']:.3f} ms/step -> trace/fixed = {g['ratio_to_fixed']:.2f}"
        )
    return lines


def table_mixed(data: dict) -> list[str]:
    rows_in = data.get("mixed", {}).get("rows", [])
    if not rows_in:
        return []
    s = data["meta"]["settings"]
    (d0, d1), (c0, c1), (l0, l1) = s["mixed_decodes"], s["mixed_chunks"], s["mixed_chunk_len"]
    lines = [
        f"mixed trace ({s['steps']} timed steps of {d0}-{d1} decodes + {c0}-{c1} prefill "
        f"chunks of {l0}-{l1} tokens)"
    ]
    rows = []
    for e in rows_in:
        if e.get("status", "ok") != "ok":
            rows.append([e.get("label"), _mode_of(e), e["status"][:70], "", "", ""])
            continue
        modes = e.get("stats", {}).get("runtime_modes", {})
        rows.append(
            [
                e.get("label"),
                _mode_of(e),
                _f(e["mean_ms"], ".3f"),
                _f(e["median_ms"], ".3f"),
                _f(e["tokens_per_s"], ".0f"),
                ", ".join(f"{k} {v}" for k, v in modes.items()),
            ]
        )
    header = ["config", "mode", "mean ms/step", "median ms", "tokens/s", "runtime modes"]
    return lines + _rows_table(header, rows)


def table_startup(data: dict) -> list[str]:
    e = data.get("startup", {}).get("graphattn")
    if not e:
        return []
    lines = [f"start-up ({e.get('label')}, default capture sizes; fresh processes, empty cache)"]
    if data.get("meta", {}).get("settings", {}).get("profile_startup"):
        lines.append("  (each process ran ga.compile under cProfile: every time here is inflated)")
    if e.get("status", "ok") != "ok" and "cold" not in e:
        return lines + [f"  {e['status']}"]
    rows = []
    for name, _ in STARTUP_PROCESSES:
        if name not in e:
            continue
        r = e.get(name) or {}
        if r.get("status", "ok") != "ok":
            rows.append([name, r.get("status", "")[:80], "", "", "", "", "", "", "", ""])
            continue
        compile_info = r.get("compile") or {}
        rows.append(
            [
                name,
                _f(r.get("compile_s")),
                _f(compile_info.get("trace_seconds")),
                _f(r.get("capture_s")),
                _f(r.get("graph_memory_mib"), ".0f"),
                _f(r.get("ga_compile_s")),
                _f(r.get("process_s")),
                str(r.get("compile_warm")),
                str(compile_info.get("trace_source", "")),
                str(r.get("triton_compiles", "-")),
            ]
        )
    header = [
        "process",
        "compile s",
        "trace s",
        "capture s",
        "graph MiB",
        "ga.compile s",
        "process s",
        "warm",
        "trace from",
        "Triton compiles",
    ]
    lines += _rows_table(header, rows)
    sizes = (e.get("cold") or {}).get("capture_sizes")
    if sizes:
        lines.append(f"  capture sizes: {sizes}")
    return lines


def table_host(data: dict) -> list[str]:
    e = data.get("host", {}).get("graphattn")
    if not e:
        return []
    lines = [f"host overhead per decode step, us ({e.get('label')}; median; see JSON method)"]
    if e.get("status", "ok") != "ok":
        return lines + [f"  {e['status']}"]
    rows = []
    for n, r in e["by_requests"].items():
        p = r.get("phases_us", {})
        modes = r.get("stats", {}).get("runtime_modes", {})
        rows.append(
            [
                n,
                _f(r["step_us"]["median"], ".1f"),
                _spread(r["step_us"]),
                _f((r.get("step_cloned_us") or {}).get("median"), ".1f"),
                *[_f(p.get(k), ".1f") for k in HOST_COLUMNS],
                _f(r.get("from_arrays_us"), ".1f"),
                _f(r.get("from_requests_us"), ".1f"),
                ",".join(modes),
            ]
        )
    header = ["requests", "step", "p10-p90", "step, clone", "check", "prepare", "common md"]
    header += ["build md", "forward", "(replay)", "restore"]
    header += ["other", "from_arrays", "from_requests", "runtime mode"]
    lines += _rows_table(header, rows)
    for n, r in e["by_requests"].items():  # the host's speed from round to round
        if r.get("step_us_by_round"):
            medians = " / ".join(f"{v:.1f}" for v in r["step_us_by_round"])
            lines.append(f"  {n} requests, each round's median: {medians}")
    return lines


def _spread(summary: dict) -> str:
    """A timing's p10-p90 range (a host whose speed changes mid-run shows here)."""
    if summary.get("p10") is None or summary.get("p90") is None:
        return "-"
    return f"{summary['p10']:.1f}-{summary['p90']:.1f}"


def table_floor(data: dict) -> list[str]:
    f = data.get("floor", {}).get("result")
    if not f:
        return []
    if "copy_bytes_per_s" not in f:
        return [f"floor: {f.get('status')}"]
    return [
        f"floor: weights {f['weight_bytes'] / 1e9:.3f} GB ({f['weight_bytes_read_per_step'] / 1e9:.3f} "
        f"GB read per step: the embedding is only gathered); copy bandwidth "
        f"{f['copy_bytes_per_s'] / 1e12:.3f} TB/s (read + write) -> "
        f"{f['floor_all_weights_ms']:.3f} ms all weights, {f['floor_weights_read_ms']:.3f} ms read",
    ]


def table_targets(data: dict) -> list[str]:
    rows = [
        [t["target"], _f(t["value"], ".3f"), _f(t["limit"], ".3f"), t["verdict"]]
        for t in data.get("targets", [])
    ]
    return ["targets (issue 6)"] + _rows_table(["target", "value", "limit", "verdict"], rows)


def print_table(data: dict, out_path: Path | None = None) -> None:
    meta = data["meta"]
    lines = [
        "",
        f"graphattn decode benchmark: {meta['device']}, torch {meta['torch']}, triton "
        f"{meta['triton']}, {meta['date_utc']}, commit {meta['commit']}, "
        f"PDL {'on' if meta.get('pdl') else 'off'}",
        f"command: {meta['command']}",
    ]
    for section in (
        table_latency,
        table_trace,
        table_mixed,
        table_startup,
        table_host,
        table_floor,
        table_targets,
    ):
        part = section(data)
        if part:
            lines += [""] + part
    walls = data.get("wall_seconds", {})
    if walls:
        top = {k: v for k, v in walls.items() if ": " not in k}
        lines += ["", "wall seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in top.items())]
    if out_path is not None:
        lines.append(f"JSON: {out_path}")
    if meta.get("smoke"):
        lines.append(SMOKE_NOTE)
    print("\n".join(lines), flush=True)


def write_plot(data: dict, path: Path) -> None:
    """Step latency against batch size, one line per configuration, log-scale y."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("no matplotlib: --plot skipped (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(10, 5))
    for row in data.get("latency", {}).get("rows", []):
        points = [(int(b), v) for b, v in (row.get("ms") or {}).items() if v is not None]
        if points:
            dashed = "--" if row.get("system") == "baseline" else "-"
            ax.plot(*zip(*points), dashed, marker="o", label=f"{row['label']} ({_mode_of(row)})")
    floor = data.get("floor", {}).get("result", {}).get("floor_ms_by_batch")
    if floor:
        ax.plot([int(b) for b in floor], list(floor.values()), ":", color="gray", label="floor")
    meta = data["meta"]
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = [int(b) for b in meta["settings"]["batch_sizes"]]
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set(xlabel="batch size (decode requests)", ylabel="ms per decode step")
    title = f"decode step, context {meta['settings']['context']}: {meta['device']}"
    ax.set_title(title + (" (smoke: not results)" if meta.get("smoke") else ""), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the lines
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log(f"plot written to {path}")


# -- command line ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="decode.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, few steps")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {','.join(PARTS)}")
    p.add_argument("--modes", help="graphattn latency configs: " + ",".join(ENGINE_SPECS))
    p.add_argument("--baselines", default=",".join(BASELINES), help="comma list; '' for none")
    p.add_argument("--attention-backend", help="TRITON (default), TORCH_REF or auto")
    p.add_argument(
        "--extra-passes",
        help="comma list of post-grad passes run after the defaults in every graphattn engine "
        "(opt-in ones, e.g. prefetch_next_weight)",
    )
    p.add_argument("--batch-sizes", help="decode batch sizes (default 1,8,32,128)")
    p.add_argument("--context", type=int, help="cached tokens per request (default 512)")
    p.add_argument("--warmup", type=int, help="warm-up steps (default 10)")
    p.add_argument("--steps", type=int, help="timed steps (default 50)")
    p.add_argument("--trace-steps", type=int)
    p.add_argument("--trace-budget", type=float, help="baseline trace seconds (default 90)")
    p.add_argument("--host-sizes", help="request counts of the host part (default 1,32,256)")
    p.add_argument("--host-iters", type=int)
    p.add_argument("--max-num-tokens", type=int, help="engine token budget per step (2048)")
    p.add_argument(
        "--max-num-seqs",
        type=int,
        help="engine max_num_seqs (default: the largest batch of any part, 256); it bounds "
        "the default capture sizes",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds per process")
    p.add_argument(
        "--profile-startup",
        metavar="DIR",
        help="run each start-up process's ga.compile under cProfile; write the stats here",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=400.0,
        help="no configuration starts after this many seconds; later ones are 'skipped' "
        "(default 400)",
    )
    p.add_argument("--cpu", action="store_true", help="run on the CPU even with CUDA")
    p.add_argument("--out", help="JSON path (default $OUT/decode.json or ./decode.json)")
    p.add_argument("--plot", help="also write the latency plot (PNG) here")
    p.add_argument("--plot-only", metavar="JSON", help="plot (to --plot) from a saved JSON")
    p.add_argument("--table-only", metavar="JSON", help="print the table of a saved JSON")
    p.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        help="each configuration in its own process (default: on with CUDA, off for --smoke)",
    )
    p.add_argument(
        "--config-timeout",
        type=float,
        default=900.0,
        help="--isolate: seconds a configuration's process may take before it is killed (900)",
    )
    p.add_argument("--startup-child", help=argparse.SUPPRESS)
    p.add_argument("--config-child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def settings_from_args(a: argparse.Namespace) -> Settings:
    d = SMOKE_DEFAULTS if a.smoke else FULL_DEFAULTS
    device = "cuda" if torch.cuda.is_available() and not a.cpu else "cpu"
    parts = _names(a.parts, PARTS, "part")
    backend = a.attention_backend or d["attention_backend"]
    mixed = d["mixed"]
    return Settings(
        smoke=a.smoke,
        device=device,
        dtype=torch.bfloat16 if device == "cuda" else torch.float32,
        parts=parts,
        modes=_names(a.modes or d["modes"], tuple(ENGINE_SPECS), "mode"),
        baselines=_names(a.baselines, BASELINES, "baseline"),
        attention_backend=None if backend.lower() == "auto" else backend,
        batch_sizes=_ints(a.batch_sizes or d["batch_sizes"]),
        context=a.context or d["context"],
        warmup=max(1, a.warmup if a.warmup is not None else d["warmup"]),
        steps=max(1, a.steps or d["steps"]),
        trace_steps=a.trace_steps or d["trace_steps"],
        trace_max_batch=d["trace_max_batch"],
        trace_budget_s=a.trace_budget if a.trace_budget is not None else d["trace_budget"],
        mixed_decodes=mixed[0],
        mixed_chunks=mixed[1],
        mixed_chunk_len=mixed[2],
        host_sizes=_ints(a.host_sizes or d["host_sizes"]),
        host_iters=a.host_iters or d["host_iters"],
        max_num_tokens=a.max_num_tokens or d["max_num_tokens"],
        seed=a.seed,
        startup_timeout_s=a.startup_timeout,
        time_limit_s=a.time_limit,
        max_seqs=a.max_num_seqs,
        profile_startup=a.profile_startup,
        isolate=a.isolate if a.isolate is not None else (device == "cuda" and not a.smoke),
        config_timeout_s=a.config_timeout,
        extra_passes=tuple(n.strip() for n in (a.extra_passes or "").split(",") if n.strip()),
    )


def _names(text: str, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in known]
    if bad:
        raise SystemExit(f"unknown {what}(s) {bad}; expected some of {','.join(known)}")
    return names


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def default_out() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "decode.json" if out else Path("decode.json")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.startup_child:
        return startup_child(a.startup_child)
    if a.config_child:
        if not a.out:
            raise SystemExit("--config-child needs --out (where its results go)")
        return config_child(a.config_child, Path(a.out))
    if a.plot_only or a.table_only:
        data = json.loads(Path(a.plot_only or a.table_only).read_text())
        if a.plot_only:
            write_plot(data, Path(a.plot or Path(a.plot_only).with_suffix(".png")))
        print_table(data)
        return 0
    s = settings_from_args(a)
    limit_cpu_threads(s)
    if s.device != "cuda" and not s.smoke:
        raise SystemExit("no CUDA device: the full benchmark needs a GPU; use --smoke on the CPU")
    largest = max(s.decode_rows, s.mixed_decodes[1] + s.mixed_chunks[1])
    if s.max_num_seqs < largest:
        raise SystemExit(
            f"--max-num-seqs {s.max_num_seqs} < {largest} requests that a part puts in one step "
            "(batch sizes, host sizes, trace and mixed steps); lower those too"
        )
    if "mixed" in s.parts and s.mixed_chunk_len[1] > s.context:
        raise SystemExit(f"the mixed part's chunks need --context >= {s.mixed_chunk_len[1]}")
    return run(s, Path(a.out) if a.out else default_out(), Path(a.plot) if a.plot else None)


if __name__ == "__main__":
    sys.exit(main())

"""Attention kernel benchmark: TRITON paged attention against torch SDPA on contiguous KV.

    python benchmarks/attention.py --out $OUT/attention.json   # a GPU (an H200: ~1-2 min)
    python benchmarks/attention.py --smoke                     # CPU, Triton interpreter: every path, no results

Shapes: 32 query heads, 8 KV heads, head size 128, bf16, cache block 16.
- decode, batch x context 1x4096, 16x4096, 64x4096, 256x1024, 8x32768: one query token per
  request over its whole context. Achieved TB/s = K+V bytes read / time, with
  bytes = batch * context * 8 heads * 128 * 2 (K and V) * 2 bytes.
- causal prefill 1x8192 and 8x1024: TFLOP/s with FLOPs = batch * 2 * seq^2 * 32 * 128
  (two matmuls of 2*seq^2*dim FLOPs per head, halved by the causal mask: 4*seq^2*H*D/2).
TRITON runs with the launch plan the backend would choose ("auto") and with split-KV off;
torch SDPA (flash and cuDNN back ends, ``enable_gqa``) runs on the same values stored
contiguously. A sweep over tile configurations follows for the two target cases.

Timing: every implementation is captured as one CUDA graph of k calls that rotate over
input sets (fresh random values, never zeros) whose total size is at least twice the L2
cache, so no call finds its inputs in L2 and host launch overhead is not measured; the
graph is replayed after warm-up and the per-call time is the median over replays / k.
The device-to-device copy bandwidth (bytes read + written) is measured once in the run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
DECODE_CASES = [(1, 4096), (16, 4096), (64, 4096), (256, 1024), (8, 32768)]
PREFILL_CASES = [(1, 8192), (8, 1024)]
SMOKE_DECODE, SMOKE_PREFILL = [(2, 40), (1, 100)], [(1, 48), (2, 20)]
TARGETS = [  # (kind, batch, length, metric, threshold)
    ("decode", 64, 4096, "TB/s", 3.4),
    ("prefill", 1, 8192, "TFLOP/s", 250.0),
]
DEFAULT_L2 = 60 * 2**20
FORMULAS = {
    "decode_bytes": "batch * context * num_kv_heads * head_size * 2 (K and V) * element bytes",
    "decode_TBps": "decode_bytes / time",
    "prefill_flops": "batch * 4 * seq^2 * num_heads * head_size / 2 (causal half)",
    "prefill_TFLOPs": "prefill_flops / time",
    "copy_TBps": "2 * bytes (read + written) of a 1 GiB device-to-device copy / time",
}


@dataclass
class Case:
    kind: str  # "decode" or "prefill"
    batch: int
    length: int  # decode: context per request; prefill: prompt length

    @property
    def name(self) -> str:
        return f"{self.kind} {self.batch}x{self.length}"

    @property
    def num_tokens(self) -> int:
        return self.batch if self.kind == "decode" else self.batch * self.length

    def work(self, dtype: torch.dtype) -> float:
        """Bytes (decode) or FLOPs (prefill) one call does."""
        if self.kind == "decode":
            return self.batch * self.length * NUM_KV_HEADS * HEAD_SIZE * 2 * dtype.itemsize
        return self.batch * 4 * self.length**2 * NUM_HEADS * HEAD_SIZE / 2

    def rate(self, seconds: float, dtype: torch.dtype) -> float:
        """TB/s (decode) or TFLOP/s (prefill)."""
        return self.work(dtype) / seconds / 1e12

    @property
    def unit(self) -> str:
        return "TB/s" if self.kind == "decode" else "TFLOP/s"


# -- inputs ---------------------------------------------------------------------------------


@dataclass
class InputSet:
    """One set of inputs: a paged cache region for TRITON, the same values contiguous for SDPA."""

    query: torch.Tensor  # [T, Hq, D]
    key_cache: torch.Tensor  # [NB, BS, Hkv, D] (shared by all sets)
    value_cache: torch.Tensor
    block_table: torch.Tensor  # [B, blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    output: torch.Tensor  # [T, Hq, D]


def make_sets(case: Case, n: int, st: Settings, gen) -> list[InputSet]:
    """``n`` input sets over one cache; each set's requests own random, disjoint blocks."""
    dtype, device = st.dtype, st.device
    blocks_per_req = -(-case.length // BLOCK_SIZE)
    num_blocks = n * case.batch * blocks_per_req
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    key_cache = _randn(shape, dtype, device, gen)
    value_cache = _randn(shape, dtype, device, gen)
    order = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    tables = order.view(n, case.batch, blocks_per_req)
    q_len = 1 if case.kind == "decode" else case.length
    qsl = torch.arange(case.batch + 1, dtype=torch.int32, device=device) * q_len
    seq_lens = torch.full((case.batch,), case.length, dtype=torch.int32, device=device)
    sets = []
    for i in range(n):
        query = _randn((case.num_tokens, NUM_HEADS, HEAD_SIZE), dtype, device, gen)
        sets.append(
            InputSet(
                query, key_cache, value_cache, tables[i], qsl, seq_lens, torch.empty_like(query)
            )
        )
    return sets


def contiguous_kv(s: InputSet, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The set's keys and values as SDPA takes them: [B, Hkv, L, D], contiguous."""

    def gather(cache):
        kv = cache[s.block_table.long()].flatten(1, 2)[:, : case.length]  # [B, L, Hkv, D]
        return kv.transpose(1, 2).contiguous()

    return gather(s.key_cache), gather(s.value_cache)


def sdpa_query(s: InputSet, case: Case) -> torch.Tensor:
    """[B, Hq, Lq, D] view of the set's queries."""
    q_len = 1 if case.kind == "decode" else case.length
    return s.query.view(case.batch, q_len, NUM_HEADS, HEAD_SIZE).transpose(1, 2)


def num_sets(case: Case, dtype, l2_bytes: int) -> int:
    """Enough sets that their inputs together are at least twice the L2 cache."""
    per_set = case.batch * case.length * NUM_KV_HEADS * HEAD_SIZE * 2 * dtype.itemsize
    per_set += 2 * case.num_tokens * NUM_HEADS * HEAD_SIZE * dtype.itemsize  # query, output
    return max(1, min(64, math.ceil(2 * l2_bytes / per_set)))


def _randn(shape, dtype, device, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device, dtype=dtype)  # drawn on the device


# -- the implementations ----------------------------------------------------------------------


def triton_call(s: InputSet, case: Case, plan, scratch) -> Callable[[], Any]:
    from graphattn.kernels.unified_attention import unified_attention

    def call():
        unified_attention(
            s.query, s.key_cache, s.value_cache, s.output, s.block_table, s.query_start_loc,
            s.seq_lens, plan, scale=HEAD_SIZE**-0.5, scratch=scratch,
        )  # fmt: skip

    return call


def triton_plan(case: Case, dtype, device, num_splits: int | None, tiles=None):
    """The backend's plan (``num_splits`` None: chosen as its builder chooses) or a forced one."""
    from graphattn.kernels.attention_plan import choose_num_splits, plan_attention

    if num_splits is None:  # the builder's choice for a batch within max_num_seqs
        num_splits = 1
        if case.kind == "decode":
            num_splits = choose_num_splits(case.batch, NUM_KV_HEADS, num_sms(device))
    return plan_attention(
        case.num_tokens,
        case.batch,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=dtype,
        device_type=device.type,
        num_splits=num_splits,
        uniform_decode=case.kind == "decode",
        tiles=tiles,
    )


def sdpa_call(q, k, v, case: Case, backend, gqa: bool) -> Callable[[], Any]:
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    causal = case.kind == "prefill"

    def call():
        with sdpa_kernel(backend):
            return sdpa(q, k, v, is_causal=causal, scale=HEAD_SIZE**-0.5, enable_gqa=gqa)

    return call


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 64  # smoke: enough "SMs" that the auto plan of a small decode splits the keys


# -- timing ---------------------------------------------------------------------------------


def time_rotating(
    calls: list[Callable[[], Any]], device, reps: int, smoke: bool, graph_calls: int | None = None
) -> dict:
    """Median seconds per call: a CUDA graph of k calls over the sets, replayed ``reps`` times.
    k is at least ``graph_calls`` when given (the same k for every variant of a comparison),
    else enough for ~2 ms by an eager estimate (which host overhead inflates)."""
    for call in calls:  # compile, and let SDPA pick its kernels, outside the graph
        call()
    if smoke:
        start = time.perf_counter()
        calls[0]()
        return {"seconds": time.perf_counter() - start, "method": "one eager call (smoke)"}
    torch.cuda.synchronize(device)
    one = _event_seconds(lambda: [c() for c in calls]) / len(calls)
    if graph_calls is not None:
        repeat = max(1, math.ceil(graph_calls / len(calls)))
    else:
        repeat = max(1, math.ceil(2e-3 / max(one, 1e-7) / len(calls)))  # >= ~2 ms per replay
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            for call in calls:
                call()
    torch.cuda.synchronize(device)
    k = repeat * len(calls)
    for _ in range(3):
        graph.replay()
    times = [_event_seconds(graph.replay) / k for _ in range(reps)]
    return {
        "seconds": statistics.median(times),
        "p10_s": _quantile(times, 0.1),
        "p90_s": _quantile(times, 0.9),
        "calls_per_replay": k,
        "method": f"median of {reps} replays of a CUDA graph of {k} calls over {len(calls)} sets",
    }


def _event_seconds(fn: Callable[[], Any]) -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- one case -----------------------------------------------------------------------------


@dataclass
class Settings:
    device: torch.device
    dtype: torch.dtype
    reps: int
    smoke: bool
    l2_bytes: int


@dataclass
class Variant:
    """One implementation ready to time: a call per input set, what set 0's call returns."""

    calls: list[Callable[[], Any]]
    output: Callable[[], torch.Tensor]  # [T, Hq, D] after calls[0]()
    plan: Any = None
    note: str = ""


def run_case(case: Case, st: Settings, gen) -> list[dict]:
    """TRITON (auto, split-KV off) and SDPA (flash, cuDNN) on one case; a row per implementation."""
    sets = make_sets(case, 2 if st.smoke else num_sets(case, st.dtype, st.l2_bytes), st, gen)
    reference = reference_output(sets[0], case)
    variants = [("triton", "auto", None)] + (
        [("triton", "split-KV off", 1)] if case.kind == "decode" else []
    )
    rows = [measure(case, st, impl, label, lambda s=splits: triton_variant(case, st, sets, s), reference)
            for impl, label, splits in variants]  # fmt: skip
    kv = [contiguous_kv(s, case) for s in sets]
    for label, backend in sdpa_backends(st):
        build = lambda b=backend: sdpa_variant(case, sets, kv, b)  # noqa: E731
        rows.append(measure(case, st, "sdpa", label, build, reference))
    return rows


def triton_variant(case: Case, st: Settings, sets, num_splits, tiles=None) -> Variant:
    from graphattn.kernels.split_kv import SplitScratch

    plan = triton_plan(case, st.dtype, st.device, num_splits, tiles)
    scratch = SplitScratch.allocate(case.num_tokens, NUM_KV_HEADS, HEAD_SIZE, st.device)
    calls = [triton_call(s, case, plan, scratch) for s in sets]
    return Variant(calls, lambda: sets[0].output, plan)


def sdpa_variant(case: Case, sets, kv, backend) -> Variant:
    """SDPA with ``enable_gqa``; where a back end refuses it, on KV repeated to every query head."""
    queries = [sdpa_query(s, case) for s in sets]
    calls = [sdpa_call(q, k, v, case, backend, gqa=True) for q, (k, v) in zip(queries, kv)]
    note = ""
    try:
        calls[0]()
    except RuntimeError as e:
        note = f"enable_gqa refused ({str(e).splitlines()[0][:80]}); KV repeated: reads 4x the counted bytes"
        g = NUM_HEADS // NUM_KV_HEADS
        kv = [(k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)) for k, v in kv]
        calls = [sdpa_call(q, k, v, case, backend, gqa=False) for q, (k, v) in zip(queries, kv)]
    return Variant(calls, lambda: as_tokens(calls[0](), case), note=note)


def measure(case: Case, st: Settings, impl: str, label: str, build, reference) -> dict:
    row = {"case": case.name, "kind": case.kind, "batch": case.batch, "length": case.length,
           "impl": impl, "variant": label}  # fmt: skip
    try:
        v: Variant = build()
        if v.plan is not None:
            row["plan"] = describe_plan(v.plan)
        if v.note:
            row["note"] = v.note
        v.calls[0]()
        row["rel_err_vs_fp32"] = rel_err(v.output(), reference)
        timing = time_rotating(v.calls, st.device, st.reps, st.smoke)
        row.update(timing)
        row["us"] = timing["seconds"] * 1e6
        row[case.unit] = case.rate(timing["seconds"], st.dtype)
    except Exception as e:  # an unavailable back end or a failed compile is a result too
        row["unavailable"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        row["traceback"] = traceback.format_exc(limit=4)
    return row


def reference_output(s: InputSet, case: Case) -> torch.Tensor:
    """fp32 attention of the first set on contiguous fp32 copies of its values: [T, Hq, D]."""
    g = NUM_HEADS // NUM_KV_HEADS
    k, v = (t.float().repeat_interleave(g, dim=1) for t in contiguous_kv(s, case))
    q = sdpa_query(s, case).float()
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=case.kind == "prefill", scale=HEAD_SIZE**-0.5
    )
    return as_tokens(out, case)


def as_tokens(out: torch.Tensor, case: Case) -> torch.Tensor:
    """[B, Hq, L, D] -> [B*L, Hq, D]."""
    return out.transpose(1, 2).reshape(case.num_tokens, NUM_HEADS, HEAD_SIZE)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def describe_plan(plan) -> dict:
    t = plan.tiles
    return {"grid": list(plan.grid), "block_m": t.block_m, "tile_n": t.tile_n,
            "num_warps": t.num_warps, "num_stages": t.num_stages, "num_splits": plan.num_splits}  # fmt: skip


def sdpa_backends(st: Settings):
    from torch.nn.attention import SDPBackend

    if st.smoke:  # no flash or cuDNN on the CPU: the math back end checks the wiring
        return [("math (smoke)", SDPBackend.MATH)]
    return [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]


# -- the sweep ------------------------------------------------------------------------------

DECODE_SWEEP = [  # (block_m, tile_n, num_warps, num_stages, splits)
    (16, 32, 4, 3, 1), (16, 64, 4, 2, 1), (16, 64, 4, 4, 1), (16, 128, 4, 3, 1),
    (16, 64, 8, 3, 1), (16, 128, 8, 2, 1), (16, 64, 4, 3, 2), (16, 64, 4, 3, 4),
]  # fmt: skip
PREFILL_SWEEP = [
    (128, 128, 8, 2, 1), (128, 64, 4, 3, 1), (128, 32, 8, 4, 1), (64, 64, 4, 3, 1),
    (64, 128, 4, 2, 1), (128, 64, 8, 2, 1),
]  # fmt: skip


def run_sweep(case: Case, configs, st: Settings, gen) -> list[dict]:
    """The target case under other tile configurations (what the table in attention_plan could be)."""
    from graphattn.kernels.attention_plan import TileConfig

    sets = make_sets(case, num_sets(case, st.dtype, st.l2_bytes), st, gen)
    reference = reference_output(sets[0], case)
    rows = []
    for block_m, tile_n, warps, stages, splits in configs:
        tiles = TileConfig(block_m, tile_n, warps, stages)
        label = f"m{block_m} n{tile_n} w{warps} s{stages} split{splits}"
        build = lambda t=tiles, s=splits: triton_variant(case, st, sets, s, t)  # noqa: E731
        rows.append(measure(case, st, "triton", label, build, reference))
    return rows


# -- report ---------------------------------------------------------------------------------


def table(rows: list[dict], copy_tbps: float | None) -> str:
    head = f"{'case':20s} {'impl':7s} {'variant':26s} {'us':>9s} {'rate':>14s} {'% copy':>7s} {'rel err':>8s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "unavailable" in r:
            lines.append(
                f"{r['case']:20s} {r['impl']:7s} {r['variant']:26s} unavailable: {r['unavailable']}"
            )
            continue
        unit = "TB/s" if r["kind"] == "decode" else "TFLOP/s"
        share = f"{100 * r[unit] / copy_tbps:6.1f}%" if unit == "TB/s" and copy_tbps else ""
        lines.append(
            f"{r['case']:20s} {r['impl']:7s} {r['variant']:26s} {r['us']:9.1f} "
            f"{r[unit]:9.2f} {unit:7s} {share:>7s} {r['rel_err_vs_fp32']:8.1e}"
        )
    return "\n".join(lines)


def check_targets(rows: list[dict], smoke: bool) -> list[dict]:
    out = []
    for kind, batch, length, unit, threshold in TARGETS:
        row = next((r for r in rows if r["kind"] == kind and r["batch"] == batch
                    and r["length"] == length and r["impl"] == "triton" and r["variant"] == "auto"), None)  # fmt: skip
        value = None if row is None or "unavailable" in row else row[unit]
        verdict = (
            "n/a (smoke)"
            if smoke
            else "n/a"
            if value is None
            else "met"
            if value >= threshold
            else "missed"
        )
        out.append({"case": f"{kind} {batch}x{length}", "target": f">= {threshold} {unit}",
                    "value": value, "verdict": verdict})  # fmt: skip
    return out


def meta(st: Settings, copy_tbps: float | None) -> dict:
    import triton

    gpu = (
        torch.cuda.get_device_name(st.device)
        if st.device.type == "cuda"
        else platform.processor() or "cpu"
    )
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "num_sms": num_sms(st.device),
        "l2_bytes": st.l2_bytes,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(st.dtype),
        "shape": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_size": HEAD_SIZE,
            "block_size": BLOCK_SIZE,
        },
        "copy_TBps": copy_tbps,
        "formulas": FORMULAS,
        "timing": __doc__.split("Timing: ")[1].split("\n\n")[0].replace("\n", " "),
        "smoke": st.smoke,
    }


def bench_device(smoke: bool) -> torch.device | None:
    """The GPU, or the CPU under the Triton interpreter for a smoke run; None (after saying
    why) for a timed run without CUDA."""
    if smoke and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not smoke:
        print("no CUDA device: run with --smoke on a CPU (no timing results)", file=sys.stderr)
        return None
    return device


def l2_bytes(device: torch.device) -> int:
    cuda = device.type == "cuda"
    return (torch.cuda.get_device_properties(device).L2_cache_size if cuda else 0) or DEFAULT_L2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = bench_device(args.smoke)
    if device is None:
        return 2
    st = Settings(device, torch.bfloat16, args.reps, args.smoke, l2_bytes(device))
    gen = torch.Generator(device=device).manual_seed(0)
    start = time.perf_counter()
    copy_tbps = None
    if not args.smoke:
        from benchmarks.decode import copy_bandwidth

        copy_tbps = copy_bandwidth("cuda", 2**30) / 1e12
        print(f"device copy bandwidth (read + write, 1 GiB): {copy_tbps:.2f} TB/s", file=sys.stderr)
    decode = SMOKE_DECODE if args.smoke else DECODE_CASES
    prefill = SMOKE_PREFILL if args.smoke else PREFILL_CASES
    rows: list[dict] = []
    for case in [Case("decode", b, n) for b, n in decode] + [
        Case("prefill", b, n) for b, n in prefill
    ]:
        print(f"[{time.perf_counter() - start:6.1f}s] {case.name}", file=sys.stderr)
        rows += run_case(case, st, gen)
        _release(device)
    sweep: list[dict] = []
    if not args.smoke and not args.no_sweep:
        for case, configs in (
            (Case("decode", 64, 4096), DECODE_SWEEP),
            (Case("prefill", 1, 8192), PREFILL_SWEEP),
        ):
            print(f"[{time.perf_counter() - start:6.1f}s] sweep {case.name}", file=sys.stderr)
            sweep += run_sweep(case, configs, st, gen)
            _release(device)
    result = {"meta": meta(st, copy_tbps), "rows": rows, "sweep": sweep,
              "targets": check_targets(rows, args.smoke), "wall_seconds": time.perf_counter() - start}  # fmt: skip
    print_report(result)
    if args.out or not args.smoke:  # a smoke run writes nothing unless asked to
        out_path = Path(args.out or Path(os.environ.get("OUT", ".")) / "attention.json")
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1, default=str))
        print(f"JSON: {out_path}")
    return 0


def print_report(result: dict) -> None:
    """The sweep first, then the main table and the targets (the part a log tail shows)."""
    m = result["meta"]
    if result["sweep"]:
        print(
            "\nsweep (TRITON on the target cases; variant = block_m, tile_n, warps, stages, splits):"
        )
        print(table(result["sweep"], m["copy_TBps"]))
    print_header(m)
    print("decode rate = K+V bytes / time; prefill rate = batch*4*seq^2*heads*dim/2 FLOPs / time")
    print("rel err = relative Frobenius error against fp32 attention on the same values")
    print(table(result["rows"], m["copy_TBps"]))
    print("targets:")
    for t in result["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.2f}"
        print(f"  {t['case']:16s} {t['target']:16s} {value:>8s}  {t['verdict']}")
    print(f"wall time {result['wall_seconds']:.0f} s")


def print_header(m: dict) -> None:
    """The device, versions and date of a result's meta, a smoke warning, the copy bandwidth."""
    print(
        f"\n{m['gpu']} ({m['num_sms']} SMs), torch {m['torch']}, triton {m['triton']}, {m['date']}"
    )
    if m["smoke"]:
        print("SMOKE RUN (CPU, Triton interpreter): timings are not performance results")
    if m["copy_TBps"]:
        print(f"device copy bandwidth: {m['copy_TBps']:.2f} TB/s (read + written)")


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--out",
        help="JSON path (default $OUT/attention.json, else ./attention.json; none for --smoke)",
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU interpreter; no results"
    )
    p.add_argument("--reps", type=int, default=20, help="timed graph replays per measurement")
    p.add_argument("--no-sweep", action="store_true", help="skip the tile-configuration sweep")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())

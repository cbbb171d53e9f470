"""MLA on the GPU: TRITON_MLA's kernels, and a decode step of an MLA model per backend.

1. The decode kernel (``kernels/mla_attention.py``) at DeepSeek-V2's entry (512 + 64) and 16 heads
   (DeepSeek-V2-Lite), bf16, for each batch and context: microseconds a launch (its split
   reduction included) and the entries read per second, timed as ``benchmarks/attention.py``
   times (one CUDA graph of many calls over caches that together are twice the L2), and its
   difference from the plain-PyTorch reference TORCH_REF_MLA runs (``paged_attention_ref``).
2. The causal kernel (``mla_attention``, any batch) on prefills of one request, after
   ``--prefill-context`` cached entries: microseconds a launch (one CUDA graph of many
   calls), TFLOP/s, and the reference's eager time (TORCH_REF_MLA's per-request loop, CUDA
   events, median) beside it, with their difference.
3. A decode step (``engine.step`` + head + greedy) of ``MLAForCausalLM`` at DeepSeek-V2-Lite's
   attention shape with ``--layers`` dense layers, for TRITON_MLA under
   FULL_AND_PIECEWISE (decodes replay full graphs) and TORCH_REF_MLA (lowered to PIECEWISE).

The steps are timed as ``benchmarks/decode.py`` times them (CUDA events after warm-up,
medians, fresh random tokens each step).

    python benchmarks/mla.py --out $OUT/mla.json     # CUDA; scripts/device_run.sh mla
    python benchmarks/mla.py --smoke                 # CPU plumbing (interpreter), no results
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import graphattn as ga

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))
from benchmarks import attention as A  # noqa: E402
from benchmarks import decode as D  # noqa: E402


def kernel_part(a, device: str, dtype: torch.dtype) -> list[dict]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 4
    rows = []
    for context in a.contexts:
        for b in a.batches:
            row = _kernel_case(a, b, context, sms, device, dtype)
            rows.append(row)
            print(
                f"kernel bs {b} ctx {context}: TRITON_MLA {row['triton_us']:.1f} us "
                f"({row['triton_gbs']:.0f} GB/s, {row['splits']} splits, {row['sets']} cache "
                f"sets), rel err against the reference {row['rel_err']:.2e}",
                flush=True,
            )
    return rows


def _kernel_case(a, b: int, context: int, sms: int, device: str, dtype: torch.dtype) -> dict:
    """One batch of ``b`` requests of ``context`` + 1 entries: the kernel timed over enough
    caches that together they are twice the L2 (none is found there; ``benchmarks/
    attention.py``'s rotation in one CUDA graph, so no launch cost is timed), the reference
    on one of them, and their difference."""
    from graphattn.attention.backends.mla import _mla_kernels
    from graphattn.kernels.attention_plan import choose_num_splits
    from graphattn.kernels.reference import paged_attention_ref

    kernels = _mla_kernels()
    rank, rope, heads, block = a.rank, a.rope, a.heads, 16
    scale = (rank + rope) ** -0.5
    width = -(-(context + 1) // block)
    gen = torch.Generator(device).manual_seed(b * 7 + context)
    entry_bytes = (rank + rope) * (2 if dtype != torch.float32 else 4)
    per_set = b * width * block * entry_bytes
    l2 = A.DEFAULT_L2
    if device == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", l2)
    n_sets = 1 if a.smoke else max(1, min(256, -(-2 * l2 // per_set)))  # 155 MB at most
    caches = [
        torch.randn(b * width, block, rank + rope, device=device, generator=gen).to(dtype)
        for _ in range(n_sets)
    ]
    table = torch.arange(b * width, device=device, dtype=torch.int32).view(b, width)
    seq_lens = torch.full((b,), context + 1, dtype=torch.int32, device=device)
    starts = torch.arange(b + 1, dtype=torch.int32, device=device)
    query = torch.randn(b, heads, rank + rope, device=device, generator=gen).to(dtype)
    out = torch.empty(b, heads, rank, device=device, dtype=dtype)
    decode = kernels.mla_attention
    splits = min(decode.MAX_SPLITS, choose_num_splits(b, -(-heads // decode.BLOCK_H), sms))
    n = b * heads * splits
    scratch = kernels.split_kv.SplitScratch(
        torch.empty(n * rank, device=device), torch.empty(n, device=device), b
    )
    launch = functools.partial(
        decode.mla_decode, kv_lora_rank=rank, scale=scale, num_splits=splits, scratch=scratch
    )
    calls = [
        functools.partial(launch, query, cache, table, seq_lens, out, starts) for cache in caches
    ]
    keys = caches[0].unsqueeze(2)
    ref_out = torch.empty_like(out)
    reference = functools.partial(
        paged_attention_ref, query, keys, keys[..., :rank], table, starts.tolist(),
        seq_lens.tolist(), scale, ref_out, num_decodes=b,
    )  # fmt: skip
    calls[0]()
    reference()
    err = float((out.float() - ref_out.float()).norm() / ref_out.float().norm())
    timed = A.time_rotating(calls, torch.device(device), a.iters, a.smoke)
    t_ms = 1e3 * timed["seconds"]
    read = b * (context + 1) * entry_bytes
    return dict(
        batch=b, context=context, splits=splits, sets=n_sets, triton_us=1e3 * t_ms,
        triton_gbs=read / t_ms / 1e6, rel_err=err, method=timed["method"],
    )  # fmt: skip


def prefill_part(a, device: str, dtype: torch.dtype) -> list[dict]:
    from graphattn.attention.backends.mla import _mla_kernels
    from graphattn.kernels.reference import paged_attention_ref

    kernels = _mla_kernels()
    rank, rope, heads, block = a.rank, a.rope, a.heads, 16
    scale = (rank + rope) ** -0.5
    rows = []
    for n in a.prefills:
        context = a.prefill_context
        total = context + n
        width = -(-total // block)
        gen = torch.Generator(device).manual_seed(n)
        cache = torch.randn(width, block, rank + rope, device=device, generator=gen).to(dtype)
        table = torch.arange(width, device=device, dtype=torch.int32).view(1, width)
        seq_lens = torch.tensor([total], dtype=torch.int32, device=device)
        starts = torch.tensor([0, n], dtype=torch.int32, device=device)
        query = torch.randn(n, heads, rank + rope, device=device, generator=gen).to(dtype)
        out, ref_out = (torch.empty(n, heads, rank, device=device, dtype=dtype) for _ in "ab")
        call = functools.partial(
            kernels.mla_attention.mla_attention, query, cache, table, seq_lens, out, starts,
            num_reqs=1, kv_lora_rank=rank, scale=scale,
        )  # fmt: skip
        keys = cache.unsqueeze(2)
        reference = functools.partial(
            paged_attention_ref, query, keys, keys[..., :rank], table, [0, n], [total], scale,
            ref_out,
        )  # fmt: skip
        timed = A.time_rotating([call], torch.device(device), a.iters, a.smoke)
        ref_ms = _eager_median_ms(reference, device, 3 if a.smoke else 10)
        err = float((out.float() - ref_out.float()).norm() / ref_out.float().norm())
        # scores (rank + rope) and values (rank): 2 flops a multiply-add, causal pairs
        pairs = n * context + n * (n + 1) / 2
        flops = 2 * heads * pairs * (2 * rank + rope)
        us = 1e6 * timed["seconds"]
        row = dict(
            tokens=n, context=context, triton_us=us, triton_tflops=flops / us / 1e6,
            reference_ms=ref_ms, rel_err=err, method=timed["method"],
        )  # fmt: skip
        rows.append(row)
        print(
            f"prefill {n} after {context}: TRITON_MLA {us:.1f} us ({row['triton_tflops']:.1f} "
            f"TFLOP/s), reference {ref_ms:.2f} ms eager, rel err {err:.2e}",
            flush=True,
        )
    return rows


def _eager_median_ms(fn, device: str, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            times.append(1e3 * A._event_seconds(fn))
        else:
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def engine_part(a, device: str, dtype: torch.dtype) -> list[dict]:
    from graphattn.models import MLAConfig, MLAForCausalLM, init_random_weights

    cfg = (
        MLAConfig.tiny()
        if a.smoke
        else MLAConfig(
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=10944,
            num_hidden_layers=a.layers,
            num_attention_heads=a.heads,
            kv_lora_rank=a.rank,
            qk_rope_head_dim=a.rope,
        )
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = init_random_weights(MLAForCausalLM(cfg)).to(dtype).eval()
    rows = []
    for backend, mode in (("TRITON_MLA", "FULL_AND_PIECEWISE"), ("TORCH_REF_MLA", "PIECEWISE")):
        rows += _engine_rows(a, model, backend, mode, device)
    return rows


def _engine_rows(a, model, backend: str, mode: str, device: str) -> list[dict]:
    """Decode steps of every batch size on one engine of ``backend`` in ``mode``."""
    context, vocab, top = a.contexts[0], model.config.vocab_size, max(a.batches)
    blocks_per = -(-(context + 2) // 16)
    engine = ga.compile(
        model,
        cudagraph_mode=mode,
        attention_backend=backend,
        cudagraph_capture_sizes=sorted(set(a.batches)),
        max_num_seqs=top,
        max_num_tokens=max(512, top),
        max_model_len=blocks_per * 16,
        num_blocks=top * blocks_per + 1,
    )
    table = np.array(engine.kv_cache.allocate(top * blocks_per), np.int32)
    table = table.reshape(top, blocks_per)
    widths = np.full(top, blocks_per, np.int32)
    rng = np.random.default_rng(0)
    for r in range(top):  # the context, a chunk of at most 512 a step
        for start in range(0, context, 512):
            n = min(512, context - start)
            engine.step(
                ga.Batch.from_arrays(
                    rng.integers(1, vocab, n), np.array([n], np.int32),
                    np.array([start], np.int32), table[r : r + 1], widths[:1],
                )
            )  # fmt: skip
    rows = []
    for b in a.batches:
        tokens = rng.integers(1, vocab, (a.warmup + a.iters, b))
        batches = [
            ga.Batch.from_arrays(
                t, np.ones(b, np.int32), np.full(b, context, np.int32), table[:b], widths[:b]
            )
            for t in tokens
        ]
        step = functools.partial(_decode_step, engine, batches)
        before = dict(engine.stats.runtime_modes)
        timed = D.time_steps(step, a.warmup, a.iters, device)  # as the decode benchmark times
        ms = timed["median_ms"]
        ran = sorted(m for m, k in engine.stats.runtime_modes.items() if k != before.get(m))
        rows.append(dict(backend=backend, mode=mode, batch=b, context=context, ms=ms, ran=ran))
        print(f"engine {backend} ({mode}) bs {b}: {ms:.3f} ms a step, ran {ran}", flush=True)
    return rows


def _decode_step(engine: ga.CompiledModel, batches: list[ga.Batch], i: int) -> torch.Tensor:
    """Decode step ``i``: its own prepared batch (fresh tokens each), head and argmax."""
    return ga.greedy(engine.compute_logits(engine.step(batches[i], clone=False)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--contexts", default="512,4096")
    p.add_argument("--prefills", default="512,2048", help="new tokens of the prefill rows")
    p.add_argument("--prefill-context", type=int, default=0, help="cached entries before them")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--rank", type=int, default=512)
    p.add_argument("--rope", type=int, default=64)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--parts", default="kernel,prefill,engine")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", help="JSON path")
    a = p.parse_args(argv)
    if a.smoke:  # the interpreter: tiny shapes, few steps
        a.batches, a.contexts, a.heads, a.rank, a.rope = "1,3", "40", 4, 64, 16
        a.prefills, a.prefill_context = "9", 5
        a.warmup, a.iters = 1, 2
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined
    a.batches = [int(x) for x in a.batches.split(",")]
    a.contexts = [int(x) for x in a.contexts.split(",")]
    a.prefills = [int(x) for x in a.prefills.split(",")]
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    parts = a.parts.split(",")
    if "kernel" in parts:
        result["kernel"] = kernel_part(a, device, dtype)
    if "prefill" in parts:
        result["prefill"] = prefill_part(a, device, dtype)
    if "engine" in parts:
        result["engine"] = engine_part(a, device, dtype)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

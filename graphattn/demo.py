"""``python -m graphattn demo``: a tiny random-weight Llama (or, with ``--model mla``, a
DeepSeek-V2-style MLA model) compiled in each CUDA-graph mode."""

from __future__ import annotations

import time
import warnings

import torch

import graphattn as ga
from graphattn.models import (
    LlamaConfig,
    LlamaForCausalLM,
    MLAConfig,
    MLAForCausalLM,
    init_random_weights,
)

PROMPT_LENGTHS = (5, 17, 33, 64, 9, 100, 3, 48)


def run_demo(modes: list[str], new_tokens: int, use_cpu: bool, model_kind: str = "llama") -> None:
    """Generate the same prompts with one engine per mode; print the first engine's report,
    then the requested and resolved mode, fallbacks and speed of each.
    """
    device = "cuda" if torch.cuda.is_available() and not use_cpu else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = dict(num_hidden_layers=4, hidden_size=256, intermediate_size=512)
    if model_kind == "mla":  # TRITON_MLA on CUDA (every mode), TORCH_REF_MLA on the CPU
        cfg = MLAConfig.tiny(**shape, num_attention_heads=8)
        model = init_random_weights(MLAForCausalLM(cfg))
    else:
        cfg = LlamaConfig.tiny(**shape, num_attention_heads=8, num_key_value_heads=2)
        model = init_random_weights(LlamaForCausalLM(cfg))
    model = model.to(device, dtype)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS
    ]
    rows, first = [], None
    for mode in modes:
        engine, seconds = _build(model, mode)
        if first is None:
            first = engine
            print(engine.report, "\n")
        outputs, tokens_per_s, ms_per_step = _generate(engine, prompts, new_tokens)
        if len(rows) == 0:
            for prompt, out in zip(prompts[:3], outputs):
                print(f"prompt of {len(prompt):3d} tokens -> {out[:8]} ...")
        rows.append((mode, engine, seconds, tokens_per_s, ms_per_step, outputs))
    _print_summary(rows, device, len(prompts), new_tokens)


def _build(model: torch.nn.Module, mode: str) -> tuple[ga.CompiledModel, float]:
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ga.FallbackWarning)  # shown from the report below
        engine = ga.compile(
            model,
            cudagraph_mode=mode,
            max_num_seqs=16,
            max_num_tokens=512,
            max_model_len=512,
            num_blocks=256,
        )
    return engine, time.perf_counter() - start


def _generate(engine: ga.CompiledModel, prompts: list[list[int]], new_tokens: int):
    engine.generate(prompts[:2], 2)  # warm-up
    steps_before = engine.stats.steps
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = engine.generate(prompts, new_tokens)
    seconds = time.perf_counter() - start
    steps = engine.stats.steps - steps_before
    return outputs, sum(map(len, outputs)) / seconds, 1e3 * seconds / steps


def _print_summary(rows, device: str, num_prompts: int, new_tokens: int) -> None:
    print(
        f"\n{num_prompts} prompts x {new_tokens} new tokens on {device} "
        "(greedy, continuous batching; wall time includes sampling on the host):"
    )
    print(
        f"  {'requested':<20}{'resolved':<20}{'start-up s':>11}{'tokens/s':>10}"
        f"{'ms/step':>9}  steps by runtime mode"
    )
    reference = rows[0][5]
    for mode, engine, seconds, tps, ms, outputs in rows:
        modes = ", ".join(f"{m} {n}" for m, n in sorted(engine.stats.runtime_modes.items()))
        same = "" if outputs == reference else "  (tokens differ from the first mode: bf16)"
        print(
            f"  {mode:<20}{engine.resolved_mode!s:<20}{seconds:>11.1f}{tps:>10.0f}"
            f"{ms:>9.2f}  {modes}{same}"
        )
        for record in engine.report.fallbacks:
            print(f"      fallback: {record}")

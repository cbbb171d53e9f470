"""The decode benchmark's baseline (benchmarks/baseline.py) computes what graphattn computes,
and traces whole: one graph at a fixed batch size and one with a dynamic batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import rel_err

import graphattn as ga
from graphattn.models import LlamaConfig, LlamaForCausalLM, init_random_weights

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks.baseline import StaticLlama  # noqa: E402

PROMPT_LENS = [5, 17, 9]  # awkward lengths: inside a block, across a block edge


def _models(seed: int, **overrides):
    cfg = LlamaConfig.tiny(**overrides)
    model = init_random_weights(LlamaForCausalLM(cfg), seed=seed)
    base = StaticLlama.from_graphattn(model, max_batch=4, max_len=48)
    return model, base


def _prefill_both(model, base, gen):
    """The same random prompts in graphattn's cache (one step) and in baseline rows 0..2."""
    engine = ga.compile(model, cudagraph_mode="NONE", num_blocks=32, max_model_len=48)
    prompts = [torch.randint(1, model.vocab_size, (n,), generator=gen) for n in PROMPT_LENS]
    blocks = [engine.kv_cache.allocate(3) for _ in prompts]
    engine.step(ga.Batch.from_requests([ga.Request(p, 0, b) for p, b in zip(prompts, blocks)]))
    for row, prompt in enumerate(prompts):
        base.prefill(prompt[None], first_row=row)
    return engine, blocks


def _decode_both(engine, base, blocks, positions, tokens):
    """One decode step of every request in both; returns (graphattn, baseline) logits [B, V]."""
    batch = ga.Batch.from_arrays(
        tokens.numpy(), np.ones(len(blocks), np.int32), np.array(positions), np.array(blocks)
    )
    ours = engine.compute_logits(engine.step(batch))
    with torch.no_grad():
        theirs = base(tokens, torch.tensor(positions))
    return ours, theirs


@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True, "num_key_value_heads": 1}])
def test_logits_match_graphattn_eager(overrides):
    """Three decode steps at different positions per request: logits equal graphattn's."""
    gen = torch.Generator().manual_seed(7)
    model, base = _models(seed=3, **overrides)
    if overrides.get("attention_bias"):
        with torch.no_grad():
            for layer in model.layers:
                layer.self_attn.qkv_proj.bias.normal_(0, 0.02, generator=gen)
        base = StaticLlama.from_graphattn(model, max_batch=4, max_len=48)
    engine, blocks = _prefill_both(model, base, gen)
    positions = list(PROMPT_LENS)
    for _ in range(3):
        tokens = torch.randint(1, model.vocab_size, (len(blocks),), generator=gen)
        ours, theirs = _decode_both(engine, base, blocks, positions, tokens)
        assert rel_err(theirs, ours) < 1e-5
        positions = [p + 1 for p in positions]


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiles_whole(dynamic):
    """fullgraph=True: no graph break at a fixed batch or with a dynamic one; same logits."""
    torch._dynamo.reset()
    _, base = _models(seed=5)
    gen = torch.Generator().manual_seed(1)
    base.prefill(torch.randint(1, 512, (4, 20), generator=gen))
    compiled = torch.compile(base, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for b in (4, 3) if dynamic else (4, 4):
        tokens = torch.randint(1, 512, (b,), generator=gen)
        positions = torch.full((b,), 20)
        with torch.no_grad():
            expected = base(tokens, positions)
            got = compiled(tokens, positions)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_weights_are_copied_not_shared():
    model, base = _models(seed=2)
    assert base.output.weight.data_ptr() != model.lm_head.weight.data_ptr()
    torch.testing.assert_close(base.layers[1].w13.weight, model.layers[1].mlp.gate_up_proj.weight)

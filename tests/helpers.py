"""Test helpers written independently of graphattn's internals: dense attention in float64,
a model whose q/k/v are looked up from random tables, batch builders and cache snapshots.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn

import graphattn as ga

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def dense_attention(q, k, v, scale, *, sliding_window=None, soft_cap=None):
    """Causal attention of the last ``len(q)`` positions of a sequence, in float64.

    q: [L, Hq, D]; k, v: [S, Hkv, D] for the whole sequence (S >= L). Returns [L, Hq, D].
    """
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    length, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for h in range(num_heads):
        kh, vh = k[:, h // group], v[:, h // group]  # [S, D]
        for i in range(length):
            pos = seq_len - length + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            s = (kh[lo : pos + 1] @ q[i, h]) * scale
            if soft_cap is not None:
                s = soft_cap * torch.tanh(s / soft_cap)
            out[i, h] = torch.softmax(s, 0) @ vh[lo : pos + 1]
    return out


class TableAttentionModel(nn.Module):
    """One ``ga.Attention`` whose q/k/v for token id ``t`` are rows ``t`` of random tables.

    The test knows every token's q/k/v from its id, so it can compute attention densely.
    """

    def __init__(
        self,
        vocab,
        num_heads,
        num_kv_heads,
        head_size,
        *,
        sliding_window=None,
        backend=None,
        soft_cap=None,
        seed=0,
        num_layers=1,
        heads_per_layer=None,
    ):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab
        self.num_kv_heads, self.head_size = num_kv_heads, head_size
        heads = heads_per_layer or [num_heads] * num_layers
        self.q = nn.ParameterList(
            nn.Parameter(torch.randn(vocab, h * head_size, generator=gen), requires_grad=False)
            for h in heads
        )
        self.k = nn.Parameter(
            torch.randn(vocab, num_kv_heads * head_size, generator=gen), requires_grad=False
        )
        self.v = nn.Parameter(
            torch.randn(vocab, num_kv_heads * head_size, generator=gen), requires_grad=False
        )
        self.attns = nn.ModuleList(
            ga.Attention(
                h,
                head_size,
                head_size**-0.5,
                num_kv_heads,
                prefix=f"layers.{i}.attn",
                sliding_window=sliding_window,
                backend=backend,
                logits_soft_cap=soft_cap,
            )
            for i, h in enumerate(heads)
        )

    def forward(self, input_ids, positions):
        k, v = self.k[input_ids], self.v[input_ids]
        return torch.cat([attn(q[input_ids], k, v) for q, attn in zip(self.q, self.attns)], -1)

    def expected(self, seq_ids, num_new, layer=0):
        """Dense attention output [num_new, Hq*D] for the last ``num_new`` of ``seq_ids``."""
        ids = torch.as_tensor(seq_ids)
        attn = self.attns[layer]
        q = self.q[layer][ids[-num_new:]].view(num_new, attn.num_heads, self.head_size)
        k = self.k[ids].view(len(ids), self.num_kv_heads, self.head_size)
        v = self.v[ids].view(len(ids), self.num_kv_heads, self.head_size)
        out = dense_attention(
            q, k, v, attn.scale, sliding_window=attn.sliding_window, soft_cap=attn.logits_soft_cap
        )
        return out.reshape(num_new, -1)


@dataclass
class Seq:
    """A test request: its full token ids, how many are already cached, its block ids."""

    ids: list[int]
    num_computed: int
    blocks: list[int]

    def request(self) -> ga.Request:
        return ga.Request(self.ids[self.num_computed :], self.num_computed, self.blocks)

    def prefix_request(self) -> ga.Request:
        return ga.Request(self.ids[: self.num_computed], 0, self.blocks)


def make_seqs(rng: np.random.Generator, shapes, vocab, block_size, num_blocks) -> list[Seq]:
    """Sequences of (num_computed, num_new) shapes with distinct random blocks each."""
    need = [-(-(c + n) // block_size) for c, n in shapes]
    ids = rng.permutation(num_blocks)[: sum(need)].tolist()
    seqs, start = [], 0
    for (c, n), b in zip(shapes, need):
        seqs.append(Seq(rng.integers(0, vocab, c + n).tolist(), c, ids[start : start + b]))
        start += b
    return seqs


def prefill_prefixes(engine, seqs: list[Seq]) -> None:
    """Cache every sequence's computed prefix, as many per step as the token budget allows."""
    budget, chunk, used = engine.config.max_num_tokens, [], 0
    for s in (s for s in seqs if s.num_computed):
        if chunk and used + s.num_computed > budget:
            engine.step(ga.Batch.from_requests(chunk))
            chunk, used = [], 0
        chunk.append(s.prefix_request())
        used += s.num_computed
    if chunk:
        engine.step(ga.Batch.from_requests(chunk))


def run_with_prefixes(engine, seqs: list[Seq]) -> torch.Tensor:
    """Cache every sequence's computed prefix, then run the new tokens (one step)."""
    prefill_prefixes(engine, seqs)
    return engine.step(ga.Batch.from_requests([s.request() for s in seqs]))


def snapshot(engine):
    """Copies of every cache tensor, the allocator's free list and debug's block record."""
    return (
        {n: t.clone() for n, t in engine.kv_cache.tensors.items()},
        list(engine.kv_cache.allocator._free),
        engine.kv_cache.allocator.entries.copy(),
    )


def assert_unchanged(engine, snap) -> None:
    tensors, free, entries = snap
    for name, t in engine.kv_cache.tensors.items():
        assert torch.equal(t, tensors[name]), f"KV cache of {name} changed"
    assert engine.kv_cache.allocator._free == free, "allocator changed"
    assert (engine.kv_cache.allocator.entries == entries).all(), "debug's block record changed"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def eager_engine(model, **overrides):
    """``ga.compile`` without a trace (compile_backend="none") unless the test says otherwise:
    for tests whose subject is not compilation, so the CPU suite stays fast.
    """
    overrides.setdefault("compile_backend", "none")
    return ga.compile(model, **overrides)


def small_bf16_llama(vocab, hidden, intermediate, *, device="cpu", norms_off_one=False):
    """A seeded 2-layer bf16 Llama with 4 query and 2 KV heads. ``norms_off_one`` draws the
    norm weights from [0.5, 1.5], so a rewrite that drops them changes the output."""
    from graphattn.models.llama import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device, torch.bfloat16)
    if norms_off_one:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
    return model


def compiled_without_interpreter(module: str, function: str):
    """``module.function()``'s JSON result, run in a process without TRITON_INTERPRET (kernels
    defined for compilation, as CI compiles for a GPU it does not have)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import json, {module}; print(json.dumps({module}.{function}()))"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=os.path.dirname(__file__),
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_main_needs_cuda(main, capsys) -> None:
    """A GPU-only benchmark's ``main([])`` on a machine without CUDA: exit code 2 and a
    message saying so (skipped where a CUDA device is present)."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    assert main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def as_model_inputs(gm):
    """Mark every placeholder of ``gm`` a model input no kernel writes (``split.MODEL_INPUT``,
    which the pass manager sets for a piece of a compiled model), as a graph built by hand
    for a pass's tests stands for a piece whose inputs are all parameters."""
    from graphattn.passes.split import MODEL_INPUT

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta[MODEL_INPUT] = True
    return gm

"""The decode benchmark's baseline: graphattn's Llama rewritten in plain PyTorch with a static KV cache.

This is the model a user would write for ``torch.compile``: every request owns one row of a
static cache per layer, a step writes its keys and values at its positions with an indexed
store and attends over the whole row under a mask. At a fixed batch size every shape is
fixed and the forward has no graph break, so ``torch.compile(mode="default")`` and
``torch.compile(mode="reduce-overhead")`` take it whole; with ``dynamic=True`` the batch
dimension is symbolic.

The cache is ``[max_batch, Hkv, max_len, D]`` (heads before positions): each (request,
head) is then one contiguous ``[max_len, D]`` matrix, which a batched matmul reads in place.
With positions before heads the matmul would first copy the whole cache every step.

Weights come from a graphattn ``LlamaForCausalLM`` (``from_graphattn``), so both run the
same function: the logits match graphattn's eager engine (tests/test_benchmark_baseline.py).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from graphattn.models import LlamaConfig, LlamaForCausalLM


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as graphattn's Llama computes it."""

    def __init__(self, hidden_size: int, eps: float, **factory) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in float32. x: [B, S, H, D]; cos, sin: [B, S, D/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)  # [B, S, H, D/2] each
    cos, sin = cos[:, :, None, :].float(), sin[:, :, None, :].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal GQA attention over whole cache rows: a query at position p sees slots 0..p.

    q: [B, S, Hq, D]; k, v: [B, Hkv, L, D]; positions: [B, S]. Returns [B, S, Hq*D].
    The G = Hq/Hkv query heads of one KV head share one matmul, so K and V are read once.
    """
    b, s, hq, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = (
        q.view(b, s, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * s, d)
    )  # [B, Hkv, G*S, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [B, Hkv, G*S, L]
    slots = torch.arange(length, device=q.device)
    visible = slots[None, None, :] <= positions[:, :, None]  # [B, S, L]
    scores = scores.view(b, hkv, g, s, length).masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, hkv, g * s, length)
    out = torch.matmul(probs, v)  # [B, Hkv, G*S, D]
    return out.view(b, hkv, g, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, hq * d)


class Block(nn.Module):
    """One decoder layer with its own static KV cache."""

    def __init__(self, cfg: LlamaConfig, max_batch: int, max_len: int, **factory) -> None:
        super().__init__()
        d, hq, hkv = cfg.head_size, cfg.num_attention_heads, cfg.kv_heads
        self.num_heads, self.num_kv_heads, self.head_size = hq, hkv, d
        self.scale = d**-0.5
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)
        self.wqkv = nn.Linear(cfg.hidden_size, (hq + 2 * hkv) * d, cfg.attention_bias, **factory)
        self.wo = nn.Linear(hq * d, cfg.hidden_size, bias=False, **factory)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)
        self.w13 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False, **factory)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False, **factory)
        cache_shape = (max_batch, hkv, max_len, d)
        self.register_buffer("k_cache", torch.zeros(cache_shape, **factory), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape, **factory), persistent=False)

    def forward(self, x, positions, cos, sin, first_row: int = 0):
        """x: [B, S, H]; positions: [B, S] -> [B, S, H]. Rows first_row.. of the cache."""
        x = x + self.attention(self.attention_norm(x), positions, cos, sin, first_row)
        h = self.ffn_norm(x)
        gate, up = self.w13(h).chunk(2, dim=-1)  # [B, S, I] each
        return x + self.w2(nn.functional.silu(gate) * up)

    def attention(self, x, positions, cos, sin, first_row: int):
        b, s, _ = x.shape
        d, hq, hkv = self.head_size, self.num_heads, self.num_kv_heads
        q, k, v = self.wqkv(x).split([hq * d, hkv * d, hkv * d], dim=-1)
        q = apply_rope(q.view(b, s, hq, d), cos, sin)  # [B, S, Hq, D]
        k = apply_rope(k.view(b, s, hkv, d), cos, sin)  # [B, S, Hkv, D]
        rows = torch.arange(first_row, first_row + b, device=x.device)[:, None].expand(b, s)
        self.k_cache[rows, :, positions] = k  # indexed store at [row, :, position]
        self.v_cache[rows, :, positions] = v.view(b, s, hkv, d)
        k_rows = self.k_cache[first_row : first_row + b]  # [B, Hkv, L, D]
        v_rows = self.v_cache[first_row : first_row + b]
        return self.wo(masked_attention(q, k_rows, v_rows, positions, self.scale))


class StaticLlama(nn.Module):
    """``forward(tokens [B], positions [B]) -> logits [B, V]``: one decode step of B requests.

    Request i is row i of every layer's cache; ``prefill`` fills rows with prompts.
    """

    def __init__(self, cfg: LlamaConfig, max_batch: int, max_len: int, **factory) -> None:
        super().__init__()
        if cfg.sliding_window is not None:
            raise ValueError("the baseline has no sliding-window attention")
        self.config, self.max_batch, self.max_len = cfg, max_batch, max_len
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, **factory)
        self.layers = nn.ModuleList(
            Block(cfg, max_batch, max_len, **factory) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, **factory)
        rope_shape = (max_len, cfg.head_size)  # [L, D]: cos of D/2 frequencies, then sin
        self.register_buffer("cos_sin", torch.zeros(rope_shape, **factory), persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.hidden(tokens[:, None], positions[:, None])  # [B, 1, H]
        return self.output(hidden[:, -1])  # [B, V]

    def hidden(self, tokens, positions, first_row: int = 0) -> torch.Tensor:
        """tokens, positions: [B, S] -> final hidden states [B, S, H]."""
        x = self.tok_embeddings(tokens)  # [B, S, H]
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)  # [B, S, D/2] each
        for layer in self.layers:
            x = layer(x, positions, cos, sin, first_row)
        return self.norm(x)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, first_row: int = 0, chunk: int = 128) -> None:
        """Write prompts ``tokens [B, S]`` into rows first_row.. at positions 0..S-1 (eager).

        Runs ``chunk`` positions at a time to bound the [B, Hkv, G*chunk, L] scores.
        """
        b, s = tokens.shape
        positions = torch.arange(s, device=tokens.device).expand(b, s)
        for start in range(0, s, chunk):
            end = min(start + chunk, s)
            self.hidden(tokens[:, start:end], positions[:, start:end], first_row)

    def reset_cache(self) -> None:
        for layer in self.layers:
            layer.k_cache.zero_()
            layer.v_cache.zero_()

    def cache_tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in (layer.k_cache, layer.v_cache)]

    @classmethod
    def from_graphattn(cls, model: LlamaForCausalLM, max_batch: int, max_len: int) -> StaticLlama:
        """A baseline with ``model``'s weights (copied), on its device and in its dtype."""
        param = next(model.parameters())
        with torch.device("meta"):
            base = cls(model.config, max_batch, max_len, dtype=param.dtype)
        base = base.to_empty(device=param.device)
        base.load_state_dict(baseline_state_dict(model), strict=True)
        rope = rope_table(model)
        if rope.shape[0] < max_len:
            raise ValueError(f"max_len {max_len} exceeds the model's {rope.shape[0]} positions")
        base.cos_sin = rope[:max_len].clone()  # the model's values, in the model's table dtype
        base.reset_cache()
        return base.eval()


def rope_table(model: LlamaForCausalLM) -> torch.Tensor:
    """The model's rotary table ``[max_positions, D]`` (cos of D/2 frequencies, then sin)."""
    for name, buffer in model.named_buffers():
        if name.endswith("cos_sin_cache"):
            return buffer
    raise ValueError(f"{type(model).__name__} has no rotary table (a cos_sin_cache buffer)")


# graphattn parameter name -> baseline parameter name
_RENAMES = (
    (r"^embed_tokens\.", "tok_embeddings."),
    (r"\.input_layernorm\.", ".attention_norm."),
    (r"\.self_attn\.qkv_proj\.", ".wqkv."),
    (r"\.self_attn\.o_proj\.", ".wo."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.mlp\.gate_up_proj\.", ".w13."),
    (r"\.mlp\.down_proj\.", ".w2."),
    (r"^lm_head\.", "output."),
)


def baseline_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """``model``'s parameters under the baseline's names (merged qkv and gate/up kept merged)."""
    renamed = {}
    for name, tensor in model.state_dict().items():
        for pattern, replacement in _RENAMES:
            name = re.sub(pattern, replacement, name)
        renamed[name] = tensor
    return renamed

"""A Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU, tied or untied head) on ``ga.Attention``.

The forward takes the flat token layout: ``input_ids [T]`` and ``positions [T]`` for all
requests of a step back to back, and returns hidden states ``[T, hidden]``;
``compute_logits`` maps hidden states to ``[T, vocab]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from graphattn.attention.layer import Attention
from graphattn.errors import ConfigError
from graphattn.head import linear


@dataclass(frozen=True)
class LlamaConfig:
    """Model shape; field names follow Hugging Face's ``LlamaConfig``."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    sliding_window: int | None = None

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def tiny(cls, **overrides: Any) -> LlamaConfig:
        """A few-layer model for tests and the demo (head size 64: every backend serves it)."""
        base = dict(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=2048,
        )
        return cls(**{**base, **overrides})

    @classmethod
    def llama_3_2_1b(cls, **overrides: Any) -> LlamaConfig:
        """Llama-3.2-1B's shape (with an untied head, as the benchmark specifies)."""
        base = dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            rope_theta=500000.0,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        )
        return cls(**{**base, **overrides})


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half layout), cos/sin looked up by position.

    ``scaling`` (Hugging Face's ``rope_scaling``): ``linear``, ``llama3`` or ``yarn``; YaRN
    also scales cos and sin by its attention factor, as transformers does.
    """

    def __init__(
        self, head_size: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
        scaling = resolve_rope_scaling(scaling, max_positions)
        if scaling is not None:
            inv_freq = _scale_inv_freq(inv_freq, scaling, theta)
        magnitude = rope_magnitude(scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        cache = magnitude * torch.cat([angles.cos(), angles.sin()], dim=-1)
        self.register_buffer("cos_sin_cache", cache.float(), persistent=False)  # [P, D]
        self.head_size = head_size

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of every token's position, ``[T, D/2]`` each; looked up once per step."""
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        return cos, sin


def apply_rotary(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], d: int) -> torch.Tensor:
    """Rotate ``x`` ``[T, H*D]`` (rotate-half layout) by the step's (cos, sin)."""
    t = x.shape[0]
    cos, sin = rope[0][:, None, :].float(), rope[1][:, None, :].float()  # [T, 1, D/2]
    x1, x2 = x.view(t, -1, d).float().chunk(2, dim=-1)  # [T, H, D/2] each
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype).view(t, -1)


# rope_scaling kinds: the numbers each needs, and the ones it may take
ROPE_NEEDS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor",),
}
ROPE_OPTIONAL: dict[str, tuple[str, ...]] = {
    "yarn": (
        "original_max_position_embeddings",  # default: max_position_embeddings
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
    ),
}


def resolve_rope_scaling(
    scaling: dict[str, Any] | None, max_positions: int
) -> dict[str, Any] | None:
    """``scaling`` checked (a ``ConfigError`` names what is missing or not a number), its
    kind under ``rope_type``, and YaRN's original context ``max_positions`` where none is
    given, as transformers fills it. None or the default kind: None."""
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type")) or "default"
    if kind not in ROPE_NEEDS:
        raise ConfigError(f"rope scaling {kind!r} is not supported ({', '.join(ROPE_NEEDS)})")
    missing = [k for k in ROPE_NEEDS[kind] if not _is_number(scaling.get(k))]
    bad = [k for k in ROPE_OPTIONAL.get(kind, ()) if k in scaling and not _is_number(scaling[k])]
    if missing or bad:
        raise ConfigError(
            f"rope_scaling of type {kind!r} needs the numbers {list(ROPE_NEEDS[kind])}; missing "
            f"or not a number: {missing + bad} (got {scaling})"
        )
    if kind == "default":
        return None
    out = {**scaling, "rope_type": kind}
    if kind == "yarn":
        out.setdefault("original_max_position_embeddings", max_positions)
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any], theta: float) -> torch.Tensor:
    """The frequencies under ``scaling`` (resolved): ``linear`` slows them all by
    ``factor``; ``llama3`` slows long wavelengths by ``factor`` and keeps short ones,
    blending between; ``yarn`` blends by the number of rotations a dimension makes within
    the original context."""
    kind, factor = scaling["rope_type"], scaling["factor"]
    if kind == "linear":
        return inv_freq / factor
    old_len = scaling["original_max_position_embeddings"]
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, scaling, theta, factor, old_len)
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen) - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, blended)
    return torch.where(wavelen < old_len / high, inv_freq, out)


def _yarn_inv_freq(inv_freq, scaling, theta, factor, old_len) -> torch.Tensor:
    """YaRN (Peng et al., 2023): dimensions that turn more than ``beta_fast`` times within
    ``old_len`` positions keep their frequency, those that turn fewer than ``beta_slow``
    times are slowed by ``factor`` (interpolated), and a linear ramp over the dimensions
    between mixes the two. The ramp's ends are rounded outwards unless ``truncate`` is
    False, as transformers does."""
    dim = 2 * inv_freq.numel()

    def dim_turning(times: float) -> float:  # the dimension that turns `times` times
        return dim * math.log(old_len / (times * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_turning(scaling.get("beta_fast") or 32), dim_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if hi == lo:
        hi += 0.001  # no division by zero where the ramp is a step
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def yarn_mscale(factor: float, scale: float = 1.0) -> float:
    """YaRN's magnitude correction for stretching positions by ``factor``: 0.1 * scale *
    ln(factor) + 1 (1 where nothing is stretched)."""
    return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0


def rope_magnitude(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by under ``scaling`` (resolved): YaRN's attention
    factor (given, or from ``mscale`` over ``mscale_all_dim`` where both are set, else from
    the factor alone); 1 for every other kind."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return yarn_mscale(factor, m) / yarn_mscale(factor, m_all)
    return yarn_mscale(factor)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, prefix: str) -> None:
        super().__init__()
        d, hq, hk = cfg.head_size, cfg.num_attention_heads, cfg.kv_heads
        self.q_size, self.kv_size = hq * d, hk * d
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.head_size = d
        self.attn = Attention(
            hq, d, d**-0.5, hk, prefix=f"{prefix}.attn", sliding_window=cfg.sliding_window
        )

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        qk_size = self.q_size + self.kv_size
        # q and k rotated together: one fused kernel under Inductor instead of two
        qk = apply_rotary(qkv[:, :qk_size], rope, self.head_size)  # [T, (Hq+Hkv)*D]
        q, k = qk.split([self.q_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, qkv[:, qk_size:]))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inner = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inner, bias=False)
        self.down_proj = nn.Linear(inner, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    # (cfg, prefix) -> the attention block (graphattn.models.mla's layer gives its own)
    attention_cls: type[nn.Module] = LlamaAttention

    def __init__(self, cfg: LlamaConfig, prefix: str, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_cls(cfg, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.make_mlp(cfg, index)

    def make_mlp(self, cfg: LlamaConfig, index: int) -> nn.Module:
        """Layer ``index``'s MLP (graphattn.models.mla's layers may take a mixture of experts)."""
        return LlamaMLP(cfg)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(rope, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T]) -> hidden [T, H]``; ``compute_logits`` -> [T, V]."""

    # (cfg, prefix, index) -> one decoder layer (its index since round 41: MLA's layers choose
    # their MLP by it)
    layer_cls: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # one table for all layers: [max_positions, rotated dims] float32
        self.rotary_emb = self.make_rotary_emb(cfg)
        self.layers = nn.ModuleList(
            self.layer_cls(cfg, f"model.layers.{i}", i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @staticmethod
    def make_rotary_emb(cfg: LlamaConfig) -> RotaryEmbedding:
        return RotaryEmbedding(
            cfg.head_size, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, H]
        rope = self.rotary_emb(positions)
        for layer in self.layers:
            x = layer(rope, x)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head.weight, self.lm_head.bias)  # [T, V]


def init_random_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> nn.Module:
    """Deterministic random weights in the usual small-normal scale (norms 1, biases 0),
    drawn on the parameters' device (a CPU generator takes seconds for a billion weights).
    """
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                if p.device not in generators:
                    generators[p.device] = torch.Generator(p.device).manual_seed(seed)
                p.normal_(0.0, std, generator=generators[p.device])
    return model

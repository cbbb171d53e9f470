"""A small decoder with DeepSeek-V2's multi-head latent attention (MLA) on ``ga.MLAAttention``.

Each layer projects the hidden state to a compressed KV (``kv_lora_rank``) and a rotary key
part shared by all heads, and caches only those; ``kv_b_proj`` expands the compressed KV to
each head's key (no-position part) and value, which ``ga.MLAAttention`` folds into the
query and the output instead. The forward takes
``input_ids [T]`` and ``positions [T]`` and returns hidden states ``[T, hidden]``;
``compute_logits`` maps them to ``[T, vocab]``. Random weights: ``init_random_weights``.

Where it differs from DeepSeek-V2 (so no checkpoint of it loads as is): the MLP of every
layer is dense SwiGLU (no mixture of experts); the rotary embedding uses the rotate-half
layout of the example Llama (DeepSeek rotates interleaved pairs); no YaRN scaling of the
positions or of the softmax scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphattn.attention.layer import MLAAttention
from graphattn.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
)


@dataclass(frozen=True)
class MLAConfig:
    """Model shape; field names follow Hugging Face's ``DeepseekV2Config``."""

    vocab_size: int = 102400
    hidden_size: int = 2048
    intermediate_size: int = 10944
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    q_lora_rank: int | None = None  # None: one q_proj (DeepSeek-V2-Lite); else q_a/q_b
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def tiny(cls, **overrides: Any) -> MLAConfig:
        """A few-layer model for tests and examples."""
        base = dict(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            q_lora_rank=96,
            kv_lora_rank=64,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
            max_position_embeddings=2048,
        )
        return cls(**{**base, **overrides})


class MLASelfAttention(nn.Module):
    """DeepSeek-V2's attention block: the projections around ``ga.MLAAttention``."""

    def __init__(self, cfg: MLAConfig, prefix: str) -> None:
        super().__init__()
        h, hidden = cfg.num_attention_heads, cfg.hidden_size
        self.cfg = cfg
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            hidden, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False
        )
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(h * cfg.v_head_dim, hidden, bias=False)
        self.attn = MLAAttention(
            h,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            scale=cfg.qk_head_dim**-0.5,
            prefix=f"{prefix}.attn",
        )

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H * (nope + rope)]`` before the rotary embedding."""
        if self.cfg.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        cfg, t = self.cfg, x.shape[0]
        nope, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        q = self.queries(x).view(t, cfg.num_attention_heads, nope + r)
        q_pe = apply_rotary(q[..., nope:].reshape(t, -1), rope, r)  # [T, H * rope]
        q = torch.cat([q[..., :nope], q_pe.view(t, -1, r)], dim=-1).view(t, -1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, r], dim=-1)
        k_pe = apply_rotary(k_pe.contiguous(), rope, r)  # [T, rope], shared by the heads
        out = self.attn(q, self.kv_a_layernorm(kv_c), k_pe, self.kv_b_proj.weight)
        return self.o_proj(out)


class MLADecoderLayer(LlamaDecoderLayer):
    """The Llama layer (pre-norm residual blocks, SwiGLU MLP) around MLA attention."""

    attention_cls = MLASelfAttention


class MLAForCausalLM(LlamaForCausalLM):
    """``forward(input_ids [T], positions [T]) -> hidden [T, H]``; ``compute_logits`` -> [T, V]
    (the example Llama's, with MLA layers and a rotary table of ``qk_rope_head_dim``)."""

    layer_cls = MLADecoderLayer

    @staticmethod
    def make_rotary_emb(cfg: MLAConfig) -> RotaryEmbedding:  # type: ignore[override]
        return RotaryEmbedding(
            cfg.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope_theta, None
        )

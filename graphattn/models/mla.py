"""A DeepSeek-V2-style decoder: multi-head latent attention (MLA) on ``ga.MLAAttention``.

Each layer projects the hidden state to a compressed KV (``kv_lora_rank``) and a rotary key
part shared by all heads, and caches only those; ``kv_b_proj`` expands the compressed KV to
each head's key (no-position part) and value, which ``ga.MLAAttention`` folds into the
query and the output instead. The forward takes
``input_ids [T]`` and ``positions [T]`` and returns hidden states ``[T, hidden]``;
``compute_logits`` maps them to ``[T, vocab]``. Random weights: ``init_random_weights``.

The MLP is dense SwiGLU, or, with ``n_routed_experts`` set, DeepSeek-V2's mixture of experts
from layer ``first_k_dense_replace`` on: a softmax router picks ``num_experts_per_tok``
experts a token (``greedy``, or ``group_limited_greedy`` within the best ``topk_group`` of
``n_group`` groups), their outputs weighted by the router's probabilities times
``routed_scaling_factor``, plus ``n_shared_experts`` always-on experts as one wider MLP.
The experts run as one grouped GEMM over the (token, pick) rows sorted by expert where
``torch._grouped_mm`` serves the device and dtype without a host sync (bf16 on Hopper and
Blackwell GPUs and on the CPU), else every expert on every token, weighted (``Experts``);
both keep the step's shapes static, so the layer traces and captures like any other.

The rotary embedding rotates halves (the example Llama's layout); DeepSeek's checkpoints
rotate interleaved pairs, so ``graphattn.models.load`` reorders the rotary rows of the
query and key projections, which leaves every score unchanged. ``rope_scaling`` may be
YaRN, which also scales the softmax (``softmax_scale``) as DeepSeek-V2 does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from graphattn import envs
from graphattn.attention.layer import MLAAttention
from graphattn.errors import ConfigError
from graphattn.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    resolve_rope_scaling,
    yarn_mscale,
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
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    # the mixture of experts (None: a dense MLP in every layer)
    n_routed_experts: int | None = None
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 1408
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0  # layers before it keep the dense MLP
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"  # or "group_limited_greedy"
    n_group: int | None = None
    topk_group: int | None = None

    def __post_init__(self) -> None:
        if self.n_routed_experts is None:
            return
        e, k = self.n_routed_experts, self.num_experts_per_tok
        if not 0 < k <= e:
            raise ConfigError(f"num_experts_per_tok must lie in [1, {e}] (the experts), got {k}")
        if self.topk_method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(
                f"topk_method must be 'greedy' or 'group_limited_greedy', got {self.topk_method!r}"
            )
        if self.topk_method == "group_limited_greedy":
            g, top = self.n_group, self.topk_group
            if not (isinstance(g, int) and g > 0 and e % g == 0):
                raise ConfigError(f"n_group must divide n_routed_experts ({e}), got {g!r}")
            if not (isinstance(top, int) and 0 < top <= g and k <= top * (e // g)):
                raise ConfigError(
                    f"topk_group must lie in [1, n_group={g}] and leave {k} experts to pick, "
                    f"got {top!r}"
                )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1 / sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim) squared where
        the rope is YaRN with ``mscale_all_dim`` (DeepSeek-V2's long-context scaling)."""
        scale = self.qk_head_dim**-0.5
        rope = resolve_rope_scaling(self.rope_scaling, self.max_position_embeddings) or {}
        if rope.get("rope_type") == "yarn" and rope.get("mscale_all_dim"):
            scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
        return scale

    def is_moe_layer(self, index: int) -> bool:
        return self.n_routed_experts is not None and index >= self.first_k_dense_replace

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
            scale=cfg.softmax_scale,
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


class MoE(nn.Module):
    """DeepSeek-V2's mixture of experts (see the module): a router, ``n_routed_experts``
    SwiGLU experts stored as two stacked weights (Hugging Face's layout: ``gate_up_proj``
    ``[E, 2 * inner, hidden]``, ``down_proj`` ``[E, hidden, inner]``), and the shared
    experts."""

    def __init__(self, cfg: MLAConfig) -> None:
        super().__init__()
        e, inner, hidden = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.cfg = cfg
        self.gate = nn.Linear(hidden, e, bias=False)
        self.experts = Experts(e, hidden, inner)
        self.shared_experts = (
            LlamaMLP(cfg, inner * cfg.n_shared_experts) if cfg.n_shared_experts else None
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's picked experts ``[T, k]`` and their weights ``[T, k]`` fp32: the
        router's probabilities (softmax in fp32) times ``routed_scaling_factor``."""
        cfg = self.cfg
        probs = nn.functional.linear(x.float(), self.gate.weight.float()).softmax(-1)
        candidates = probs
        if cfg.topk_method == "group_limited_greedy":  # only experts of the best groups
            groups = probs.view(x.shape[0], cfg.n_group, -1)
            best = groups.amax(-1).topk(cfg.topk_group, dim=-1).indices  # [T, topk_group]
            keep = torch.zeros_like(groups[..., 0]).scatter(1, best, 1.0)  # [T, n_group]
            candidates = (groups * keep[..., None]).view_as(probs)
        top = candidates.topk(cfg.num_experts_per_tok, dim=-1)
        return top.indices, top.values * cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.route(x))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class Experts(nn.Module):
    """The routed experts, each a SwiGLU MLP, stacked. Two ways to run them, the same sums:

    - grouped: the (token, pick) rows sorted by expert and each expert's rows multiplied by
      its weights in one ``torch._grouped_mm`` (a step reads only the experts its tokens
      picked). Static shapes and, where the GEMM needs no host sync, capturable: bf16 on
      Hopper/Blackwell GPUs, and bf16 on the CPU (rows a multiple of 16 bytes).
    - dense: every expert on every token, weighted by the router (0 for the experts a token
      did not pick); it reads every expert's weights each step. Everywhere else: fp32 and
      fp16 (torch traces the grouped GEMM in bf16 only, and on a GPU runs other dtypes as a
      loop that syncs with the host), other GPUs, ``GRAPHATTN_DENSE_EXPERTS=1``.
    """

    def __init__(self, num_experts: int, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inner))
        self.use_grouped = self._grouped_serves()

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        """After every move or cast (``.to``, ``.cuda``, ``to_empty``): which way the
        weights' new device and dtype take (a plain attribute, so a traced model holds the
        choice as a constant, and the trace cache's key sees it)."""
        out = super()._apply(fn, recurse)
        self.use_grouped = self._grouped_serves()
        return out

    def _grouped_serves(self) -> bool:
        w = self.down_proj
        return grouped_gemm_serves(w.device, w.dtype, w.shape[1], w.shape[2])

    def forward(self, x: torch.Tensor, picked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.use_grouped:
            return self.grouped(x, picked, weights)
        return self.dense(x, picked, weights)

    def grouped(self, x: torch.Tensor, picked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        num_experts, k = self.gate_up_proj.shape[0], picked.shape[1]
        flat = picked.reshape(-1)  # [T * k]: row t * k + j is token t's j-th pick
        order = flat.argsort(stable=True)  # the rows, grouped by expert
        token = order // k
        ones = torch.ones_like(flat, dtype=torch.int32)
        counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
        ends = counts.scatter_add(0, flat, ones).cumsum(0, dtype=torch.int32)  # each group's end
        gate, up = torch._grouped_mm(x[token], self.gate_up_proj.transpose(1, 2), offs=ends).chunk(
            2, dim=-1
        )
        y = torch._grouped_mm(
            nn.functional.silu(gate) * up, self.down_proj.transpose(1, 2), offs=ends
        )  # [T * k, hidden], in expert order
        y = y.float() * weights.reshape(-1)[order, None]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        return out.index_add(0, token, y).to(x.dtype)

    def dense(self, x: torch.Tensor, picked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        num_experts = self.gate_up_proj.shape[0]
        every = torch.zeros(x.shape[0], num_experts, dtype=torch.float32, device=x.device)
        every = every.scatter(1, picked, weights)  # [T, E], 0 for the experts not picked
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in range(num_experts):
            gate, up = nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            y = nn.functional.linear(nn.functional.silu(gate) * up, self.down_proj[e])
            out = out + y.float() * every[:, e : e + 1]
        return out.to(x.dtype)


def grouped_gemm_serves(device: torch.device, dtype: torch.dtype, hidden: int, inner: int) -> bool:
    """Whether ``Experts`` with weights of this device and dtype takes ``torch._grouped_mm``
    (``GRAPHATTN_DENSE_EXPERTS=1``: never)."""
    if not hasattr(torch, "_grouped_mm") or envs.dense_experts():
        return False
    if dtype != torch.bfloat16:  # torch's shape function (what tracing runs) takes bf16 only
        return False
    if device.type == "cuda":  # the CUTLASS path: no host sync, so CUDA graphs capture it
        return torch.cuda.get_device_capability(device)[0] in (9, 10)
    if device.type == "cpu":  # torch >= 2.9's CPU kernel: rows of a multiple of 16 bytes
        return all(n * 2 % 16 == 0 for n in (hidden, inner))
    return False


class MLADecoderLayer(LlamaDecoderLayer):
    """The Llama layer (pre-norm residual blocks) around MLA attention, with DeepSeek-V2's
    mixture of experts where the config puts one."""

    attention_cls = MLASelfAttention

    def make_mlp(self, cfg: MLAConfig, index: int) -> nn.Module:  # type: ignore[override]
        return MoE(cfg) if cfg.is_moe_layer(index) else LlamaMLP(cfg)


class MLAForCausalLM(LlamaForCausalLM):
    """``forward(input_ids [T], positions [T]) -> hidden [T, H]``; ``compute_logits`` -> [T, V]
    (the example Llama's, with MLA layers and a rotary table of ``qk_rope_head_dim``)."""

    layer_cls = MLADecoderLayer

    @staticmethod
    def make_rotary_emb(cfg: MLAConfig) -> RotaryEmbedding:  # type: ignore[override]
        return RotaryEmbedding(
            cfg.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )

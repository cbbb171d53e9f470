"""``ga.Attention``: the layer a model uses for attention over graphattn's paged KV cache."""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch
from torch import nn

import graphattn.attention.ops  # noqa: F401  (registers torch.ops.graphattn)
from graphattn.attention.backend import AttentionBackend, AttentionSelectorConfig
from graphattn.attention.forward_context import get_forward_context
from graphattn.attention.registry import Selection, get_backend, select_backend
from graphattn.errors import ConfigError, InvalidInputError
from graphattn.kv_cache import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

_DEFAULT_BLOCK_SIZE = 16


class Attention(nn.Module):
    """Causal multi-head attention (MHA, GQA or MQA) over the paged KV cache.

    Takes the step's queries, keys and values in the flat token layout (``[T, Hq*D]`` and
    ``[T, Hkv*D]``, or ``[T, H, D]``) and returns ``[T, Hq*D]``. The layer's backend is
    selected in the constructor from what is known then (the default dtype and device)
    and confirmed by ``ga.compile`` against the engine's configuration, which may select
    again: an engine keeps its own backend, impl and cache per layer (see ``BoundLayer``),
    so one model can serve several engines. ``prefix`` names the layer; it must be unique
    in the model.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        *,
        prefix: str,
        sliding_window: int | None = None,
        backend: str | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        _check_shape_args(num_heads, head_size, num_kv_heads, prefix, sliding_window)
        logits_soft_cap = _checked_soft_cap(logits_soft_cap)
        if (
            isinstance(scale, bool)
            or not isinstance(scale, numbers.Real)
            or not math.isfinite(scale)
        ):
            raise ConfigError(f"scale must be a finite number, got {scale!r}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.layer_name = prefix
        self.requested_backend = backend
        if backend is not None:  # validated against the real configuration in ga.compile
            self.set_backend(Selection(get_backend(backend), explicit=True), None)
        else:
            # provisional (ga.compile selects again for the engine's real settings): a
            # default dtype no backend serves, such as float64 while a model is built before
            # .float(), must not fail the constructor
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
            dtype = torch.get_default_dtype()
            if dtype not in (torch.float16, torch.bfloat16, torch.float32):
                dtype = torch.float32
            cfg = self.selector_config(dtype, dtype, _DEFAULT_BLOCK_SIZE, device_type)
            self.set_backend(select_backend(cfg), None)

    def selector_config(
        self, dtype: torch.dtype, kv_cache_dtype: torch.dtype, block_size: int, device_type: str
    ) -> AttentionSelectorConfig:
        """What this layer asks of a backend under the given engine settings."""
        return AttentionSelectorConfig(
            head_size=self.head_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            block_size=block_size,
            device_type=device_type,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
        )

    def set_backend(self, selection: Selection, kv_cache_dtype: torch.dtype | None) -> None:
        """Use ``selection.backend`` from now on: a fresh impl for this layer."""
        self.selection = selection
        self.attn_backend: type[AttentionBackend] = selection.backend
        self.impl = self.make_impl(selection.backend, kv_cache_dtype)

    def make_impl(self, backend: type[AttentionBackend], kv_cache_dtype: torch.dtype | None):
        """An impl of ``backend`` for this layer's shape (engines make their own)."""
        return backend.get_impl_cls()(
            self.num_heads,
            self.head_size,
            self.scale,
            self.num_kv_heads,
            self.sliding_window,
            kv_cache_dtype,
            self.logits_soft_cap,
        )

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> FullAttentionSpec:
        if self.sliding_window is not None:
            return SlidingWindowSpec(
                block_size, self.num_kv_heads, self.head_size, dtype, self.sliding_window
            )
        return FullAttentionSpec(block_size, self.num_kv_heads, self.head_size, dtype)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        num_tokens = query.shape[0]
        if not torch.compiler.is_compiling():
            self._check_inputs(query, key, value)
        q = query.reshape(num_tokens, self.num_heads, self.head_size)  # [T, Hq, D]
        k = key.reshape(num_tokens, self.num_kv_heads, self.head_size)  # [T, Hkv, D]
        v = value.reshape(num_tokens, self.num_kv_heads, self.head_size)
        output = torch.empty_like(q)  # [T, Hq, D]
        dep = torch.ops.graphattn.unified_kv_cache_update(k, v, self.layer_name)
        torch.ops.graphattn.unified_attention_with_output(q, k, v, output, self.layer_name, dep)
        return output.view(num_tokens, self.num_heads * self.head_size)

    def _check_inputs(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        t = query.shape[0]
        for name, x, heads in (
            ("query", query, self.num_heads),
            ("key", key, self.num_kv_heads),
            ("value", value, self.num_kv_heads),
        ):
            if x.shape[0] != t or x.numel() != t * heads * self.head_size:
                raise InvalidInputError(
                    f"{self.layer_name}: {name} must be [{t}, {heads * self.head_size}] or "
                    f"[{t}, {heads}, {self.head_size}], got {list(x.shape)}"
                )
        self._check_kinds_and_call(query, (("key", key), ("value", value)), "query, key and value")

    def _check_kinds_and_call(
        self, query: torch.Tensor, others: tuple[tuple[str, torch.Tensor], ...], what: str
    ) -> None:
        """The query and the ``(name, tensor)`` others of one dtype and device, floating
        point; the layer's first call this step, and for every token of it."""
        for name, x in others:
            if x.dtype != query.dtype or x.device != query.device:
                raise InvalidInputError(
                    f"{self.layer_name}: {name} is {x.dtype} on {x.device}, query is "
                    f"{query.dtype} on {query.device}; {what} must have one dtype and device"
                )
        if not query.is_floating_point():
            raise InvalidInputError(
                f"{self.layer_name}: {what} must be floating point, got {query.dtype}"
            )
        t = query.shape[0]
        ctx = get_forward_context()
        if ctx.called is None:
            ctx.called = set()
        elif self.layer_name in ctx.called:
            raise InvalidInputError(twice_called_message(self.layer_name))
        ctx.called.add(self.layer_name)
        slots = None if ctx.slot_mapping is None else ctx.slot_mapping.get(self.layer_name)
        expected = ctx.num_tokens if slots is None else slots.shape[0]
        if expected is not None and expected != t:
            raise InvalidInputError(
                f"{self.layer_name}: got {what} for {t} tokens; the step has "
                f"{expected} (the length of input_ids): attention takes every token"
            )

    def extra_repr(self) -> str:
        sw = f", sliding_window={self.sliding_window}" if self.sliding_window else ""
        return (
            f"{self.layer_name}: heads={self.num_heads}/{self.num_kv_heads}, "
            f"head_size={self.head_size}, backend={self.attn_backend.get_name()}{sw}"
        )


class MLAAttention(Attention):
    """Multi-head latent attention (DeepSeek-V2's MLA) over the paged KV cache.

    The cache keeps one entry per token for all heads: the normalized compressed KV
    (``kv_lora_rank`` values) and the rotary key part (``qk_rope_head_dim``). Each head's key
    and value come from the compressed KV through ``kv_b_proj`` (``[H * (qk_nope_head_dim +
    v_head_dim), kv_lora_rank]``), so the layer folds that projection into the query and the
    output instead of expanding the cache ("absorbed" MLA): per head,
    ``q_nope @ W_UK`` gives a query in the compressed space, attention runs over the cache
    entries as one shared KV head whose values are their first ``kv_lora_rank`` columns, and
    ``@ W_UV.T`` maps its output back to ``v_head_dim``. The backend sees MQA with a query
    and key of ``kv_lora_rank + qk_rope_head_dim`` and a value of ``kv_lora_rank``; only a
    backend whose ``is_mla()`` is True serves it.

    ``forward(query, kv_c_normed, k_pe, kv_b_proj_weight)``: the queries ``[T, H *
    (qk_nope_head_dim + qk_rope_head_dim)]`` (nope part first, rotary part rotated), the
    normalized compressed KV ``[T, kv_lora_rank]``, the rotated rotary key ``[T,
    qk_rope_head_dim]`` and the model's ``kv_b_proj`` weight; returns ``[T, H * v_head_dim]``,
    the rows o_proj takes. ``scale`` multiplies the scores (DeepSeek: ``(qk_nope_head_dim +
    qk_rope_head_dim) ** -0.5``, times its YaRN factor where the model has one).
    """

    def __init__(
        self,
        num_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
        prefix: str,
        backend: str | None = None,
    ) -> None:
        for name, value in (
            ("kv_lora_rank", kv_lora_rank),
            ("qk_nope_head_dim", qk_nope_head_dim),
            ("qk_rope_head_dim", qk_rope_head_dim),
            ("v_head_dim", v_head_dim),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if qk_rope_head_dim % 2:
            raise ConfigError(
                f"qk_rope_head_dim must be even (rotary pairs), got {qk_rope_head_dim}"
            )
        # set before Attention.__init__, which selects a backend through selector_config
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        super().__init__(
            num_heads, kv_lora_rank + qk_rope_head_dim, scale, 1, prefix=prefix, backend=backend
        )

    def selector_config(
        self, dtype: torch.dtype, kv_cache_dtype: torch.dtype, block_size: int, device_type: str
    ) -> AttentionSelectorConfig:
        cfg = super().selector_config(dtype, kv_cache_dtype, block_size, device_type)
        return dataclasses.replace(cfg, use_mla=True)

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> MLAAttentionSpec:
        return MLAAttentionSpec(
            block_size, 1, self.head_size, dtype, self.kv_lora_rank, self.num_heads
        )

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_b_proj_weight: torch.Tensor,
    ) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            self._check_mla_inputs(query, kv_c_normed, k_pe, kv_b_proj_weight)
        t, h, rank = query.shape[0], self.num_heads, self.kv_lora_rank
        nope, rope, v_dim = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        q_nope, q_pe = query.reshape(t, h, nope + rope).split([nope, rope], dim=-1)
        w_uk = kv_b_proj_weight.unflatten(0, (h, nope + v_dim))[:, :nope]  # [H, nope, rank]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, rank]
        q = torch.cat([q_latent, q_pe], dim=-1)  # [T, H, rank + rope]
        kv = torch.cat([kv_c_normed.reshape(t, rank), k_pe.reshape(t, rope)], dim=-1)
        kv = kv.view(t, 1, rank + rope)
        latent = kv[..., :rank]  # the values: the compressed KV, a view of the entries
        output = query.new_empty(t, h, rank)
        dep = torch.ops.graphattn.unified_kv_cache_update(kv, latent, self.layer_name)
        torch.ops.graphattn.unified_attention_with_output(
            q, kv, latent, output, self.layer_name, dep
        )
        # sliced from the weight here, after the op: the piece after the split then reads
        # the parameter itself, not a view the piece before made
        w_uv = kv_b_proj_weight.unflatten(0, (h, nope + v_dim))[:, nope:]  # [H, v, rank]
        out = torch.bmm(output.transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, v]
        return out.transpose(0, 1).reshape(t, h * v_dim)

    def _check_mla_inputs(self, query, kv_c_normed, k_pe, weight) -> None:
        """Each input a tensor of one of its layouts, of the query's dtype and device."""
        h, rank = self.num_heads, self.kv_lora_rank
        nope, rope, v_dim = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        t = query.shape[0] if isinstance(query, torch.Tensor) and query.dim() > 0 else "T"
        for name, x, layouts in (
            ("query", query, ([t, h * (nope + rope)], [t, h, nope + rope])),
            ("kv_c_normed", kv_c_normed, ([t, rank], [t, 1, rank])),
            ("k_pe", k_pe, ([t, rope], [t, 1, rope])),
            ("kv_b_proj_weight", weight, ([h * (nope + v_dim), rank],)),
        ):
            if not isinstance(x, torch.Tensor) or list(x.shape) not in layouts:
                got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise InvalidInputError(
                    f"{self.layer_name}: {name} must be {' or '.join(map(str, layouts))}, got {got}"
                )
        others = (("kv_c_normed", kv_c_normed), ("k_pe", k_pe), ("kv_b_proj_weight", weight))
        self._check_kinds_and_call(query, others, "the MLA inputs")

    def extra_repr(self) -> str:
        return (
            f"{self.layer_name}: heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
            f"qk_nope={self.qk_nope_head_dim}, qk_rope={self.qk_rope_head_dim}, "
            f"v={self.v_head_dim}, backend={self.attn_backend.get_name()}"
        )


def twice_called_message(layer_name: str) -> str:
    return (
        f"{layer_name} ran twice in one forward; a ga.Attention owns one layer's KV cache "
        f"and writes it once a step (a second call overwrites the first call's keys and "
        f"values): give each call its own ga.Attention (its own prefix), or call a shared "
        f"layer once and reuse its output"
    )


def _checked_soft_cap(cap: object) -> float | None:
    """None or a finite cap > 0; 0 means no cap, as flash-attn and checkpoint configs use it
    (a cap of 0 divides by zero in the kernels, and inf or NaN turns every score to NaN)."""
    if cap is None or (cap == 0 and not isinstance(cap, bool)):
        return None
    if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not 0 < cap < math.inf:
        raise ConfigError(f"logits_soft_cap must be a finite number > 0, 0 or None, got {cap!r}")
    return float(cap)


def _check_shape_args(num_heads, head_size, num_kv_heads, prefix, sliding_window) -> None:
    for name, value in (
        ("num_heads", num_heads),
        ("head_size", head_size),
        ("num_kv_heads", num_kv_heads),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive int, got {value!r}")
    if num_heads % num_kv_heads:
        raise ConfigError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if not isinstance(prefix, str) or not prefix:
        raise ConfigError(f"prefix must name the layer (a non-empty str), got {prefix!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ConfigError(f"sliding_window must be a positive int or None, got {sliding_window!r}")

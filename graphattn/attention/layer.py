"""``ga.Attention``: the layer a model uses for attention over graphattn's paged KV cache."""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

import graphattn.attention.ops  # noqa: F401  (registers torch.ops.graphattn)
from graphattn.attention.backend import AttentionBackend, AttentionSelectorConfig
from graphattn.attention.forward_context import get_forward_context
from graphattn.attention.registry import Selection, get_backend, select_backend
from graphattn.errors import ConfigError, InvalidInputError
from graphattn.kv_cache import FullAttentionSpec, SlidingWindowSpec

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
            if x.dtype != query.dtype or x.device != query.device:
                raise InvalidInputError(
                    f"{self.layer_name}: {name} is {x.dtype} on {x.device}, query is "
                    f"{query.dtype} on {query.device}; all three must match"
                )
        if not query.is_floating_point():
            raise InvalidInputError(
                f"{self.layer_name}: query, key and value must be floating point, got {query.dtype}"
            )
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
                f"{self.layer_name}: got query, key and value for {t} tokens; the step has "
                f"{expected} (the length of input_ids): attention takes every token"
            )

    def extra_repr(self) -> str:
        sw = f", sliding_window={self.sliding_window}" if self.sliding_window else ""
        return (
            f"{self.layer_name}: heads={self.num_heads}/{self.num_kv_heads}, "
            f"head_size={self.head_size}, backend={self.attn_backend.get_name()}{sw}"
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

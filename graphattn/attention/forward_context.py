"""The per-step attention state the custom ops read: layers, metadata, slot mappings, mode."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from graphattn.capture.mode import CUDAGraphMode
from graphattn.errors import ForwardContextError


@dataclass
class BoundLayer:
    """One attention layer as an engine runs it: the module with the engine's backend, impl
    and cache tensor. Kept by the engine, not the module, so several engines can serve one model.
    """

    layer: Any  # the ga.Attention module
    backend: Any  # its AttentionBackend class in this engine
    impl: Any  # the engine's AttentionImpl for it
    kv_cache: torch.Tensor | None = None


@dataclass
class ForwardContext:
    """What one step's attention ops need; set by the runner around the model call.

    ``layers`` is static for an engine (layer name -> ``BoundLayer``). ``attn_metadata``
    and ``slot_mapping`` map every layer name to its group's object for this step; both
    are None in a profile run.
    """

    layers: Mapping[str, Any]
    attn_metadata: Mapping[str, Any] | None = None
    slot_mapping: Mapping[str, torch.Tensor] | None = None
    batch_descriptor: Any = None
    runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    # the layers an uncompiled forward has called so far (ga.Attention's checks; made by
    # the first layer, so that a compiled step's context allocates nothing for it)
    called: set[str] | None = None
    # the forward's token count where no slot mapping gives it (the uncompiled profile run)
    num_tokens: int | None = None

    def layer(self, name: str) -> Any:
        try:
            return self.layers[name]
        except KeyError:
            raise ForwardContextError(
                f"attention layer {name!r} is not part of the running engine "
                f"(known: {sorted(self.layers)[:8]}...)"
            ) from None


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    """The context of the step in progress; an error outside ``set_forward_context``."""
    if _current is None:
        raise ForwardContextError(
            "a graphattn attention op ran outside a forward context; run the model through "
            "engine.step(batch) (or wrap the call in set_forward_context)"
        )
    return _current


def is_forward_context_set() -> bool:
    return _current is not None


class set_forward_context:  # lower case: called like the function it replaced
    """Make a context current for the ``with`` block; the previous one is restored after.

    A class rather than a generator: it runs on every step, and ``contextlib``'s wrapper
    costs about a microsecond more. Like the generator it replaced, one object is entered
    once.
    """

    __slots__ = ("context", "entered", "previous")

    def __init__(
        self,
        attn_metadata: Mapping[str, Any] | None,
        batch_descriptor: Any = None,
        runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
        *,
        layers: Mapping[str, Any],
        slot_mapping: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.context = ForwardContext(
            layers, attn_metadata, slot_mapping, batch_descriptor, runtime_mode
        )
        self.previous: ForwardContext | None = None
        self.entered = False

    def __enter__(self) -> ForwardContext:
        global _current
        if self.entered:
            raise ForwardContextError(
                "this set_forward_context(...) object was already entered; make a new one "
                "for each with block"
            )
        self.entered = True
        self.previous, _current = _current, self.context
        return self.context

    def __exit__(self, *exc: object) -> None:
        global _current
        _current = self.previous

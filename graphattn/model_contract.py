"""What graphattn needs of a model's forward, checked at start-up on both paths (the
uncompiled profile run and the compiled path's trace): ``forward(input_ids, positions)``
that takes the two tensors positionally and returns one floating-point tensor with one row
per token."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

FORWARD = "forward(input_ids, positions)"


def call_error(model: nn.Module) -> str | None:
    """Why ``model(input_ids, positions)`` cannot bind, or None (also where the forward has
    no signature to read: the call itself then says what is wrong)."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(None, None)
    except TypeError as e:
        return (
            f"graphattn calls model(input_ids, positions) with two positional tensors; "
            f"{type(model).__qualname__}.forward{signature} cannot take them ({e})"
        )
    return None


def output_error(model: nn.Module, out: Any, num_tokens: int) -> str | None:
    """Why ``out`` is not what ``model``'s forward of ``num_tokens`` tokens must return (one
    floating-point tensor, ``[num_tokens, ...]``), or None."""
    name = type(model).__qualname__
    if not isinstance(out, torch.Tensor):
        return (
            f"graphattn runs models whose {FORWARD} returns one tensor of hidden states; "
            f"{name} returned {type(out).__name__}"
        )
    if not out.is_floating_point():
        return (
            f"graphattn runs models whose {FORWARD} returns hidden states, a floating-point "
            f"tensor; {name} returned a tensor of {str(out.dtype).removeprefix('torch.')}"
        )
    if out.dim() == 0 or out.shape[0] != num_tokens:
        return (
            f"graphattn runs models whose {FORWARD} returns one row per token, [T, ...] with "
            f"T the length of input_ids; {name} returned shape {list(out.shape)} for "
            f"T={num_tokens} (return every token's row, without a batch dimension in front "
            f"such as Hugging Face's [1, T, hidden])"
        )
    return None

"""Argument checks the kernel launchers run before launching: each failure says what was
expected and what arrived (TypeError for dtypes, ValueError for shapes, strides and devices).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# What the cache, the queries and the outputs may be stored as.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def expect_dtype(name: str, x: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if x.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise TypeError(f"{name} must have dtype in ({names}), got {x.dtype}")


def expect_ndim(name: str, x: torch.Tensor, ndim: int, layout: str) -> None:
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {layout} ({ndim}-D), got shape {list(x.shape)}")


def expect_dim(name: str, x: torch.Tensor, dim: int, size: int, what: str) -> None:
    if x.shape[dim] != size:
        raise ValueError(
            f"{name} dim {dim} ({what}) must be {size}, got {x.shape[dim]} (shape {list(x.shape)})"
        )


def expect_min_dim(name: str, x: torch.Tensor, dim: int, size: int, what: str) -> None:
    if x.shape[dim] < size:
        raise ValueError(
            f"{name} dim {dim} ({what}) must be at least {size}, got {x.shape[dim]} "
            f"(shape {list(x.shape)})"
        )


def expect_unit_last_stride(name: str, x: torch.Tensor) -> None:
    """The kernels address the last dimension contiguously."""
    if x.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension (stride 1), got strides "
            f"{list(x.stride())}"
        )


def expect_same_strides(name: str, x: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    if x.shape != other.shape or x.stride() != other.stride():
        raise ValueError(
            f"{name} and {other_name} must have the same shape and strides, got "
            f"{list(x.shape)}/{list(x.stride())} and {list(other.shape)}/{list(other.stride())}"
        )


def expect_same_device(named: dict[str, torch.Tensor]) -> None:
    devices = {name: t.device for name, t in named.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")

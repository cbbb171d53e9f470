"""Typed errors and the fallback warning: every failure says what was expected and what arrived."""

from __future__ import annotations


class GraphAttnError(Exception):
    """Base class of every error graphattn raises on purpose."""


class ConfigError(GraphAttnError, ValueError):
    """A configuration value is out of range or inconsistent with another."""


class InvalidInputError(GraphAttnError, ValueError):
    """A tensor or value handed to graphattn has the wrong shape, dtype, device or range."""


class InvalidBatchError(InvalidInputError):
    """A step's batch cannot run; nothing was written to the KV cache."""


class OutOfBlocksError(GraphAttnError, RuntimeError):
    """The block allocator cannot satisfy a request (too few free blocks, or ids to free
    that are not allocated); nothing was allocated or freed."""


class BackendSelectionError(GraphAttnError, ValueError):
    """No attention backend fits a layer; the message lists every candidate's reasons."""


class BackendError(GraphAttnError, ValueError):
    """An attention backend is malformed or broke its contract: at registration, or where
    the engine first uses what it returns (support level, cache shape, metadata)."""


class UnsupportedModeError(GraphAttnError, NotImplementedError):
    """A requested feature or CUDA-graph mode is not available in this build."""


class CUDAGraphModeError(GraphAttnError, ValueError):
    """A CUDA-graph mode cannot be served by the selected attention backends."""


class RecompileError(GraphAttnError, RuntimeError):
    """The model was traced again after start-up (strict or debug mode)."""


class CaptureError(GraphAttnError, RuntimeError):
    """A CUDA graph capture failed, or was attempted after start-up."""


class ForwardContextError(GraphAttnError, RuntimeError):
    """An attention op ran outside a forward context, or for an unknown layer."""


class FallbackWarning(UserWarning):
    """A requested mode or feature was lowered at start-up; the message says why.

    Turn it into an error with ``warnings.simplefilter("error", FallbackWarning)`` or
    ``strict=True`` (the ``-W`` command-line option cannot name a class of an installed
    package: Python resolves it before the package can be imported).
    """


def arrived(value: object) -> str:
    """What arrived, for a message: an array's or tensor's dtype and shape
    (``torch.float32[3, 64]``), else the value's type name."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return type(value).__name__
    return f"{dtype}{list(shape)}"

"""Environment variables graphattn reads, all in one place but one: ``GRAPHATTN_PDL``
(``0`` launches the Triton kernels without programmatic dependent launch) is read by
``graphattn/kernels/pdl.py``, since the kernels import only torch and triton."""

from __future__ import annotations

import os

from graphattn.errors import ConfigError


def triton_interpret() -> bool:
    """True when Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cache_root() -> str:
    """Root of graphattn's compile cache: ``$GRAPHATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/graphattn``."""
    explicit = os.environ.get("GRAPHATTN_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "graphattn")


def debug() -> bool:
    """``GRAPHATTN_DEBUG=1`` turns on debug checks (address checks at replay, strict recompiles)."""
    return os.environ.get("GRAPHATTN_DEBUG", "0") not in ("", "0")


def prefetch_mib() -> int:
    """``GRAPHATTN_PREFETCH_MIB``: MiB of the next weight the opt-in ``prefetch_next_weight``
    pass asks into L2 (default 16; 0 turns its rewrite off)."""
    raw = os.environ.get("GRAPHATTN_PREFETCH_MIB", "16")
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"GRAPHATTN_PREFETCH_MIB must be an int >= 0 (MiB), got {raw!r}")
    return value

"""Environment variables graphattn reads, all in one place but one: ``GRAPHATTN_PDL``
(``0`` launches the Triton kernels without programmatic dependent launch) is read by
``graphattn/kernels/pdl.py``, since the kernels import only torch and triton."""

from __future__ import annotations

import os


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

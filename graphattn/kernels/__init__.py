"""Attention kernels over the paged KV cache: Triton kernels and their plain-torch references.

This package imports only torch and triton (its modules, not the package itself, import
Triton: ``triton_import_error`` asks whether they can).
"""

from __future__ import annotations

import functools
import importlib


@functools.cache
def triton_import_error() -> str | None:
    """Why ``import triton`` fails here, or None when it works."""
    try:
        importlib.import_module("triton")
    except ImportError as e:
        return str(e) or type(e).__name__
    return None

"""Environment variables graphattn reads, all in one place but two the kernels read
themselves, since they import only torch and triton: ``GRAPHATTN_PDL`` (``0`` launches the
Triton kernels without programmatic dependent launch; ``graphattn/kernels/pdl.py``) and
``GRAPHATTN_FUSED_SPLIT_MERGE`` (``1`` merges split-KV results inside the attention launch;
``graphattn/kernels/attention_plan.py``)."""

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
    """``GRAPHATTN_DEBUG=1`` turns on debug checks (address checks at replay, strict recompiles);
    unset, empty or ``0`` leaves them off, any other value is an error."""
    raw = os.environ.get("GRAPHATTN_DEBUG", "0") or "0"
    if raw not in ("0", "1"):
        raise ConfigError(f"GRAPHATTN_DEBUG must be 0 or 1, got {raw!r}")
    return raw == "1"


def prefetch_mib() -> int:
    """``GRAPHATTN_PREFETCH_MIB``: MiB of the next weight the opt-in ``prefetch_next_weight``
    pass asks into L2 (default 16; 0 turns its rewrite off)."""
    return _count("GRAPHATTN_PREFETCH_MIB", 16, " (MiB)")


def inductor_pdl() -> bool:
    """``GRAPHATTN_INDUCTOR_PDL``: ``1`` (the default) lets Inductor's Triton kernels in the
    compiled pieces launch with programmatic dependent launch too, where graphattn's own
    kernels do and the engine captures CUDA graphs (docs/performance-history.md, round 22); ``0``
    leaves Inductor's config as it is."""
    raw = os.environ.get("GRAPHATTN_INDUCTOR_PDL", "1") or "1"
    if raw not in ("0", "1"):
        raise ConfigError(f"GRAPHATTN_INDUCTOR_PDL must be 0 or 1, got {raw!r}")
    return raw == "1"


def fold_o_proj() -> bool:
    """``GRAPHATTN_FOLD_O_PROJ``: ``1`` moves each attention layer's o_proj into its
    attention op before the split (``passes/o_proj_fold.py``; TRITON then multiplies by the
    weight inside its split-KV reduction at one token, with fp32 atomic adds whose order
    varies from run to run); ``0``, the default, leaves the graph as traced."""
    raw = os.environ.get("GRAPHATTN_FOLD_O_PROJ", "0") or "0"
    if raw not in ("0", "1"):
        raise ConfigError(f"GRAPHATTN_FOLD_O_PROJ must be 0 or 1, got {raw!r}")
    return raw == "1"


def dense_experts() -> bool:
    """``GRAPHATTN_DENSE_EXPERTS``: ``1`` runs a mixture of experts (``models.mla.Experts``)
    densely, every expert on every token, even where ``torch._grouped_mm`` would serve;
    ``0``, the default, takes the grouped GEMM where it does. Read when the model is made and
    each time it is moved or cast (``.to``)."""
    raw = os.environ.get("GRAPHATTN_DENSE_EXPERTS", "0") or "0"
    if raw not in ("0", "1"):
        raise ConfigError(f"GRAPHATTN_DENSE_EXPERTS must be 0 or 1, got {raw!r}")
    return raw == "1"


def check_pdl() -> None:
    """``GRAPHATTN_PDL`` (read by ``graphattn.kernels.pdl``, which imports only torch and
    triton): unset, empty, ``0`` or ``1``; anything else (``false``, ``off``) would leave
    PDL on while looking like it turned it off."""
    raw = os.environ.get("GRAPHATTN_PDL", "1")
    if raw not in ("", "0", "1"):
        raise ConfigError(f"GRAPHATTN_PDL must be 0 or 1, got {raw!r}")


PRECOMPILE_THREADS_DEFAULT = 8


def precompile_threads() -> int:
    """``GRAPHATTN_PRECOMPILE_THREADS``: threads that compile graphattn's Triton kernels ahead
    of a cold start's runs and a capture's warm-ups (``kernels/precompile.py``); default 8, at
    most the machine's CPUs; ``0`` or ``1`` compiles each at its first launch, one after
    another."""
    threads = _count("GRAPHATTN_PRECOMPILE_THREADS", PRECOMPILE_THREADS_DEFAULT)
    return min(threads, os.cpu_count() or 1)


def _count(name: str, default: int, unit: str = "") -> int:
    """The int >= 0 in ``name`` (unset or empty: ``default``); a ConfigError otherwise."""
    raw = os.environ.get(name, "") or str(default)
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"{name} must be an int >= 0{unit}, got {raw!r}")
    return value


INPUT_STAGINGS = ("copies", "kernel")


def input_staging() -> str:
    """``GRAPHATTN_INPUT_STAGING``: how a FULL graph brings the step's inputs to the device:
    ``kernel`` (the default: one kernel that reads the pinned buffers,
    ``kernels/stage_inputs.py``; on the H200 21-23 us a step faster than the copies at batch
    1, 14-20 at 8 and 32, round 14) or ``copies`` (three memcpy nodes)."""
    raw = os.environ.get("GRAPHATTN_INPUT_STAGING", "kernel") or "kernel"
    if raw not in INPUT_STAGINGS:
        raise ConfigError(f"GRAPHATTN_INPUT_STAGING must be one of {INPUT_STAGINGS}, got {raw!r}")
    return raw

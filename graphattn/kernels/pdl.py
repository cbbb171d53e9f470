"""Programmatic dependent launch (PDL) for graphattn's Triton kernels.

Between two kernels a CUDA graph drains the first one's last programs, then ramps the next
one up. With PDL (Hopper and later) the next kernel's programs start while the first one's
last programs finish: a kernel launched with ``launch_pdl=True`` runs ahead up to
``griddepcontrol.wait`` (``tl.extra.cuda.gdc_wait``), which returns once every kernel it
depends on has finished and its writes are visible. The kernel before it lets it start
early with ``gdc_launch_dependents``; one that never calls it (Inductor's kernels, cuBLAS)
lets it start when it finishes, as a normal launch would.

The kernels that use it, and how:
- the GEMVs (``gemv.py``, ``prologue_gemv.py``): before the wait a program loads only its
  first weight tile (no kernel in a step writes weights, so the tile cannot be stale; the
  GEMV passes rewrite only linears whose weight is a parameter);
- decode attention (``unified_attention.py`` with the new keys written in the launch): before
  the wait a program reads the step's metadata (query start locations, sequence lengths, its
  slot and block ids: host-to-device copies made before the step's first kernel, written by
  no kernel) and asks L2 for its first key and value tile (``prefetch.global.L2``, a hint
  that returns no data, so nothing stale can be read); q, the new key and value and the
  cache itself are read after it;
- mixed-batch attention and the split-KV reduction (``split_kv.py``): every read after the
  wait (a mixed batch's cache may come from the write kernel just before);
- the opt-in reduction with o_proj folded in (``split_kv.reduce_splits_o_proj``): before
  the wait its weight tile (a parameter), the batch's end and, in a launch of one token,
  that token's sequence length (metadata, read as decode attention reads it); the partial
  results after it, and its atomic adds into the row that the attention launch zeroed
  after its own wait;
- the argmax's two passes (``argmax.py``, ``graphattn.greedy`` after the head): every read
  after the wait;
- in all of them every read of activations and every store comes after the wait, so a
  kernel neither reads an input early nor overwrites a buffer an earlier kernel still reads.
  Before the wait a kernel reads only what no kernel of the step writes (weights, the
  step's metadata) and asks for prefetches: since some kernels signal at their start,
  several kernels before it may still be running then, not only the one right before;
  every program waits (before any early return), so a kernel finishes only after everything
  before it has;
- where each signals its dependents: the GEMVs and mixed-batch attention after their main
  loop, not at their start: signalling at the start let the next kernel's programs take SM
  slots and wait in them while this one still streamed, which measured slower
  (``benchmarks/pdl_chain.py``, docs/performance-history.md). Decode attention and the reduction
  signal at their start: at one token they take few of the SMs' slots, so the o_proj GEMV
  after them can have its first weight tiles in flight while they run. With the early reads
  and prefetch above, the batch-1 step measured 16-19 us faster than without both; neither
  alone showed a gain (docs/performance-history.md, round 12). The argmax's passes signal at their
  start too: a few dozen programs at batch 1, and so does the folded reduction (signalling
  after its adds measured slower, docs/results/o-proj-fold-round37-h200.log).

``GRAPHATTN_PDL=0`` turns it off. It is off on the CPU (the Triton interpreter), on ROCm and
before compute capability 9.0, where the kernels launch normally.
"""

from __future__ import annotations

import functools
import os

import torch

MIN_CAPABILITY = 9  # griddepcontrol needs sm_90
ENV = "GRAPHATTN_PDL"  # "0" turns PDL off (kernels import only torch and triton: read here)


@functools.lru_cache(maxsize=16)
def use_pdl(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL (``GRAPHATTN_PDL`` is read once per device and
    process; ``use_pdl.cache_clear()`` reads it again)."""
    return _why_not(device) is None


def describe(device: torch.device) -> str:
    """Whether launches on ``device`` use PDL, and why not where they do not (the engine
    report's ``kernels.pdl``)."""
    if use_pdl(device):
        major, minor = torch.cuda.get_device_capability(device)
        return f"on (compute capability {major}.{minor})"
    return "off: " + (_why_not(device) or f"{ENV} was off when first read")


def _why_not(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"{device.type} is not a CUDA device"
    if torch.version.hip:
        return "ROCm has no griddepcontrol"
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "the Triton interpreter runs the kernels (TRITON_INTERPRET)"
    if os.environ.get(ENV, "1") in ("", "0"):
        return f"{ENV}={os.environ.get(ENV)!r}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < MIN_CAPABILITY:
        return (
            f"needs compute capability {MIN_CAPABILITY}.0 or later, the device has {major}.{minor}"
        )
    return None


def launch_options(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for a kernel launch: ``{"launch_pdl": True}`` where PDL is on."""
    return {"launch_pdl": True} if use_pdl(device) else {}

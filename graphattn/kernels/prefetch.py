"""L2 prefetch hints (Triton, CUDA only): ask the L2 cache for lines a later load will read.

``prefetch.global.L2`` returns no data and nothing waits for it, so a prefetch can neither
read a stale value nor hold up the program that issues it; at worst it fetches a line for
nothing. graphattn's kernels issue prefetches before their PDL wait (``pdl.py``), while the
memory would otherwise idle: decode attention for its first key and value tile, and a GEMV
(opt-in) for the start of the next GEMV's weight. The Triton interpreter cannot run inline
PTX, so callers pass a constexpr that is false off CUDA.
"""

from __future__ import annotations

import triton
import triton.language as tl

LINE_BYTES = tl.constexpr(128)  # an L2 line (a constexpr: the kernels read it)


def line_elems(element_size: int) -> int:
    """Elements of ``element_size`` bytes in one L2 line."""
    return LINE_BYTES.value // element_size


@triton.jit
def prefetch_l2(ptrs):
    """One ``prefetch.global.L2`` per element of ``ptrs`` (a pointer per line to fetch)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )

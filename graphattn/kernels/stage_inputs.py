"""Stage a step's inputs from pinned host memory to the device with one kernel (Triton).

A FULL graph starts with the step's input copies (``ModelRunner.full_graph_prologue``).
As copies they are memcpy nodes, run by a copy engine, each handed over to the next node
across engines. This kernel does the same work as one kernel node instead: its programs
read the pinned host buffers directly, through the addresses unified virtual addressing
gives every pinned allocation on the device (over the host link), and write the device
buffers.

A copy is a list of segments ``(source, destination, words)``: contiguous runs of 32-bit
words (an int64 element is two), which a program walks in blocks of ``BLOCK`` words.
The default for full graphs since round 14 (on the H200 21-23 us a step faster than the
three copies at batch 1, 14-20 at 8 and 32; docs/performance-history.md);
``GRAPHATTN_INPUT_STAGING=copies`` goes back to the copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

MAX_SEGMENTS = 8
BLOCK = 1024  # 32-bit words a program moves per pass (4 KiB)


class StagingPlan:
    """One step size's segments, as word views of the buffers (made once per size: the
    launch then only passes them)."""

    def __init__(self, segments: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not 0 < len(segments) <= MAX_SEGMENTS:
            raise ValueError(f"1 to {MAX_SEGMENTS} segments, got {len(segments)}")
        self.sources, self.destinations, self.words = [], [], []
        for src, dst in segments:
            if src.shape != dst.shape or src.dtype != dst.dtype:
                raise ValueError(
                    f"a segment copies like to like, got {src.dtype}{list(src.shape)} -> "
                    f"{dst.dtype}{list(dst.shape)}"
                )
            if not (src.is_contiguous() and dst.is_contiguous()):
                raise ValueError("segments must be contiguous")
            if src.element_size() % 4:
                raise ValueError(f"segments of 32- or 64-bit elements, got {src.dtype}")
            self.sources.append(src.view(torch.int32))
            self.destinations.append(dst.view(torch.int32))
            self.words.append(src.numel() * src.element_size() // 4)
        longest = max(self.words)
        # enough programs that every segment's longest run is one pass, never fewer than 1
        self.grid = (max(1, triton.cdiv(longest, BLOCK)), len(segments))
        pad = MAX_SEGMENTS - len(segments)
        dummy = self.destinations[0]
        self.args = [
            *self.sources,
            *[dummy] * pad,
            *self.destinations,
            *[dummy] * pad,
            *self.words,
            *[0] * pad,
        ]


def stage(plan: StagingPlan) -> None:
    """Launch the copy of every segment of ``plan`` (asynchronous, on the current stream)."""
    _stage_kernel[plan.grid](*plan.args, BLOCK=BLOCK)


@triton.jit(do_not_specialize=["n0", "n1", "n2", "n3", "n4", "n5", "n6", "n7"])
def _stage_kernel(
    s0, s1, s2, s3, s4, s5, s6, s7,  # sources: int32 word views (pinned host memory)
    d0, d1, d2, d3, d4, d5, d6, d7,  # destinations: int32 word views (device)
    n0, n1, n2, n3, n4, n5, n6, n7,  # words per segment (0: unused)
    BLOCK: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(1)
    if seg == 0:
        _copy(s0, d0, n0, BLOCK)
    elif seg == 1:
        _copy(s1, d1, n1, BLOCK)
    elif seg == 2:
        _copy(s2, d2, n2, BLOCK)
    elif seg == 3:
        _copy(s3, d3, n3, BLOCK)
    elif seg == 4:
        _copy(s4, d4, n4, BLOCK)
    elif seg == 5:
        _copy(s5, d5, n5, BLOCK)
    elif seg == 6:
        _copy(s6, d6, n6, BLOCK)
    else:
        _copy(s7, d7, n7, BLOCK)


@triton.jit
def _copy(src, dst, n, BLOCK: tl.constexpr):
    """This program's blocks of words [0, n): one every ``num_programs(0)`` blocks."""
    offs = tl.arange(0, BLOCK)
    step = tl.num_programs(0) * BLOCK
    for start in range(tl.program_id(0) * BLOCK, n, step):
        i = start + offs
        ok = i < n
        # .cv: fetch from the host every launch, never a line cached by an earlier one
        tl.store(dst + i, tl.load(src + i, mask=ok, cache_modifier=".cv"), mask=ok)

"""The dispatcher: each step's (tokens, requests, uniform decode) -> runtime mode and padded key."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from graphattn.capture.mode import CUDAGraphMode
from graphattn.capture.sizes import padding_table

M = CUDAGraphMode
ABOVE_LARGEST = "batch above the largest capture size"


class BatchDescriptor(NamedTuple):
    """The key a graph is captured and replayed under.

    FULL keys fix the padded request count too (the attention launch depends on it);
    PIECEWISE keys have ``num_reqs`` None since attention runs eagerly between graphs.
    """

    num_tokens: int
    num_reqs: int | None = None
    uniform_decode: bool = False


class Dispatch(NamedTuple):
    mode: CUDAGraphMode
    descriptor: BatchDescriptor | None
    fallback: str | None = None  # why a batch that wanted a graph runs without one


class CudagraphDispatcher:
    """Knows which (mode, key) graphs exist and picks one for each step.

    FULL if the resolved mode serves this kind of batch with full graphs and a key exists,
    else PIECEWISE for the padded token count, else NONE. A batch above the largest size
    runs without graphs and says why.
    """

    def __init__(
        self,
        mode: CUDAGraphMode,
        sizes: Sequence[int],
        max_num_seqs: int,
        uniform_decode_query_len: int = 1,
    ) -> None:
        self.mode = mode
        self.sizes = sorted(sizes) if mode != M.NONE else []
        self.max_num_seqs = max_num_seqs
        self.q = uniform_decode_query_len
        self.pad_to = padding_table(self.sizes) if self.sizes else []
        self.keys: dict[CUDAGraphMode, list[BatchDescriptor]] = {M.FULL: [], M.PIECEWISE: []}
        for size in self.sizes:
            if (
                mode.decode_mode() == M.FULL
                and size % self.q == 0
                and size // self.q <= max_num_seqs
            ):
                self.keys[M.FULL].append(BatchDescriptor(size, size // self.q, True))
            if mode.mixed_mode() == M.FULL:
                self.keys[M.FULL].append(BatchDescriptor(size, min(size, max_num_seqs), False))
            if mode.has_piecewise_cudagraphs():
                self.keys[M.PIECEWISE].append(BatchDescriptor(size))
        self._full = set(self.keys[M.FULL])
        self._memo: dict[tuple[int, int, bool], Dispatch] = {}  # a decode loop repeats a few

    @property
    def max_size(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def dispatch(self, num_tokens: int, num_reqs: int, uniform_decode: bool) -> Dispatch:
        """The runtime mode and padded key of one step (no key for NONE)."""
        args = (num_tokens, num_reqs, uniform_decode)
        out = self._memo.get(args)
        if out is None:
            if len(self._memo) > 4096:
                self._memo.clear()
            out = self._memo[args] = self._dispatch(*args)
        return out

    def _dispatch(self, num_tokens: int, num_reqs: int, uniform_decode: bool) -> Dispatch:
        if self.mode == M.NONE:
            return Dispatch(M.NONE, None)
        if num_tokens > self.max_size:
            return Dispatch(M.NONE, None, ABOVE_LARGEST)
        padded = self.pad_to[num_tokens]
        if uniform_decode and padded % self.q == 0:
            key = BatchDescriptor(padded, padded // self.q, True)
            if key in self._full:
                return Dispatch(M.FULL, key)
        key = BatchDescriptor(padded, min(padded, self.max_num_seqs), False)
        if key in self._full and num_reqs <= key.num_reqs:
            return Dispatch(M.FULL, key)
        if self.keys[M.PIECEWISE]:
            return Dispatch(M.PIECEWISE, BatchDescriptor(padded))
        return Dispatch(M.NONE, None)

    def capture_order(self) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
        """Every (mode, key) to capture: FULL before PIECEWISE, largest first within each."""
        order = []
        for mode in (M.FULL, M.PIECEWISE):
            order += [(mode, k) for k in sorted(self.keys[mode], key=lambda k: -k.num_tokens)]
        return order

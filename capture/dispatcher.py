"""The dispatcher: each step's (tokens, requests, uniform decode) -> runtime mode and padded key."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from graphattn.capture.mode import CUDAGraphMode
from graphattn.capture.sizes import padding_table

M = CUDAGraphMode
ABOVE_LARGEST = "batch above the largest capture size"
NO_DECODE_GRAPH = "decode batch without a full graph of its padded size"
ONE_TOKEN_DECODES = "one-token decode batch; full decode graphs are for uniform_decode_query_len"


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
    fallback: str | None = None  # why a batch runs with less graph than its mode gives


class CudagraphDispatcher:
    """Knows which (mode, key) graphs exist and picks one for each step.

    FULL if the resolved mode serves this kind of batch with full graphs and a key exists,
    else PIECEWISE for the padded token count, else NONE. A batch that the mode would serve
    with a graph and that gets less says why: above the largest size it runs without graphs;
    a decode batch padded to a size above ``max_num_seqs`` (which has no uniform-decode
    graph) runs piecewise or without graphs under the modes that run decodes FULL apart.
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
        # uniform decode batches pad to the smallest size with a uniform-decode graph, not
        # to the next size of any kind: with q > 1 a size that is no multiple of q has none
        uniform = [k.num_tokens for k in self.keys[M.FULL] if k.uniform_decode]
        self.pad_uniform = padding_table(uniform) if uniform else []
        self._memo: dict[tuple[int, int, bool], Dispatch] = {}  # a decode loop repeats a few

    @property
    def max_size(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def decode_gap(self) -> tuple[int, int] | None:
        """The decode batch sizes (tokens, first and last) that pad to a size with no full
        graph, under a mode that runs decodes FULL and mixed batches otherwise; None if none.

        Uniform-decode graphs exist only for sizes of at most ``max_num_seqs`` requests (and,
        with ``uniform_decode_query_len`` q > 1, multiples of q); a decode batch larger than
        every such size (a user's list that skips from below the limit to above it) gets
        what mixed batches get.
        """
        if self.mode.decode_mode() != M.FULL or self.mode.mixed_mode() == M.FULL:
            return None
        lost = [
            n
            for n in range(self.q, min(self.max_size, self.max_num_seqs * self.q) + 1, self.q)
            if self._dispatch(n, n // self.q, True).mode != M.FULL
        ]
        return (lost[0], lost[-1]) if lost else None

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
        wanted = self.mode.decode_mode() if uniform_decode else self.mode.mixed_mode()
        if num_tokens > self.max_size:  # mixed batches under FULL_DECODE_ONLY lose nothing
            return Dispatch(M.NONE, None, ABOVE_LARGEST if wanted != M.NONE else None)
        padded = self.pad_to[num_tokens]
        if uniform_decode and num_tokens < len(self.pad_uniform):
            size = self.pad_uniform[num_tokens]
            # under FULL a mixed graph of a smaller size serves the batch with less padding
            # (only with q > 1, where the uniform sizes skip the sizes that are no multiple)
            if size == padded or self.mode.mixed_mode() != M.FULL:
                return Dispatch(M.FULL, BatchDescriptor(size, size // self.q, True))
        key = BatchDescriptor(padded, min(padded, self.max_num_seqs), False)
        if key in self._full and num_reqs <= key.num_reqs:
            return Dispatch(M.FULL, key)
        if wanted == M.FULL:
            fallback = NO_DECODE_GRAPH
        elif self.q > 1 and num_tokens == num_reqs and self.mode.decode_mode() == M.FULL:
            fallback = f"{ONE_TOKEN_DECODES}={self.q} tokens a request"
        else:
            fallback = None
        if self.keys[M.PIECEWISE]:
            return Dispatch(M.PIECEWISE, BatchDescriptor(padded), fallback)
        return Dispatch(M.NONE, None, fallback)

    def capture_order(self) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
        """Every (mode, key) to capture: FULL before PIECEWISE, largest first within each."""
        order = []
        for mode in (M.FULL, M.PIECEWISE):
            order += [(mode, k) for k in sorted(self.keys[mode], key=lambda k: -k.num_tokens)]
        return order

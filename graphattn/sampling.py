"""Greedy sampling: the argmax of each row of the logits, fast for a decode step's few rows.

``torch.argmax`` over a ``[B, 128256]`` bf16 tensor with a small B reduces each row in a
single thread block: 37 us at B = 1 on an H200 (docs/performance.md), 3% of a 1B model's
decode step. ``greedy`` cuts each row into ``chunks`` equal pieces, takes every piece's
maximum in parallel, then the best piece: three small kernels, the same answer (the first
maximal index, NaN counting as the maximum, as ``torch.argmax`` does).
"""

from __future__ import annotations

import functools

import torch

from graphattn.errors import InvalidInputError

_MAX_CHUNKS = 128
_MIN_CHUNK = 256  # below this a row is short enough for one block


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` for ``[T, V]`` logits: int64 ``[T]``."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise InvalidInputError(
            f"greedy expects [num_tokens, vocab] floating-point logits, got "
            f"{logits.dtype} of shape {list(logits.shape)}"
        )
    rows, vocab = logits.shape
    chunks = num_chunks(vocab)
    if chunks == 1 or rows == 0 or not logits.is_contiguous():
        return logits.argmax(-1)
    width = vocab // chunks
    best, where = logits.view(rows, chunks, width).max(-1)  # [T, C] each: first max per chunk
    chunk = best.argmax(-1, keepdim=True)  # [T, 1]: first chunk holding the row's maximum
    return (where.gather(-1, chunk) + chunk * width).squeeze(-1)


@functools.lru_cache(maxsize=64)
def num_chunks(vocab: int) -> int:
    """The most equal chunks (at most 128) of at least 256 entries that ``vocab`` splits into."""
    for chunks in range(min(_MAX_CHUNKS, vocab // _MIN_CHUNK), 1, -1):
        if vocab % chunks == 0:
            return chunks
    return 1

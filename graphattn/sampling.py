"""Greedy sampling: the argmax of each row of the logits, fast for a decode step's few rows.

``torch.argmax`` over a ``[B, 128256]`` bf16 tensor with a small B reduces each row in a
single thread block: 26 us at B = 1 on an H200, 3% of a 1B model's decode step. On CUDA
``greedy`` runs ``graphattn.kernels.argmax`` instead, which reads each row in 2048-wide
chunks in parallel and then picks the best chunk: 3.5 us at B = 1, 22 us at B = 128
against torch's 39 (``docs/results/prologue-gemv-h200.log``). Same answer: the first
maximal index, NaN counting as the maximum, as ``torch.argmax`` does.
"""

from __future__ import annotations

import torch

from graphattn.errors import InvalidInputError


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` for ``[T, V]`` logits: int64 ``[T]``."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise InvalidInputError(
            f"greedy expects [num_tokens, vocab] floating-point logits, got "
            f"{logits.dtype} of shape {list(logits.shape)}"
        )
    rows, vocab = logits.shape
    triton_ok = logits.is_cuda and logits.dtype in _TRITON_DTYPES and vocab < 2**31
    if not triton_ok or rows == 0 or vocab == 0 or logits.stride(1) != 1:
        return logits.argmax(-1)
    from graphattn.kernels.argmax import argmax

    return argmax(logits)


_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

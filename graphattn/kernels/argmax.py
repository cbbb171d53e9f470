"""Row argmax of a decode step's logits (Triton): ``logits.argmax(-1)`` in two short launches.

Reference: ``torch.argmax`` (tests/test_argmax.py): the first maximal index of each row,
NaN counting as the maximum (the first NaN wins), an all ``-inf`` row giving 0.

One program per ``[B, 128256]`` row would read 128k values alone (torch's reduction does
that: 27 us at B = 1 on an H200), so each row is cut into ``block`` wide chunks:

1. program ``(row, chunk)`` reads its chunk once and writes the chunk's maximum and the
   first index holding it (fp32 and int32 partials, ``[B, C]`` each);
2. program ``row`` reads its ``C`` partials and keeps the first chunk holding the largest.

Taking the first index within a chunk and then the first chunk is the first index in the
row. NaN is carried as a flag beside the value: a chunk with a NaN reports its first NaN,
and a row with any NaN chunk takes the first of those.

Where PDL is on (``pdl.py``) both launch with it: each signals its dependents, then waits,
before any read, so the first pass starts as the head's GEMV drains and the second as the
first pass runs; neither reads anything before its wait.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from graphattn.kernels.checks import FLOAT_DTYPES, expect_dtype, expect_ndim
from graphattn.kernels.pdl import launch_options

BLOCK = 2048  # entries of a row per program of the first pass
MAX_VOCAB = 2**31 - 1  # indices are int32 in the kernels


def argmax(logits: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """``logits.argmax(-1)`` for ``[B, V]`` logits with unit stride along V: int64 ``[B]``.
    ``block`` (a power of two) is the chunk width of the first pass."""
    expect_ndim("logits", logits, 2, "[num_tokens, vocab]")
    expect_dtype("logits", logits, FLOAT_DTYPES)
    if logits.stride(1) != 1:
        raise ValueError(
            f"logits must have unit stride along the vocabulary, got {logits.stride()}"
        )
    rows, vocab = logits.shape
    if not 1 <= vocab <= MAX_VOCAB:
        raise ValueError(
            f"logits must have a vocabulary of 1 to 2**31 - 1, got shape {[rows, vocab]}"
        )
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(vocab, block)
    values = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    where = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    nans = torch.empty(rows, chunks, dtype=torch.int8, device=logits.device)
    # Triton launches on the current device: make it the logits' one
    on_device = torch.cuda.device(logits.device) if logits.is_cuda else contextlib.nullcontext()
    pdl = launch_options(logits.device)
    with on_device:
        _chunk_argmax_kernel[(rows, chunks)](
            logits,
            values,
            where,
            nans,
            vocab,
            logits.stride(0),
            chunks,
            BLOCK=block,
            PDL=bool(pdl),
            num_warps=4,
            **pdl,
        )
        _row_argmax_kernel[(rows,)](
            values,
            where,
            nans,
            out,
            chunks,
            BLOCK_C=triton.next_power_of_2(chunks),
            PDL=bool(pdl),
            num_warps=1,
            **pdl,
        )
    return out


@triton.jit
def _first_max(v, nan, idx, BIG: tl.constexpr):
    """(value, NaN flag, index) of the first maximal element of ``v``, NaN the largest."""
    any_nan = tl.max(nan.to(tl.int32), 0)
    best = tl.max(tl.where(nan, float("-inf"), v), 0)
    hit = tl.where(any_nan > 0, nan, (v == best) & ~nan)
    first = tl.min(tl.where(hit, idx, BIG), 0)
    return best, any_nan, first


@triton.jit
def _chunk_argmax_kernel(
    x_ptr,  # [B, V]
    val_ptr,  # [B, C] fp32: each chunk's maximum (of the non-NaN entries)
    idx_ptr,  # [B, C] int32: the first index in the row holding it (or the first NaN)
    nan_ptr,  # [B, C] int8: the chunk holds a NaN
    V,
    stride_row,
    C,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # launched with launch_pdl: signal, then wait before any read (pdl.py)
):
    if PDL:  # the logits come from the kernel before (the head's GEMV)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    v = tl.load(x_ptr + row.to(tl.int64) * stride_row + offs, mask=ok, other=float("-inf"))
    v = v.to(tl.float32)
    nan = v != v
    best, any_nan, first = _first_max(v, nan, tl.where(ok, offs, 2**31 - 1), 2**31 - 1)
    out = row * C + chunk
    tl.store(val_ptr + out, best)
    tl.store(idx_ptr + out, first)
    tl.store(nan_ptr + out, any_nan.to(tl.int8))


@triton.jit
def _row_argmax_kernel(
    val_ptr,
    idx_ptr,
    nan_ptr,
    out_ptr,
    C,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,  # launched with launch_pdl: signal, then wait before any read (pdl.py)
):
    if PDL:  # the partials come from the first pass
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    ok = c < C
    base = row * C
    v = tl.load(val_ptr + base + c, mask=ok, other=float("-inf"))
    nan = tl.load(nan_ptr + base + c, mask=ok, other=0) != 0
    # the chunks' first indices increase with the chunk, so the first chunk wins a tie
    idx = tl.load(idx_ptr + base + c, mask=ok, other=2**31 - 1)
    _, _, first = _first_max(v, nan, tl.where(ok, idx, 2**31 - 1), 2**31 - 1)
    tl.store(out_ptr + row, first.to(tl.int64))

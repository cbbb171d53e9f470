"""MLA decode (Triton): one query token a request over a paged cache of MLA entries.

An entry is ``[kv_lora_rank + rope]`` values a token, shared by every head: the compressed
KV (which is also the value attention sums) and the rotary key. The absorbed queries are
``[T, H, kv_lora_rank + rope]``; a head's score against a token is its latent part times
the entry's compressed KV plus its rotary part times the entry's rotary key, two dots that
need no padding of ``kv_lora_rank + rope`` to a power of two. The output is
``[T, H, kv_lora_rank]``.

One program per (request, block of ``BLOCK_H`` heads, split of the keys): it streams the
request's entries a tile at a time (each tile read once for all its heads) with an online
softmax. With more than one split each program stores its rows and their log-sum-exp (base
2) in the scratch as ``split_kv``'s reduction reads them (``[T, H, S, kv_lora_rank]``), and
that reduction merges them. Requests of sequence length 0 (padding) write zeros, or rows
the reduction skips. The launch depends only on the padded request count, the heads, the
sizes and the split count, so a CUDA graph replays it for any batch of that size.

Reference: ``graphattn.kernels.reference.paged_attention_ref`` with the values a view of the
keys' first ``kv_lora_rank`` columns (as TORCH_REF_MLA calls it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphattn.kernels import split_kv
from graphattn.kernels.checks import (
    expect_dim,
    expect_dtype,
    expect_min_dim,
    expect_ndim,
    expect_same_device,
    expect_unit_last_stride,
)

LOG2E = 1.4426950408889634
BLOCK_H = 16  # heads a program: tl.dot needs 16 rows; fewer heads are masked
MAX_SPLITS = 8  # the scratch holds max requests x heads x this many partial rows


def kernel_constants(
    kv_lora_rank: int, rope: int, dtype: torch.dtype, block_size: int, split: bool, device_type: str
) -> dict:
    """The kernel's constexprs and launch options. Entries a loop trip and warps: compiled for
    sm_90 at DeepSeek-V2's 512 + 64 these spill no registers (bf16 and fp16: 32 and 4;
    fp32: 16 and 8, where 32 and 8 spilled; tests/test_kernels.py checks)."""
    tile_n, num_warps = (16, 8) if dtype == torch.float32 else (32, 4)
    return dict(
        LATENT=kv_lora_rank,
        L_PAD=max(16, triton.next_power_of_2(kv_lora_rank)),  # tl.dot needs K and N >= 16
        ROPE=rope,
        R_PAD=max(16, triton.next_power_of_2(rope)),
        BLOCK_H=BLOCK_H,
        TILE_N=tile_n,
        BLOCK_SIZE=block_size,
        SPLIT=split,
        # the interpreter's tl.dot multiplies bf16 bit patterns (triton#11584): fp32 copies
        DOT_FP32=device_type == "cpu" and dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=2,
    )


def mla_decode(
    query: torch.Tensor,  # [R, H, kv_lora_rank + rope], one token a request
    cache: torch.Tensor,  # [NB, BS, kv_lora_rank + rope]
    block_table: torch.Tensor,  # [>= R, max_blocks] int32
    seq_lens: torch.Tensor,  # [>= R] int32, 0 for padding requests
    output: torch.Tensor,  # [R, H, kv_lora_rank]
    query_start_loc: torch.Tensor,  # [>= R + 1] int32 (the reduction's end of the batch)
    *,
    kv_lora_rank: int,
    scale: float,
    num_splits: int,
    scratch: split_kv.SplitScratch | None,
) -> torch.Tensor:
    """Attention of each request's one token over its ``seq_lens[r]`` entries, into ``output``."""
    num_reqs, num_heads, entry = query.shape
    rope = entry - kv_lora_rank
    _check(
        query, cache, block_table, seq_lens, output, query_start_loc, kv_lora_rank, num_splits,
        scratch,
    )  # fmt: skip
    if num_reqs == 0:
        return output
    split = num_splits > 1
    part_out = scratch.out if split else output
    part_lse = scratch.lse if split else output
    constants = kernel_constants(
        kv_lora_rank, rope, query.dtype, cache.shape[1], split, query.device.type
    )
    grid = (num_reqs, triton.cdiv(num_heads, BLOCK_H), num_splits)
    _mla_decode_kernel[grid](
        query,
        cache,
        block_table,
        seq_lens,
        output,
        part_out,
        part_lse,
        num_heads,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_table.stride(0),
        output.stride(0),
        output.stride(1),
        **constants,
    )
    if split:
        split_kv.reduce_rows(
            scratch, output, query_start_loc, num_reqs, num_reqs, num_splits, kv_lora_rank
        )
    return output


def _check(
    query, cache, block_table, seq_lens, output, query_start_loc, rank, num_splits, scratch
) -> None:
    expect_ndim("query", query, 3, "[num_reqs, num_heads, kv_lora_rank + rope]")
    expect_ndim("cache", cache, 3, "[num_blocks, block_size, kv_lora_rank + rope]")
    expect_ndim("output", output, 3, "[num_reqs, num_heads, kv_lora_rank]")
    num_reqs, num_heads, entry = query.shape
    if not 0 < rank < entry:
        raise ValueError(f"kv_lora_rank must lie in (0, {entry}) (the entry), got {rank}")
    expect_dim("cache", cache, 2, entry, "kv_lora_rank + rope")
    expect_dim("output", output, 0, num_reqs, "num_reqs")
    expect_dim("output", output, 1, num_heads, "num_heads")
    expect_dim("output", output, 2, rank, "kv_lora_rank")
    expect_dtype("cache", cache, (query.dtype,))
    expect_dtype("output", output, (query.dtype,))
    expect_ndim("block_table", block_table, 2, "[num_reqs, max_blocks]")
    expect_min_dim("block_table", block_table, 0, num_reqs, "num_reqs")
    expect_min_dim("seq_lens", seq_lens, 0, num_reqs, "num_reqs")
    expect_min_dim("query_start_loc", query_start_loc, 0, num_reqs + 1, "num_reqs + 1")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        expect_dtype(name, t, (torch.int32,))
    expect_dtype("query_start_loc", query_start_loc, (torch.int32,))
    for name, t in (("query", query), ("cache", cache), ("output", output)):
        expect_unit_last_stride(name, t)
    expect_unit_last_stride("block_table", block_table)
    named = {"query": query, "cache": cache, "output": output, "block_table": block_table}
    named |= {"seq_lens": seq_lens, "query_start_loc": query_start_loc}
    expect_same_device(named)
    if num_splits > 1:
        rows = num_reqs * num_heads * num_splits
        if scratch is None or scratch.lse.numel() < rows or scratch.out.numel() < rows * rank:
            raise ValueError(
                f"{num_splits} splits of {num_reqs} requests x {num_heads} heads need a scratch "
                f"of {rows} rows of {rank}"
            )
        for name, t in (("scratch.out", scratch.out), ("scratch.lse", scratch.lse)):
            if t.dtype != torch.float32 or t.device != query.device:
                raise ValueError(
                    f"{name} must be float32 on {query.device}, got {t.dtype} on {t.device}"
                )


@triton.jit(do_not_specialize=["num_heads"])
def _mla_decode_kernel(
    q_ptr,
    cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,  # [R, H, S, LATENT] fp32 flat, SPLIT only
    part_lse_ptr,  # [R, H, S] fp32 flat, SPLIT only
    num_heads,
    score_scale,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_bt,
    stride_ot,
    stride_oh,
    LATENT: tl.constexpr,
    L_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    R_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [H]
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    h_ok = heads < num_heads
    dl = tl.arange(0, L_PAD)
    dr = tl.arange(0, R_PAD)
    l_ok = dl < LATENT
    r_ok = dr < ROPE
    seq_len = tl.load(seq_lens_ptr + req)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), TILE_N) * TILE_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    q_rows = req.to(tl.int64) * stride_qt + heads.to(tl.int64) * stride_qh  # [H]
    q_lat = tl.load(q_ptr + q_rows[:, None] + dl[None, :], h_ok[:, None] & l_ok[None, :], 0.0)
    q_pe = tl.load(
        q_ptr + q_rows[:, None] + LATENT + dr[None, :], h_ok[:, None] & r_ok[None, :], 0.0
    )
    if DOT_FP32:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    acc = tl.zeros([BLOCK_H, L_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)  # finite: empty rows stay NaN-free
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for start in range(lo, hi, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        ok = pos < hi
        block = tl.load(bt_row + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        slots = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs  # [N]
        lat = tl.load(cache_ptr + slots[:, None] + dl[None, :], ok[:, None] & l_ok[None, :], 0.0)
        pe = tl.load(
            cache_ptr + slots[:, None] + LATENT + dr[None, :], ok[:, None] & r_ok[None, :], 0.0
        )
        if DOT_FP32:
            lat = lat.to(tl.float32)
            pe = pe.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(lat), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PRECISION)  # [H, N]
        s = tl.where(ok[None, :], s * score_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=DOT_PRECISION)
        m_i = m_new
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]  # [H, L]
    mask = h_ok[:, None] & l_ok[None, :]
    if SPLIT:  # the layout split_kv's reduction reads: row (req * H + head) * S + split
        row = (req.to(tl.int64) * num_heads + heads) * num_splits + split  # [H]
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_out_ptr + row[:, None] * LATENT + dl[None, :], out, mask=mask)
        tl.store(part_lse_ptr + row, lse, mask=h_ok)
    else:
        o_rows = req.to(tl.int64) * stride_ot + heads.to(tl.int64) * stride_oh
        tl.store(
            out_ptr + o_rows[:, None] + dl[None, :], out.to(out_ptr.dtype.element_ty), mask=mask
        )

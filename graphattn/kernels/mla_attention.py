"""MLA attention (Triton) over a paged cache of MLA entries: one-token decodes with split-KV
(``mla_decode``), and any batch (prefills, chunked prefills, decodes, verify steps of a few
tokens a request) in one causal launch (``mla_attention``).

An entry is ``[kv_lora_rank + rope]`` values a token, shared by every head: the compressed
KV (which is also the value attention sums) and the rotary key. The absorbed queries are
``[T, H, kv_lora_rank + rope]``; a head's score against a token is its latent part times
the entry's compressed KV plus its rotary part times the entry's rotary key, two dots that
need no padding of ``kv_lora_rank + rope`` to a power of two. The output is
``[T, H, kv_lora_rank]``.

Both entry points launch one kernel. A program holds 16 rows (``BLOCK_H``), streams the
keys a tile at a time (each tile read once for all its rows) with an online softmax, and
with more than one split stores its rows and their log-sum-exp (base 2) in the scratch as
``split_kv``'s reduction reads them (``[T, H, S, kv_lora_rank]``), which merges them.

- ``mla_decode``: a program per (request, block of 16 heads, split); a request is a token.
- ``mla_attention``: a program per (query tile of a request, block of heads, split), its
  rows ``BLOCK_Q`` tokens x ``16 // BLOCK_Q`` heads (one token of 16 heads where the model
  has 16 or more; four tokens of four heads for four), found by the same binary search
  over ``query_start_loc`` as the unified attention kernel; rows see their keys causally.
  The grid, ``T // BLOCK_Q + R`` tiles, depends only on the padded token and request
  counts, so a CUDA graph replays it for any batch of those sizes.

Requests of sequence length 0 (padding) get zero rows (split or not: the reduction writes
zeros for rows no split saw a key of); tokens past ``query_start_loc[num_reqs]`` are not
written.

Reference: ``graphattn.kernels.reference.paged_attention_ref`` with the values a view of the
keys' first ``kv_lora_rank`` columns (as TORCH_REF_MLA calls it).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from graphattn.kernels import split_kv
from graphattn.kernels.attention_plan import choose_num_splits
from graphattn.kernels.checks import (
    expect_dim,
    expect_dtype,
    expect_min_dim,
    expect_ndim,
    expect_same_device,
    expect_unit_last_stride,
)
from graphattn.kernels.unified_attention import _split_range, query_tile

LOG2E = 1.4426950408889634
BLOCK_H = 16  # rows a program (tokens x heads): tl.dot needs 16 rows; rows past the end are masked
MAX_SPLITS = 8  # the scratch holds max requests x heads x this many partial rows


def kernel_constants(
    kv_lora_rank: int, rope: int, dtype: torch.dtype, block_size: int, split: bool, device_type: str
) -> dict:
    """The kernel's constexprs and launch options (both entry points). Entries a loop trip,
    warps and pipeline stages: compiled for sm_90 at DeepSeek-V2's 512 + 64 these spill no
    registers, decode or causal (bf16 and fp16: 32, 4 and 2; fp32: 16, 8 and 1, where 32
    entries, or two stages for the causal kernel, spilled; tests/test_kernels.py checks)."""
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
        num_stages=1 if dtype == torch.float32 else 2,
    )


def heads_per_tile(num_heads: int) -> int:
    """Heads a program of ``mla_attention`` takes: 16, or all of them where fewer (rounded up
    to a power of two); its tiles hold ``BLOCK_H // heads_per_tile`` tokens."""
    return min(BLOCK_H, triton.next_power_of_2(num_heads))


@functools.lru_cache(maxsize=4096)
def split_count(
    num_tokens: int,
    num_reqs: int,
    num_heads: int,
    num_sms: int,
    max_tokens: int,
    uniform_decode: bool,
) -> int:
    """Split-KV splits for a launch of ``num_tokens`` tokens of ``num_reqs`` requests (both
    padded): more than one only where its programs would not fill the GPU twice and its
    partial rows fit the scratch (``split_rows``) of a launch of at most ``max_tokens``
    tokens. Decodes (``uniform_decode``) count a program per request and 16 heads, other
    batches one per query tile and block of heads. Cached: every layer of an eager or
    piecewise step asks for the same launch."""
    if num_tokens > max_tokens:
        return 1
    if uniform_decode:
        programs = num_reqs * triton.cdiv(num_heads, BLOCK_H)
    else:
        heads = heads_per_tile(num_heads)
        tiles = num_tokens // (BLOCK_H // heads) + num_reqs
        programs = tiles * triton.cdiv(num_heads, heads)
    splits = min(MAX_SPLITS, choose_num_splits(programs, 1, num_sms))
    return max(
        1, min(splits, split_rows(max_tokens, num_heads, num_sms) // (num_tokens * num_heads))
    )


@functools.cache
def split_rows(max_tokens: int, num_heads: int, num_sms: int) -> int:
    """Partial rows (token x head x split) the scratch holds: the most any decode launch of
    up to ``max_tokens`` requests needs. Splits are asked for only where the programs are
    few, so this is far below ``max_tokens x heads x MAX_SPLITS``: 32 MiB of scratch at
    DeepSeek-V2's 128 heads and rank 512 on 132 SMs with 128 requests, against 256 MiB.
    Other launches take at most as many splits as fit."""
    blocks = triton.cdiv(num_heads, BLOCK_H)
    return max(
        t * num_heads * min(MAX_SPLITS, choose_num_splits(t * blocks, 1, num_sms))
        for t in range(1, max_tokens + 1)
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
    num_reqs = query.shape[0]
    return _launch(
        query, cache, block_table, seq_lens, output, query_start_loc, num_reqs, kv_lora_rank,
        scale, num_splits, scratch, mixed=False,
    )  # fmt: skip


def mla_attention(
    query: torch.Tensor,  # [T, H, kv_lora_rank + rope]
    cache: torch.Tensor,  # [NB, BS, kv_lora_rank + rope], the step's entries already written
    block_table: torch.Tensor,  # [>= R, max_blocks] int32
    seq_lens: torch.Tensor,  # [>= R] int32, 0 for padding requests
    output: torch.Tensor,  # [T, H, kv_lora_rank]
    query_start_loc: torch.Tensor,  # [>= R + 1] int32
    *,
    num_reqs: int,
    kv_lora_rank: int,
    scale: float,
    num_splits: int = 1,
    scratch: split_kv.SplitScratch | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens (rows ``query_start_loc[r]`` to
    ``query_start_loc[r + 1]``, the last of its ``seq_lens[r]`` positions) over its entries,
    into ``output``. Rows past ``query_start_loc[num_reqs]`` are not written."""
    return _launch(
        query, cache, block_table, seq_lens, output, query_start_loc, num_reqs, kv_lora_rank,
        scale, num_splits, scratch, mixed=True,
    )  # fmt: skip


def _launch(
    query, cache, block_table, seq_lens, output, query_start_loc, num_reqs, rank, scale,
    num_splits, scratch, *, mixed: bool,
) -> torch.Tensor:  # fmt: skip
    num_tokens, num_heads, entry = query.shape
    _check(
        query, cache, block_table, seq_lens, output, query_start_loc, num_reqs, rank,
        num_splits, scratch,
    )  # fmt: skip
    if num_tokens == 0 or num_reqs == 0:
        return output
    split = num_splits > 1
    part_out = scratch.out if split else output
    part_lse = scratch.lse if split else output
    constants = kernel_constants(
        rank, entry - rank, query.dtype, cache.shape[1], split, query.device.type
    )
    if mixed:
        heads = heads_per_tile(num_heads)
        block_q = BLOCK_H // heads
        grid = (num_tokens // block_q + num_reqs, triton.cdiv(num_heads, heads), num_splits)
    else:
        heads, block_q = BLOCK_H, 1
        grid = (num_reqs, triton.cdiv(num_heads, BLOCK_H), num_splits)
    _mla_kernel[grid](
        query,
        cache,
        block_table,
        seq_lens,
        query_start_loc,
        output,
        part_out,
        part_lse,
        num_heads,
        num_reqs,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_table.stride(0),
        output.stride(0),
        output.stride(1),
        HEADS=heads,
        BLOCK_Q=block_q,
        MIXED=mixed,
        **constants,
    )
    if split:
        split_kv.reduce_rows(
            scratch, output, query_start_loc, num_tokens, num_reqs, num_splits, rank
        )
    return output


def _check(
    query, cache, block_table, seq_lens, output, query_start_loc, num_reqs, rank, num_splits,
    scratch,
) -> None:  # fmt: skip
    expect_ndim("query", query, 3, "[num_tokens, num_heads, kv_lora_rank + rope]")
    expect_ndim("cache", cache, 3, "[num_blocks, block_size, kv_lora_rank + rope]")
    expect_ndim("output", output, 3, "[num_tokens, num_heads, kv_lora_rank]")
    num_tokens, num_heads, entry = query.shape
    if not 0 < rank < entry:
        raise ValueError(f"kv_lora_rank must lie in (0, {entry}) (the entry), got {rank}")
    if not 0 <= num_reqs <= num_tokens:
        raise ValueError(f"num_reqs must lie in [0, {num_tokens}] (the tokens), got {num_reqs}")
    expect_dim("cache", cache, 2, entry, "kv_lora_rank + rope")
    expect_dim("output", output, 0, num_tokens, "num_tokens")
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
        rows = num_tokens * num_heads * num_splits
        if scratch is None or scratch.lse.numel() < rows or scratch.out.numel() < rows * rank:
            raise ValueError(
                f"{num_splits} splits of {num_tokens} tokens x {num_heads} heads need a scratch "
                f"of {rows} rows of {rank}"
            )
        for name, t in (("scratch.out", scratch.out), ("scratch.lse", scratch.lse)):
            if t.dtype != torch.float32 or t.device != query.device:
                raise ValueError(
                    f"{name} must be float32 on {query.device}, got {t.dtype} on {t.device}"
                )


@triton.jit(do_not_specialize=["num_heads", "num_reqs"])
def _mla_kernel(
    q_ptr,
    cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,  # MIXED only
    out_ptr,
    part_out_ptr,  # [T, H, S, LATENT] fp32 flat, SPLIT only
    part_lse_ptr,  # [T, H, S] fp32 flat, SPLIT only
    num_heads,
    num_reqs,
    score_scale,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_bt,
    stride_ot,
    stride_oh,
    HEADS: tl.constexpr,  # heads a program: BLOCK_H // BLOCK_Q
    BLOCK_Q: tl.constexpr,  # tokens a program (MIXED; 1 for decodes)
    MIXED: tl.constexpr,  # False: one token a request, a program per request
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
    rows = tl.arange(0, BLOCK_H)
    heads = tl.program_id(1) * HEADS + rows % HEADS  # [H]
    if MIXED:  # this tile's request, its tokens and their positions (unified_attention's way)
        tile_id = tl.num_programs(0) - 1 - tl.program_id(0)  # long causal tiles first
        req, q_start, q_len, first, seq_len = query_tile(
            query_start_loc_ptr, seq_lens_ptr, num_reqs, tile_id, BLOCK_Q
        )
        if first >= q_len:  # the request has fewer tiles than its bound
            return
        context = seq_len - q_len
        token = first + rows // HEADS  # [H] within the request
        row_ok = (token < q_len) & (heads < num_heads)
        q_pos = context + token  # [H] the row's position: it sees keys up to it
        hi = tl.minimum(context + first + BLOCK_Q, seq_len)
        tok = q_start + token  # [H] row of query and output
    else:
        req = tl.program_id(0)
        row_ok = heads < num_heads
        seq_len = tl.load(seq_lens_ptr + req)
        hi = seq_len
        tok = req
    lo, hi = _split_range(hi * 0, hi, TILE_N)
    dl = tl.arange(0, L_PAD)
    dr = tl.arange(0, R_PAD)
    l_ok = dl < LATENT
    r_ok = dr < ROPE

    q_rows = tok.to(tl.int64) * stride_qt + heads.to(tl.int64) * stride_qh  # [H]
    q_lat = tl.load(q_ptr + q_rows[:, None] + dl[None, :], row_ok[:, None] & l_ok[None, :], 0.0)
    q_pe = tl.load(
        q_ptr + q_rows[:, None] + LATENT + dr[None, :], row_ok[:, None] & r_ok[None, :], 0.0
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
        if MIXED:  # causal: a row sees the keys up to its own position
            seen = ok[None, :] & (pos[None, :] <= q_pos[:, None])
        else:
            seen = ok[None, :]
        s = tl.where(seen, s * score_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=DOT_PRECISION)
        m_i = m_new
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]  # [H, L]
    mask = row_ok[:, None] & l_ok[None, :]
    if SPLIT:  # the layout split_kv's reduction reads: row (token * H + head) * S + split
        row = (tok.to(tl.int64) * num_heads + heads) * tl.num_programs(2) + tl.program_id(2)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_out_ptr + row[:, None] * LATENT + dl[None, :], out, mask=mask)
        tl.store(part_lse_ptr + row, lse, mask=row_ok)
    else:
        o_rows = tok.to(tl.int64) * stride_ot + heads.to(tl.int64) * stride_oh
        tl.store(
            out_ptr + o_rows[:, None] + dl[None, :], out.to(out_ptr.dtype.element_ty), mask=mask
        )

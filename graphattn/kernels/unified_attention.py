"""Unified paged attention (Triton): prefills, chunked prefills and decodes of one batch in one
launch, with an optional split-KV pass whose partial results ``split_kv.reduce_splits`` merges.

Reference: ``graphattn.kernels.reference.paged_attention_ref``.

A program owns one query tile of one request and one KV head: ``block_q`` tokens x the
``group`` query heads of that KV head, as ``block_m = block_q * group_pad`` rows (row ``r``
is token ``r // group_pad``, head ``r % group_pad``), so each key and value tile is loaded
once for the whole group. It finds its request by binary search over ``query_start_loc``
and walks the request's keys causally in tiles of ``tile_n`` tokens gathered through the
block table, with an online softmax in fp32 (base 2). Key tiles that no row of the tile can
see are skipped; tiles every row sees in full run without masks.

With ``num_splits`` > 1 the keys a tile sees are cut into that many segments (third grid
axis); each program writes its normalised partial output and log-sum-exp to the scratch,
which the reduction kernel merges after the launch or, with a fused merge, the tile's last
split program at its end (``split_kv``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from graphattn.kernels import split_kv
from graphattn.kernels.attention_plan import SPLIT_SLOTS, AttentionPlan
from graphattn.kernels.checks import (
    FLOAT_DTYPES,
    expect_dim,
    expect_dtype,
    expect_min_dim,
    expect_ndim,
    expect_same_device,
    expect_same_strides,
    expect_unit_last_stride,
)
from graphattn.kernels.kv_cache_write import check_write_args
from graphattn.kernels.pdl import launch_options
from graphattn.kernels.prefetch import LINE_BYTES, prefetch_l2
from graphattn.kernels.split_kv import merge_if_last, split_segment, store_partial

LOG2E = math.log2(math.e)


def unified_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    value_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    output: torch.Tensor | None,  # [T, Hq, D], rows of real tokens are written; None: o_proj
    block_table: torch.Tensor,  # [R, max_blocks] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32
    plan: AttentionPlan,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    scratch: split_kv.SplitScratch | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    fused_merge: bool | None = None,
    o_proj: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its cached sequence; see the module.

    The first ``plan.num_tokens`` rows of ``query`` and ``plan.num_reqs`` requests are read.
    Split-KV (``plan.num_splits`` > 1) needs ``scratch``; ``fused_merge`` merges the
    splits inside this launch instead of a reduction kernel after it (None:
    ``split_kv.fused_merge()``, from ``GRAPHATTN_FUSED_SPLIT_MERGE``).

    ``new_kv = (key [T, Hkv, D], value, slot_mapping [T])`` writes the step's keys and values
    into the cache inside this launch (no separate ``write_kv_cache``). Only for batches in
    which every request has one query token (decodes): the one program whose keys include a
    request's last position writes that token's key and value, then reads them back with the
    rest of its tile.

    ``o_proj = (weight [N, Hq * D], out [T, N] fp32)`` (split-KV with the reduction kernel
    only): this launch zeroes ``out`` and the reduction multiplies the merged rows by
    o_proj's weight into it (``split_kv.reduce_splits_o_proj``) instead of writing
    ``output``, which may then be None; returns ``out``.
    """
    if output is None:
        if o_proj is None:
            raise ValueError("output may be None only when o_proj takes the result")
        output = query  # never written: with o_proj the reduction writes o_proj's output
    _check(query, key_cache, value_cache, output, block_table, query_start_loc, seq_lens, plan)
    if new_kv is not None:
        key, value, slot_mapping = new_kv
        check_write_args(key, value, key_cache, value_cache, slot_mapping)
        expect_min_dim("key", key, 0, plan.num_tokens, "num_tokens (padded)")
        stride_kt, stride_kh, stride_vt, stride_vh = (
            key.stride(0), key.stride(1), value.stride(0), value.stride(1)
        )  # fmt: skip
    else:
        key = value = slot_mapping = query  # unused by the kernel
        stride_kt = stride_kh = stride_vt = stride_vh = 0
    merge = plan.num_splits > 1 and (split_kv.fused_merge() if fused_merge is None else fused_merge)
    if o_proj is not None:
        _check_o_proj(o_proj, query, plan, merge)
        zero = o_proj[1]
    else:
        zero = seq_lens  # unused by the kernel
    if plan.num_splits > 1:
        split_kv.check_scratch(scratch, plan, query.device, fused=merge)
        partial_out, partial_lse = scratch.out, scratch.lse
        tickets = scratch.tickets if merge else seq_lens  # unused without the merge
    else:
        partial_out = partial_lse = output  # unused by the kernel
        tickets = seq_lens
    score_scale, cap_scale = _score_scales(scale, soft_cap)
    pdl = launch_options(query.device)
    constants = kernel_constants(
        plan,
        block_size=key_cache.shape[1],
        dtype=query.dtype,
        device_type=query.device.type,
        sliding=sliding_window is not None,
        soft_cap=soft_cap is not None,
        pdl=bool(pdl),
        merge=merge,
        o_proj=o_proj is not None,
    )
    _attention_kernel[plan.grid](
        query,
        key_cache,
        value_cache,
        output,
        block_table,
        query_start_loc,
        seq_lens,
        partial_out,
        partial_lse,
        tickets,
        key,
        value,
        slot_mapping,
        zero,
        zero.numel() if o_proj is not None else 0,
        plan.num_reqs,
        score_scale,
        cap_scale,
        sliding_window or 0,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        WRITE_KV=new_kv is not None,
        **constants,
        **pdl,
    )
    if o_proj is not None:
        split_kv.reduce_splits_o_proj(
            scratch, o_proj[1], o_proj[0], query_start_loc, plan, seq_lens, sliding_window or 0
        )
        return o_proj[1]
    if plan.num_splits > 1 and not merge:
        split_kv.reduce_splits(scratch, output, query_start_loc, plan)
    return output


ZERO_BLOCK = 64  # elements of o_proj's output each attention program zeroes at a time


def o_proj_refusal(plan: AttentionPlan, merge: bool) -> str | None:
    """Why ``plan`` cannot take o_proj into its split-KV reduction (``merge``: the splits
    merge in the attention launch), or None when it can."""
    if plan.num_splits < 2 or merge:
        return (
            f"o_proj folds into the split-KV reduction kernel: the plan has {plan.num_splits} "
            f"split(s){' merged in the attention launch' if merge else ''}"
        )
    if split_kv.o_proj_block_n(plan.group_pad, plan.head_size) is None:
        return (
            f"o_proj folds into the reduction for groups of at most "
            f"{max(split_kv.O_PROJ_ROWS)} columns (query heads x padded head size); this "
            f"plan's group is {plan.group_pad} x {triton.next_power_of_2(plan.head_size)}"
        )
    return None


def _check_o_proj(
    o_proj: tuple[torch.Tensor, torch.Tensor],
    query: torch.Tensor,
    plan: AttentionPlan,
    merge: bool,
) -> None:
    """What the folded o_proj needs: split-KV merged by the reduction kernel, a contiguous
    ``[N, Hq * D]`` weight of the query's dtype and a contiguous fp32 ``[T, N]`` output."""
    refusal = o_proj_refusal(plan, merge)
    if refusal is not None:
        raise ValueError(refusal)
    weight, out = o_proj
    k = query.shape[1] * query.shape[2]
    expect_ndim("o_proj weight", weight, 2, "[N, Hq * D]")
    expect_dim("o_proj weight", weight, 1, k, "Hq * D")
    expect_dtype("o_proj weight", weight, (query.dtype,))
    expect_ndim("o_proj out", out, 2, "[T, N]")
    expect_dim("o_proj out", out, 0, query.shape[0], "T")
    expect_dim("o_proj out", out, 1, weight.shape[0], "N")
    expect_dtype("o_proj out", out, (torch.float32,))
    expect_same_device({"query": query, "o_proj weight": weight, "o_proj out": out})
    for name, t in (("o_proj weight", weight), ("o_proj out", out)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {list(t.stride())}")


def kernel_constants(
    plan: AttentionPlan,
    *,
    block_size: int,
    dtype: torch.dtype,
    device_type: str,
    sliding: bool,
    soft_cap: bool,
    pdl: bool = False,
    merge: bool = False,
    o_proj: bool = False,
) -> dict[str, Any]:
    """The attention kernel's constexpr arguments and launch options for ``plan`` (``pdl``:
    launched with programmatic dependent launch, ``pdl.launch_options``; ``merge``: a split
    launch merges its splits itself, ``split_kv.merge_if_last``; ``o_proj``: the launch
    zeroes the folded o_proj's output for ``split_kv.reduce_splits_o_proj``)."""
    t = plan.tiles
    return dict(
        HEAD_SIZE=plan.head_size,
        D_PAD=triton.next_power_of_2(plan.head_size),
        GROUP=plan.group,
        G_PAD=plan.group_pad,
        BLOCK_M=t.block_m,
        BLOCK_Q=plan.block_q,
        TILE_N=t.tile_n,
        BLOCK_SIZE=block_size,
        SPLIT=plan.num_splits > 1,
        # the split count when the launch merges its splits itself (0: the reduction kernel
        # does): a constexpr, so the merge's loads over the splits unroll and go out together
        MERGE_SPLITS=plan.num_splits if merge and plan.num_splits > 1 else 0,
        ZERO_BLOCK=ZERO_BLOCK if o_proj else 0,
        SLIDING=sliding,
        SOFT_CAP=soft_cap,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        # The Triton interpreter's tl.dot multiplies bf16 bit patterns (triton#11584): on the
        # CPU multiply exactly upcast fp32 copies instead. Remove once the interpreter converts.
        DOT_FP32=device_type == "cpu" and dtype == torch.bfloat16,
        PDL=pdl,
        # where the decode launch has a PDL wait to run ahead of (so CUDA, sm_90 and later,
        # never the interpreter, which cannot run the inline PTX); without one the hints
        # would only compete with the kernel's own loads
        PREFETCH=pdl,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
    )


def _score_scales(scale: float, soft_cap: float | None) -> tuple[float, float]:
    """(factor on q.k, factor after tanh): scores end in base-2 units for exp2."""
    if soft_cap is None:
        return scale * LOG2E, 1.0
    return scale / soft_cap, soft_cap * LOG2E


@triton.jit(do_not_specialize=["num_reqs"])
def _attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    part_out_ptr,  # [cap, Hq, S, D] fp32 flat, split-KV only
    part_lse_ptr,  # [cap, Hq, S] fp32 flat, split-KV only
    tickets_ptr,  # [tiles * Hkv] int32, zero between launches, MERGE_SPLITS only
    new_k_ptr,  # [T, Hkv, D], WRITE_KV only
    new_v_ptr,
    slot_ptr,  # [T] slot of each token, -1 = none
    zero_ptr,  # [zero_numel] fp32 set to 0 after the wait, ZERO_BLOCK > 0 only (folded o_proj)
    zero_numel,
    num_reqs,
    score_scale,
    cap_scale,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,  # cache strides (both caches share them): block, slot in block, head
    stride_cs,
    stride_ch,
    stride_bt,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    WRITE_KV: tl.constexpr,
    ZERO_BLOCK: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    MERGE_SPLITS: tl.constexpr,  # > 0: the tile's last of these split programs merges them
    SLIDING: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PDL: tl.constexpr,  # launched with launch_pdl: see the waits below and kernels/pdl.py
    PREFETCH: tl.constexpr,  # decodes with PDL: the first key and value tile into L2 early
):
    if PDL and not WRITE_KV:  # a mixed batch: the cache may come from the write kernel before
        tl.extra.cuda.gdc_wait()
    if PDL and WRITE_KV:  # decodes: few slots taken, so let the next kernel in now (pdl.py)
        tl.extra.cuda.gdc_launch_dependents()
    # Last tiles first: under causal masking they see the most keys, so the long programs
    # start in the first wave and the short ones fill the tail.
    tile_id = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    req, q_start, q_len, first, seq_len = query_tile(
        query_start_loc_ptr, seq_lens_ptr, num_reqs, tile_id, BLOCK_Q
    )
    has_tile = first < q_len  # false: the request has fewer tiles than its bound
    context = seq_len - q_len
    rows = tl.arange(0, BLOCK_M)
    token = first + rows // G_PAD  # [M] query token within the request
    head = kv_head * GROUP + rows % G_PAD  # [M] query head
    row_ok = (token < q_len) & (rows % G_PAD < GROUP)  # [M]
    q_pos = context + token  # [M] position in the sequence
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < HEAD_SIZE

    # Keys the tile sees: [lo, hi), then this program's split of them.
    first_pos = context + first
    hi = tl.minimum(context + first + BLOCK_Q, seq_len)  # past the tile's last query position
    lo = first_pos * 0
    if SLIDING:
        lo = tl.maximum(first_pos - window + 1, 0)
    if SPLIT:
        lo, hi = _split_range(lo, hi, TILE_N)
    # Tiles below the first query position are seen by every row: no masks there.
    if SLIDING:
        mid = lo
    else:
        full = tl.maximum(tl.minimum(hi, first_pos + 1) - lo, 0) // TILE_N
        mid = lo + full * TILE_N
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    kv_head_off = kv_head.to(tl.int64) * stride_ch
    if WRITE_KV:  # decodes: what no kernel of the step writes, before the wait (kernels/pdl.py)
        slot = tl.load(slot_ptr + tl.where(has_tile, q_start, 0))  # q_start may be past the end
        if PREFETCH:  # the first key and value tile, so that it is in L2 after the wait
            _prefetch_tile(
                k_cache_ptr, v_cache_ptr, bt_row, kv_head_off, lo, tl.where(has_tile, hi, 0),
                stride_cb, stride_cs, HEAD_SIZE, TILE_N, BLOCK_SIZE,
            )  # fmt: skip
        if PDL:  # q and the new key and value come from the kernel before
            tl.extra.cuda.gdc_wait()
    if ZERO_BLOCK > 0:  # after every wait: the kernels that read this memory before are done
        _zero(zero_ptr, zero_numel, ZERO_BLOCK)
    if first >= q_len:  # no tile here; after the wait, so no kernel ends before the one before
        return
    q_rows = (q_start + token).to(tl.int64) * stride_qt + head * stride_qh  # [M]
    q = tl.load(
        q_ptr + q_rows[:, None] + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0
    )  # [M, D]
    if DOT_FP32:
        q = q.to(tl.float32)  # the key and value tiles follow q's dtype in _attend

    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: fully masked rows stay NaN-free
    if WRITE_KV:  # decodes: the request's one new token sits at seq_len - 1
        _write_new_kv(
            new_k_ptr, new_v_ptr, k_cache_ptr, v_cache_ptr, slot.to(tl.int64), q_start, kv_head,
            kv_head_off, seq_len - 1, lo, hi, dims, dim_ok, stride_kt, stride_kh, stride_vt,
            stride_vh, stride_cb, stride_cs, BLOCK_SIZE,
        )  # fmt: skip
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, kv_head_off, lo, mid, hi, q_pos,
        window, score_scale, cap_scale, stride_cb, stride_cs, dims,
        HEAD_SIZE, D_PAD, TILE_N, BLOCK_SIZE, False, SLIDING, SOFT_CAP, DOT_PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, kv_head_off, mid, hi, hi, q_pos,
        window, score_scale, cap_scale, stride_cb, stride_cs, dims,
        HEAD_SIZE, D_PAD, TILE_N, BLOCK_SIZE, True, SLIDING, SOFT_CAP, DOT_PRECISION,
    )  # fmt: skip

    if PDL and not WRITE_KV:
        tl.extra.cuda.gdc_launch_dependents()
    has_keys = l_i > 0.0  # false only for rows that see nothing (padding, empty splits)
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]  # [M, D]
    store_mask = row_ok[:, None] & dim_ok[None, :]
    if SPLIT:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        store_partial(
            part_out_ptr, part_lse_ptr, out, lse, q_start + token, head, row_ok, store_mask,
            dims, tl.program_id(2), tl.num_programs(2), GROUP * tl.num_programs(1), HEAD_SIZE,
        )  # fmt: skip
        if MERGE_SPLITS > 0:  # split_kv.merge_if_last
            merge_if_last(
                part_out_ptr, part_lse_ptr, tickets_ptr, out_ptr, q_start + token, head, row_ok,
                store_mask, dims, stride_ot, stride_oh, GROUP * tl.num_programs(1), HEAD_SIZE,
                MERGE_SPLITS,
            )  # fmt: skip
    else:
        o_rows = (q_start + token).to(tl.int64) * stride_ot + head * stride_oh  # [M]
        tl.store(
            out_ptr + o_rows[:, None] + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )


@triton.jit
def _zero(ptr, numel, BLOCK: tl.constexpr):
    """This program's share of ``ptr[:numel] = 0``, strided over the launch's programs."""
    pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2)
    pid += tl.program_id(2)
    programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    for start in range(pid * BLOCK, numel, programs * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(ptr + offs, tl.zeros([BLOCK], tl.float32), mask=offs < numel)


@triton.jit
def _write_new_kv(
    new_k_ptr, new_v_ptr, k_cache_ptr, v_cache_ptr, slot, token, kv_head, kv_head_off,
    last, lo, hi, dims, dim_ok, stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs,
    BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """Store ``token``'s key and value for ``kv_head`` at ``slot`` when this program's key
    range [lo, hi) holds position ``last`` (one program per request and head does), then a
    barrier so every thread of the program reads them back from the cache.
    """
    if (lo <= last) & (last < hi) & (slot >= 0):
        k = tl.load(new_k_ptr + token.to(tl.int64) * stride_kt + kv_head * stride_kh + dims, dim_ok)
        v = tl.load(new_v_ptr + token.to(tl.int64) * stride_vt + kv_head * stride_vh + dims, dim_ok)
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + kv_head_off
        tl.store(k_cache_ptr + dst + dims, k.to(k_cache_ptr.dtype.element_ty), mask=dim_ok)
        tl.store(v_cache_ptr + dst + dims, v.to(v_cache_ptr.dtype.element_ty), mask=dim_ok)
    tl.debug_barrier()


@triton.jit
def _prefetch_tile(
    k_cache_ptr, v_cache_ptr, bt_row, kv_head_off, lo, hi, stride_cb, stride_cs,
    HEAD_SIZE: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """Ask L2 for the key and value rows of positions [lo, min(lo + TILE_N, hi)): one
    prefetch per line (``prefetch.py``; CUDA only)."""
    n = lo + tl.arange(0, TILE_N)  # [N]
    # masked rows: block 0's, inside the cache
    rows = _kv_rows(bt_row, kv_head_off, n, n < hi, stride_cb, stride_cs, BLOCK_SIZE, True)
    per_line: tl.constexpr = LINE_BYTES * 8 // k_cache_ptr.dtype.element_ty.primitive_bitwidth
    lines: tl.constexpr = (HEAD_SIZE + per_line - 1) // per_line
    line = tl.arange(0, triton.next_power_of_2(lines))
    offs = rows[:, None] + (tl.minimum(line, lines - 1) * per_line)[None, :]  # [N, L]
    prefetch_l2(k_cache_ptr + offs)
    prefetch_l2(v_cache_ptr + offs)


@triton.jit
def query_tile(query_start_loc_ptr, seq_lens_ptr, num_reqs, tile_id, BLOCK_Q: tl.constexpr):
    """Query tile ``tile_id`` of a launch whose requests own ``cdiv``-ish tiles of
    ``BLOCK_Q`` tokens (``query_start_loc[i] // BLOCK_Q + i`` is request i's first): its
    request, the request's first token and query length, the tile's first token within the
    request (the tile is empty where it is >= the query length: the bound counts one tile a
    request more than some need) and the request's sequence length. The MLA kernel's tiles
    are found the same way."""
    req = _find_request(query_start_loc_ptr, num_reqs, tile_id, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    first = (tile_id - q_start // BLOCK_Q - req) * BLOCK_Q
    seq_len = tl.load(seq_lens_ptr + req)
    return req, q_start, q_len, first, seq_len


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, tile_id, BLOCK_Q: tl.constexpr):
    """The last request whose first tile ``query_start_loc[i] // BLOCK_Q + i`` is <= tile_id."""
    lo = num_reqs * 0
    hi = num_reqs + 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        below = first_tile <= tile_id
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    return lo


@triton.jit
def _split_range(lo, hi, TILE_N: tl.constexpr):
    """This program's segment of [lo, hi): equal whole tiles per split, the last one shorter."""
    span = tl.maximum(hi - lo, 0)
    seg = split_segment(span, tl.num_programs(2), TILE_N)
    start = lo + tl.program_id(2) * seg
    return start, tl.minimum(start + seg, hi)


@triton.jit
def _attend(
    acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, kv_head_off, start, stop, seen_end, q_pos,
    window, score_scale, cap_scale, stride_cb, stride_cs, dims,
    HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, SLIDING: tl.constexpr,
    SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Online softmax over keys [start, stop) in tiles; keys at or past ``seen_end`` are masked.

    acc: [M, D] fp32, l_i and m_i: [M] fp32 (running sum and max, base 2); q: [M, D].
    """
    offs_n = tl.arange(0, TILE_N)
    for n0 in range(start, stop, TILE_N):
        n = n0 + offs_n  # [N] key positions
        n_ok = n < seen_end
        k, v = _load_kv(
            k_cache_ptr, v_cache_ptr, bt_row, kv_head_off, n, n_ok, dims, stride_cb, stride_cs,
            HEAD_SIZE, D_PAD, BLOCK_SIZE, MASKED,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * score_scale
        if SOFT_CAP:
            s = _tanh(s) * cap_scale
        if MASKED:
            visible = n_ok[None, :] & (n[None, :] <= q_pos[:, None])  # [M, N]
            if SLIDING:
                visible = visible & (q_pos[:, None] - n[None, :] < window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(
            p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], input_precision=DOT_PRECISION
        )
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _load_kv(
    k_cache_ptr, v_cache_ptr, bt_row, kv_head_off, n, n_ok, dims, stride_cb, stride_cs,
    HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """Key and value tiles [N, D] of positions ``n``, gathered through the block table."""
    rows = _kv_rows(bt_row, kv_head_off, n, n_ok, stride_cb, stride_cs, BLOCK_SIZE, MASKED)
    offs = rows[:, None] + dims[None, :]  # [N, D]
    if MASKED:
        mask = n_ok[:, None] & (dims < HEAD_SIZE)[None, :]
        k = tl.load(k_cache_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=mask, other=0.0)
    elif HEAD_SIZE == D_PAD:
        k = tl.load(k_cache_ptr + offs)
        v = tl.load(v_cache_ptr + offs)
    else:
        mask = (dims < HEAD_SIZE)[None, :]
        k = tl.load(k_cache_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=mask, other=0.0)
    return k, v


@triton.jit
def _kv_rows(
    bt_row, kv_head_off, n, n_ok, stride_cb, stride_cs,
    BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """[N] element offsets of positions ``n``'s rows of one KV head in a cache (both caches
    share the layout), through the request's block-table row; with MASKED, block 0's rows
    where not ``n_ok``."""
    if MASKED:
        block = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0)
    else:
        block = tl.load(bt_row + n // BLOCK_SIZE)
    return block.to(tl.int64) * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head_off


@triton.jit
def _tanh(x):
    """tanh from exp2, saturating cleanly at +-1 for large |x|."""
    e = tl.exp2(x * 2.8853900817779268)  # exp(2x)
    return 1.0 - 2.0 / (e + 1.0)


def _check(query, key_cache, value_cache, output, block_table, query_start_loc, seq_lens, plan):
    expect_ndim("query", query, 3, "[num_tokens, num_heads, head_size]")
    expect_ndim("key_cache", key_cache, 4, "[num_blocks, block_size, num_kv_heads, head_size]")
    expect_ndim("block_table", block_table, 2, "[num_reqs, max_blocks]")
    num_heads = plan.num_kv_heads * plan.group
    expect_min_dim("query", query, 0, plan.num_tokens, "num_tokens (padded)")
    expect_dim("query", query, 1, num_heads, "num_heads")
    expect_dim("query", query, 2, plan.head_size, "head_size")
    if output.shape != query.shape:
        raise ValueError(
            f"output must have query's shape {list(query.shape)}, got {list(output.shape)}"
        )
    expect_same_strides("key_cache", key_cache, "value_cache", value_cache)
    expect_dim("key_cache", key_cache, 2, plan.num_kv_heads, "num_kv_heads")
    expect_dim("key_cache", key_cache, 3, plan.head_size, "head_size")
    expect_min_dim("block_table", block_table, 0, plan.num_reqs, "num_reqs (padded)")
    expect_min_dim("query_start_loc", query_start_loc, 0, plan.num_reqs + 1, "num_reqs + 1")
    expect_min_dim("seq_lens", seq_lens, 0, plan.num_reqs, "num_reqs")
    for name, t in (("query", query), ("output", output), ("key_cache", key_cache)):
        expect_dtype(name, t, FLOAT_DTYPES)
        expect_unit_last_stride(name, t)
    expect_dtype("output", output, (query.dtype,))
    expect_dtype("value_cache", value_cache, (key_cache.dtype,))
    for name, t in (
        ("block_table", block_table),
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
    ):
        expect_dtype(name, t, (torch.int32,))
    expect_unit_last_stride("block_table", block_table)
    expect_same_device(
        {
            "query": query,
            "key_cache": key_cache,
            "value_cache": value_cache,
            "output": output,
            "block_table": block_table,
            "query_start_loc": query_start_loc,
            "seq_lens": seq_lens,
        }
    )


__all__ = ["SPLIT_SLOTS", "AttentionPlan", "unified_attention"]

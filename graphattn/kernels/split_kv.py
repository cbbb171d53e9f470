"""Split-KV (Triton): the scratch for partial results, their store, and the reduction kernel.

With split-KV each (query tile, KV head, split) program of ``unified_attention`` writes,
per query row, its output normalised over its own keys and that output's log-sum-exp
(base 2). The reduction merges the splits of each (token, query head):
``out = sum_s 2^(lse_s - m) * out_s / sum_s 2^(lse_s - m)`` with ``m = max_s lse_s``.

Scratch layout, flat fp32: ``out`` as ``[num_tokens, Hq, S, D]`` and ``lse`` as
``[num_tokens, Hq, S]`` for the launch's token count, head count and split count; it is
allocated once at the largest size and never per step.

Two ways to merge (``GRAPHATTN_FUSED_SPLIT_MERGE``, ``attention_plan.fused_merge``, read
once per process; ``0``, the default: the reduction kernel):

- ``_reduce_kernel``, a second launch, one program per (token, query head);
- ``merge_if_last`` (``1``), inside the attention launch: each split program of a (query
  tile, KV head) counts its arrival on that pair's ticket once its partial rows are stored,
  and the last to arrive merges the tile's rows and sets the ticket back to 0 for the next
  launch. One launch and one kernel boundary less per layer; the tickets live in the
  scratch (``tickets``, zero at allocation and after every launch). Measured slower on the
  H200 (round 14: 40 us a step at batch 1 with its loops unrolled, 79 us before), so not
  the default. Why is not measured; a likely cause is that the last program's barrier,
  atomic and merge sit on the critical path, where the reduction kernel, launched early
  under PDL, has its launch done before the attention ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from graphattn.kernels.attention_plan import (  # noqa: F401 (re-exported)
    MERGE_ENV,
    SPLIT_SLOTS,
    AttentionPlan,
    describe_merge,
    fused_merge,
)
from graphattn.kernels.pdl import launch_options


@dataclass(frozen=True)
class SplitScratch:
    """Partial outputs and log-sum-exps for up to ``max_tokens`` tokens."""

    out: torch.Tensor  # [max_tokens * Hkv * SPLIT_SLOTS * D] fp32
    lse: torch.Tensor  # [max_tokens * Hkv * SPLIT_SLOTS] fp32
    max_tokens: int
    # [2 * max_tokens * Hkv] int32, zero between launches: one arrival count per (query
    # tile, KV head) program group of a fused-merge launch (a grid has at most
    # num_tokens // block_q + num_reqs <= 2 * num_tokens tiles)
    tickets: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls, max_tokens: int, num_kv_heads: int, head_size: int, device: torch.device
    ) -> SplitScratch:
        rows = max_tokens * num_kv_heads * SPLIT_SLOTS
        return cls(
            torch.empty(rows * head_size, dtype=torch.float32, device=device),
            torch.empty(rows, dtype=torch.float32, device=device),
            max_tokens,
            torch.zeros(2 * max_tokens * num_kv_heads, dtype=torch.int32, device=device),
        )


def check_scratch(
    scratch: SplitScratch | None,
    plan: AttentionPlan,
    device: torch.device,
    fused: bool = False,
) -> None:
    """The scratch must hold this launch's partial results (``fused``: and a ticket per
    (query tile, KV head)), on the launch's device."""
    if scratch is None:
        raise ValueError(f"split-KV with {plan.num_splits} splits needs a SplitScratch, got None")
    rows = plan.num_tokens * plan.num_kv_heads * plan.group * plan.num_splits
    if scratch.lse.numel() < rows or scratch.out.numel() < rows * plan.head_size:
        raise ValueError(
            f"split scratch holds {scratch.lse.numel()} partial rows, this launch needs {rows} "
            f"({plan.num_tokens} tokens x {plan.num_kv_heads * plan.group} heads x "
            f"{plan.num_splits} splits)"
        )
    for name, t in (("scratch.out", scratch.out), ("scratch.lse", scratch.lse)):
        if t.dtype != torch.float32 or t.device != device:
            raise ValueError(f"{name} must be float32 on {device}, got {t.dtype} on {t.device}")
    if fused:
        tiles = plan.grid[0] * plan.grid[1]
        t = scratch.tickets
        if t is None or t.numel() < tiles:
            have = "none" if t is None else t.numel()
            raise ValueError(
                f"a fused split merge needs a ticket per (query tile, KV head): {tiles}; the "
                f"scratch has {have}"
            )
        if t.dtype != torch.int32 or t.device != device or not t.is_contiguous():
            raise ValueError(
                f"scratch.tickets must be contiguous int32 on {device}, got {t.dtype} on {t.device}"
            )


def reduce_splits(
    scratch: SplitScratch,
    output: torch.Tensor,  # [T, Hq, D]
    query_start_loc: torch.Tensor,  # [R + 1] int32
    plan: AttentionPlan,
) -> None:
    """Merge the partial results of every real token into ``output`` (padding rows: untouched
    past the last request, zero for requests without keys)."""
    reduce_rows(
        scratch, output, query_start_loc, plan.num_tokens, plan.num_reqs, plan.num_splits,
        plan.head_size,
    )  # fmt: skip


def reduce_rows(
    scratch: SplitScratch,
    output: torch.Tensor,  # [>= T, H, D]
    query_start_loc: torch.Tensor,  # [R + 1] int32
    num_tokens: int,
    num_reqs: int,
    num_splits: int,
    head_size: int,
) -> None:
    """``reduce_splits`` for any launch that stored the partial rows of ``num_tokens`` tokens
    in this layout, ``[T, H, S, head_size]`` and ``[T, H, S]`` (the MLA decode kernel's
    too): one program per (token, head)."""
    pdl = launch_options(output.device)
    _reduce_kernel[(num_tokens, output.shape[1])](
        scratch.out,
        scratch.lse,
        output,
        query_start_loc,
        num_reqs,
        num_splits,
        output.stride(0),
        output.stride(1),
        HEAD_SIZE=head_size,
        D_PAD=triton.next_power_of_2(head_size),
        S_PAD=triton.next_power_of_2(num_splits),
        PDL=bool(pdl),
        num_warps=4,
        **pdl,
    )


# The folded reduction's programs hold their [rows, group * head_size] weight tile in
# registers across the PDL wait. Rows a program, by the tile's width (the group's query heads
# times the padded head size): 64 at Llama-3.2-1B's 4 heads of 64 (8 KV heads x 32 row
# blocks: 256 programs of 4 warps, two an SM, all in flight at once, as measured on the
# H200), fewer where 64 rows spilled registers when compiled for sm_90 (4 x 128: 256 bytes a
# thread; 8 x 128: 2.5 KB; 1 x 64: 8 bytes). Wider groups are not folded: 16 x 128 spilled
# even at 8 rows. tests/test_kernels.py compiles every width for sm_90 and checks for
# spills. A first build with 8 warps cost 12 us a layer on the H200, likely two waves of
# programs (docs/results/o-proj-fold-round37-h200.log).
O_PROJ_ROWS = {64: 32, 128: 64, 256: 64, 512: 32, 1024: 16}
O_PROJ_WARPS = 4


def o_proj_block_n(group_pad: int, head_size: int) -> int | None:
    """Output rows a program of the folded reduction takes; None where the group is too wide
    to fold (its tile would not fit in registers)."""
    return O_PROJ_ROWS.get(group_pad * triton.next_power_of_2(head_size))


def reduce_splits_o_proj(
    scratch: SplitScratch,
    out: torch.Tensor,  # [T, N] fp32, zero (the attention launch zeroes it)
    weight: torch.Tensor,  # [N, Hq * D], o_proj's weight
    query_start_loc: torch.Tensor,  # [R + 1] int32
    plan: AttentionPlan,
    seq_lens: torch.Tensor,  # [R] int32
    sliding_window: int = 0,  # the attention launch's (0: none)
) -> None:
    """Merge the partial results of every real token and multiply them by o_proj's weight
    in the same launch: ``out[t] += merged[t] @ weight.T``, each program adding one KV
    head's share (its query heads' columns of ``weight``) to a block of ``out``'s columns
    with fp32 atomic adds (docs/performance.md, "o_proj in the split reduction").

    The merged rows are rounded to the weight's dtype first, as the attention output is
    stored before o_proj reads it. The adds of the KV heads land in no fixed order, so the
    sum's last bits can differ from run to run.

    A launch of one token and one request (the engine's fold: a decode step of one request)
    reads only the splits that hold keys: the token is its request's last, so its keys are
    the sequence's (its window's) and the attention launch's ``_split_range`` gives each
    split whole tiles of them; the kernel works out from the sequence length, before its
    PDL wait, how many splits that leaves non-empty (5 of 16 at 513 keys in 128-key tiles)
    and masks the others' loads."""
    pdl = launch_options(out.device)
    n = weight.shape[0]
    block_n = o_proj_block_n(plan.group_pad, plan.head_size)  # checked by the launch's caller
    _reduce_o_proj_kernel[(plan.num_kv_heads, triton.cdiv(n, block_n))](
        scratch.out,
        scratch.lse,
        weight,
        out,
        query_start_loc,
        seq_lens,
        plan.num_reqs,
        n,
        weight.stride(0),
        out.stride(0),
        sliding_window,
        NUM_SPLITS=plan.num_splits,
        TILE_N=plan.tiles.tile_n,
        ONE_TOKEN=plan.num_tokens == 1 and plan.num_reqs == 1,  # request 0's last token
        GROUP=plan.group,
        G_PAD=plan.group_pad,
        HEAD_SIZE=plan.head_size,
        D_PAD=triton.next_power_of_2(plan.head_size),
        BLOCK_N=block_n,
        PDL=bool(pdl),
        num_warps=O_PROJ_WARPS,
        **pdl,
    )


@triton.jit
def split_segment(span, num_splits, TILE_N: tl.constexpr):
    """Keys each split takes of a tile's ``span`` keys: whole key tiles, so the last split
    that holds keys is shorter and any after it empty (the attention launch's
    ``_split_range``; the folded reduction counts the filled splits by it)."""
    return tl.cdiv(tl.cdiv(span, num_splits), TILE_N) * TILE_N


@triton.jit
def store_partial(
    part_out_ptr,
    part_lse_ptr,
    out,  # [M, D] fp32, normalised over this split's keys
    lse,  # [M] fp32, base 2; -inf where the split has no keys
    token,  # [M] token index in the batch
    head,  # [M] query head
    row_ok,  # [M]
    store_mask,  # [M, D]
    dims,  # [D]
    split,
    num_splits,
    num_heads,
    HEAD_SIZE: tl.constexpr,
):
    """Write one split's rows into the scratch viewed as [T, Hq, S, D] and [T, Hq, S]."""
    row = (token.to(tl.int64) * num_heads + head) * num_splits + split  # [M]
    tl.store(part_lse_ptr + row, lse, mask=row_ok)
    tl.store(part_out_ptr + row[:, None] * HEAD_SIZE + dims[None, :], out, mask=store_mask)


@triton.jit
def merge_if_last(
    part_out_ptr,
    part_lse_ptr,
    tickets_ptr,
    out_ptr,
    token,  # [M] token index in the batch
    head,  # [M] query head
    row_ok,  # [M]
    store_mask,  # [M, D]
    dims,  # [D]
    stride_ot,
    stride_oh,
    num_heads,
    HEAD_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,  # the launch's split count (tl.num_programs(2))
):
    """After ``store_partial``, in every split program of one (query tile, KV head): the last
    to arrive merges the tile's rows of every split into ``out`` (as ``_reduce_kernel`` does)
    and sets the ticket back to 0, ready for the next launch.

    The arrival is counted once all of the program's threads have stored their rows (the
    barrier) with an acquire-release atomic at GPU scope, so the last program's reads, made
    after its own arrival and through L2 (``.cg``), see every split's rows. The loops over
    the splits unroll (``NUM_SPLITS`` is a constexpr), so no load waits on another and all
    of them are in flight at once, as in ``_reduce_kernel``. A runtime loop here is not
    pipelined (its loads feed no ``tl.dot``) and paid an L2 round trip per split and pass:
    the first build of this merge made the step 79 us slower at batch 1 than the reduction
    kernel (docs/performance-history.md, round 14).
    """
    tl.debug_barrier()
    ticket = tickets_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    arrived = tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu")
    if arrived == NUM_SPLITS - 1:
        first = (token.to(tl.int64) * num_heads + head) * NUM_SPLITS  # [M] split 0's row
        top = tl.full(row_ok.shape, float("-inf"), tl.float32)
        for split in tl.static_range(NUM_SPLITS):
            lse = tl.load(
                part_lse_ptr + first + split, mask=row_ok, other=float("-inf"), cache_modifier=".cg"
            )
            top = tl.maximum(top, lse)
        top = tl.where(top > float("-inf"), top, 0.0)  # no key at all: every weight is 0
        acc = tl.zeros(store_mask.shape, tl.float32)
        total = tl.zeros(row_ok.shape, tl.float32)
        for split in tl.static_range(NUM_SPLITS):  # in split order, as the reduction sums
            row = first + split
            lse = tl.load(
                part_lse_ptr + row, mask=row_ok, other=float("-inf"), cache_modifier=".cg"
            )
            weight = tl.exp2(lse - top)  # 1 for the largest split, 0 for empty ones
            part = tl.load(
                part_out_ptr + row[:, None] * HEAD_SIZE + dims[None, :],
                mask=store_mask,
                other=0.0,
                cache_modifier=".cg",
            )
            acc += part * weight[:, None]
            total += weight
        out = acc / tl.maximum(total, 1.0)[:, None]  # >= 1 when any split has keys; else 0
        dst = token.to(tl.int64) * stride_ot + head * stride_oh  # [M]
        tl.store(
            out_ptr + dst[:, None] + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )
        tl.store(ticket, 0)  # every split has arrived: nothing else touches it this launch


@triton.jit(do_not_specialize=["num_reqs", "num_splits"])
def _reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    query_start_loc_ptr,
    num_reqs,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_SIZE: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    PDL: tl.constexpr,  # launched with launch_pdl: signal, then wait before any read (pdl.py)
):
    if PDL:  # let the next kernel in at once (few slots taken), then wait (kernels/pdl.py)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # the partial results come from the attention kernel before
    token = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    splits = tl.arange(0, S_PAD)
    dims = tl.arange(0, D_PAD)
    row = (token.to(tl.int64) * num_heads + head) * num_splits + splits  # [S]
    ok = splits < num_splits
    # Every read at once, none waiting on another: the batch's end, the log-sum-exps and the
    # partial rows. A split without keys stored zeros (and -inf), so no row needs a mask; a
    # padding token's rows (in the scratch, never written) are read and dropped.
    end = tl.load(query_start_loc_ptr + num_reqs)
    lse = tl.load(part_lse_ptr + row, mask=ok, other=float("-inf"))
    mask = ok[:, None] & (dims < HEAD_SIZE)[None, :]
    parts = tl.load(part_out_ptr + row[:, None] * HEAD_SIZE + dims[None, :], mask=mask, other=0.0)
    if token >= end:  # a padding token no request owns
        return
    top = tl.max(lse, 0)
    top = tl.where(top > float("-inf"), top, 0.0)  # no key at all: every weight is 0
    weight = tl.exp2(lse - top)  # [S], 1 for the largest split, 0 for empty ones
    total = tl.maximum(tl.sum(weight, 0), 1.0)  # >= 1 when any split has keys; else out = 0
    out = tl.sum(parts * weight[:, None], 0) / total  # [D]
    dst = out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + dims
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_SIZE)


@triton.jit(do_not_specialize=["num_reqs"])
def _reduce_o_proj_kernel(
    part_out_ptr,
    part_lse_ptr,
    w_ptr,  # [N, Hq * D]
    y_ptr,  # [T, N] fp32, zero before the launch
    query_start_loc_ptr,
    seq_lens_ptr,
    num_reqs,
    num_rows,  # N, o_proj's output columns
    stride_wn,
    stride_yt,
    window,  # the attention launch's sliding window, 0 for none
    NUM_SPLITS: tl.constexpr,  # a constexpr: the loops over the splits unroll, loads all in flight
    TILE_N: tl.constexpr,  # the attention launch's key tile: its splits hold whole tiles
    ONE_TOKEN: tl.constexpr,  # the launch's one token is its request's last: skip empty splits
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,  # launched with launch_pdl: the weight tile, signal, wait (pdl.py)
):
    kv_head = tl.program_id(0)
    num_heads = tl.num_programs(0) * GROUP
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns
    row_ok = rows < num_rows
    g = tl.arange(0, G_PAD)  # [G] query head of the group
    d = tl.arange(0, D_PAD)  # [D]
    head = kv_head * GROUP + g  # [G]
    gd_ok = (g < GROUP)[:, None] & (d < HEAD_SIZE)[None, :]  # [G, D]
    cols = (head * HEAD_SIZE)[:, None] + d[None, :]  # [G, D] o_proj input columns
    # The weight tile and the batch's end first: no kernel of the step writes either (the
    # step's metadata is staged before its first kernel), so they are read before the wait,
    # while attention runs with the memory nearly idle.
    w = tl.load(
        w_ptr + (rows.to(tl.int64) * stride_wn)[:, None, None] + cols[None, :, :],
        mask=row_ok[:, None, None] & gd_ok[None, :, :],
        other=0.0,
    )  # [BN, G, D]
    end = tl.load(query_start_loc_ptr + num_reqs)  # padding tokens past it stay zero
    if ONE_TOKEN:  # the splits with keys, as the attention launch cut [lo, seq_len) into them
        seq_len = tl.load(seq_lens_ptr)  # staged before the step's first kernel, as ``end``
        # the token's keys [lo, seq_len): its position is seq_len - 1 (the attention tile's
        # first and only query position, hence the tile's lo and hi)
        lo = tl.where(window > 0, tl.maximum(seq_len - 1 - window + 1, 0), 0)
        span = tl.maximum(seq_len - lo, 0)
        seg = split_segment(span, NUM_SPLITS, TILE_N)
        filled = tl.zeros([G_PAD], tl.int32) + tl.cdiv(span, tl.maximum(seg, 1))  # 0: no keys
    else:  # (a [G] vector either way: the interpreter cannot mask by a broadcast scalar)
        filled = tl.full([G_PAD], NUM_SPLITS, tl.int32)
    if PDL:  # let the next kernel in now, then wait for the partial results
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    for t in range(0, end):
        first = (t * num_heads + head.to(tl.int64)) * NUM_SPLITS  # [G] split 0's row
        top = tl.full([G_PAD], float("-inf"), tl.float32)
        for split in tl.static_range(NUM_SPLITS):
            have = (g < GROUP) & (split < filled)  # [G]; an empty split's lse is -inf
            lse = tl.load(part_lse_ptr + first + split, mask=have, other=float("-inf"))
            top = tl.maximum(top, lse)
        top = tl.where(top > float("-inf"), top, 0.0)  # no key at all: every weight is 0
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        total = tl.zeros([G_PAD], tl.float32)
        for split in tl.static_range(NUM_SPLITS):  # in split order, as the reduction sums
            row = first + split
            have = (g < GROUP) & (split < filled)
            lse = tl.load(part_lse_ptr + row, mask=have, other=float("-inf"))
            weight = tl.exp2(lse - top)  # 1 for the largest split, 0 for empty ones
            part = tl.load(  # an empty split's rows are zeros
                part_out_ptr + row[:, None] * HEAD_SIZE + d[None, :],
                mask=gd_ok & have[:, None],
                other=0.0,
            )
            acc += part * weight[:, None]
            total += weight
        x = acc / tl.maximum(total, 1.0)[:, None]  # [G, D], the merged attention rows
        x = x.to(w_ptr.dtype.element_ty).to(tl.float32)  # as the attention output is stored
        y = tl.sum(tl.sum(w.to(tl.float32) * x[None, :, :], 2), 1)  # [BN]
        tl.atomic_add(y_ptr + t * stride_yt + rows, y, mask=row_ok, sem="relaxed")

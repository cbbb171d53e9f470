"""One-row GEMV with its input's last elementwise step computed in the prologue (Triton).

Reference: the unfused ops in the graph's order (``rms_norm_gemv_ref``; tests/test_prologue_gemv.py).

A one-token decode step spends a kernel launch on each small op between two linear layers:
the residual add with the RMSNorm that follows it, and the SiLU-and-multiply of the MLP.
Each of these kernels does ~2 us of latency and almost no work, and the GEMV after it reads
the result right back. Here the GEMV computes its own input from the op's inputs:

- ``rms_norm_gemv(x, w, norm_w, eps, residual)``: ``h = x + residual`` (rounded to x's dtype,
  written once, by program 0, for the next residual), ``out = rms_norm(h, norm_w) @ w.T``.
  The row's ``rsqrt(mean(h^2) + eps)`` is one number, so it factors out of the product:
  each program sums ``h^2`` and ``(h * norm_w) . w`` in fp32 in the same pass over K and
  scales its sums once at the end. No program waits on the whole row before its first
  weight tile (a first version did, and its fused launches were slower than the kernels
  they replaced: docs/performance-history.md).
- ``silu_mul_gemv(gate_up, w)``: ``s = silu(gate) * up`` (each rounded like the graph: SiLU
  in fp32 then to x's dtype, the product in x's dtype) over ``gate_up = [gate | up]``, then
  ``out = s @ w.T``.

And one epilogue, for the MLP's first linear: ``rms_norm_gemv(..., epilogue="silu_mul")``
streams the ``[gate | up]`` weight's two halves together (each program ``block_n / 2`` rows
of each) and stores ``silu(gate) * up`` instead of the two halves, rounded as the graph
rounds it (gate and up to x's dtype, SiLU in fp32 then to x's dtype, the product in x's
dtype). The SiLU-and-multiply kernel between gate_up and down goes, with its launch.

And one for the attention block's first linear: ``rms_norm_gemv(..., epilogue="rope",
rotary=Rotary(cos, sin, head_size, rotated))`` rotates the first ``rotated`` output columns
(the query and key heads of ``[q | k | v]``) by the step's rotary embedding (rotate-half
layout: in each head of ``head_size`` columns, column ``i < head_size / 2`` pairs with
``i + head_size / 2``). Each program streams the two rows of each of its pairs together,
rounds both products to x's dtype as the graph stores them, and stores
``(x1 cos - x2 sin, x2 cos + x1 sin)`` computed in fp32 and rounded once, as the graph's
rotary does. The rotary kernel between qkv and attention goes.

The SiLU product rounds as the post-grad graph ``passes/prologue_gemv.py`` rewrites does;
the normalized row is never rounded to x's dtype (the graph rounds it once), so a fused
norm differs from the unfused one by at most that rounding of each element: one unit of
``|n| @ |w.T|`` (tests/test_prologue_gemv.py holds both folds to three units with the
output's own rounding). Weight tiles are streamed as in ``gemv.py`` (``block_n`` rows per
program, K in ``block_k`` tiles, fp32 products summed once after the loop), and launched
with programmatic dependent launch on Hopper and later (``pdl.py``): as in ``gemv``, the
weight must not be an output of the kernel launched just before (a parameter never is).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from graphattn.kernels.checks import (
    expect_dim,
    expect_dtype,
    expect_min_dim,
    expect_ndim,
    expect_same_device,
    expect_unit_last_stride,
)
from graphattn.kernels.gemv import GemvConfig, choose_gemv_config, padded_k
from graphattn.kernels.pdl import launch_options

PROLOGUE_DTYPES = (torch.bfloat16, torch.float16)
RMS_NORM, SILU_MUL = 0, 1
EPILOGUES = (None, "silu_mul", "rope")
NO_EPILOGUE, GLU, ROPE = 0, 1, 2  # the kernel's EPILOGUE


class Rotary(NamedTuple):
    """The rotary embedding of ``epilogue="rope"``: the step's one position's ``cos`` and
    ``sin`` (``[1, head_size / 2]`` or ``[head_size / 2]``, fp32, bf16 or fp16, unit last
    stride), the head size, and how many leading output columns rotate (whole heads)."""

    cos: torch.Tensor
    sin: torch.Tensor
    head_size: int
    rotated: int


def rms_norm_gemv(
    x: torch.Tensor,  # [1, K]
    weight: torch.Tensor,  # [N, K] contiguous
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    residual: torch.Tensor | None = None,  # [1, K]
    *,
    epilogue: str | None = None,
    config: GemvConfig | None = None,
    rotary: Rotary | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) @ weight.T, x + residual)``; see the module. Without a
    residual the second result is ``x`` itself. ``epilogue="silu_mul"`` takes the product
    as ``[gate | up]`` (N even) and returns ``silu(gate) * up``, ``[1, N / 2]``, instead.
    ``epilogue="rope"`` returns the product with its first ``rotary.rotated`` columns
    rotated by ``rotary``. ``config``: the tiling (its ``block_n``, ``block_k``,
    ``num_warps`` and ``num_stages``; with an epilogue ``block_n`` counts the rows of both
    halves or of both columns of each rotated pair, so it is at least 2); None picks the
    one-row config for the weight's shape (``choose_prologue_config``)."""
    expect_ndim("weight", weight, 2, "[N, K]")
    if residual is not None and x.dtype == torch.float32 and weight.dtype != torch.float32:
        # an fp32 x (an fp32 o_proj row, passes/o_proj_fold.py) is rounded to the weight's
        # dtype in the kernel before the add, as the graph rounds it
        _check_row("x", x, weight, weight.shape[1], torch.float32)
    else:
        _check_row("x", x, weight, weight.shape[1])
    expect_ndim("norm_weight", norm_weight, 1, "[K]")
    expect_dim("norm_weight", norm_weight, 0, x.shape[1], "K")
    expect_unit_last_stride("norm_weight", norm_weight)
    expect_same_device({"x": x, "weight": weight, "norm_weight": norm_weight})
    kind = _check_epilogue(epilogue, weight, rotary, x)
    if residual is not None:
        _check_row("residual", residual, weight, x.shape[1])
        expect_same_device({"x": x, "residual": residual})
        h = torch.empty_like(residual)
    else:
        residual = h = x  # unused by the kernel
    has_residual = residual is not h
    out = _launch(
        x, residual, h, norm_weight, weight, float(eps), RMS_NORM, has_residual, kind, config,
        rotary,
    )  # fmt: skip
    return out, h


def silu_mul_gemv(
    gate_up: torch.Tensor, weight: torch.Tensor, *, config: GemvConfig | None = None
) -> torch.Tensor:
    """``(silu(gate) * up) @ weight.T`` for ``gate_up = [gate | up]`` of ``[1, 2K]``;
    ``config`` as for ``rms_norm_gemv`` (None: ``gemv``'s one-row config; this opt-in fold
    was not part of the tile sweep)."""
    expect_ndim("weight", weight, 2, "[N, K]")
    _check_row("gate_up", gate_up, weight, 2 * weight.shape[1])
    expect_same_device({"gate_up": gate_up, "weight": weight})
    return _launch(
        gate_up, gate_up, gate_up, weight, weight, 0.0, SILU_MUL, False, NO_EPILOGUE, config
    )  # fmt: skip


def choose_prologue_config(rows: int, k: int, *, glu: bool = False) -> GemvConfig:
    """The tiling of a one-row prologue GEMV over a ``[rows, k]`` weight, measured on an H200
    inside the batch-1 step's GEMV chain (``benchmarks/gemv_tiles.py``,
    docs/results/gemv-tiles-h200.log). Every program reads the prologue's inputs (x, the
    residual, the norm weight; or gate and up) for each K tile, so wider programs than
    ``gemv``'s pay off. Up to 4096 rows: 8 rows a program in 1024-wide tiles (measured on
    the qkv projection, 3072x2048); with the SiLU-mul epilogue: 32 rows, 16 of each half,
    in 256-wide tiles (measured on gate_up, 16384x2048); 4 warps and 2 stages for both.
    Above 4096 rows without the epilogue, ``gemv``'s one-row config."""
    k_pad = padded_k(k)
    if glu:
        return GemvConfig(32, min(256, k_pad), 4, 2)
    if rows <= 4096:
        return GemvConfig(8, min(1024, k_pad), 4, 2)
    return choose_gemv_config(1, rows, k, 1)  # the one-row configs do not depend on SMs


def _launch(
    x, residual, h, norm_weight, weight, eps, prologue, has_residual, epilogue, config,
    rotary=None,
) -> torch.Tensor:  # fmt: skip
    rows, k = weight.shape
    glu = epilogue == GLU
    n = rows // 2 if glu else rows  # output columns
    out = torch.empty(1, n, dtype=weight.dtype, device=x.device)
    if config is None and prologue == SILU_MUL:
        config = choose_gemv_config(1, rows, k, 1)  # the one-row configs do not depend on SMs
    elif config is None:
        config = choose_prologue_config(rows, k, glu=glu)
    if config.split_k != 1 or config.dot:
        raise ValueError(
            f"a prologue GEMV runs one K split on the CUDA cores, got config {config.label}"
        )
    if epilogue != NO_EPILOGUE and config.block_n < 2:
        raise ValueError(
            f"epilogue={EPILOGUES[epilogue]!r} streams block_n / 2 pairs of weight rows, so "
            f"block_n must be at least 2, got config {config.label}"
        )
    # With an epilogue a program streams block_n weight rows as before, as block_n / 2
    # pairs: (gate, up) rows N apart, or rotary pairs half a head apart.
    block_n = config.block_n // 2 if epilogue != NO_EPILOGUE else config.block_n
    if epilogue == ROPE:
        cos, sin, half, rotated = rotary.cos, rotary.sin, rotary.head_size // 2, rotary.rotated
        programs = triton.cdiv(n // 2, block_n)
    else:
        cos = sin = x  # unused by the kernel
        half, rotated = 1, 0
        programs = triton.cdiv(n, block_n)
    pdl = launch_options(x.device)
    _prologue_gemv_kernel[(programs,)](
        x,
        residual,
        h,
        norm_weight,
        weight,
        out,
        cos,
        sin,
        n,
        k,
        weight.stride(0),
        eps,
        rotated,
        PROLOGUE=prologue,
        HAS_RESIDUAL=has_residual,
        EPILOGUE=epilogue,
        HALF=half,
        PDL=bool(pdl),
        EVEN_K=k % config.block_k == 0,
        BLOCK_N=block_n,
        BLOCK_K=config.block_k,
        STAGES=config.num_stages,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl,
    )
    return out


def _check_epilogue(
    epilogue: str | None, weight: torch.Tensor, rotary: Rotary | None, x: torch.Tensor
) -> int:
    """The kernel's EPILOGUE for ``epilogue`` (a typed error for anything it cannot do)."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    if (epilogue == "rope") != (rotary is not None):
        raise ValueError(
            f"rotary is for epilogue='rope' and only for it, got epilogue={epilogue!r} with "
            f"rotary={'given' if rotary is not None else None}"
        )
    if epilogue is None:
        return NO_EPILOGUE
    if epilogue == "rope":
        _check_rotary(rotary, weight, x)
        return ROPE
    if weight.shape[0] % 2:
        raise ValueError(
            f"epilogue='silu_mul' needs an even number of weight rows ([gate | up]), got "
            f"weight shape {list(weight.shape)}"
        )
    return GLU


def _check_rotary(rotary: Rotary, weight: torch.Tensor, x: torch.Tensor) -> None:
    if not isinstance(rotary, Rotary):
        raise TypeError(
            f"rotary must be a Rotary(cos, sin, head_size, rotated), got {type(rotary).__name__}"
        )
    d, rotated, n = rotary.head_size, rotary.rotated, weight.shape[0]
    if not (isinstance(d, int) and d >= 2 and d % 2 == 0):
        raise ValueError(f"rotary.head_size must be an even int >= 2, got {d!r}")
    if n % d:
        raise ValueError(
            f"epilogue='rope' pairs columns within heads of {d}: the weight's {n} rows must be "
            f"whole heads"
        )
    if not (isinstance(rotated, int) and 0 < rotated <= n and rotated % d == 0):
        raise ValueError(f"rotary.rotated must be whole heads of {d} in (0, {n}], got {rotated!r}")
    for name, t in (("rotary.cos", rotary.cos), ("rotary.sin", rotary.sin)):
        if t.numel() != d // 2 or t.dim() not in (1, 2) or t.shape[-1] != d // 2:
            raise ValueError(
                f"{name} must be [1, {d // 2}] or [{d // 2}] (one position, head_size / 2), "
                f"got shape {list(t.shape)}"
            )
        expect_dtype(name, t, (torch.float32, torch.bfloat16, torch.float16))
        expect_unit_last_stride(name, t)
    expect_same_device({"x": x, "rotary.cos": rotary.cos, "rotary.sin": rotary.sin})


def _check_row(
    name: str, t: torch.Tensor, weight: torch.Tensor, k: int, dtype: torch.dtype | None = None
) -> None:
    """A ``[1, K]`` row with unit last stride, of the weight's dtype (or of ``dtype``)."""
    expect_ndim(name, t, 2, "[1, K]")
    expect_dim(name, t, 0, 1, "rows")
    expect_dim(name, t, 1, k, "K")
    expect_unit_last_stride(name, t)
    if dtype is not None:
        expect_dtype(name, t, (dtype,))
        expect_dtype("weight", weight, PROLOGUE_DTYPES)
    else:
        expect_dtype(name, t, PROLOGUE_DTYPES)
        expect_dtype("weight", weight, (t.dtype,))
    expect_ndim("weight", weight, 2, "[N, K]")
    expect_min_dim("weight", weight, 0, 1, "N")  # no program would run, h would stay unwritten
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous, got strides {list(weight.stride())}")


@triton.jit
def _prologue_gemv_kernel(
    x_ptr,  # [K] (RMS_NORM) or [2K] (SILU_MUL: gate then up)
    res_ptr,  # [K], HAS_RESIDUAL only
    h_ptr,  # [K] output x + residual, HAS_RESIDUAL only
    norm_w_ptr,  # [K], RMS_NORM only
    w_ptr,  # [N, K], or [2N, K] with GLU (gate rows, then up rows)
    out_ptr,  # [N]
    cos_ptr,  # [HALF], ROPE only
    sin_ptr,  # [HALF], ROPE only
    N,  # output columns
    K,
    stride_wn,
    eps,
    rotated,  # ROPE: the leading output columns that rotate (whole heads)
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    # 1 (GLU): out = silu(gate) * up over the two halves of the weight's rows;
    # 2 (ROPE): the rotate-half rotary embedding over heads of 2 * HALF columns
    EPILOGUE: tl.constexpr,
    HALF: tl.constexpr,  # ROPE: half the head size
    PDL: tl.constexpr,  # launched with launch_pdl: first weight tile, wait, ..., signal (pdl.py)
    EVEN_K: tl.constexpr,  # K is whole tiles: no masks in the loop
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    if EPILOGUE == 2:  # ROPE: BN pairs (row, row + HALF), the first of each in a head's first half
        pairs = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        row_ok = pairs < N // 2
        pairs = tl.minimum(pairs, N // 2 - 1)
        rows = (pairs // HALF) * (2 * HALF) + pairs % HALF
        partner = HALF  # rows from a pair's first row to its second
    else:
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        row_ok = rows < N
        rows = tl.minimum(rows, N - 1)
        partner = N  # GLU: the up half's rows
    cols = tl.arange(0, BLOCK_K)  # [BK]
    # Clamped rows read real data, so only K needs a mask; their results are not stored.
    w_ptrs = w_ptr + (rows.to(tl.int64) * stride_wn)[:, None] + cols[None, :]
    # each pair's second row (N may be a constexpr: Triton specialises an int equal to 1)
    up_ptrs = w_ptrs + tl.cast(partner, tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # summed over K after the loop
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # each pair's second row (epilogues)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)  # RMS_NORM: h^2, summed over K after the loop
    h_len = tl.where(pid == 0, K, 0)  # program 0 writes h
    k_first = 0
    if PDL:  # the first tile: its weights before the wait (no kernel writes them), x after
        ok = cols < K
        w = tl.load(w_ptrs, mask=ok[None, :], other=0.0)
        w_up = tl.load(up_ptrs, mask=ok[None, :], other=0.0) if EPILOGUE != 0 else w
        tl.extra.cuda.gdc_wait()
        a, a_sq = _prologue(
            x_ptr, res_ptr, h_ptr, norm_w_ptr, out_ptr, cols, ok, h_len, K,
            PROLOGUE, HAS_RESIDUAL, False,
        )  # fmt: skip
        sq += a_sq
        acc += w.to(tl.float32) * a[None, :]
        if EPILOGUE != 0:
            acc_up += w_up.to(tl.float32) * a[None, :]
        w_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
        k_first = BLOCK_K
    if EPILOGUE == 2:  # the tables before the loop (after the wait), their latency under it
        cos = tl.load(cos_ptr + pairs % HALF).to(tl.float32)
        sin = tl.load(sin_ptr + pairs % HALF).to(tl.float32)
    for k in tl.range(k_first, K, BLOCK_K, num_stages=STAGES):
        offs = k + cols
        ok = offs < K
        a, a_sq = _prologue(
            x_ptr, res_ptr, h_ptr, norm_w_ptr, out_ptr, offs, ok, h_len, K,
            PROLOGUE, HAS_RESIDUAL, EVEN_K,
        )  # fmt: skip
        sq += a_sq
        if EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=ok[None, :], other=0.0)
        acc += w.to(tl.float32) * a[None, :]
        if EPILOGUE != 0:
            if EVEN_K:
                w_up = tl.load(up_ptrs)
            else:
                w_up = tl.load(up_ptrs, mask=ok[None, :], other=0.0)
            acc_up += w_up.to(tl.float32) * a[None, :]
        w_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    dtype = out_ptr.dtype.element_ty
    res = tl.sum(acc, axis=1)
    up = tl.sum(acc_up, axis=1)
    if PROLOGUE == 0:
        scale = tl.rsqrt(tl.sum(sq, 0) / K + eps)
        res = res * scale
        up = up * scale
    if EPILOGUE == 1:  # gate and up are rounded to dtype first, as the graph stores them
        res = _silu_mul(res.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype)
    if EPILOGUE == 2:  # both columns of a pair are rounded to dtype first, as the graph stores them
        x1 = res.to(dtype).to(tl.float32)
        x2 = up.to(dtype).to(tl.float32)
        turn = rows < rotated
        res = tl.where(turn, x1 * cos - x2 * sin, x1)
        up = tl.where(turn, x2 * cos + x1 * sin, x2)
        tl.store(out_ptr + rows + HALF, up.to(dtype), mask=row_ok)
    tl.store(out_ptr + rows, res.to(dtype), mask=row_ok)


@triton.jit
def _silu_mul(gate, up, dtype: tl.constexpr):
    """``silu(gate) * up`` in fp32 from fp32 values of dtype, rounded as the graph rounds it:
    SiLU in fp32 then to dtype, the product in dtype."""
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (silu * up).to(dtype).to(tl.float32)


@triton.jit
def _prologue(
    x_ptr, res_ptr, h_ptr, norm_w_ptr, out_ptr, offs, ok, h_len, K,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """The GEMV's input over one K tile ``offs`` in fp32, and its ``h^2`` (RMS_NORM; zeros
    for SILU_MUL)."""
    dtype = out_ptr.dtype.element_ty
    if PROLOGUE == 0:  # RMS_NORM: h * norm_w now, the row's rsqrt after the loop
        h = _load(x_ptr + offs, ok, EVEN_K).to(dtype)  # an fp32 x is rounded first
        if HAS_RESIDUAL:
            h = (h.to(tl.float32) + _load(res_ptr + offs, ok, EVEN_K).to(tl.float32)).to(dtype)
            tl.store(h_ptr + offs, h, mask=offs < h_len)
        hf = h.to(tl.float32)
        a = hf * _load(norm_w_ptr + offs, ok, EVEN_K).to(tl.float32)
        a_sq = hf * hf
    else:  # SILU_MUL
        gate = _load(x_ptr + offs, ok, EVEN_K).to(tl.float32)
        up = _load(x_ptr + K + offs, ok, EVEN_K).to(tl.float32)
        a = _silu_mul(gate, up, dtype)
        a_sq = tl.zeros_like(a)
    return a, a_sq


@triton.jit
def _load(ptrs, ok, EVEN_K: tl.constexpr):
    if EVEN_K:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=ok, other=0.0)
    return v


# -- references ---------------------------------------------------------------------------


def rms_norm_gemv_ref(x, weight, norm_weight, eps, residual=None):
    """The unfused ops in the graph's order and dtypes."""
    h = x if residual is None else x + residual
    hf = h.float()
    n = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()).to(x.dtype)
    return (n.float() @ weight.float().T).to(x.dtype), h

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
  they replaced: docs/performance.md).
- ``silu_mul_gemv(gate_up, w)``: ``s = silu(gate) * up`` (each rounded like the graph: SiLU
  in fp32 then to x's dtype, the product in x's dtype) over ``gate_up = [gate | up]``, then
  ``out = s @ w.T``.

The SiLU product rounds as the post-grad graph ``passes/prologue_gemv.py`` rewrites does;
the normalized row is never rounded to x's dtype (the graph rounds it once), so a fused
norm differs from the unfused one by at most that rounding of each element: one unit of
``|n| @ |w.T|`` (tests/test_prologue_gemv.py holds both folds to three units with the
output's own rounding). Weight tiles are streamed as in ``gemv.py`` (``block_n`` rows per
program, K in ``block_k`` tiles, fp32 products summed once after the loop).
"""

from __future__ import annotations

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
from graphattn.kernels.gemv import choose_gemv_config

PROLOGUE_DTYPES = (torch.bfloat16, torch.float16)
RMS_NORM, SILU_MUL = 0, 1


def rms_norm_gemv(
    x: torch.Tensor,  # [1, K]
    weight: torch.Tensor,  # [N, K] contiguous
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    residual: torch.Tensor | None = None,  # [1, K]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) @ weight.T, x + residual)``; see the module. Without a
    residual the second result is ``x`` itself."""
    expect_ndim("weight", weight, 2, "[N, K]")
    _check_row("x", x, weight, weight.shape[1])
    expect_ndim("norm_weight", norm_weight, 1, "[K]")
    expect_dim("norm_weight", norm_weight, 0, x.shape[1], "K")
    expect_unit_last_stride("norm_weight", norm_weight)
    expect_same_device({"x": x, "weight": weight, "norm_weight": norm_weight})
    if residual is not None:
        _check_row("residual", residual, weight, x.shape[1])
        expect_same_device({"x": x, "residual": residual})
        h = torch.empty_like(x)
    else:
        residual = h = x  # unused by the kernel
    out = _launch(x, residual, h, norm_weight, weight, float(eps), RMS_NORM, residual is not h)
    return out, h


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``(silu(gate) * up) @ weight.T`` for ``gate_up = [gate | up]`` of ``[1, 2K]``."""
    expect_ndim("weight", weight, 2, "[N, K]")
    _check_row("gate_up", gate_up, weight, 2 * weight.shape[1])
    expect_same_device({"gate_up": gate_up, "weight": weight})
    return _launch(gate_up, gate_up, gate_up, weight, weight, 0.0, SILU_MUL, False)


def _launch(x, residual, h, norm_weight, weight, eps, prologue, has_residual) -> torch.Tensor:
    n, k = weight.shape
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    config = choose_gemv_config(1, n, k, 1)  # the one-row configs do not depend on SMs
    _prologue_gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x,
        residual,
        h,
        norm_weight,
        weight,
        out,
        n,
        k,
        weight.stride(0),
        eps,
        PROLOGUE=prologue,
        HAS_RESIDUAL=has_residual,
        EVEN_K=k % config.block_k == 0,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        STAGES=config.num_stages,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def _check_row(name: str, t: torch.Tensor, weight: torch.Tensor, k: int) -> None:
    expect_ndim(name, t, 2, "[1, K]")
    expect_dim(name, t, 0, 1, "rows")
    expect_dim(name, t, 1, k, "K")
    expect_unit_last_stride(name, t)
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
    w_ptr,  # [N, K]
    out_ptr,  # [N]
    N,
    K,
    stride_wn,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr,  # K is whole tiles: no masks in the loop
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    cols = tl.arange(0, BLOCK_K)  # [BK]
    # Clamped rows read real data, so only K needs a mask; their results are not stored.
    w_ptrs = w_ptr + (tl.minimum(rows, N - 1).to(tl.int64) * stride_wn)[:, None] + cols[None, :]
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # summed over K after the loop
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)  # RMS_NORM: h^2, summed over K after the loop
    h_len = tl.where(pid == 0, K, 0)  # program 0 writes h
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        offs = k + cols
        ok = offs < K
        if PROLOGUE == 0:  # RMS_NORM: h * norm_w now, the row's rsqrt after the loop
            h = _load(x_ptr + offs, ok, EVEN_K)
            if HAS_RESIDUAL:
                h = (h.to(tl.float32) + _load(res_ptr + offs, ok, EVEN_K).to(tl.float32)).to(dtype)
                tl.store(h_ptr + offs, h, mask=offs < h_len)
            hf = h.to(tl.float32)
            sq += hf * hf
            a = hf * _load(norm_w_ptr + offs, ok, EVEN_K).to(tl.float32)
        else:  # SILU_MUL
            gate = _load(x_ptr + offs, ok, EVEN_K).to(tl.float32)
            up = _load(x_ptr + K + offs, ok, EVEN_K).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            a = (silu * up).to(dtype).to(tl.float32)
        if EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=ok[None, :], other=0.0)
        acc += w.to(tl.float32) * a[None, :]
        w_ptrs += BLOCK_K
    res = tl.sum(acc, axis=1)
    if PROLOGUE == 0:
        res = res * tl.rsqrt(tl.sum(sq, 0) / K + eps)
    tl.store(out_ptr + rows, res.to(dtype), mask=rows < N)


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

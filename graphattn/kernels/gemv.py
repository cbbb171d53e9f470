"""Few-row GEMV (Triton): ``x @ weight.T`` for up to 16 rows of ``x`` and an nn.Linear weight.

Reference: ``x.double() @ weight.double().T`` (tests/test_gemv.py).

At decode batch sizes a linear layer is bound by reading its weight once, so the kernel's
job is to keep enough weight bytes in flight on every SM. Program ``(n, s)`` owns
``block_n`` output columns (weight rows) and the ``s``-th of ``split_k`` slices of K. It
streams its weight rows in ``[block_n, block_k]`` tiles, contiguous along K, and multiplies
each tile with the matching ``[block_m, block_k]`` tile of all the rows of ``x`` (``block_m``
is M rounded up to a power of two), so the weight is read once whatever M is:

- ``dot=False``: fp32 products summed over K on the CUDA cores. For M = 1 the products
  accumulate as ``[block_n, block_k]`` and are summed over K once, after the loop.
- ``dot=True``: ``tl.dot(w, x^T)`` on the tensor cores, x padded to 16 rows. The weight tile
  is the tall operand; the padding costs tensor-core time only, which a GEMV has spare.

The K loop is software-pipelined ``num_stages`` deep on both paths (copies to shared
memory ahead of use; 1 = no pipelining). Rows past M and weight rows past N are clamped to the last real one, so the loads in the
loop are unmasked (unless K is not a multiple of the split's tiles); their results are
dropped at the store. Accumulation is fp32. With ``split_k`` > 1 each program stores its
fp32 partial sums to a workspace ``[split_k, M, N]`` that a second kernel sums in split
order into ``out``: deterministic, no atomics.

On Hopper and later the kernel is launched with programmatic dependent launch
(``pdl.py``): a program loads its first weight tile, waits for the kernels before it, and
signals the next kernel after its K loop.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from graphattn.kernels.checks import (
    FLOAT_DTYPES,
    expect_dim,
    expect_dtype,
    expect_ndim,
    expect_same_device,
    expect_unit_last_stride,
)
from graphattn.kernels.pdl import launch_options
from graphattn.kernels.prefetch import LINE_BYTES, line_elems, prefetch_l2

MAX_ROWS = 16  # rows of x one launch takes; beyond that a GEMM (cuBLAS) reads the weight as well
MAX_SPLIT_K = 16
# Programs to aim for per SM: enough resident programs that their loads cover DRAM latency.
PROGRAMS_PER_SM = 4
# Broadcast path: fp32 products per thread per K tile (block_m * block_n * block_k / threads)
# that stay in registers.
FMA_ELEMS_PER_THREAD = 64
# Tensor-core path: weight-tile elements per pipeline stage (32 KiB of bf16 in shared memory).
DOT_TILE_ELEMS = 16384
REDUCE_BLOCK_N = 128  # output columns per program of the split-K reduction
CPU_NUM_SMS = 8  # the interpreter has no SMs; a few keeps the CPU grids small


@dataclass(frozen=True)
class GemvConfig:
    """One launch's tiling: ``block_n`` weight rows x ``block_k`` columns per loop step."""

    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 2
    split_k: int = 1
    dot: bool = False  # tensor cores (tl.dot) instead of CUDA-core products

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {value}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"GemvConfig.num_stages must be in [1, 8], got {self.num_stages}")
        if not 1 <= self.split_k <= MAX_SPLIT_K:
            raise ValueError(
                f"GemvConfig.split_k must be in [1, {MAX_SPLIT_K}], got {self.split_k}"
            )
        if self.dot and min(self.block_n, self.block_k) < 16:
            raise ValueError(
                "GemvConfig(dot=True) needs block_n and block_k >= 16 (tl.dot's smallest tile), "
                f"got block_n={self.block_n}, block_k={self.block_k}"
            )

    @property
    def label(self) -> str:
        path = "dot" if self.dot else "fma"
        return (
            f"n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages} "
            f"split{self.split_k} {path}"
        )


def gemv(
    x: torch.Tensor,  # [M, K], M <= 16, unit column stride
    weight: torch.Tensor,  # [N, K], unit column stride (an nn.Linear weight)
    out: torch.Tensor | None = None,  # [M, N], x's dtype, unit column stride
    *,
    config: GemvConfig | None = None,
    prefetch: torch.Tensor | None = None,
    prefetch_bytes: int = 0,
) -> torch.Tensor:
    """``x @ weight.T`` in fp32 accumulation, stored in x's dtype; see the module.

    Any K works (tiles past K are masked); rows of 16-byte-aligned length read fastest.
    ``config`` None: ``choose_gemv_config`` for the shape and the device's SM count.

    With PDL (``pdl.py``) each program reads its first ``weight`` tile before waiting for
    the kernel launched before it; since some kernels signal their dependents at their start,
    several kernels before it may still run then, so ``weight`` must not be written by any
    kernel of the step (a parameter never is; ``GRAPHATTN_PDL=0`` for anything else).

    ``prefetch``: a contiguous tensor (the next GEMV's weight) whose first ``prefetch_bytes``
    the programs ask into L2 before that wait, split evenly among them (``prefetch.py``).
    Only where the launch uses PDL: without it nothing runs ahead of the kernel before, and
    the hints would compete with this GEMV's own loads.
    """
    _check(x, weight, out)
    _check_prefetch(prefetch, prefetch_bytes, x.device)
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:  # an empty sum
        return out.zero_()
    if config is None:
        config = choose_gemv_config(m, n, k, _num_sms(x.device))
    hint = (prefetch, prefetch_bytes) if prefetch is not None and prefetch_bytes else None
    if config.split_k == 1:
        _launch(x, weight, out, out.stride(0), 0, config, hint)
        return out
    partial = torch.empty(config.split_k, m, n, dtype=torch.float32, device=x.device)
    _launch(x, weight, partial, n, m * n, config, hint)  # [S, M, N] fp32
    _sum_splits_kernel[(triton.cdiv(n, REDUCE_BLOCK_N),)](
        partial,
        out,
        m,
        n,
        out.stride(0),
        SPLIT_K=config.split_k,
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=REDUCE_BLOCK_N,
    )
    return out


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    dst: torch.Tensor,  # out [M, N], or the fp32 workspace [S, M, N] of a split K
    stride_dm: int,
    stride_ds: int,
    config: GemvConfig,
    hint: tuple[torch.Tensor, int] | None = None,  # (tensor, bytes) to prefetch into L2
) -> None:
    (m, k), n = x.shape, weight.shape[0]
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    pdl = launch_options(x.device)
    grid = (triton.cdiv(n, config.block_n), config.split_k)
    # only ahead of a PDL wait (so never under the interpreter, which cannot run the PTX)
    pf = _prefetch_plan(hint, grid[0] * grid[1]) if pdl else _NO_PREFETCH
    _gemv_kernel[grid](
        x,
        weight,
        dst,
        pf.tensor if pf.tensor is not None else weight,  # unread without PF_PAD
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        weight.stride(0),
        stride_dm,
        stride_ds,
        pf.lines_per_program,
        pf.last_line,
        BLOCK_M=16 if config.dot else triton.next_power_of_2(m),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        EVEN_K=k % k_per_split == 0,
        DOT=config.dot,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        # The Triton interpreter's tl.dot multiplies bf16 bit patterns (triton#11584): on the
        # CPU multiply exactly upcast fp32 copies instead. Remove once the interpreter converts.
        DOT_FP32=x.device.type == "cpu" and x.dtype == torch.bfloat16,
        # On the loop: Triton pipelines loads that feed no tl.dot only when the loop asks.
        STAGES=config.num_stages,
        PDL=bool(pdl),
        PF_PAD=pf.pad,
        PF_LINE=pf.line_elems,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl,
    )


@dataclass(frozen=True)
class _PrefetchPlan:
    """Each program asks L2 for ``lines_per_program`` lines of ``tensor`` (its own share,
    clamped to ``last_line``); ``pad`` (a power of two >= the share, 0 = none) sizes the
    kernel's vector of line addresses."""

    tensor: torch.Tensor | None = None
    lines_per_program: int = 0
    last_line: int = 0
    pad: int = 0
    line_elems: int = 1


_NO_PREFETCH = _PrefetchPlan()
MAX_PREFETCH_LINES = 1024  # per program: a few prefetch instructions per thread


def _prefetch_plan(hint: tuple[torch.Tensor, int] | None, programs: int) -> _PrefetchPlan:
    if hint is None:
        return _NO_PREFETCH
    tensor, nbytes = hint
    nbytes = min(nbytes, tensor.numel() * tensor.element_size())
    lines = triton.cdiv(nbytes, LINE_BYTES.value)
    share = min(triton.cdiv(lines, programs), MAX_PREFETCH_LINES)
    if share == 0:
        return _NO_PREFETCH
    last = min(lines, share * programs) - 1  # the cap can leave the end of the prefix out
    return _PrefetchPlan(
        tensor, share, last, triton.next_power_of_2(share), line_elems(tensor.element_size())
    )


def _check_prefetch(prefetch: torch.Tensor | None, nbytes: int, device: torch.device) -> None:
    if prefetch is None:
        if nbytes:
            raise ValueError(f"prefetch_bytes={nbytes} without a prefetch tensor")
        return
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"prefetch_bytes must be an int >= 0, got {nbytes!r}")
    if prefetch.device != device:
        raise ValueError(f"prefetch must be on {device}, got {prefetch.device}")
    if not prefetch.is_contiguous():
        raise ValueError(f"prefetch must be contiguous, got strides {tuple(prefetch.stride())}")


def gemv_supported(
    x: torch.Tensor, weight: torch.Tensor, device_types: tuple[str, ...] = ("cuda",)
) -> bool:
    """Whether ``gemv(x, weight)`` runs with vectorised loads: tensors on a device of
    ``device_types`` (tests add the interpreter's "cpu") of one supported dtype, 1-16 rows,
    a contiguous weight and rows whose length and starts are 16-byte aligned. ``gemv``
    itself also takes other K and strides, more slowly. Only one row has measured configs:
    at 2-16 rows ``choose_gemv_config``'s estimates lost to cuBLAS in the sweep, by up to
    9x (docs/results/gemv-h200.log), so callers should keep cuBLAS there."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return False
    if x.device.type not in device_types or weight.device != x.device:
        return False
    if x.dtype not in FLOAT_DTYPES or weight.dtype != x.dtype:
        return False
    if not 1 <= x.shape[0] <= MAX_ROWS or x.stride(1) != 1 or not weight.is_contiguous():
        return False
    size = x.element_size()
    aligned = (x.shape[1] * size, x.stride(0) * size, x.data_ptr(), weight.data_ptr())
    return all(a % 16 == 0 for a in aligned)


@functools.lru_cache(maxsize=256)
def choose_gemv_config(m: int, n: int, k: int, num_sms: int) -> GemvConfig:
    """One row: the configs measured best (``_one_row_config``). More rows: an unmeasured
    estimate that puts ``PROGRAMS_PER_SM`` programs on each of ``num_sms`` SMs where N
    allows, splitting K when even the narrowest tiles leave SMs idle, with tensor cores above
    4 rows. The sweep found it far from the best configs there (gate_up at 4 rows: 153 us
    against cuBLAS's 20), which is why only one-row layers use the kernel.
    """
    if m == 1:
        return _one_row_config(n, k)
    dot = m > 4
    target = PROGRAMS_PER_SM * num_sms
    widths = (64, 32, 16) if dot else (64, 32, 16, 8, 4)
    block_n = next((w for w in widths if triton.cdiv(n, w) >= target), widths[-1])
    num_warps = 4
    k_pad = padded_k(k)
    if dot:
        block_k = DOT_TILE_ELEMS // block_n
    else:  # narrower tiles rather than K tiles under 128 (256-byte bf16 rows) for more rows
        budget = FMA_ELEMS_PER_THREAD * 32 * num_warps // triton.next_power_of_2(m)
        block_n = max(widths[-1], min(block_n, budget // min(128, k_pad)))
        block_k = budget // block_n
    block_k = max(16, min(block_k, 512, k_pad))
    split_k = 1
    while (
        triton.cdiv(n, block_n) * split_k * 2 <= target
        and k >= 2 * split_k * block_k * 2  # each split keeps at least two K tiles
        and split_k < MAX_SPLIT_K
    ):
        split_k *= 2
    return GemvConfig(block_n, block_k, num_warps, 3, split_k, dot)


def _one_row_config(n: int, k: int) -> GemvConfig:
    """The best single-row configs measured on an H200 inside the batch-1 step's chain of 64
    GEMVs, with PDL (``benchmarks/gemv_tiles.py``, docs/results/gemv-tiles-h200.log): o_proj
    (2048x2048) reads a whole 2048-wide row tile at once on 8 warps, down (2048x8192) 1024
    at a time, each 4 weight rows a program. Above N = 4096 the earlier one-kernel sweep's 8
    rows on 2 warps (docs/results/gemv-h200.log: gate_up 17.9 us against cuBLAS's 18.0, a
    128k-vocabulary head 117.8 against 122.5).
    """
    k_pad = padded_k(k)
    if n > 4096:
        return GemvConfig(8, min(512, k_pad), 2, 3)
    if k <= 2048:
        return GemvConfig(4, k_pad, 8, 3)
    return GemvConfig(4, 1024, 4, 3)


def padded_k(k: int) -> int:
    """K rounded up to a power of two, at least 16: the widest K tile a launch needs."""
    return max(16, triton.next_power_of_2(k))


def _check(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> None:
    expect_ndim("x", x, 2, "[M, K]")
    expect_ndim("weight", weight, 2, "[N, K]")
    expect_dtype("x", x, FLOAT_DTYPES)
    if weight.dtype != x.dtype:
        raise TypeError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(
            f"x must have at most {MAX_ROWS} rows (a GEMV), got shape {list(x.shape)}; "
            "use torch.mm for more"
        )
    expect_dim("weight", weight, 1, x.shape[1], "K, x's dim 1")
    expect_unit_last_stride("x", x)
    expect_unit_last_stride("weight", weight)
    tensors = {"x": x, "weight": weight}
    if out is not None:
        expect_ndim("out", out, 2, "[M, N]")
        if out.dtype != x.dtype:
            raise TypeError(f"out must have x's dtype {x.dtype}, got {out.dtype}")
        expect_dim("out", out, 0, x.shape[0], "M, x's dim 0")
        expect_dim("out", out, 1, weight.shape[0], "N, weight's dim 0")
        expect_unit_last_stride("out", out)
        tensors["out"] = out
    expect_same_device(tensors)


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_NUM_SMS


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    dst_ptr,  # out [M, N] (split_k == 1) or the fp32 workspace [S, M, N]
    pf_ptr,  # asked into L2 before the PDL wait (PF_PAD > 0): the next GEMV's weight
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_wn,
    stride_dm,
    stride_ds,
    pf_lines,  # lines of pf_ptr per program
    pf_last,  # the last line of pf_ptr to ask for
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # every split's K range is whole tiles
    DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,  # launched with launch_pdl: first weight tile, wait, ..., signal (pdl.py)
    PF_PAD: tl.constexpr,  # a power of two >= pf_lines; 0: no prefetch
    PF_LINE: tl.constexpr,  # elements of pf_ptr per L2 line
):
    split = tl.program_id(1)
    rows_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] weight rows
    rows_m = tl.arange(0, BLOCK_M)  # [BM] rows of x
    cols = tl.arange(0, BLOCK_K)  # [BK]
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    # Clamped rows read real data, so only K needs a mask; their results are not stored.
    w_rows = tl.minimum(rows_n, N - 1).to(tl.int64) * stride_wn
    x_rows = tl.minimum(rows_m, M - 1).to(tl.int64) * stride_xm
    w_ptrs = w_ptr + w_rows[:, None] + (k_lo + cols)[None, :]  # [BN, BK]
    x_ptrs = x_ptr + x_rows[:, None] + (k_lo + cols)[None, :]  # [BM, BK]
    if DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    elif BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # summed over K after the loop
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_first = k_lo
    if PDL:  # the first tile: its weights before the wait (no kernel writes them), x after
        k_ok = (k_lo + cols < k_hi)[None, :]
        w = tl.load(w_ptrs, mask=k_ok, other=0.0)
        if PF_PAD > 0:  # this program's share of the next weight, while the kernels before run
            program = tl.program_id(0) * tl.num_programs(1) + split
            share = tl.minimum(tl.arange(0, PF_PAD), pf_lines - 1)
            line = tl.minimum(program.to(tl.int64) * pf_lines + share, pf_last)
            prefetch_l2(pf_ptr + line * PF_LINE)
        tl.extra.cuda.gdc_wait()
        x = tl.load(x_ptrs, mask=k_ok, other=0.0)
        acc = _gemv_tile(acc, w, x, BLOCK_M, DOT, DOT_PRECISION, DOT_FP32)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        k_first = k_lo + BLOCK_K
    for k in tl.range(k_first, k_hi, BLOCK_K, num_stages=STAGES):
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs)
        else:
            k_ok = (k + cols < k_hi)[None, :]
            w = tl.load(w_ptrs, mask=k_ok, other=0.0)
            x = tl.load(x_ptrs, mask=k_ok, other=0.0)
        acc = _gemv_tile(acc, w, x, BLOCK_M, DOT, DOT_PRECISION, DOT_FP32)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if DOT:
        res = tl.trans(acc)
    elif BLOCK_M == 1:
        res = tl.sum(acc, axis=1)[None, :]
    else:
        res = acc  # [BM, BN]
    dst = dst_ptr + split.to(tl.int64) * stride_ds + rows_m[:, None] * stride_dm + rows_n[None, :]
    mask = (rows_m < M)[:, None] & (rows_n < N)[None, :]
    tl.store(dst, res.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_tile(
    acc,
    w,  # [BN, BK]
    x,  # [BM, BK]
    BLOCK_M: tl.constexpr,
    DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """``acc`` plus one K tile's products (the layout of ``acc`` is the path's)."""
    if DOT:
        if DOT_FP32:
            w, x = w.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)  # [BN, BM]
    elif BLOCK_M == 1:
        acc += w.to(tl.float32) * x.to(tl.float32)  # [BN, BK]
    else:
        prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [BM, BN, BK]
        acc += tl.sum(prod, axis=2)
    return acc


@triton.jit
def _sum_splits_kernel(
    part_ptr,  # [S, M, N] fp32
    out_ptr,  # [M, N]
    M,
    N,
    stride_om,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows_m = tl.arange(0, BLOCK_M)
    rows_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows_m < M)[:, None] & (rows_n < N)[None, :]
    offs = rows_m[:, None] * N + rows_n[None, :]  # [BM, BN]
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):  # in split order: the same sum on every run
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    dst = out_ptr + rows_m[:, None] * stride_om + rows_n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)

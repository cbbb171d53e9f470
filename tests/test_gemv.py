"""The few-row GEMV (graphattn.kernels.gemv) against ``x @ weight.T`` in float64.

On the CPU the kernels run under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET) at awkward sizes; the ``gpu`` tests run Llama-3.2-1B's linear layers in
bf16 and replay the kernel from a CUDA graph. Outputs are NaN-poisoned before each run, so
an element the kernel forgets to write fails.

Error is the relative Frobenius error against float64 on the same stored values. The
output is rounded once to its dtype: within 1 unit roundoff on the GPU, within 2 under the
interpreter (it truncates fp32 -> bf16 instead of rounding). fp32 accumulation over K <=
8192 adds far less. fp32 at 1e-5 fails a TF32 product (10-bit mantissa, ~1e-3).
"""

from __future__ import annotations

import pytest
import torch
from helpers import rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

from graphattn.kernels.gemv import (
    FMA_ELEMS_PER_THREAD,
    MAX_SPLIT_K,
    PROGRAMS_PER_SM,
    GemvConfig,
    choose_gemv_config,
    gemv,
    gemv_supported,
)

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2 * 2**-11, torch.bfloat16: 2 * 2**-8}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Each path and its masks: M = 1 (deferred sum), broadcast, tensor cores; K tiles that do not
# divide K; split-K with uneven and empty splits (K = 8 has one tile for three splits).
CONFIGS = {
    "fma": GemvConfig(block_n=8, block_k=128),
    "fma split3": GemvConfig(block_n=16, block_k=64, split_k=3),
    "dot": GemvConfig(block_n=16, block_k=64, dot=True),
    "dot split4": GemvConfig(block_n=32, block_k=32, num_warps=2, split_k=4, dot=True),
}
SHAPES = [(1, 8), (97, 200), (130, 520)]  # (N, K)
# Llama-3.2-1B's decode linears: qkv, o, gate_up, down, lm head. (N, K)
LLAMA_SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048)]


def make_inputs(m, n, k, dtype, *, device="cpu", seed=0, row_pad=0):
    """x [m, k] (a view with row stride k + row_pad, NaN past k), weight [n, k], NaN-filled
    out [m, n]."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = torch.full((m, k + row_pad), float("nan"), device=device)
    rows[:, :k] = torch.randn(m, k, generator=gen, device=device)
    x = rows.to(dtype)[:, :k]
    weight = torch.randn(n, k, generator=gen, device=device).to(dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    return x, weight, out


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.double() @ weight.double().T  # [M, N], on x's device


def assert_matches_reference(x, weight, out):
    assert not out.isnan().any(), "an output element was not written"
    assert rel_err(out, reference(x, weight)) < TOLERANCE[x.dtype]


# -- correctness ------------------------------------------------------------------------


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_awkward_sizes(dtype, m, n, k, config):
    x, weight, out = make_inputs(m, n, k, dtype, seed=m * n + k)
    result = gemv(x, weight, out, config=CONFIGS[config])
    assert result is out
    assert_matches_reference(x, weight, out)


@settings(max_examples=20, deadline=None)
@given(
    m=st.integers(1, 16),
    n=st.integers(1, 70),
    k=st.sampled_from([8, 16, 24, 64, 96, 200, 256]),
    block_n=st.sampled_from([4, 16, 32]),
    block_k=st.sampled_from([16, 32, 64]),
    split_k=st.sampled_from([1, 2, 3]),
    dot=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_matches_reference(m, n, k, block_n, block_k, split_k, dot, dtype, seed):
    """Any M up to 16, N, K and config, whole K tiles (no K mask) included."""
    block_n = max(block_n, 16) if dot else block_n
    config = GemvConfig(block_n, block_k, split_k=split_k, dot=dot)
    x, weight, out = make_inputs(m, n, k, dtype, seed=seed)
    assert_matches_reference(x, weight, gemv(x, weight, out, config=config))


@pytest.mark.parametrize("config", [None, CONFIGS["fma split3"], CONFIGS["dot"]])
def test_strided_rows(config):
    """x and out as views into wider rows: neither the NaN padding of x is read nor that of
    out written. K = 256 is whole tiles (unmasked loads)."""
    x, weight, _ = make_inputs(5, 40, 256, torch.float16, seed=1, row_pad=9)
    assert x.stride() == (265, 1)
    wide = torch.full((5, 47), float("nan"), dtype=x.dtype)
    out = wide[:, 3:43]  # [5, 40], row stride 47
    gemv(x, weight, out, config=config)
    assert_matches_reference(x, weight, out)
    assert wide[:, :3].isnan().all() and wide[:, 43:].isnan().all()


def test_allocates_the_output():
    x, weight, _ = make_inputs(2, 33, 64, torch.bfloat16)
    out = gemv(x, weight, config=CONFIGS["fma"])
    assert out.shape == (2, 33) and out.dtype == torch.bfloat16
    assert_matches_reference(x, weight, out)


def test_split_k_is_deterministic():
    """Partial sums are added in split order, never with atomics: bit-identical runs."""
    x, weight, _ = make_inputs(3, 50, 512, torch.float32, seed=4)
    config = GemvConfig(block_n=16, block_k=64, split_k=4)
    first = gemv(x, weight, config=config)
    assert torch.equal(first, gemv(x, weight, config=config))
    assert_matches_reference(x, weight, first)


def test_empty_sizes():
    x, weight, _ = make_inputs(1, 1, 8, torch.float32)
    assert gemv(x[:0], weight).shape == (0, 1)
    assert gemv(x, weight[:0]).shape == (1, 0)
    assert torch.equal(gemv(x[:, :0], weight[:, :0]), torch.zeros(1, 1))


# -- configs ----------------------------------------------------------------------------


@given(
    m=st.integers(2, 16),  # one row takes the measured configs (the test below)
    n=st.integers(1, 200_000),
    k=st.integers(1, 16384),
    num_sms=st.sampled_from([8, 78, 132]),
)
def test_heuristic_fills_the_gpu_within_its_budgets(m, n, k, num_sms):
    config = choose_gemv_config(m, n, k, num_sms)
    target = PROGRAMS_PER_SM * num_sms
    programs = -(-n // config.block_n) * config.split_k
    # the grid reaches half the target, or no further split keeps two K tiles per split
    assert (
        2 * programs > target
        or config.split_k == MAX_SPLIT_K
        or k < 4 * config.split_k * config.block_k
    )
    if config.split_k > 1:
        assert k >= 2 * config.split_k * config.block_k
    assert config.block_k <= max(16, 1 << (k - 1).bit_length())
    if not config.dot:  # products of one K tile stay in registers
        block_m = 1 << (m - 1).bit_length()
        threads = 32 * config.num_warps
        assert block_m * config.block_n * config.block_k <= FMA_ELEMS_PER_THREAD * threads


@given(n=st.integers(1, 200_000), k=st.integers(1, 16384), num_sms=st.sampled_from([8, 132]))
def test_one_row_configs_stay_within_budget(n, k, num_sms):
    config = choose_gemv_config(1, n, k, num_sms)
    assert config.split_k == 1 and not config.dot
    k_pad = max(16, 1 << (k - 1).bit_length())
    assert config.block_k <= k_pad
    if k <= 512:  # a short row is one tile
        assert config.block_k == k_pad
    assert config.block_n * config.block_k <= FMA_ELEMS_PER_THREAD * 32 * config.num_warps


@pytest.mark.parametrize(
    ("n", "k", "tiling"),
    [  # the tilings measured best (docs/results/gemv-tiles-h200.log, gemv-h200.log)
        (2048, 2048, (4, 2048, 8, 3)),  # o_proj: the whole row at once
        (2048, 8192, (4, 1024, 4, 3)),  # down
        (3072, 2048, (4, 2048, 8, 3)),  # qkv without a folded norm: o_proj's rule
        (16384, 2048, (8, 512, 2, 3)),  # gate_up without a folded norm
        (128256, 2048, (8, 512, 2, 3)),  # a 128k-vocabulary head
    ],
)
def test_one_row_takes_the_measured_configs(n, k, tiling):
    config = choose_gemv_config(1, n, k, 132)
    assert (config.block_n, config.block_k, config.num_warps, config.num_stages) == tiling


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(block_n=12), "block_n must be a power of two, got 12"),
        (dict(block_k=0), "block_k must be a power of two, got 0"),
        (dict(num_warps=3), "num_warps must be a power of two"),
        (dict(num_stages=0), r"num_stages must be in \[1, 8\], got 0"),
        (dict(split_k=0), "split_k must be in"),
        (dict(split_k=MAX_SPLIT_K + 1), "split_k must be in"),
        (dict(block_n=8, dot=True), "needs block_n and block_k >= 16"),
    ],
)
def test_config_rejects_bad_values(fields, message):
    with pytest.raises(ValueError, match=message):
        GemvConfig(**fields)


# -- bad input --------------------------------------------------------------------------


def _bad_inputs():
    x, w = torch.randn(2, 64), torch.randn(8, 64)
    out = torch.empty(2, 8)
    return {
        "1-D x": ((x[0], w, None), ValueError, r"x must be \[M, K\] \(2-D\), got shape \[64\]"),
        "3-D weight": ((x, w[None], None), ValueError, r"weight must be \[N, K\] \(2-D\)"),
        "K mismatch": ((x, w[:, :32], None), ValueError, r"weight dim 1 \(K, x's dim 1\) must be 64, got 32"),
        "too many rows": ((torch.randn(17, 64), w, None), ValueError, "at most 16 rows"),
        "int x": ((x.int(), w.int(), None), TypeError, "x must have dtype in"),
        "mixed dtypes": ((x, w.half(), None), TypeError, "weight must have x's dtype torch.float32, got torch.float16"),
        "x columns strided": ((torch.randn(2, 128)[:, ::2], w, None), ValueError, "x must be contiguous in its last dimension"),
        "weight transposed": ((x, torch.randn(64, 8).T, None), ValueError, "weight must be contiguous in its last dimension"),
        "out shape": ((x, w, torch.empty(2, 9)), ValueError, r"out dim 1 \(N, weight's dim 0\) must be 8, got 9"),
        "out rows": ((x, w, torch.empty(3, 8)), ValueError, r"out dim 0 \(M, x's dim 0\) must be 2, got 3"),
        "out dtype": ((x, w, out.half()), TypeError, "out must have x's dtype torch.float32, got torch.float16"),
        "out strided": ((x, w, torch.empty(8, 2).T), ValueError, "out must be contiguous in its last dimension"),
        "devices": ((x, w.to("meta"), None), ValueError, "one device"),
    }  # fmt: skip


@pytest.mark.parametrize("case", sorted(_bad_inputs()))
def test_rejects_bad_input(case):
    args, error, message = _bad_inputs()[case]
    with pytest.raises(error, match=message):
        gemv(*args)
    assert not gemv_supported(*args[:2])


def test_not_supported_on_the_cpu():
    x, weight, _ = make_inputs(1, 8, 64, torch.bfloat16)
    assert not gemv_supported(x, weight)


# -- GPU: Llama-3.2-1B's linears, CUDA graphs -------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), LLAMA_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_gpu_llama_shapes_bf16(m, n, k):
    x, weight, out = make_inputs(m, n, k, torch.bfloat16, device="cuda", seed=n + m)
    assert gemv_supported(x, weight)
    assert_matches_reference(x, weight, gemv(x, weight, out))


@pytest.mark.gpu
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_configs_and_dtypes(dtype, config):
    x, weight, out = make_inputs(3, 2048 + 40, 8192 + 24, dtype, device="cuda", row_pad=8)
    assert_matches_reference(x, weight, gemv(x, weight, out, config=CONFIGS[config]))


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, GemvConfig(block_n=8, block_k=256, split_k=4)])
def test_gpu_graph_replay_reads_new_inputs(config):
    """Captured once (split-K's workspace from the graph's pool), replayed on new x values."""
    x, weight, out = make_inputs(4, 2048, 8192, torch.bfloat16, device="cuda")
    gemv(x, weight, out, config=config)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv(x, weight, out, config=config)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(x, weight, out)


@pytest.mark.gpu
def test_gpu_supported_conditions():
    x, weight, _ = make_inputs(16, 256, 2048, torch.bfloat16, device="cuda")
    assert gemv_supported(x, weight)
    assert not gemv_supported(torch.cat([x, x[:1]]), weight)  # 17 rows
    assert not gemv_supported(x[:, 1:].contiguous(), weight[:, 1:].contiguous())  # K = 2047
    assert not gemv_supported(x, weight.T.contiguous().T)  # column-major weight
    assert not gemv_supported(x.float(), weight)

"""The prologue GEMVs (graphattn.kernels.prologue_gemv) against the unfused ops.

The reference runs the prologue in the graph's order and dtypes (``rms_norm_gemv_ref``, and
SiLU-and-multiply written out) and the product in float64, over the prologue's result rounded
to the activation dtype as the unfused graph rounds it. The error is measured per output
element relative to ``|prologue| @ |weight.T|``, so a prologue element that differs by a
fraction of a unit moves the output by at most that fraction of the scale. The bound is
three unit roundoffs: one for the output's own rounding, one for the normalised row, which
the fused norm never rounds (the reference rounds it once), and one for elements the two
sides compute slightly differently (rsqrt, the mean square and exp in another order; the
interpreter truncates instead of rounding).
"""

from __future__ import annotations

import pytest
import torch
from helpers import rel_err

from graphattn.kernels.gemv import FMA_ELEMS_PER_THREAD, GemvConfig
from graphattn.kernels.prologue_gemv import (
    Rotary,
    choose_prologue_config,
    rms_norm_gemv,
    rms_norm_gemv_ref,
    silu_mul_gemv,
)
from graphattn.models.llama import apply_rotary

UNIT = {torch.float16: 2**-11, torch.bfloat16: 2**-8}
# (N, K): K below one tile and one whole tile at the default tilings (1024 wide; the epilogue's
# 256: across, past and whole tiles); test_explicit_tilings runs several tiles without it
SHAPES = [(1, 8), (97, 200), (130, 520), (97, 1024)]
# block_n, block_k, warps, stages: several K tiles, one row a program, a program wider than N
TILINGS = [GemvConfig(4, 64, 4, 2), GemvConfig(1, 128, 2, 3), GemvConfig(32, 32, 4, 1)]
LLAMA = [(3072, 2048), (16384, 2048)]  # qkv and gate_up after a norm (N, K)


def _randn(*shape, dtype, device, gen):
    return torch.randn(*shape, generator=gen, device=device).to(dtype)


def _norm_inputs(n, k, dtype, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    x, residual = (_randn(1, k, dtype=dtype, device=device, gen=gen) for _ in range(2))
    weight = _randn(n, k, dtype=dtype, device=device, gen=gen)
    norm_weight = (1 + 0.1 * torch.randn(k, generator=gen, device=device)).to(dtype)
    return x, weight, norm_weight, residual


def _product_err(out: torch.Tensor, prologue: torch.Tensor, weight: torch.Tensor) -> float:
    """Largest error of ``out`` against ``prologue @ weight.T`` in float64, each element
    relative to ``|prologue| @ |weight.T|``: an element of the prologue rounded the other
    way moves the output by its weight times one unit, whatever the sum cancels."""
    p, w = prologue.double(), weight.double()
    scale = (p.abs() @ w.abs().T).clamp_min(1e-30)
    return float(((out.double() - p @ w.T).abs() / scale).max())


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_gemv_matches_the_unfused_ops(n, k, dtype, with_residual):
    x, weight, norm_weight, residual = _norm_inputs(n, k, dtype)
    residual = residual if with_residual else None
    out, h = rms_norm_gemv(x, weight, norm_weight, 1e-5, residual)
    _, h_ref = rms_norm_gemv_ref(x, weight, norm_weight, 1e-5, residual)
    hf = h_ref.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_weight.float()).to(
        dtype
    )
    assert out.shape == (1, n) and out.dtype == dtype
    assert _product_err(out, normed, weight) < 3 * UNIT[dtype]
    if with_residual:
        assert h is not x and rel_err(h, x.double() + residual.double()) < 2 * UNIT[dtype]
    else:
        assert h is x


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_gemv_matches_the_unfused_ops(n, k, dtype):
    gen = torch.Generator().manual_seed(1)
    gate_up = _randn(1, 2 * k, dtype=dtype, device="cpu", gen=gen)
    weight = _randn(n, k, dtype=dtype, device="cpu", gen=gen)
    gate, up = gate_up.chunk(2, dim=-1)
    s = torch.nn.functional.silu(gate.float()).to(dtype) * up
    out = silu_mul_gemv(gate_up, weight)
    assert out.shape == (1, n) and out.dtype == dtype
    assert _product_err(out, s, weight) < 3 * UNIT[dtype]


def _silu_mul_err(s: torch.Tensor, normed: torch.Tensor, weight: torch.Tensor, unit: float):
    """Largest error of ``s`` against ``silu(gate) * up`` of ``normed @ weight.T`` in float64,
    each element over its bound: gate and up each within three units of their scale (as
    ``_product_err`` holds the plain product), carried through SiLU (slope in [-0.1, 1.1])
    and the product, plus two roundings of the result (SiLU's and the product's)."""
    n, w = normed.double(), weight.double()
    gate_w, up_w = w.chunk(2, dim=0)
    gate, up = n @ gate_w.T, n @ up_w.T
    d_gate = 3 * unit * (n.abs() @ gate_w.abs().T)
    d_up = 3 * unit * (n.abs() @ up_w.abs().T)
    silu = torch.nn.functional.silu(gate)
    want = silu * up
    bound = 1.1 * d_gate * (up.abs() + d_up) + silu.abs() * d_up + 2 * unit * want.abs()
    return float(((s.double() - want).abs() / bound.clamp_min(1e-30)).max())


@pytest.mark.parametrize("n, k", [(2, 8), (194, 200), (260, 520), (194, 1024)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_silu_mul_epilogue_matches_the_unfused_ops(n, k, dtype, with_residual):
    x, weight, norm_weight, residual = _norm_inputs(n, k, dtype, seed=2)
    residual = residual if with_residual else None
    s, h = rms_norm_gemv(x, weight, norm_weight, 1e-5, residual, epilogue="silu_mul")
    full, h_full = rms_norm_gemv(x, weight, norm_weight, 1e-5, residual)
    assert s.shape == (1, n // 2) and s.dtype == dtype
    assert torch.equal(h, h_full)
    hf = (x if residual is None else h_full).float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_weight.float()).to(
        dtype
    )
    assert _silu_mul_err(s, normed, weight, UNIT[dtype]) <= 1
    # the bound is tight enough to catch halves taken the wrong way round
    gate, up = full.chunk(2, dim=-1)
    swapped = torch.nn.functional.silu(up.float()).to(dtype) * gate
    assert _silu_mul_err(swapped, normed, weight, UNIT[dtype]) > 1


@pytest.mark.parametrize("n, k", [(2, 8), (194, 200), (260, 520), (194, 1024)])
def test_silu_mul_epilogue_rounds_as_the_graph(n, k):
    """fp16 (the interpreter rounds fp32 -> fp16 to nearest; it truncates to bf16): the
    epilogue equals SiLU-and-multiply rounded as the graph rounds it (gate and up stored,
    SiLU in fp32 then stored, the product stored) over the plain kernel's gate and up, bit
    for bit; a kernel that skipped one of those roundings would differ."""
    dtype = torch.float16
    x, weight, norm_weight, residual = _norm_inputs(n, k, dtype, seed=3)
    s, _ = rms_norm_gemv(x, weight, norm_weight, 1e-5, residual, epilogue="silu_mul")
    # the plain kernel in the epilogue's K tiles: the same sums in the same order
    same_k_order = choose_prologue_config(n, k, glu=True)
    plain = rms_norm_gemv(x, weight, norm_weight, 1e-5, residual, config=same_k_order)[0]
    gate, up = plain.chunk(2, dim=-1)
    assert torch.equal(s, torch.nn.functional.silu(gate.float()).to(dtype) * up)


def _rotary(d: int, rotated: int, dtype, device="cpu", seed=7) -> Rotary:
    """One position's cos and sin as the model looks them up: halves of one [1, d] row."""
    gen = torch.Generator(device=device).manual_seed(seed)
    angles = 100 * torch.rand(d // 2, generator=gen, device=device)
    row = torch.cat([angles.cos(), angles.sin()])[None].to(dtype)
    cos, sin = row.chunk(2, dim=-1)
    return Rotary(cos, sin, d, rotated)


def _rope_call(rotary, **kwargs):
    """A bad-argument case: the norm GEMV with the rope epilogue and ``rotary``."""
    return lambda x, w, nw, r: rms_norm_gemv(
        x, w, nw, 1e-5, epilogue="rope", rotary=rotary, **kwargs
    )


def _rotated_as_the_graph(plain: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """The model's rotary (graphattn.models.llama.apply_rotary) over the plain product."""
    r = rotary.rotated
    turned = apply_rotary(plain[:, :r], (rotary.cos, rotary.sin), rotary.head_size)
    return torch.cat([turned, plain[:, r:]], dim=-1)


# (N, K, head size, rotated columns): q and k heads rotated and v not, all heads rotated,
# a K tile past the end, heads narrower than a program's pairs
ROPE_SHAPES = [(96, 64, 16, 64), (128, 200, 32, 128), (192, 520, 64, 128), (12, 8, 4, 8)]


@pytest.mark.parametrize("n, k, d, rotated", ROPE_SHAPES)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("config", [None, *TILINGS[::2]], ids=lambda c: getattr(c, "label", c))
def test_rope_epilogue_rotates_as_the_graph(n, k, d, rotated, with_residual, config):
    """fp16 (the interpreter truncates to bf16 where torch rounds): the epilogue equals the
    model's rotary over the plain kernel's product under the same tiling (the same K order),
    bit for bit, and leaves the residual sum and the columns past ``rotated`` alone."""
    dtype = torch.float16
    x, weight, norm_weight, residual = _norm_inputs(n, k, dtype, seed=8)
    residual = residual if with_residual else None
    rotary = _rotary(d, rotated, torch.float32)
    out, h = rms_norm_gemv(
        x, weight, norm_weight, 1e-5, residual, epilogue="rope", rotary=rotary, config=config
    )
    plain, h_plain = rms_norm_gemv(x, weight, norm_weight, 1e-5, residual, config=config)
    assert out.shape == (1, n) and out.dtype == dtype
    assert torch.equal(h, h_plain)
    assert torch.equal(out, _rotated_as_the_graph(plain, rotary))
    assert torch.equal(out[:, rotated:], plain[:, rotated:])
    # the check can fail: cos and sin swapped, or one head fewer rotated
    swapped = rotary._replace(cos=rotary.sin, sin=rotary.cos)
    assert not torch.equal(out, _rotated_as_the_graph(plain, swapped))
    if rotated > d:
        fewer = rotary._replace(rotated=rotated - d)
        assert not torch.equal(out, _rotated_as_the_graph(plain, fewer))


def test_rope_epilogue_reads_bf16_tables():
    """The tables in the model's dtype (its cos_sin_cache follows model.to(dtype))."""
    dtype = torch.float16
    x, weight, norm_weight, _ = _norm_inputs(128, 64, dtype, seed=9)
    rotary = _rotary(32, 96, torch.bfloat16)
    out, _ = rms_norm_gemv(x, weight, norm_weight, 1e-5, epilogue="rope", rotary=rotary)
    plain, _ = rms_norm_gemv(x, weight, norm_weight, 1e-5)
    assert torch.equal(out, _rotated_as_the_graph(plain, rotary))


@pytest.mark.parametrize("config", TILINGS, ids=lambda c: c.label)
@pytest.mark.parametrize("k", [512, 520])  # whole tiles (no masks in the loop), a partial one
@pytest.mark.parametrize("with_residual", [True, False])
def test_explicit_tilings(config, k, with_residual):
    """Every tiling is within the reference bound, and the epilogue equals SiLU-and-multiply
    of the plain kernel's halves under the same tiling (the same K order), bit for bit
    (fp16: the interpreter truncates to bf16 where torch rounds)."""
    dtype = torch.float16
    n = 130
    x, weight, norm_weight, residual = _norm_inputs(n, k, dtype, seed=5)
    residual = residual if with_residual else None
    out, h = rms_norm_gemv(x, weight, norm_weight, 1e-5, residual, config=config)
    want, h_want = rms_norm_gemv_ref(x, weight, norm_weight, 1e-5, residual)
    assert torch.equal(h, h_want)
    assert rel_err(out, want) < 3 * UNIT[dtype]
    if config.block_n >= 2:  # the epilogue takes block_n / 2 rows of each half
        s, _ = rms_norm_gemv(
            x, weight, norm_weight, 1e-5, residual, epilogue="silu_mul", config=config
        )
        plain = rms_norm_gemv(x, weight, norm_weight, 1e-5, residual, config=config)[0]
        gate, up = plain.chunk(2, -1)
        assert torch.equal(s, torch.nn.functional.silu(gate.float()).to(dtype) * up)
    gate_up = _randn(1, 2 * k, dtype=dtype, device="cpu", gen=torch.Generator().manual_seed(6))
    g, u = gate_up.float().chunk(2, dim=-1)
    prologue = (torch.nn.functional.silu(g).to(dtype) * u.to(dtype)).to(dtype)
    assert _product_err(silu_mul_gemv(gate_up, weight, config=config), prologue, weight) < (
        3 * UNIT[dtype]
    )


@pytest.mark.parametrize("rows", [1, 97, 3072, 4096, 4097, 16384, 128256])
@pytest.mark.parametrize("k", [8, 520, 2048, 8192])
@pytest.mark.parametrize("glu", [False, True])
def test_prologue_configs(rows, k, glu):
    """The measured tilings for the Llama shapes; every config keeps one K tile's products
    (two accumulators with the epilogue) in registers and tiles no wider than K needs."""
    config = choose_prologue_config(rows, k, glu=glu)
    assert config.split_k == 1 and not config.dot
    assert config.block_k <= max(16, 1 << (k - 1).bit_length())
    assert config.block_n * config.block_k <= FMA_ELEMS_PER_THREAD * 32 * config.num_warps
    if (rows, k, glu) == (3072, 2048, False):  # qkv
        assert config == GemvConfig(8, 1024, 4, 2)
    if (rows, k, glu) == (16384, 2048, True):  # gate_up with the SiLU-mul epilogue
        assert config == GemvConfig(32, 256, 4, 2)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda x, w, nw, r: rms_norm_gemv(x.repeat(2, 1), w, nw, 1e-5), ValueError, "rows"),
        (lambda x, w, nw, r: rms_norm_gemv(x, w[:, :-1], nw, 1e-5), ValueError, "K"),
        (lambda x, w, nw, r: rms_norm_gemv(x.float(), w, nw, 1e-5), TypeError, "x must have"),
        (
            lambda x, w, nw, r: rms_norm_gemv(x, w.t().contiguous().t(), nw, 1e-5),
            ValueError,
            "weight must be contiguous",
        ),
        (lambda x, w, nw, r: rms_norm_gemv(x, w, nw[:-1], 1e-5), ValueError, "norm_weight"),
        (
            lambda x, w, nw, r: rms_norm_gemv(x, w, nw.repeat(2)[::2], 1e-5),
            ValueError,
            "norm_weight",
        ),
        (
            lambda x, w, nw, r: rms_norm_gemv(x, w[0], nw, 1e-5),
            ValueError,
            r"weight must be \[N, K\]",
        ),
        (lambda x, w, nw, r: rms_norm_gemv(x, w, nw, 1e-5, r[:, :-1]), ValueError, "residual"),
        (lambda x, w, nw, r: silu_mul_gemv(x, w), ValueError, "gate_up dim 1"),
        (
            lambda x, w, nw, r: rms_norm_gemv(x, w, nw, 1e-5, epilogue="gelu"),
            ValueError,
            "epilogue must be one of",
        ),
        (
            lambda x, w, nw, r: rms_norm_gemv(x, w[:15], nw, 1e-5, epilogue="silu_mul"),
            ValueError,
            "even number of weight rows",
        ),
        (
            lambda x, w, nw, r: rms_norm_gemv(x, w[:0], nw, 1e-5, r),
            ValueError,
            r"weight dim 0 \(N\)",
        ),
        (
            lambda x, w, nw, r: rms_norm_gemv(x, w, nw, 1e-5, config=GemvConfig(split_k=2)),
            ValueError,
            "one K split on the CUDA cores",
        ),
        (
            lambda x, w, nw, r: silu_mul_gemv(
                x.repeat(1, 2), w, config=GemvConfig(16, 16, dot=True)
            ),
            ValueError,
            "one K split on the CUDA cores",
        ),
        (
            lambda x, w, nw, r: rms_norm_gemv(
                x, w, nw, 1e-5, epilogue="silu_mul", config=GemvConfig(1, 32)
            ),
            ValueError,
            "block_n must be at least 2, got config n1 k32",
        ),
        (
            lambda x, w, nw, r: rms_norm_gemv(x, w, nw, 1e-5, epilogue="rope"),
            ValueError,
            "rotary is for epilogue='rope' and only for it",
        ),
        (
            lambda x, w, nw, r: rms_norm_gemv(x, w, nw, 1e-5, rotary=_rotary(8, 8, torch.float32)),
            ValueError,
            "rotary is for epilogue='rope' and only for it",
        ),
        (
            _rope_call(_rotary(8, 8, torch.float32)._replace(head_size=7)),
            ValueError,
            "head_size must be an even int",
        ),
        (
            _rope_call(_rotary(32, 32, torch.float32)),
            ValueError,
            "the weight's 16 rows must be whole heads",
        ),
        (
            _rope_call(_rotary(8, 12, torch.float32)),
            ValueError,
            r"rotary.rotated must be whole heads of 8 in \(0, 16\], got 12",
        ),
        (
            _rope_call(_rotary(16, 16, torch.float32)._replace(head_size=8)),
            ValueError,
            r"rotary.cos must be \[1, 4\] or \[4\]",
        ),
        (
            _rope_call(_rotary(8, 8, torch.float32), config=GemvConfig(1, 32)),
            ValueError,
            "epilogue='rope' streams block_n / 2 pairs",
        ),
        (
            _rope_call(tuple(_rotary(8, 8, torch.float32))),
            TypeError,
            r"rotary must be a Rotary\(cos, sin, head_size, rotated\), got tuple",
        ),
    ],
)
def test_bad_arguments_are_rejected(call, error, message):
    x, weight, norm_weight, residual = _norm_inputs(16, 32, torch.bfloat16)
    with pytest.raises(error, match=message):
        call(x, weight, norm_weight, residual)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", LLAMA)
def test_llama_shapes_on_the_gpu(n, k):
    dtype = torch.bfloat16
    x, weight, norm_weight, residual = _norm_inputs(n, k, dtype, device="cuda")
    out, h = rms_norm_gemv(x, weight, norm_weight, 1e-5, residual)
    want, h_want = rms_norm_gemv_ref(x, weight, norm_weight, 1e-5, residual)
    assert torch.equal(h, h_want)  # the add rounds once, as torch's does
    hf = h_want.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_weight.float()).to(
        dtype
    )
    assert _product_err(out, normed, weight) < 3 * UNIT[dtype]
    assert rel_err(out, want) < 3 * UNIT[dtype]
    gate_up = torch.randn(1, 2 * k, device="cuda").to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    s = torch.nn.functional.silu(gate.float()).to(dtype) * up
    assert _product_err(silu_mul_gemv(gate_up, weight[:, :k]), s, weight[:, :k]) < 3 * UNIT[dtype]
    fused, h_fused = rms_norm_gemv(x, weight, norm_weight, 1e-5, residual, epilogue="silu_mul")
    assert torch.equal(h_fused, h_want)
    assert _silu_mul_err(fused, normed, weight, UNIT[dtype]) <= 1
    if n == 3072:  # qkv of Llama 3.2 1B: 32 query and 8 KV heads of 64, q and k rotated
        rotary = _rotary(64, 2560, dtype, device="cuda")
        turned, h_rope = rms_norm_gemv(
            x, weight, norm_weight, 1e-5, residual, epilogue="rope", rotary=rotary
        )
        assert torch.equal(h_rope, h_want)
        assert torch.equal(turned[:, 2560:], out[:, 2560:])
        # fp32 rotation of the same bf16 products; the kernel may fuse a multiply-add
        assert rel_err(turned, _rotated_as_the_graph(out, rotary)) < UNIT[dtype]

"""The prologue-GEMV pass: what it folds in graphs shaped like Inductor's post-grad graphs
(fake CUDA tensors, so on the CPU), and a bf16 Llama compiled by Inductor on the CPU with
the rewrite allowed there (the kernels run under the Triton interpreter): which ops each
one-token step calls, and that it computes what the unfused model computes.
"""

from __future__ import annotations

import collections
import operator
from types import SimpleNamespace

import pytest
import torch
from helpers import as_model_inputs, rel_err, small_bf16_llama
from torch import fx
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import graphattn as ga
from graphattn.errors import ConfigError
from graphattn.kernels import gemv as gemv_kernels
from graphattn.kernels import prologue_gemv as prologue_kernels
from graphattn.models.llama import RMSNorm
from graphattn.passes import single_row_gemv
from graphattn.passes.pass_manager import DEFAULT_PASSES, make_pass_manager
from graphattn.passes.prologue_gemv import (
    RmsNormGemvPass,
    RotaryEpiloguePass,
    SiluMulEpiloguePass,
    SiluMulGemvPass,
)

BF16 = torch.bfloat16
ops = torch.ops.graphattn
NO_GEMV = ("noop_elimination", "unfuse_residual_addmm")
# every prologue and epilogue fold but the SiLU-mul epilogue, which takes what the opt-in
# silu_mul_gemv would
WITH_PROLOGUE = (*NO_GEMV, "rms_norm_gemv", "rope_epilogue", "silu_mul_gemv", "single_row_gemv")


def _graph(fn, *shapes, keep=(), dtypes=None):
    """Post-grad-like ATen graph of ``fn`` over fake CUDA tensors of ``shapes`` (bf16, or
    ``dtypes``; the ops in ``keep`` stay undecomposed)."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        dtypes = dtypes or [BF16] * len(shapes)
        args = [torch.empty(*s, dtype=t, device="cuda") for s, t in zip(shapes, dtypes)]
    table = {op: f for op, f in select_decomp_table().items() if op not in keep}
    gm = make_fx(fn, decomposition_table=table, tracing_mode="fake")(*args)
    gm.graph.eliminate_dead_code()  # as Inductor has by the time post-grad passes run
    gm.recompile()
    return as_model_inputs(gm)


def _targets(gm: fx.GraphModule) -> collections.Counter:
    return collections.Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def _fold(gm: fx.GraphModule, *, epilogue: bool = False) -> int:
    passes = [RmsNormGemvPass(), *([SiluMulEpiloguePass()] if epilogue else []), SiluMulGemvPass()]
    changed = sum(p(gm.graph) for p in passes)
    gm.graph.lint()
    gm.recompile()
    return changed


def _norm(x, norm_w):
    """The Llama model's RMSNorm.forward with ``norm_w`` as a graph input."""
    return RMSNorm.forward(SimpleNamespace(weight=norm_w, eps=1e-5), x)


def _add_norm_linear(a, b, norm_w, w):  # [1, 64] x2, [64], [96, 64]
    h = a + b
    return torch.nn.functional.linear(_norm(h, norm_w), w), h


def _norm_linear(x, norm_w, w):
    return torch.nn.functional.linear(_norm(x, norm_w), w)


def _silu_mul_linear(gate_up, w):  # [1, 2 * 48], [64, 48]
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w)


def test_residual_add_and_norm_fold_into_one_op_with_the_sum_as_second_output():
    gm = _graph(_add_norm_linear, (1, 64), (1, 64), (64,), (96, 64))
    assert _fold(gm) == 1
    targets = _targets(gm)
    assert targets[ops.add_rms_norm_gemv.default] == 1
    for gone in (
        torch.ops.aten.mm.default,
        torch.ops.aten.rsqrt.default,
        torch.ops.aten.add.Tensor,
    ):
        assert targets[gone] == 0, gm.code
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    outs = output.args[0]
    assert all(o.target is operator.getitem for o in outs)
    assert [o.args[1] for o in outs] == [0, 1]  # (the product, the residual sum h)


def test_norm_without_a_residual_folds_into_rms_norm_gemv():
    gm = _graph(_norm_linear, (1, 64), (64,), (96, 64))
    assert _fold(gm) == 1
    assert _targets(gm)[ops.rms_norm_gemv.default] == 1
    assert _targets(gm)[torch.ops.aten.mm.default] == 0


def test_silu_mul_folds_into_silu_mul_gemv():
    gm = _graph(_silu_mul_linear, (1, 96), (64, 48))
    assert _fold(gm) == 1
    targets = _targets(gm)
    assert targets[ops.silu_mul_gemv.default] == 1
    assert targets[torch.ops.aten.mm.default] == targets[torch.ops.aten.split.Tensor] == 0


def _silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _add_norm_mlp(a, b, norm_w, w_gate_up, w_down):  # [1, 64] x2, [64], [96, 64], [64, 48]
    h = a + b
    gate_up = torch.nn.functional.linear(_norm(h, norm_w), w_gate_up)
    return torch.nn.functional.linear(_silu_mul(gate_up), w_down), h


def _norm_mlp(x, norm_w, w_gate_up, w_down):
    gate_up = torch.nn.functional.linear(_norm(x, norm_w), w_gate_up)
    return torch.nn.functional.linear(_silu_mul(gate_up), w_down)


MLP_SHAPES = [(64,), (96, 64), (64, 48)]


def test_silu_mul_folds_into_the_gate_up_gemv_as_an_epilogue():
    gm = _graph(_add_norm_mlp, (1, 64), (1, 64), *MLP_SHAPES)
    assert _fold(gm, epilogue=True) == 2  # the norm into gate_up, then the SiLU-mul after it
    targets = _targets(gm)
    assert targets[ops.add_rms_norm_gemv_silu_mul.default] == 1
    assert targets[ops.add_rms_norm_gemv.default] == targets[ops.silu_mul_gemv.default] == 0
    for gone in (torch.ops.aten.split.Tensor, torch.ops.aten.mul.Tensor):
        assert targets[gone] == 0, gm.code
    assert targets[torch.ops.aten.mm.default] == 1  # down, for single_row_gemv
    (fused,) = [n for n in gm.graph.nodes if n.target is ops.add_rms_norm_gemv_silu_mul.default]
    assert fused.meta["val"].__class__ is tuple and fused.meta["val"][0].shape == (1, 48)
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    h = output.args[0][1]
    assert h.target is operator.getitem and h.args == (fused, 1)  # the residual sum


def test_silu_mul_epilogue_without_a_residual():
    gm = _graph(_norm_mlp, (1, 64), *MLP_SHAPES)
    assert _fold(gm, epilogue=True) == 2
    targets = _targets(gm)
    assert targets[ops.rms_norm_gemv_silu_mul.default] == 1
    assert targets[ops.rms_norm_gemv.default] == targets[torch.ops.aten.split.Tensor] == 0


def test_without_the_epilogue_pass_silu_mul_gemv_takes_the_chain():
    gm = _graph(_norm_mlp, (1, 64), *MLP_SHAPES)
    assert _fold(gm) == 2
    targets = _targets(gm)
    assert targets[ops.rms_norm_gemv.default] == targets[ops.silu_mul_gemv.default] == 1


def test_an_epilogue_that_would_leave_the_product_alive_is_not_made():
    """With ``aten.silu`` kept whole, the fp32 gate may have other users; the rewrite would
    then leave the product (and the GEMV streaming the weight) in the graph as well."""

    def fn(x, nw, wgu, wd):
        gate, up = _norm_linear(x, nw, wgu).chunk(2, dim=-1)
        gate_f32 = gate.float()
        s = torch.nn.functional.silu(gate_f32).to(BF16) * up
        return torch.nn.functional.linear(s, wd), gate_f32 * 2

    gm = _graph(fn, (1, 64), *MLP_SHAPES, keep=(torch.ops.aten.silu.default,))
    assert _targets(gm)[torch.ops.aten.silu.default] == 1
    assert RmsNormGemvPass()(gm.graph) == 1
    assert SiluMulEpiloguePass()(gm.graph) == 0
    assert _targets(gm)[ops.rms_norm_gemv_silu_mul.default] == 0
    # without the second user the same graph folds
    gm = _graph(
        lambda x, nw, wgu, wd: fn(x, nw, wgu, wd)[0],
        (1, 64),
        *MLP_SHAPES,
        keep=(torch.ops.aten.silu.default,),
    )
    RmsNormGemvPass()(gm.graph)
    assert SiluMulEpiloguePass()(gm.graph) == 1


@pytest.mark.parametrize(
    "fn, shapes, norms",
    [
        # the gate_up product has a second user: the halves must be stored anyway
        (
            lambda x, nw, wgu, wd: (
                torch.nn.functional.linear(_silu_mul(gu := _norm_linear(x, nw, wgu)), wd),
                gu,
            ),
            [(1, 64), *MLP_SHAPES],
            1,
        ),
        # SiLU of the second half times the first
        (
            lambda x, nw, wgu, wd: torch.nn.functional.linear(
                _silu_mul(_norm_linear(x, nw, wgu).flip(-1)), wd
            ),
            [(1, 64), *MLP_SHAPES],
            1,
        ),
        (
            lambda x, nw, wgu, wd: torch.nn.functional.linear(
                torch.nn.functional.silu((gu := _norm_linear(x, nw, wgu).chunk(2, dim=-1))[1])
                * gu[0],
                wd,
            ),
            [(1, 64), *MLP_SHAPES],
            1,
        ),
        # the same with the residual add: the two-output op keeps its halves too
        (
            lambda a, b, nw, wgu, wd: (
                torch.nn.functional.linear(_silu_mul(gu := _norm_linear(a + b, nw, wgu)), wd),
                gu,
            ),
            [(1, 64), (1, 64), *MLP_SHAPES],
            1,
        ),
        # the gate in fp32 has another user (the matcher's exp form refuses it)
        (
            lambda x, nw, wgu, wd: (
                torch.nn.functional.linear(
                    torch.nn.functional.silu(
                        gf := (gu := _norm_linear(x, nw, wgu).chunk(2, dim=-1))[0].float()
                    ).to(BF16)
                    * gu[1],
                    wd,
                ),
                gf * 2,
            ),
            [(1, 64), *MLP_SHAPES],
            1,
        ),
        # gate_up without a norm before it: no prologue GEMV to carry the epilogue
        (
            lambda x, nw, wgu, wd: torch.nn.functional.linear(
                _silu_mul(torch.nn.functional.linear(x * nw, wgu)), wd
            ),
            [(1, 64), *MLP_SHAPES],
            0,
        ),
    ],
)
def test_other_mlps_keep_their_silu_mul(fn, shapes, norms):
    gm = _graph(fn, *shapes)
    assert SiluMulEpiloguePass()(gm.graph) == 0  # nothing to fold before the norm pass
    assert RmsNormGemvPass()(gm.graph) == norms  # gate_up's norm folds where there is one
    before = _targets(gm)
    assert SiluMulEpiloguePass()(gm.graph) == 0
    assert _targets(gm) == before
    targets = _targets(gm)
    assert targets[ops.rms_norm_gemv_silu_mul.default] == 0


@pytest.mark.parametrize(
    "fn, shapes",
    [
        # the normalised row has a second user: folding would compute it twice
        (
            lambda x, nw, w: (torch.nn.functional.linear(n := _norm(x, nw), w), n * 2),
            [(1, 64), (64,), (96, 64)],
        ),
        (_norm_linear, [(2, 64), (64,), (96, 64)]),  # two rows
        # split along the rows, not the features
        (
            lambda gu, w: torch.nn.functional.linear(
                torch.nn.functional.silu(gu.split(1, 0)[0]) * gu.split(1, 0)[1], w
            ),
            [(2, 48), (64, 48)],
        ),
        # the halves of two different tensors
        (
            lambda g, u, w: torch.nn.functional.linear(torch.nn.functional.silu(g) * u, w),
            [(1, 48), (1, 48), (64, 48)],
        ),
        # a norm without its weight
        (
            lambda x, w: torch.nn.functional.linear(
                (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(BF16),
                w,
            ),
            [(1, 64), (96, 64)],
        ),
    ],
)
def test_other_chains_stay(fn, shapes):
    gm = _graph(fn, *shapes)
    before = gm.code
    assert _fold(gm) == 0
    assert gm.code == before


# -- the rotary epilogue -------------------------------------------------------------------

aten = torch.ops.aten
D, Q, KV = 16, 64, 32  # head size; query and key columns of the [1, 128] qkv product
QKV_SHAPES = [(1, 64), (1, 64), (64,), (128, 64), (1, D // 2), (1, D // 2)]


def _rotate(x, cos, sin, *, form="rotate_half"):
    """graphattn.models.llama.apply_rotary in explicit ATen ops (make_fx's fake CUDA tensors
    reject its ``[:, None, :]`` indexing), or one of the other ``form``s the pass must leave
    alone."""
    c, s = aten.unsqueeze(cos, 1).float(), aten.unsqueeze(sin, 1).float()
    if form == "4d":  # fp32 tables unsqueezed twice: the terms are [1, 1, H, D/2] and
        # cat(dim=2) joins them along the heads, not within each head
        c, s = aten.unsqueeze(aten.unsqueeze(cos, 1), 1), aten.unsqueeze(aten.unsqueeze(sin, 1), 1)
        x1, x2 = x.view(1, -1, D).float().chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=2).to(x.dtype).view(1, -1)
    if form == "sin_for_cos":  # the second half's cos is another table
        x1, x2 = x.view(1, -1, D).float().chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * s, x2 * s + x1 * s], dim=-1).to(x.dtype).view(1, -1)
    x1, x2 = x.view(1, -1, D).float().chunk(2, dim=-1)
    first = x1 * c + x2 * s if form == "flip" else x1 * c - x2 * s
    second = x2 * c + x1 * s
    halves = [second, first] if form == "halves_swapped" else [first, second]
    return torch.cat(halves, dim=-1).to(x.dtype).view(1, -1)


def _attention_inputs(a, b, norm_w, w, cos, sin):
    return _attention_inputs_as(a, b, norm_w, w, cos, sin)


def _attention_inputs_as(a, b, norm_w, w, cos, sin, *, form="rotate_half", extra=None):
    h = a + b
    qkv = torch.nn.functional.linear(_norm(h, norm_w), w)
    q, k = _rotate(aten.slice(qkv, 1, 0, Q + KV), cos, sin, form=form).split([Q, KV], dim=-1)
    out = (q, k, aten.slice(qkv, 1, Q + KV, 128), h)
    if extra == "product":  # the unrotated q and k columns are read as well
        return (*out, qkv)
    if extra == "overlap":  # a slice from inside the rotated columns
        return (*out, aten.slice(qkv, 1, Q + KV - 8, 128))
    return out


def _fold_rope(gm: fx.GraphModule) -> int:
    changed = RmsNormGemvPass()(gm.graph) + RotaryEpiloguePass()(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return changed


def test_rotary_folds_into_the_qkv_gemv_as_an_epilogue():
    gm = _graph(_attention_inputs, *QKV_SHAPES)
    assert _fold_rope(gm) == 2  # the norm into qkv, then the rotary after it
    targets = _targets(gm)
    assert targets[ops.add_rms_norm_gemv_rope.default] == 1
    assert targets[ops.add_rms_norm_gemv.default] == 0
    for gone in (aten.cat.default, aten.sub.Tensor, aten.mul.Tensor, aten.split.Tensor):
        assert targets[gone] == 0, gm.code
    (fused,) = [n for n in gm.graph.nodes if n.target is ops.add_rms_norm_gemv_rope.default]
    assert fused.args[-4:][2:] == (D, Q + KV)  # head size, rotated columns
    assert [a.name for a in fused.args[-4:-2]] == ["cos_1", "sin_1"]
    (product,) = [u for u in fused.users if u.args[1] == 0]
    starts = sorted(u.args[2] for u in product.users)
    assert starts == [0, Q + KV]  # [q | k] and v, both read from the fused output
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    assert output.args[0][3].args == (fused, 1)  # the residual sum


def test_rotary_epilogue_without_a_residual():
    def fn(x, norm_w, w, cos, sin):
        qkv = torch.nn.functional.linear(_norm(x, norm_w), w)
        return _rotate(aten.slice(qkv, 1, 0, Q + KV), cos, sin), aten.slice(qkv, 1, Q + KV, 128)

    gm = _graph(fn, *QKV_SHAPES[1:])
    assert _fold_rope(gm) == 2
    targets = _targets(gm)
    assert targets[ops.rms_norm_gemv_rope.default] == 1
    assert targets[ops.rms_norm_gemv.default] == targets[aten.cat.default] == 0


@pytest.mark.parametrize(
    "variant",
    [
        {"form": "flip"},  # x1 cos + x2 sin first: not the rotate-half rotary
        {"form": "halves_swapped"},  # cat([x2 cos + x1 sin, x1 cos - x2 sin])
        {"form": "sin_for_cos"},  # x2 sin + x1 sin in the second half
        {"form": "4d"},  # the same terms over [1, 1, H, D/2]: cat(dim=2) joins heads
        {"form": "rotate_half", "tables": torch.float64},  # the kernel reads fp32/bf16/fp16
        {"extra": "product"},
        {"extra": "overlap"},
    ],
    ids=lambda v: "-".join(str(x) for x in v.values()),
)
def test_other_rotaries_stay(variant):
    variant = dict(variant)
    tables = variant.pop("tables", torch.float32 if variant.get("form") == "4d" else BF16)

    def fn(a, b, norm_w, w, cos, sin):
        return _attention_inputs_as(a, b, norm_w, w, cos, sin, **variant)

    gm = _graph(fn, *QKV_SHAPES, dtypes=[BF16] * 4 + [tables] * 2)
    assert RmsNormGemvPass()(gm.graph) == 1
    before = gm.graph.python_code("self").src
    assert RotaryEpiloguePass()(gm.graph) == 0
    assert gm.graph.python_code("self").src == before
    assert _targets(gm)[ops.add_rms_norm_gemv_rope.default] == 0


def test_per_head_tables_stay():
    """Tables of [1, H, D/2] (one row per head) are not one position's cos and sin."""

    def fn(a, b, norm_w, w, cos, sin):
        h = a + b
        qkv = torch.nn.functional.linear(_norm(h, norm_w), w)
        x1, x2 = aten.slice(qkv, 1, 0, Q + KV).view(1, -1, D).float().chunk(2, dim=-1)
        c, s = cos.float(), sin.float()
        y = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(BF16).view(1, -1)
        return y, aten.slice(qkv, 1, Q + KV, 128), h

    heads = (Q + KV) // D
    gm = _graph(fn, *QKV_SHAPES[:4], (1, heads, D // 2), (1, heads, D // 2))
    assert RmsNormGemvPass()(gm.graph) == 1
    assert RotaryEpiloguePass()(gm.graph) == 0


def test_rotary_epilogue_runs_after_the_norm_fold():
    with pytest.raises(ConfigError, match="'rms_norm_gemv' must come before 'rope_epilogue'"):
        make_pass_manager(["rope_epilogue", "rms_norm_gemv"])
    assert "rope_epilogue" in DEFAULT_PASSES


# -- end to end through Inductor (CPU) -----------------------------------------------------


def _count_launches(monkeypatch) -> collections.Counter:
    calls: collections.Counter = collections.Counter()

    def counted(module, name, label):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            has_residual = name == "rms_norm_gemv" and (len(args) > 4 or "residual" in kwargs)
            epilogue = kwargs.get("epilogue")
            calls[
                label
                + (" + residual" if has_residual else "")
                + (f" + {epilogue}" if epilogue else "")
            ] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    counted(prologue_kernels, "rms_norm_gemv", "rms_norm_gemv")
    counted(prologue_kernels, "silu_mul_gemv", "silu_mul_gemv")
    counted(gemv_kernels, "gemv", "gemv")
    return calls


def test_default_passes_fold_the_norms_of_a_compiled_llama_and_match(monkeypatch, tmp_path):
    """The default pass list on a bf16 Llama compiled by Inductor (CPU): one-token steps call
    the fused norm GEMVs (qkv's with the rotary epilogue, gate_up's with the SiLU-and-multiply
    epilogue) and the plain GEMV
    (the SiLU prologue fold is opt-in), and match an engine without the GEMV passes."""
    monkeypatch.setattr(single_row_gemv, "GEMV_DEVICES", ("cuda", "cpu"))
    calls = _count_launches(monkeypatch)
    model = small_bf16_llama(128, 64, 96, norms_off_one=True)
    common = dict(
        cudagraph_mode="NONE",
        attention_backend="TORCH_REF",
        compile_sizes=(1,),
        max_num_seqs=2,
        max_num_tokens=16,
        max_model_len=64,
        num_blocks=16,
    )
    fused = ga.compile(model, passes=DEFAULT_PASSES, cache_dir=str(tmp_path / "fused"), **common)
    plain = ga.compile(model, passes=NO_GEMV, cache_dir=str(tmp_path / "plain"), **common)
    prompt = ga.Request(list(range(1, 9)), 0, [0])
    for engine in (fused, plain):
        engine.step(ga.Batch.from_requests([prompt]))
    calls.clear()
    step = ga.Batch.from_requests([ga.Request([9], 8, [0])])
    got = fused.step(step)
    # layer 0: norm(embedding) -> qkv -> rotary; o; add + norm -> gate_up -> silu * mul; down
    # layer 1: add + norm -> qkv -> rotary; o; add + norm -> gate_up -> silu * mul; down; the
    # final norm stays
    assert calls == {
        "rms_norm_gemv + rope": 1,
        "rms_norm_gemv + residual + rope": 1,
        "rms_norm_gemv + residual + silu_mul": 2,
        "gemv": 4,
    }
    want = plain.step(step)
    assert rel_err(got, want) < 2e-2  # bf16 activations, rounded at other places by Inductor


@pytest.mark.gpu
def test_engine_on_cuda_folds_and_matches_cublas(monkeypatch, tmp_path):
    """The prologue passes and the rotary epilogue on a bf16 Llama on the GPU: FULL graphs
    of one token record the fused ops (counted while the engine captures: a replay runs no
    Python), and a decode step's output matches an engine without the GEMV passes."""
    calls = _count_launches(monkeypatch)
    model = small_bf16_llama(512, 256, 512, device="cuda", norms_off_one=True)
    common = dict(
        max_num_seqs=4, max_num_tokens=64, max_model_len=128, num_blocks=32,
        cudagraph_capture_sizes=(1, 2, 4),
    )  # fmt: skip
    fused = ga.compile(model, passes=WITH_PROLOGUE, cache_dir=str(tmp_path / "fused"), **common)
    assert {
        "rms_norm_gemv + rope",  # layer 0's qkv
        "rms_norm_gemv + residual + rope",  # layer 1's
        "rms_norm_gemv + residual",  # gate_up
        "silu_mul_gemv",
        "gemv",
    } <= set(calls)
    plain = ga.compile(model, passes=NO_GEMV, cache_dir=str(tmp_path / "plain"), **common)
    prompt = ga.Request(list(range(1, 9)), 0, [0])
    for engine in (fused, plain):
        engine.step(ga.Batch.from_requests([prompt]))
    step = ga.Batch.from_requests([ga.Request([9], 8, [0])])
    got, want = fused.step(step), plain.step(step)
    assert fused.stats.runtime_modes["FULL"] == 1
    assert rel_err(got, want) < 2e-2

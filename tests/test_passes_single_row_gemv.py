"""The single-row GEMV pass: which linear layers it rewrites (ATen graphs with fake CUDA
tensors, so it runs on the CPU), and on a GPU that an engine's one-token build calls the
Triton GEMV and gives the same tokens as cuBLAS.
"""

from __future__ import annotations

import pytest
import torch
from helpers import small_bf16_llama
from torch import fx
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import graphattn as ga
from graphattn.passes.single_row_gemv import GEMV_OP, SingleRowGemvPass

aten = torch.ops.aten
BF16 = torch.bfloat16


def _linear_graph(x_shape, w_shape, *, dtype=BF16, device="cuda", symbolic_rows=False, fn=None):
    """The ATen graph of ``fn(x, w)`` (default ``F.linear``) over fake tensors."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        rows = x_shape[0]
        if symbolic_rows:  # a size Dynamo left dynamic, as in a piece's dynamic build
            symbol = mode.shape_env.create_symbol(3, ConstantSource("rows"))
            rows = mode.shape_env.create_symintnode(symbol, hint=3)
        x = torch.empty(rows, *x_shape[1:], dtype=dtype, device=device)
        w = torch.empty(*w_shape, dtype=dtype, device=device)
    fn = fn or torch.nn.functional.linear
    return make_fx(fn, tracing_mode="fake")(x, w)


def _rewrites(gm: fx.GraphModule) -> int:
    changed = SingleRowGemvPass()(gm.graph)
    gm.graph.lint()
    return changed


def test_one_row_linear_becomes_gemv():
    gm = _linear_graph((1, 64), (96, 64))
    assert _rewrites(gm) == 1
    (call,) = [n for n in gm.graph.nodes if n.target is GEMV_OP]
    assert call.meta["val"].shape == (1, 96) and call.meta["val"].dtype == BF16
    assert all(n.target is not aten.mm.default for n in gm.graph.nodes)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(x_shape=(2, 64), w_shape=(96, 64)),  # two rows: cuBLAS won the sweep there
        dict(x_shape=(1, 64), w_shape=(96, 64), symbolic_rows=True),  # a dynamic build
        dict(x_shape=(1, 64), w_shape=(96, 64), dtype=torch.float32),  # not measured
        dict(x_shape=(1, 64), w_shape=(96, 64), device="cpu"),
        dict(x_shape=(1, 20), w_shape=(96, 20)),  # 40-byte rows do not vectorise
        # x @ w with w already [K, N]: there is no [N, K] weight to stream
        dict(x_shape=(1, 64), w_shape=(64, 96), fn=torch.mm),
        # a weight that is itself a transpose (not contiguous)
        dict(
            x_shape=(1, 64), w_shape=(64, 96), fn=lambda x, w: torch.nn.functional.linear(x, w.t())
        ),
        # a weight computed in the graph: with PDL the GEMV reads it before the kernel that
        # writes it has finished
        dict(
            x_shape=(1, 64), w_shape=(96, 64), fn=lambda x, w: torch.nn.functional.linear(x, w * 2)
        ),
    ],
)
def test_other_matmuls_stay(kwargs):
    gm = _linear_graph(**kwargs)
    before = gm.code
    assert _rewrites(gm) == 0
    gm.recompile()
    assert gm.code == before


def test_compile_sizes_default_to_one_token_on_cuda_with_the_pass_and_graphs():
    config = ga.CompileConfig()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    graphed = (1, 2, 4, 8)  # capture sizes covering one token
    assert config.resolved_compile_sizes(cuda, graphed) == (1,)
    assert config.resolved_compile_sizes(cpu, graphed) == ()
    assert config.resolved_compile_sizes(cuda, ()) == ()  # no graphs: a Python op per layer
    assert config.resolved_compile_sizes(cuda, (2, 4)) == ()  # one token runs without one
    assert config.resolved_compile_sizes(cuda, graphed, torch.float16) == (1,)
    assert config.resolved_compile_sizes(cuda, graphed, torch.float32) == ()  # not rewritten
    assert config.replace(passes=("noop_elimination",)).resolved_compile_sizes(cuda, graphed) == ()
    assert config.replace(passes=("rms_norm_gemv",)).resolved_compile_sizes(cuda, graphed) == (1,)
    assert config.replace(compile_backend="eager").resolved_compile_sizes(cuda, graphed) == ()
    assert config.replace(compile_sizes=(4, 2)).resolved_compile_sizes(cuda, ()) == (4, 2)
    assert config.replace(compile_sizes=()).resolved_compile_sizes(cuda, graphed) == ()


@pytest.mark.gpu
def test_engine_one_token_build_runs_the_gemv_with_cublas_tokens(monkeypatch, tmp_path):
    """FULL_AND_PIECEWISE on a small bf16 Llama: the one-token graphs record the Triton GEMV
    for every linear layer of the model (a replay runs no Python, so the calls are counted
    while the engine warms up and captures), and greedy decoding gives the same tokens as
    an engine without the pass (cuBLAS).
    """
    from graphattn.kernels import gemv as gemv_module

    seen = set()
    launch = gemv_module.gemv

    def counting(x, weight, *args, **kwargs):
        seen.add((x.shape[0], *weight.shape))
        return launch(x, weight, *args, **kwargs)

    monkeypatch.setattr(gemv_module, "gemv", counting)
    # the head [384, 256] differs from every linear in the graph
    model = small_bf16_llama(384, 256, 512, device="cuda")
    common = dict(
        max_num_seqs=4,
        max_num_tokens=64,
        max_model_len=128,
        num_blocks=32,
        cudagraph_capture_sizes=(1, 2, 4),
        cache_dir=str(tmp_path),
    )
    passes = ("noop_elimination", "unfuse_residual_addmm", "single_row_gemv")
    with_gemv = ga.compile(model, passes=passes, **common)
    assert with_gemv.report.compile["compile_sizes"] == [1]
    # qkv [(4 + 2 * 2) * 64, 256], o [256, 256], gate_up [1024, 256], down [256, 512]
    assert seen == {(1, 512, 256), (1, 256, 256), (1, 1024, 256), (1, 256, 512)}
    seen.clear()
    cublas = ga.compile(model, passes=("noop_elimination", "unfuse_residual_addmm"), **common)
    assert cublas.report.compile["compile_sizes"] == [] and not seen
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    assert with_gemv.generate(prompts, 12) == cublas.generate(prompts, 12)
    assert with_gemv.stats.runtime_modes["FULL"] > 0

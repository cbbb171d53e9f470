"""The single-row GEMV pass: which linear layers it rewrites (ATen graphs with fake CUDA
tensors, so it runs on the CPU), and on a GPU that an engine's one-token build calls the
Triton GEMV and gives the same tokens as cuBLAS.
"""

from __future__ import annotations

import pytest
import torch
from helpers import as_model_inputs, small_bf16_llama
from torch import fx
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import graphattn as ga
from graphattn.passes.single_row_gemv import GEMV_OP, SingleRowGemvPass
from graphattn.passes.split import MODEL_INPUT

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
    return as_model_inputs(make_fx(fn, tracing_mode="fake")(x, w))


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


# -- inputs an earlier piece computes -------------------------------------------------------


def test_only_a_marked_model_input_is_a_weight():
    """A placeholder is a weight only when marked a model input no kernel of the step writes
    (the pass manager marks a piece's); an unmarked one (a value an earlier piece computes,
    possibly still being written when a PDL-launched GEMV reads its first weight tile)
    stays a matmul."""
    gm = _linear_graph((1, 64), (96, 64))
    (_, w) = [n for n in gm.graph.nodes if n.op == "placeholder"]
    del w.meta[MODEL_INPUT]
    assert _rewrites(gm) == 0
    w.meta[MODEL_INPUT] = True
    assert _rewrites(gm) == 1


class ComputedWeightModel(torch.nn.Module):
    """Embedding, qkv, one ga.Attention, then two linears of the attention output: ``o``
    (a parameter) and one whose weight the step computes before the attention (so it
    reaches the piece after the attention as an input computed by the piece before)."""

    def __init__(self, vocab=64, hidden=64):
        super().__init__()
        self.vocab_size, heads, kv_heads, head = vocab, 2, 1, 64
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.qkv = torch.nn.Linear(hidden, (heads + 2 * kv_heads) * head, bias=False)
        self.attn = ga.Attention(heads, head, head**-0.5, kv_heads, prefix="attn")
        self.o = torch.nn.Linear(heads * head, hidden, bias=False)
        self.side = torch.nn.Linear(heads * head, 32, bias=False)
        self.sizes = (heads * head, kv_heads * head, kv_heads * head)

    def forward(self, input_ids, positions):
        h = self.embed(input_ids)
        side_weight = self.side.weight * 2  # computed in the piece before the attention
        q, k, v = self.qkv(h).split(self.sizes, -1)
        a = self.attn(q, k, v)
        return torch.cat([self.o(a), torch.nn.functional.linear(a, side_weight)], -1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_model_keeps_a_computed_weight_on_cublas(monkeypatch, tmp_path, device):
    """Compiled by Inductor (on the CPU with the GEMV pass let onto it; on the GPU with
    FULL_AND_PIECEWISE graphs): the one-token build runs the GEMV for qkv and o, whose
    weights are parameters, but never for the linear whose weight the piece before the
    attention computes; the pieces' inputs say which is which, also when the trace comes
    from the trace cache, and the output matches an engine without the pass."""
    from graphattn.kernels import gemv as gemv_module
    from graphattn.passes import single_row_gemv

    if device == "cpu":
        monkeypatch.setattr(single_row_gemv, "GEMV_DEVICES", ("cuda", "cpu"))
    seen = []
    launch = gemv_module.gemv

    def counting(x, weight, *args, **kwargs):
        seen.append(tuple(weight.shape))
        return launch(x, weight, *args, **kwargs)

    monkeypatch.setattr(gemv_module, "gemv", counting)
    torch.manual_seed(0)
    model = ComputedWeightModel().to(device, BF16)
    common = dict(
        max_num_seqs=2, max_num_tokens=16, max_model_len=64, num_blocks=8, compile_sizes=(1,)
    )  # fmt: skip
    if device == "cpu":
        common.update(cudagraph_mode="NONE", attention_backend="TORCH_REF")
    else:
        common.update(
            cudagraph_mode="FULL_AND_PIECEWISE",
            cudagraph_capture_sizes=(1, 2),
            attention_backend="TRITON",
        )
    passes = ("noop_elimination", "single_row_gemv")
    with_gemv = ga.compile(model, passes=passes, cache_dir=str(tmp_path / "gemv"), **common)
    plain = ga.compile(
        model, passes=("noop_elimination",), cache_dir=str(tmp_path / "mm"), **common
    )
    again = ga.compile(model, passes=passes, cache_dir=str(tmp_path / "gemv"), **common)
    assert again.report.compile["trace_source"] == "trace cache"  # split_graph_of on a load
    for engine in (with_gemv, again):
        after_attention = engine.compiled.pieces[-1].piece.module
        inputs = [n for n in after_attention.graph.nodes if n.op == "placeholder"]
        # o's weight only: the attention output and the side weight are computed in the step
        (marked,) = [n.name for n in inputs if n.meta.get(MODEL_INPUT)]
        assert "_o_" in marked and "weight" in marked, marked
    prompt = ga.Request(list(range(1, 6)), 0, [0])
    for engine in (with_gemv, plain):
        engine.step(ga.Batch.from_requests([prompt]))
    if device == "cpu":
        seen.clear()
    step = ga.Batch.from_requests([ga.Request([7], 5, [0])])
    got = with_gemv.step(step)
    # o and qkv (on the GPU, as the engines captured them); never the side weight [32, 128]
    assert set(seen) == {(64, 128), (256, 64)}
    if device == "cpu":
        assert len(seen) == 2
    else:
        assert with_gemv.stats.runtime_modes["FULL"] == 1
    torch.testing.assert_close(got, plain.step(step), rtol=2e-2, atol=2e-2)

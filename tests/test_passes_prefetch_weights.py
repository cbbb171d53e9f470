"""The opt-in ``prefetch_next_weight`` pass and the GEMV's L2 prefetch: which GEMV it rewrites
(ATen graphs with fake CUDA tensors, so on the CPU), a compiled model using it, and on a GPU
that the hints change no result. The addresses the kernel asks for are checked in
test_pdl.py, under the interpreter.
"""

from __future__ import annotations

import collections

import pytest
import torch
from test_passes_prologue_gemv import _graph, _norm

import graphattn as ga
from graphattn.errors import ConfigError
from graphattn.kernels import gemv as gemv_kernels
from graphattn.kernels.gemv import gemv
from graphattn.passes.pass_manager import DEFAULT_PASSES, make_pass_manager
from graphattn.passes.prefetch_weights import GEMV_PREFETCH_OP, PrefetchNextWeightPass
from graphattn.passes.single_row_gemv import GEMV_OP

ops = torch.ops.graphattn
PASSES = ("rms_norm_gemv", "single_row_gemv", "prefetch_next_weight")


def _attention_then_mlp(attn, residual, norm_w, w_o, w_gu):  # [1, 4, 16], [1, 64], [64], ...
    """A layer after its attention op: o_proj of the attention output (a piece input),
    then add + norm and gate_up."""
    o = torch.nn.functional.linear(attn.view(1, 64), w_o)
    h = o + residual
    return torch.nn.functional.linear(_norm(h, norm_w), w_gu), h


def _rewrite(gm, passes=PASSES) -> collections.Counter:
    make_pass_manager(passes)(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return collections.Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def _placeholders(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def test_o_proj_asks_for_the_next_weight():
    gm = _graph(_attention_then_mlp, (1, 4, 16), (1, 64), (64,), (64, 64), (128, 64))
    targets = _rewrite(gm)
    assert targets[GEMV_PREFETCH_OP] == 1 and targets[GEMV_OP] == 0
    assert targets[ops.add_rms_norm_gemv.default] == 1  # gate_up, untouched
    (call,) = [n for n in gm.graph.nodes if n.target is GEMV_PREFETCH_OP]
    w_o, w_gu = _placeholders(gm)[3:]
    assert call.args[1] is w_o and call.args[2] is w_gu
    assert call.args[3] == 128 * 64 * 2  # all of gate_up's weight: under the 16 MiB budget
    assert call.meta["val"].shape == (1, 64)


def test_the_budget_caps_the_bytes_and_zero_turns_the_rewrite_off(monkeypatch):
    monkeypatch.setenv("GRAPHATTN_PREFETCH_MIB", "1")
    gm = _graph(_attention_then_mlp, (1, 4, 16), (1, 64), (64,), (64, 64), (16384, 64))
    assert _rewrite(gm)[GEMV_PREFETCH_OP] == 1
    (call,) = [n for n in gm.graph.nodes if n.target is GEMV_PREFETCH_OP]
    assert call.args[3] == 1 << 20  # 1 MiB of the 2 MiB weight
    monkeypatch.setenv("GRAPHATTN_PREFETCH_MIB", "0")
    gm = _graph(_attention_then_mlp, (1, 4, 16), (1, 64), (64,), (64, 64), (128, 64))
    assert _rewrite(gm)[GEMV_PREFETCH_OP] == 0


@pytest.mark.parametrize("raw", ["-1", "two", "1.5"])
def test_a_bad_amount_is_a_config_error(monkeypatch, raw):
    monkeypatch.setenv("GRAPHATTN_PREFETCH_MIB", raw)
    with pytest.raises(ConfigError, match="GRAPHATTN_PREFETCH_MIB must be an int >= 0"):
        PrefetchNextWeightPass().uuid()


def test_the_amount_is_part_of_the_uuid(monkeypatch):
    monkeypatch.setenv("GRAPHATTN_PREFETCH_MIB", "16")
    sixteen = PrefetchNextWeightPass().uuid()
    monkeypatch.setenv("GRAPHATTN_PREFETCH_MIB", "8")
    assert PrefetchNextWeightPass().uuid() != sixteen


def _mlp(x, w1, w2):  # [1, 64], [128, 64], [64, 128]
    return torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w1)), w2)


def _computed_input(x, w1, w2):
    return torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(torch.relu(x), w1)), w2)


def _last(a, w):
    return torch.nn.functional.linear(a.view(1, 64), w)


@pytest.mark.parametrize(
    "fn, shapes, prefetching",
    [
        # the first GEMV reads a graph input, the second streams after it: 1 of the 2
        (_mlp, ((1, 64), (128, 64), (64, 128)), 1),
        # the first one's input is computed (relu): no program of it runs early, and the
        # second's input is the first's output
        (_computed_input, ((1, 64), (128, 64), (64, 128)), 0),
        # a GEMV of a graph input, with no GEMV after it in the graph
        (_last, ((1, 4, 16), (96, 64)), 0),
    ],
)
def test_only_a_gemv_of_a_piece_input_with_a_gemv_after_it_prefetches(fn, shapes, prefetching):
    gm = _graph(fn, *shapes)
    gemvs = _rewrite(gm, ("single_row_gemv",))[GEMV_OP]
    targets = _rewrite(gm, ("prefetch_next_weight",))
    assert targets[GEMV_PREFETCH_OP] == prefetching
    assert targets[GEMV_OP] == gemvs - prefetching


def test_it_runs_after_single_row_gemv():
    with pytest.raises(ConfigError, match="'single_row_gemv' must come before"):
        make_pass_manager(("prefetch_next_weight", "single_row_gemv"))
    assert "prefetch_next_weight" not in DEFAULT_PASSES  # opt-in until measured


def test_gemv_checks_its_prefetch_and_ignores_it_without_pdl():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 200, generator=gen).to(torch.bfloat16)
    w = torch.randn(50, 200, generator=gen).to(torch.bfloat16)
    nxt = torch.randn(64, 64).to(torch.bfloat16)
    assert torch.equal(gemv(x, w, prefetch=nxt, prefetch_bytes=4096), gemv(x, w))
    with pytest.raises(ValueError, match="without a prefetch tensor"):
        gemv(x, w, prefetch_bytes=10)
    with pytest.raises(ValueError, match="must be contiguous"):
        gemv(x, w, prefetch=nxt.t(), prefetch_bytes=10)
    with pytest.raises(ValueError, match="must be an int >= 0"):
        gemv(x, w, prefetch=nxt, prefetch_bytes=-1)


def _count_gemvs(monkeypatch) -> collections.Counter:
    """Counts the GEMV launches, with and without a prefetch, from now on."""
    calls = collections.Counter()
    launch = gemv_kernels.gemv

    def counting(x, weight, *args, prefetch=None, prefetch_bytes=0, **kwargs):
        calls["prefetch" if prefetch is not None else "plain"] += 1
        return launch(x, weight, *args, prefetch=prefetch, prefetch_bytes=prefetch_bytes, **kwargs)

    monkeypatch.setattr(gemv_kernels, "gemv", counting)
    return calls


@pytest.mark.gpu
def test_gpu_prefetching_gemvs_in_a_cuda_graph_match_plain_ones():
    """A chain of PDL GEMVs, each asking L2 for the next one's weight, captured in a CUDA
    graph: the bits of the same chain without the hints, replay after replay."""
    from graphattn.kernels import pdl

    device = torch.device("cuda", torch.cuda.current_device())
    if not pdl.use_pdl(device):
        pytest.skip("the hints are issued only ahead of a PDL wait (compute capability 9.0)")
    gen = torch.Generator(device=device).manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen, device=device) / k**0.5).bfloat16()
               for n, k in ((2048, 1024), (1024, 2048), (4096, 1024), (1024, 4096))]  # fmt: skip

    def chain(x, hints):
        for i, w in enumerate(weights):
            nxt = weights[(i + 1) % len(weights)]
            x = gemv(
                x, w, prefetch=nxt if hints else None, prefetch_bytes=(1 << 20) if hints else 0
            )
        return x

    x = torch.randn(1, 1024, generator=gen, device=device).bfloat16()
    chain(x, True)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x, True)
    for _ in range(3):
        x.copy_(torch.randn(1, 1024, generator=gen, device=device).bfloat16())
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, chain(x.clone(), False))


@pytest.mark.gpu
def test_gpu_engine_with_the_pass_prefetches_in_o_proj_and_matches(monkeypatch, tmp_path):
    """FULL_AND_PIECEWISE on a small bf16 Llama with the pass: the one-token graphs record
    o_proj as a prefetching GEMV in every layer (counted while the engine captures), and a
    decode step gives the bits of an engine without it."""
    from helpers import small_bf16_llama

    calls = _count_gemvs(monkeypatch)
    model = small_bf16_llama(512, 256, 512, device="cuda", norms_off_one=True)
    common = dict(
        max_num_seqs=4, max_num_tokens=64, max_model_len=128, num_blocks=32,
        cudagraph_capture_sizes=(1, 2, 4),
    )  # fmt: skip
    passes = (*DEFAULT_PASSES, "prefetch_next_weight")
    hinted = ga.compile(model, passes=passes, cache_dir=str(tmp_path / "hinted"), **common)
    assert calls["prefetch"] > 0 and calls["prefetch"] == calls["plain"]  # o_proj and down
    plain = ga.compile(model, cache_dir=str(tmp_path / "plain"), **common)
    prompt = ga.Request(list(range(1, 9)), 0, [0])
    for engine in (hinted, plain):
        engine.step(ga.Batch.from_requests([prompt]))
    step = ga.Batch.from_requests([ga.Request([9], 8, [0])])
    got, want = hinted.step(step), plain.step(step)
    assert hinted.stats.runtime_modes["FULL"] == 1
    assert torch.equal(got, want)


def test_a_compiled_llama_with_the_pass_calls_it_and_starts_warm(monkeypatch, tmp_path):
    """A bf16 Llama compiled by Inductor on the CPU with the GEMV passes allowed there: each
    one-token step's o_proj runs as a prefetching GEMV (the hint itself is skipped off the
    GPU), the output is the bits of an engine without the pass, and a second engine from the
    same cache rebuilds the op from the trace cache without Dynamo."""
    from helpers import small_bf16_llama

    from graphattn.passes import single_row_gemv

    monkeypatch.setattr(single_row_gemv, "GEMV_DEVICES", ("cuda", "cpu"))
    calls = _count_gemvs(monkeypatch)
    model = small_bf16_llama(128, 64, 96, norms_off_one=True)
    common = dict(
        cudagraph_mode="NONE", attention_backend="TORCH_REF", compile_sizes=(1,),
        max_num_seqs=2, max_num_tokens=16, max_model_len=64, num_blocks=16,
    )  # fmt: skip
    passes = (*DEFAULT_PASSES, "prefetch_next_weight")
    hinted = ga.compile(model, passes=passes, cache_dir=str(tmp_path / "hinted"), **common)
    plain = ga.compile(model, cache_dir=str(tmp_path / "plain"), **common)
    warm = ga.compile(model, passes=passes, cache_dir=str(tmp_path / "hinted"), **common)
    assert warm.report.compile["trace_source"] == "trace cache"
    prompt = ga.Request(list(range(1, 9)), 0, [0])
    step = ga.Batch.from_requests([ga.Request([9], 8, [0])])
    outs = []
    for engine in (hinted, plain, warm):
        engine.step(ga.Batch.from_requests([prompt]))
        calls.clear()
        outs.append(engine.step(step))
        # two layers: o_proj (which prefetches with the pass) and down; qkv and gate_up are
        # norm GEMVs, launched by another function
        assert calls == ({"plain": 4} if engine is plain else {"prefetch": 2, "plain": 2})
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[1])

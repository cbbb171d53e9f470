"""The tiny Llama compiled piecewise by ga.compile(compile_backend="inductor") matches the
eager engine (compile_backend="none") on mixed prefill + decode batches: fp32 on the CPU,
bf16 on CUDA (judged against an fp32 eager engine, next to the bf16 eager engine's error).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import make_seqs, rel_err, run_with_prefixes
from hypothesis import given
from hypothesis import strategies as st

import graphattn as ga
from graphattn.models import LlamaConfig, LlamaForCausalLM, init_random_weights

LIMITS = dict(max_num_seqs=16, max_num_tokens=384, num_blocks=128, max_model_len=256)
VOCAB, BLOCK = 512, 16
COMPILE_SIZES = (8,)


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return init_random_weights(LlamaForCausalLM(LlamaConfig.tiny()), seed=1)


def _pair(model, device, dtype, backend, cache_dir, *, ref_dtype=None):
    """(eager engine in ref_dtype or dtype, compiled engine in dtype) on ``device``."""
    common = dict(cudagraph_mode="NONE", attention_backend=backend, **LIMITS)
    ref_model = copy.deepcopy(model).to(device, ref_dtype or dtype)
    ref = ga.compile(ref_model, compile_backend="none", **common)
    compiled = ga.compile(
        copy.deepcopy(model).to(device, dtype),
        compile_backend="inductor",
        compile_sizes=COMPILE_SIZES,
        cache_dir=cache_dir,
        **common,
    )
    return ref, compiled


@pytest.fixture(scope="module")
def cpu_engines(tmp_path_factory):
    cache_dir = str(tmp_path_factory.mktemp("llama-cache"))
    return _pair(_llama(), "cpu", torch.float32, "TORCH_REF", cache_dir)


shapes_strategy = st.lists(
    st.one_of(
        st.tuples(st.integers(0, 60), st.integers(2, 24)),  # a prefill (maybe with a prefix)
        st.tuples(st.integers(1, 60), st.just(1)),  # a decode
    ),
    min_size=1,
    max_size=6,
)


@given(shapes=shapes_strategy, seed=st.integers(0, 2**16))
def test_compiled_llama_matches_the_eager_engine_on_mixed_batches(cpu_engines, shapes, seed):
    ref, compiled = cpu_engines
    seqs = make_seqs(np.random.default_rng(seed), shapes, VOCAB, BLOCK, LIMITS["num_blocks"])
    expected = run_with_prefixes(ref, seqs)
    got = run_with_prefixes(compiled, seqs)
    assert rel_err(got, expected) < 1e-5
    assert compiled.compiled.num_recompiles == 0


def test_compiled_llama_report_and_specialised_size(cpu_engines):
    ref, compiled = cpu_engines
    info = compiled.report.compile
    # 2 layers: 2 * 2 + 1 pieces; the middle piece differs from the first (embedding) and
    # the last (final norm), so all three compiled pieces are distinct graphs
    assert (info["num_pieces"], info["num_compiled_pieces"], info["num_distinct_graphs"]) == (
        5,
        3,
        3,
    )
    assert info["compile_sizes"] == list(COMPILE_SIZES)
    assert all(sorted(p.specialised) == list(COMPILE_SIZES) for p in compiled.compiled.pieces)
    seqs = make_seqs(np.random.default_rng(1), [(0, 5), (9, 1), (30, 1), (3, 1)], VOCAB, BLOCK, 64)
    assert sum(len(s.ids) - s.num_computed for s in seqs) == COMPILE_SIZES[0]
    assert rel_err(run_with_prefixes(compiled, seqs), run_with_prefixes(ref, seqs)) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["TORCH_REF", "TRITON"])
def test_compiled_llama_matches_the_eager_engine_on_cuda_in_bf16(backend, tmp_path):
    model = _llama()
    ref32, compiled = _pair(
        model, "cuda", torch.bfloat16, backend, str(tmp_path), ref_dtype=torch.float32
    )
    eager16 = ga.compile(
        copy.deepcopy(model).to("cuda", torch.bfloat16),
        compile_backend="none",
        cudagraph_mode="NONE",
        attention_backend=backend,
        **LIMITS,
    )
    rng = np.random.default_rng(0)
    for _ in range(8):
        shapes = [(int(c), int(n)) for c, n in zip(rng.integers(0, 60, 5), rng.integers(1, 20, 5))]
        shapes += [(int(c), 1) for c in rng.integers(1, 100, 4)]
        seqs = make_seqs(rng, shapes, VOCAB, BLOCK, LIMITS["num_blocks"])
        expected = run_with_prefixes(ref32, seqs)
        err_compiled = rel_err(run_with_prefixes(compiled, seqs), expected)
        err_eager = rel_err(run_with_prefixes(eager16, seqs), expected)
        assert err_compiled <= 2 * err_eager + 2e-3, (err_compiled, err_eager)
    assert compiled.compiled.num_recompiles == 0
    assert compiled.report.compile["inductor_compiles"] > 0


def _second_engine_from_the_trace_cache(first, device, dtype, **kwargs):
    """A second engine of the same model and settings as ``first`` (a fresh copy of the
    model), built from the trace cache; checked to have run no Dynamo trace.
    """
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    second = ga.compile(copy.deepcopy(_llama()).to(device, dtype), **kwargs)
    info = second.report.compile
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    assert (info["trace_source"], info["trace_seconds"], info["inductor_compiles"]) == (
        "trace cache",
        0.0,
        0,
    )
    assert info["trace_cache"].startswith("loaded ") and info["warm"]
    assert info["cache_key"] == first.report.compile["cache_key"]
    return second


def test_a_second_engine_takes_its_trace_from_the_trace_cache(cpu_engines):
    ref, compiled = cpu_engines
    assert compiled.report.compile["trace_source"] == "dynamo"
    second = _second_engine_from_the_trace_cache(
        compiled,
        "cpu",
        torch.float32,
        cudagraph_mode="NONE",
        attention_backend="TORCH_REF",
        compile_backend="inductor",
        compile_sizes=COMPILE_SIZES,
        cache_dir=compiled.config.cache_dir,
        **LIMITS,
    )
    # the GEMV passes' weight marks are the fresh trace's (the restored graph has no example
    # values: which inputs share memory comes from the model's tensors)
    assert _model_input_marks(second) == _model_input_marks(compiled)
    assert sum(len(marked) for marked in _model_input_marks(second)) > 0
    # and the report says the same: the rotary table (gathered by position, which the rule
    # takes for a view leaving its piece) is the one model tensor no GEMV may take
    for engine in (compiled, second):
        assert engine.report.compile["not_weights"] == {
            "l_model_modules_rotary_emb_buffers_cos_sin_cache_": (
                "submod_0 lets it or a view of it leave the piece"
            )
        }
    seqs = make_seqs(np.random.default_rng(2), [(0, 9), (20, 1), (7, 3)], VOCAB, BLOCK, 64)
    assert rel_err(run_with_prefixes(second, seqs), run_with_prefixes(ref, seqs)) < 1e-5


def _model_input_marks(engine) -> list[list[str]]:
    from graphattn.passes.split import MODEL_INPUT

    return [
        [n.name for n in p.module.graph.find_nodes(op="placeholder") if n.meta.get(MODEL_INPUT)]
        for p in engine.compiled.runtime.split.pieces
    ]


@pytest.mark.gpu
def test_a_second_graph_engine_takes_its_trace_from_the_trace_cache(tmp_path):
    """The trace cache under CUDA graphs: the second engine's graphs replay the same
    builds, so its decode steps give the first engine's outputs exactly.
    """
    kwargs = dict(
        cudagraph_mode="FULL_AND_PIECEWISE",
        attention_backend="TRITON",
        compile_backend="inductor",
        cache_dir=str(tmp_path),
        **LIMITS,
    )
    first = ga.compile(copy.deepcopy(_llama()).to("cuda", torch.bfloat16), **kwargs)
    assert first.report.compile["trace_source"] == "dynamo"
    second = _second_engine_from_the_trace_cache(first, "cuda", torch.bfloat16, **kwargs)
    assert second.resolved_mode == first.resolved_mode
    rng = np.random.default_rng(3)
    prefills = [(0, int(n)) for n in rng.integers(2, 30, 6)]
    decodes = [(int(c), 1) for c in rng.integers(1, 100, 6)]
    for shapes in (prefills, decodes):
        seqs = make_seqs(rng, shapes, VOCAB, BLOCK, LIMITS["num_blocks"])
        torch.testing.assert_close(
            run_with_prefixes(second, seqs), run_with_prefixes(first, seqs), rtol=0, atol=0
        )


@pytest.mark.parametrize(
    "change",
    [
        dict(rms_norm_eps=1e-3),
        dict(rope_theta=500000.0),
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            }
        ),
        dict(tie_word_embeddings=True),
        dict(attention_bias=True),
    ],
    ids=["eps", "rope-theta", "rope-scaling", "tied-head", "bias"],
)
def test_every_llama_config_change_changes_the_trace_cache_key(change):
    from graphattn.passes.trace_cache import trace_key

    def key(cfg):
        model = init_random_weights(LlamaForCausalLM(cfg))
        ids = torch.zeros(8, dtype=torch.long)
        found, why = trace_key({}, model, ids, ids)
        assert found, why
        return found

    base = LlamaConfig.tiny()
    assert key(base) == key(LlamaConfig.tiny())
    assert key(LlamaConfig.tiny(**change)) != key(base)


@pytest.mark.gpu
def test_inductor_kernels_with_pdl_in_graphs_match_the_same_engine_without(tmp_path, monkeypatch):
    """On Hopper the engine's Inductor builds launch their Triton kernels with PDL inside
    CUDA graphs (FULL at the decode sizes, PIECEWISE at the rest): their code waits with
    griddepcontrol, the report says so, and mixed and decode batches come out as close to
    an fp32 eager engine as the same engine's with GRAPHATTN_INDUCTOR_PDL=0. A kernel that
    read what the kernel before it writes without waiting would read the last step's values.
    """
    from graphattn.kernels import pdl

    device = torch.device("cuda", torch.cuda.current_device())
    if not pdl.use_pdl(device):
        pytest.skip(f"graphattn's PDL is {pdl.describe(device)}")
    model = _llama()
    common = dict(attention_backend="TRITON", **LIMITS)
    ref32 = ga.compile(
        copy.deepcopy(model).to("cuda", torch.float32),
        compile_backend="none",
        cudagraph_mode="NONE",
        **common,
    )
    engines = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("GRAPHATTN_INDUCTOR_PDL", setting)
        engines[setting] = ga.compile(
            copy.deepcopy(model).to("cuda", torch.bfloat16),
            cudagraph_mode="FULL_AND_PIECEWISE",
            cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32],
            cache_dir=str(tmp_path / "cache"),
            debug_dump_path=str(tmp_path / f"dump-{setting}"),
            **common,
        )
    on, off = engines["1"], engines["0"]
    assert (
        on.report.kernels["inductor_pdl"]
        == "on (graphattn's builds set Inductor's triton.enable_pdl)"
    )
    assert off.report.kernels["inductor_pdl"] == "off: GRAPHATTN_INDUCTOR_PDL=0"
    assert on.report.compile["cache_key"] != off.report.compile["cache_key"]

    def inductor_code(setting):
        return "\n".join(p.read_text() for p in (tmp_path / f"dump-{setting}").rglob("*.py"))

    assert "gdc_wait()" in inductor_code("1") and "gdc_wait()" not in inductor_code("0")
    rng = np.random.default_rng(3)
    for step in range(10):
        if step % 2:  # decodes only: a FULL graph
            shapes = [(int(c), 1) for c in rng.integers(1, 120, int(rng.integers(1, 17)))]
        else:  # prefills and decodes: PIECEWISE (or eager past the capture sizes)
            shapes = [
                (int(c), int(n)) for c, n in zip(rng.integers(0, 60, 3), rng.integers(2, 9, 3))
            ]
            shapes += [(int(c), 1) for c in rng.integers(1, 100, 3)]
        seqs = make_seqs(rng, shapes, VOCAB, BLOCK, LIMITS["num_blocks"])
        expected = run_with_prefixes(ref32, seqs)
        err_on = rel_err(run_with_prefixes(on, seqs), expected)
        err_off = rel_err(run_with_prefixes(off, seqs), expected)
        assert err_on <= 1.5 * err_off + 1e-3, (step, err_on, err_off)
    for engine in engines.values():
        assert engine.stats.captures_after_startup == 0
        assert set(engine.stats.runtime_modes) >= {"FULL", "PIECEWISE"}

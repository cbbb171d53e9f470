"""Capture and padded replay on CUDA: every mode, TRITON (ALWAYS) and TORCH_REF (NEVER).

Each graph engine is checked against an eager engine (no compilation, no graphs) with the
same backend on hypothesis-drawn batches: pure decodes, mixed prefill/decode batches,
sizes between captured sizes and above the largest. Outputs and the KV cache slots a step
writes must agree, with zero recompiles and no capture after start-up; debug=True makes
every replay check that its inputs sit at the captured addresses.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
from helpers import Seq, prefill_prefixes, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

import graphattn as ga
from graphattn.models import LlamaConfig, LlamaForCausalLM, init_random_weights

pytestmark = pytest.mark.gpu

M = ga.CUDAGraphMode
SIZES = [1, 2, 4, 8, 16, 24, 32]  # largest 32: a 40-request decode batch runs without graphs
LIMITS = dict(max_num_seqs=48, max_num_tokens=256, max_model_len=256, num_blocks=512, block_size=16)
# What each requested mode resolves to for a backend of that support level.
RESOLVED = {
    "TRITON": {m: m for m in M},
    "TORCH_REF": {
        M.NONE: M.NONE,
        M.PIECEWISE: M.PIECEWISE,
        M.FULL: None,
        M.FULL_DECODE_ONLY: M.PIECEWISE,
        M.FULL_AND_PIECEWISE: M.PIECEWISE,
    },
}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig.tiny(
        num_hidden_layers=3,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    return init_random_weights(LlamaForCausalLM(cfg), seed=2).to("cuda", torch.bfloat16)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("compile-cache"))


_ENGINES: dict = {}


def _engines(model, cache_dir, backend, mode, staging="kernel"):
    """(reference, graph engine) for backend x mode, built once per module (``staging``:
    GRAPHATTN_INPUT_STAGING while the graph engine is built)."""
    key = (backend, mode, staging)
    if key not in _ENGINES:
        ref = ga.compile(
            copy.deepcopy(model),
            cudagraph_mode="NONE",
            compile_backend="none",
            attention_backend=backend,
            **LIMITS,
        )
        saved = os.environ.get("GRAPHATTN_INPUT_STAGING")
        os.environ["GRAPHATTN_INPUT_STAGING"] = staging
        try:
            eng = ga.compile(
                copy.deepcopy(model),
                cudagraph_mode=mode,
                compile_backend="inductor",
                attention_backend=backend,
                cudagraph_capture_sizes=SIZES,
                debug=True,
                cache_dir=cache_dir,
                **LIMITS,
            )
        finally:
            if saved is None:
                del os.environ["GRAPHATTN_INPUT_STAGING"]
            else:
                os.environ["GRAPHATTN_INPUT_STAGING"] = saved
        _ENGINES[key] = (ref, eng)
    return _ENGINES[key]


BATCH_KIND = st.sampled_from(["decode", "mixed", "between", "above"])


@st.composite
def batches(draw):
    """(kind, shapes): (num_computed, num_new) per request."""
    kind = draw(BATCH_KIND)
    if kind == "decode":
        n = draw(st.sampled_from([1, 2, 4, 8, 16, 32]))
    elif kind == "between":
        n = draw(st.sampled_from([3, 5, 7, 13, 20, 31]))
    elif kind == "above":
        n = draw(st.integers(33, 48))
    else:
        n = draw(st.integers(1, 6))
    if kind == "mixed":
        shapes = [(draw(st.integers(0, 90)), draw(st.integers(2, 20))) for _ in range(n)]
        shapes += [(draw(st.integers(1, 120)), 1) for _ in range(draw(st.integers(0, 6)))]
    else:
        shapes = [(draw(st.integers(1, 200)), 1) for _ in range(n)]
    return kind, draw(st.permutations(shapes)), draw(st.integers(0, 2**16))


def _seqs(shapes, seed):
    rng = np.random.default_rng(seed)
    blocks = rng.permutation(LIMITS["num_blocks"]).tolist()
    seqs, start = [], 0
    for c, n in shapes:
        need = -(-(c + n) // 16)
        seqs.append(Seq(rng.integers(0, 512, c + n).tolist(), c, blocks[start : start + need]))
        start += need
    return seqs


def _step_both(ref, eng, seqs):
    for e in (ref, eng):
        prefill_prefixes(e, seqs)
    batch = ga.Batch.from_requests([s.request() for s in seqs])
    return ref.step(batch), eng.step(batch)


def _written_slots(seqs):
    return torch.tensor(
        [
            b * 16 + p % 16
            for s in seqs
            for b, p in ((s.blocks[p // 16], p) for p in range(len(s.ids)))
        ],
        device="cuda",
    )


@pytest.mark.parametrize("backend", ["TRITON", "TORCH_REF"])
@pytest.mark.parametrize("mode", list(M), ids=str)
def test_graph_engine_matches_eager_engine(model, cache_dir, backend, mode):
    _check_graph_engine(model, cache_dir, backend, mode)


@pytest.mark.parametrize("mode", [M.FULL, M.FULL_AND_PIECEWISE], ids=str)
def test_copy_staging_engine_matches_eager_engine(model, cache_dir, mode):
    """GRAPHATTN_INPUT_STAGING=copies: the full graphs start with three copies instead of the
    staging kernel (the default); decodes, mixed batches (reordered: the output index too)
    and padding as above."""
    _check_graph_engine(model, cache_dir, "TRITON", mode, staging="copies")


def _check_graph_engine(model, cache_dir, backend, mode, staging="kernel"):
    expected_mode = RESOLVED[backend][mode]
    if expected_mode is None:
        with pytest.raises(ga.CUDAGraphModeError, match="TORCH_REF supports NEVER"):
            ga.compile(model, cudagraph_mode=mode, attention_backend=backend, **LIMITS)
        return
    ref, eng = _engines(model, cache_dir, backend, mode, staging)
    assert eng.resolved_mode == expected_mode
    assert bool(eng.report.fallbacks) == (expected_mode != mode)

    @settings(max_examples=25, deadline=None)
    @given(case=batches())
    def check(case):
        kind, shapes, seed = case
        seqs = _seqs(shapes, seed)
        for e in (ref, eng):
            prefill_prefixes(e, seqs)
        before = dict(eng.stats.runtime_modes)
        batch = ga.Batch.from_requests([s.request() for s in seqs])
        out_ref, out = ref.step(batch), eng.step(batch)
        assert out.shape == out_ref.shape
        assert rel_err(out, out_ref) < 2e-2, kind
        slots = _written_slots(seqs)
        for name, cache in eng.kv_cache.tensors.items():
            a = cache.flatten(1, 2)[:, slots]  # [2, S, Hkv, D]
            b = ref.kv_cache.tensors[name].flatten(1, 2)[:, slots]
            assert rel_err(a, b) < 2e-2, name
        ran = [m for m, n in eng.stats.runtime_modes.items() if n != before.get(m, 0)]
        expected = _expected_runtime(eng.resolved_mode, kind, batch.num_tokens)
        assert ran == [expected], (kind, batch.num_tokens, ran)

    check()
    assert eng.stats.recompiles == 0
    assert eng.stats.captures_after_startup == 0
    if expected_mode != M.NONE:
        assert eng.stats.fallbacks.get("batch above the largest capture size", 0) >= 0


def _expected_runtime(mode, kind, num_tokens):
    if mode == M.NONE or num_tokens > max(SIZES):
        return "NONE"
    if kind in ("decode", "between") and mode.decode_mode() == M.FULL:
        return "FULL"
    if kind == "mixed" and mode.mixed_mode() == M.FULL:
        return "FULL"
    inner = mode.decode_mode() if kind != "mixed" else mode.mixed_mode()
    return inner.name if inner != M.FULL else "FULL"


def test_report_shows_capture(model, cache_dir):
    _, eng = _engines(model, cache_dir, "TRITON", M.FULL_AND_PIECEWISE)
    cap = eng.report.capture
    assert cap["sizes"] == {"FULL": SIZES, "PIECEWISE": SIZES}
    assert cap["full_graphs"] == {"uniform decode": SIZES}  # mixed batches run piecewise
    assert cap["graphs"] > 0 and cap["seconds"] > 0 and cap["graph_memory_mib"] >= 0
    # graphattn's kernels compile on a pool before the warm-ups after a cold compile, and
    # not after a warm one (kernels/precompile.py; the module's engines share a cache)
    pre = cap["kernel_precompile"]
    if eng.report.compile["warm"]:
        assert pre["status"].startswith("skipped: a warm compile"), pre
    else:
        assert pre["status"] == "on" and pre["launches"] > 0, pre
    assert eng.report.compile["num_pieces"] == 2 * 3 + 1  # 3 layers: 3 attention + 4 compiled


def test_above_largest_size_is_counted_not_printed(model, cache_dir, capsys):
    ref, eng = _engines(model, cache_dir, "TRITON", M.FULL_AND_PIECEWISE)
    seqs = _seqs([(10, 1)] * 40, 7)
    for e in (ref, eng):
        prefill_prefixes(e, seqs)
    before = eng.stats.fallbacks["batch above the largest capture size"]
    batch = ga.Batch.from_requests([s.request() for s in seqs])
    ref.step(batch), eng.step(batch)
    assert eng.stats.fallbacks["batch above the largest capture size"] == before + 1
    assert "largest" not in capsys.readouterr().out


@pytest.mark.parametrize("mode", [M.PIECEWISE, M.FULL_AND_PIECEWISE], ids=str)
def test_update_op_inside_pieces_writes_every_step(model, cache_dir, mode):
    """splitting_ops without the KV-update op put the update inside the captured pieces.
    Pieces captured on all-decode synthetic batches must still write the cache when a
    prefill of their padded size replays them, and decode graphs must write too.
    """
    ref, _ = _engines(model, cache_dir, "TRITON", M.NONE)
    eng = ga.compile(
        copy.deepcopy(model),
        cudagraph_mode=mode,
        compile_backend="inductor",
        attention_backend="TRITON",
        cudagraph_capture_sizes=SIZES,
        splitting_ops=("graphattn::unified_attention_with_output",),
        cache_dir=cache_dir,
        **LIMITS,
    )
    for i, shapes in enumerate(
        [[(0, 3), (0, 5)], [(3, 1), (5, 1), (40, 1)], [(10, 4), (20, 1), (0, 2)], [(7, 1)] * 8]
    ):
        seqs = _seqs(shapes, 100 + i)
        out_ref, out = _step_both(ref, eng, seqs)
        assert rel_err(out, out_ref) < 2e-2, shapes
        slots = _written_slots(seqs)
        for name, cache in eng.kv_cache.tensors.items():
            a = cache.flatten(1, 2)[:, slots]
            b = ref.kv_cache.tensors[name].flatten(1, 2)[:, slots]
            assert rel_err(a, b) < 2e-2, (shapes, name)
    assert eng.stats.recompiles == 0 and eng.stats.captures_after_startup == 0
    assert eng.stats.runtime_modes.get("PIECEWISE", 0) > 0


def _decode_seqs(n, seed):
    """n decode requests with distinct prompts (prefilled in each engine by the caller)."""
    return _seqs([(int(c), 1) for c in np.random.default_rng(seed).integers(5, 150, n)], seed)


def _record_copies(engine, monkeypatch):
    """The (tokens, requests) of every copy_to_device call the engine's runner makes."""
    calls = []
    original = engine.runner.buffers.copy_to_device
    monkeypatch.setattr(
        engine.runner.buffers, "copy_to_device", lambda *a: (calls.append(a), original(*a))
    )
    return calls


def test_full_steps_copy_their_inputs_inside_the_graph(model, cache_dir, monkeypatch):
    """A FULL replay moves the pinned inputs itself: the step makes no copy call, a PIECEWISE
    step makes its one, and both compute what the eager engine does."""
    ref, eng = _engines(model, cache_dir, "TRITON", M.FULL_AND_PIECEWISE)
    assert eng.report.capture["input_copies"] == "inside full graphs"
    calls = _record_copies(eng, monkeypatch)
    for i, (shapes, mode, copies) in enumerate(
        (
            ([(c, 1) for c in (9, 40, 77, 120)], "FULL", 0),
            ([(0, 7), (30, 1)], "PIECEWISE", 1),
            ([(c, 1) for c in (3, 60)], "FULL", 0),
        )
    ):
        seqs = _seqs(shapes, 11 + i)
        for e in (ref, eng):
            prefill_prefixes(e, seqs)
        calls.clear()
        before = eng.stats.runtime_modes[mode]
        batch = ga.Batch.from_requests([s.request() for s in seqs])
        out = eng.step(batch)
        out_ref = ref.step(batch)
        assert eng.stats.runtime_modes[mode] == before + 1
        assert len(calls) == copies, (mode, calls)
        assert rel_err(out, out_ref) < 2e-2, shapes


@pytest.mark.parametrize("staging", ["copies", "kernel"])
def test_full_steps_queued_behind_a_busy_gpu_read_their_own_inputs(model, cache_dir, staging):
    """Steps queued while the GPU is busy: each graph's copies (or staging kernel) read the
    pinned buffers when the GPU reaches them, so the next step must not refill them before
    then."""
    ref, eng = _engines(model, cache_dir, "TRITON", M.FULL_AND_PIECEWISE, staging)
    want = "one kernel" if staging == "kernel" else "three memcpy nodes"
    assert want in eng.report.capture["input_staging"]
    every = _decode_seqs(32, 300)  # disjoint blocks: all prefills happen before any decode
    groups = [every[i : i + 8] for i in range(0, 32, 8)]
    for e in (ref, eng):
        prefill_prefixes(e, every)
    expected = [ref.step(ga.Batch.from_requests([s.request() for s in g])) for g in groups]
    batches = [ga.Batch.from_requests([s.request() for s in seqs]) for seqs in groups]

    def queued_steps():
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU work ahead of every step below
        outs = [eng.step(b) for b in batches]
        torch.cuda.synchronize()
        return [rel_err(out, out_ref) for out, out_ref in zip(outs, expected)]

    before = eng.stats.runtime_modes["FULL"]
    errors = queued_steps()
    assert eng.stats.runtime_modes["FULL"] == before + len(batches)
    assert max(errors) < 2e-2, errors

    # The control: without the wait for the copies-done event, the same steps refill the
    # pinned buffers before the queued graphs copy them, and read another step's inputs.
    class NoWait:
        def synchronize(self):
            pass

        def record(self, stream=None):
            pass

    event, eng.runner._copies_done = eng.runner._copies_done, NoWait()
    try:
        assert max(queued_steps()) > 0.1
    finally:
        eng.runner._copies_done = event


def test_a_builder_using_device_inputs_gets_them_before_build(model, cache_dir, monkeypatch):
    """What ``build`` sees on the device in a FULL step: none when the builder declares that
    replays need no build (TRITON's default); the previous step's lengths when the graph
    copies the inputs (the documented contract), this step's when the builder declares
    uses_device_inputs_in_build, whose engine copies before build."""
    from graphattn.attention.backends.triton_attn import TritonMetadataBuilder

    seen = []
    build = TritonMetadataBuilder.build

    def build_reading_seq_lens(self, common_prefix_len, cam):
        seen.append(cam.seq_lens.clone())  # device work in build, ordered before the replay
        return build(self, common_prefix_len, cam)

    def full_step(eng, seqs):
        for e in (ref, eng):
            prefill_prefixes(e, seqs)
        seen.clear()
        batch = ga.Batch.from_requests([s.request() for s in seqs])
        before = eng.stats.runtime_modes["FULL"]
        out = eng.step(batch)
        built = [lens[: len(seqs)].cpu() for lens in seen]  # before the reference's builds
        assert eng.stats.runtime_modes["FULL"] == before + 1
        assert rel_err(out, ref.step(batch)) < 2e-2
        expected = torch.tensor([len(s.ids) for s in seqs], dtype=torch.int32)
        return built, expected

    ref, inside = _engines(model, cache_dir, "TRITON", M.FULL_AND_PIECEWISE)
    monkeypatch.setattr(TritonMetadataBuilder, "build", build_reading_seq_lens)
    # TRITON's build only fills a Python object, so a FULL replay skips it...
    assert inside.report.capture["metadata_on_full_replays"].startswith("skipped")
    assert full_step(inside, _decode_seqs(6, 399))[0] == []  # no build ran
    # ...and a builder doing device work in build must say a replay needs it
    monkeypatch.setattr(TritonMetadataBuilder, "full_replay_needs_build", True)
    (got,), expected = full_step(inside, _decode_seqs(6, 400))
    assert not torch.equal(got, expected)  # the prefill's lengths: the copy runs in the graph

    monkeypatch.setattr(TritonMetadataBuilder, "uses_device_inputs_in_build", True)
    opted_out = ga.compile(
        copy.deepcopy(model),
        cudagraph_mode=M.FULL_DECODE_ONLY,
        attention_backend="TRITON",
        cudagraph_capture_sizes=[4, 8],
        cache_dir=cache_dir,
        **LIMITS,
    )
    assert opted_out.report.capture["input_copies"] == "before each step"
    assert opted_out.report.capture["metadata_on_full_replays"] == (
        "built each step (TritonMetadataBuilder: full_replay_needs_build)"
    )
    calls = _record_copies(opted_out, monkeypatch)
    (got,), expected = full_step(opted_out, _decode_seqs(6, 401))
    assert torch.equal(got, expected)
    assert calls[-1] == (8, 8)  # the FULL step's own copy, at the key's padded size


@pytest.fixture(scope="module")
def gap_engine(model, cache_dir):
    """FULL_AND_PIECEWISE with sizes that skip past max_num_seqs=48 (1, 2, 4, then 64)."""
    gap = r"decode batches of 5-48 tokens get no full graph under FULL_AND_PIECEWISE"
    with pytest.warns(ga.FallbackWarning, match=gap):
        return ga.compile(
            copy.deepcopy(model),
            cudagraph_mode="FULL_AND_PIECEWISE",
            compile_backend="inductor",
            attention_backend="TRITON",
            cudagraph_capture_sizes=[1, 2, 4, 64],
            cache_dir=cache_dir,
            **LIMITS,
        )


def test_decode_batches_padded_past_max_num_seqs_are_warned_and_counted(
    model, cache_dir, gap_engine
):
    """A decode batch of 6 pads to 64, which has no uniform-decode graph: it runs piecewise,
    right, and counted as a fallback; start-up said so and the report keeps it."""
    ref, _ = _engines(model, cache_dir, "TRITON", M.NONE)
    eng = gap_engine
    assert eng.resolved_mode == M.FULL_AND_PIECEWISE and not eng.report.fallbacks
    assert eng.report.capture["full_graphs"] == {"uniform decode": [1, 2, 4]}
    assert "a capture size of 48 gives them one" in eng.report.capture["decode_gap"]
    seqs = _decode_seqs(6, 41)
    for e in (ref, eng):
        prefill_prefixes(e, seqs)
    modes, fallbacks = dict(eng.stats.runtime_modes), dict(eng.stats.fallbacks)
    batch = ga.Batch.from_requests([s.request() for s in seqs])
    out_ref, out = ref.step(batch), eng.step(batch)
    assert rel_err(out, out_ref) < 2e-2
    assert eng.stats.runtime_modes["PIECEWISE"] == modes.get("PIECEWISE", 0) + 1
    lost = "decode batch without a full graph of its padded size"
    assert eng.stats.fallbacks[lost] == fallbacks.get(lost, 0) + 1
    small = _decode_seqs(3, 42)  # 3 pads to 4: a full graph, no fallback
    for e in (ref, eng):
        prefill_prefixes(e, small)
    batch = ga.Batch.from_requests([s.request() for s in small])
    out_ref, out = ref.step(batch), eng.step(batch)
    assert rel_err(out, out_ref) < 2e-2
    assert eng.stats.runtime_modes["FULL"] == modes.get("FULL", 0) + 1
    assert eng.stats.fallbacks[lost] == fallbacks.get(lost, 0) + 1


def test_a_graph_asked_for_after_start_up_is_refused_and_counted(model, cache_dir, gap_engine):
    """The guarantee behind 'zero captures after start-up': a step routed to a graph that was
    never captured raises, is counted, and leaves the engine able to step on."""
    from graphattn.capture.dispatcher import BatchDescriptor, Dispatch

    ref, _ = _engines(model, cache_dir, "TRITON", M.NONE)
    eng = gap_engine
    assert eng.stats.captures_after_startup == 0
    seqs = _decode_seqs(2, 43)
    for e in (ref, eng):
        prefill_prefixes(e, seqs)
    batch = ga.Batch.from_requests([s.request() for s in seqs])
    planner = eng.runner.planner
    eng.runner.planner = lambda *args: Dispatch(M.FULL, BatchDescriptor(3, 3, True))
    try:
        with pytest.raises(ga.CaptureError, match=r"no FULL graph for .* capture is closed"):
            eng.step(batch)
    finally:
        eng.runner.planner = planner
    assert eng.stats.captures_after_startup == 1
    out_ref, out = ref.step(batch), eng.step(batch)
    assert rel_err(out, out_ref) < 2e-2
    assert eng.stats.captures_after_startup == 1

"""Mode resolution, capture sizes, the dispatcher and padding: the logic of capture/, on the CPU."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from helpers import TableAttentionModel, eager_engine, make_seqs, rel_err
from hypothesis import given
from hypothesis import strategies as st

import graphattn as ga
from graphattn.attention import AttentionCGSupport as S
from graphattn.capture.dispatcher import (
    ABOVE_LARGEST,
    NO_DECODE_GRAPH,
    BatchDescriptor,
    CudagraphDispatcher,
)
from graphattn.capture.manager import describe_decode_gap, summarize_keys
from graphattn.capture.mode import CUDAGraphMode as M
from graphattn.capture.resolve import resolve_cudagraph_mode, resolve_for_engine
from graphattn.capture.sizes import clip_capture_sizes, default_capture_sizes

# requested mode, support, attention split ("P" yes, "-" no, "*" either), decode query
# length ("*" for 1 and 2) -> resolved mode or "error". Written from docs/modes.md's rules by hand.
TABLE = """
NONE               *              * *  NONE
PIECEWISE          *              * *  PIECEWISE
FULL               ALWAYS         * *  FULL
FULL               UNIFORM_BATCH  P *  FULL_AND_PIECEWISE
FULL               UNIFORM_BATCH  - *  FULL_DECODE_ONLY
FULL               SINGLE         P 1  FULL_AND_PIECEWISE
FULL               SINGLE         P 2  PIECEWISE
FULL               SINGLE         - 1  FULL_DECODE_ONLY
FULL               SINGLE         - 2  NONE
FULL               NEVER          * *  error
FULL_DECODE_ONLY   ALWAYS         * *  FULL_DECODE_ONLY
FULL_DECODE_ONLY   UNIFORM_BATCH  * *  FULL_DECODE_ONLY
FULL_DECODE_ONLY   SINGLE         * 1  FULL_DECODE_ONLY
FULL_DECODE_ONLY   SINGLE         P 2  PIECEWISE
FULL_DECODE_ONLY   SINGLE         - 2  NONE
FULL_DECODE_ONLY   NEVER          P *  PIECEWISE
FULL_DECODE_ONLY   NEVER          - *  NONE
FULL_AND_PIECEWISE ALWAYS         * *  FULL_AND_PIECEWISE
FULL_AND_PIECEWISE UNIFORM_BATCH  * *  FULL_AND_PIECEWISE
FULL_AND_PIECEWISE SINGLE         * 1  FULL_AND_PIECEWISE
FULL_AND_PIECEWISE SINGLE         P 2  PIECEWISE
FULL_AND_PIECEWISE SINGLE         - 2  NONE
FULL_AND_PIECEWISE NEVER          P *  PIECEWISE
FULL_AND_PIECEWISE NEVER          - *  NONE
"""
SUPPORT = {
    "ALWAYS": S.ALWAYS,
    "UNIFORM_BATCH": S.UNIFORM_BATCH,
    "SINGLE": S.UNIFORM_SINGLE_TOKEN_DECODE,
    "NEVER": S.NEVER,
}


def _expected_table():
    table = {}
    for line in TABLE.strip().splitlines():
        mode, support, split, q, result = line.split()
        supports = SUPPORT.values() if support == "*" else [SUPPORT[support]]
        splits = [True, False] if split == "*" else [split == "P"]
        qs = [1, 2] if q == "*" else [int(q)]
        for key in itertools.product([M[mode]], supports, splits, qs):
            assert key not in table, f"table lists {key} twice"
            table[key] = result
    return table


EXPECTED = _expected_table()


def test_table_covers_every_combination():
    assert len(EXPECTED) == len(M) * len(S) * 2 * 2


@pytest.mark.parametrize("key", sorted(EXPECTED, key=str), ids=str)
def test_resolution_matches_the_table(key):
    mode, support, split, q = key
    kwargs = dict(
        attention_is_splitting_op=split, uniform_decode_query_len=q, backend_name="MYBACKEND"
    )
    if EXPECTED[key] == "error":
        with pytest.raises(ga.GraphAttnError) as err:
            resolve_cudagraph_mode(mode, support, **kwargs)
        assert isinstance(err.value, ValueError)
        text = str(err.value)
        assert "MYBACKEND" in text and support.name in text and "try cudagraph_mode=" in text
        # the mode to try is one that resolves: PIECEWISE needs the split, NONE does not
        assert f"try cudagraph_mode={'PIECEWISE' if split else 'NONE'}" in text
        assert ("with the model compiled and split at attention" in text) == (
            not split and mode.mixed_mode() == M.FULL
        )
        return
    resolved, records = resolve_cudagraph_mode(mode, support, **kwargs)
    assert resolved == M[EXPECTED[key]]
    assert (resolved != mode) == bool(records)
    if records:  # a chain from the request to the result, each naming backend and support
        assert records[0].requested == mode and records[-1].resolved == resolved
        assert all(r.backend == "MYBACKEND" and r.support == support.name for r in records)
        assert all("batches run" in r.cost for r in records)


def test_fallback_record_says_what_it_costs():
    _, (rec,) = resolve_cudagraph_mode(M.FULL_AND_PIECEWISE, S.NEVER, backend_name="TORCH_REF")
    assert str(rec) == (
        "cudagraph_mode FULL_AND_PIECEWISE -> PIECEWISE (full graphs need a support level above "
        "NEVER): backend TORCH_REF supports NEVER; uniform decode batches run piecewise "
        "(attention eager between graphs)"
    )


def test_default_capture_sizes():
    assert default_capture_sizes(8, 4096) == [1, 2, 4, 8]
    assert default_capture_sizes(100, 4096)[-3:] == [88, 96, 100]
    sizes = default_capture_sizes(512, 300)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-4:] == [256, 272, 288, 300]
    assert all(b - a == 8 for a, b in itertools.pairwise(sizes[3:34]))


def test_user_sizes_sorted_deduplicated_clipped():
    assert clip_capture_sizes([64, 8, 8, 1, 5000], 4096) == ([1, 8, 64], [5000])


@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=12, unique=True),
    num_tokens=st.integers(1, 400),
    max_num_seqs=st.integers(1, 300),
    mode=st.sampled_from([M.PIECEWISE, M.FULL, M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE]),
    decode=st.booleans(),
)
def test_dispatch_pads_to_smallest_captured_size_that_fits(
    sizes, num_tokens, max_num_seqs, mode, decode
):
    num_reqs = (
        min(num_tokens, max_num_seqs) if decode else max(1, min(num_tokens // 3, max_num_seqs))
    )
    uniform = decode and num_reqs == num_tokens
    d = CudagraphDispatcher(mode, sizes, max_num_seqs)
    out = d.dispatch(num_tokens, num_reqs, uniform)
    fitting = [s for s in sizes if s >= num_tokens]
    wanted = mode.decode_mode() if uniform else mode.mixed_mode()
    if not fitting:  # a fallback only for a kind of batch the mode gives graphs
        assert out.mode == M.NONE
        assert out.fallback == (ABOVE_LARGEST if wanted != M.NONE else None)
        return
    # a batch gets less than its mode's kind of graph only as a decode with no full graph
    # of its padded size, and says so
    lost = out.mode != wanted and not (out.mode == M.FULL and mode == M.FULL)
    assert out.fallback == (NO_DECODE_GRAPH if lost else None)
    assert not lost or (uniform and wanted == M.FULL and min(fitting) > max_num_seqs)
    if out.mode == M.NONE:  # only when no graph of the padded size serves this batch
        assert not d.keys[M.PIECEWISE]
        assert not [
            k
            for k in d.keys[M.FULL]
            if k.num_tokens == min(fitting) and (uniform or not k.uniform_decode)
        ]
        return
    key = out.descriptor
    assert key.num_tokens == min(fitting) >= num_tokens
    assert key in d.keys[out.mode]
    if out.mode == M.FULL:
        assert key.num_reqs >= num_reqs
        assert key.uniform_decode == uniform or not key.uniform_decode
    else:
        assert key.num_reqs is None


def test_mixed_batches_above_the_largest_size_under_full_decode_only_lose_nothing():
    # FULL_DECODE_ONLY runs mixed batches without graphs at every size: not a fallback
    d = CudagraphDispatcher(M.FULL_DECODE_ONLY, [1, 2, 4, 8], max_num_seqs=8)
    assert d.dispatch(20, 2, False) == (M.NONE, None, None)
    assert d.dispatch(5, 2, False) == (M.NONE, None, None)
    assert d.dispatch(9, 9, True) == (M.NONE, None, ABOVE_LARGEST)  # a decode would have had one
    for mode in (M.FULL, M.PIECEWISE, M.FULL_AND_PIECEWISE):
        assert CudagraphDispatcher(mode, [1, 2, 4, 8], 8).dispatch(20, 2, False).fallback == (
            ABOVE_LARGEST
        )


@pytest.mark.parametrize(
    "mode, runs", [(M.FULL_AND_PIECEWISE, M.PIECEWISE), (M.FULL_DECODE_ONLY, M.NONE)], ids=str
)
def test_decode_batches_padded_above_max_num_seqs_say_they_lost_their_full_graph(mode, runs):
    """A user's sizes that skip from 8 to 256 past max_num_seqs=128: decode batches of 9-128
    requests pad to 256, which has no uniform-decode graph. They run what mixed batches run,
    each step says why, and start-up says which sizes and what would fix it.
    """
    d = CudagraphDispatcher(mode, [1, 2, 4, 8, 256], max_num_seqs=128)
    assert d.dispatch(8, 8, True) == (M.FULL, BatchDescriptor(8, 8, True), None)
    for n in (9, 100, 128):
        out = d.dispatch(n, n, True)
        assert out.mode == runs and out.fallback == NO_DECODE_GRAPH, n
    assert d.decode_gap() == (9, 128)
    text = describe_decode_gap(d)
    assert text.startswith(f"decode batches of 9-128 tokens get no full graph under {mode}")
    assert "max_num_seqs (128)" in text
    assert ("padded as mixed batches are (from 256)" in text) == (runs == M.PIECEWISE)
    assert f"run {'piecewise' if runs == M.PIECEWISE else 'without graphs'}" in text
    assert text.endswith("a capture size of 128 gives them one")
    fixed = CudagraphDispatcher(mode, [1, 2, 4, 8, 128, 256], max_num_seqs=128)
    assert fixed.decode_gap() is None and describe_decode_gap(fixed) is None
    assert fixed.dispatch(100, 100, True) == (M.FULL, BatchDescriptor(128, 128, True), None)
    # FULL serves those decodes with its mixed graphs of 256: nothing lost, nothing said
    full = CudagraphDispatcher(M.FULL, [1, 2, 4, 8, 256], max_num_seqs=128)
    assert full.dispatch(100, 100, True) == (M.FULL, BatchDescriptor(256, 128, False), None)
    assert full.decode_gap() is None


@given(max_num_seqs=st.integers(1, 600), max_num_tokens=st.integers(1, 8192))
def test_default_sizes_leave_no_decode_gap(max_num_seqs, max_num_tokens):
    sizes = default_capture_sizes(max_num_seqs, max_num_tokens)
    for mode in (M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE):
        assert CudagraphDispatcher(mode, sizes, max_num_seqs).decode_gap() is None


def test_full_decode_only_without_a_decode_size_falls_to_none_and_says_so():
    # FULL_AND_PIECEWISE lowered to FULL_DECODE_ONLY (attention not split) with every size
    # above max_num_seqs would capture nothing: the engine is told, and records each step
    kwargs = dict(has_cuda=True, attention_is_splitting_op=False, backend_name="TRITON")
    mode, records = resolve_for_engine(
        M.FULL_AND_PIECEWISE, S.ALWAYS, has_decode_size=False, **kwargs
    )
    assert mode == M.NONE and [r.resolved for r in records] == [M.FULL_DECODE_ONLY, M.NONE]
    assert str(records[-1]) == (
        "cudagraph_mode FULL_DECODE_ONLY -> NONE (full decode graphs need a capture size <= "
        "max_num_seqs); every batch runs without graphs"
    )
    # a size that fits, or a mode with other graphs, is left alone
    assert resolve_for_engine(M.FULL_AND_PIECEWISE, S.ALWAYS, **kwargs)[0] == M.FULL_DECODE_ONLY
    split = dict(kwargs, attention_is_splitting_op=True)
    for m in (M.FULL, M.FULL_AND_PIECEWISE, M.PIECEWISE):
        assert resolve_for_engine(m, S.ALWAYS, has_decode_size=False, **split) == (m, [])


def test_capture_order_full_first_largest_first():
    d = CudagraphDispatcher(M.FULL_AND_PIECEWISE, [1, 2, 4, 8], max_num_seqs=4)
    assert d.capture_order() == [
        (M.FULL, BatchDescriptor(4, 4, True)),
        (M.FULL, BatchDescriptor(2, 2, True)),
        (M.FULL, BatchDescriptor(1, 1, True)),
        (M.PIECEWISE, BatchDescriptor(8)),
        (M.PIECEWISE, BatchDescriptor(4)),
        (M.PIECEWISE, BatchDescriptor(2)),
        (M.PIECEWISE, BatchDescriptor(1)),
    ]


def test_report_lists_each_size_once_and_what_its_full_graphs_serve():
    # FULL captures a uniform-decode and a mixed graph of each size (up to max_num_seqs
    # requests for the first): the report says so instead of listing sizes twice
    full = summarize_keys(CudagraphDispatcher(M.FULL, [1, 2, 4, 8], max_num_seqs=4).keys)
    assert full == {
        "sizes": {"FULL": [1, 2, 4, 8]},
        "full_graphs": {"uniform decode": [1, 2, 4], "mixed": [1, 2, 4, 8]},
    }
    fap = CudagraphDispatcher(M.FULL_AND_PIECEWISE, [1, 2, 4, 8], 8, uniform_decode_query_len=2)
    assert summarize_keys(fap.keys) == {
        "sizes": {"FULL": [2, 4, 8], "PIECEWISE": [1, 2, 4, 8]},
        "full_graphs": {"uniform decode": [2, 4, 8]},
    }
    assert summarize_keys(CudagraphDispatcher(M.PIECEWISE, [1, 2], 2).keys) == {
        "sizes": {"PIECEWISE": [1, 2]}
    }


@pytest.fixture(scope="module")
def padded_engine():
    """An eager engine whose runner pads as the dispatcher says (no graphs on the CPU)."""
    model = TableAttentionModel(64, 4, 2, 64, seed=5)
    engine = eager_engine(
        model, num_blocks=64, max_num_seqs=8, max_num_tokens=64, max_model_len=256
    )
    d = CudagraphDispatcher(M.FULL, [1, 2, 4, 8, 16, 32, 64], max_num_seqs=8)
    seen = []

    def planner(num_tokens, num_reqs, uniform):
        seen.append(d.dispatch(num_tokens, num_reqs, uniform))
        return seen[-1]

    engine.runner.planner = planner
    return engine, model, seen


@given(
    shape=st.lists(
        st.sampled_from([(0, 5), (9, 1), (3, 1), (0, 13), (20, 3)]), min_size=1, max_size=6
    ),
    seed=st.integers(0, 100),
)
def test_padded_steps_compute_the_real_tokens_and_touch_no_other_slot(padded_engine, shape, seed):
    engine, model, seen = padded_engine
    seqs = make_seqs(np.random.default_rng(seed), shape, 64, 16, 64)
    for s in seqs:
        if s.num_computed:
            engine.step(ga.Batch.from_requests([s.prefix_request()]))
    cache = engine.kv_cache.tensors["layers.0.attn"]
    before = cache.clone()
    out = engine.step(ga.Batch.from_requests([s.request() for s in seqs]))
    plan_key = seen[-1].descriptor
    b = engine.runner.buffers
    t, r = sum(len(s.ids) - s.num_computed for s in seqs), len(seqs)
    assert plan_key.num_tokens >= t
    assert (b.slot_mapping.np[t : plan_key.num_tokens] == -1).all()  # padding: slot -1 only
    assert (b.slot_mapping.np[:t] >= 0).all()
    assert (b.seq_lens.np[r : plan_key.num_reqs] == 0).all()
    expected = torch.cat([model.expected(s.ids, len(s.ids) - s.num_computed) for s in seqs])
    assert rel_err(out, expected) < 1e-5
    written = {int(x) for x in b.slot_mapping.np[:t]}
    slots_changed = (cache != before).reshape(2, cache.shape[1] * cache.shape[2], -1).any(-1).any(0)
    changed = slots_changed.nonzero().flatten().tolist()
    assert set(changed) <= written  # nothing but the real tokens' slots changed


def test_metadata_follows_the_graph_not_the_capture_batch(padded_engine):
    """What a capture records must hold for every batch replayed through it: a FULL graph
    for mixed batches says uniform_decode=False even though its synthetic capture batch is
    all decodes; PIECEWISE never lets attention take over the KV-cache write (the update op
    may sit in a captured piece); each eager warm-up sees the metadata its capture will.
    """
    engine, _, _ = padded_engine
    runner = engine.runner
    seen: list[tuple[bool, bool, bool, int]] = []

    def record(plan, *, capturing=False):
        cam = runner.common_metadata(plan)[0]
        seen.append((capturing, cam.uniform_decode, cam.fuse_kv_update, cam.max_query_len))

    keys = [
        (M.FULL, BatchDescriptor(4, 4, False)),
        (M.FULL, BatchDescriptor(4, 4, True)),
        (M.PIECEWISE, BatchDescriptor(4)),
    ]
    runner.run = record  # no CUDA here: record each run's metadata instead of running
    try:
        runner.capture_graphs(keys)
    finally:
        del runner.run
    warmups, captures = seen[0::2], seen[1::2]
    assert [w[0] for w in warmups] == [False] * 3 and [c[0] for c in captures] == [True] * 3
    assert [w[1:] for w in warmups] == [c[1:] for c in captures]
    assert [c[1:3] for c in captures] == [(False, True), (True, True), (True, False)]
    assert all(c[3] == 1 for c in captures)  # every capture batch really was all decodes
    # a step's own metadata: a decode batch planned onto a uniform-decode FULL key
    batch = ga.Batch.from_requests([ga.Request([1], 3, [0]), ga.Request([2], 5, [1])])
    cam = runner.common_metadata(runner.prepare_inputs(batch))[0]
    assert cam.uniform_decode and cam.fuse_kv_update


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: records what happened while capturing."""

    log: list[str] = []

    def capture_begin(self, pool=None):
        self.log.append("capture_begin")

    def capture_end(self):
        self.log.append("capture_end")

    def replay(self):
        self.log.append("replay")


def test_wrapper_prologue_is_captured_never_called_outside_a_capture(monkeypatch):
    """The prologue (the runner's input copies) runs between capture_begin and the model,
    once per key, and what it returns after the model, before capture_end (the runner joins
    its event branch there); a replay and a call-through (another runtime mode) run neither."""
    from graphattn.attention import set_forward_context
    from graphattn.capture.wrapper import CaptureState, CUDAGraphWrapper

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    log = _FakeGraph.log = []
    state = object.__new__(CaptureState)  # no CUDA pool or stream: nothing here needs them
    state.pool, state.debug, state.open, state.num_graphs = None, False, True, 0

    def model(x):
        log.append("model")
        return x + 1

    def prologue(key):
        log.append(f"prologue {key.num_tokens}")
        return lambda: log.append(f"finish {key.num_tokens}")

    state.refused = 0
    wrapper = CUDAGraphWrapper(model, M.FULL, state, prologue=prologue)
    key = BatchDescriptor(8, 8, True)
    x = torch.zeros(8)
    with set_forward_context(None, key, M.FULL, layers={}):
        wrapper(x)
    assert log == ["capture_begin", "prologue 8", "model", "finish 8", "capture_end"]
    state.open = False
    for mode, expected in ((M.FULL, ["replay"]), (M.PIECEWISE, ["model"]), (M.NONE, ["model"])):
        log.clear()
        with set_forward_context(None, key, mode, layers={}):
            wrapper(x)
        assert log == expected, mode
    assert state.num_graphs == 1 and state.refused == 0


def test_a_graph_asked_for_after_start_up_is_refused_and_counted(monkeypatch):
    from graphattn.attention import set_forward_context
    from graphattn.capture.wrapper import CaptureState, CUDAGraphWrapper

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    _FakeGraph.log = []
    state = object.__new__(CaptureState)
    state.pool, state.debug, state.open, state.num_graphs, state.refused = None, False, False, 0, 0
    wrapper = CUDAGraphWrapper(lambda x: x + 1, M.FULL, state, name="model")
    closed = r"model: no FULL graph for .*capture is closed"
    key = BatchDescriptor(3, 3, True)
    with (
        set_forward_context(None, key, M.FULL, layers={}),
        pytest.raises(ga.CaptureError, match=closed),
    ):
        wrapper(torch.zeros(3))
    assert state.refused == 1 and state.num_graphs == 0 and _FakeGraph.log == []


@pytest.mark.parametrize(
    "ops, split",
    [
        (None, True),
        (("graphattn::unified_attention_with_output",), True),
        (("graphattn::unified_attention_with_output.default",), True),
        (
            (
                "graphattn::unified_attention_with_output.default",
                "graphattn::unified_kv_cache_update.default",
            ),
            True,
        ),
        (("graphattn::unified_kv_cache_update",), False),
        ((), False),
    ],
)
def test_the_engine_reads_splitting_ops_as_the_splitter_does(ops, split):
    """An overload name splits the model (passes/split.py), so the mode negotiation must
    count it as split too; it used to lower PIECEWISE to NONE with a false reason.
    """
    from types import SimpleNamespace

    from graphattn.engine import CompiledModel

    config = ga.CompileConfig(splitting_ops=ops, compile_backend="inductor")
    assert CompiledModel._attention_is_split(SimpleNamespace(config=config)) is split
    none = ga.CompileConfig(splitting_ops=ops, compile_backend="none")
    assert CompiledModel._attention_is_split(SimpleNamespace(config=none)) is False

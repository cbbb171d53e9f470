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
from graphattn.capture.dispatcher import ABOVE_LARGEST, BatchDescriptor, CudagraphDispatcher
from graphattn.capture.manager import summarize_keys
from graphattn.capture.mode import CUDAGraphMode as M
from graphattn.capture.resolve import resolve_cudagraph_mode
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
    if not fitting:
        assert out.mode == M.NONE and out.fallback == ABOVE_LARGEST
        return
    if out.mode == M.NONE:  # only when no graph of the padded size serves this batch
        assert not d.keys[M.PIECEWISE] and out.fallback is None
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

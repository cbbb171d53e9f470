"""What graphattn guarantees about the classic CUDA-graph pitfalls (each needs CUDA).

- A step's output is never overwritten by a later replay (unless the caller asks for it in
  place with ``clone=False``).
- Host scalars are not frozen at capture: a graph replayed for a batch with other lengths
  and other token counts (padded to the same size) computes that batch.
- Host synchronization inside a captured region is a CaptureError at start-up that says
  what went wrong, never a hang or a silently wrong graph.
- Capture after start-up is an error; nothing captures lazily at serve time.
- Inputs and weights are read by address: debug mode checks both at every replay.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import TableAttentionModel, make_seqs, rel_err

import graphattn as ga
from graphattn.attention import AttentionCGSupport
from graphattn.attention.backends.torch_ref import TorchRefBackend, TorchRefMetadataBuilder

pytestmark = pytest.mark.gpu
LIMITS = dict(max_num_seqs=16, max_num_tokens=1024, max_model_len=256, num_blocks=128)


@pytest.fixture(scope="module")
def full_engine():
    # the served model never moves after capture (graphs read its weights by address); the
    # float copy on the CPU computes the expected outputs
    model = TableAttentionModel(64, 8, 2, 64, seed=3).to(torch.bfloat16)
    reference = copy.deepcopy(model).float()
    model.to("cuda")
    eng = ga.compile(
        model,
        cudagraph_mode="FULL_DECODE_ONLY",
        compile_backend="none",
        attention_backend="TRITON",
        cudagraph_capture_sizes=[4, 8],
        debug=True,
        **LIMITS,
    )
    return eng, reference


def _decode_batch(seqs):
    return ga.Batch.from_requests([s.request() for s in seqs])


def _prefill(eng, seqs):
    eng.step(ga.Batch.from_requests([s.prefix_request() for s in seqs]))


def test_output_survives_the_next_replay(full_engine):
    eng, _ = full_engine
    import numpy as np

    a = make_seqs(np.random.default_rng(1), [(20, 1)] * 3, 64, 16, 64)
    _prefill(eng, a)
    out_a = eng.step(_decode_batch(a))
    kept = out_a.clone()
    b = make_seqs(np.random.default_rng(2), [(30, 1)] * 3, 64, 16, 64)
    _prefill(eng, b)
    eng.step(_decode_batch(b))  # same padded size: the same graph replays
    assert eng.stats.runtime_modes["FULL"] >= 2
    assert torch.equal(out_a, kept)


def test_clone_false_returns_the_graph_output_in_place(full_engine):
    """The opt-out: the rows come back in the graph's memory, which a later replay (here
    one of the same graph) overwrites, and they match what the default returns."""
    import numpy as np

    eng, _ = full_engine
    a = make_seqs(np.random.default_rng(6), [(24, 1)] * 3, 64, 16, 64)
    _prefill(eng, a)
    in_place = eng.step(_decode_batch(a), clone=False)
    kept = in_place.clone()
    b = make_seqs(np.random.default_rng(7), [(40, 1)] * 3, 64, 16, 64)
    _prefill(eng, b)
    full_before = eng.stats.runtime_modes["FULL"]
    out_b = eng.step(_decode_batch(b))  # same padded size: the same graph replays
    assert eng.stats.runtime_modes["FULL"] == full_before + 1
    assert torch.equal(in_place, out_b)  # overwritten by b's rows
    assert not torch.equal(kept, out_b)
    again = eng.step(_decode_batch(b), clone=False)
    assert again.data_ptr() == in_place.data_ptr()
    assert torch.equal(again, out_b)


def test_host_scalars_are_not_frozen_at_capture(full_engine):
    """Batches of 5, 6 and 8 decodes with different lengths all replay the 8-token graph."""
    import numpy as np

    eng, reference = full_engine
    for n, ctx, seed in ((5, 17, 3), (6, 90, 4), (8, 33, 5)):
        seqs = make_seqs(np.random.default_rng(seed), [(ctx + i, 1) for i in range(n)], 64, 16, 64)
        _prefill(eng, seqs)
        full_before = eng.stats.runtime_modes["FULL"]
        out = eng.step(_decode_batch(seqs))
        assert eng.stats.runtime_modes["FULL"] == full_before + 1
        expected = torch.cat([reference.expected(s.ids, 1) for s in seqs])
        assert rel_err(out, expected) < 2e-2


class _SyncingBuilder(TorchRefMetadataBuilder):
    cudagraph_support = AttentionCGSupport.ALWAYS  # a false claim: forward syncs with the host


class _SyncingBackend(TorchRefBackend):
    @staticmethod
    def get_name():
        return "SYNCING"

    @staticmethod
    def get_builder_cls():
        return _SyncingBuilder


def test_host_sync_during_capture_is_a_clear_error():
    ga.register_backend(_SyncingBackend, {}, replace=True)
    model = TableAttentionModel(16, 4, 2, 64).to("cuda", torch.bfloat16)
    with pytest.raises(ga.CaptureError, match="must not synchronize with the host"):
        ga.compile(
            model,
            cudagraph_mode="FULL_DECODE_ONLY",
            compile_backend="none",
            attention_backend="SYNCING",
            cudagraph_capture_sizes=[2],
            **LIMITS,
        )
    # the device is still usable afterwards, random numbers included
    assert torch.ones(2, device="cuda").sum().item() == 2
    assert torch.randn(4, device="cuda").isfinite().all()


def test_capture_after_startup_is_an_error(full_engine):
    from graphattn.attention.forward_context import set_forward_context
    from graphattn.capture.dispatcher import BatchDescriptor

    eng, _ = full_engine
    ids = eng.runner.buffers.input_ids.gpu[:2]
    with (
        set_forward_context(
            {}, BatchDescriptor(2, 2, True), ga.CUDAGraphMode.FULL, layers=eng.bound
        ),
        pytest.raises(ga.CaptureError, match="capture is closed"),
    ):
        eng.runner.forward(ids, ids)


def test_moved_inputs_are_caught_in_debug_mode(full_engine):
    from graphattn.attention.forward_context import set_forward_context
    from graphattn.capture.dispatcher import BatchDescriptor

    eng, _ = full_engine
    moved = torch.zeros(4, dtype=torch.int64, device="cuda")
    with (
        set_forward_context(
            {}, BatchDescriptor(4, 4, True), ga.CUDAGraphMode.FULL, layers=eng.bound
        ),
        pytest.raises(ga.CaptureError, match="other addresses"),
    ):
        eng.runner.forward(moved, moved)


def test_moved_weights_are_caught_in_debug_mode():
    import numpy as np

    model = TableAttentionModel(64, 8, 2, 64, seed=6).to("cuda", torch.bfloat16)
    eng = ga.compile(
        model,
        cudagraph_mode="FULL_DECODE_ONLY",
        compile_backend="none",
        attention_backend="TRITON",
        cudagraph_capture_sizes=[2],
        debug=True,
        **LIMITS,
    )
    seqs = make_seqs(np.random.default_rng(1), [(5, 1), (9, 1)], 64, 16, 64)
    _prefill(eng, seqs)
    eng.step(_decode_batch(seqs))
    with torch.no_grad():
        model.k.data = model.k.data.clone()  # a new tensor: the graph would read the old one
    with pytest.raises(ga.CaptureError, match="moved after capture"):
        eng.step(_decode_batch(seqs))

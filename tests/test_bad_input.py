"""Every bad input gets a typed error naming the request and value, and changes nothing."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICES, TableAttentionModel, assert_unchanged, eager_engine, snapshot

import graphattn as ga


@pytest.fixture(params=DEVICES)
def engine(request):
    model = TableAttentionModel(40, 4, 2, 64).to(request.param)
    eng = eager_engine(model, max_num_seqs=4, max_num_tokens=64, num_blocks=8, max_model_len=96)
    eng.kv_cache.allocate(3)
    # something in the cache to protect
    eng.step(ga.Batch.from_requests([ga.Request(list(range(20)), 0, [0, 1])]))
    return eng


R = ga.Request
BAD_BATCHES = {
    "no blocks for its tokens": ([R([1] * 5, 30, [0, 1])], r"has 2 block\(s\) for 35 tokens"),
    "block id outside the cache": ([R([1, 2], 0, [8])], "block id 8"),
    "negative block id": ([R([1], 3, [-1])], "block id -1"),
    "empty request": ([R([1], 0, [0]), R([], 4, [1])], "request 1 has no tokens"),
    "too many requests": ([R([1], 0, [i]) for i in range(5)], "5 requests; max_num_seqs is 4"),
    "too many tokens": ([R([1] * 65, 0, [0, 1, 2, 3, 4])], "65 tokens; max_num_tokens is 64"),
    "beyond max_model_len": ([R([1] * 2, 95, list(range(7)))], "max_model_len is 96"),
    "token outside the vocabulary": ([R([1, 40], 0, [0])], "token id 40"),
    "negative computed tokens": ([R([1], -2, [0])], "num_computed_tokens"),
    "no requests": ([], "no requests"),
}


@pytest.mark.parametrize("case", sorted(BAD_BATCHES))
def test_bad_batch_is_rejected_and_changes_nothing(engine, case):
    requests, message = BAD_BATCHES[case]
    snap = snapshot(engine)
    with pytest.raises(ga.InvalidBatchError, match=message):
        engine.step(ga.Batch.from_requests(requests))
    assert_unchanged(engine, snap)
    assert engine.stats.steps == 1


@pytest.mark.parametrize(
    "token_ids, message",
    [
        (torch.tensor([1.0, 2.0]), "integers on the CPU"),
        (["a"], "must hold ints"),
        (None, "sequence of ints"),
    ],
)
def test_bad_token_ids(engine, token_ids, message):
    snap = snapshot(engine)
    with pytest.raises(ga.InvalidBatchError, match=message):
        engine.step(ga.Batch.from_requests([R(token_ids, 0, [0])]))
    assert_unchanged(engine, snap)


@pytest.mark.gpu
def test_token_ids_on_the_wrong_device(engine):
    with pytest.raises(ga.InvalidBatchError, match="on the CPU"):
        ga.Batch.from_requests([R(torch.tensor([1, 2], device="cuda"), 0, [0])])


def test_float_arrays_are_rejected():
    with pytest.raises(ga.InvalidBatchError, match="must hold integers"):
        ga.Batch.from_arrays([1.5], [1], [0], [[0]])


def test_rejected_step_then_good_step(engine):
    """A rejected step leaves the engine usable, and the cached prefix still answers."""
    with pytest.raises(ga.InvalidBatchError):
        engine.step(ga.Batch.from_requests([R([1], 20, [0, 9])]))
    out = engine.step(ga.Batch.from_requests([R([5], 20, [0, 1])]))
    ids = list(range(20)) + [5]
    expected = engine.model.cpu().expected(ids, 1)
    torch.testing.assert_close(out.cpu(), expected.float(), rtol=1e-4, atol=1e-5)


def test_model_dtype_must_match_config():
    model = TableAttentionModel(8, 2, 2, 64)
    with pytest.raises(ga.InvalidInputError, match="convert the model first"):
        eager_engine(model, dtype="bfloat16", num_blocks=4)


def test_layer_inputs_are_checked():
    from graphattn.attention import set_forward_context

    model = TableAttentionModel(8, 2, 2, 64)
    engine = eager_engine(model, num_blocks=4)
    attn = model.attns[0]
    q = torch.randn(3, 128)
    with set_forward_context(None, layers=engine.bound):
        with pytest.raises(ga.InvalidInputError, match=r"key must be \[3, 128\]"):
            attn(q, torch.randn(3, 64), torch.randn(3, 128))
        with pytest.raises(ga.InvalidInputError, match="all three must match"):
            attn(q, q.double(), q)


def test_out_of_blocks_is_typed_and_allocates_nothing(engine):
    free = engine.kv_cache.num_free_blocks
    with pytest.raises(ga.OutOfBlocksError, match=f"only {free} of 8 are free"):
        engine.kv_cache.allocate(free + 1)
    assert engine.kv_cache.num_free_blocks == free

"""TORCH_REF against dense causal attention written in the test (helpers.dense_attention)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import DEVICES, TableAttentionModel, make_seqs, rel_err, run_with_prefixes
from hypothesis import given
from hypothesis import strategies as st

import graphattn as ga

KINDS = st.sampled_from(["prefill", "chunked", "decode"])


@st.composite
def shapes(draw, max_reqs=5):
    """(num_computed, num_new) per request: prefills, chunked prefills and decodes mixed."""
    out = []
    for kind in draw(st.lists(KINDS, min_size=1, max_size=max_reqs)):
        if kind == "prefill":
            out.append((0, draw(st.integers(1, 70))))
        elif kind == "chunked":
            out.append((draw(st.integers(1, 60)), draw(st.integers(2, 40))))
        else:
            out.append((draw(st.integers(1, 100)), 1))
    return out


def _engine(model, block_size, device, **kw):
    return ga.compile(
        model.to(device),
        cudagraph_mode="NONE",
        compile_backend="none",
        block_size=block_size,
        num_blocks=96,
        max_model_len=256,
        attention_backend="TORCH_REF",
        **kw,
    )


@pytest.mark.parametrize("device", DEVICES)
@given(
    shape=shapes(),
    block_size=st.sampled_from([16, 32]),
    gqa=st.sampled_from([1, 2, 4]),
    head_size=st.sampled_from([64, 80]),
    window=st.sampled_from([None, 7, 40]),
    seed=st.integers(0, 2**16),
)
def test_matches_dense_attention(device, shape, block_size, gqa, head_size, window, seed):
    model = TableAttentionModel(64, 2 * gqa, 2, head_size, sliding_window=window, seed=seed)
    engine = _engine(model, block_size, device)
    seqs = make_seqs(np.random.default_rng(seed), shape, 64, block_size, 96)
    out = run_with_prefixes(engine, seqs)
    expected = torch.cat([model.cpu().expected(s.ids, len(s.ids) - s.num_computed) for s in seqs])
    model.to(device)
    assert out.shape == expected.shape
    assert rel_err(out, expected) < 1e-5


def test_soft_cap_matches_dense():
    model = TableAttentionModel(32, 4, 2, 64, soft_cap=5.0)
    engine = _engine(model, 16, "cpu")
    seqs = make_seqs(np.random.default_rng(1), [(0, 30), (20, 1), (5, 9)], 32, 16, 96)
    out = run_with_prefixes(engine, seqs)
    expected = torch.cat([model.expected(s.ids, len(s.ids) - s.num_computed) for s in seqs])
    assert rel_err(out, expected) < 1e-5


def test_block_boundary_and_single_token():
    """A request ending exactly on a block boundary, a one-token prompt, and a 97-token prompt."""
    model = TableAttentionModel(50, 4, 4, 64)
    engine = _engine(model, 16, "cpu")
    seqs = make_seqs(np.random.default_rng(2), [(31, 1), (0, 1), (0, 97), (16, 16)], 50, 16, 96)
    out = run_with_prefixes(engine, seqs)
    expected = torch.cat([model.expected(s.ids, len(s.ids) - s.num_computed) for s in seqs])
    assert rel_err(out, expected) < 1e-5


def test_profile_run_without_metadata_gives_zeros():
    from graphattn.attention import set_forward_context

    model = TableAttentionModel(16, 4, 2, 64)
    engine = _engine(model, 16, "cpu")
    ids = torch.arange(5)
    with set_forward_context(None, layers=engine.bound):
        out = model(ids, ids)
    assert out.shape == (5, 4 * 64)
    assert torch.count_nonzero(out) == 0

"""ga.Attention: input layouts, the custom ops, and the forward context."""

from __future__ import annotations

import pytest
import torch
from helpers import TableAttentionModel, eager_engine

import graphattn as ga
from graphattn.attention import get_forward_context, set_forward_context


def test_flat_and_unflattened_inputs_give_the_same_output():
    model = TableAttentionModel(16, 4, 2, 64)
    engine = eager_engine(model, num_blocks=4)
    attn = model.attns[0]
    q, k, v = torch.randn(3, 256), torch.randn(3, 128), torch.randn(3, 128)
    blocks = engine.kv_cache.allocate(1)
    batch = ga.Batch.from_requests([ga.Request([1, 2, 3], 0, blocks)])
    plan = engine.runner.prepare_inputs(batch)
    md = engine.runner.build_metadata(engine.runner.common_metadata(plan))
    slots = dict.fromkeys(md, engine.runner.buffers.slot_mapping.gpu[:3])
    with set_forward_context(md, layers=engine.bound, slot_mapping=slots):
        flat = attn(q, k, v)
    with set_forward_context(md, layers=engine.bound, slot_mapping=slots):  # one call a forward
        unflat = attn(q.view(3, 4, 64), k.view(3, 2, 64), v.view(3, 2, 64))
    assert flat.shape == (3, 256)
    torch.testing.assert_close(flat, unflat)


def test_op_outside_a_forward_context_is_a_clear_error():
    attn = ga.Attention(2, 64, 0.125, prefix="lonely")
    with pytest.raises(ga.GraphAttnError, match="outside a forward context"):
        attn(torch.randn(1, 128), torch.randn(1, 128), torch.randn(1, 128))


def test_unknown_layer_in_context():
    attn = ga.Attention(2, 64, 0.125, prefix="stranger")
    with set_forward_context(None, layers={}), pytest.raises(ga.GraphAttnError, match="stranger"):
        attn(torch.randn(1, 128), torch.randn(1, 128), torch.randn(1, 128))


def test_context_nests_and_restores():
    with set_forward_context(None, layers={"a": 1}) as outer:
        with set_forward_context(None, layers={"b": 2}):
            assert "b" in get_forward_context().layers
        assert get_forward_context() is outer
        with pytest.raises(KeyError), set_forward_context(None, layers={"c": 3}):
            raise KeyError("an op failed")
        assert get_forward_context() is outer  # restored when the block raised
    once = set_forward_context(None, layers={})
    with once, pytest.raises(ga.GraphAttnError, match="already entered"), once:
        pass
    with pytest.raises(ga.GraphAttnError):  # the refused entry left nothing behind
        get_forward_context()
    with pytest.raises(ga.GraphAttnError):
        get_forward_context()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_heads=6, head_size=64, scale=1.0, num_kv_heads=4, prefix="x"), "multiple of"),
        (dict(num_heads=4, head_size=0, scale=1.0, prefix="x"), "head_size must be"),
        (dict(num_heads=4, head_size=64, scale=1.0, prefix=""), "prefix must name"),
        (
            dict(num_heads=4, head_size=64, scale=1.0, prefix="x", sliding_window=0),
            "sliding_window",
        ),
        # a cap the kernels divide by (TRITON: ZeroDivisionError after the cache write) or
        # that turns every score to NaN
        *(
            (
                dict(num_heads=4, head_size=64, scale=1.0, prefix="x", logits_soft_cap=cap),
                r"logits_soft_cap must be a finite number > 0, 0 or None, got",
            )
            for cap in (-5.0, float("inf"), float("nan"), "30", True)
        ),
        *(
            (dict(num_heads=4, head_size=64, scale=s, prefix="x"), "scale must be a finite")
            for s in (float("nan"), float("inf"), None)
        ),
    ],
)
def test_bad_layer_arguments(kwargs, message):
    with pytest.raises(ga.ConfigError, match=message):
        ga.Attention(**kwargs)


def test_a_soft_cap_of_zero_means_none():
    # flash-attn's and checkpoint configs' convention; TORCH_REF used to compute uniform
    # attention with it and TRITON to divide by zero
    import numpy as np

    layer = ga.Attention(4, 64, 0.125, prefix="x", logits_soft_cap=0)
    assert layer.logits_soft_cap is None
    assert ga.Attention(4, 64, 0.125, prefix="y", logits_soft_cap=30).logits_soft_cap == 30.0
    assert ga.Attention(4, 64, np.float32(0.125), prefix="z").scale == 0.125


def test_duplicate_layer_names_are_an_error():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = ga.Attention(2, 64, 1.0, prefix="same")
            self.b = ga.Attention(2, 64, 1.0, prefix="same")

    with pytest.raises(ga.ConfigError, match="share the name 'same'"):
        eager_engine(Two(), num_blocks=4)


def test_ops_trace_with_fake_tensors():
    """The custom ops have meta implementations: tracing under FakeTensorMode works."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.empty(5, 2, 64), torch.empty(5, 1, 64), torch.empty(5, 1, 64)
        out = torch.empty_like(q)
        dep = torch.ops.graphattn.unified_kv_cache_update(k, v, "x")
        torch.ops.graphattn.unified_attention_with_output(q, k, v, out, "x", dep)
        assert dep.shape == (0,)

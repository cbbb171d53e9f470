"""Backend registry and selection: priorities, kept reasons, explicit choices, errors."""

from __future__ import annotations

import pytest
import torch
from helpers import TableAttentionModel, eager_engine

import graphattn as ga
from graphattn.attention import AttentionSelectorConfig, select_backend
from graphattn.attention.backends.torch_ref import TorchRefBackend


def _cfg(**kw):
    base = dict(
        head_size=64,
        num_heads=4,
        num_kv_heads=2,
        dtype=torch.float32,
        kv_cache_dtype=torch.float32,
        block_size=16,
        device_type="cpu",
    )
    return AttentionSelectorConfig(**{**base, **kw})


class PickyBackend(TorchRefBackend):
    """Ranked first on the CPU but serves only head size 128."""

    @staticmethod
    def get_name():
        return "PICKY"

    @classmethod
    def supports_head_size(cls, head_size):
        return head_size == 128


@pytest.fixture
def picky():
    ga.register_backend(PickyBackend, {"cpu": 1000}, replace=True)
    yield PickyBackend
    ga.register_backend(PickyBackend, {}, replace=True)  # off every device again


def test_cpu_default_is_torch_ref():
    assert select_backend(_cfg()).backend.get_name() == "TORCH_REF"


def test_passed_over_reasons_are_kept(picky):
    sel = select_backend(_cfg(head_size=64))
    assert sel.backend is TorchRefBackend
    assert sel.rejected == {"PICKY": ["head size 64 not supported"]}
    assert select_backend(_cfg(head_size=128)).backend is PickyBackend


def test_no_backend_fits_lists_every_reason(picky):
    ga.register_backend(TorchRefBackend, {"cpu": 100, "cuda": 0, "xpu": 1}, replace=True)
    ga.register_backend(PickyBackend, {"xpu": 2}, replace=True)
    try:
        with pytest.raises(ga.BackendSelectionError) as err:
            select_backend(_cfg(device_type="xpu", head_size=96))
    finally:
        ga.register_backend(TorchRefBackend, {"cpu": 100, "cuda": 0}, replace=True)
    text = str(err.value)
    assert "no attention backend can serve head_size=96" in text
    assert "PICKY: device xpu not in ['cuda', 'cpu']; head size 96 not supported" in text
    assert "TORCH_REF: device xpu not in ['cuda', 'cpu']" in text


def test_explicit_request_that_cannot_serve_is_an_error(picky):
    with pytest.raises(ga.BackendSelectionError, match="PICKY was requested but cannot serve"):
        select_backend(_cfg(head_size=64), requested="picky")


def test_unknown_backend_name():
    with pytest.raises(ga.BackendSelectionError, match="unknown attention backend 'NOPE'"):
        ga.Attention(2, 64, 0.1, prefix="x", backend="NOPE")
    with pytest.raises(ga.BackendSelectionError, match="a backend name must be a str, got 123"):
        ga.Attention(2, 64, 0.1, prefix="x", backend=123)


def test_name_conflict_needs_replace():
    first, second = _named("MINE"), _named("mine")
    ga.register_backend(first, {}, replace=True)  # replace: the test may run twice
    with pytest.raises(ValueError, match="named 'MINE' is already registered"):
        ga.register_backend(second, {"cpu": 1})
    assert ga.attention.registry.registered_backends()["MINE"] is first
    ga.register_backend(second, {}, replace=True)
    assert ga.attention.registry.registered_backends()["MINE"] is second


def test_layer_and_config_can_name_the_backend(picky):
    model = TableAttentionModel(8, 2, 2, 128, num_layers=2)
    engine = eager_engine(model, num_blocks=4)
    assert [x.backend for x in engine.report.layers] == ["PICKY", "PICKY"]
    engine = eager_engine(model, num_blocks=4, attention_backend="TORCH_REF")
    assert [(x.backend, x.selected_by) for x in engine.report.layers] == [
        ("TORCH_REF", "config"),
        ("TORCH_REF", "config"),
    ]
    model.attns[1].requested_backend = "PICKY"
    engine = eager_engine(model, num_blocks=4, attention_backend="TORCH_REF")
    assert [(x.backend, x.selected_by) for x in engine.report.layers] == [
        ("TORCH_REF", "config"),
        ("PICKY", "layer"),
    ]
    assert len(engine.attn_groups) == 2  # different backends never share a group


# -- a backend author's mistakes: typed errors, nothing registered -----------------------


def _named(name, base=TorchRefBackend, **members):
    return type(f"B_{name}", (base,), {"get_name": staticmethod(lambda: name), **members})


class NotABackend:
    @staticmethod
    def get_name():
        return "NOT_A_BACKEND"


class Incomplete(ga.AttentionBackend):  # no get_impl_cls, get_builder_cls
    @staticmethod
    def get_name():
        return "INCOMPLETE"


@pytest.mark.parametrize(
    "backend, priority, message",
    [
        (NotABackend, {"cpu": 1}, "expected an AttentionBackend subclass"),
        ("SDPA", {"cpu": 1}, "expected an AttentionBackend subclass, got 'SDPA'"),
        (Incomplete, {"cpu": 1}, r"does not implement \['get_builder_cls', 'get_impl_cls'\]"),
        (_named(5), {"cpu": 1}, r"get_name\(\) must return a name, got 5"),
        (_named("BADPRIO"), 5, "must map device types to ranks"),
        (_named("BADPRIO"), {"gpu": 5}, "names 'gpu', not a torch device type"),
        (_named("BADPRIO"), {"cpu": "high"}, "on cpu must be an int, got 'high'"),
        (_named("torch_ref"), {"cpu": 1}, "TORCH_REF is a built-in attention backend"),
        (
            _named("BADBUILDER", get_builder_cls=staticmethod(lambda: object)),
            {"cpu": 1},
            r"get_builder_cls\(\) must return an AttentionMetadataBuilder subclass",
        ),
        (
            _named("BADSIZES", get_supported_kernel_block_sizes=classmethod(lambda cls: 16)),
            {"cpu": 1},
            r"get_supported_kernel_block_sizes\(\) must return a tuple of positive ints .*got 16",
        ),
    ],
)
def test_bad_registration_is_typed_and_registers_nothing(backend, priority, message):
    before = ga.attention.registry.registered_backends()
    with pytest.raises(ga.BackendError, match=message):
        ga.register_backend(backend, priority)
    assert ga.attention.registry.registered_backends() == before
    assert select_backend(_cfg()).backend is TorchRefBackend  # selection still works


def test_names_are_case_insensitive():
    lower = _named("my_ref")
    try:
        ga.register_backend(lower, {"cpu": 1})
        assert select_backend(_cfg(), "my_ref").backend is lower
        assert select_backend(_cfg(), "MY_REF").backend is lower
    finally:
        ga.register_backend(lower, {}, replace=True)


@pytest.mark.parametrize("answer", [None, "bad config", [1]])
def test_validate_configuration_must_return_reasons(answer):
    odd = _named("ODD_ANSWER", validate_configuration=classmethod(lambda cls, cfg: answer))
    ga.register_backend(odd, {"cpu": 1000}, replace=True)
    try:
        with pytest.raises(ga.BackendError, match="must return a list of reasons"):
            select_backend(_cfg())
    finally:
        ga.register_backend(odd, {}, replace=True)

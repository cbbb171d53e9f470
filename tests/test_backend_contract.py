"""What the engine checks of a backend where it first uses it: a breach is a BackendError."""

from __future__ import annotations

import pytest
import torch
from helpers import TableAttentionModel, assert_unchanged, eager_engine, snapshot

import graphattn as ga
from graphattn.attention.backends.torch_ref import (
    TorchRefBackend,
    TorchRefImpl,
    TorchRefMetadataBuilder,
)
from graphattn.attention.registry import registered_backends, select_backend
from graphattn.capture.mode import CUDAGraphMode
from graphattn.capture.resolve import resolve_for_engine
from graphattn.kv_cache import FullAttentionSpec, group_layers_by_spec


@pytest.fixture
def registered():
    """Registers backends by name for one test, then takes them off every device."""
    names = []

    def register(name, builder_members=None, **members):
        if builder_members:
            builder = type(f"Builder_{name}", (TorchRefMetadataBuilder,), builder_members)
            members["get_builder_cls"] = staticmethod(lambda: builder)
        backend = type(
            f"B_{name}", (TorchRefBackend,), {"get_name": staticmethod(lambda: name), **members}
        )
        ga.register_backend(backend, {}, replace=True)
        names.append(backend)
        return name

    yield register
    for backend in names:
        ga.register_backend(backend, {}, replace=True)


def _engine(backend, **overrides):
    model = TableAttentionModel(40, 4, 2, 64, backend=backend)
    return eager_engine(
        model, max_num_seqs=4, max_num_tokens=64, num_blocks=8, max_model_len=96, **overrides
    )


@pytest.mark.parametrize(
    "shape",
    [
        lambda nb, bs, h, d: (2, nb // 2, bs, h, d),  # half the blocks
        lambda nb, bs, h, d: (2, nb, bs, h),  # no head dimension
        lambda nb, bs, h, d: (3, nb, bs, h, d),  # a third tensor's worth
        lambda nb, bs, h, d: None,
        lambda nb, bs, h, d: (2, nb, bs, h, float(d)),
    ],
)
def test_cache_shape_must_hold_every_slot(registered, shape):
    name = registered("BAD_SHAPE", get_kv_cache_shape=staticmethod(shape))
    with pytest.raises(
        ga.BackendError, match=r"BAD_SHAPE.get_kv_cache_shape\(8, 16, 2, 64\) must be"
    ):
        _engine(name)


@pytest.mark.parametrize("support", [3, "ALWAYS", None])
def test_support_level_must_be_an_enum(registered, support):
    name = registered("BAD_SUPPORT", builder_members={"cudagraph_support": support})
    with pytest.raises(
        ga.BackendError, match=r"declares CUDA-graph support .*expected an AttentionCGSupport"
    ):
        _engine(name)


def test_metadata_none_is_an_error_not_a_profile_run(registered):
    """Found at start-up: an engine without graphs builds every group's metadata once for a
    synthetic batch (graph modes build in their capture's warm-ups)."""
    name = registered("NO_METADATA", builder_members={"build": lambda self, prefix, cam: None})
    with pytest.raises(ga.BackendError, match=r"built no metadata \(None\) for a step"):
        _engine(name)


def test_metadata_none_at_a_step_changes_nothing(registered):
    def build(self, prefix, cam):  # None for prefills only: start-up's one token passes
        return (
            None if cam.num_actual_tokens > 1 else TorchRefMetadataBuilder.build(self, prefix, cam)
        )

    name = registered("NONE_FOR_PREFILLS", builder_members={"build": build})
    engine = _engine(name)
    engine.kv_cache.allocate(2)
    snap = snapshot(engine)
    with pytest.raises(ga.BackendError, match=r"built no metadata \(None\) for a step"):
        engine.step(_request_batch())
    assert_unchanged(engine, snap)
    assert engine.stats.steps == 0


def test_layers_without_a_common_kernel_block_size():
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    with pytest.raises(ga.ConfigError, match=r"share no kernel block size.*a: \[8\]; b: \[16\]"):
        group_layers_by_spec({"a": spec, "b": spec}, {"a": (8,), "b": (16,)})


@pytest.mark.parametrize(
    "requested, resolved, cost",
    [
        (CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE, "every batch runs without graphs"),
        (
            CUDAGraphMode.FULL_AND_PIECEWISE,
            CUDAGraphMode.FULL_DECODE_ONLY,
            "mixed batches run without graphs",
        ),
    ],
)
def test_cost_of_losing_piecewise_graphs(requested, resolved, cost):
    mode, records = resolve_for_engine(
        requested,
        ga.AttentionCGSupport.ALWAYS,
        has_cuda=True,
        attention_is_splitting_op=False,
        backend_name="TRITON",
    )
    assert mode == resolved and records[0].cost == cost


class _WritesApart(TorchRefBackend.get_impl_cls()):
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        raise AssertionError("never called: the test checks registration only")


@pytest.mark.parametrize(
    "members, message",
    [
        (  # the write in do_kv_cache_update, the flag left at its default: never called
            {"get_impl_cls": staticmethod(lambda: _WritesApart)},
            r"_WritesApart defines do_kv_cache_update, but WHERE_WRITE.forward_includes_kv_"
            r"cache_update is True \(the default\), so the engine never calls it",
        ),
        (  # the flag says apart, the impl has no such method
            {"forward_includes_kv_cache_update": False},
            r"WHERE_WRITE.forward_includes_kv_cache_update is False, so the engine calls "
            r"do_kv_cache_update before attention, but TorchRefImpl does not define it",
        ),
        ({"forward_includes_kv_cache_update": 0}, r"must be True or False, got 0"),
        ({"get_impl_cls": staticmethod(lambda: object)}, r"must return an AttentionImpl subclass"),
    ],
)
def test_the_cache_write_must_be_where_the_flag_says(members, message):
    backend = type(
        "B", (TorchRefBackend,), {"get_name": staticmethod(lambda: "WHERE_WRITE"), **members}
    )
    with pytest.raises(ga.BackendError, match=message):
        ga.register_backend(backend, {"cpu": 1})
    assert "WHERE_WRITE" not in registered_backends()


def test_a_write_apart_with_the_flag_set_registers():
    members = {
        "get_name": staticmethod(lambda: "WRITE_APART"),
        "get_impl_cls": staticmethod(lambda: _WritesApart),
        "forward_includes_kv_cache_update": False,
    }
    backend = type("B", (TorchRefBackend,), members)
    ga.register_backend(backend, {})  # no device: never selected
    assert registered_backends()["WRITE_APART"] is backend


def test_support_level_is_declared_on_the_class(registered):
    def init(self, *args):
        TorchRefMetadataBuilder.__init__(self, *args)
        self.cudagraph_support = ga.AttentionCGSupport.ALWAYS

    name = registered("INSTANCE_SUPPORT", builder_members={"__init__": init})
    with pytest.raises(
        ga.BackendError, match=r"sets cudagraph_support on an instance; the level is read from"
    ):
        _engine(name)


class _ReturnsNew(TorchRefImpl):
    """Computes the rows into a tensor of its own and returns it: output stays unwritten."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args):
        if attn_metadata is None:
            return output.zero_()
        mine = torch.empty_like(output)
        TorchRefImpl.forward(self, layer, query, key, value, kv_cache, attn_metadata, mine)
        return mine


class _ReturnsView(TorchRefImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args):
        TorchRefImpl.forward(self, layer, query, key, value, kv_cache, attn_metadata, output)
        rows = output.view(output.shape[0], -1)  # the same memory: fine
        return rows[: max(1, rows.shape[0] - 1)]  # narrowed too (a padded step's real rows)


class _ReadsMetadataAlways(TorchRefImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args):
        output[:] = attn_metadata.seq_lens.max()  # no profile-run check: fails at start-up
        return output


def _request_batch():
    return ga.Batch.from_requests([ga.Request([1, 2, 3], 0, [0])])


def test_an_impl_returning_a_new_tensor_is_an_error(registered):
    name = registered("RETURNS_NEW", get_impl_cls=staticmethod(lambda: _ReturnsNew))
    engine = _engine(name)
    engine.kv_cache.allocate(1)
    with pytest.raises(
        ga.BackendError,
        match=r"_ReturnsNew.forward \(RETURNS_NEW\) returned a new tensor torch.float32\[3, 4, "
        r"64\], not the output it was given \(torch.float32\[3, 4, 64\]\): an impl writes",
    ):
        engine.step(_request_batch())


def test_an_impl_returning_a_view_of_output_runs(registered):
    name = registered("RETURNS_VIEW", get_impl_cls=staticmethod(lambda: _ReturnsView))
    engine, ref = _engine(name), _engine("TORCH_REF")
    for e in (engine, ref):
        e.kv_cache.allocate(1)
    torch.testing.assert_close(engine.step(_request_batch()), ref.step(_request_batch()))


class _ReturnsZeros(TorchRefImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args):
        return torch.zeros_like(output)


def test_the_default_o_proj_path_checks_what_forward_returns():
    impl = _ReturnsZeros.__new__(_ReturnsZeros)  # forward_o_proj reads nothing of self
    q = torch.randn(2, 4, 8)
    with pytest.raises(
        ga.BackendError, match=r"_ReturnsZeros.forward \(via forward_o_proj\) returned a new tensor"
    ):
        impl.forward_o_proj(None, q, q, q, None, object(), torch.randn(6, 32), torch.empty(2, 6))


@pytest.mark.skipif(not hasattr(Exception(), "add_note"), reason="notes are Python 3.11+")
def test_an_error_in_the_profile_run_says_so(registered):
    name = registered("NO_NONE_CHECK", get_impl_cls=staticmethod(lambda: _ReadsMetadataAlways))
    with pytest.raises(AttributeError) as err:
        _engine(name)
    (note,) = err.value.__notes__
    assert note.startswith("graphattn: _ReadsMetadataAlways.forward (NO_NONE_CHECK) raised this")
    assert "profile run, where attn_metadata is None" in note


@pytest.mark.parametrize("replace", [False, True])
def test_a_builtin_name_is_not_taken_by_another_class(replace):
    before = registered_backends()
    clash = type("Clash", (TorchRefBackend,), {"get_name": staticmethod(lambda: "torch_ref")})
    with pytest.raises(
        ga.BackendError,
        match=r"TORCH_REF is a built-in attention backend \(graphattn.attention.backends."
        r"torch_ref.TorchRefBackend\); register .*Clash under a name of its own",
    ):
        ga.register_backend(clash, {"cpu": 5}, replace=replace)
    assert registered_backends() == before
    ga.register_backend(TorchRefBackend, {"cpu": 100, "cuda": 0})  # its own class: new ranks


@pytest.mark.parametrize(
    "members, message",
    [
        ({"supported_dtypes": torch.float32}, r"supported_dtypes must be a tuple of dtype"),
        ({"supported_dtypes": ("float32",)}, r"supported_dtypes must be a tuple of dtype"),
        ({"supported_devices": "cpu"}, r"supported_devices must be a tuple of str, e.g."),
    ],
)
def test_supported_dtypes_and_devices_are_tuples(members, message):
    backend = type("B", (TorchRefBackend,), {"get_name": staticmethod(lambda: "LOOSE"), **members})
    with pytest.raises(ga.BackendError, match=message):
        ga.register_backend(backend, {"cpu": 1})
    assert "LOOSE" not in registered_backends()


class _WritesNothing(TorchRefImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args):
        if attn_metadata is None:
            return output.zero_()
        scratch = torch.zeros_like(kv_cache)  # "writes" a copy: the cache stays as it was
        return TorchRefImpl.forward(self, layer, query, key, value, scratch, attn_metadata, output)


def test_debug_finds_a_cache_write_that_does_nothing(registered):
    name = registered("WRITES_NOTHING", get_impl_cls=staticmethod(lambda: _WritesNothing))
    engine = _engine(name)  # without debug the step runs: registration cannot see it
    engine.kv_cache.allocate(1)
    engine.step(_request_batch())
    engine = _engine(name, debug=True)
    engine.kv_cache.allocate(1)
    with pytest.raises(
        ga.BackendError,
        match=r"debug=True: the first step had 3 tokens' keys and values to write, but the KV "
        r"cache of no layer of backend WRITES_NOTHING changed \(1 layers: layers.0.attn\)",
    ):
        engine.step(_request_batch())
    engine.step(_request_batch())  # checked once: later steps run as without debug


def test_debug_passes_a_backend_that_writes_and_checks_once():
    engine = _engine("TORCH_REF", debug=True)
    engine.kv_cache.allocate(1)
    with pytest.raises(ga.InvalidBatchError):  # rejected before running: not yet checked
        engine.step(ga.Batch.from_requests([ga.Request([1, 2, 3], 0, [99])]))
    assert engine._check_kv_writes
    engine.step(_request_batch())
    assert not engine._check_kv_writes


@pytest.mark.parametrize(
    "support, mode, expected",
    [
        ("NEVER", "FULL", "FULL: an error (cudagraph_mode=FULL needs full CUDA graphs for every"),
        (
            "UNIFORM_BATCH",
            "FULL_DECODE_ONLY",
            "FULL_DECODE_ONLY, kept",
        ),
        (
            "UNIFORM_BATCH",
            "FULL",
            "cudagraph_mode FULL -> FULL_DECODE_ONLY (mixed batches need ALWAYS for full graphs): "
            "backend LEVEL supports UNIFORM_BATCH",
        ),
        ("ALWAYS", "NONE", None),
    ],
)
def test_off_cuda_the_report_says_what_a_gpu_would_resolve(registered, support, mode, expected):
    level = getattr(ga.AttentionCGSupport, support)
    name = registered("LEVEL", builder_members={"cudagraph_support": level})
    engine = _engine(name, cudagraph_mode=mode)
    assert engine.report.resolved_mode == "NONE"  # the CPU: no graphs whatever the level
    if expected is None:
        assert engine.report.mode_on_cuda is None
        assert "on a CUDA device" not in str(engine.report)
    else:
        assert engine.report.mode_on_cuda.startswith(expected)
        assert f"on a CUDA device: {engine.report.mode_on_cuda}" in str(engine.report).splitlines()
        assert engine.report.to_dict()["mode_on_cuda"] == engine.report.mode_on_cuda


class _TwoLayersOneUnused(torch.nn.Module):
    """A table model with a second ga.Attention it never calls (a spare head)."""

    def __init__(self):
        super().__init__()
        self.inner = TableAttentionModel(40, 4, 2, 64)
        self.spare = ga.Attention(4, 64, 0.125, num_kv_heads=2, prefix="spare.attn")

    def forward(self, input_ids, positions):
        return self.inner(input_ids, positions)


def test_debug_does_not_blame_a_backend_for_a_layer_the_model_never_calls():
    model = _TwoLayersOneUnused()
    engine = eager_engine(model, num_blocks=8, max_model_len=96, debug=True)
    assert len(engine.kv_cache.tensors) == 2
    engine.kv_cache.allocate(1)
    engine.step(_request_batch())  # TORCH_REF wrote layers.0.attn: the spare is not its fault
    assert not engine._check_kv_writes


def test_off_cuda_the_report_selects_again_for_cuda():
    """Automatic selection ranks backends per device (TORCH_REF first on the CPU, TRITON
    on CUDA): the line resolves with the backend a GPU would select, not the CPU's."""
    engine = _engine(None, cudagraph_mode="FULL")
    layer = engine.bound["layers.0.attn"].layer
    assert engine.report.layers[0].backend == "TORCH_REF"  # NEVER: FULL would be an error
    cfg = layer.selector_config(torch.float32, torch.float32, 16, "cuda")
    on_cuda = select_backend(cfg).backend.get_name()
    assert on_cuda != "TORCH_REF"  # TRITON where Triton imports
    assert engine.report.mode_on_cuda == f"FULL, kept (backend {on_cuda})"

"""The TRITON backend: through the engine against dense attention and TORCH_REF, its
validation reasons, the profile run, padded batches, and launches fixed per padded size.

On the CPU the kernels run under the Triton interpreter (tests/conftest.py).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from helpers import DEVICES, TableAttentionModel, make_seqs, rel_err, run_with_prefixes
from hypothesis import given, settings
from hypothesis import strategies as st
from test_torch_ref import shapes  # prefills, chunked prefills and decodes mixed

import graphattn as ga
from graphattn.attention import AttentionSelectorConfig, candidates, select_backend
from graphattn.attention.backends import triton_attn
from graphattn.attention.backends.torch_ref import TorchRefBackend
from graphattn.attention.backends.triton_attn import TritonBackend, TritonMetadataBuilder
from graphattn.capture.dispatcher import BatchDescriptor, Dispatch
from graphattn.capture.mode import CUDAGraphMode
from graphattn.kernels import split_kv, unified_attention
from graphattn.kv_cache import FullAttentionSpec

# fp32 everywhere on the CPU; bf16 engines on the GPU are judged at 3 bf16 unit roundoffs
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3 * 2**-8}


def _engine(model, block_size=16, device="cpu", backend="TRITON", **kw):
    return ga.compile(
        model.to(device),
        cudagraph_mode="NONE",
        compile_backend="none",
        block_size=block_size,
        num_blocks=96,
        max_model_len=256,
        max_num_seqs=16,
        attention_backend=backend,
        **kw,
    )


def _expected(model, seqs):
    return torch.cat([model.expected(s.ids, len(s.ids) - s.num_computed) for s in seqs])


# -- through the engine -----------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=8, deadline=None)
@given(
    shape=shapes(max_reqs=4),
    block_size=st.sampled_from([16, 32]),
    gqa=st.sampled_from([1, 2, 4]),
    head_size=st.sampled_from([64, 80]),
    window=st.sampled_from([None, 7]),
    seed=st.integers(0, 2**16),
)
def test_engine_matches_dense_and_torch_ref(
    device, shape, block_size, gqa, head_size, window, seed
):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = TableAttentionModel(64, 2 * gqa, 2, head_size, sliding_window=window, seed=seed)
    model = model.to(dtype)
    seqs = make_seqs(np.random.default_rng(seed), shape, 64, block_size, 96)
    out = run_with_prefixes(_engine(model, block_size, device), seqs)
    ref = run_with_prefixes(_engine(model, block_size, device, backend="TORCH_REF"), seqs)
    expected = _expected(model.cpu(), seqs)
    assert out.shape == expected.shape
    assert rel_err(out, expected) < TOLERANCE[dtype]
    assert rel_err(out, ref) < TOLERANCE[dtype]


def test_soft_cap_block_boundary_and_awkward_lengths():
    """Soft-capping; a one-token prompt, a 97-token prompt, requests ending on a block boundary."""
    model = TableAttentionModel(50, 4, 2, 96, soft_cap=5.0)
    shape = [(31, 1), (0, 1), (0, 97), (16, 16)]
    seqs = make_seqs(np.random.default_rng(2), shape, 50, 16, 96)
    out = run_with_prefixes(_engine(model), seqs)
    assert rel_err(out, _expected(model, seqs)) < 1e-5


@pytest.mark.parametrize("num_sms", [1, 16])  # split-KV off (GPU "full"), on
def test_padded_batches_through_the_runner(num_sms):
    """The runner pads (slot -1 tokens, length-0 requests) as it does for a captured size."""
    model = TableAttentionModel(64, 8, 2, 64, seed=3)
    engine = _engine(model)
    (group,) = engine.attn_groups
    group.builder.num_sms = num_sms
    built = []
    build = group.builder.build
    group.builder.build = lambda p, cam: built.append(build(p, cam)) or built[-1]
    engine.runner.planner = lambda t, r, u: Dispatch(
        CUDAGraphMode.NONE, BatchDescriptor(t + 5, r + 3, u)
    )
    seqs = make_seqs(np.random.default_rng(3), [(20, 1), (0, 5), (33, 1), (7, 2)], 64, 16, 96)
    out = run_with_prefixes(engine, seqs)
    assert rel_err(out, _expected(model, seqs)) < 1e-5
    last = built[-1]  # 9 tokens + 5, 4 requests + 3: within the split scratch (16 tokens)
    assert (last.num_input_tokens, last.num_reqs) == (14, 7)
    assert (last.num_splits > 1) == (num_sms > 1)


@pytest.fixture
def fused_merge_env(monkeypatch):
    """GRAPHATTN_FUSED_SPLIT_MERGE=1 for one test (read once per process: cleared around)."""
    monkeypatch.setenv(split_kv.MERGE_ENV, "1")
    split_kv.fused_merge.cache_clear()
    yield
    monkeypatch.delenv(split_kv.MERGE_ENV)
    split_kv.fused_merge.cache_clear()


def test_fused_split_merge_through_the_engine(fused_merge_env, monkeypatch):
    """With the merge in the attention launch the engine's steps match the model, no
    reduction kernel runs, the report says so, and the tickets end at zero."""
    model = TableAttentionModel(64, 8, 2, 64, seed=4)
    engine = _engine(model)
    (group,) = engine.attn_groups
    group.builder.num_sms = 16  # split-KV on for these small batches
    built = []
    build = group.builder.build
    group.builder.build = lambda p, cam: built.append(build(p, cam)) or built[-1]
    reduced = []
    monkeypatch.setattr(split_kv, "reduce_splits", lambda *a, **k: reduced.append(a))
    seqs = make_seqs(np.random.default_rng(5), [(20, 1), (0, 5), (33, 1), (7, 1)], 64, 16, 96)
    out = run_with_prefixes(engine, seqs)
    assert rel_err(out, _expected(model, seqs)) < 1e-5
    assert reduced == [] and any(md.num_splits > 1 for md in built)
    assert torch.count_nonzero(group.builder.scratch.tickets) == 0
    assert "last split program" in engine.report.kernels["split_kv_merge"]


def test_a_bad_merge_variable_fails_at_start_up(monkeypatch):
    monkeypatch.setenv(split_kv.MERGE_ENV, "yes")
    split_kv.fused_merge.cache_clear()
    try:
        with pytest.raises(ga.ConfigError, match="GRAPHATTN_FUSED_SPLIT_MERGE must be 0 or 1"):
            _engine(TableAttentionModel(16, 4, 2, 64))
    finally:
        split_kv.fused_merge.cache_clear()


def test_profile_run_without_metadata_gives_zeros():
    from graphattn.attention import set_forward_context

    model = TableAttentionModel(16, 4, 2, 64)
    engine = _engine(model)
    ids = torch.arange(5)
    with set_forward_context(None, layers=engine.runner.layers):
        out = model(ids, ids)
    assert out.shape == (5, 4 * 64)
    assert torch.count_nonzero(out) == 0


def test_output_scale_is_not_supported():
    impl = TritonBackend.get_impl_cls()(4, 64, 0.125, 2)
    q, out = torch.randn(3, 4, 64), torch.empty(3, 4, 64)
    with pytest.raises(NotImplementedError, match="fused output quantization"):
        impl.forward(None, q, q, q, None, None, out, output_scale=torch.ones(1))
    with pytest.raises(NotImplementedError, match="fused output quantization"):
        impl.forward(None, q, q, q, None, None, out, output_block_scale=torch.ones(1))


# -- the builder and impl on CAMs padded as the runner pads them ---------------------------


class Harness:
    """A TRITON builder and impl over a random paged cache, fed hand-made padded CAMs."""

    def __init__(self, num_heads=8, num_kv_heads=2, head_size=64, block_size=16, num_sms=4):
        self.config = ga.CompileConfig(max_num_seqs=16, block_size=block_size, num_blocks=32)
        spec = FullAttentionSpec(block_size, num_kv_heads, head_size, torch.float32)
        self.builder = TritonMetadataBuilder(spec, ["l0"], self.config, torch.device("cpu"))
        self.builder.num_sms = num_sms
        self.impl = TritonBackend.get_impl_cls()(num_heads, head_size, 0.1, num_kv_heads)
        gen = torch.Generator().manual_seed(0)
        shape = TritonBackend.get_kv_cache_shape(32, block_size, num_kv_heads, head_size)
        self.kv_cache = torch.randn(shape, generator=gen)
        self.num_heads, self.head_size, self.block_size = num_heads, head_size, block_size

    def cam(self, shapes, num_tokens, num_reqs):
        """A CAM of ``shapes`` padded to ``num_tokens`` tokens and ``num_reqs`` requests."""
        t, r = sum(n for _, n in shapes), len(shapes)
        assert t <= num_tokens and r <= num_reqs, "the padded sizes must hold the batch"
        starts = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum([n for _, n in shapes], out=starts[1 : r + 1])
        starts[r + 1 :] = np.minimum(t + np.arange(1, num_reqs - r + 1), num_tokens)
        seq_lens = np.zeros(num_reqs, dtype=np.int32)
        seq_lens[:r] = [c + n for c, n in shapes]
        table = np.full((num_reqs, 16), 2**30, dtype=np.int32)  # never read past a request
        for i, (c, n) in enumerate(shapes):
            blocks = -(-(c + n) // self.block_size)
            table[i, :blocks] = np.arange(4 * i, 4 * i + blocks)  # at most 4 blocks each
        slots = np.full(num_tokens, -1, dtype=np.int64)
        qsl = torch.from_numpy(starts)
        return ga.CommonAttentionMetadata(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl,
            seq_lens=torch.from_numpy(seq_lens),
            seq_lens_cpu=torch.from_numpy(seq_lens),
            max_seq_len=int(seq_lens.max()),
            num_reqs=num_reqs,
            num_actual_tokens=t,
            num_input_tokens=num_tokens,
            max_query_len=max(n for _, n in shapes),
            block_table_tensor=torch.from_numpy(table),
            slot_mapping=torch.from_numpy(slots),
            positions=torch.zeros(num_tokens, dtype=torch.int64),
            is_prefilling=torch.zeros(num_reqs, dtype=torch.bool),
        )

    def forward(self, cam, query):
        md = self.builder.build(0, cam)
        output = torch.full_like(query, float("nan"))
        self.impl.forward(None, query, None, None, self.kv_cache, md, output)
        return output


def _reference(h: Harness, cam, query):
    from graphattn.kernels.reference import paged_attention_ref

    r = int((cam.seq_lens > 0).sum())
    out = torch.zeros(cam.num_actual_tokens, h.num_heads, h.head_size)
    k, v = h.kv_cache.unbind(0)
    return paged_attention_ref(
        query[: cam.num_actual_tokens], k, v, cam.block_table_tensor[:r],
        cam.query_start_loc_cpu[: r + 1].tolist(), cam.seq_lens_cpu[:r].tolist(), 0.1, out,
    )  # fmt: skip


@pytest.mark.parametrize("num_sms", [1, 16])
def test_padded_cam_real_rows_are_correct(num_sms):
    h = Harness(num_sms=num_sms)
    cam = h.cam([(9, 1), (0, 1), (20, 6), (15, 1)], num_tokens=12, num_reqs=7)
    query = torch.randn(12, h.num_heads, h.head_size)
    out = h.forward(cam, query)
    real = out[: cam.num_actual_tokens]
    assert not real.isnan().any()
    assert rel_err(real, _reference(h, cam, query)) < 1e-5


class _LaunchRecorder:
    """Stands in for a Triton kernel; records each launch's grid and constant arguments."""

    def __init__(self, kernel, log):
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.kernel.fn.__name__, tuple(grid), tuple(sorted(kwargs.items()))))
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.mark.parametrize("num_sms", [1, 16])
def test_launch_is_fixed_for_a_padded_size(monkeypatch, num_sms):
    """Batches of different lengths padded to one size launch the same kernels, grids and
    constants: a graph captured for the size serves them all. (Uniform decode batches are
    a key of their own and may take other tiles; every launch is correct for every batch.)"""
    log: list = []
    for module, name in ((unified_attention, "_attention_kernel"), (split_kv, "_reduce_kernel")):
        monkeypatch.setattr(module, name, _LaunchRecorder(getattr(module, name), log))
    h = Harness(num_sms=num_sms)
    batches = [
        [(0, 10)],  # one prefill
        [(30, 4), (2, 1), (40, 2), (0, 3)],  # chunked and mixed
        [(9, 1), (0, 6), (15, 1)],  # decodes and a prefill
    ]
    launches = []
    for batch in batches:
        log.clear()
        cam = h.cam(batch, num_tokens=12, num_reqs=6)
        query = torch.randn(12, h.num_heads, h.head_size)
        out = h.forward(cam, query)
        assert rel_err(out[: cam.num_actual_tokens], _reference(h, cam, query)) < 1e-5
        launches.append(list(log))
    assert launches[0] == launches[1] == launches[2]
    assert len(launches[0]) == (1 if num_sms == 1 else 2)  # split-KV adds the reduction
    decodes = []
    for batch in ([(9, 1), (0, 1), (15, 1)], [(40, 1), (3, 1), (7, 1), (1, 1), (2, 1)]):
        log.clear()
        h.forward(h.cam(batch, num_tokens=12, num_reqs=6), torch.randn(12, 8, 64))
        decodes.append(list(log))
    assert decodes[0] == decodes[1]


def test_build_is_cheap_and_never_syncs(monkeypatch):
    h = Harness()
    cam = h.cam([(9, 1), (0, 5)], num_tokens=8, num_reqs=4)
    h.builder.build(0, cam)  # first build of a size fills the split cache
    for name in ("item", "tolist", "cpu", "numpy", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, _forbidden(name))
    times = []
    for _ in range(200):
        start = time.perf_counter()
        md = h.builder.build(0, cam)
        times.append(time.perf_counter() - start)
    monkeypatch.undo()
    assert md.scratch is h.builder.scratch  # allocated once, shared by every step
    # "a few microseconds"; generous for a loaded CI machine
    assert statistics.median(times) < 50e-6


def _forbidden(name):
    def fail(*args, **kwargs):
        raise AssertionError(f"build called Tensor.{name} (a host sync on CUDA)")

    return fail


# -- selection and validation -----------------------------------------------------------


def _cfg(**kw):
    base = dict(
        head_size=128,
        num_heads=32,
        num_kv_heads=8,
        dtype=torch.bfloat16,
        kv_cache_dtype=torch.bfloat16,
        block_size=16,
        device_type="cuda",
    )
    return AttentionSelectorConfig(**{**base, **kw})


def test_first_on_cuda_below_torch_ref_on_cpu():
    assert candidates("cuda")[0] is TritonBackend
    cpu = candidates("cpu")
    assert cpu.index(TorchRefBackend) < cpu.index(TritonBackend)
    assert select_backend(_cfg(device_type="cpu", dtype=torch.float32)).backend is TorchRefBackend
    assert TritonBackend.validate_configuration(_cfg()) == []
    assert TritonBackend.validate_configuration(_cfg(device_type="cpu")) == []  # interpreter on


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (dict(head_size=72), "head size 72 not supported"),
        (dict(head_size=72), "head sizes supported: [64, 80, 96, 128, 256]"),
        (dict(dtype=torch.float64), "dtype torch.float64 not supported"),
        (dict(kv_cache_dtype=torch.int8), "kv cache dtype torch.int8 not supported"),
        (dict(block_size=8), "block size 8 is not a multiple of [16, 32, 64]"),
        (dict(device_type="xpu"), "device xpu not in ['cuda', 'cpu']"),
        (dict(num_heads=128, num_kv_heads=1), "128 query heads per KV head"),
    ],
)
def test_validate_configuration_reasons(change, reason):
    assert reason in "; ".join(TritonBackend.validate_configuration(_cfg(**change)))


def test_cpu_without_the_interpreter_is_rejected(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reasons = TritonBackend.validate_configuration(_cfg(device_type="cpu"))
    assert any("TRITON_INTERPRET=1" in r for r in reasons)


def test_missing_triton_is_a_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now raises ImportError
    triton_attn._triton_import_error.cache_clear()
    try:
        reasons = TritonBackend.validate_configuration(_cfg())
    finally:
        triton_attn._triton_import_error.cache_clear()
    assert len(reasons) == 1 and reasons[0].startswith("triton is not installed")


def test_module_imports_without_triton():
    """graphattn imports and names the reason where Triton cannot be imported at all."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, graphattn as ga\n"
        "from graphattn.attention import AttentionSelectorConfig as C\n"
        "b = ga.attention.get_backend('TRITON')\n"
        "print(b.validate_configuration(C(128, 32, 8, torch.bfloat16, torch.bfloat16, 16, 'cuda')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "triton is not installed" in out.stdout

"""The input staging kernel (``GRAPHATTN_INPUT_STAGING=kernel``): segments copied word for
word, nothing else written, and ``InputBuffers.stage_to_device`` moving what the copies
move. On the CPU the kernel runs under the Triton interpreter (the pinned-memory reads are a
GPU test, in test_capture.py and below)."""

from __future__ import annotations

import importlib.util
import re

import numpy as np
import pytest
import torch
from helpers import compiled_without_interpreter
from hypothesis import given, settings
from hypothesis import strategies as st

from graphattn import envs
from graphattn.buffers import InputBuffers
from graphattn.errors import ConfigError
from graphattn.kernels import stage_inputs as si

DTYPES = [torch.int32, torch.int64, torch.float32]


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 2 * si.BLOCK + 7), min_size=1, max_size=si.MAX_SEGMENTS),
    kinds=st.lists(st.sampled_from(DTYPES), min_size=si.MAX_SEGMENTS, max_size=si.MAX_SEGMENTS),
    seed=st.integers(0, 2**16),
)
def test_segments_are_copied_and_nothing_else(lengths, kinds, seed):
    gen = torch.Generator().manual_seed(seed)
    sources, destinations, segments = [], [], []
    for n, dtype in zip(lengths, kinds):
        src = torch.randint(-(2**30), 2**30, (n + 5,), generator=gen).to(dtype)
        dst = torch.full((n + 5,), -7).to(dtype)
        sources.append(src)
        destinations.append(dst)
        segments.append((src[:n], dst[:n]))
    si.stage(si.StagingPlan(segments))
    for n, src, dst in zip(lengths, sources, destinations):
        assert torch.equal(dst[:n], src[:n])
        assert (dst[n:] == -7).all()  # past the segment: untouched


def test_a_plan_rejects_what_it_cannot_copy():
    a = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="1 to 8 segments"):
        si.StagingPlan([])
    with pytest.raises(ValueError, match="like to like"):
        si.StagingPlan([(a, torch.zeros(4, dtype=torch.int64))])
    with pytest.raises(ValueError, match="contiguous"):
        si.StagingPlan([(torch.zeros(8, dtype=torch.int32)[::2], a)])
    with pytest.raises(ValueError, match="32- or 64-bit"):
        si.StagingPlan([(torch.zeros(4, dtype=torch.int16), torch.zeros(4, dtype=torch.int16))])


def _split_buffers(ratios=(1,)) -> InputBuffers:
    """CPU InputBuffers whose device side is a separate zeroed tensor (on the CPU the two
    sides are one tensor), so what a copy writes can be told from what it leaves."""
    b = InputBuffers(32, 8, 6, ratios, torch.device("cpu"))
    for flat in (b._i64, b._pos, b._i32):
        flat.device = torch.zeros_like(flat.host)
        for view in flat.views.values():
            start = view.end - view.np.size
            view.gpu = flat.device[start : view.end].view(view.np.shape)
    return b


def _fill(b: InputBuffers, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for flat in (b._i64, b._pos, b._i32):
        flat.host.copy_(torch.from_numpy(rng.integers(1, 1000, flat.host.numel())))


@pytest.mark.parametrize("ratios", [(1,), (1, 2), (1, 2, 4)])  # three tables: the prefix path
@pytest.mark.parametrize(("tokens", "reqs"), [(1, 1), (5, 3), (32, 8)])
def test_staging_moves_what_the_step_reads(ratios, tokens, reqs):
    """Each input's rows of a step of ``tokens`` tokens and ``reqs`` requests reach the
    device as ``copy_to_device`` brings them; the rest of the device buffers stays zero (the
    copies move longer prefixes, the kernel only the rows)."""
    staged, copied = _split_buffers(ratios), _split_buffers(ratios)
    _fill(staged, 1)
    _fill(copied, 1)
    staged.stage_to_device(tokens, reqs)
    copied.copy_to_device(tokens, reqs)
    token_inputs = ["input_ids", "slot_mapping", "output_index", "positions"]
    for name in token_inputs:
        got, want = getattr(staged, name), getattr(copied, name)
        assert torch.equal(got.gpu[:tokens], want.gpu[:tokens]), name
        assert torch.equal(got.gpu[:tokens], got.cpu[:tokens]), name
        assert (got.gpu[tokens:] == 0).all(), name
    rows = [("query_start_loc", reqs + 1), ("seq_lens", reqs)]
    for name, n in rows:
        got, want = getattr(staged, name), getattr(copied, name)
        assert torch.equal(got.gpu[:n], want.gpu[:n]) and torch.equal(got.gpu[:n], got.cpu[:n])
    for k, table in staged.block_tables.items():
        assert torch.equal(table.gpu[:reqs], table.cpu[:reqs]), k
        assert torch.equal(table.gpu[:reqs], copied.block_tables[k].gpu[:reqs]), k
    # a second step of another size reads its own rows, from a plan made once per size
    _fill(staged, 2)
    staged.stage_to_device(tokens, reqs)
    assert torch.equal(staged.input_ids.gpu[:tokens], staged.input_ids.cpu[:tokens])
    assert len(staged._staging) == 1


def test_input_staging_variable(monkeypatch):
    monkeypatch.delenv("GRAPHATTN_INPUT_STAGING", raising=False)
    assert envs.input_staging() == "kernel"  # the default since round 14 (measured faster)
    monkeypatch.setenv("GRAPHATTN_INPUT_STAGING", "copies")
    assert envs.input_staging() == "copies"
    monkeypatch.setenv("GRAPHATTN_INPUT_STAGING", "dma")
    with pytest.raises(ConfigError, match=re.escape("('copies', 'kernel'), got 'dma'")):
        envs.input_staging()


def test_input_staging_without_triton_falls_back_to_copies(monkeypatch, caplog):
    """The staging kernel is Triton's: where Triton is missing the full graphs copy, and the
    engine says so (the report's capture section and a warning in the log)."""
    import sys

    from graphattn import engine
    from graphattn.kernels import triton_import_error

    monkeypatch.delenv("GRAPHATTN_INPUT_STAGING", raising=False)
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "triton", None)  # import triton now raises ImportError
        triton_import_error.cache_clear()
        try:
            with caplog.at_level("WARNING", logger="graphattn"):
                staging, note = engine._input_staging()
        finally:
            triton_import_error.cache_clear()
    assert staging == "copies" and "needs Triton" in note
    assert "three memcpy nodes instead of one kernel" in caplog.text
    assert engine._input_staging() == ("kernel", None)
    monkeypatch.setenv("GRAPHATTN_INPUT_STAGING", "copies")
    assert engine._input_staging() == ("copies", None)


@pytest.mark.gpu
def test_gpu_staging_reads_pinned_memory_at_replay():
    """On CUDA the kernel reads the pinned host buffers through their device addresses, when
    it runs: a graph captured once copies each replay's new host values."""
    host = torch.zeros(3000, dtype=torch.int64, pin_memory=True)
    dev = torch.zeros(3000, dtype=torch.int64, device="cuda")
    small_host = torch.zeros(5, dtype=torch.int32, pin_memory=True)
    small_dev = torch.zeros(5, dtype=torch.int32, device="cuda")
    plan = si.StagingPlan([(host[:2999], dev[:2999]), (small_host, small_dev)])
    si.stage(plan)  # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        si.stage(plan)
    for i in range(3):
        host.copy_(torch.arange(3000) * (i + 2))
        small_host.copy_(torch.arange(5, dtype=torch.int32) - i)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(dev[:2999].cpu(), host[:2999]) and dev[2999].item() == 0
        assert torch.equal(small_dev.cpu(), small_host)


def compile_for_hopper() -> dict:
    """The staging kernel compiled for sm_90 without a GPU (a process without
    TRITON_INTERPRET): its PTX's host-memory loads and stores."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = si._stage_kernel
    sig = {}
    for name in kernel.arg_names:
        sig[name] = "constexpr" if name.isupper() else ("i32" if name[0] == "n" else "*i32")
    src = ASTSource(kernel, sig, {"BLOCK": si.BLOCK})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    return {
        "cv_loads": len(re.findall(r"ld\.global\.cv", ptx)),
        "other_loads": len(re.findall(r"ld\.global\.(?!cv)", ptx)),
        "stores": len(re.findall(r"st\.global", ptx)),
    }


@pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.nvidia") is None,
    reason="Triton's NVIDIA backend is not installed",
)
def test_staging_kernel_compiles_for_hopper_reading_the_host_uncached():
    """Every load of the pinned buffers is ld.global.cv (no line an earlier launch cached)."""
    r = compiled_without_interpreter("test_stage_inputs", "compile_for_hopper")
    assert r["cv_loads"] >= si.MAX_SEGMENTS and r["other_loads"] == 0 and r["stores"] > 0, r

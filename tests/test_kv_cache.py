"""Block allocator, KV-cache groups, and the rewrite of block tables into kernel blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import graphattn as ga
from graphattn.kv_cache import (
    BlockAllocator,
    FullAttentionSpec,
    SlidingWindowSpec,
    choose_kernel_block_size,
    group_layers_by_spec,
    to_kernel_block_table,
)


def test_allocator_allocates_distinct_and_frees():
    alloc = BlockAllocator(10)
    a = alloc.allocate(4)
    b = alloc.allocate(6)
    assert sorted(a + b) == list(range(10)) and alloc.num_free == 0
    with pytest.raises(ga.OutOfBlocksError, match="asked for 1 KV-cache blocks but only 0"):
        alloc.allocate(1)
    alloc.free(a)
    assert alloc.num_free == 4
    assert sorted(alloc.allocate(4)) == sorted(a)


def test_a_bad_free_says_which_ids_and_why():
    alloc = BlockAllocator(4)
    ids = alloc.allocate(2)  # [0, 1]
    with pytest.raises(
        ga.OutOfBlocksError,
        match=r"cannot free block ids \[0, 0, 3, 9\]: expected distinct allocated ids; outside "
        r"\[0, 4\): \[9\]; not allocated \(free already, or never handed out\): \[3\]; given "
        r"more than once: \[0\]. Nothing was freed",
    ):
        alloc.free([ids[0], ids[0], 3, 9])
    assert alloc.num_free == 2 and alloc.in_use.tolist() == [True, True, False, False]
    with pytest.raises(ValueError, match="read-only"):
        alloc.in_use[2] = True  # a view to read, not a way to allocate


def test_allocator_rejects_bad_free_and_changes_nothing():
    alloc = BlockAllocator(4)
    ids = alloc.allocate(2)
    for bad in ([ids[0], ids[0]], [3], [7], [-1]):
        with pytest.raises(ga.OutOfBlocksError):
            alloc.free(bad)
        assert alloc.num_free == 2


@given(
    table=st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=6), min_size=1, max_size=5),
    ratio=st.sampled_from([1, 2, 4]),
)
def test_kernel_block_table_addresses_the_same_slots(table, ratio):
    """Token t of a request lands on the same cache slot through either table."""
    width = max(len(r) for r in table)
    bt = np.array([r + [0] * (width - len(r)) for r in table], dtype=np.int32)
    kernel = to_kernel_block_table(bt, ratio)
    manager_bs, kernel_bs = 16, 16 // ratio
    for row in range(bt.shape[0]):
        for t in range(width * manager_bs):
            manager_slot = bt[row, t // manager_bs] * manager_bs + t % manager_bs
            kernel_slot = kernel[row, t // kernel_bs] * kernel_bs + t % kernel_bs
            assert manager_slot == kernel_slot


def test_choose_kernel_block_size():
    assert choose_kernel_block_size(64, [16, 32], what="x") == 32
    assert choose_kernel_block_size(16, [16, 32, 64], what="x") == 16
    with pytest.raises(ga.ConfigError, match="not a multiple"):
        choose_kernel_block_size(8, [16, 32], what="x")


def test_groups_by_spec_and_common_kernel_block_size():
    full = FullAttentionSpec(64, 2, 64, torch.float16)
    local = SlidingWindowSpec(64, 2, 64, torch.float16, sliding_window=128)
    specs = {"a": full, "b": local, "c": full}
    sizes = {"a": (16, 32), "b": (), "c": (16, 32, 64)}
    groups = group_layers_by_spec(specs, sizes)
    assert [(g.layer_names, g.kernel_block_size) for g in groups] == [
        (("a", "c"), 32),
        (("b",), 64),
    ]
    assert groups[0].blocks_per_kernel_block == 2


def test_engine_rewrites_block_table_for_smaller_kernel_blocks():
    """A backend whose kernels address 16-token blocks under a 32-token manager block."""
    from helpers import TableAttentionModel, eager_engine, make_seqs, rel_err, run_with_prefixes

    from graphattn.attention.backends.torch_ref import TorchRefBackend

    class Small(TorchRefBackend):
        @staticmethod
        def get_name():
            return "TORCH_REF_KB16"

        @classmethod
        def get_supported_kernel_block_sizes(cls):
            return (16,)

    ga.register_backend(Small, {}, replace=True)
    model = TableAttentionModel(64, 4, 2, 64, backend="TORCH_REF_KB16")
    engine = eager_engine(model, block_size=32, num_blocks=16, max_model_len=128)
    assert engine.kv_cache.groups[0].kernel_block_size == 16
    assert engine.kv_cache.tensors["layers.0.attn"].shape[1:3] == (32, 16)
    seqs = make_seqs(np.random.default_rng(0), [(40, 1), (0, 50), (10, 7)], 64, 32, 16)
    out = run_with_prefixes(engine, seqs)
    expected = torch.cat([model.expected(s.ids, len(s.ids) - s.num_computed) for s in seqs])
    assert rel_err(out, expected) < 1e-5


def test_a_cache_larger_than_the_memory_is_a_config_error_before_allocating(monkeypatch):
    """A num_blocks the device cannot hold used to end in an empty MemoryError (the block
    list), a bare out-of-memory error from torch, or the process killed; now ga.compile says
    what the cache needs, what is available and how many blocks fit, before allocating."""
    from helpers import TableAttentionModel

    import graphattn.kv_cache as kv_cache_module

    allocated = []
    monkeypatch.setattr(kv_cache_module, "available_bytes", lambda device: 1 << 20)  # 1 MiB
    monkeypatch.setattr(kv_cache_module.BlockAllocator, "__init__", lambda *a: allocated.append(a))
    # 2 layers x key and value x 16 slots x 2 KV heads x 64 x fp32: 32 KiB a block
    with pytest.raises(
        ga.ConfigError,
        match=r"num_blocks=64 needs 2\.00 MiB \(32,768 bytes a block over every layer\) but cpu "
        r"has 1\.00 MiB available; at most 32 blocks would fit",
    ):
        ga.compile(TableAttentionModel(40, 4, 2, 64, num_layers=2), compile_backend="none",
                   num_blocks=64)  # fmt: skip
    assert allocated == []  # nothing was made
    # what fits is made
    monkeypatch.undo()
    engine = ga.compile(TableAttentionModel(40, 4, 2, 64, num_layers=2), compile_backend="none",
                        num_blocks=32)  # fmt: skip
    assert engine.kv_cache.nbytes == 32 * 32768


@pytest.mark.skipif(
    __import__("graphattn.kv_cache").kv_cache.available_bytes(torch.device("cpu")) is None,
    reason="no MemAvailable to read here",
)
def test_a_trillion_blocks_are_refused_on_this_host():
    from helpers import TableAttentionModel

    with pytest.raises(ga.ConfigError, match=r"num_blocks=1000000000000 needs .* GiB .* available"):
        ga.compile(TableAttentionModel(40, 4, 2, 64), compile_backend="none", num_blocks=10**12)


@pytest.mark.gpu
def test_a_cache_larger_than_the_gpu_is_refused_before_allocating():
    """On CUDA the check reads the driver's free memory plus torch's unused cache."""
    from helpers import TableAttentionModel

    from graphattn.kv_cache import available_bytes

    device = torch.device("cuda")
    free, total = torch.cuda.mem_get_info(device)
    assert free <= available_bytes(device) <= total
    model = TableAttentionModel(40, 4, 2, 64).to(device)  # 16 KiB a block (fp32, one layer)
    before = torch.cuda.memory_allocated(device)
    with pytest.raises(ga.ConfigError, match=r"GiB \(16,384 bytes a block over every layer\)"):
        ga.compile(model, compile_backend="none", num_blocks=total // 16384 + 1)
    assert torch.cuda.memory_allocated(device) == before

"""The Triton kernels against graphattn.kernels.reference and helpers.dense_attention.

On the CPU they run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET),
on small hypothesis-drawn batches with awkward sizes; the ``gpu`` tests run realistic sizes
in bf16 and replay the kernels from a CUDA graph. Outputs are NaN-poisoned before each run
so a real row the kernel forgets to write fails.

Error is the relative Frobenius error against a float32 (paged reference) or float64
(dense) computation on the same stored values. The bound is a few unit roundoffs of the
storage dtype: the kernel rounds the probabilities to it before the P.V product and rounds
the output once; everything else accumulates in fp32.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import pytest
import torch
from helpers import compiled_without_interpreter, dense_attention, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

from graphattn.kernels import attention_plan as ap
from graphattn.kernels import split_kv
from graphattn.kernels.attention_plan import TileConfig, choose_num_splits, plan_attention
from graphattn.kernels.kv_cache_write import write_kv_cache
from graphattn.kernels.reference import paged_attention_ref, write_kv_cache_ref
from graphattn.kernels.split_kv import SplitScratch
from graphattn.kernels.unified_attention import unified_attention

# 3 unit roundoffs of the storage dtype; fp32 also sums exp2 terms over long rows.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3 * 2**-11, torch.bfloat16: 3 * 2**-8}
UNUSED_BLOCK = 2**30  # block-table entries no kernel may read: far outside any cache
SLOW = settings(max_examples=12, deadline=None)


@dataclass
class PagedCase:
    """A padded batch over a paged cache filled with random values, as a runner pads it."""

    query: torch.Tensor  # [T_pad, Hq, D]
    key_cache: torch.Tensor  # [NB, BS, Hkv, D]
    value_cache: torch.Tensor
    block_table: torch.Tensor  # [R_pad, max_blocks] int32, UNUSED_BLOCK past each request
    query_start_loc: torch.Tensor  # [R_pad + 1] int32
    seq_lens: torch.Tensor  # [R_pad] int32, 0 for padding requests
    shapes: list[tuple[int, int]]  # (num_computed, num_new) of the real requests
    num_tokens: int  # real tokens

    @property
    def num_reqs(self) -> int:
        return len(self.shapes)

    def sequence_kv(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of request ``i``'s whole sequence, [S, Hkv, D], as stored."""
        seq_len = sum(self.shapes[i])
        bs = self.key_cache.shape[1]
        blocks = self.block_table[i, : -(-seq_len // bs)].long()
        k = self.key_cache[blocks].flatten(0, 1)[:seq_len]
        v = self.value_cache[blocks].flatten(0, 1)[:seq_len]
        return k, v

    def plan(self, num_splits=1, tiles=None):
        return plan_attention(
            self.query.shape[0],
            len(self.seq_lens),
            num_heads=self.query.shape[1],
            num_kv_heads=self.key_cache.shape[2],
            head_size=self.query.shape[2],
            dtype=self.query.dtype,
            device_type=self.query.device.type,
            num_splits=num_splits,
            tiles=tiles,
        )


def make_case(
    shapes,
    *,
    num_heads,
    num_kv_heads,
    head_size,
    block_size,
    dtype=torch.float32,
    device="cpu",
    seed=0,
    pad_tokens=0,
    pad_reqs=0,
) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // block_size) for c, n in shapes]
    num_blocks = sum(need) + 3  # a few blocks no request owns
    cache_shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    r, t = len(shapes), sum(n for _, n in shapes)
    block_table = torch.full((r + pad_reqs, max(need) + 2), UNUSED_BLOCK, dtype=torch.int32)
    ids = torch.randperm(num_blocks, generator=gen)
    for i, b in enumerate(need):
        block_table[i, :b] = ids[sum(need[:i]) : sum(need[:i]) + b]
    starts = [0]
    for _, n in shapes:
        starts.append(starts[-1] + n)
    # padding request i owns padding token t + i while there are any (runner._pad_buffers)
    starts += [min(t + i, t + pad_tokens) for i in range(1, pad_reqs + 1)]
    seq_lens = [c + n for c, n in shapes] + [0] * pad_reqs
    query = torch.randn(t + pad_tokens, num_heads, head_size, generator=gen).to(device, dtype)
    return PagedCase(
        query,
        key_cache,
        value_cache,
        block_table.to(device),
        torch.tensor(starts, dtype=torch.int32, device=device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        list(shapes),
        t,
    )


def run_kernel(
    case: PagedCase, plan, *, scale, window=None, soft_cap=None, fused_merge=False, scratch=None
) -> torch.Tensor:
    """The kernel's output for ``case`` under ``plan``, poisoned with NaN beforehand, as is
    the split scratch (the merge reads every split's row of each real token: a row the
    attention kernel did not write would turn its output NaN). ``fused_merge``: the splits
    merged inside the launch; ``scratch``: reuse one (its tickets must be zero)."""
    output = torch.full_like(case.query, float("nan"))
    if scratch is None:
        scratch = SplitScratch.allocate(
            case.query.shape[0], case.key_cache.shape[2], case.query.shape[2], case.query.device
        )
    scratch.out.fill_(float("nan"))
    scratch.lse.fill_(float("nan"))
    return unified_attention(
        case.query,
        case.key_cache,
        case.value_cache,
        output,
        case.block_table,
        case.query_start_loc,
        case.seq_lens,
        plan,
        scale=scale,
        sliding_window=window,
        soft_cap=soft_cap,
        scratch=scratch,
        fused_merge=fused_merge,
    )


def paged_reference(case: PagedCase, *, scale, window=None, soft_cap=None) -> torch.Tensor:
    """graphattn.kernels.reference on float32 copies of the stored values: [T, Hq, D]."""
    r = case.num_reqs
    out = torch.zeros(case.num_tokens, *case.query.shape[1:], device=case.query.device)
    return paged_attention_ref(
        case.query[: case.num_tokens].float(),
        case.key_cache.float(),
        case.value_cache.float(),
        case.block_table[:r],
        case.query_start_loc[: r + 1].tolist(),
        case.seq_lens[:r].tolist(),
        scale,
        out,
        sliding_window=window,
        soft_cap=soft_cap,
    )


def dense_reference(case: PagedCase, *, scale, window=None, soft_cap=None) -> torch.Tensor:
    """helpers.dense_attention (float64) request by request: [T, Hq, D]."""
    outs = []
    starts = case.query_start_loc.tolist()
    for i in range(case.num_reqs):
        k, v = case.sequence_kv(i)
        q = case.query[starts[i] : starts[i + 1]]
        outs.append(dense_attention(q, k, v, scale, sliding_window=window, soft_cap=soft_cap))
    return torch.cat(outs)


def assert_matches_references(case: PagedCase, out: torch.Tensor, **attn) -> None:
    real = out[: case.num_tokens]
    assert not real.isnan().any(), "a real token's row was not written"
    bound = TOLERANCE[case.query.dtype]
    assert rel_err(real, paged_reference(case, **attn)) < bound
    assert rel_err(real, dense_reference(case, **attn)) < bound


# -- strategies -------------------------------------------------------------------------


@st.composite
def request_shapes(draw, block_size: int, max_reqs: int = 4):
    """(num_computed, num_new) per request, with the awkward sizes the kernels must take."""
    kinds = st.sampled_from(["prefill", "chunked", "decode", "one", "long", "boundary"])
    out = []
    for kind in draw(st.lists(kinds, min_size=1, max_size=max_reqs)):
        if kind == "prefill":
            out.append((0, draw(st.integers(2, 40))))
        elif kind == "chunked":
            out.append((draw(st.integers(1, 60)), draw(st.integers(2, 30))))
        elif kind == "decode":
            out.append((draw(st.integers(1, 90)), 1))
        elif kind == "one":
            out.append((0, 1))
        elif kind == "long":
            out.append((0, 97))
        else:  # the sequence ends exactly on a block boundary
            blocks = draw(st.integers(1, 3))
            new = draw(st.sampled_from([1, block_size]))
            out.append((blocks * block_size - new, new))
    return out


@st.composite
def tile_configs(draw, group: int):
    """Tiles smaller, equal and larger than a cache block; block_m a multiple of the group."""
    group_pad = 1 << (group - 1).bit_length()
    block_m = draw(st.sampled_from([m for m in (16, 32, 64) if m >= group_pad]))
    return TileConfig(block_m, draw(st.sampled_from([16, 32, 64])), 4, 1)


# -- unified attention ------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    block_size=st.sampled_from([16, 32]),
    gqa=st.sampled_from([1, 2, 4]),
    num_kv_heads=st.sampled_from([1, 2]),
    head_size=st.sampled_from([64, 80, 96, 128]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    num_splits=st.sampled_from([1, 2, 3]),
    pad=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    seed=st.integers(0, 2**16),
    fused_merge=st.booleans(),
)
def test_unified_attention_matches_references(
    data, block_size, gqa, num_kv_heads, head_size, dtype, num_splits, pad, seed, fused_merge
):
    shapes = data.draw(request_shapes(block_size))
    tiles = data.draw(tile_configs(gqa))
    case = make_case(
        shapes,
        num_heads=gqa * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
        pad_tokens=pad[0],
        pad_reqs=pad[1],
    )
    plan = case.plan(num_splits, tiles)
    out = run_kernel(case, plan, scale=head_size**-0.5, fused_merge=fused_merge)
    assert_matches_references(case, out, scale=head_size**-0.5)


@SLOW
@given(
    data=st.data(),
    window=st.sampled_from([1, 7, 20, 40]),
    soft_cap=st.sampled_from([None, 2.0, 30.0]),
    gqa=st.sampled_from([1, 4]),
    num_splits=st.sampled_from([1, 3]),
    seed=st.integers(0, 2**16),
)
def test_sliding_window_and_soft_cap(data, window, soft_cap, gqa, num_splits, seed):
    shapes = data.draw(request_shapes(16))
    case = make_case(
        shapes, num_heads=2 * gqa, num_kv_heads=2, head_size=64, block_size=16, seed=seed
    )
    attn = dict(scale=0.125, window=window, soft_cap=soft_cap)
    out = run_kernel(case, case.plan(num_splits), **attn)
    assert_matches_references(case, out, **attn)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize(("head_size", "block_size"), [(80, 16), (96, 32), (256, 64)])
def test_awkward_batch(num_splits, head_size, block_size):
    """One token, 97 tokens, a decode and a chunk ending on a block boundary, padding."""
    shapes = [(0, 1), (0, 97), (2 * block_size - 1, 1), (block_size, block_size), (5, 1)]
    case = make_case(
        shapes,
        num_heads=4,
        num_kv_heads=2,
        head_size=head_size,
        block_size=block_size,
        pad_tokens=3,
        pad_reqs=2,
    )
    out = run_kernel(case, case.plan(num_splits), scale=0.1)
    assert_matches_references(case, out, scale=0.1)


@pytest.mark.parametrize(("kind", "num_splits"), [("decode", 5), ("mixed", 2)])
def test_fused_split_merge_matches_the_reduction_kernel(kind, num_splits, monkeypatch):
    """GRAPHATTN_FUSED_SPLIT_MERGE's path: the tile's last split program merges. The same rows
    as the reduction kernel's (which must not run), padding rows included, every ticket back
    at 0, and a second launch on the same scratch the same again."""
    if kind == "decode":
        shapes, pad = [(0, 1), (15, 1), (16, 1), (40, 1), (7, 1)], (2, 2)
    else:
        shapes, pad = [(0, 1), (0, 37), (31, 1), (16, 16), (5, 1)], (3, 2)
    case = make_case(
        shapes, num_heads=8, num_kv_heads=2, head_size=64, block_size=16, seed=11,
        pad_tokens=pad[0], pad_reqs=pad[1],
    )  # fmt: skip
    plan = case.plan(num_splits)
    ref = run_kernel(case, plan, scale=0.125)
    scratch = SplitScratch.allocate(case.query.shape[0], 2, 64, case.query.device)
    calls = []
    monkeypatch.setattr(split_kv, "reduce_splits", lambda *a, **k: calls.append(a))
    for _ in range(2):
        out = run_kernel(case, plan, scale=0.125, fused_merge=True, scratch=scratch)
        assert calls == []  # no reduction launched
        assert torch.count_nonzero(scratch.tickets) == 0
        n = case.num_tokens
        assert not out[:n].isnan().any()
        assert rel_err(out[:n], ref[:n]) < 1e-6
        # padding rows as the reduction leaves them: zero for padding requests (no keys),
        # untouched (NaN) past them
        assert torch.equal(out[n:].nan_to_num(7.0), ref[n:].nan_to_num(7.0))
        assert_matches_references(case, out, scale=0.125)


def test_fused_split_merge_needs_tickets():
    case = make_case([(40, 1)], num_heads=2, num_kv_heads=2, head_size=64, block_size=16)
    plan = case.plan(4)
    scratch = SplitScratch.allocate(1, 2, 64, case.query.device)
    small = dataclasses.replace(scratch, tickets=scratch.tickets[:1])
    with pytest.raises(ValueError, match="a ticket per"):
        run_kernel(case, plan, scale=0.1, fused_merge=True, scratch=small)
    wrong = dataclasses.replace(scratch, tickets=scratch.tickets.float())
    with pytest.raises(ValueError, match="contiguous int32"):
        run_kernel(case, plan, scale=0.1, fused_merge=True, scratch=wrong)
    run_kernel(case, plan, scale=0.1, fused_merge=False, scratch=small)  # unused without it


def test_fused_split_merge_env(monkeypatch):
    monkeypatch.setenv(split_kv.MERGE_ENV, "2")
    split_kv.fused_merge.cache_clear()
    try:
        with pytest.raises(ValueError, match="must be 0 or 1"):
            split_kv.fused_merge()
        monkeypatch.setenv(split_kv.MERGE_ENV, "1")
        split_kv.fused_merge.cache_clear()
        assert split_kv.fused_merge() and "last split program" in split_kv.describe_merge()
        monkeypatch.delenv(split_kv.MERGE_ENV)
        split_kv.fused_merge.cache_clear()
        assert not split_kv.fused_merge() and "reduction kernel" in split_kv.describe_merge()
    finally:
        split_kv.fused_merge.cache_clear()


def test_padding_requests_without_tokens():
    """More padding requests than padding tokens: the last ones own zero tokens."""
    case = make_case(
        [(3, 1), (0, 5)],
        num_heads=2,
        num_kv_heads=2,
        head_size=64,
        block_size=16,
        pad_tokens=1,
        pad_reqs=4,
    )
    assert case.query_start_loc.tolist() == [0, 1, 6, 7, 7, 7, 7]
    for splits in (1, 2):
        assert_matches_references(case, run_kernel(case, case.plan(splits), scale=0.1), scale=0.1)


# -- launch plans -----------------------------------------------------------------------


@given(
    query_lens=st.lists(st.integers(0, 300), min_size=1, max_size=40),
    extra_tokens=st.integers(0, 50),
    extra_reqs=st.integers(0, 10),
    group=st.sampled_from([1, 2, 3, 4, 8, 16, 64]),
    decode_tiles=st.booleans(),
)
def test_grid_covers_every_query_tile(query_lens, extra_tokens, extra_reqs, group, decode_tiles):
    """Request i's tiles start at query_start_loc[i] // block_q + i and fit in the grid for
    every batch padded to the plan's sizes."""
    t, r = sum(query_lens), len(query_lens)
    num_tokens, num_reqs = t + extra_tokens, r + extra_reqs
    tiles = TileConfig(max(16, 1 << (group - 1).bit_length()), 32, 4, 1) if decode_tiles else None
    plan = plan_attention(
        num_tokens,
        num_reqs,
        num_heads=group,
        num_kv_heads=1,
        head_size=128,
        dtype=torch.bfloat16,
        device_type="cuda",
        tiles=tiles,
    )
    start, first_free = 0, 0
    for i, q in enumerate(query_lens):
        first_tile = start // plan.block_q + i
        assert first_tile >= first_free  # requests' tile ranges do not overlap
        first_free = first_tile + -(-q // plan.block_q)
        start += q
    assert first_free <= plan.grid[0]


def test_plan_is_a_function_of_padded_sizes():
    kw = dict(
        num_heads=32,
        num_kv_heads=8,
        head_size=128,
        dtype=torch.bfloat16,
        device_type="cuda",
        num_splits=4,
    )
    assert plan_attention(64, 64, **kw) == plan_attention(64, 64, **kw)
    decode, mixed = plan_attention(64, 64, **kw), plan_attention(512, 64, **kw)
    assert decode.tiles.block_m == 16 and mixed.tiles.block_m == 128
    assert decode.grid == (64 // 4 + 64, 8, 4)
    # a padded uniform decode batch (more padding tokens than padding requests)
    assert plan_attention(72, 64, uniform_decode=True, **kw).tiles.block_m == 16
    # speculative-decoding verify batches: 4 tokens x 4 heads fill one decode tile; 5 do not
    verify = plan_attention(256, 64, uniform_query_len=4, **kw)
    assert verify.tiles == decode.tiles and verify.block_q == 4
    assert verify.grid == (256 // 4 + 64, 8, 4)
    assert plan_attention(320, 64, uniform_query_len=5, **kw).tiles == mixed.tiles


@given(
    num_reqs=st.integers(1, 256),
    num_kv_heads=st.sampled_from([1, 2, 8]),
    num_sms=st.sampled_from([4, 132]),
)
def test_splits_fill_the_gpu(num_reqs, num_kv_heads, num_sms):
    splits = choose_num_splits(num_reqs, num_kv_heads, num_sms)
    work = num_reqs * num_kv_heads
    assert 1 <= splits <= ap.MAX_SPLITS
    if work >= ap.WAVES * num_sms:
        assert splits == 1
    elif splits < ap.MAX_SPLITS:
        assert work * splits >= ap.WAVES * num_sms


def test_splits_are_capped_by_the_scratch():
    plan = plan_attention(
        8,
        8,
        num_heads=32,
        num_kv_heads=1,
        head_size=64,
        dtype=torch.float16,
        device_type="cpu",
        num_splits=32,
    )
    assert plan.num_splits == ap.SPLIT_SLOTS // 32


# -- launcher checks --------------------------------------------------------------------


def _small_case():
    return make_case([(3, 2)], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)


def test_launcher_rejects_bad_arguments():
    case = _small_case()
    plan = case.plan()
    args = dict(
        query=case.query,
        key_cache=case.key_cache,
        value_cache=case.value_cache,
        output=torch.empty_like(case.query),
        block_table=case.block_table,
        query_start_loc=case.query_start_loc,
        seq_lens=case.seq_lens,
        plan=plan,
        scale=0.1,
    )
    with pytest.raises(
        TypeError, match=r"block_table must have dtype in \(torch.int32\), got torch.int64"
    ):
        unified_attention(**{**args, "block_table": case.block_table.long()})
    with pytest.raises(TypeError, match="output must have dtype"):
        unified_attention(**{**args, "output": torch.empty_like(case.query, dtype=torch.float16)})
    strided = torch.empty(*case.query.shape, 2).select(-1, 0)
    with pytest.raises(ValueError, match="query must be contiguous in its last dimension"):
        unified_attention(**{**args, "query": strided, "output": torch.empty_like(strided)})
    with pytest.raises(ValueError, match=r"key_cache dim 2 \(num_kv_heads\) must be 2, got 4"):
        wide = torch.randn(4, 16, 4, 64)
        unified_attention(**{**args, "key_cache": wide, "value_cache": wide})
    with pytest.raises(ValueError, match="one device"):
        unified_attention(**{**args, "seq_lens": case.seq_lens.to("meta")})
    with pytest.raises(ValueError, match="needs a SplitScratch"):
        unified_attention(**{**args, "plan": case.plan(num_splits=2)})


# -- KV-cache write ---------------------------------------------------------------------


@settings(max_examples=10, deadline=None)
@given(
    num_tokens=st.integers(1, 40),
    num_kv_heads=st.sampled_from([1, 2, 3, 8]),
    head_size=st.sampled_from([64, 80, 96]),
    block_size=st.sampled_from([16, 32]),
    dtypes=st.sampled_from(
        [
            (torch.float32, torch.float32),
            (torch.bfloat16, torch.bfloat16),
            (torch.float32, torch.float16),
        ]
    ),
    seed=st.integers(0, 2**16),
)
def test_kv_cache_write_matches_reference(
    num_tokens, num_kv_heads, head_size, block_size, dtypes, seed
):
    gen = torch.Generator().manual_seed(seed)
    in_dtype, cache_dtype = dtypes
    num_blocks = -(-num_tokens // block_size) + 2
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    cache = cache.to(cache_dtype)
    # key and value as strided views of one fused projection, as a model produces them
    kv = torch.randn(num_tokens, 3 * num_kv_heads, head_size, generator=gen).to(in_dtype)
    key, value = kv[:, :num_kv_heads], kv[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.3] = -1  # padding tokens
    expected = cache.clone()
    write_kv_cache_ref(key, value, expected[0], expected[1], slots)
    write_kv_cache(key, value, cache[0], cache[1], slots)
    assert torch.equal(cache, expected)


def test_kv_cache_write_of_keys_only():
    """value and value_cache None (MLA's latent entries): each slot gets its key, written
    once; padding tokens and every other slot keep what they held."""
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(3, 4, 1, 96, generator=gen)  # [NB, BS, 1, entry]
    key = torch.randn(5, 1, 96, generator=gen)
    slots = torch.tensor([7, -1, 0, 11, 2])
    expected = cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expected[s // 4, s % 4] = key[t]
    write_kv_cache(key, None, cache, None, slots)
    assert torch.equal(cache, expected)
    with pytest.raises(ValueError, match="value and value_cache go together"):
        write_kv_cache(key, key, cache, None, slots)
    with pytest.raises(ValueError, match="value and value_cache go together"):
        write_kv_cache(key, None, cache, cache, slots)
    assert torch.equal(cache, expected)  # the refused calls wrote nothing


def new_kv_inputs(case: PagedCase, seed: int):
    """``(key, value, slot_mapping)`` of ``case``'s decodes: random keys and values as strided
    views of one fused projection, as a model produces them, and each token's slot."""
    gen = torch.Generator().manual_seed(seed)
    t_pad, hkv, d = case.query.shape[0], case.key_cache.shape[2], case.query.shape[2]
    kv = torch.randn(t_pad, 2 * hkv, d, generator=gen).to(case.query.device, case.query.dtype)
    bs = case.key_cache.shape[1]
    slots = torch.full((t_pad,), -1, dtype=torch.int64)
    for i, (computed, new) in enumerate(case.shapes):
        assert new == 1, "new_kv is for decodes"
        slots[i] = int(case.block_table[i, computed // bs]) * bs + computed % bs
    return kv[:, :hkv], kv[:, hkv:], slots.to(case.query.device)


def decode_with_new_kv(case: PagedCase, plan, *, scale, seed, window=None, fused_merge=False):
    """Run ``case`` (decodes) twice from the same cache: write_kv_cache then attention, and
    attention with ``new_kv`` (the write inside the launch; ``fused_merge``: and the splits
    merged inside it). Returns both (output, caches).
    """
    key, value, slots = new_kv_inputs(case, seed)
    t_pad, hkv, d = case.query.shape[0], case.key_cache.shape[2], case.query.shape[2]
    results = []
    for fused in (False, True):
        caches = (case.key_cache.clone(), case.value_cache.clone())
        output = torch.full_like(case.query, float("nan"))
        scratch = SplitScratch.allocate(t_pad, hkv, d, case.query.device)
        if not fused:
            write_kv_cache(key, value, *caches, slots)
        out = unified_attention(
            case.query, *caches, output, case.block_table, case.query_start_loc, case.seq_lens,
            plan, scale=scale, sliding_window=window, scratch=scratch,
            new_kv=(key, value, slots) if fused else None, fused_merge=fused and fused_merge,
        )  # fmt: skip
        results.append((out, caches))
    return results


@pytest.mark.parametrize(
    ("num_splits", "fused_merge"), [(1, False), (3, False), (8, False), (8, True)]
)
@pytest.mark.parametrize("window", [None, 5])
def test_decode_launch_writes_the_new_keys_and_values(num_splits, fused_merge, window):
    """new_kv: the cache ends exactly as write_kv_cache leaves it, and attention reads the
    new token (every real row equals the two-launch result), padding included.
    """
    shapes = [(0, 1), (15, 1), (16, 1), (40, 1), (7, 1)]
    case = make_case(
        shapes, num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seed=3,
        pad_tokens=2, pad_reqs=2,
    )  # fmt: skip
    (ref, ref_caches), (out, caches) = decode_with_new_kv(
        case, case.plan(num_splits), scale=0.125, seed=4, window=window, fused_merge=fused_merge
    )
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])
    assert not torch.equal(ref_caches[0], case.key_cache)  # the write did change the cache
    real = out[: case.num_tokens]
    assert not real.isnan().any()
    assert rel_err(real, ref[: case.num_tokens]) < 1e-6


def test_new_kv_is_checked():
    case = make_case([(3, 1)], num_heads=2, num_kv_heads=2, head_size=64, block_size=16)
    key = torch.randn(1, 2, 64)
    args = (case.key_cache, case.value_cache, torch.empty_like(case.query), case.block_table,
            case.query_start_loc, case.seq_lens, case.plan())  # fmt: skip
    with pytest.raises(TypeError, match="slot_mapping must have dtype"):
        unified_attention(case.query, *args, scale=0.1, new_kv=(key, key, torch.zeros(1)))
    with pytest.raises(ValueError, match="key_cache dim 3"):
        other = torch.randn(1, 2, 32)
        unified_attention(
            case.query, *args, scale=0.1, new_kv=(other, other, torch.zeros(1, dtype=torch.int64))
        )


def test_kv_cache_write_rejects_bad_arguments():
    cache = torch.zeros(2, 4, 16, 2, 64)
    key = torch.randn(3, 2, 64)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(TypeError, match="slot_mapping must have dtype"):
        write_kv_cache(key, key, cache[0], cache[1], slots.float())
    with pytest.raises(ValueError, match=r"slot_mapping dim 0 \(num_tokens\) must be at least 3"):
        write_kv_cache(key, key, cache[0], cache[1], slots[:2])
    with pytest.raises(ValueError, match=r"key_cache dim 3 \(head_size\) must be 64, got 80"):
        other = torch.zeros(2, 4, 16, 2, 80)
        write_kv_cache(key, key, other[0], other[1], slots)


# -- GPU: realistic sizes, bf16, both paths, graph replay ----------------------------------


def _gpu_case(shapes, seed, **kw):
    kw = {"num_heads": 32, "num_kv_heads": 8, "head_size": 128, "block_size": 16, **kw}
    return make_case(shapes, dtype=kw.pop("dtype", torch.bfloat16), device="cuda", seed=seed, **kw)


def _check_against_paged_reference(case, out, **attn):
    real = out[: case.num_tokens]
    assert not real.isnan().any(), "a real token's row was not written"
    assert rel_err(real, paged_reference(case, **attn)) < TOLERANCE[case.query.dtype]


MIXED = [(0, 1), (4000, 1), (8191, 1), (0, 1500), (2000, 517), (1023, 1), (15, 17)]


@pytest.mark.gpu
@pytest.mark.parametrize(("num_splits", "fused_merge"), [(1, False), (8, False), (8, True)])
@pytest.mark.parametrize("kind", ["mixed", "decode"])
def test_gpu_realistic_bf16(kind, num_splits, fused_merge):
    gen = torch.Generator().manual_seed(7)
    if kind == "mixed":
        shapes = MIXED
    else:
        shapes = [(int(c), 1) for c in torch.randint(1, 8192, (64,), generator=gen)]
    pad_tokens = 5 if kind == "mixed" else 3  # a padded decode batch keeps tokens == requests
    case = _gpu_case(shapes, seed=1, pad_tokens=pad_tokens, pad_reqs=3)
    out = run_kernel(case, case.plan(num_splits), scale=128**-0.5, fused_merge=fused_merge)
    _check_against_paged_reference(case, out, scale=128**-0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize(
    ("dtype", "head_size", "block_size", "attn"),
    [
        (torch.bfloat16, 64, 16, {}),
        (torch.float16, 80, 32, {"window": 100}),
        (torch.bfloat16, 96, 64, {"soft_cap": 20.0}),
        (torch.float32, 128, 32, {}),
        (torch.bfloat16, 256, 16, {"window": 700, "soft_cap": 30.0}),
        (torch.float16, 128, 64, {}),
    ],
)
def test_gpu_head_sizes_and_dtypes(dtype, head_size, block_size, attn, num_splits):
    """Every head size, dtype and block size compiles and is right, one variant each."""
    shapes = [(0, 300), (700, 1), (64, 64), (0, 1), (1999, 1)]
    case = _gpu_case(shapes, seed=2, num_heads=8, num_kv_heads=2, head_size=head_size,
                     block_size=block_size, dtype=dtype, pad_tokens=2, pad_reqs=2)  # fmt: skip
    out = run_kernel(case, case.plan(num_splits), scale=head_size**-0.5, **attn)
    _check_against_paged_reference(case, out, scale=head_size**-0.5, **attn)


@pytest.mark.gpu
@pytest.mark.parametrize(("num_splits", "fused_merge"), [(1, False), (8, False), (8, True)])
def test_gpu_graph_replay_serves_every_batch_of_its_size(num_splits, fused_merge):
    """Capture one launch for a padded size, then replay it for other batches of that size
    (a fused merge's tickets are back at zero after every replay)."""
    pad_tokens, pad_reqs = 40, 4
    first = _gpu_case(
        [(100, 1), (0, 50), (3000, 1)], seed=3, pad_tokens=pad_tokens, pad_reqs=pad_reqs
    )
    static = make_static_copy(first)
    copy_into(static, first)
    plan = first.plan(num_splits)
    output = torch.full_like(first.query, float("nan"))
    scratch = SplitScratch.allocate(plan.num_tokens, 8, 128, torch.device("cuda"))
    launch = lambda: unified_attention(  # noqa: E731
        static.query, static.key_cache, static.value_cache, output, static.block_table,
        static.query_start_loc, static.seq_lens, plan, scale=0.09, scratch=scratch,
        fused_merge=fused_merge,
    )  # fmt: skip
    launch()  # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    # Batches of other lengths padded to the same 92 tokens and 7 requests.
    for seed, shapes in enumerate([[(5000, 1), (7, 60), (0, 30)], [(0, 90), (1, 1), (2, 1)]]):
        other = _gpu_case(shapes, seed=10 + seed, pad_tokens=0, pad_reqs=0)
        other = repad(other, first.query.shape[0], len(first.seq_lens))
        copy_into(static, other)
        output.fill_(float("nan"))
        for _ in range(3):  # replays after the first start from the tickets it left
            graph.replay()
        _check_against_paged_reference(other, output, scale=0.09)
        assert torch.count_nonzero(scratch.tickets) == 0


@dataclass
class _Static:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor


def make_static_copy(case: PagedCase) -> _Static:
    """Buffers large enough for any case of the same padded size (a graph reads them by address)."""
    cache_shape = (4096, *case.key_cache.shape[1:])
    return _Static(
        case.query.clone(),
        torch.randn(cache_shape, device="cuda").to(case.key_cache.dtype),
        torch.randn(cache_shape, device="cuda").to(case.key_cache.dtype),
        torch.full((len(case.seq_lens), 512), UNUSED_BLOCK, dtype=torch.int32, device="cuda"),
        case.query_start_loc.clone(),
        case.seq_lens.clone(),
    )


def repad(case: PagedCase, num_tokens: int, num_reqs: int) -> PagedCase:
    """``case`` padded to ``num_tokens`` and ``num_reqs`` the way the runner pads."""
    t, r = case.num_tokens, case.num_reqs
    assert t <= num_tokens and r <= num_reqs
    starts = case.query_start_loc.tolist() + [
        min(t + i, num_tokens) for i in range(1, num_reqs - r + 1)
    ]
    query = torch.cat(
        [
            case.query,
            torch.randn(num_tokens - t, *case.query.shape[1:], device="cuda").to(case.query.dtype),
        ]
    )
    table = torch.full(
        (num_reqs, case.block_table.shape[1]), UNUSED_BLOCK, dtype=torch.int32, device="cuda"
    )
    table[:r] = case.block_table
    return PagedCase(
        query, case.key_cache, case.value_cache, table,
        torch.tensor(starts, dtype=torch.int32, device="cuda"),
        torch.cat([case.seq_lens, torch.zeros(num_reqs - r, dtype=torch.int32, device="cuda")]),
        case.shapes, t,
    )  # fmt: skip


def copy_into(static: _Static, case: PagedCase) -> None:
    nb = case.key_cache.shape[0]
    static.query.copy_(case.query)
    static.key_cache[:nb].copy_(case.key_cache)
    static.value_cache[:nb].copy_(case.value_cache)
    static.block_table.fill_(UNUSED_BLOCK)
    static.block_table[:, : case.block_table.shape[1]].copy_(case.block_table)
    static.query_start_loc.copy_(case.query_start_loc)
    static.seq_lens.copy_(case.seq_lens)
    # the case now reads the static cache (its blocks were copied to the same ids)
    case.key_cache, case.value_cache = static.key_cache, static.value_cache
    case.block_table = static.block_table


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 8])
def test_gpu_decode_launch_writes_the_new_keys_and_values(num_splits):
    gen = torch.Generator().manual_seed(9)
    shapes = [(int(c), 1) for c in torch.randint(0, 4096, (64,), generator=gen)]
    case = _gpu_case(shapes, seed=2, head_size=64, pad_tokens=3, pad_reqs=3)
    (ref, ref_caches), (out, caches) = decode_with_new_kv(
        case, case.plan(num_splits), scale=0.125, seed=5
    )
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])
    real = out[: case.num_tokens]
    assert not real.isnan().any()
    assert rel_err(real, ref[: case.num_tokens]) < 1e-6


@pytest.mark.gpu
def test_gpu_kv_cache_write_matches_reference():
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(2, 512, 16, 8, 128, generator=gen).to("cuda", torch.bfloat16)
    key, value = (torch.randn(3000, 8, 128, generator=gen).to("cuda", torch.bfloat16) for _ in "kv")
    slots = torch.randperm(512 * 16, generator=gen)[:3000].cuda()
    slots[::7] = -1
    expected = cache.clone()
    write_kv_cache_ref(key, value, expected[0], expected[1], slots)
    write_kv_cache(key, value, cache[0], cache[1], slots)
    assert torch.equal(cache, expected)


# -- CPU: the CUDA launches compile for Hopper --------------------------------------------

# (dtype, head_size, query heads per KV head, tokens for 64 requests, splits, sliding, soft-cap,
# splits merged in the launch, o_proj's output zeroed for the folded reduction)
HOPPER_LAUNCHES = [
    (torch.bfloat16, 128, 4, 64, 1, False, False, False, False),  # decode
    (torch.bfloat16, 128, 4, 64, 4, False, False, False, False),  # decode, split-KV
    (torch.bfloat16, 128, 4, 64, 4, False, False, True, False),  # split-KV merged in the launch
    (torch.bfloat16, 64, 4, 64, 16, False, False, True, False),  # the same, the benchmark's shape
    (torch.bfloat16, 64, 4, 64, 16, False, False, False, True),  # o_proj folded (zeroes its row)
    (torch.bfloat16, 128, 4, 4096, 1, False, False, False, False),  # prefill
    (torch.bfloat16, 80, 8, 4096, 1, True, True, False, False),  # prefill, window and soft-cap
    (torch.float16, 256, 2, 4096, 1, False, False, False, False),
    (torch.float16, 64, 1, 64, 2, False, False, False, False),
    (torch.float32, 128, 4, 4096, 1, False, False, False, False),
]


def compile_for_hopper() -> list[dict]:
    """Compile the launches the backend picks on CUDA for sm_90, without a GPU: the shared
    memory each needs and the bytes its registers spill (None without cuobjdump).

    Runs in a process without TRITON_INTERPRET (kernels defined for compilation).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from graphattn.kernels import split_kv
    from graphattn.kernels import unified_attention as ua

    results = []
    for (
        dtype,
        head_size,
        group,
        tokens,
        splits,
        sliding,
        soft_cap,
        merge,
        o_proj,
    ) in HOPPER_LAUNCHES:
        plan = plan_attention(
            tokens, 64, num_heads=8 * group, num_kv_heads=8, head_size=head_size, dtype=dtype,
            device_type="cuda", num_splits=splits,
        )  # fmt: skip
        constants = ua.kernel_constants(
            plan, block_size=16, dtype=dtype, device_type="cuda", sliding=sliding,
            soft_cap=soft_cap, pdl=True, merge=merge,  # as launched on Hopper (kernels/pdl.py)
            o_proj=o_proj,
        )  # fmt: skip
        constants["WRITE_KV"] = tokens == 64  # decodes write the new keys in the launch
        options = {k: constants.pop(k) for k in ("num_warps", "num_stages")}
        kernel = ua._attention_kernel
        src = ASTSource(kernel, _signature(kernel, dtype), constants, _aligned(kernel))
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        name = f"{dtype} D{head_size} G{group} T{tokens} S{splits} sw={sliding} cap={soft_cap}"
        name += " merged" * merge + " o_proj" * o_proj
        ptx = compiled.asm["ptx"]
        results.append(
            dict(
                case=name,
                shared=compiled.metadata.shared,
                spill=_spill(compiled),
                merge=merge,
                # the arrival count and the merge's reads through L2 (split_kv.merge_if_last)
                acq_rel_atomics=len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", ptx)),
                cg_loads=len(re.findall(r"ld\.global\.cg", ptx)),
            )
        )
    reduce = ASTSource(
        split_kv._reduce_kernel,
        _signature(split_kv._reduce_kernel, torch.bfloat16),
        dict(HEAD_SIZE=128, D_PAD=128, S_PAD=32, PDL=True),
        _aligned(split_kv._reduce_kernel),
    )
    compiled = triton.compile(reduce, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    results.append(dict(case="reduce", shared=compiled.metadata.shared, spill=_spill(compiled)))
    # a verify batch (4 tokens a request) on the decode tiles, its keys written apart
    plan = plan_attention(
        256, 64, num_heads=32, num_kv_heads=8, head_size=64, dtype=torch.bfloat16,
        device_type="cuda", num_splits=4, uniform_query_len=4,
    )  # fmt: skip
    constants = ua.kernel_constants(
        plan, block_size=16, dtype=torch.bfloat16, device_type="cuda", sliding=False,
        soft_cap=False, pdl=True,
    )  # fmt: skip
    constants["WRITE_KV"] = False
    options = {k: constants.pop(k) for k in ("num_warps", "num_stages")}
    kernel = ua._attention_kernel
    src = ASTSource(kernel, _signature(kernel, torch.bfloat16), constants, _aligned(kernel))
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    results.append(
        dict(case="verify G4 x4", shared=compiled.metadata.shared, spill=_spill(compiled))
    )

    from graphattn.kernels import mla_attention

    mla = mla_attention._mla_kernel  # DeepSeek-V2's entry (512 + 64) and a small one
    for dtype, rank, rope, split, heads in (
        (torch.bfloat16, 512, 64, True, 16),
        (torch.bfloat16, 512, 64, False, 16),
        (torch.float16, 512, 64, True, 16),
        (torch.float32, 512, 64, True, 16),
        (torch.bfloat16, 64, 16, True, 16),
        (torch.bfloat16, 8, 8, True, 16),  # a rank below tl.dot's 16, padded
        (torch.bfloat16, 512, 64, True, 4),  # the causal kernel's tiles of 4 tokens x 4 heads
    ):
        for mixed in (False, True) if heads == 16 else (True,):
            constants = mla_attention.kernel_constants(rank, rope, dtype, 16, split, "cuda")
            options = {k: constants.pop(k) for k in ("num_warps", "num_stages")}
            per = mla_attention.heads_per_tile(heads) if mixed else mla_attention.BLOCK_H
            constants |= dict(HEADS=per, BLOCK_Q=mla_attention.BLOCK_H // per, MIXED=mixed)
            src = ASTSource(mla, _signature(mla, dtype), constants, _aligned(mla))
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
            kind = f"causal {mla_attention.BLOCK_H // per} x {per}" if mixed else "decode"
            name = f"mla {kind} {dtype} {rank}+{rope} split={split}"
            results.append(dict(case=name, shared=compiled.metadata.shared, spill=_spill(compiled)))
    folded = split_kv._reduce_o_proj_kernel  # every group width it folds, as launched
    for group in (1, 2, 4, 8, 16):
        for head_size in (64, 128, 256):
            block_n = split_kv.o_proj_block_n(group, head_size)
            if block_n is None:
                continue
            constants = dict(
                NUM_SPLITS=16, TILE_N=128, ONE_TOKEN=True, GROUP=group, G_PAD=group,
                HEAD_SIZE=head_size, D_PAD=head_size, BLOCK_N=block_n, PDL=True,
            )  # fmt: skip
            src = ASTSource(folded, _signature(folded, torch.bfloat16), constants, _aligned(folded))
            options = {"num_warps": split_kv.O_PROJ_WARPS}
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
            ptx = compiled.asm["ptx"]
            results.append(
                dict(
                    case=f"reduce + o_proj G{group} D{head_size} rows {block_n}",
                    shared=compiled.metadata.shared,
                    spill=_spill(compiled),
                    # its adds into the fp32 row: relaxed reductions (no value returned)
                    relaxed_adds=len(re.findall(r"red\.global\.gpu\.relaxed\.add\.f32", ptx)),
                )
            )
    return results


def _signature(kernel, dtype) -> dict[str, str]:
    element = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    ints = ("block_table_ptr", "query_start_loc_ptr", "seq_lens_ptr", "tickets_ptr")
    sig = {}
    for name in kernel.arg_names:
        if name.isupper():
            sig[name] = "constexpr"
        elif name.startswith("part_") or name in ("zero_ptr", "y_ptr"):
            sig[name] = "*fp32"
        elif name == "slot_ptr":
            sig[name] = "*i64"
        elif name.endswith("_ptr"):
            sig[name] = "*i32" if name in ints else f"*{element}"
        else:
            sig[name] = "fp32" if name.endswith("_scale") else "i32"
    return sig


def _aligned(kernel) -> dict:
    """Pointers and strides divisible by 16, as torch allocations and these layouts give."""
    names = kernel.arg_names
    return {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if n.endswith("_ptr") or n.startswith("stride")
    }


def _spill(compiled) -> int | None:
    """Local-memory bytes per thread (register spills), from cuobjdump's resource usage."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True
        )
    match = re.search(r"STACK:(\d+)", usage.stdout)
    return int(match.group(1)) if match else None


@pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.nvidia") is None,
    reason="Triton's NVIDIA backend is not installed",
)
def test_cuda_launches_compile_for_hopper():
    """CI has no GPU: compile what the GPU will run, for sm_90, and check it fits."""
    results = compiled_without_interpreter("test_kernels", "compile_for_hopper")
    for r in results:
        assert r["shared"] <= 227 * 1024, r  # an H100/H200 block's shared-memory limit
        assert r["spill"] in (0, None), r
        if "merge" in r:  # one acquire-release arrival a program, only where splits merge
            assert r["acq_rel_atomics"] == (1 if r["merge"] else 0), r
            assert (r["cg_loads"] > 0) == r["merge"], r
        if r["case"].startswith("reduce + o_proj"):
            assert r["relaxed_adds"] > 0, r
    folded = [r["case"] for r in results if r["case"].startswith("reduce + o_proj")]
    assert len(folded) == 12 and "reduce + o_proj G4 D64 rows 64" in folded
    assert sum(r["case"].startswith("mla decode") for r in results) == 6
    assert sum(r["case"].startswith("mla causal") for r in results) == 7

"""check_batch's decode fast path agrees with the general checks on every batch, and both
return the longest sequence of a good batch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import graphattn as ga
from graphattn.kv_cache import BlockAllocator
from graphattn.validation import (
    BatchLimits,
    CheckedBatch,
    _all_equal,
    _check_decode,
    _check_general,
    _check_shapes,
    check_batch,
    check_step,
)

LIMITS = BatchLimits(
    max_num_seqs=8, max_num_tokens=8, max_model_len=64, block_size=16, num_blocks=10, vocab_size=50
)


def _outcome(check, batch: ga.Batch) -> str:
    try:
        longest = check(batch, LIMITS)
    except ga.InvalidBatchError as e:
        return str(e)
    if isinstance(longest, CheckedBatch):  # the decode path also hands the written blocks on
        blocks = longest.decode_blocks
        if blocks is not None:  # in the requests' order, as the input fill reads them
            computed = batch.num_computed_tokens
            expected = batch.block_table[np.arange(batch.num_reqs), computed // LIMITS.block_size]
            np.testing.assert_array_equal(blocks, expected)
        longest = longest.longest
    assert longest == int(batch.seq_lens.max())  # what the runner sizes the step by
    return "ok"


@st.composite
def decode_batches(draw):
    """One-token requests whose values stray just outside every limit now and then."""
    r = draw(st.integers(1, 6))
    width = draw(st.integers(1, 5))

    def mostly(good, any_value, n):  # about three draws in four are good
        value = st.one_of(good, good, good, any_value)
        return draw(st.lists(value, min_size=n, max_size=n))

    computed = np.array(
        mostly(st.integers(0, 16 * width - 1), st.integers(-2, 70), r), dtype=np.int32
    )
    table = np.array(mostly(st.integers(0, 9), st.integers(-1, 11), r * width), np.int32)
    num_block_ids = np.array(mostly(st.just(width), st.integers(0, width), r), np.int32)
    tokens = np.array(mostly(st.integers(0, 49), st.integers(-1, 51), r), np.int64)
    table = table.reshape(r, width)
    return ga.Batch.from_arrays(tokens, np.ones(r, np.int32), computed, table, num_block_ids)


@settings(max_examples=400, deadline=None)
@given(decode_batches())
def test_decode_checks_match_the_general_checks(batch):
    assert _outcome(_check_decode, batch) == _outcome(_check_general, batch)


def _checked_generally(batch: ga.Batch) -> str:
    def general(batch, limits):
        _check_shapes(batch)
        return _check_general(batch, limits)

    return _outcome(general, batch)


@st.composite
def one_token_a_request_batches(draw):
    """``decode_batches`` whose query lengths sometimes are not all 1 (a 0 and a 2 keep the
    token count): check_batch must send those to the general checks."""
    batch = draw(decode_batches())
    q = batch.query_lens.copy()
    if len(q) > 1 and draw(st.booleans()):
        i, j = draw(st.lists(st.integers(0, len(q) - 1), min_size=2, max_size=2, unique=True))
        q[i], q[j] = 0, 2
    return ga.Batch.from_arrays(
        batch.token_ids, q, batch.num_computed_tokens, batch.block_table, batch.num_block_ids
    )


@settings(max_examples=300, deadline=None)
@given(one_token_a_request_batches())
def test_check_batch_agrees_with_the_general_checks(batch):
    assert _outcome(check_batch, batch) == _checked_generally(batch)


def test_num_block_ids_wider_than_the_table_is_named_on_the_decode_path():
    batch = _decode([3, 4], [[0], [1]], num_block_ids=[1, 2])
    with pytest.raises(
        ga.InvalidBatchError, match="request 1 declares 2 block ids; the block table has 1 columns"
    ):
        check_batch(batch, LIMITS)


@pytest.mark.parametrize(
    "values, value, expected",
    [
        (np.ones(5, np.int32), 1, True),
        (np.array([1, 1, 0, 1], np.int32), 1, False),
        (np.full(3, 7, np.int32), 7, True),
        (np.full(3, 7, np.int32), 6, False),
        (np.arange(10, dtype=np.int32)[::3] * 0 + 2, 2, True),  # not contiguous
        (np.array([2, 2, 2**32 + 2], np.int64), 2, False),  # equal in the low 32 bits
    ],
)
def test_all_equal(values, value, expected):
    assert _all_equal(values, value) is expected


def _decode(computed, table, tokens=None, num_block_ids=None):
    r = len(computed)
    tokens = np.arange(r) if tokens is None else tokens
    return ga.Batch.from_arrays(tokens, np.ones(r, np.int32), computed, table, num_block_ids)


@pytest.mark.parametrize(
    "batch, message",
    [
        (_decode([3, 70], [[0, 1], [2, 3]]), "request 1 would hold 71 tokens; max_model_len is 64"),
        (_decode([3, -1], [[0], [2]]), "request 1 has num_computed_tokens -1"),
        (_decode([3, 16], [[0, 1], [2, 3]], num_block_ids=[2, 1]), "request 1 has 1 block"),
        (_decode([3, 20], [[0, 1], [2, 10]]), r"request 1: block id 10 \(entry 1\)"),
        (_decode([3, 20], [[-1, 1], [2, 3]]), r"request 0: block id -1 \(entry 0\)"),
        (_decode([3, 4], [[0], [1]], tokens=[1, 50]), "request 1: token id 50"),
        (_decode([3, 4], [[0], [1]], tokens=[-3, 1]), "request 0: token id -3"),
    ],
)
def test_bad_decode_batches_name_the_request(batch, message):
    with pytest.raises(ga.InvalidBatchError, match=message):
        check_batch(batch, LIMITS)


def test_unused_block_ids_may_be_anything():
    # request 0 needs one block; its second entry is past num_block_ids and never read
    check_batch(_decode([3, 20], [[0, -1], [2, 3]], num_block_ids=[1, 2]), LIMITS)
    check_batch(_decode([3, 20], [[0, 99], [2, 3]], num_block_ids=[1, 2]), LIMITS)


@pytest.mark.parametrize(
    "query_lens, computed",
    [([3, 1, 4], [0, 20, 7]), ([1, 1], [0, 0]), ([8], [40]), ([2, 3, 1, 1], [30, 0, 63, 12])],
)
def test_mixed_batches_return_their_longest_sequence(query_lens, computed):
    q = np.array(query_lens, np.int32)
    c = np.array(computed, np.int32)
    tokens = np.arange(int(q.sum()), dtype=np.int64) % 50
    batch = ga.Batch.from_arrays(tokens, q, c, *_own_blocks(c + q))
    assert check_batch(batch, LIMITS) == int((c + q).max())


def _own_blocks(seq_lens, block_size=16):
    """A -1-padded table giving each request blocks of its own, and their counts."""
    needed = [-(-int(n) // block_size) for n in seq_lens]
    table = np.full((len(needed), max(needed)), -1, np.int32)
    first = 0
    for row, n in enumerate(needed):
        table[row, :n] = np.arange(first, first + n)
        first += n
    return table, np.array(needed, np.int32)


@pytest.mark.parametrize(
    "query_lens, computed, table, tokens, message",
    [
        # two decodes write block 1 with different blocks before it: the decode path
        (
            [1, 1],
            [20, 21],
            [[0, 1], [2, 1]],
            [5, 6],
            "requests 0 and 1 both write block 1 .* not as a prefix they share",
        ),
        # block 3 at entry 0 of one table and entry 1 of the other
        (
            [1, 1],
            [4, 20],
            [[3, 4], [5, 3]],
            [5, 6],
            "requests 0 and 1 both write block 3 .*entries 0 and 1",
        ),
        # two decodes at the same slot of a shared block, with different tokens
        (
            [1, 1],
            [4, 4],
            [[3], [3]],
            [5, 6],
            "requests 0 and 1 both write position 4 of block 3 with different tokens",
        ),
        # a prefill chunk and a decode writing position 5 of block 4 differently: the general path
        (
            [6, 1],
            [0, 5],
            [[4], [4]],
            [1, 2, 3, 4, 5, 6, 9],
            "both write position 5 of block 4 with different tokens .6 and 9.",
        ),
        # one request's table repeats the block its chunk spills into
        ([4], [14], [[2, 2]], [1, 2, 3, 4], "request 0 writes block 2 through entries 0 and 1"),
    ],
)
def test_writes_that_would_overwrite_each_other_are_an_error(
    query_lens, computed, table, tokens, message
):
    """Keys and values of one step never overwrite each other: a block written by two
    requests is a prefix they share, with the same token wherever both write, and a
    request's written entries name distinct blocks."""
    q = np.array(query_lens, np.int32)
    batch = ga.Batch.from_arrays(np.array(tokens), q, np.array(computed, np.int32), np.array(table))
    with pytest.raises(ga.InvalidBatchError, match=message):
        check_batch(batch, LIMITS)


@pytest.mark.parametrize(
    "query_lens, computed, table, tokens",
    [
        # two identical requests in one step: the same writes
        ([1, 1], [20, 20], [[0, 1], [0, 1]], [7, 7]),
        # a prompt's prefill and a prefix hit on its last block recomputing the last token,
        # scheduled together (vLLM marks blocks cached when it schedules them)
        ([8, 1], [0, 7], [[4], [4]], [1, 2, 3, 4, 5, 6, 7, 8, 8]),
        # identical prompts prefilled together across a block boundary
        ([20, 20], [0, 0], [[1, 2], [1, 2]], list(range(20)) * 2),
    ],
)
def test_a_block_shared_as_a_prefix_may_be_written_alike(query_lens, computed, table, tokens):
    q = np.array(query_lens, np.int32)
    c = np.array(computed, np.int32)
    batch = ga.Batch.from_arrays(np.array(tokens) % 50, q, c, np.array(table))
    limits = dataclasses.replace(LIMITS, max_num_tokens=64)
    assert check_batch(batch, limits) == int((c + q).max())


def test_a_full_prefix_block_may_be_shared():
    """Requests reading one full block (a common prefix) and writing blocks of their own."""
    batch = _decode([16, 17, 20], [[0, 1], [0, 2], [0, 3]])
    assert check_batch(batch, LIMITS) == 21
    chunks = ga.Batch.from_arrays(
        np.arange(5), np.array([3, 2], np.int32), np.array([16, 16], np.int32),
        np.array([[0, 1], [0, 2]], np.int32),
    )  # fmt: skip
    assert check_batch(chunks, LIMITS) == 19


def test_entries_a_request_does_not_use_are_not_checked_whatever_its_batchmates_need():
    """Request 0 needs one block; its second entry (junk) is not checked, alone or beside a
    request that needs two columns."""
    alone = _decode([3], [[5, 99]])
    beside = _decode([3, 20], [[5, 99], [2, 3]])
    assert check_batch(alone, LIMITS) == 4
    assert check_batch(beside, LIMITS) == 21


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"token_ids": [1, 2]}, "token_ids must be a numpy integer array .* got a list"),
        ({"block_table": np.zeros((1, 2), np.int32)}, r"block_table must be \[requests \(2\)"),
        ({"block_table": np.zeros(4, np.int32)}, "block_table must have 2 dimension"),
        ({"query_lens": np.ones(2, np.float32)}, "query_lens must be a numpy integer array"),
    ],
)
def test_a_batch_built_by_hand_is_checked_like_one_from_arrays(fields, message):
    good = {
        "token_ids": np.array([1, 2], np.int64),
        "query_lens": np.ones(2, np.int32),
        "num_computed_tokens": np.array([3, 4], np.int32),
        "block_table": np.array([[0], [1]], np.int32),
        "num_block_ids": np.ones(2, np.int32),
    }
    with pytest.raises(ga.InvalidBatchError, match=message):
        check_batch(ga.Batch(**(good | fields)), LIMITS)


def _writes_ok_naively(batch, block_size) -> bool:
    """The write rules token by token, in plain Python."""
    owners = {}  # block -> (request, entry); slot -> token
    slots = {}
    start = 0
    for r, (q, c) in enumerate(zip(batch.query_lens.tolist(), batch.num_computed_tokens.tolist())):
        for i in range(q):
            pos = c + i
            e = pos // block_size
            block = int(batch.block_table[r, e])
            for other_r, other_e in owners.get(block, []):
                if other_r == r and other_e != e:
                    return False
                if other_r != r and (
                    other_e != e
                    or batch.block_table[r, : e + 1].tolist()
                    != batch.block_table[other_r, : e + 1].tolist()
                ):
                    return False
            owners.setdefault(block, []).append((r, e))
            token = int(batch.token_ids[start + i])
            if slots.setdefault((block, pos % block_size), token) != token:
                return False
        start += q
    if (batch.query_lens == 1).all():
        # in a block several decodes write, none of them reads a slot another one writes
        # (reads by requests that do not write the block are not checked: they would scan
        # every table)
        writer = {}
        for r, c in enumerate(batch.num_computed_tokens.tolist()):
            writer[(int(batch.block_table[r, c // block_size]), c % block_size)] = r
        shared = {b for b, pairs in owners.items() if len(pairs) > 1}
        for r, c in enumerate(batch.num_computed_tokens.tolist()):
            own = int(batch.block_table[r, c // block_size])
            for pos in range(c // block_size * block_size, c):  # its cached part of that block
                w = writer.get((own, pos % block_size))
                if own in shared and w is not None and w != r:
                    return False
    return True


@st.composite
def sharing_batches(draw):
    """Small batches over few blocks, so that requests often write the same ones."""
    r = draw(st.integers(1, 4))
    width = 3
    q = draw(st.lists(st.integers(1, 5), min_size=r, max_size=r))
    c = draw(st.lists(st.integers(0, 4 * width - 6), min_size=r, max_size=r))
    table = draw(st.lists(st.integers(0, 3), min_size=r * width, max_size=r * width))
    tokens = draw(st.lists(st.integers(0, 2), min_size=sum(q), max_size=sum(q)))
    return ga.Batch.from_arrays(
        np.array(tokens), np.array(q, np.int32), np.array(c, np.int32),
        np.array(table, np.int32).reshape(r, width),
    )  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(sharing_batches())
def test_the_write_rules_agree_with_a_token_by_token_oracle(batch):
    limits = dataclasses.replace(LIMITS, block_size=4, max_num_tokens=64, num_blocks=4)
    try:
        check_batch(batch, limits)
        accepted = True
    except ga.InvalidBatchError as e:
        assert "write" in str(e)  # the other checks pass on these batches
        accepted = False
    assert accepted == _writes_ok_naively(batch, 4)


def test_one_sequence_twice_in_a_decode_batch_is_refused():
    """Positions 5 and 6 of one sequence as two one-token decodes: the second reads slot 5
    as cached while the first writes it, inside the same attention launch on TRITON."""
    batch = _decode(np.array([5, 6], np.int32), np.array([[0, 1], [0, 1]], np.int32))
    with pytest.raises(
        ga.InvalidBatchError,
        match=r"request 1 reads position 5 of block 0 as cached, but request 0 writes it in "
        r"this step: in a batch of one-token decodes the writes happen inside attention",
    ):
        check_batch(batch, LIMITS)
    # the same two tokens as one request's two-token chunk are fine
    chunk = ga.Batch.from_arrays(np.array([3, 4]), np.array([2], np.int32),
                                 np.array([5], np.int32), np.array([[0, 1]], np.int32))  # fmt: skip
    assert check_batch(chunk, LIMITS) == 7


# -- debug=True: the blocks a step uses, against each other and across steps -----------------


def _debug_limits(allocator=None, **changes):
    """LIMITS with debug's allocator: a fresh one that never handed a block out unless given."""
    allocator = BlockAllocator(LIMITS.num_blocks) if allocator is None else allocator
    return dataclasses.replace(LIMITS, allocator=allocator, **changes)


@pytest.mark.parametrize(
    "computed, table, message",
    [
        # request 1 reads block 3 (its entry 0) that request 0 writes as its entry 1
        ([20, 17], [[0, 3], [3, 5]], r"requests 0 and 1 both use block 3 in this step, at entries "
         r"1 and 0 of their block tables: a block holds one range of positions"),
        # one request reading one block at two entries, or writing an entry it also reads
        ([40], [[2, 2, 4]], "request 0 uses block 2 at entries 0 and 1 of its block table; a "
         "request's blocks must be distinct"),
        ([20], [[4, 4]], "request 0 uses block 4 at entries 0 and 1"),
    ],
)  # fmt: skip
def test_debug_refuses_a_block_used_at_two_entries_in_a_step(computed, table, message):
    """Reads the checks without debug do not scan (they look at blocks written twice)."""
    batch = _decode(np.array(computed, np.int32), np.array(table, np.int32))
    assert check_batch(batch, LIMITS) == max(computed) + 1
    limits = _debug_limits()
    with pytest.raises(ga.InvalidBatchError, match=message):
        check_batch(batch, limits)


def test_debug_accepts_blocks_shared_at_one_entry_read_or_written():
    limits = _debug_limits(max_num_tokens=64)
    readers = _decode(np.array([16, 17, 20], np.int32), np.array([[0, 1], [0, 2], [0, 3]]))
    assert check_batch(readers, limits) == 21
    alike = ga.Batch.from_arrays(  # identical prompts prefilled together across two blocks
        np.array(list(range(20)) * 2), np.array([20, 20], np.int32), np.zeros(2, np.int32),
        np.array([[1, 2], [1, 2]], np.int32),
    )  # fmt: skip
    assert check_batch(alike, limits) == 20
    junk = _decode(np.array([3, 20], np.int32), np.array([[5, 5], [2, 3]]))  # unused entry 1
    assert check_batch(junk, limits) == 21
    # one block at one entry behind different blocks: a prefix cache that finds blocks by
    # content (vLLM's keeps two blocks of one hash when identical prompts ran together) may
    # hand out [0, 5] and [2, 5] where blocks 0 and 2 hold the same keys
    by_content = _decode(np.array([40, 33], np.int32), np.array([[0, 5, 1], [2, 5, 3]]))
    assert check_batch(by_content, limits) == 41


def test_debug_finds_a_block_handed_to_another_request_while_a_stale_table_uses_it():
    """Free and allocate again: the allocated-block check alone cannot see the stale table."""
    alloc = BlockAllocator(LIMITS.num_blocks)
    limits = _debug_limits(alloc)
    first = alloc.allocate(2)  # [0, 1]
    check_step(_decode(np.array([20], np.int32), np.array([first])), limits)
    alloc.free(first)
    other = alloc.allocate(3)  # [0, 1, 2]: request B holds block 0 as its entry 1
    b = np.array([[other[1], other[0], other[2]]], np.int32)
    check_step(_decode(np.array([20], np.int32), b), limits)
    entries = alloc.entries.copy()
    assert entries[other].tolist() == [1, 0, -1]  # block 2 not used yet
    stale = _decode(np.array([21], np.int32), np.array([first]))  # A's table, kept after free
    with pytest.raises(
        ga.InvalidBatchError,
        match=r"request 0 uses block 0 as entry 0 of its block table, but the last step that "
        r"used it since its allocate had it at entry 1: one of the two tables is stale",
    ):
        check_step(stale, limits)
    np.testing.assert_array_equal(alloc.entries, entries)  # a rejected batch records nothing
    # B's own steps go on; a block freed and allocated again starts with no entry
    check_step(_decode(np.array([21], np.int32), b), limits)
    alloc.free(other)
    again = alloc.allocate(2)
    assert (alloc.entries[again] == -1).all()
    check_step(_decode(np.array([20], np.int32), np.array([again[::-1]])), limits)


def test_debug_without_the_engines_allocator_checks_within_the_step_only():
    """A loop running its own allocator (the engine's never handed a block out) may reuse a
    block at another entry from one step to the next, but not at two entries within one
    step."""
    alloc = BlockAllocator(LIMITS.num_blocks)
    limits = _debug_limits(alloc)
    check_step(_decode(np.array([20], np.int32), np.array([[0, 1]])), limits)
    check_step(_decode(np.array([20], np.int32), np.array([[1, 0]])), limits)
    assert (alloc.entries == -1).all()
    with pytest.raises(ga.InvalidBatchError, match="request 0 uses block 1 at entries 0 and 1"):
        check_step(_decode(np.array([20], np.int32), np.array([[1, 1]])), limits)


def test_debug_finds_a_table_used_after_every_block_was_freed():
    """One request: allocate, step, free, step again with the same table."""
    alloc = BlockAllocator(LIMITS.num_blocks)
    limits = _debug_limits(alloc)
    blocks = alloc.allocate(2)
    check_step(_decode(np.array([20], np.int32), np.array([blocks])), limits)
    alloc.free(blocks)
    with pytest.raises(ga.InvalidBatchError, match=r"block id 0 \(entry 0\) is not allocated"):
        check_step(_decode(np.array([21], np.int32), np.array([blocks])), limits)


def test_debug_skips_the_entries_no_sliding_window_reads():
    """Every layer slides over 20 positions: entries wholly before a request's first read
    position (its computed tokens - 19) may all name one null block, as vLLM's sliding-window
    manager leaves them; the entries read are checked as ever."""
    alloc = BlockAllocator(LIMITS.num_blocks)
    null, *b = alloc.allocate(6)
    limits = _debug_limits(alloc, read_window=20)
    # position 50 reads 31..50: entries 1..3 (entry 0 is the null block); position 60 reads
    # 41..60: entries 2 and 3 (entries 0 and 1 null)
    table = np.array([[null, b[0], b[1], b[2]], [null, null, b[3], b[4]]], np.int32)
    computed = np.array([50, 60], np.int32)
    with pytest.raises(
        ga.InvalidBatchError, match="requests 0 and 1 both use block 0 in this step, at entries 0 "
    ):
        check_step(_decode(computed, table), _debug_limits(alloc))  # no window: every entry
    assert check_step(_decode(computed, table), limits).longest == 61
    for entry, block, message in [
        (2, 9, r"request 1: block id 9 \(entry 2\) is not allocated"),
        (2, b[0], "requests 0 and 1 both use block 1 in this step, at entries 1 and 2"),
    ]:
        bad = table.copy()
        bad[1, entry] = block
        with pytest.raises(ga.InvalidBatchError, match=message):
            check_step(_decode(computed, bad), limits)


def _tables_ok_naively(batch, block_size) -> bool:
    """Every block the step uses is used at one entry of the block tables."""
    entry_of = {}  # block -> its entry
    seq_lens = (batch.num_computed_tokens + batch.query_lens).tolist()
    for r, n in enumerate(seq_lens):
        for e in range(-(-n // block_size)):
            if entry_of.setdefault(int(batch.block_table[r, e]), e) != e:
                return False
    return True


@st.composite
def reading_batches(draw):
    """One-token requests reading up to four blocks each out of six: tables often name one
    block at several places."""
    r = draw(st.integers(1, 4))
    c = draw(st.lists(st.integers(0, 15), min_size=r, max_size=r))
    table = draw(st.lists(st.integers(0, 5), min_size=r * 4, max_size=r * 4))
    return _decode(np.array(c, np.int32), np.array(table, np.int32).reshape(r, 4))


@settings(max_examples=400, deadline=None)
@given(st.one_of(sharing_batches(), reading_batches()))
def test_debugs_table_check_agrees_with_a_naive_oracle(batch):
    limits = dataclasses.replace(LIMITS, block_size=4, max_num_tokens=64, num_blocks=6)
    try:
        check_batch(batch, limits)
    except ga.InvalidBatchError:
        return  # the write rules refuse it before debug's checks run
    debug = dataclasses.replace(limits, allocator=BlockAllocator(6))
    try:
        check_batch(batch, debug)
        accepted = True
    except ga.InvalidBatchError as e:
        assert "use block" in str(e) or "uses block" in str(e)
        accepted = False
    assert accepted == _tables_ok_naively(batch, 4)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_debugs_checks_across_steps_agree_with_a_naive_model(data):
    """Random allocates, frees and decode steps over 8 blocks of 4 tokens: a batch the
    checks without debug accept is refused by debug's exactly when a plain model of its
    rules says so, a refused one records nothing, and the recorded entries are the model's."""
    block_size, num_blocks = 4, 8
    alloc = BlockAllocator(num_blocks)
    plain = dataclasses.replace(LIMITS, block_size=block_size, num_blocks=num_blocks)
    limits = dataclasses.replace(plain, allocator=alloc)
    last = {}  # block -> the entry of its last use since its allocate
    for _ in range(data.draw(st.integers(1, 12))):
        op = data.draw(st.sampled_from(["allocate", "free", "step", "step"]))
        if op == "allocate" and alloc.num_free:
            for block in alloc.allocate(data.draw(st.integers(1, alloc.num_free))):
                last.pop(block, None)
            continue
        if op == "free" and alloc.in_use.any():
            held = np.flatnonzero(alloc.in_use).tolist()
            ids = data.draw(st.lists(st.sampled_from(held), min_size=1, unique=True))
            alloc.free(ids)
            for block in ids:
                last.pop(block, None)
            continue
        r = data.draw(st.integers(1, 3))
        computed = data.draw(st.lists(st.integers(0, 11), min_size=r, max_size=r))
        rows = st.lists(st.integers(0, num_blocks - 1), min_size=3, max_size=3)
        table = data.draw(st.lists(rows, min_size=r, max_size=r))
        batch = _decode(np.array(computed, np.int32), np.array(table, np.int32))
        try:
            check_step(batch, plain)
        except ga.InvalidBatchError:
            continue  # the write rules refuse it first
        places = [(t[e], e) for t, c in zip(table, computed) for e in range(c // block_size + 1)]
        entry_of = {}
        ok = all(entry_of.setdefault(block, e) == e for block, e in places)
        if alloc.handed_out:
            ok = ok and all(alloc.in_use[b] and last.get(b, e) == e for b, e in places)
        before = alloc.entries.copy()
        try:
            check_step(batch, limits)
            accepted = True
        except ga.InvalidBatchError:
            accepted = False
        assert accepted == ok, (computed, table, last)
        if not accepted:
            np.testing.assert_array_equal(alloc.entries, before)
        elif alloc.handed_out:
            last.update(entry_of)
        expected = np.full(num_blocks, -1, np.int32)
        for block, e in last.items():
            expected[block] = e
        np.testing.assert_array_equal(alloc.entries, expected)

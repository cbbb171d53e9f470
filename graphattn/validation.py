"""Checks of a step's batch against the engine's limits, before anything is written."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from graphattn.batch import Batch
from graphattn.errors import InvalidBatchError


@dataclass(frozen=True)
class BatchLimits:
    """What an engine can take in one step."""

    max_num_seqs: int
    max_num_tokens: int
    max_model_len: int
    block_size: int
    num_blocks: int
    vocab_size: int | None = None
    # debug=True: the engine's BlockAllocator, and the checks of every block a step uses
    # (``_check_tables``). Off by default. Those against the allocator start at its first
    # allocate: a caller may run its own allocator over the cache.
    allocator: Any = None
    # How far back any layer reads: the largest sliding window where every layer has one,
    # None where a layer attends to the whole sequence. debug=True's block checks skip the
    # entries no layer reads (a loop may point them all at one null block, as vLLM does).
    read_window: int | None = None


@dataclass(frozen=True)
class CheckedBatch:
    """What ``check_step`` found on the way that the step's input fill needs again."""

    longest: int  # the longest sequence the step leaves (computed + new tokens)
    # A batch of one-token requests checked on the decode path: the block each request
    # writes its token to (int32, the caller's order), gathered once for the write check
    # and the slots. None otherwise.
    decode_blocks: np.ndarray | None = None


def check_batch(batch: Batch, limits: BatchLimits) -> int:
    """Raise ``InvalidBatchError`` naming the first bad request and value; if all is well,
    return the longest sequence the step leaves (computed + new tokens), which the runner
    needs and the checks find on the way.

    Vectorized over requests: its cost must stay small next to a decode step.
    """
    return check_step(batch, limits).longest


def check_step(batch: Batch, limits: BatchLimits) -> CheckedBatch:
    """``check_batch``, also returning what the runner's input fill would compute again."""
    if not isinstance(batch, Batch):
        raise InvalidBatchError(
            f"expected a graphattn Batch (Batch.from_requests or Batch.from_arrays), got "
            f"{type(batch).__name__}"
        )
    r, t = batch.num_reqs, batch.num_tokens
    if r == 0:
        raise InvalidBatchError("the batch has no requests")
    if r > limits.max_num_seqs:
        raise InvalidBatchError(
            f"the batch has {r} requests; max_num_seqs is {limits.max_num_seqs}"
        )
    if t > limits.max_num_tokens:
        raise InvalidBatchError(
            f"the batch has {t} tokens; max_num_tokens is {limits.max_num_tokens}"
        )
    if t == r and _is_decode_layout(batch) and _all_equal(batch.query_lens, 1):
        checked = _check_decode(batch, limits)  # every request decodes one token
    else:
        _check_shapes(batch)
        checked = CheckedBatch(_check_general(batch, limits))
    if limits.allocator is not None:  # debug=True
        _check_tables(batch, limits, checked.longest)
    return checked


def _check_tables(batch: Batch, limits: BatchLimits, longest: int) -> None:
    """``debug=True``'s checks of the blocks a step uses: every entry below a request's
    ``num_computed_tokens + query length`` that a layer reads (under sliding windows alone,
    not those wholly before the earliest window: ``limits.read_window``). The last of
    ``check_step``. A block holds the keys and values of one range of positions, its entry
    in a block table, so:

    - within the step, a block is used at one entry: a request naming one block at two
      entries, or two requests using one block at different entries, is an error whether
      they write it or only read it (the checks without debug look only at blocks the step
      writes twice);
    - once the engine's allocator has handed out a block (``allocate`` outside
      ``generate``), each block used is allocated (not a table kept after ``free``, not an
      id never allocated) and at the entry where a step last used it since its
      ``allocate``: a table kept after ``free`` whose blocks went to another request at
      other entries.

    Which blocks stand before a block is not checked: a prefix cache that finds its blocks
    by content (vLLM's) may give two requests equal prefixes in different blocks. When every
    check passes, the entries are recorded in the allocator (``BlockAllocator.entries``); a
    rejected batch records nothing.
    """
    allocator, block_size = limits.allocator, limits.block_size
    width = -(-longest // block_size)
    table = batch.block_table[:, :width]
    computed = batch.num_computed_tokens.astype(np.int64)
    entry = np.arange(width)[None, :]
    used = entry < -(-(computed + batch.query_lens) // block_size)[:, None]
    if limits.read_window is not None:  # the first position the step's first token reads
        used &= entry >= (np.maximum(computed - limits.read_window + 1, 0) // block_size)[:, None]
    tracked = allocator.handed_out  # a loop that never calls allocate runs its own allocator
    if tracked:
        _check_allocated(table, used, allocator.in_use)
    rows, entries = np.nonzero(used)  # the used places, row by row
    blocks = table[rows, entries].astype(np.int64)
    entries = entries.astype(np.int32)
    # one entry a block: scatter the entries by block (the last place wins) and read them
    # back; a place that reads another entry shares its block with a place at another entry
    kept = np.empty(limits.num_blocks, dtype=np.int32)
    kept[blocks] = entries
    clash = kept[blocks] != entries
    if clash.any():
        first = int(np.argmax(clash))
        alike = np.flatnonzero(blocks == blocks[first])
        second = int(alike[np.argmax(entries[alike] != entries[first])])
        places = sorted((int(rows[k]), int(entries[k])) for k in (first, second))
        _explain_clash(int(blocks[first]), *places)
    if not tracked:
        return
    before = allocator.entries[blocks]
    moved = (before >= 0) & (before != entries)
    if moved.any():
        k = int(np.argmax(moved))
        raise InvalidBatchError(
            f"request {rows[k]} uses block {blocks[k]} as entry {entries[k]} of its block "
            f"table, but the last step that used it since its allocate had it at entry "
            f"{before[k]}: one of the two tables is stale (kept after free, its blocks since "
            "handed to another request), or the loop recycles blocks without free (debug=True "
            "expects a block to keep its entry from allocate to free; a loop that runs its own "
            "allocator takes no block from engine.kv_cache.allocate)"
        )
    allocator.entries[blocks] = entries


def _explain_clash(block: int, a: tuple[int, int], b: tuple[int, int]) -> None:
    """Two (request, entry) places of one step that use ``block`` at different entries."""
    (i, j), (k, m) = a, b
    if i == k:
        raise InvalidBatchError(
            f"request {i} uses block {block} at entries {j} and {m} of its block table; a "
            "request's blocks must be distinct"
        )
    raise InvalidBatchError(
        f"requests {i} and {k} both use block {block} in this step, at entries {j} and {m} of "
        "their block tables: a block holds one range of positions, so one of them reads keys "
        "and values written for other positions (debug=True checks reads as well as writes)"
    )


def _check_allocated(table: np.ndarray, used: np.ndarray, allocated: np.ndarray) -> None:
    """Every block id a request uses (``used``, over ``table``'s columns) is one the engine's
    allocator handed out and has not taken back."""
    bad = used & ~allocated[np.where(used, table, 0)]
    if bad.any():
        i, j = (int(x) for x in np.argwhere(bad)[0])
        raise InvalidBatchError(
            f"request {i}: block id {table[i, j]} (entry {j}) is not allocated (debug=True "
            "checks every block a step uses against engine.kv_cache: freed, or never "
            "handed out by allocate)"
        )


def _check_general(batch: Batch, limits: BatchLimits) -> int:
    q, computed = batch.query_lens, batch.num_computed_tokens
    seq_lens = computed.astype(np.int64) + q
    needed = -(-seq_lens // limits.block_size)
    longest = int(seq_lens.max())
    # one reduction per rule on the path every good batch takes; the rules again, one
    # by one and naming the request, only when one of them fails
    if (
        q.min() < 1
        or computed.min() < 0
        or longest > limits.max_model_len
        or (needed > batch.num_block_ids).any()
    ):
        _explain_request_error(batch, seq_lens, needed, limits)
    _check_block_ids(batch, -(-longest // limits.block_size), limits.num_blocks, limits.block_size)
    tokens = batch.token_ids
    if tokens.size and not _in_range(tokens, _token_bound(limits)):
        _explain_token_error(batch, limits.vocab_size)
    _check_writes(batch, limits.block_size)
    return longest


def _check_writes(batch: Batch, block_size: int) -> None:
    """The step's writes never conflict. Each request writes its new tokens through one or
    more entries of its block table; where two of those writes land in one block:

    - one request naming that block at two entries is an error (its blocks must be distinct);
    - two requests may share the block only as a prefix they share (the same blocks up to
      and including it, at the same entry), and a slot both write must get the same token
      (identical prompts scheduled together, or a prefix hit that recomputes its last
      token, as vLLM's scheduler makes); anything else overwrites keys and values.

    Vectorized over (request, entry) pairs; the rules run one group at a time only where a
    block is written by more than one pair. Not checked here, as it would scan every table
    on every step: a written block that another request only reads, or that is an earlier
    entry of the same request's table (``debug=True`` checks them: ``_check_tables``).
    """
    q = batch.query_lens.astype(np.int64)
    computed = batch.num_computed_tokens.astype(np.int64)
    first = computed // block_size
    count = (computed + q - 1) // block_size - first + 1  # entries each request writes
    req = np.repeat(np.arange(batch.num_reqs), count)
    entry = first[req] + (np.arange(len(req)) - (np.cumsum(count) - count)[req])
    blocks = batch.block_table[req, entry].astype(np.int64)
    order = np.argsort(blocks, kind="stable")
    blocks = blocks[order]
    shared = blocks[1:] == blocks[:-1]
    if shared.any():
        _check_shared_blocks(batch, block_size, blocks, req[order], entry[order], shared)


def _check_shared_blocks(batch, block_size, blocks, req, entry, shared) -> None:
    """``_check_writes``'s rules for each block more than one (request, entry) writes."""
    groups: dict[int, set[int]] = {}
    for k in np.flatnonzero(shared).tolist():
        groups.setdefault(int(blocks[k]), set()).update((k, k + 1))
    q, computed, table = batch.query_lens, batch.num_computed_tokens, batch.block_table
    token_start = np.cumsum(q) - q
    decodes_only = bool((q == 1).all())
    for block, members in groups.items():
        entry_of: dict[int, int] = {}
        for k in sorted(members):
            r, e = int(req[k]), int(entry[k])
            if entry_of.setdefault(r, e) != e:
                raise InvalidBatchError(
                    f"request {r} writes block {block} through entries {entry_of[r]} and {e} "
                    f"of its block table; a request's blocks must be distinct"
                )
        first_req, first_entry = min(entry_of.items())
        written: dict[int, tuple[int, int]] = {}  # position -> (request, token)
        for r, e in sorted(entry_of.items()):
            if (r, e) != (first_req, first_entry) and (
                e != first_entry or not np.array_equal(table[r, : e + 1], table[first_req, : e + 1])
            ):
                raise InvalidBatchError(
                    f"requests {first_req} and {r} both write block {block} in this step, but "
                    f"not as a prefix they share (entries {first_entry} and {e}; blocks before "
                    f"it {table[first_req, :first_entry].tolist()} and {table[r, :e].tolist()}): "
                    f"they would overwrite each other's keys and values"
                )
            c = int(computed[r])
            lo, hi = max(c, e * block_size), min(c + int(q[r]), (e + 1) * block_size)
            for pos in range(lo, hi):
                token = int(batch.token_ids[token_start[r] + pos - c])
                other, other_token = written.setdefault(pos, (r, token))
                if other_token != token:
                    raise InvalidBatchError(
                        f"requests {other} and {r} both write position {pos} of block {block} "
                        f"with different tokens ({other_token} and {token})"
                    )
        if decodes_only:  # a decode reads no slot another decode writes in the same step
            for r, e in sorted(entry_of.items()):
                for pos in range(e * block_size, min(int(computed[r]), (e + 1) * block_size)):
                    writer = written.get(pos, (r, 0))[0]
                    if writer != r:
                        raise InvalidBatchError(
                            f"request {r} reads position {pos} of block {block} as cached, but "
                            f"request {writer} writes it in this step: in a batch of one-token "
                            "decodes the writes happen inside attention, so the read would race "
                            "them (one sequence listed twice does this)"
                        )


def _check_decode_writes(batch: Batch, block_size: int) -> np.ndarray:
    """``_check_writes`` for one-token requests: the blocks they write, sorted, have no
    neighbours alike (a request writes one slot, so only other requests can collide).
    Returns those blocks in the requests' order (the input fill's slots need them)."""
    r = batch.num_reqs
    table = batch.block_table
    if block_size & (block_size - 1) == 0:  # a power of two (the config's rule): a shift
        entry = batch.num_computed_tokens >> (block_size.bit_length() - 1)
    else:
        entry = batch.num_computed_tokens // block_size
    if table.flags.c_contiguous:  # one gather from the flat table: a third of a 2-D index's cost
        entry += _row_starts(r, table.shape[1])
        written = table.ravel().take(entry)
    else:
        written = table[np.arange(r), entry]
    if r > 1:
        ordered = np.sort(written)
        if (ordered[1:] == ordered[:-1]).any():
            _check_writes(batch, block_size)  # the rules, naming the requests where they fail
    return written


def _row_starts(r: int, width: int) -> np.ndarray:
    """``[0, width, 2 * width, ...]`` for ``r`` rows (int32), kept per width."""
    starts = _ROW_STARTS.get(width)
    if starts is None or len(starts) < r:
        if len(_ROW_STARTS) >= _FILLED_KEYS:
            _ROW_STARTS.clear()
        starts = _ROW_STARTS[width] = np.arange(max(r, 256), dtype=np.int32) * width
    return starts[:r]


_ROW_STARTS: dict[int, np.ndarray] = {}


def _is_decode_layout(batch: Batch) -> bool:
    """The arrays are numpy arrays of the dtypes ``Batch.from_arrays`` gives (the decode
    checks read them as unsigned), the token ids and query lengths one-dimensional; anything
    else takes the general checks, which say what is wrong."""
    q, tokens, declared = batch.query_lens, batch.token_ids, batch.num_block_ids
    return (
        getattr(q, "dtype", None) == np.int32
        and q.ndim == 1
        and getattr(tokens, "dtype", None) == np.int64
        and tokens.ndim == 1
        and getattr(batch.num_computed_tokens, "dtype", None) == np.int32
        and getattr(batch.block_table, "dtype", None) == np.int32
        and isinstance(declared, np.ndarray)
        and declared.dtype.kind in "iu"
    )


def _check_decode(batch: Batch, limits: BatchLimits) -> CheckedBatch:
    """``_check_shapes`` and ``_check_general`` for a batch of one-token requests (every
    query length 1), in fewer numpy calls: a range check ``0 <= x < n`` is one maximum of
    ``x`` read as unsigned (negatives become huge), and where every request declares the
    whole block table (the common layout) the blocks a request needs are one comparison of
    the largest position with the table's width. On any failure the general checks run and
    name the request.
    """
    computed, declared, table = batch.num_computed_tokens, batch.num_block_ids, batch.block_table
    r = batch.num_reqs
    if computed.shape != (r,) or declared.shape != (r,) or table.ndim != 2 or len(table) != r:
        _check_shapes(batch)  # raises
    width, block_size = table.shape[1], limits.block_size
    last = int(_umax(computed))  # the largest position written
    if _all_equal(declared, width):
        enough = last // block_size < width
    else:  # the blocks each request needs, against what it declares and the table holds
        enough = not (computed // block_size >= declared).any() and declared.max() <= width
    if last >= limits.max_model_len or not enough:
        _check_shapes(batch)
        return CheckedBatch(_check_general(batch, limits))
    _check_block_ids(batch, last // block_size + 1, limits.num_blocks, block_size)
    if _umax(batch.token_ids) >= _token_bound(limits):  # negatives read as huge
        _explain_token_error(batch, limits.vocab_size)
    return CheckedBatch(last + 1, _check_decode_writes(batch, block_size))


def _all_equal(values: np.ndarray, value: int) -> bool:
    """Every entry of ``values`` (a 1-D int array) is ``value``: one comparison of bytes,
    about a third of one numpy reduction's fixed cost on arrays this small."""
    data = values.tobytes()
    key = (value, values.dtype.str)
    filled = _FILLED.get(key)
    if filled is None or len(filled) < len(data):
        if len(_FILLED) >= _FILLED_KEYS:
            _FILLED.clear()
        filled = _FILLED[key] = np.full(max(values.size, 256), value, values.dtype).tobytes()
    return data == filled[: len(data)]


# (value, dtype) -> that value repeated, as bytes, for _all_equal: one entry per value checked
# (1 for query lengths, the table's width for num_block_ids), grown to the largest batch seen
_FILLED: dict[tuple[int, str], bytes] = {}
_FILLED_KEYS = 64


def _umax(values: np.ndarray) -> np.unsignedinteger:
    unsigned = np.uint32 if values.dtype == np.int32 else np.uint64
    return np.maximum.reduce(values.view(unsigned), axis=None)


def _token_bound(limits: BatchLimits) -> int:
    """Token ids must lie in ``[0, bound)``: the vocabulary where the model declares one;
    otherwise any id but a negative one (read as unsigned, a negative int64 is >= 2**63)."""
    return limits.vocab_size if limits.vocab_size is not None else 2**63


def _explain_token_error(batch: Batch, vocab_size: int | None) -> None:
    tokens = batch.token_ids
    bad = tokens < 0 if vocab_size is None else (tokens < 0) | (tokens >= vocab_size)
    tok = int(np.argmax(bad))
    req = int(np.searchsorted(np.cumsum(batch.query_lens), tok, side="right"))
    if vocab_size is None:
        raise InvalidBatchError(f"request {req}: token id {tokens[tok]} is negative")
    raise InvalidBatchError(
        f"request {req}: token id {tokens[tok]} is outside the vocabulary [0, {vocab_size})"
    )


def _explain_request_error(
    batch: Batch, seq_lens: np.ndarray, needed: np.ndarray, limits: BatchLimits
) -> None:
    q, computed = batch.query_lens, batch.num_computed_tokens
    _first_bad(q < 1, "has no tokens to compute (query length {}); every request needs >= 1", q)
    _first_bad(computed < 0, "has num_computed_tokens {}; expected >= 0", computed)
    _first_bad(
        seq_lens > limits.max_model_len,
        f"would hold {{}} tokens; max_model_len is {limits.max_model_len}",
        seq_lens,
    )
    short = needed > batch.num_block_ids
    if short.any():
        i = int(np.argmax(short))
        raise InvalidBatchError(
            f"request {i} has {batch.num_block_ids[i]} block(s) for {seq_lens[i]} tokens; "
            f"block size {limits.block_size} needs {needed[i]}"
        )


def _check_shapes(batch: Batch) -> None:
    for name in ("token_ids", "query_lens", "num_computed_tokens", "block_table", "num_block_ids"):
        value = getattr(batch, name)
        if not isinstance(value, np.ndarray) or value.dtype.kind not in "iu":
            kind = f"{value.dtype} array" if isinstance(value, np.ndarray) else type(value).__name__
            raise InvalidBatchError(
                f"{name} must be a numpy integer array (build batches with Batch.from_requests "
                f"or Batch.from_arrays), got a {kind}"
            )
        ndim = 2 if name == "block_table" else 1
        if value.ndim != ndim:
            raise InvalidBatchError(
                f"{name} must have {ndim} dimension(s), got shape {list(value.shape)}"
            )
    r = batch.num_reqs
    if batch.block_table.shape[0] != r:
        raise InvalidBatchError(
            f"block_table must be [requests ({r}), blocks], got shape {list(batch.block_table.shape)}"
        )
    for name in ("num_computed_tokens", "num_block_ids"):
        if getattr(batch, name).shape != (r,):
            raise InvalidBatchError(
                f"{name} must have one entry per request ({r}), got shape "
                f"{list(getattr(batch, name).shape)}"
            )
    total = int(batch.query_lens.sum())
    if total != batch.num_tokens:
        raise InvalidBatchError(
            f"query_lens sum to {total} but the batch has {batch.num_tokens} token ids"
        )
    width = batch.block_table.shape[1]
    if batch.num_block_ids.max() > width:
        i = int(np.argmax(batch.num_block_ids > width))
        raise InvalidBatchError(
            f"request {i} declares {batch.num_block_ids[i]} block ids; the block table has "
            f"{width} columns"
        )


def _check_block_ids(batch: Batch, width: int, num_blocks: int, block_size: int) -> None:
    """Every block id a request uses (the blocks its tokens so far and this step's fill,
    within the first ``width`` columns: the longest request's) is in the cache. Entries a
    request does not use may hold anything, whatever its batchmates need."""
    table = batch.block_table[:, :width]
    if table.size == 0 or _in_range(table, num_blocks):
        return  # every entry of the columns in use is valid, used or not
    seq_lens = batch.num_computed_tokens.astype(np.int64) + batch.query_lens
    used = np.arange(width)[None, :] < -(-seq_lens // block_size)[:, None]
    bad = used & ((table < 0) | (table >= num_blocks))
    if bad.any():
        i, j = (int(x) for x in np.argwhere(bad)[0])
        raise InvalidBatchError(
            f"request {i}: block id {table[i, j]} (entry {j}) is outside the cache [0, {num_blocks})"
        )


def _first_bad(mask: np.ndarray, message: str, values: np.ndarray) -> None:
    if mask.any():
        i = int(np.argmax(mask))
        raise InvalidBatchError(f"request {i} " + message.format(values[i]))


def _in_range(values: np.ndarray, bound: int) -> bool:
    if values.dtype in (np.int32, np.int64):
        return bool(_umax(values) < bound)
    return bool(values.min() >= 0 and values.max() < bound)

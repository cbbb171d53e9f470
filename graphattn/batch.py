"""``Request`` and ``Batch``: what one step computes, in the caller's order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

import numpy as np
import torch

from graphattn.errors import InvalidBatchError


@dataclass(frozen=True)
class Request:
    """One request's share of a step.

    ``token_ids`` are the tokens to compute now (a whole prompt, a chunk of it, or one
    decoded token); ``num_computed_tokens`` tokens of the same request are already in the
    KV cache; ``block_ids`` are the request's cache blocks in order, enough for
    ``num_computed_tokens + len(token_ids)`` tokens.
    """

    token_ids: Sequence[int] | np.ndarray | torch.Tensor
    num_computed_tokens: int = 0
    block_ids: Sequence[int] = ()


@dataclass(frozen=True, eq=False)
class Batch:
    """A step's requests as arrays, in the caller's order.

    Build it with ``Batch.from_requests`` (convenient) or ``Batch.from_arrays`` (no
    per-request Python work; what a scheduler with its own arrays should use).
    """

    token_ids: np.ndarray  # [T] int64, the requests' new tokens back to back
    query_lens: np.ndarray  # [R] int32, new tokens per request
    num_computed_tokens: np.ndarray  # [R] int32
    block_table: np.ndarray  # [R, B] int32, -1 past a request's last block
    num_block_ids: np.ndarray  # [R] int32, valid entries per row of block_table

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_lens(self) -> np.ndarray:
        return self.num_computed_tokens + self.query_lens

    def last_token_rows(self) -> np.ndarray:
        """``[R]`` int64: the row of ``engine.step``'s output holding each request's last new
        token, in the caller's order (the rows a sampler reads; a prefill chunk that does
        not end its prompt has nothing to sample there)."""
        return np.cumsum(self.query_lens, dtype=np.int64) - 1

    @classmethod
    def from_requests(cls, requests: Sequence[Request]) -> Batch:
        """Arrays from ``Request`` objects (any iterable of them); a malformed request is an
        ``InvalidBatchError``."""
        try:
            requests = list(requests)
        except TypeError:
            raise InvalidBatchError(
                f"expected an iterable of ga.Request, got {type(requests).__name__}"
            ) from None
        for i, r in enumerate(requests):
            if not isinstance(r, Request):
                raise InvalidBatchError(f"request {i} must be a ga.Request, got {type(r).__name__}")
        arrays = _plain_int_arrays(requests)
        if arrays is None:
            arrays = _checked_arrays(requests)
        return cls(*arrays)

    @classmethod
    def from_arrays(
        cls,
        token_ids: np.ndarray,
        query_lens: np.ndarray,
        num_computed_tokens: np.ndarray,
        block_table: np.ndarray,
        num_block_ids: np.ndarray | None = None,
    ) -> Batch:
        """A batch over arrays the caller owns (copied only where dtypes differ).

        ``num_block_ids`` defaults to every entry of ``block_table`` being valid.
        """
        query_lens = _int_array("query_lens", query_lens, np.int32, ndim=1)
        computed = _int_array("num_computed_tokens", num_computed_tokens, np.int32, ndim=1)
        table = _int_array("block_table", block_table, np.int32, ndim=2)
        num_reqs = len(query_lens)
        if num_block_ids is None:
            num_block_ids = np.full(num_reqs, table.shape[1], dtype=np.int32)
        declared = _int_array("num_block_ids", num_block_ids, np.int32, ndim=1)
        if not len(computed) == len(declared) == table.shape[0] == num_reqs:
            raise InvalidBatchError(
                f"query_lens gives {num_reqs} requests: num_computed_tokens and num_block_ids "
                f"must have {num_reqs} entries and block_table {num_reqs} rows, got "
                f"{len(computed)}, {len(declared)} and shape {list(table.shape)}"
            )
        return cls(
            token_ids=_int_array("token_ids", token_ids, np.int64, ndim=1),
            query_lens=query_lens,
            num_computed_tokens=computed,
            block_table=table,
            num_block_ids=declared,
        )


_Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
_PLAIN_SEQUENCES = (list, tuple, range)
_ONLY_INT = frozenset({int})
# what is iterable but no list of ids: no order of its own (a set's is its hash order, a
# mapping's its keys') or text; taken as ids, a step would read the wrong blocks or tokens
UNORDERED_OR_TEXT = (Set, Mapping, str, bytes, bytearray)


def _plain_int_arrays(requests: list[Request]) -> _Arrays | None:
    """``Batch``'s arrays in a few numpy calls over the whole batch, for the common case:
    every request's ``token_ids`` and ``block_ids`` are lists, tuples or ranges of plain
    ``int`` and its ``num_computed_tokens`` a plain ``int``, all within what the arrays hold.

    None for anything else (numpy or torch values, bools, ints of other types, values out of
    range): ``_checked_arrays`` then checks request by request and names the one at fault.
    Both give the same arrays wherever this one answers (tests/test_bad_input.py).
    """
    tokens: list[int] = []
    blocks: list[int] = []
    computed: list[int] = []
    token_lens: list[int] = []
    block_lens: list[int] = []
    for r in requests:
        t, b, c = r.token_ids, r.block_ids, r.num_computed_tokens
        if type(t) not in _PLAIN_SEQUENCES or type(b) not in _PLAIN_SEQUENCES or type(c) is not int:
            return None
        tokens.extend(t)
        blocks.extend(b)
        computed.append(c)
        token_lens.append(len(t))
        block_lens.append(len(b))
    if not (_ONLY_INT.issuperset(map(type, tokens)) and _ONLY_INT.issuperset(map(type, blocks))):
        return None  # a bool, a numpy integer, a float, ...: checked one by one
    try:
        token_ids = np.array(tokens, dtype=np.int64)
        block_ids = np.array(blocks, dtype=np.int64)
        num_computed = np.array(computed, dtype=np.int64)
    except OverflowError:  # a Python int beyond int64
        return None
    low, high = _INT32
    if block_ids.size and (block_ids.min() < low or block_ids.max() > high):
        return None
    if num_computed.size and (num_computed.min() < 0 or num_computed.max() > high):
        return None
    return _pack(token_ids, token_lens, num_computed, block_ids, block_lens)


def _checked_arrays(requests: list[Request]) -> _Arrays:
    """``Batch``'s arrays, each request's values checked on their own (any integer type a
    request may hold); a bad value is an ``InvalidBatchError`` naming its request."""
    token_lists = [_token_array(i, r.token_ids) for i, r in enumerate(requests)]
    blocks = [_int_list(i, "block_ids", r.block_ids, _INT32) for i, r in enumerate(requests)]
    computed = [_nonnegative(i, r.num_computed_tokens) for i, r in enumerate(requests)]
    return _pack(
        np.concatenate(token_lists) if token_lists else np.zeros(0, np.int64),
        [len(t) for t in token_lists],
        computed,
        np.array([b for ids in blocks for b in ids], dtype=np.int64),
        [len(b) for b in blocks],
    )


def _pack(
    token_ids: np.ndarray,
    token_lens: list[int],
    computed: Sequence[int] | np.ndarray,
    block_ids: np.ndarray,
    block_lens: list[int],
) -> _Arrays:
    """``Batch``'s arrays from checked values: the block ids back to back fill each row of the
    table from its start, -1 after them."""
    num_block_ids = np.array(block_lens, dtype=np.int32)
    width = int(num_block_ids.max()) if len(block_lens) else 0
    table = np.full((len(block_lens), max(width, 1)), -1, dtype=np.int32)
    if block_ids.size:
        table[np.arange(width) < num_block_ids[:, None]] = block_ids
    return (
        token_ids,
        np.array(token_lens, dtype=np.int32),
        np.asarray(computed).astype(np.int32),
        table,
        num_block_ids,
    )


def _int_array(name: str, values: object, dtype: type, *, ndim: int) -> np.ndarray:
    """``values`` as a host integer array of ``ndim`` dimensions and ``dtype``; floats,
    bools, device tensors and values ``dtype`` cannot hold are errors (numpy would wrap
    them: a block id of 2**32 would become 0)."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise InvalidBatchError(f"{name} must be on the CPU, got a tensor on {values.device}")
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise InvalidBatchError(f"{name} must hold integers, got a {values.dtype} tensor")
        values = values.detach().numpy()
    try:
        array = np.asarray(values)
    except (ValueError, TypeError) as e:  # ragged rows, objects numpy cannot make an array of
        raise InvalidBatchError(
            f"{name} must be a rectangular integer array, got {type(values).__name__} ({e})"
        ) from None
    if array.ndim != ndim:
        raise InvalidBatchError(
            f"{name} must have {ndim} dimension(s), got shape {list(array.shape)}"
        )
    if array.dtype == dtype:
        return array
    if array.size and array.dtype.kind not in "iu":
        raise InvalidBatchError(f"{name} must hold integers, got dtype {array.dtype}")
    if array.size and not np.can_cast(array.dtype, dtype):
        info = np.iinfo(dtype)
        low, high = array.min(), array.max()
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise InvalidBatchError(
                f"{name} holds {bad}, outside the {np.dtype(dtype).name} range "
                f"[{info.min}, {info.max}]"
            )
    return array.astype(dtype)


def _token_array(index: int, token_ids: object, what: str = "token_ids") -> np.ndarray:
    if isinstance(token_ids, torch.Tensor):
        if (
            token_ids.device.type != "cpu"
            or token_ids.is_floating_point()
            or token_ids.is_complex()
            or token_ids.dtype == torch.bool
        ):
            raise InvalidBatchError(
                f"request {index}: {what} must be integers on the CPU, got a "
                f"{token_ids.dtype} tensor on {token_ids.device}"
            )
        if token_ids.ndim != 1:
            raise InvalidBatchError(
                f"request {index}: {what} must be one-dimensional, got a tensor of shape "
                f"{list(token_ids.shape)}"
            )
        values = token_ids.detach().numpy()
        if values.dtype == np.uint64 and values.size and values.max() > _INT64[1]:
            raise InvalidBatchError(
                f"request {index}: {what} holds {int(values.max())}, outside "
                f"[{_INT64[0]}, {_INT64[1]}]"
            )  # before the cast below wraps it
        return values.astype(np.int64)
    return np.asarray(_int_list(index, what, token_ids, _INT64), dtype=np.int64)


def _int_list(index: int, what: str, values: object, bounds: tuple[int, int]) -> list[int]:
    """``values`` as a list of ints within ``bounds`` (inclusive: what the batch's array for
    them holds)."""
    if isinstance(values, np.ndarray):
        if values.dtype.kind not in "iu":
            raise InvalidBatchError(f"request {index}: {what} must be integers, got {values.dtype}")
        if values.ndim != 1:
            raise InvalidBatchError(
                f"request {index}: {what} must be one-dimensional, got an array of shape "
                f"{list(values.shape)}"
            )
        items = values.tolist()
    elif isinstance(values, torch.Tensor):
        items = _token_array(index, values, what).tolist()
    else:
        items = _plain_ints(index, what, values)
    low, high = bounds
    out_of_range = [v for v in items if not low <= v <= high]
    if out_of_range:
        raise InvalidBatchError(
            f"request {index}: {what} holds {out_of_range[0]}, outside [{low}, {high}]"
        )
    return items


def _plain_ints(index: int, what: str, values: object) -> list[int]:
    if isinstance(values, UNORDERED_OR_TEXT):
        raise InvalidBatchError(
            f"request {index}: {what} must be an ordered sequence of ints (a list, tuple, "
            f"range or 1-D array), got {type(values).__name__}"
        )
    try:
        items = list(values)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidBatchError(
            f"request {index}: {what} must be a sequence of ints, got {type(values).__name__}"
        ) from None
    bad = [v for v in items if not is_int(v)]
    if bad:
        raise InvalidBatchError(f"request {index}: {what} must hold ints, got {bad[0]!r}")
    return items


def _nonnegative(index: int, value: object) -> int:
    if not is_int(value) or not 0 <= value <= _INT32[1]:
        raise InvalidBatchError(
            f"request {index}: num_computed_tokens must be an int in [0, {_INT32[1]}], "
            f"got {value!r}"
        )
    return int(value)


def is_int(value: object) -> bool:
    """A Python or numpy integer, and not a bool (which Python counts as an int)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


_INT32 = (-(2**31), 2**31 - 1)  # what the batch's int32 arrays hold
_INT64 = (-(2**63), 2**63 - 1)

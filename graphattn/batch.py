"""``Request`` and ``Batch``: what one step computes, in the caller's order."""

from __future__ import annotations

from collections.abc import Sequence
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

    @classmethod
    def from_requests(cls, requests: Sequence[Request]) -> Batch:
        """Arrays from ``Request`` objects; a malformed request is an ``InvalidBatchError``."""
        token_lists = [_token_array(i, r.token_ids) for i, r in enumerate(requests)]
        blocks = [_int_list(i, "block_ids", r.block_ids) for i, r in enumerate(requests)]
        computed = [_nonnegative(i, r.num_computed_tokens) for i, r in enumerate(requests)]
        width = max((len(b) for b in blocks), default=0)
        table = np.full((len(requests), max(width, 1)), -1, dtype=np.int32)
        for row, ids in enumerate(blocks):
            table[row, : len(ids)] = ids
        tokens = np.concatenate(token_lists) if token_lists else np.zeros(0, np.int64)
        return cls(
            token_ids=tokens,
            query_lens=np.array([len(t) for t in token_lists], dtype=np.int32),
            num_computed_tokens=np.array(computed, dtype=np.int32),
            block_table=table,
            num_block_ids=np.array([len(b) for b in blocks], dtype=np.int32),
        )

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
        table = _int_array("block_table", block_table, np.int32)
        if table.ndim != 2 or table.shape[0] != len(query_lens):
            raise InvalidBatchError(
                f"block_table must be [num_reqs={len(query_lens)}, max_blocks], "
                f"got shape {list(table.shape)}"
            )
        if num_block_ids is None:
            num_block_ids = np.full(table.shape[0], table.shape[1], dtype=np.int32)
        return cls(
            token_ids=_int_array("token_ids", token_ids, np.int64).reshape(-1),
            query_lens=_int_array("query_lens", query_lens, np.int32),
            num_computed_tokens=_int_array("num_computed_tokens", num_computed_tokens, np.int32),
            block_table=table,
            num_block_ids=_int_array("num_block_ids", num_block_ids, np.int32),
        )


def _int_array(name: str, values: object, dtype: type) -> np.ndarray:
    """``values`` as a host integer array; floats, bools and device tensors are errors."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise InvalidBatchError(f"{name} must be on the CPU, got a tensor on {values.device}")
        values = values.numpy()
    array = np.asarray(values)
    if array.size and array.dtype.kind not in "iu":
        raise InvalidBatchError(f"{name} must hold integers, got dtype {array.dtype}")
    return array.astype(dtype, copy=False)


def _token_array(index: int, token_ids: object) -> np.ndarray:
    if isinstance(token_ids, torch.Tensor):
        if (
            token_ids.device.type != "cpu"
            or token_ids.is_floating_point()
            or token_ids.is_complex()
        ):
            raise InvalidBatchError(
                f"request {index}: token_ids must be integers on the CPU, got a "
                f"{token_ids.dtype} tensor on {token_ids.device}"
            )
        return token_ids.reshape(-1).numpy().astype(np.int64)
    return np.asarray(_int_list(index, "token_ids", token_ids), dtype=np.int64)


def _int_list(index: int, what: str, values: object) -> list[int]:
    if isinstance(values, np.ndarray):
        if values.dtype.kind not in "iu":
            raise InvalidBatchError(f"request {index}: {what} must be integers, got {values.dtype}")
        return values.reshape(-1).tolist()
    if isinstance(values, torch.Tensor):
        return _token_array(index, values).tolist()
    try:
        items = list(values)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidBatchError(
            f"request {index}: {what} must be a sequence of ints, got {type(values).__name__}"
        ) from None
    bad = [v for v in items if not isinstance(v, (int, np.integer)) or isinstance(v, bool)]
    if bad:
        raise InvalidBatchError(f"request {index}: {what} must hold ints, got {bad[0]!r}")
    return items


def _nonnegative(index: int, value: object) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
        raise InvalidBatchError(
            f"request {index}: num_computed_tokens must be an int >= 0, got {value!r}"
        )
    return int(value)

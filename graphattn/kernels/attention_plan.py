"""How a paged-attention launch is shaped: tile sizes, split count and grid for one padded batch.

The plan depends only on quantities a captured CUDA graph fixes — the padded token and
request counts, the head layout, head size, dtype and device — never on the lengths of a
particular batch, which the kernels read from device tensors. Every plan is correct for
every batch padded to its sizes; the choice between plans is about speed only.

Grid of the attention kernel: ``(num_tokens // block_q + num_reqs, num_kv_heads, num_splits)``.
Request ``i`` owns query tiles from ``query_start_loc[i] // block_q + i`` on (a bound of its
``ceil(query_len / block_q)`` tiles); programs without a tile exit at once.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

# Partial-result rows the split-KV scratch holds per (token, KV head): the group's query
# heads times the splits. It sizes the scratch without knowing the query-head count.
SPLIT_SLOTS = 64
MAX_SPLITS = 32
MAX_GROUP = 64  # query heads per KV head one program handles
# Programs (request x KV head x split) to aim for: two waves of one program per SM.
WAVES = 2


MERGE_ENV = "GRAPHATTN_FUSED_SPLIT_MERGE"  # "1": merge inside the attention launch


@functools.lru_cache(maxsize=1)
def fused_merge() -> bool:
    """Whether split-KV launches merge their splits inside the attention kernel
    (``GRAPHATTN_FUSED_SPLIT_MERGE=1``) rather than in ``_reduce_kernel``; read once per
    process (``fused_merge.cache_clear()`` reads it again)."""
    raw = os.environ.get(MERGE_ENV, "0")
    if raw not in ("0", "1", ""):
        raise ValueError(f"{MERGE_ENV} must be 0 or 1, got {raw!r}")
    return raw == "1"


def describe_merge() -> str:
    """How split-KV results are merged, for the engine's report."""
    if fused_merge():
        return f"by the last split program of each tile, in the attention launch ({MERGE_ENV}=1)"
    return "by a reduction kernel after the attention launch"


@dataclass(frozen=True)
class TileConfig:
    """One program's tile: ``block_m`` query rows (tokens x heads of a group) x ``tile_n`` keys."""

    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class AttentionPlan:
    """Everything a launch depends on; equal plans mean identical launches."""

    num_tokens: int  # padded
    num_reqs: int  # padded
    num_kv_heads: int
    group: int  # query heads per KV head
    group_pad: int  # the group rounded up to a power of two
    head_size: int
    tiles: TileConfig
    num_splits: int

    @property
    def block_q(self) -> int:
        """Query tokens per program."""
        return self.tiles.block_m // self.group_pad

    @property
    def grid(self) -> tuple[int, int, int]:
        num_tiles = self.num_tokens // self.block_q + self.num_reqs
        return (num_tiles, self.num_kv_heads, self.num_splits)


def choose_num_splits(num_reqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per (request, KV head) so that few long sequences still fill ``WAVES`` waves."""
    work = num_reqs * num_kv_heads
    return max(1, min(MAX_SPLITS, -(-WAVES * num_sms // work)))


@functools.lru_cache(maxsize=1024)
def plan_attention(
    num_tokens: int,
    num_reqs: int,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device_type: str,
    num_splits: int = 1,
    uniform_decode: bool = False,
    tiles: TileConfig | None = None,
    uniform_query_len: int | None = None,
) -> AttentionPlan:
    """The launch for ``num_tokens`` tokens of ``num_reqs`` requests (both padded).

    ``num_splits`` > 1 asks for split-KV; it is capped so the partial results fit the
    scratch (``SPLIT_SLOTS`` rows per token and KV head). ``uniform_decode`` (every request
    has one query token; a captured graph's key fixes it) picks decode tiles even where
    padding tokens outnumber padding requests. ``uniform_query_len`` (every request has that
    many query tokens, as a speculative-decoding verify graph's key fixes) picks them too
    where one decode tile holds a request's rows (its tokens times the padded group).
    ``tiles`` overrides the table.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads")
    group = num_heads // num_kv_heads
    if group > MAX_GROUP:
        raise ValueError(f"at most {MAX_GROUP} query heads per KV head, got {group}")
    group_pad = _next_power_of_2(group)
    decode_like = (
        uniform_decode
        or num_tokens <= num_reqs
        or (uniform_query_len is not None and uniform_query_len * group_pad <= max(16, group_pad))
    )
    if tiles is None:
        tiles = choose_tiles(head_size, dtype, group_pad, decode_like, device_type)
    if tiles.block_m % group_pad or tiles.block_m < 16:
        raise ValueError(
            f"block_m must be >= 16 and a multiple of the padded group {group_pad}, "
            f"got {tiles.block_m}"
        )
    splits = max(1, min(num_splits, MAX_SPLITS, SPLIT_SLOTS // group))
    return AttentionPlan(
        num_tokens, num_reqs, num_kv_heads, group, group_pad, head_size, tiles, splits
    )


def choose_tiles(
    head_size: int, dtype: torch.dtype, group_pad: int, decode_like: bool, device_type: str
) -> TileConfig:
    """The tile table. Decode-like batches (no more tokens than requests) take one token per
    program row group and stream keys; others take tall query tiles for tensor-core reuse.
    """
    if device_type != "cuda":  # the interpreter: small tiles, few loop trips
        return TileConfig(max(16, group_pad), 32, 4, 1)
    if dtype == torch.float32:  # exact fp32 dots run on FMA units: small tiles avoid spills
        return TileConfig(max(16, group_pad), 32, 8, 2)
    wide = _next_power_of_2(head_size) > 128  # twice the registers and shared memory per row
    if decode_like:  # key tiles of 16 KiB (K) where the head allows: fewer, longer loads
        tile_n = 32 if wide else 128 if head_size <= 64 else 64
        return TileConfig(max(16, group_pad), tile_n, 4, 3)
    if wide:
        return TileConfig(max(64, group_pad), 64, 8, 2)
    return TileConfig(max(128, group_pad), 64, 8, 3)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()

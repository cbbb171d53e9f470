"""Capture sizes: the token counts graphs are recorded for; every other batch pads up to one."""

from __future__ import annotations

from collections.abc import Sequence


def default_capture_sizes(
    max_num_seqs: int, max_num_tokens: int, uniform_decode_query_len: int = 1
) -> list[int]:
    """1, 2, 4, then steps of 8 up to 256, then steps of 16, up to the bound, in requests,
    each times ``uniform_decode_query_len`` (the tokens of a request in a uniform decode
    batch: 1, or 1 + the draft tokens of a speculative-decoding verify step).

    The bound is a decode batch of every request, ``max_num_seqs`` or fewer where the token
    limit allows fewer (the config keeps ``uniform_decode_query_len <= max_num_tokens``); it
    is always a size itself, so every uniform decode batch has a graph.
    """
    q = uniform_decode_query_len
    bound = min(max_num_seqs, max_num_tokens // q)
    requests = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, bound + 1, 16))
    return sorted({n * q for n in requests if n <= bound} | {bound * q})


def clip_capture_sizes(sizes: Sequence[int], max_num_tokens: int) -> tuple[list[int], list[int]]:
    """A user's list sorted and de-duplicated, and the sizes dropped for exceeding the token limit."""
    unique = sorted(set(sizes))
    return [s for s in unique if s <= max_num_tokens], [s for s in unique if s > max_num_tokens]


def padding_table(sizes: Sequence[int]) -> list[int]:
    """``table[n]`` is the smallest size >= n, for n in 0..max(sizes)."""
    table, i = [], 0
    ordered = sorted(sizes)
    for n in range(ordered[-1] + 1):
        while ordered[i] < n:
            i += 1
        table.append(ordered[i])
    return table

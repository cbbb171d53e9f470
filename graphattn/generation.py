"""Greedy generation with continuous batching: the demo and benchmark driver, not a server."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from graphattn.batch import Batch
from graphattn.errors import InvalidInputError
from graphattn.sampling import greedy

if TYPE_CHECKING:
    from graphattn.engine import CompiledModel


@dataclass
class _Sequence:
    """One prompt in flight: its tokens so far, how many are cached, its blocks."""

    index: int
    tokens: list[int]
    prompt_len: int
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len


def generate(
    engine: CompiledModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
) -> list[list[int]]:
    """Decode every prompt greedily; requests join as blocks and batch slots free up.

    Each step schedules every running decode (one token each), then continues chunked
    prefills and admits waiting prompts while the token budget lasts. A prompt's blocks
    for its whole length (prompt plus ``max_new_tokens``) are allocated when it joins and
    freed when it finishes, so a running request never waits for blocks.
    """
    cfg = engine.config
    _check_prompts(prompts, max_new_tokens, cfg.max_model_len, engine.kv_cache)
    waiting = deque(_Sequence(i, list(p), len(p)) for i, p in enumerate(prompts))
    running: list[_Sequence] = []
    results: list[list[int]] = [[] for _ in prompts]
    while waiting or running:
        scheduled = _schedule(engine, waiting, running, max_new_tokens)
        batch = _to_batch(scheduled, engine.kv_cache.block_size)
        hidden = engine.step(batch, clone=False)  # read below, before the next step
        ends = np.cumsum(batch.query_lens) - 1
        sampling = [
            i for i, (seq, n) in enumerate(scheduled) if seq.num_computed + n == len(seq.tokens)
        ]
        next_tokens = []
        if sampling:
            next_tokens = greedy(engine.compute_logits(hidden[ends[sampling]])).tolist()
        for seq, n in scheduled:
            seq.num_computed += n
        for i, token in zip(sampling, next_tokens):
            seq = scheduled[i][0]
            seq.tokens.append(token)
            if seq.num_generated >= max_new_tokens or token == eos_token_id:
                running.remove(seq)
                engine.kv_cache.free(seq.blocks)
                results[seq.index] = seq.tokens[seq.prompt_len :]
    return results


def _schedule(
    engine: CompiledModel, waiting: deque, running: list, max_new_tokens: int
) -> list[tuple[_Sequence, int]]:
    cfg, kv = engine.config, engine.kv_cache
    budget = cfg.max_num_tokens
    scheduled = []
    for seq in running:  # decodes (one token) and unfinished prefills
        n = min(len(seq.tokens) - seq.num_computed, budget)
        if n:
            scheduled.append((seq, n))
            budget -= n
    while waiting and budget and len(running) < cfg.max_num_seqs:
        seq = waiting[0]
        need = kv.blocks_for(seq.prompt_len + max_new_tokens)
        if need > kv.num_free_blocks:
            break
        waiting.popleft()
        seq.blocks = kv.allocate(need)
        running.append(seq)
        n = min(seq.prompt_len, budget)
        scheduled.append((seq, n))
        budget -= n
    return scheduled


def _to_batch(scheduled: list[tuple[_Sequence, int]], block_size: int) -> Batch:
    tokens = np.concatenate(
        [np.asarray(s.tokens[s.num_computed : s.num_computed + n], np.int64) for s, n in scheduled]
    )
    width = max(len(s.blocks) for s, _ in scheduled)
    table = np.full((len(scheduled), width), -1, dtype=np.int32)
    for row, (seq, _) in enumerate(scheduled):
        table[row, : len(seq.blocks)] = seq.blocks
    return Batch.from_arrays(
        tokens,
        np.array([n for _, n in scheduled], np.int32),
        np.array([s.num_computed for s, _ in scheduled], np.int32),
        table,
        np.array([len(s.blocks) for s, _ in scheduled], np.int32),
    )


def _check_prompts(prompts, max_new_tokens, max_model_len, kv_cache) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InvalidInputError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise InvalidInputError(f"prompt {i} is empty")
        total = len(prompt) + max_new_tokens
        if total > max_model_len:
            raise InvalidInputError(
                f"prompt {i} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} it "
                f"needs {total} > max_model_len={max_model_len}"
            )
        if kv_cache.blocks_for(total) > kv_cache.num_blocks:
            raise InvalidInputError(
                f"prompt {i} needs {kv_cache.blocks_for(total)} blocks; the cache has "
                f"{kv_cache.num_blocks}"
            )

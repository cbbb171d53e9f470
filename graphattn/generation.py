"""Greedy generation with continuous batching: the demo and benchmark driver, not a server."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from graphattn.batch import UNORDERED_OR_TEXT, Batch, is_int
from graphattn.errors import InvalidInputError, OutOfBlocksError
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
    for everything it will cache (the prompt and its generated tokens but the last, which
    is never fed back) are allocated when it joins and freed when it finishes, so a running
    request never waits for blocks.
    """
    if not callable(getattr(engine.model, "compute_logits", None)):
        raise InvalidInputError(
            f"{type(engine.model).__name__} has no compute_logits(hidden) -> logits; generate "
            f"samples from it (drive engine.step yourself for a model without a head)"
        )
    prompts, max_new_tokens, eos_token_id = _check_prompts(
        prompts, max_new_tokens, eos_token_id, engine.runner.limits, engine.kv_cache
    )
    waiting = deque(_Sequence(i, p, len(p)) for i, p in enumerate(prompts))
    running: list[_Sequence] = []
    results: list[list[int]] = [[] for _ in prompts]
    allocator = engine.kv_cache.allocator
    caller_allocated = allocator.handed_out
    try:
        while waiting or running:
            scheduled = _schedule(engine, waiting, running, max_new_tokens)
            batch = _to_batch(scheduled, engine.kv_cache.block_size)
            hidden = engine.step(batch, clone=False)  # read below, before the next step
            ends = batch.last_token_rows()
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
    except BaseException:
        # the blocks this call holds go back, so a failed call leaves the allocator as it was
        for seq in running:
            engine.kv_cache.free(seq.blocks)
        raise
    finally:
        # every block this call took is back: debug's checks against the allocator follow
        # the caller's own allocate calls (a loop that runs its own allocator may warm up
        # with generate)
        allocator.handed_out = caller_allocated
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
        need = kv.blocks_for(_cached_len(seq.prompt_len, max_new_tokens))
        if need > kv.num_free_blocks:
            if not running:  # no request will finish and free blocks: it can never start
                raise OutOfBlocksError(
                    f"prompt {seq.index} needs {need} KV-cache blocks and only "
                    f"{kv.num_free_blocks} of {kv.num_blocks} are free (the others are "
                    "held outside generate)"
                )
            break
        waiting.popleft()
        seq.blocks = kv.allocate(need)
        running.append(seq)
        n = min(seq.prompt_len, budget)
        scheduled.append((seq, n))
        budget -= n
    return scheduled


def _cached_len(prompt_len: int, max_new_tokens: int) -> int:
    """The tokens a prompt puts in the cache at most: the prompt and every generated token
    but the last, which is sampled and returned, never fed back."""
    return prompt_len + max_new_tokens - 1


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


def _check_prompts(
    prompts, max_new_tokens, eos_token_id, limits, kv_cache
) -> tuple[list[list[int]], int, int | None]:
    """The prompts as lists of ints, after every check a step would make of them, so that a
    bad prompt is an error before anything is allocated or run; and ``max_new_tokens`` and
    ``eos_token_id`` as Python ints (a numpy int would wrap in the lengths computed from it)."""
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise InvalidInputError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if eos_token_id is not None and not is_int(eos_token_id):
        raise InvalidInputError(f"eos_token_id must be an int or None, got {eos_token_id!r}")
    max_new_tokens = int(max_new_tokens)
    eos_token_id = None if eos_token_id is None else int(eos_token_id)
    checked = []
    for i, prompt in enumerate(_as_list(prompts, "prompts must be a list of token-id lists")):
        tokens = _as_list(prompt, f"prompt {i} must be a list of token ids")
        if not tokens:
            raise InvalidInputError(f"prompt {i} is empty")
        bad = [t for t in tokens if not is_int(t)]
        if bad:
            raise InvalidInputError(f"prompt {i}: token ids must be ints, got {bad[0]!r}")
        vocab = limits.vocab_size
        outside = [t for t in tokens if t < 0 or (vocab is not None and t >= vocab)]
        if outside:
            raise InvalidInputError(
                f"prompt {i}: token id {outside[0]} is outside the vocabulary "
                f"[0, {vocab if vocab is not None else 'inf'})"
            )
        total = _cached_len(len(tokens), max_new_tokens)
        if total > limits.max_model_len:
            raise InvalidInputError(
                f"prompt {i} has {len(tokens)} tokens; with max_new_tokens={max_new_tokens} it "
                f"caches {total} > max_model_len={limits.max_model_len}"
            )
        if kv_cache.blocks_for(total) > kv_cache.num_blocks:
            raise InvalidInputError(
                f"prompt {i} needs {kv_cache.blocks_for(total)} blocks; the cache has "
                f"{kv_cache.num_blocks}"
            )
        checked.append([int(t) for t in tokens])
    return checked, max_new_tokens, eos_token_id


def _as_list(values: object, expected: str) -> list:
    """``values`` as a list (arrays and tensors through ``tolist``); a str, a scalar or
    anything else not iterable is an ``InvalidInputError`` saying ``expected``."""
    if isinstance(values, (np.ndarray, torch.Tensor)):
        values = values.tolist()
    if isinstance(values, UNORDERED_OR_TEXT) or not hasattr(values, "__iter__"):
        raise InvalidInputError(f"{expected}, got {type(values).__name__}")
    return list(values)

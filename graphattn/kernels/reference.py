"""Plain-torch paged attention and KV-cache write: the references the Triton kernels are tested
against, and the computation of the TORCH_REF backend.

Cache layout: ``key_cache`` and ``value_cache`` are ``[num_blocks, block_size, Hkv, D]``;
token ``t`` of a request lives at slot ``block_table[t // block_size] * block_size +
t % block_size``. Arithmetic is float32 whatever the storage dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def write_kv_cache_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    value_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    """Scatter each token's key and value into its slot; tokens with a negative slot are skipped."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat_k = key_cache.view(-1, *key_cache.shape[2:])  # [NB*BS, Hkv, D]
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    flat_k.index_copy_(0, slots, key[valid].to(key_cache.dtype))
    flat_v.index_copy_(0, slots, value[valid].to(value_cache.dtype))


def paged_attention_ref(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    value_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    block_table: torch.Tensor,  # [R, max_blocks] int32
    query_start_loc: Sequence[int],  # [R + 1], host values
    seq_lens: Sequence[int],  # [R], host values
    scale: float,
    output: torch.Tensor,  # [T, Hq, D], rows of the R requests are written
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_decodes: int = 0,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its cached sequence.

    Request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``, the last
    tokens of its ``seq_lens[i]``-token sequence. The first ``num_decodes`` requests must
    have one query token each; they are computed together, the rest one by one.
    """
    if num_decodes:
        _decode_batch(
            query,
            key_cache,
            value_cache,
            block_table,
            seq_lens,
            scale,
            output,
            num_decodes,
            sliding_window,
            soft_cap,
        )
    for i in range(num_decodes, len(seq_lens)):
        start, end, seq_len = query_start_loc[i], query_start_loc[i + 1], seq_lens[i]
        if end == start or seq_len == 0:
            continue
        num_blocks = -(-seq_len // key_cache.shape[1])
        blocks = block_table[i, :num_blocks].long()
        keys = key_cache[blocks].flatten(0, 1)[:seq_len]  # [S, Hkv, D]
        values = value_cache[blocks].flatten(0, 1)[:seq_len]
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        visible = _visible(q_pos[:, None], k_pos[None, :], sliding_window)  # [L, S]
        out = _attend(
            query[start:end][None], keys[None], values[None], visible[None], scale, soft_cap
        )
        output[start:end] = out[0].to(output.dtype)
    return output


def _decode_batch(
    query,
    key_cache,
    value_cache,
    block_table,
    seq_lens,
    scale,
    output,
    num_decodes,
    sliding_window,
    soft_cap,
) -> None:
    block_size = key_cache.shape[1]
    lens = torch.as_tensor(seq_lens[:num_decodes], device=query.device)
    max_blocks = max(1, -(-int(lens.max()) // block_size))
    blocks = block_table[:num_decodes, :max_blocks].long()  # [N, MB]
    # a shorter request's columns past its last block hold whatever the caller left there
    # (-1 or any value: never checked, never attended to); read block 0 for them instead
    blocks = blocks.masked_fill((blocks < 0) | (blocks >= key_cache.shape[0]), 0)
    keys = key_cache[blocks].flatten(1, 2)  # [N, MB*BS, Hkv, D]
    values = value_cache[blocks].flatten(1, 2)
    k_pos = torch.arange(keys.shape[1], device=query.device)[None, None, :]  # [1, 1, S]
    q_pos = (lens - 1)[:, None, None]  # [N, 1, 1]
    visible = _visible(q_pos, k_pos, sliding_window) & (k_pos < lens[:, None, None])
    out = _attend(query[:num_decodes, None], keys, values, visible, scale, soft_cap)
    valid = lens > 0  # padding requests (length 0) keep their rows
    output[:num_decodes][valid] = out[valid, 0].to(output.dtype)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible = visible & (q_pos - k_pos < sliding_window)
    return visible


def _attend(
    q: torch.Tensor,  # [N, L, Hq, D]
    k: torch.Tensor,  # [N, S, Hkv, D]
    v: torch.Tensor,  # [N, S, Hkv, Dv]
    visible: torch.Tensor,  # [N, L, S] bool
    scale: float,
    soft_cap: float | None,
) -> torch.Tensor:
    n, length, num_heads, dim = q.shape
    num_kv_heads = k.shape[2]
    qg = q.float().view(n, length, num_kv_heads, num_heads // num_kv_heads, dim)
    scores = torch.einsum("nlhgd,nshd->nhgls", qg, k.float()) * scale  # [N, Hkv, G, L, S]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with nothing visible -> 0
    out = torch.einsum("nhgls,nshd->nlhgd", probs, v.float())
    return out.reshape(n, length, num_heads, v.shape[-1])  # MLA: values narrower than keys

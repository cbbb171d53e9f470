"""KV-cache write (Triton): scatter each token's key and value into its slot of the paged cache.

Reference: ``graphattn.kernels.reference.write_kv_cache_ref``. One program per (token, chunk
of KV heads); a token whose slot is negative (a padding token) writes nothing, so the
launch is the same for every batch padded to one token count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphattn.kernels.checks import (
    FLOAT_DTYPES,
    expect_dim,
    expect_dtype,
    expect_min_dim,
    expect_ndim,
    expect_same_device,
    expect_same_strides,
    expect_unit_last_stride,
)

SLOT_DTYPES = (torch.int64, torch.int32)
_MAX_HEADS_PER_PROGRAM = 8


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor | None,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    value_cache: torch.Tensor | None,  # [NB, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [>= T] int64, -1 = skip
) -> None:
    """Write ``key[t]`` and ``value[t]`` to slot ``slot_mapping[t]`` (cast to the cache dtype).

    ``value`` and ``value_cache`` both None: a cache of one tensor a slot (MLA's latent
    entries, whose values are a view of the keys), written once.
    """
    if (value is None) != (value_cache is None):
        raise ValueError(
            "value and value_cache go together: both tensors, or both None for a cache "
            f"without values; got value={_kind(value)}, value_cache={_kind(value_cache)}"
        )
    has_value = value is not None
    if not has_value:  # the keys stand in: checked like a value, never read by the kernel
        value, value_cache = key, key_cache
    check_write_args(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    heads_per_program = min(triton.next_power_of_2(num_kv_heads), _MAX_HEADS_PER_PROGRAM)
    grid = (num_tokens, triton.cdiv(num_kv_heads, heads_per_program))
    _write_kv_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        num_kv_heads,
        BLOCK_SIZE=key_cache.shape[1],
        HEAD_SIZE=head_size,
        BLOCK_H=heads_per_program,
        BLOCK_D=triton.next_power_of_2(head_size),
        HAS_VALUE=has_value,
    )


def _kind(t: torch.Tensor | None) -> str:
    return "None" if t is None else "a tensor"


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # cache strides (both caches share them): block, slot in block, head
    stride_cs,
    stride_ch,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_VALUE: tl.constexpr,  # False: keys only (a cache of one tensor a slot)
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token
        return
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    dims = tl.arange(0, BLOCK_D)  # [BD]
    mask = (heads < num_kv_heads)[:, None] & (dims < HEAD_SIZE)[None, :]  # [BH, BD]
    row = token.to(tl.int64)
    k = tl.load(key_ptr + row * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    dst_offs = dst + heads[:, None] * stride_ch + dims[None, :]  # [BH, BD]
    tl.store(key_cache_ptr + dst_offs, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    if HAS_VALUE:
        v_offs = row * stride_vt + heads[:, None] * stride_vh + dims[None, :]
        v = tl.load(value_ptr + v_offs, mask=mask)
        tl.store(value_cache_ptr + dst_offs, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def check_write_args(key, value, key_cache, value_cache, slot_mapping) -> None:
    """The arguments of a KV-cache write (here or inside an attention launch), checked."""
    expect_ndim("key", key, 3, "[num_tokens, num_kv_heads, head_size]")
    expect_ndim("key_cache", key_cache, 4, "[num_blocks, block_size, num_kv_heads, head_size]")
    expect_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    if value.shape != key.shape:
        raise ValueError(f"value must have key's shape {list(key.shape)}, got {list(value.shape)}")
    expect_same_strides("key_cache", key_cache, "value_cache", value_cache)
    expect_dim("key_cache", key_cache, 2, key.shape[1], "num_kv_heads")
    expect_dim("key_cache", key_cache, 3, key.shape[2], "head_size")
    expect_min_dim("slot_mapping", slot_mapping, 0, key.shape[0], "num_tokens")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache)):
        expect_dtype(name, t, FLOAT_DTYPES)
        expect_unit_last_stride(name, t)
    expect_dtype("value", value, (key.dtype,))
    expect_dtype("value_cache", value_cache, (key_cache.dtype,))
    expect_dtype("slot_mapping", slot_mapping, SLOT_DTYPES)
    expect_same_device(
        {
            "key": key,
            "value": value,
            "key_cache": key_cache,
            "value_cache": value_cache,
            "slot_mapping": slot_mapping,
        }
    )

"""The paged KV cache: specs, groups of layers, per-layer tensors, the block allocator and kernel blocks."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from graphattn.batch import is_int
from graphattn.errors import ConfigError, InvalidInputError, OutOfBlocksError


@dataclass(frozen=True)
class FullAttentionSpec:
    """What one layer keeps per cached token: keys and values of ``num_kv_heads`` heads."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def elements_per_slot(self) -> int:
        """Cache elements one token takes in one layer: a key and a value per KV head."""
        return 2 * self.num_kv_heads * self.head_size

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer, keys and values together."""
        return self.block_size * self.elements_per_slot * self.dtype.itemsize

    def describe(self) -> str:
        return (
            f"full(kv_heads={self.num_kv_heads}, head={self.head_size}, {_dtype_name(self.dtype)})"
        )


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """A layer that attends only to the last ``sliding_window`` tokens (itself included)."""

    sliding_window: int = 0

    def describe(self) -> str:
        return (
            f"sliding(window={self.sliding_window}, kv_heads={self.num_kv_heads}, "
            f"head={self.head_size}, {_dtype_name(self.dtype)})"
        )


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """An MLA layer (``ga.MLAAttention``): one entry per token shared by every head, the
    compressed KV (``kv_lora_rank`` values, which are also the values attention sums) and
    then the rotary key part; ``head_size`` is their sum and ``num_kv_heads`` is 1."""

    kv_lora_rank: int = 0
    # the layer's query heads, which all read the one entry: not what the cache holds, but
    # TRITON_MLA's builder sizes its split scratch by them at start-up
    num_heads: int = 0

    @property
    def elements_per_slot(self) -> int:
        return self.head_size

    def describe(self) -> str:
        return (
            f"mla(latent={self.kv_lora_rank}, rope={self.head_size - self.kv_lora_rank}, "
            f"heads={self.num_heads}, {_dtype_name(self.dtype)})"
        )


KVCacheSpec = FullAttentionSpec  # the base class names the protocol every spec follows


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers with one KV-cache spec; they share a block table and a ``CommonAttentionMetadata``.

    ``kernel_block_size`` is the block size the group's kernels address; when it is smaller
    than the manager's ``spec.block_size`` the block table is rewritten into kernel blocks.
    """

    group_id: int
    spec: FullAttentionSpec
    layer_names: tuple[str, ...]
    kernel_block_size: int

    @property
    def blocks_per_kernel_block(self) -> int:
        """How many kernel blocks make one manager block (1 when they are the same size)."""
        return self.spec.block_size // self.kernel_block_size


def group_layers_by_spec(
    layer_specs: Mapping[str, FullAttentionSpec],
    kernel_block_sizes: Mapping[str, Sequence[int]],
) -> list[KVCacheGroup]:
    """One group per distinct spec, in the order the layers first appear.

    ``kernel_block_sizes`` gives, per layer, the kernel block sizes its backend supports
    (empty: any); the group takes the largest size that every layer supports and that
    divides the manager's block size.
    """
    order: dict[FullAttentionSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        order.setdefault(spec, []).append(name)
    groups = []
    for group_id, (spec, names) in enumerate(order.items()):
        constraints = [set(kernel_block_sizes[n]) for n in names if kernel_block_sizes[n]]
        size = spec.block_size
        if constraints:
            common = sorted(set.intersection(*constraints))
            if not common:
                listing = "; ".join(
                    f"{n}: {sorted(kernel_block_sizes[n])}" for n in names if kernel_block_sizes[n]
                )
                raise ConfigError(
                    f"the layers of one KV-cache group ({spec.describe()}) share no kernel block "
                    f"size, so no block layout serves all of their backends: {listing}"
                )
            size = choose_kernel_block_size(spec.block_size, common, what=f"layers {names}")
        groups.append(KVCacheGroup(group_id, spec, tuple(names), size))
    return groups


def choose_kernel_block_size(block_size: int, supported: Iterable[int], *, what: str) -> int:
    """The largest supported kernel block size that divides ``block_size``."""
    fitting = [s for s in supported if s <= block_size and block_size % s == 0]
    if not fitting:
        raise ConfigError(
            f"block_size {block_size} is not a multiple of any kernel block size "
            f"{sorted(supported)} supported by {what}"
        )
    return max(fitting)


def to_kernel_block_table(block_table: np.ndarray, ratio: int) -> np.ndarray:
    """Rewrite manager blocks into ``ratio`` kernel blocks each: id b becomes b*ratio .. b*ratio+ratio-1.

    ``block_table`` is ``[num_reqs, num_blocks]``; the result is ``[num_reqs, num_blocks*ratio]``.
    """
    if ratio == 1:
        return block_table
    offsets = np.arange(ratio, dtype=block_table.dtype)
    kernel = block_table[:, :, None] * ratio + offsets  # [R, B, ratio]
    return kernel.reshape(block_table.shape[0], -1)


class BlockAllocator:
    """Hands out block ids of a fixed pool; exhaustion or a bad free is a typed error."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # a stack: the lowest ids first, then the most recently freed (in the order freed)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._in_use = np.zeros(num_blocks, dtype=bool)
        # whether the caller took blocks with allocate (debug's checks against the allocator
        # start then; ``generate`` puts it back as it was, since it frees what it took)
        self.handed_out = False
        # debug=True's record of where each allocated block sits: the block-table entry (the
        # block's place in its sequence) at which a step last used it, -1 where no step has
        # since its allocate. validation.py writes it after a step's checks pass; allocate
        # and free clear it, so a block handed out again starts with no place.
        self.entries = np.full(num_blocks, -1, dtype=np.int32)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> np.ndarray:
        """``[num_blocks]`` bool, True where a block is allocated (a live, read-only view)."""
        view = self._in_use.view()
        view.flags.writeable = False
        return view

    def allocate(self, n: int) -> list[int]:
        """``n`` free block ids; on exhaustion raises and allocates nothing."""
        if not is_int(n) or n < 0:
            raise InvalidInputError(f"the number of blocks must be an int >= 0, got {n!r}")
        if n > len(self._free):
            raise OutOfBlocksError(
                f"asked for {n} KV-cache blocks but only {len(self._free)} of "
                f"{self.num_blocks} are free"
            )
        ids = [self._free.pop() for _ in range(n)]
        self._in_use[ids] = True
        self.entries[ids] = -1
        self.handed_out = self.handed_out or n > 0
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Return blocks to the pool; an id that is not allocated raises and frees nothing."""
        try:
            ids = list(block_ids)
        except TypeError:
            raise InvalidInputError(
                f"block_ids must be a sequence of ints, got {type(block_ids).__name__}"
            ) from None
        not_ints = [b for b in ids if not is_int(b)]
        if not_ints:
            raise InvalidInputError(f"block ids must be ints, got {not_ints[0]!r}")
        counts = Counter(ids)
        outside = [b for b in counts if not 0 <= b < self.num_blocks]
        not_allocated = [b for b in counts if 0 <= b < self.num_blocks and not self._in_use[b]]
        repeated = sorted(b for b, k in counts.items() if k > 1)
        if outside or not_allocated or repeated:
            why = [
                f"{what} {found}"
                for what, found in (
                    (f"outside [0, {self.num_blocks}):", outside),
                    ("not allocated (free already, or never handed out):", not_allocated),
                    ("given more than once:", repeated),
                )
                if found
            ]
            raise OutOfBlocksError(
                f"cannot free block ids {ids if len(ids) <= 8 else ids[:8] + ['...']}: expected "
                f"distinct allocated ids; {'; '.join(why)}. Nothing was freed"
            )
        ids = [int(b) for b in ids]  # ids handed out later are plain ints, whatever came in
        self._in_use[ids] = False
        self.entries[ids] = -1
        self._free.extend(reversed(ids))


class KVCache:
    """Per-layer cache tensors in each backend's layout, the groups, and the block allocator.

    Made once at start-up; lives as long as the engine. ``tensors[layer_name]`` is the
    tensor the layer's backend reads and writes.
    """

    def __init__(
        self,
        groups: Sequence[KVCacheGroup],
        num_blocks: int,
        shape_of: Callable[[str, KVCacheGroup, int], tuple[int, ...]],
        device: torch.device,
    ) -> None:
        self.groups = list(groups)
        self.num_blocks = num_blocks
        self.block_size = self.groups[0].spec.block_size if self.groups else 0
        layouts = {
            name: (shape_of(name, group, num_blocks * group.blocks_per_kernel_block), group)
            for group in self.groups
            for name in group.layer_names
        }
        needed = sum(
            math.prod(shape) * group.spec.dtype.itemsize for shape, group in layouts.values()
        )
        _check_fits(needed, num_blocks, device)  # a ConfigError, not an out-of-memory crash
        self.allocator = BlockAllocator(num_blocks)
        self.tensors: dict[str, torch.Tensor] = {
            name: torch.zeros(shape, dtype=group.spec.dtype, device=device)
            for name, (shape, group) in layouts.items()
        }

    def allocate(self, n: int) -> list[int]:
        return self.allocator.allocate(n)

    def free(self, block_ids: Iterable[int]) -> None:
        self.allocator.free(block_ids)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def available_bytes(device: torch.device) -> int | None:
    """Memory a new allocation on ``device`` can take: the GPU's free memory plus what
    torch's caching allocator holds unused, or on a Linux host MemAvailable; None where it
    cannot be read."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_fits(needed: int, num_blocks: int, device: torch.device) -> None:
    available = available_bytes(device)
    if available is None or needed <= available:
        return
    per_block = needed / num_blocks
    raise ConfigError(
        f"a KV cache of num_blocks={num_blocks} needs {_gib(needed)} ({per_block:,.0f} bytes a "
        f"block over every layer) but {device} has {_gib(available)} available; at most "
        f"{int(available // per_block):,} blocks would fit"
    )


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.2f} MiB"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

"""The attention contract: a backend class, a metadata builder per group and an impl per layer.

Lifetimes:
- ``AttentionBackend``: a class with static and class methods only; never instantiated.
- ``AttentionMetadataBuilder``: one per attention group, made at start-up; ``build`` runs
  once per group per step and its result is shared by every layer of the group.
- ``AttentionImpl``: one per layer, made in the layer's constructor; ``forward`` runs once
  per layer per step.
- ``CommonAttentionMetadata``: one per KV-cache group per step, made by the runner from
  its persistent buffers; builders turn it into their own metadata.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch

from graphattn.errors import BackendError, arrived

if TYPE_CHECKING:
    from graphattn.config import CompileConfig
    from graphattn.kv_cache import FullAttentionSpec


class AttentionCGSupport(enum.IntEnum):
    """What a metadata builder allows under full CUDA graphs (higher allows more)."""

    NEVER = 0  # host-side decisions per step: only eager or piecewise
    UNIFORM_SINGLE_TOKEN_DECODE = 1  # full graphs for batches of one-token decodes
    UNIFORM_BATCH = 2  # full graphs for batches whose requests all have the same query length
    ALWAYS = 3  # full graphs for any batch, mixed prefills included


@dataclass(frozen=True)
class AttentionSelectorConfig:
    """What a backend is asked to serve; ``validate_configuration`` judges it."""

    head_size: int
    num_heads: int
    num_kv_heads: int
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    block_size: int
    device_type: str
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    use_mla: bool = False  # a ga.MLAAttention layer: only an MLA backend serves it


@dataclass
class CommonAttentionMetadata:
    """The step's batch as every backend sees it, for one KV-cache group.

    Requests are ordered decodes first. Tensors live on the model's device unless named
    ``*_cpu``. Under a padded batch (a captured graph replayed for fewer tokens) the
    tensors cover ``num_reqs`` requests and ``num_input_tokens`` tokens: padding requests
    have sequence length 0, padding tokens have slot -1, and kernels skip both.
    """

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, cumulative query lengths
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, computed + new tokens
    seq_lens_cpu: torch.Tensor  # [num_reqs] int32, seq_lens on the host (the same values)
    max_seq_len: int
    num_reqs: int
    num_actual_tokens: int  # real tokens, before padding
    num_input_tokens: int  # tokens the model runs on, padding included
    max_query_len: int
    block_table_tensor: torch.Tensor  # [num_reqs, max_blocks] int32, in kernel blocks
    slot_mapping: torch.Tensor  # [num_input_tokens] int64, -1 for padding
    positions: torch.Tensor  # [num_input_tokens] int64
    is_prefilling: torch.Tensor  # [num_reqs] bool on the CPU: the request computes > 1 token
    causal: bool = True
    # Every request has one query token, in this batch and in every batch a launch built
    # from this metadata will run for: a FULL graph's key fixes it (a graph captured for
    # mixed batches says False even when its capture batch happened to be all decodes).
    uniform_decode: bool = False
    # Every request has this many query tokens, in the same sense (1 when uniform_decode;
    # uniform_decode_query_len for a FULL graph of speculative-decoding verify batches,
    # padding requests included); None when the requests' lengths differ or may differ.
    uniform_query_len: int | None = None
    # A backend may move the step's KV-cache write from do_kv_cache_update into its
    # attention launch only when this is True: the update op and attention then run in one
    # CUDA graph (FULL) or both eagerly, so a choice made while capturing cannot go stale.
    # False under PIECEWISE, where the update op may be captured inside a piece (custom
    # splitting_ops) while attention runs eagerly between pieces.
    fuse_kv_update: bool = False

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]


def split_decodes_and_prefills(cam: CommonAttentionMetadata, threshold: int = 1) -> tuple[int, int]:
    """(num_decodes, num_decode_tokens): the leading requests with query length <= threshold.

    Relies on the runner's decodes-first order.
    """
    query_lens = cam.query_lens_cpu[: cam.num_reqs]
    is_prefill = query_lens > threshold
    if not bool(is_prefill.any()):
        return cam.num_reqs, cam.num_actual_tokens
    num_decodes = int(is_prefill.int().argmax())
    return num_decodes, int(cam.query_start_loc_cpu[num_decodes])


M = TypeVar("M")


class AttentionMetadataBuilder(ABC, Generic[M]):
    """Turns a ``CommonAttentionMetadata`` into a backend's own metadata, once per group per step.

    Made once per attention group at start-up. Buffers a graph must read by address belong
    here (allocated in ``__init__`` at the largest size), never in ``build``.
    """

    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    # Requests with at most this many query tokens count as decodes and are put first.
    reorder_batch_threshold: ClassVar[int | None] = None
    # True when ``build`` launches device work that reads or writes the step's device
    # inputs (the tensors of ``CommonAttentionMetadata``). Under a FULL replay those inputs
    # reach the device inside the graph, after ``build`` (reads would see the previous
    # step's values, writes would be copied over); such a builder makes the runner copy
    # them before ``build`` on every step instead.
    uses_device_inputs_in_build: ClassVar[bool] = False
    # False when ``build`` only describes launches: it reads the ``cam`` it is given, returns
    # a new metadata object and changes nothing else (no device work, no buffer written, no
    # state a later step reads). A FULL replay holds the captured launches already, so when
    # every group's builder says False the runner skips the metadata on FULL replays.
    full_replay_needs_build: ClassVar[bool] = True

    def __init__(
        self,
        kv_cache_spec: FullAttentionSpec,
        layer_names: list[str],
        config: CompileConfig,
        device: torch.device,
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.config = config
        self.device = device

    @classmethod
    def get_cudagraph_support(
        cls, config: CompileConfig, kv_cache_spec: FullAttentionSpec
    ) -> AttentionCGSupport:
        """The support level for this configuration (default: the class attribute)."""
        return cls.cudagraph_support

    @abstractmethod
    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata) -> M:
        """This step's metadata for every layer of the group."""

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> M:
        """Metadata for a capture run; the same as ``build`` unless a backend needs otherwise."""
        return self.build(0, common_attn_metadata)

    def update_block_table(
        self, metadata: M, block_table: torch.Tensor, slot_mapping: torch.Tensor
    ) -> M:
        """Metadata reused with another group's block table; backends may override."""
        raise NotImplementedError(f"{type(self).__name__} cannot reuse metadata across groups")


class AttentionImpl(ABC):
    """One layer's attention computation; made in the layer's constructor."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap

    @abstractmethod
    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,  # [T, Hq, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # the backend's get_kv_cache_shape layout
        attn_metadata: Any,  # None in the profile run: fill output with zeros
        output: torch.Tensor,  # [T, Hq, D], written in place
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the step's queries over the cache; writes and returns ``output``."""

    def forward_o_proj(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,  # [T, Hq, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,
        attn_metadata: Any,  # None in the profile run
        weight: torch.Tensor,  # [N, Hq * D], the output projection's weight
        output: torch.Tensor,  # [T, N] fp32, written in place
    ) -> torch.Tensor:
        """Attention, then the output projection: ``forward``'s rows ``[T, Hq * D] @
        weight.T`` into the fp32 ``output`` (the ``graphattn::unified_attention_o_proj`` op
        that ``passes/o_proj_fold.py`` calls in place of attention and the o_proj linear).
        This default runs ``forward``, then the matmul into ``output``: for fp32 rows directly;
        on CUDA in bf16 or fp16 one cuBLAS call writes its fp32 sums (``out_dtype``: the sums
        the linear it replaces rounds, and the next piece rounds them); elsewhere the matmul
        in the rows' dtype and a copy. A backend whose kernels can fold the projection into
        attention overrides it (TRITON)."""
        rows = torch.empty_like(query)
        result = self.forward(layer, query, key, value, kv_cache, attn_metadata, rows)
        if result is not None and result is not rows:
            check_wrote_output(
                result, rows, f"{type(self).__qualname__}.forward (via forward_o_proj)"
            )
        rows = rows.view(query.shape[0], -1)
        if rows.dtype == output.dtype:  # fp32 rows: the matmul writes the buffer itself
            return torch.mm(rows, weight.t(), out=output)
        if rows.is_cuda and rows.dtype in (torch.bfloat16, torch.float16):
            # no copy kernel: at batch 8 in FULL graphs the copy cost 50 us a step (round 38)
            return torch.mm(rows, weight.t(), out_dtype=output.dtype, out=output)
        return output.copy_(torch.mm(rows, weight.t()))

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64, -1 for tokens to skip
    ) -> None:
        """Write the step's keys and values (backends whose forward does not)."""
        raise NotImplementedError(
            f"{type(self).__name__} has no do_kv_cache_update: its backend must keep "
            "forward_includes_kv_cache_update = True (the default) and write the cache in forward"
        )


class AttentionBackend(ABC):
    """A family of attention kernels: names its impl and builder and says what it supports.

    Only static and class methods; never instantiated.
    """

    # When False the layer calls the KV-cache-update op (and so do_kv_cache_update)
    # before the attention op; when True forward writes the cache itself.
    forward_includes_kv_cache_update: ClassVar[bool] = True
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.float16,
        torch.bfloat16,
        torch.float32,
    )
    supported_devices: ClassVar[tuple[str, ...]] = ("cuda",)

    @staticmethod
    @abstractmethod
    def get_name() -> str: ...

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]: ...

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """The layer's cache tensor shape; by default keys and values stacked:
        ``(2, num_blocks, block_size, num_kv_heads, head_size)``. An MLA backend keeps one
        entry per token (``num_blocks * block_size * head_size`` elements; num_kv_heads is 1).
        """
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def is_mla(cls) -> bool:
        """Whether the backend serves ``ga.MLAAttention`` layers (and only those): its impl
        gets the absorbed queries ``[T, H, kv_lora_rank + rope]``, the step's cache entries
        as ``key`` ``[T, 1, kv_lora_rank + rope]`` and their first ``kv_lora_rank`` columns
        as ``value``, and writes ``[T, H, kv_lora_rank]`` (docs/backends.md)."""
        return False

    @classmethod
    def full_cls_name(cls) -> str:
        return f"{cls.__module__}.{cls.__qualname__}"

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size > 0

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in cls.supported_dtypes

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: torch.dtype) -> bool:
        return kv_cache_dtype in cls.supported_dtypes

    @classmethod
    def get_supported_kernel_block_sizes(cls) -> tuple[int, ...]:
        """Block sizes the kernels address; the manager's block size must be a multiple of one.

        An empty tuple means the kernels address any block size as it is.
        """
        return (16, 32, 64)

    @classmethod
    def supports_block_size(cls, block_size: int) -> bool:
        sizes = cls.get_supported_kernel_block_sizes()
        return not sizes or any(block_size % s == 0 for s in sizes)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_logits_soft_cap(cls) -> bool:
        return False

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False

    @classmethod
    def validate_configuration(cls, cfg: AttentionSelectorConfig) -> list[str]:
        """Every reason this backend cannot serve ``cfg``; an empty list means it can."""
        reasons = []  # the kind (is_mla against cfg.use_mla) is selection's to check
        if cfg.device_type not in cls.supported_devices:
            reasons.append(f"device {cfg.device_type} not in {list(cls.supported_devices)}")
        if not cls.supports_head_size(cfg.head_size):
            reasons.append(f"head size {cfg.head_size} not supported")
        if not cls.supports_dtype(cfg.dtype):
            reasons.append(f"dtype {cfg.dtype} not supported")
        if not cls.supports_kv_cache_dtype(cfg.kv_cache_dtype):
            reasons.append(f"kv cache dtype {cfg.kv_cache_dtype} not supported")
        if not cls.supports_block_size(cfg.block_size):
            sizes = list(cls.get_supported_kernel_block_sizes())
            reasons.append(f"block size {cfg.block_size} is not a multiple of {sizes}")
        if cfg.sliding_window is not None and not cls.supports_sliding_window():
            reasons.append("sliding window not supported")
        if cfg.logits_soft_cap is not None and not cls.supports_logits_soft_cap():
            reasons.append("logits soft-capping not supported")
        return reasons


def check_wrote_output(result: object, output: torch.Tensor, who: str) -> None:
    """An impl's ``forward`` writes its rows into ``output`` and returns it (or None, or a
    view of it, such as its real tokens' rows). Whatever else it returns is dropped by the
    op, so a new tensor would leave ``output`` unwritten and the model would read whatever
    that memory held: a ``BackendError`` naming ``who`` (the impl's method and backend)
    instead."""
    if (
        isinstance(result, torch.Tensor)
        and result.untyped_storage().data_ptr() == output.untyped_storage().data_ptr()
    ):
        return
    got = ("a new tensor " if isinstance(result, torch.Tensor) else "") + arrived(result)
    raise BackendError(
        f"{who} returned {got}, not the output it was given ({arrived(output)}): an impl "
        "writes its result into output in place and returns output (or None, or a view of "
        "it); anything else it returns is dropped, so output would stay unwritten"
    )

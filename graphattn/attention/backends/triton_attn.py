"""TRITON: the production backend, Triton kernels over the paged KV cache (graphattn.kernels).

Full CUDA graphs for any batch (``AttentionCGSupport.ALWAYS``): the launch — which path,
grid, tile constants — is a function of the padded token and request counts and static
configuration only (``graphattn.kernels.attention_plan``); the kernels read every
per-request length from device tensors. The KV-cache write is a separate op
(``do_kv_cache_update``) except for decode batches (one query token per request) that
``CommonAttentionMetadata.fuse_kv_update`` allows (FULL graphs and eager steps), whose
attention launch writes the new keys and values itself. On the CPU it runs under the Triton interpreter
(``TRITON_INTERPRET=1``), ranked below TORCH_REF.

The Triton kernel modules are imported when the first builder is made or the first
launch runs, not with this module: Triton decides between compiling and interpreting when
a kernel is defined, and this module must import where Triton is missing.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from graphattn import envs
from graphattn.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSelectorConfig,
    CommonAttentionMetadata,
)
from graphattn.attention.forward_context import get_forward_context
from graphattn.attention.registry import register_backend
from graphattn.kernels import triton_import_error as _triton_import_error
from graphattn.kernels.attention_plan import MAX_GROUP, choose_num_splits  # no Triton needed

SUPPORTED_HEAD_SIZES = (64, 80, 96, 128, 256)
CPU_NUM_SMS = 4  # "SMs" the split choice assumes under the interpreter (exercises split-KV)
# The most tokens a step may have for forward_o_proj to fold o_proj into the split-KV
# reduction: each of its programs merges every token's splits for its block of o_proj's
# columns, so the merge's reads grow with the tokens times the column blocks (32 at
# Llama-3.2-1B's shape). Measured only at one token (docs/performance.md).
O_PROJ_FOLD_MAX_TOKENS = 1


@dataclass(slots=True)
class TritonMetadata:
    """One step of one attention group: the padded batch's device tensors and launch sizes."""

    num_actual_tokens: int
    num_input_tokens: int  # padded; the launch covers this many tokens
    num_reqs: int  # padded
    num_splits: int  # split-KV splits asked for (the impl caps them by its head group)
    uniform_decode: bool  # every request has one query token (part of a graph's key)
    uniform_query_len: int | None  # every request has this many (a verify graph's key)
    write_kv_in_attention: bool  # decodes where cam.fuse_kv_update allows: forward writes K/V
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, kernel blocks
    slot_mapping: torch.Tensor  # [num_input_tokens] int64, -1 for padding
    scratch: Any  # split_kv.SplitScratch, shared by the group's layers


class TritonMetadataBuilder(AttentionMetadataBuilder[TritonMetadata]):
    """Owns the split-KV scratch (allocated once, at the largest decode batch) and turns each
    step's padded ``CommonAttentionMetadata`` into ``TritonMetadata`` without a device sync.
    """

    cudagraph_support = AttentionCGSupport.ALWAYS
    reorder_batch_threshold = 1  # decodes first like the other backends; the kernels need no order
    # build fills a TritonMetadata from cam (the split count is a host-side cache): a FULL
    # replay, whose launches were captured with the same sizes, never reads it
    full_replay_needs_build = False

    def __init__(self, kv_cache_spec, layer_names, config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, config, device)
        split_kv = _kernels().split_kv
        # Split-KV runs for batches of at most max_num_seqs tokens (decode-sized).
        self.split_capacity = config.max_num_seqs
        self.scratch = split_kv.SplitScratch.allocate(
            self.split_capacity, kv_cache_spec.num_kv_heads, kv_cache_spec.head_size, device
        )
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else CPU_NUM_SMS
        )
        self._splits: dict[int, int] = {}  # num_reqs -> splits

    def build(self, common_prefix_len: int, cam: CommonAttentionMetadata) -> TritonMetadata:
        return TritonMetadata(
            cam.num_actual_tokens,
            cam.num_input_tokens,
            cam.num_reqs,
            self.num_splits(cam.num_input_tokens, cam.num_reqs),
            cam.uniform_decode,
            cam.uniform_query_len,
            cam.uniform_decode and cam.fuse_kv_update,
            cam.query_start_loc,
            cam.seq_lens,
            cam.block_table_tensor,
            cam.slot_mapping,
            self.scratch,
        )

    def build_for_cudagraph_capture(self, cam: CommonAttentionMetadata) -> TritonMetadata:
        """The same as ``build``: nothing in the metadata depends on the capture batch's lengths."""
        return self.build(0, cam)

    def num_splits(self, num_tokens: int, num_reqs: int) -> int:
        """Split-KV splits for a padded batch: more than one only for decode-sized batches
        with too few (request, KV head) pairs to fill the GPU.
        """
        if num_tokens > self.split_capacity:
            return 1
        splits = self._splits.get(num_reqs)  # at most max_num_seqs entries
        if splits is None:
            heads = self.kv_cache_spec.num_kv_heads
            splits = self._splits[num_reqs] = choose_num_splits(num_reqs, heads, self.num_sms)
        return splits


class TritonImpl(AttentionImpl):
    """One layer's launches; the kernels are looked up per call (a cached import), so a
    layer can name TRITON where Triton is missing and still get selection's clear error.
    """

    # Uniform batches of a few tokens a request (speculative-decoding verify graphs, and
    # eager or piecewise steps whose requests all have that many) take the decode tiles where
    # one holds a request (attention_plan): 16 rows for Llama-3.2-1B's 4 tokens x 4 heads,
    # where the prefill tiles' 128 rows would mask 7 of 8. Measured on the H200 in round 41
    # (benchmarks/spec_decode.py sets it False on one engine to compare): 5% faster than
    # the prefill tiles at batch 8, 11% at 32, a tie at 1.
    verify_decode_tiles = True

    def forward(
        self,
        layer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        output,
        output_scale=None,
        output_block_scale=None,
    ):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(
                "TRITON does not support fused output quantization (output_scale / "
                "output_block_scale); use an unquantized output"
            )
        if attn_metadata is None:  # profile run
            return output.zero_()
        md: TritonMetadata = attn_metadata
        return self._launch(query, key, value, kv_cache, md, output, self.plan_of(md, query))

    def forward_o_proj(self, layer, query, key, value, kv_cache, attn_metadata, weight, output):
        """Attention and o_proj; for a step of at most ``O_PROJ_FOLD_MAX_TOKENS`` tokens
        with split-KV merged by the reduction kernel, o_proj runs inside that kernel
        (``split_kv.reduce_splits_o_proj``): one launch and one kernel boundary less per
        layer. Anything else takes the base class's attention and matmul."""
        md: TritonMetadata | None = attn_metadata
        if md is not None and md.num_input_tokens <= O_PROJ_FOLD_MAX_TOKENS:
            plan = self.plan_of(md, query)
            kernels = _kernels()
            foldable = (
                kernels.unified_attention.o_proj_refusal(plan, kernels.split_kv.fused_merge())
                is None
                and weight.dtype == query.dtype
                and weight.is_contiguous()
                and output.is_contiguous()
            )
            if foldable:  # the attention rows stay in the scratch: no buffer for them
                return self._launch(query, key, value, kv_cache, md, None, plan, (weight, output))
        return super().forward_o_proj(
            layer, query, key, value, kv_cache, attn_metadata, weight, output
        )

    def _launch(self, query, key, value, kv_cache, md, output, plan, o_proj=None):
        key_cache, value_cache = kv_cache.unbind(0)
        return _kernels().unified_attention.unified_attention(
            query,
            key_cache,
            value_cache,
            output,
            md.block_table,
            md.query_start_loc,
            md.seq_lens,
            plan,
            scale=self.scale,
            sliding_window=self.sliding_window,
            soft_cap=self.logits_soft_cap,
            scratch=md.scratch,
            # decodes: this launch also writes the step's keys and values (the update op
            # skipped them), one kernel per layer instead of two
            new_kv=(key, value, md.slot_mapping) if md.write_kv_in_attention else None,
            o_proj=o_proj,
        )

    def plan_of(self, md: TritonMetadata, query: torch.Tensor):
        return self.plan(md, query.dtype, query.device.type)

    def plan(self, md: TritonMetadata, dtype: torch.dtype, device_type: str):
        """This layer's launch for the step (cached: a function of padded sizes only)."""
        return _kernels().attention_plan.plan_attention(
            md.num_input_tokens,
            md.num_reqs,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=dtype,
            device_type=device_type,
            num_splits=md.num_splits,
            uniform_decode=md.uniform_decode,
            uniform_query_len=md.uniform_query_len if self.verify_decode_tiles else None,
        )

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        metadata = get_forward_context().attn_metadata
        if metadata is not None and metadata[layer.layer_name].write_kv_in_attention:
            return  # forward writes decodes' keys and values in its attention launch
        key_cache, value_cache = kv_cache.unbind(0)
        _kernels().kv_cache_write.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


class TritonBackend(AttentionBackend):
    forward_includes_kv_cache_update = False
    supported_devices = ("cuda", "cpu")

    @staticmethod
    def get_name() -> str:
        return "TRITON"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return TritonMetadataBuilder

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size in SUPPORTED_HEAD_SIZES

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_logits_soft_cap(cls) -> bool:
        return True

    @classmethod
    def validate_configuration(cls, cfg: AttentionSelectorConfig) -> list[str]:
        missing = _triton_import_error()
        if missing is not None:
            return [f"triton is not installed ({missing})"]
        reasons = super().validate_configuration(cfg)
        if not cls.supports_head_size(cfg.head_size):
            reasons.append(f"head sizes supported: {list(SUPPORTED_HEAD_SIZES)}")
        if cfg.device_type == "cpu" and not envs.triton_interpret():
            reasons.append(
                "on the cpu Triton runs only under its interpreter: set TRITON_INTERPRET=1 "
                "before the first TRITON layer is made"
            )
        group = cfg.num_heads // max(cfg.num_kv_heads, 1)
        if group > MAX_GROUP:
            reasons.append(f"{group} query heads per KV head; the kernels take at most {MAX_GROUP}")
        return reasons


@functools.cache
def _kernels() -> ModuleType:
    """The kernel package with its modules loaded (first call defines the Triton kernels)."""
    for name in ("attention_plan", "kv_cache_write", "split_kv", "unified_attention"):
        importlib.import_module(f"graphattn.kernels.{name}")
    return importlib.import_module("graphattn.kernels")


register_backend(TritonBackend, {"cuda": 100, "cpu": 10})

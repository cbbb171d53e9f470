"""TORCH_REF: paged attention in plain PyTorch, the correctness oracle and the CPU default.

It decides per request on the host (a Python loop over prefills), so it allows no full
CUDA graphs (``AttentionCGSupport.NEVER``); under PIECEWISE it runs eagerly between graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphattn.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    split_decodes_and_prefills,
)
from graphattn.attention.registry import register_backend
from graphattn.kernels.reference import paged_attention_ref, write_kv_cache_ref


@dataclass
class TorchRefMetadata:
    """One step of one attention group, with the host copies the Python loop needs."""

    num_actual_tokens: int
    num_decodes: int
    query_start_loc: list[int]  # [num_reqs + 1]
    seq_lens: list[int]  # [num_reqs]
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32 on the device
    slot_mapping: torch.Tensor  # [num_input_tokens] int64 on the device


class TorchRefMetadataBuilder(AttentionMetadataBuilder[TorchRefMetadata]):
    cudagraph_support = AttentionCGSupport.NEVER
    reorder_batch_threshold = 1  # one-token decodes first: they run as one batched gather

    def build(self, common_prefix_len: int, cam: CommonAttentionMetadata) -> TorchRefMetadata:
        num_decodes, _ = split_decodes_and_prefills(cam, self.reorder_batch_threshold)
        return TorchRefMetadata(
            num_actual_tokens=cam.num_actual_tokens,
            num_decodes=num_decodes,
            query_start_loc=cam.query_start_loc_cpu[: cam.num_reqs + 1].tolist(),
            seq_lens=cam.seq_lens_cpu[: cam.num_reqs].tolist(),
            block_table=cam.block_table_tensor[: cam.num_reqs],
            slot_mapping=cam.slot_mapping,
        )


class TorchRefImpl(AttentionImpl):
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
            raise NotImplementedError("TORCH_REF does not fuse output quantization")
        if attn_metadata is None:  # profile run
            return output.zero_()
        md: TorchRefMetadata = attn_metadata
        n = md.num_actual_tokens
        key_cache, value_cache = kv_cache.unbind(0)
        write_kv_cache_ref(key[:n], value[:n], key_cache, value_cache, md.slot_mapping[:n])
        return paged_attention_ref(
            query,
            key_cache,
            value_cache,
            md.block_table,
            md.query_start_loc,
            md.seq_lens,
            self.scale,
            output,
            sliding_window=self.sliding_window,
            soft_cap=self.logits_soft_cap,
            num_decodes=md.num_decodes,
        )


class TorchRefBackend(AttentionBackend):
    forward_includes_kv_cache_update = True
    supported_devices = ("cuda", "cpu")

    @staticmethod
    def get_name() -> str:
        return "TORCH_REF"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchRefImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return TorchRefMetadataBuilder

    @classmethod
    def get_supported_kernel_block_sizes(cls) -> tuple[int, ...]:
        return ()  # gathers whole blocks of any size

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_logits_soft_cap(cls) -> bool:
        return True

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True  # each request is computed on its own


register_backend(TorchRefBackend, {"cpu": 100, "cuda": 0})

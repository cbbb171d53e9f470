"""TORCH_REF_MLA: multi-head latent attention (``ga.MLAAttention``) in plain PyTorch.

The layer has already folded ``kv_b_proj`` into the queries, so attention is MQA over one
cache entry per token: the scores read the whole entry (compressed KV and rotary key), the
values its first ``kv_lora_rank`` columns. The cache is ``[num_blocks, block_size, entry]``.
Like TORCH_REF it decides per request on the host, so it allows no full CUDA graphs
(``NEVER``): under a FULL mode the engine lowers to PIECEWISE and says so.
"""

from __future__ import annotations

from graphattn.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder
from graphattn.attention.backends.torch_ref import TorchRefMetadata, TorchRefMetadataBuilder
from graphattn.attention.registry import register_backend
from graphattn.kernels.reference import paged_attention_ref


class TorchRefMLAImpl(AttentionImpl):
    def forward(
        self,
        layer,
        query,  # [T, H, kv_lora_rank + rope]: the absorbed queries
        key,  # [T, 1, kv_lora_rank + rope]: the step's cache entries
        value,  # [T, 1, kv_lora_rank]: their compressed KV (a view of key)
        kv_cache,  # [num_blocks, block_size, kv_lora_rank + rope]
        attn_metadata,
        output,  # [T, H, kv_lora_rank]
        output_scale=None,
        output_block_scale=None,
    ):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("TORCH_REF_MLA does not fuse output quantization")
        if attn_metadata is None:  # profile run
            return output.zero_()
        md: TorchRefMetadata = attn_metadata
        n = md.num_actual_tokens
        slots = md.slot_mapping[:n]
        valid = slots >= 0
        entries = kv_cache.view(-1, kv_cache.shape[-1])  # [slots, entry]
        entries.index_copy_(0, slots[valid], key[:n, 0][valid].to(kv_cache.dtype))
        keys = kv_cache.unsqueeze(2)  # [NB, BS, 1, entry]: one KV head
        return paged_attention_ref(
            query,
            keys,
            keys[..., : value.shape[-1]],
            md.block_table,
            md.query_start_loc,
            md.seq_lens,
            self.scale,
            output,
            num_decodes=md.num_decodes,
        )


class TorchRefMLABackend(AttentionBackend):
    forward_includes_kv_cache_update = True
    supported_devices = ("cuda", "cpu")

    @staticmethod
    def get_name() -> str:
        return "TORCH_REF_MLA"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchRefMLAImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return TorchRefMetadataBuilder  # the same host lists as TORCH_REF

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (num_blocks, block_size, head_size)  # one entry per slot (num_kv_heads is 1)

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def get_supported_kernel_block_sizes(cls) -> tuple[int, ...]:
        return ()  # gathers whole blocks of any size

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True


register_backend(TorchRefMLABackend, {"cpu": 100, "cuda": 0})

"""The MLA backends (``ga.MLAAttention``): TORCH_REF_MLA in plain PyTorch, TRITON_MLA with a
Triton decode kernel.

The layer has already folded ``kv_b_proj`` into the queries, so attention is MQA over one
cache entry per token: the scores read the whole entry (compressed KV and rotary key), the
values its first ``kv_lora_rank`` columns. The cache is ``[num_blocks, block_size, entry]``.

- TORCH_REF_MLA, like TORCH_REF, decides per request on the host, so it allows no full CUDA
  graphs (``NEVER``): under a FULL mode the engine lowers to PIECEWISE and says so.
- TRITON_MLA writes the step's entries with the KV-cache write kernel and runs attention in
  one Triton launch (``kernels/mla_attention.py``): batches of one-token decodes through
  the decode kernel (a program per request, split-KV), any other batch (prefills, chunked
  prefills, verify steps) through the causal kernel. Each launch is fixed by the padded
  token and request counts, so any batch can replay a full CUDA graph (``ALWAYS``). The
  default on CUDA since its H200 tests passed (round 41); on the CPU it runs under the
  interpreter and is chosen by name.
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
from graphattn.attention.backends.torch_ref import TorchRefMetadata, TorchRefMetadataBuilder
from graphattn.attention.backends.triton_attn import CPU_NUM_SMS
from graphattn.attention.registry import register_backend
from graphattn.errors import BackendError
from graphattn.kernels import triton_import_error
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
        keys = kv_cache.unsqueeze(2)  # [NB, BS, 1, entry]: one KV head, its values a view
        return paged_attention_ref(
            query, keys, keys[..., : value.shape[-1]], md.block_table, md.query_start_loc,
            md.seq_lens, self.scale, output, num_decodes=md.num_decodes,
        )  # fmt: skip


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


# -- TRITON_MLA ------------------------------------------------------------------------------


@dataclass(slots=True)
class TritonMLAMetadata:
    """One step of one group: the padded batch's device tensors and launch sizes."""

    uniform_decode: bool  # every request has one query token (a graph's key fixes it)
    num_reqs: int  # padded
    num_input_tokens: int  # padded; the launch covers this many tokens
    num_sms: int
    max_reqs: int  # max_num_seqs: the scratch's rows of tokens
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_input_tokens] int64, -1 for padding
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    scratch: Any  # split_kv.SplitScratch: the group's, made by its builder at start-up


class TritonMLAMetadataBuilder(AttentionMetadataBuilder[TritonMLAMetadata]):
    # every launch is a function of the padded token and request counts: any batch
    cudagraph_support = AttentionCGSupport.ALWAYS
    reorder_batch_threshold = 1  # decodes first like the other backends; the kernels need no order
    # build only describes the launches: a FULL replay needs none of it
    full_replay_needs_build = False

    def __init__(self, kv_cache_spec, layer_names, config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, config, device)
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else CPU_NUM_SMS
        )
        heads = getattr(kv_cache_spec, "num_heads", 0)
        if heads < 1:
            raise BackendError(
                "TRITON_MLA sizes its split scratch by the layers' query heads: expected an "
                f"MLAAttentionSpec with num_heads >= 1 (ga.MLAAttention's), got {kv_cache_spec!r}"
            )
        # the split scratch at its largest (``mla_attention.split_rows`` rows of the latent
        # rank), made before the KV cache, whose size is checked against the memory left
        kernels = _mla_kernels()
        rows = kernels.mla_attention.split_rows(config.max_num_seqs, heads, self.num_sms)
        rank = kv_cache_spec.kv_lora_rank
        self.scratch = kernels.split_kv.SplitScratch(
            torch.empty(rows * rank, dtype=torch.float32, device=device),
            torch.empty(rows, dtype=torch.float32, device=device),
            config.max_num_seqs,
        )

    def build(self, common_prefix_len: int, cam: CommonAttentionMetadata) -> TritonMLAMetadata:
        return TritonMLAMetadata(
            cam.uniform_decode,
            cam.num_reqs,
            cam.num_input_tokens,
            self.num_sms,
            self.config.max_num_seqs,
            cam.seq_lens,
            cam.block_table_tensor,
            cam.slot_mapping,
            cam.query_start_loc,
            self.scratch,
        )


class TritonMLAImpl(AttentionImpl):
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
            raise NotImplementedError("TRITON_MLA does not fuse output quantization")
        if attn_metadata is None:  # profile run
            return output.zero_()
        md: TritonMLAMetadata = attn_metadata
        kernels = _mla_kernels()
        entries = kv_cache.unsqueeze(2)  # [NB, BS, 1, entry]: one KV head
        # the values are a view of the entries: writing the entries writes them
        kernels.kv_cache_write.write_kv_cache(key, None, entries, None, md.slot_mapping)
        rank, heads = value.shape[-1], query.shape[1]
        launch = kernels.mla_attention
        splits = self.num_splits(md, heads)
        r, t = md.num_reqs, md.num_input_tokens
        kw = dict(kv_lora_rank=rank, scale=self.scale, num_splits=splits, scratch=md.scratch)
        if md.uniform_decode:  # one token a request: a program per request
            launch.mla_decode(
                query[:r], kv_cache, md.block_table, md.seq_lens, output[:r],
                md.query_start_loc, **kw,
            )  # fmt: skip
        else:
            launch.mla_attention(
                query[:t], kv_cache, md.block_table, md.seq_lens, output[:t],
                md.query_start_loc, num_reqs=r, **kw,
            )  # fmt: skip
        return output

    @staticmethod
    def num_splits(md: TritonMLAMetadata, heads: int) -> int:
        """The launch's split-KV splits (``mla_attention.split_count``)."""
        return _mla_kernels().mla_attention.split_count(
            md.num_input_tokens, md.num_reqs, heads, md.num_sms, md.max_reqs, md.uniform_decode
        )


class TritonMLABackend(TorchRefMLABackend):
    supported_dtypes = (torch.float16, torch.bfloat16, torch.float32)

    @staticmethod
    def get_name() -> str:
        return "TRITON_MLA"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonMLAImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return TritonMLAMetadataBuilder

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False  # a decode's split count follows the batch size

    @classmethod
    def validate_configuration(cls, cfg: AttentionSelectorConfig) -> list[str]:
        missing = triton_import_error()
        if missing is not None:
            return [f"triton is not installed ({missing})"]
        reasons = super().validate_configuration(cfg)
        if cfg.device_type == "cpu" and not envs.triton_interpret():
            reasons.append(
                "on the cpu Triton runs only under its interpreter: set TRITON_INTERPRET=1 "
                "before the first layer is made"
            )
        return reasons


@functools.cache
def _mla_kernels() -> ModuleType:
    """The kernel package with the modules TRITON_MLA launches (first call defines them)."""
    for name in ("kv_cache_write", "mla_attention", "split_kv"):
        importlib.import_module(f"graphattn.kernels.{name}")
    return importlib.import_module("graphattn.kernels")


# on CUDA above TORCH_REF_MLA since its H200 tests passed (round 41); on the CPU below it
# (the interpreter is slow)
register_backend(TritonMLABackend, {"cuda": 10, "cpu": 5})

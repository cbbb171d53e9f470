"""The MLA backends (``ga.MLAAttention``): TORCH_REF_MLA in plain PyTorch, TRITON_MLA with a
Triton decode kernel.

The layer has already folded ``kv_b_proj`` into the queries, so attention is MQA over one
cache entry per token: the scores read the whole entry (compressed KV and rotary key), the
values its first ``kv_lora_rank`` columns. The cache is ``[num_blocks, block_size, entry]``.

- TORCH_REF_MLA, like TORCH_REF, decides per request on the host, so it allows no full CUDA
  graphs (``NEVER``): under a FULL mode the engine lowers to PIECEWISE and says so.
- TRITON_MLA writes the step's entries with the KV-cache write kernel and runs batches of
  one-token decodes through ``kernels/mla_decode.py`` (split-KV, the launch fixed by the
  padded request count), so decodes can replay full graphs
  (``UNIFORM_SINGLE_TOKEN_DECODE``); other batches take TORCH_REF_MLA's computation
  eagerly (piecewise). Not yet run on a GPU: on CUDA it ranks below TORCH_REF_MLA and is
  chosen by name (``attention_backend="TRITON_MLA"``).
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
from graphattn.kernels import triton_import_error
from graphattn.kernels.attention_plan import choose_num_splits
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
        return reference_attention(query, kv_cache, value.shape[-1], md, self.scale, output)


def reference_attention(
    query: torch.Tensor,  # [T, H, kv_lora_rank + rope]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope]
    kv_lora_rank: int,
    md: TorchRefMetadata,
    scale: float,
    output: torch.Tensor,  # [T, H, kv_lora_rank]
) -> torch.Tensor:
    """MLA over cache entries already written, in plain PyTorch: one KV head whose values
    are the entries' first ``kv_lora_rank`` columns (TORCH_REF_MLA, and TRITON_MLA's
    batches that are not all one-token decodes)."""
    keys = kv_cache.unsqueeze(2)  # [NB, BS, 1, entry]
    return paged_attention_ref(
        query, keys, keys[..., :kv_lora_rank], md.block_table, md.query_start_loc,
        md.seq_lens, scale, output, num_decodes=md.num_decodes,
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
    """One step of one group: the padded batch's device tensors; for a batch that is not
    all one-token decodes also TORCH_REF_MLA's host lists (``ref``)."""

    uniform_decode: bool  # every request has one query token (a graph's key fixes it)
    num_reqs: int  # padded
    num_sms: int
    max_reqs: int  # max_num_seqs: the scratch's rows of requests
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_input_tokens] int64, -1 for padding
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    scratch: dict[str, Any]  # the group's split scratch, made at the first split launch
    ref: TorchRefMetadata | None


class TritonMLAMetadataBuilder(TorchRefMetadataBuilder):
    cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    # build only describes the launches (the scratch is made by the first launch, eagerly,
    # before any capture): a FULL replay of a decode graph needs none of it
    full_replay_needs_build = False

    def __init__(self, kv_cache_spec, layer_names, config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, config, device)
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else CPU_NUM_SMS
        )
        self.scratch: dict[str, Any] = {}

    def build(self, common_prefix_len: int, cam: CommonAttentionMetadata) -> TritonMLAMetadata:
        ref = None if cam.uniform_decode else super().build(common_prefix_len, cam)
        return TritonMLAMetadata(
            cam.uniform_decode,
            cam.num_reqs,
            self.num_sms,
            self.config.max_num_seqs,
            cam.seq_lens,
            cam.block_table_tensor,
            cam.slot_mapping,
            cam.query_start_loc,
            self.scratch,
            ref,
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
        kernels.kv_cache_write.write_kv_cache(key, key, entries, entries, md.slot_mapping)
        rank = value.shape[-1]
        if not md.uniform_decode:  # prefills: eagerly, as TORCH_REF_MLA does
            return reference_attention(query, kv_cache, rank, md.ref, self.scale, output)
        r, heads = md.num_reqs, query.shape[1]
        decode = kernels.mla_decode
        splits = min(
            decode.MAX_SPLITS,
            choose_num_splits(r, -(-heads // decode.BLOCK_H), md.num_sms),
        )
        scratch = self._scratch(md, heads, rank, query.device) if splits > 1 else None
        decode.mla_decode(
            query[:r], kv_cache, md.block_table, md.seq_lens, output[:r], md.query_start_loc,
            kv_lora_rank=rank, scale=self.scale, num_splits=splits, scratch=scratch,
        )  # fmt: skip
        return output

    @staticmethod
    def _scratch(md: TritonMLAMetadata, heads: int, rank: int, device: torch.device):
        """The group's split scratch at its largest (max_num_seqs requests x heads x
        MAX_SPLITS rows of ``rank``), made once: by the first split launch, which runs
        eagerly (a warm-up) before any graph that replays it is captured."""
        scratch = md.scratch.get("split")
        if scratch is None:
            split_kv = _mla_kernels().split_kv
            rows = md.max_reqs * heads * _mla_kernels().mla_decode.MAX_SPLITS
            scratch = md.scratch["split"] = split_kv.SplitScratch(
                torch.empty(rows * rank, dtype=torch.float32, device=device),
                torch.empty(rows, dtype=torch.float32, device=device),
                md.max_reqs,
            )
        return scratch


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
    for name in ("kv_cache_write", "mla_decode", "split_kv"):
        importlib.import_module(f"graphattn.kernels.{name}")
    return importlib.import_module("graphattn.kernels")


# below TORCH_REF_MLA everywhere until it has run on a GPU: chosen by name
register_backend(TritonMLABackend, {"cuda": -10, "cpu": 5})

"""The attention contract, the ``Attention`` and ``MLAAttention`` layers, its custom ops and backend selection."""

from graphattn.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSelectorConfig,
    CommonAttentionMetadata,
    split_decodes_and_prefills,
)
from graphattn.attention.forward_context import (
    ForwardContext,
    get_forward_context,
    set_forward_context,
)
from graphattn.attention.layer import Attention, MLAAttention
from graphattn.attention.registry import (
    candidates,
    get_backend,
    register_backend,
    registered_backends,
    select_backend,
)

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionCGSupport",
    "AttentionImpl",
    "AttentionMetadataBuilder",
    "AttentionSelectorConfig",
    "CommonAttentionMetadata",
    "ForwardContext",
    "MLAAttention",
    "candidates",
    "get_backend",
    "get_forward_context",
    "register_backend",
    "registered_backends",
    "select_backend",
    "set_forward_context",
    "split_decodes_and_prefills",
]

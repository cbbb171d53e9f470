"""Attention groups: inside a KV-cache group, layers with one backend, spec and query-head count."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from graphattn.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
)
from graphattn.kv_cache import KVCacheGroup


@dataclass
class AttentionGroup:
    """Layers that share one metadata builder and, each step, one metadata object."""

    group_id: int
    backend: type[AttentionBackend]
    kv_cache_group: KVCacheGroup
    num_heads: int
    layer_names: list[str] = field(default_factory=list)
    builder: AttentionMetadataBuilder | None = None
    cudagraph_support: AttentionCGSupport = AttentionCGSupport.NEVER


def build_attention_groups(
    kv_cache_groups: Sequence[KVCacheGroup], layers: Mapping[str, object]
) -> list[AttentionGroup]:
    """Partition each KV-cache group's layers by (backend class, spec, query heads).

    ``layers`` maps names to ``BoundLayer``s. Groups are numbered in the order their first
    layer appears.
    """
    groups: list[AttentionGroup] = []
    for kv_group in kv_cache_groups:
        by_key: dict[tuple, AttentionGroup] = {}
        for name in kv_group.layer_names:
            bound = layers[name]
            key = (bound.backend, kv_group.spec, bound.layer.num_heads)
            if key not in by_key:
                by_key[key] = AttentionGroup(
                    len(groups), bound.backend, kv_group, bound.layer.num_heads
                )
                groups.append(by_key[key])
            by_key[key].layer_names.append(name)
    return groups

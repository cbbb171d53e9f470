"""The custom ops the model is split at: ``graphattn::unified_attention_with_output`` and
``graphattn::unified_kv_cache_update``, and ``graphattn::unified_attention_o_proj``, attention
followed by the output projection, which ``passes/o_proj_fold.py`` puts in place of the
first and the o_proj linear after it.

They take only tensors and the layer name, so Dynamo and Inductor see an opaque call with
a fake (meta) implementation; the real implementation finds the layer, its KV cache and
its metadata through the forward context.
"""

from __future__ import annotations

import torch

from graphattn._logging import logger
from graphattn.attention.backend import check_wrote_output
from graphattn.attention.forward_context import get_forward_context
from graphattn.errors import BackendError

_lib = torch.library.Library("graphattn", "FRAGMENT")

# Every layer calls the KV-cache update and then attention, whatever its backend (the update
# does nothing for backends whose forward writes the cache), so the traced graph does not
# depend on the backend. The update returns an empty tensor that attention takes as input: a
# data dependency that keeps the update alive and ordered before attention through Dynamo's
# and Inductor's dead-code elimination (the cache itself is not an argument of either op).
_lib.define("unified_kv_cache_update(Tensor key, Tensor value, str layer_name) -> Tensor")
_lib.define(
    "unified_attention_with_output(Tensor query, Tensor key, Tensor value, Tensor(a!) output, "
    "str layer_name, Tensor? kv_cache_dep=None) -> ()"
)

# Attention and o_proj in one op: [T, Hq, D] attention rows @ weight.T into output, fp32
# [T, N]. In fp32 so that a backend can sum the projection over its KV heads with atomic
# adds; the graph rounds it to the model's dtype right after, as the linear it replaces did.
# Like attention's, its output is allocated by the piece before it (so, under piecewise
# graphs, in the graphs' pool at a fixed address) and written in place.
_lib.define(
    "unified_attention_o_proj(Tensor query, Tensor key, Tensor value, Tensor weight, "
    "Tensor(a!) output, str layer_name, Tensor? kv_cache_dep=None) -> ()"
)


def _kv_cache_update(key: torch.Tensor, value: torch.Tensor, layer_name: str) -> torch.Tensor:
    ctx = get_forward_context()
    bound = ctx.layer(layer_name)
    if ctx.slot_mapping is not None and not bound.backend.forward_includes_kv_cache_update:
        slot_mapping = ctx.slot_mapping[layer_name]
        bound.impl.do_kv_cache_update(bound.layer, key, value, bound.kv_cache, slot_mapping)
    return key.new_empty(0)


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
    kv_cache_dep: torch.Tensor | None = None,
) -> None:
    bound, metadata = _layer_and_metadata(layer_name)
    # inline, not through a shared helper: it runs per layer per eager step (a helper call
    # measured 140 ns more a layer on the CPU)
    try:
        result = bound.impl.forward(
            bound.layer, query, key, value, bound.kv_cache, metadata, output
        )
    except Exception as e:
        _note_profile_run(e, bound, "forward", metadata)
        raise
    if result is not None and result is not output:
        check_wrote_output(result, output, _who(bound, "forward"))


def _attention_o_proj(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    weight: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
    kv_cache_dep: torch.Tensor | None = None,
) -> None:
    bound, metadata = _layer_and_metadata(layer_name)
    try:
        result = bound.impl.forward_o_proj(
            bound.layer, query, key, value, bound.kv_cache, metadata, weight, output
        )
    except Exception as e:
        _note_profile_run(e, bound, "forward_o_proj", metadata)
        raise
    if result is not None and result is not output:
        check_wrote_output(result, output, _who(bound, "forward_o_proj"))


def _note_profile_run(exc: Exception, bound, method: str, metadata) -> None:
    """An error the impl raised in the profile run (``metadata`` None) gets a note saying
    so: an impl that reads the metadata without checking for None fails there, at start-up,
    with an error of its own that would not say why."""
    if metadata is None and not isinstance(exc, BackendError):
        note = (
            f"graphattn: {_who(bound, method)} raised this in the profile run, where "
            "attn_metadata is None: an impl fills output with zeros and returns then "
            "(docs/backends.md, 'What the engine promises a backend')"
        )
        if hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(note)
        else:
            logger.error("%s", note)


def _who(bound, method: str) -> str:
    return f"{type(bound.impl).__qualname__}.{method} ({bound.backend.get_name()})"


def _layer_and_metadata(layer_name: str):
    """The step's bound layer and its attention metadata (None in the profile run)."""
    ctx = get_forward_context()
    bound = ctx.layer(layer_name)  # first: an unknown name gets its typed error
    return bound, None if ctx.attn_metadata is None else ctx.attn_metadata[layer_name]


for _key in ("CPU", "CUDA"):
    _lib.impl("unified_kv_cache_update", _kv_cache_update, _key)
    _lib.impl("unified_attention_with_output", _attention, _key)
    _lib.impl("unified_attention_o_proj", _attention_o_proj, _key)


@torch.library.register_fake("graphattn::unified_kv_cache_update")
def _kv_cache_update_fake(key: torch.Tensor, value: torch.Tensor, layer_name: str) -> torch.Tensor:
    return key.new_empty(0)


@torch.library.register_fake("graphattn::unified_attention_with_output")
def _attention_fake(query, key, value, output, layer_name, kv_cache_dep=None) -> None:
    return None


@torch.library.register_fake("graphattn::unified_attention_o_proj")
def _attention_o_proj_fake(query, key, value, weight, output, layer_name, kv_cache_dep=None):
    return None


ATTENTION_OP = torch.ops.graphattn.unified_attention_with_output.default
KV_CACHE_UPDATE_OP = torch.ops.graphattn.unified_kv_cache_update.default
ATTENTION_O_PROJ_OP = torch.ops.graphattn.unified_attention_o_proj.default
ATTENTION_O_PROJ_NAME = "graphattn::unified_attention_o_proj"
# What the piecewise compiler splits at unless the config names other ops (the o_proj op
# is split at wherever attention is: split.resolve_splitting_ops adds it).
DEFAULT_SPLITTING_OPS = (
    "graphattn::unified_attention_with_output",
    "graphattn::unified_kv_cache_update",
    ATTENTION_O_PROJ_NAME,
)

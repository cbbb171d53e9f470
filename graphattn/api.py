"""``ga.compile``: turn a model into an engine."""

from __future__ import annotations

from typing import Any

from torch import nn

from graphattn.capture.mode import CUDAGraphMode
from graphattn.config import CompileConfig
from graphattn.engine import CompiledModel


def compile(
    model: nn.Module,
    *,
    cudagraph_mode: CUDAGraphMode | str | None = None,
    config: CompileConfig | None = None,
    **overrides: Any,
) -> CompiledModel:
    """Make ``model`` an engine: select attention backends, allocate the KV cache, resolve
    the CUDA-graph mode, compile and capture. Keyword overrides are ``CompileConfig`` fields.

    ``model.forward(input_ids [T], positions [T])`` must route its attention through
    ``ga.Attention``.
    """
    if cudagraph_mode is not None:
        overrides["cudagraph_mode"] = cudagraph_mode
    return CompiledModel(model, CompileConfig.from_kwargs(config, **overrides))

"""The entry point the engine calls: trace the model once, split it, compile the pieces.

INTERFACE (filled in by the passes issue): the engine relies on exactly these names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class PieceInfo:
    """What a piece wrapper is told about the compiled piece it wraps."""

    index: int  # position among all pieces of the split graph (splitting pieces included)
    num_pieces: int  # all pieces of the split graph
    is_first: bool  # the first compiled (non-splitting) piece
    is_last: bool  # the last compiled (non-splitting) piece


# Wraps each compiled non-splitting piece (the capture layer passes its PIECEWISE CUDA-graph
# wrapper here); it must return a callable with the same signature as the piece.
PieceWrapper = Callable[[Callable[..., Any], PieceInfo], Callable[..., Any]]


@dataclass(frozen=True)
class CompileOptions:
    """The compiler's share of the engine config."""

    splitting_ops: tuple[str, ...] | None = None  # None: the graphattn attention ops
    compile_backend: str = "inductor"  # "inductor" or "eager" (split, no Inductor)
    compile_sizes: tuple[int, ...] = ()
    cache_dir: str | None = None  # None: envs.cache_root()
    debug_dump_path: str | None = None
    strict: bool = False  # a recompile after start-up raises RecompileError
    cache_factors: dict[str, Any] = field(default_factory=dict)  # engine config entering the key


@dataclass
class CompileInfo:
    """What the report shows about compilation."""

    num_pieces: int = 0
    num_compiled_pieces: int = 0
    seconds: float = 0.0
    warm: bool = False  # every piece came from the cache
    cache_hits: int = 0
    cache_misses: int = 0
    cache_dir: str = ""
    cache_key: str = ""
    inductor_compiles: int = 0


class CompiledForward:
    """``forward(input_ids, positions)`` of the model, traced once and compiled piecewise."""

    info: CompileInfo
    num_recompiles: int

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def compile_model(
    model: torch.nn.Module,
    options: CompileOptions,
    example_inputs: tuple[torch.Tensor, torch.Tensor],
    *,
    piece_wrapper: PieceWrapper | None = None,
) -> CompiledForward:
    """Trace ``model.forward`` once (token dimension dynamic, guards dropped), split it at the
    splitting ops and compile each other piece. Must be called under a forward context
    (the engine runs it as its profile run).
    """
    raise NotImplementedError("the passes issue implements this")

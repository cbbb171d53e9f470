"""The post-grad pass manager: graphattn's graph rewrites, run by Inductor on every piece.

Inductor calls ``config.post_grad_custom_post_pass`` on each piece's post-grad ATen graph
(functional, with ``meta["val"]`` on every node). The manager runs the configured passes
in order. Its ``uuid()`` combines the passes' uuids, and Inductor puts it in its own cache
key, so changing a pass (its source) never reuses code compiled without it.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from graphattn._logging import logger
from graphattn.config import DEFAULT_PASSES  # noqa: F401  (re-exported: the passes' home)
from graphattn.errors import ConfigError
from graphattn.passes.split import MODEL_INPUT


class GraphPass(ABC):
    """One rewrite of a post-grad graph.

    ``__call__`` changes the graph in place and returns how many nodes it changed;
    ``uuid()`` is stable across processes and changes when the pass's source does.
    """

    name: ClassVar[str]

    @abstractmethod
    def __call__(self, graph: fx.Graph) -> int: ...

    def uuid(self) -> str:
        """The pass's key in Inductor's caches: the whole source of the module it is defined
        in (a helper function changes what the pass does as much as the class does)."""
        source = inspect.getsource(sys.modules[type(self).__module__])
        return hashlib.sha256(f"{self.name}\n{source}".encode()).hexdigest()


class PostGradPassManager(CustomGraphPass):
    """Runs ``passes`` in order on each post-grad graph Inductor hands it.

    ``for_piece`` gives the manager for one piece: it tells the passes which of the graph's
    inputs are model inputs no kernel of the step writes (``MODEL_INPUT`` on those
    placeholders), the only ones a pass may take for a weight. A manager made without a
    piece marks nothing (Inductor's graphs come unmarked, so its passes take no placeholder
    for a weight; a test's hand-built graph may carry its own marks).
    """

    def __init__(self, passes: Sequence[GraphPass]) -> None:
        self.passes = list(passes)
        # (inputs of the piece, indices of its model inputs); None: no piece, no marks
        self.inputs: tuple[int, tuple[int, ...]] | None = None

    def for_piece(self, module: fx.GraphModule) -> PostGradPassManager:
        """This manager's passes, for the post-grad graph of piece ``module``, whose
        placeholders ``split.mark_model_inputs`` marked (Inductor keeps their order).

        A piece that calls a higher-order op (``torch.cond`` and the like) gets no marks:
        Inductor runs the passes on each body graph too, whose inputs are the op's operands,
        not the piece's.
        """
        placeholders = list(module.graph.find_nodes(op="placeholder"))
        nested = any(
            isinstance(n.target, torch._ops.HigherOrderOperator) for n in module.graph.nodes
        )
        marked = tuple(i for i, n in enumerate(placeholders) if n.meta.get(MODEL_INPUT))
        if nested and marked:
            logger.debug("a piece with a higher-order op: none of its inputs is a weight")
            marked = ()
        manager = copy.copy(self)
        manager.inputs = (len(placeholders), marked)
        return manager

    def __call__(self, graph: fx.Graph) -> None:
        self._mark_model_inputs(graph)
        for graph_pass in self.passes:
            changed = graph_pass(graph)
            if changed:
                logger.debug("pass %s changed %d node(s)", graph_pass.name, changed)
        graph.lint()

    def _mark_model_inputs(self, graph: fx.Graph) -> None:
        if self.inputs is None:  # no piece: marks only a graph built with them has
            return
        placeholders = list(graph.find_nodes(op="placeholder"))
        for node in placeholders:  # only the piece's marks count
            node.meta.pop(MODEL_INPUT, None)
        count, marked = self.inputs
        if len(placeholders) != count:  # not the piece's inputs one for one: trust none
            if marked:
                logger.warning(
                    "graphattn: a post-grad graph has %d inputs where its piece has %d; its "
                    "one-row linears stay on cuBLAS",
                    len(placeholders),
                    count,
                )
            return
        for i in marked:
            placeholders[i].meta[MODEL_INPUT] = True

    def uuid(self) -> str:
        """Inductor keys its own caches (the FX graph cache) on this: each pass's uuid,
        which of the piece's inputs are model inputs, and every source file of graphattn's
        compiler, as graphattn's compile cache does, so a pass whose matching lives in
        another module never gets a stale graph back."""
        from graphattn.passes.cache import compiler_source_hashes

        joined = ",".join(p.uuid() for p in self.passes)
        sources = ",".join(compiler_source_hashes())
        key = f"graphattn-post-grad:{joined}:{self.inputs}:{sources}"
        return hashlib.sha256(key.encode()).hexdigest()

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]


def make_pass_manager(names: Sequence[str]) -> PostGradPassManager:
    """A manager running the passes named ``names`` in order; an unknown name is a ConfigError."""
    from graphattn.passes.noop_elimination import NoOpEliminationPass
    from graphattn.passes.prefetch_weights import PrefetchNextWeightPass
    from graphattn.passes.prologue_gemv import (
        RmsNormGemvPass,
        RotaryEpiloguePass,
        SiluMulEpiloguePass,
        SiluMulGemvPass,
    )
    from graphattn.passes.single_row_gemv import SingleRowGemvPass
    from graphattn.passes.unfuse_addmm import UnfuseResidualAddmmPass

    known: dict[str, type[GraphPass]] = {
        p.name: p
        for p in (
            NoOpEliminationPass,
            UnfuseResidualAddmmPass,
            RmsNormGemvPass,
            SiluMulEpiloguePass,
            RotaryEpiloguePass,
            SiluMulGemvPass,
            SingleRowGemvPass,
            PrefetchNextWeightPass,
        )
    }
    if isinstance(names, str):
        raise ConfigError(f"passes must be a list of pass names, got the string {names!r}")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"unknown post-grad pass(es) {unknown}; known: {sorted(known)}")
    _check_order(list(names))
    return PostGradPassManager([known[n]() for n in names])


# (earlier, later): a pass that rewrites what the later one matches must run first
PASS_ORDER = (
    # unfuse_residual_addmm gives back the mm of a residual linear the others match
    ("unfuse_residual_addmm", "rms_norm_gemv"),
    ("unfuse_residual_addmm", "silu_mul_gemv"),
    ("unfuse_residual_addmm", "single_row_gemv"),
    # single_row_gemv takes the mm a prologue fold needs
    ("rms_norm_gemv", "single_row_gemv"),
    ("silu_mul_gemv", "single_row_gemv"),
    # silu_mul_epilogue rewrites the ops rms_norm_gemv makes; where silu_mul_gemv is on
    # too, the epilogue takes the SiLU-and-multiply first
    ("rms_norm_gemv", "silu_mul_epilogue"),
    ("rms_norm_gemv", "rope_epilogue"),
    ("silu_mul_epilogue", "silu_mul_gemv"),
    # prefetch_next_weight rewrites the gemv ops single_row_gemv makes
    ("single_row_gemv", "prefetch_next_weight"),
)


def _check_order(names: list[str]) -> None:
    for first, then in PASS_ORDER:
        if first in names and then in names and names.index(first) > names.index(then):
            raise ConfigError(
                f"post-grad pass {first!r} must come before {then!r} (got {names}): it rewrites "
                f"what {then!r} matches"
            )

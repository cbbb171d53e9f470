"""Compile one piece with Inductor (``torch._inductor.standalone_compile``, torch >= 2.8).

A dynamic build takes its symbolic shapes from the piece graph (the Dynamo trace's fake
tensors: the token count is a symbol); a specialised build takes the shapes of the real
example inputs it is given. Both come back as a ``CompiledArtifact`` the compile cache
can save and load.

``compile_count()`` counts every Inductor compilation this process made, so callers
(and tests) can tell a warm start, which compiles nothing, from a cold one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx

from graphattn.passes.pass_manager import PostGradPassManager

_compiles = 0


def compile_count() -> int:
    """How many times this process has run Inductor on a piece."""
    return _compiles


def compile_piece(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    dynamic: bool,
    pass_manager: PostGradPassManager,
    on_output_code: Callable[[str], None] | None = None,
    pdl: bool = False,
) -> Any:
    """Inductor's ``CompiledArtifact`` for ``gm``: dynamic (symbolic token count, from the
    graph's fake inputs) or specialised to the shapes of the real ``example_inputs``.
    ``on_output_code`` receives the generated Python wrapper code. ``pdl`` turns on
    Inductor's ``triton.enable_pdl`` for this build (its Triton kernels launch with
    programmatic dependent launch on sm_90 and later; its own config decides otherwise).
    """
    global _compiles
    from torch._inductor import standalone_compile

    _compiles += 1
    config_patches = {
        "post_grad_custom_post_pass": pass_manager,
        # standalone_compile records its artifact through Inductor's local caches
        "fx_graph_cache": True,
        "fx_graph_remote_cache": False,
    }
    if pdl:
        config_patches["triton.enable_pdl"] = True
    with torch.no_grad(), _local_autograd_cache(), _output_code_hook(on_output_code):
        return standalone_compile(
            gm,
            list(example_inputs),
            dynamic_shapes="from_graph" if dynamic else "from_example_inputs",
            options={"config_patches": config_patches},
        )


@contextlib.contextmanager
def _local_autograd_cache() -> Iterator[None]:
    with torch._functorch.config.patch(
        enable_autograd_cache=True, enable_remote_autograd_cache=False
    ):
        yield


@contextlib.contextmanager
def _output_code_hook(callback: Callable[[str], None] | None) -> Iterator[None]:
    """Hand Inductor's output code to ``callback`` (fresh compiles and Inductor cache hits
    both report it through ``GraphLowering.save_output_code``).
    """
    if callback is None:
        yield
        return
    from torch._inductor.graph import GraphLowering

    previous = GraphLowering.save_output_code
    GraphLowering.save_output_code = staticmethod(callback)
    try:
        yield
    finally:
        GraphLowering.save_output_code = previous

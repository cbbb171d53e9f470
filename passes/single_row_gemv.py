"""Single-row linear layers as ``graphattn::gemv`` (a Triton GEMV) instead of cuBLAS.

At one token a linear layer reads its weight once and does almost no arithmetic; cuBLAS
reaches 1.4-2.6 TB/s on the small projections of a 1B model on an H200 (and splits K for
the MLP's down projection, one more kernel), where ``graphattn/kernels/gemv.py`` reaches
1.9-3.3 TB/s (docs/results/gemv-h200.log). The pass rewrites ``mm(x, permute(w, [1, 0]))``
(``F.linear`` without a bias, after decomposition) into ``gemv(x, w)`` when the graph fixes
``x`` to one row: a build specialised for one token (``compile_sizes`` containing 1, which
the engine adds on CUDA while this pass is on). A dynamic build is left alone, so steps of
other sizes keep cuBLAS and no step pays a Python op call per layer.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
from collections.abc import Iterator
from typing import ClassVar

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from graphattn.passes.pass_manager import GraphPass
from graphattn.passes.split import MODEL_INPUT

aten = torch.ops.aten
GEMV_DTYPES = (torch.bfloat16, torch.float16)  # the dtypes the sweep measured
# Devices whose one-row linears are rewritten. Tests add "cpu" to run the kernels under the
# Triton interpreter; it is part of the passes' uuid, so compiled code never mixes the two.
GEMV_DEVICES = ("cuda",)


@torch.library.custom_op("graphattn::gemv", mutates_args=())
def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (``[M, K] x [N, K] -> [M, N]``) by the Triton GEMV."""
    from graphattn.kernels.gemv import gemv as launch

    return launch(x, weight)


@gemv.register_fake
def _gemv_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


GEMV_OP = torch.ops.graphattn.gemv.default


class SingleRowGemvPass(GraphPass):
    """Rewrites ``mm(x, w.T)`` with a one-row ``x`` and a contiguous CUDA ``w`` as ``gemv``."""

    name: ClassVar[str] = "single_row_gemv"

    def uuid(self) -> str:
        return module_uuid(self.name, __name__)

    def __call__(self, graph: fx.Graph) -> int:
        changed = 0
        for mm, x, weight in single_row_linears(graph):
            with graph.inserting_before(mm):
                call = graph.call_function(GEMV_OP, (x, weight))
            call.meta["val"] = _gemv_fake(x.meta["val"], weight.meta["val"])
            mm.replace_all_uses_with(call)
            graph.erase_node(mm)
            changed += 1
        return changed


def single_row_linears(graph: fx.Graph) -> Iterator[tuple[fx.Node, fx.Node, fx.Node]]:
    """``(mm, x, weight)`` of every one-row linear the GEMV takes, over a snapshot of the
    nodes (the caller may rewrite each as it comes)."""
    for node in list(graph.nodes):
        weight = single_row_linear_weight(node)
        if weight is not None:
            yield node, node.args[0], weight


def module_uuid(name: str, *modules: str) -> str:
    """A pass's uuid from the whole source of the modules its matching lives in and the
    devices it rewrites for."""
    sources = "\n".join(inspect.getsource(sys.modules[m]) for m in modules)
    return hashlib.sha256(f"{name}\n{GEMV_DEVICES}\n{sources}".encode()).hexdigest()


def single_row_linear_weight(node: fx.Node) -> fx.Node | None:
    """The ``[N, K]`` weight node of ``mm(x, permute(w, [1, 0]))`` when ``x`` is statically
    one row, ``w`` is a model input no kernel of the step writes (a parameter: see
    ``split.MODEL_INPUT``) or an attribute, and both run on CUDA in a GEMV dtype with 16-byte
    rows; else None."""
    if node.op != "call_function" or node.target is not aten.mm.default or len(node.args) != 2:
        return None
    x, transposed = node.args
    if not isinstance(x, fx.Node) or not isinstance(transposed, fx.Node):
        return None
    if transposed.target not in (aten.permute.default, aten.t.default):
        return None
    if transposed.target is aten.permute.default and list(transposed.args[1]) != [1, 0]:
        return None
    weight = transposed.args[0]
    # A model input no kernel of the step writes (split.MODEL_INPUT, set through the pass
    # manager's for_piece) or a constant of the piece, never a value computed in the step,
    # in this piece or an earlier one: the GEMVs read their first weight tile before
    # waiting for the kernel before them (PDL)
    if not isinstance(weight, fx.Node):
        return None
    if not (
        weight.op == "get_attr" or (weight.op == "placeholder" and weight.meta.get(MODEL_INPUT))
    ):
        return None
    xv, wv = x.meta.get("val"), weight.meta.get("val")
    if not isinstance(xv, torch.Tensor) or not isinstance(wv, torch.Tensor):
        return None
    if xv.dim() != 2 or wv.dim() != 2 or not statically_known_true(xv.shape[0] == 1):
        return None
    if xv.device.type not in GEMV_DEVICES or wv.device != xv.device:
        return None
    if xv.dtype not in GEMV_DTYPES or wv.dtype != xv.dtype:
        return None
    k = wv.shape[1]
    static = all(isinstance(s, int) for s in (*wv.shape, *wv.stride(), *xv.stride()))
    if not static or wv.stride() != (k, 1) or xv.stride(1) != 1:
        return None
    if (k * wv.element_size()) % 16 or (xv.stride(0) * xv.element_size()) % 16:
        return None
    return weight

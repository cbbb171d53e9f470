"""Residual-add unfusion: ``addmm(residual, x, w)`` back into ``residual + mm(x, w)``.

Inductor's post-grad patterns turn ``residual + x @ w`` into ``aten.addmm`` whenever the
sum leaves the graph or feeds a non-pointwise op, which in a transformer piece is every
residual add (the sum is the next layer's residual and a piece output). On CUDA,
``addmm`` with a full ``[T, N]`` input first copies that input into the output, so each
fused residual costs a device-to-device copy (one extra kernel node in a CUDA graph, 30 of
247 kernels per decode step of a 16-layer Llama) before a GEMM that also reads it back.
Unfused, the GEMM writes a fresh tensor and the add joins the pointwise/normalisation
kernel Inductor already emits after it, so the copy disappears.

Only full-shape inputs are unfused: a 1-D bias broadcast over rows stays an ``addmm``,
which cuBLAS applies in its epilogue without a copy.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from graphattn.passes.pass_manager import GraphPass

aten = torch.ops.aten


class UnfuseResidualAddmmPass(GraphPass):
    """Rewrites ``addmm(inp, a, b)`` with a full-shape ``inp`` and unit scales as ``inp + a @ b``."""

    name: ClassVar[str] = "unfuse_residual_addmm"

    def __call__(self, graph: fx.Graph) -> int:
        changed = 0
        for node in list(graph.nodes):
            if not is_residual_addmm(node):
                continue
            inp, mat1, mat2 = node.args[:3]
            with graph.inserting_before(node):
                product = graph.call_function(aten.mm.default, (mat1, mat2))
                total = graph.call_function(aten.add.Tensor, (inp, product))
            product.meta["val"] = aten.mm.default(mat1.meta["val"], mat2.meta["val"])
            total.meta["val"] = node.meta["val"]
            node.replace_all_uses_with(total)
            graph.erase_node(node)
            changed += 1
        return changed


def is_residual_addmm(node: fx.Node) -> bool:
    """``addmm`` whose input has the output's full shape and dtype, with beta = alpha = 1."""
    if node.op != "call_function" or node.target is not aten.addmm.default:
        return False
    if len(node.args) != 3 or any(node.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")):
        return False
    inp, mat1, mat2 = node.args
    if not all(isinstance(n, fx.Node) for n in (inp, mat1, mat2)):
        return False
    vals = [n.meta.get("val") for n in (node, inp, mat1, mat2)]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return False
    out, inp_val = vals[0], vals[1]
    return (
        inp_val.dim() == 2
        and inp_val.dtype == out.dtype
        and all(statically_known_true(x == y) for x, y in zip(inp_val.shape, out.shape))
    )

"""No-op elimination: views, reshapes, expands and slices that give back their input unchanged.

Such nodes are left behind by model code written for any shape (``x.view(t, -1)`` on an
``x`` that is already ``[t, h]``, ``x[:, :h]`` on an ``x`` that is ``h`` wide). Each one is
replaced by its input. Sizes are compared symbolically, so a rewrite holds for every
token count; when equality cannot be proven the node stays.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from graphattn.passes.pass_manager import GraphPass

aten = torch.ops.aten

# ops whose result is their input when the result's shape equals the input's shape
_SAME_SHAPE_IS_NOOP = (
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.expand.default,
)
_INT64_MAX = 2**63 - 1


class NoOpEliminationPass(GraphPass):
    """Replaces shape-preserving views/reshapes/expands and full slices by their input."""

    name: ClassVar[str] = "noop_elimination"

    def __call__(self, graph: fx.Graph) -> int:
        removed = 0
        for node in list(graph.nodes):
            if is_noop(node):
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
                removed += 1
        return removed


def is_noop(node: fx.Node) -> bool:
    """True when ``node`` returns its first argument unchanged (same shape, same view)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    source = node.args[0]
    if _would_alias_graph_input(node, source):
        return False
    out, inp = node.meta.get("val"), source.meta.get("val")
    if not isinstance(out, torch.Tensor) or not isinstance(inp, torch.Tensor):
        return False
    if node.target in _SAME_SHAPE_IS_NOOP:
        return _same_shape(out.shape, inp.shape)
    if node.target is aten.slice.Tensor:
        return _is_full_slice(node, inp)
    return False


def _same_shape(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def _is_full_slice(node: fx.Node, inp: torch.Tensor) -> bool:
    """``aten.slice(x, dim, start, end, step)`` covering all of ``dim`` with step 1."""
    names = ("dim", "start", "end", "step")
    args = dict(zip(names, (0, None, None, 1)))
    args.update(zip(names, node.args[1:]))
    args.update(node.kwargs)
    dim, start, end, step = (args[n] for n in names)
    if not isinstance(dim, int):
        return False
    size = inp.shape[dim]
    starts_at_zero = start is None or (isinstance(start, int) and start == 0)
    ends_at_size = end is None or end == _INT64_MAX or _known_at_least(end, size)
    return starts_at_zero and ends_at_size and isinstance(step, int) and step == 1


def _known_at_least(end: Any, size: Any) -> bool:
    if isinstance(end, fx.Node):
        end = end.meta.get("val")
    if not isinstance(end, (int, torch.SymInt)):
        return False
    return statically_known_true(end >= size)


def _would_alias_graph_input(node: fx.Node, source: fx.Node) -> bool:
    """Returning a graph input as an output would change which outputs alias inputs, which
    AOTAutograd has already decided for this graph: leave such nodes alone.
    """
    return source.op == "placeholder" and any(u.op == "output" for u in node.users)

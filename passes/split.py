"""Split the traced FX graph at the splitting ops into pieces, keeping the node order.

Each run of consecutive splitting-op calls becomes one *splitting piece* (run eagerly,
between the compiled pieces); everything between two such runs becomes one *compiled
piece*. A model of L attention layers therefore splits into L splitting pieces and L+1
compiled pieces around them.

Symbolic sizes (SymInt arithmetic on the token count) never cross a piece boundary: a
size computed in one piece and used in another is recomputed in the piece that uses it,
so no compiled piece has to return a size and no piece takes one it cannot derive.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from graphattn.attention.ops import DEFAULT_SPLITTING_OPS
from graphattn.errors import ConfigError

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


@dataclass(frozen=True)
class Piece:
    """One piece of the split graph: a submodule the split graph calls in order."""

    index: int  # position among all pieces
    name: str  # attribute of the split graph module that holds it ("submod_3")
    module: fx.GraphModule
    is_splitting: bool  # holds splitting ops only; runs eagerly


@dataclass(frozen=True)
class SplitGraph:
    """The split graph module (calls the pieces in order) and its pieces."""

    module: fx.GraphModule
    pieces: list[Piece]

    @property
    def compiled_pieces(self) -> list[Piece]:
        return [p for p in self.pieces if not p.is_splitting]


def resolve_splitting_ops(names: Sequence[str] | None) -> frozenset[str]:
    """The op names to split at (``None``: the graphattn attention ops), each checked to
    name a registered torch op: ``"namespace::op"`` or ``"namespace::op.overload"``.
    """
    if names is None:
        names = DEFAULT_SPLITTING_OPS
    if isinstance(names, str):
        raise ConfigError(f"splitting_ops must be a list of op names, got the string {names!r}")
    return frozenset(_check_op_name(name) for name in names)


def split_graph(gm: fx.GraphModule, splitting_ops: frozenset[str]) -> SplitGraph:
    """Split ``gm`` (changed in place: sizes are localised) into pieces at ``splitting_ops``."""
    assignment = assign_pieces(gm.graph, splitting_ops)
    localise_symbolic_values(gm.graph, assignment)
    gm.recompile()
    split = split_module(gm, None, lambda node: assignment[node], keep_original_order=True)
    _return_tuples(split)
    return split_graph_of(split, splitting_ops)


def split_graph_of(split: fx.GraphModule, splitting_ops: frozenset[str]) -> SplitGraph:
    """The ``SplitGraph`` of an already split module: its pieces in call order, each piece
    input that an earlier piece computes marked (``mark_computed_inputs``)."""
    calls = [n for n in split.graph.nodes if n.op == "call_module"]
    pieces = []
    for index, call in enumerate(calls):
        module = getattr(split, call.target)
        splitting = any(is_splitting_node(n, splitting_ops) for n in module.graph.nodes)
        mark_computed_inputs(call, module)
        pieces.append(Piece(index, call.target, module, splitting))
    return SplitGraph(split, pieces)


# node.meta key of a piece's placeholder whose value an earlier piece computes in the same
# step (an activation), as opposed to a graph input of the whole model: parameters,
# buffers and constants bound at trace time, or the step's input_ids and positions
COMPUTED_INPUT = "graphattn_computed_input"


def mark_computed_inputs(call: fx.Node, module: fx.GraphModule) -> None:
    """Set ``COMPUTED_INPUT`` on each placeholder of ``module`` (called by ``call`` in the
    split graph) whose argument is not an input or attribute of the split graph.

    A kernel may read a model input before it waits for the kernel launched before it
    (the GEMVs read their first weight tile so, under PDL); a value an earlier piece
    computes may still be being written then, so the passes never treat one as a weight.
    Where the call's arguments do not line up with the placeholders, all are marked.
    """
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    args = list(call.args) if not call.kwargs and len(call.args) == len(placeholders) else None
    for i, node in enumerate(placeholders):
        outside = args is not None and isinstance(args[i], fx.Node)
        outside = outside and args[i].op in ("placeholder", "get_attr")
        if outside:
            node.meta.pop(COMPUTED_INPUT, None)
        else:
            node.meta[COMPUTED_INPUT] = True


def assign_pieces(graph: fx.Graph, splitting_ops: frozenset[str]) -> dict[fx.Node, int]:
    """Piece number of every computing node, walking the graph in order.

    A new piece starts wherever the walk changes between splitting and other nodes.
    Symbolic (size) nodes do not start a piece: they join the current one, and
    ``localise_symbolic_values`` copies them to wherever else they are used. A
    ``getitem`` on a splitting op's result stays with the op.
    """
    assignment: dict[fx.Node, int] = {}
    piece, in_splitting = -1, None
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if is_symbolic_node(node) and piece >= 0:
            assignment[node] = piece
            continue
        splitting = is_splitting_node(node, splitting_ops) or _reads_splitting_result(
            node, splitting_ops
        )
        if splitting != in_splitting:
            piece, in_splitting = piece + 1, splitting
        assignment[node] = piece
    return assignment


def localise_symbolic_values(graph: fx.Graph, assignment: dict[fx.Node, int]) -> None:
    """Give every piece its own copy of the size computations it uses from other pieces.

    Tensor values may cross pieces (they become piece outputs and inputs); a SymInt
    computed in a compiled piece may not (Inductor pieces return tensors), so its
    computation is copied, with the size computations it depends on, into each piece
    that uses it. The original is erased once nothing uses it.
    """
    order = {node: i for i, node in enumerate(graph.nodes)}
    copies: dict[tuple[fx.Node, fx.Node], fx.Node] = {}
    for node in list(graph.nodes):
        if not is_symbolic_node(node):
            continue
        for piece, users in _foreign_users(node, assignment).items():
            anchor = min(users, key=order.__getitem__)
            copy = _copy_into(graph, node, piece, anchor, assignment, copies)
            for user in users:
                user.replace_input_with(node, copy)
        if not node.users:
            graph.erase_node(node)
            del assignment[node]


def is_symbolic_node(node: fx.Node) -> bool:
    """A computing node whose value is a size (SymInt/SymFloat/SymBool, or a tuple of them)."""
    if node.op not in ("call_function", "call_method"):
        return False
    value = node.meta.get("example_value")
    if isinstance(value, (tuple, list)):  # torch.Size, or a tuple of sizes
        return len(value) > 0 and all(isinstance(v, (*_SYMBOLIC, int)) for v in value)
    return isinstance(value, _SYMBOLIC)


def is_splitting_node(node: fx.Node, splitting_ops: frozenset[str]) -> bool:
    """True for a call of one of ``splitting_ops`` (by op name, or op name and overload)."""
    if node.op != "call_function":
        return False
    name = op_name(node.target)
    if name is None:
        return False
    op, overload = name
    if overload is None:  # a call through the packet: any overload named for the op counts
        return op in splitting_ops or any(s.partition(".")[0] == op for s in splitting_ops)
    return op in splitting_ops or f"{op}.{overload}" in splitting_ops


def op_name(target: object) -> tuple[str, str | None] | None:
    """``("namespace::op", overload or None)`` of a torch op target; None for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name, target._overloadname
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name, None
    return None


# -- helpers ------------------------------------------------------------------------------


def _check_op_name(name: object) -> str:
    if not isinstance(name, str) or "::" not in name:
        raise ConfigError(
            f"a splitting op is named 'namespace::op' or 'namespace::op.overload' "
            f"(e.g. {DEFAULT_SPLITTING_OPS[0]!r}), got {name!r}"
        )
    namespace, _, rest = name.partition("::")
    op, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError):
        raise ConfigError(
            f"splitting op {name!r} is not a registered torch op: torch.ops.{namespace}.{op} "
            "does not exist (is the library that defines it imported?)"
        ) from None
    if overload and overload not in packet.overloads():
        raise ConfigError(
            f"splitting op {name!r}: torch.ops.{namespace}.{op} has no overload {overload!r} "
            f"(it has {sorted(packet.overloads())})"
        )
    return name


def _reads_splitting_result(node: fx.Node, splitting_ops: frozenset[str]) -> bool:
    source = node.args[0] if node.args else None
    return (
        node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(source, fx.Node)
        and is_splitting_node(source, splitting_ops)
    )


def _return_tuples(split: fx.GraphModule) -> None:
    """Make every piece return a tuple, even of one value: Inductor builds return a sequence
    when loaded from the cache whatever the graph returned, so every build is called the same way.
    """
    for call in [n for n in split.graph.nodes if n.op == "call_module"]:
        piece = getattr(split, call.target)
        output = piece.graph.output_node()
        if not isinstance(output.args[0], fx.Node):
            continue
        output.args = ((output.args[0],),)
        piece.recompile()
        users = list(call.users)
        with split.graph.inserting_after(call):
            item = split.graph.call_function(operator.getitem, (call, 0))
        for user in users:
            user.replace_input_with(call, item)
    split.recompile()


def _foreign_users(node: fx.Node, assignment: dict[fx.Node, int]) -> dict[int, list[fx.Node]]:
    """Users of ``node`` in pieces other than its own, grouped by piece (the output excluded)."""
    home = assignment[node]
    foreign: dict[int, list[fx.Node]] = {}
    for user in node.users:
        if user.op != "output" and assignment[user] != home:
            foreign.setdefault(assignment[user], []).append(user)
    return foreign


def _copy_into(
    graph: fx.Graph,
    node: fx.Node,
    piece: int,
    anchor: fx.Node,
    assignment: dict[fx.Node, int],
    copies: dict[tuple[fx.Node, fx.Node], fx.Node],
) -> fx.Node:
    """A copy of size node ``node`` in ``piece``, placed before ``anchor``; the size nodes
    it reads from other pieces are copied too (once per anchor, so every copy precedes
    its users whatever order the pieces' users come in).
    """
    if (node, anchor) in copies:
        return copies[(node, anchor)]

    def local(arg: fx.Node) -> fx.Node:
        if is_symbolic_node(arg) and assignment.get(arg) != piece:
            return _copy_into(graph, arg, piece, anchor, assignment, copies)
        return arg

    with graph.inserting_before(anchor):
        copy = graph.node_copy(node, local)
    assignment[copy] = piece
    copies[(node, anchor)] = copy
    return copy

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
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.passes.split_module import split_module
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from graphattn.attention.ops import (
    ATTENTION_O_PROJ_NAME,
    ATTENTION_O_PROJ_OP,
    DEFAULT_SPLITTING_OPS,
)
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
    # the tensor inputs of the split graph (by name) that no GEMV may take for its weight,
    # and why (``mark_model_inputs``); the report shows them
    not_weights: dict[str, str] = field(default_factory=dict)
    # attention layers whose o_proj the split graph runs inside the attention op
    # (passes/o_proj_fold.py)
    o_proj_folded: int = 0

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
    ops = frozenset(_check_op_name(name) for name in names)
    if ops & {_ATTENTION, f"{_ATTENTION}.default"}:  # o_proj_fold's op takes attention's place
        ops |= {ATTENTION_O_PROJ_NAME}
    return ops


_ATTENTION = "graphattn::unified_attention_with_output"


def split_graph(
    gm: fx.GraphModule,
    splitting_ops: frozenset[str],
    input_values: Sequence[object] | None = None,
    *,
    fold_o_proj: bool = False,
) -> SplitGraph:
    """Split ``gm`` (changed in place: sizes are localised) into pieces at ``splitting_ops``
    (``input_values``: ``gm``'s inputs, as ``mark_model_inputs`` takes them; ``fold_o_proj``:
    first move each attention layer's o_proj into its attention op, ``o_proj_fold.py``,
    where the ops are split at attention)."""
    if fold_o_proj and ATTENTION_O_PROJ_NAME in splitting_ops:
        from graphattn.passes.o_proj_fold import fold_o_proj as fold

        fold(gm.graph)
    assignment = assign_pieces(gm.graph, splitting_ops)
    localise_symbolic_values(gm.graph, assignment)
    gm.recompile()
    split = split_module(gm, None, lambda node: assignment[node], keep_original_order=True)
    _return_tuples(split)
    return split_graph_of(split, splitting_ops, input_values)


def split_graph_of(
    split: fx.GraphModule,
    splitting_ops: frozenset[str],
    input_values: Sequence[object] | None = None,
) -> SplitGraph:
    """The ``SplitGraph`` of an already split module: its pieces in call order, each piece
    input that is a model input no kernel of the step writes marked (``mark_model_inputs``;
    ``input_values`` as it takes them)."""
    calls = [n for n in split.graph.nodes if n.op == "call_module"]
    pieces = []
    for index, call in enumerate(calls):
        module = getattr(split, call.target)
        splitting = any(is_splitting_node(n, splitting_ops) for n in module.graph.nodes)
        pieces.append(Piece(index, call.target, module, splitting))
    splitting_pieces = {p.name for p in pieces if p.is_splitting}
    not_weights = mark_model_inputs(split, calls, input_values, splitting_pieces)
    folded = [
        n for p in pieces if p.is_splitting for n in p.module.graph.nodes
        if n.target is ATTENTION_O_PROJ_OP
    ]  # fmt: skip
    for call in folded:  # its kernel reads the weight before its PDL wait (o_proj_fold.py)
        weight = call.args[3]
        if not (isinstance(weight, fx.Node) and weight.meta.get(MODEL_INPUT)):
            why = not_weights.get(getattr(weight, "name", ""), "it is not a model input")
            raise ConfigError(
                f"GRAPHATTN_FOLD_O_PROJ=1 folded the o_proj of {call.args[5]} into its "
                f"attention op, whose kernel reads the weight before it waits for the kernels "
                f"before it; this weight may be written during the step ({why}). Set "
                f"GRAPHATTN_FOLD_O_PROJ=0 for this model"
            )
    return SplitGraph(split, pieces, not_weights, len(folded))


# node.meta key of a piece's placeholder that is an input of the whole model which no kernel
# of the step writes (a parameter, buffer or constant bound at trace time, never written in
# place): the only kind of value a GEMV may take for its weight, since it reads its first
# weight tile before it waits for the kernel launched before it (PDL). The step's input_ids
# and positions are marked too (the split graph does not tell them apart); 1-D integer
# tensors, they are never a weight.
MODEL_INPUT = "graphattn_model_input"


def mark_model_inputs(
    split: fx.GraphModule,
    calls: list[fx.Node],
    input_values: Sequence[object] | None = None,
    splitting: AbstractSet[str] = frozenset(),
) -> dict[str, str]:
    """Set ``MODEL_INPUT`` on each piece placeholder whose argument is an input or attribute
    of the split graph that no piece writes in place, nor lets a view of escape, and that
    shares no memory with an input some piece writes.

    Which inputs share memory comes from ``input_values``, the split graph's inputs in
    order as the step binds them (the model's own tensors; None for a step input or a size,
    the engine's buffers, never the model's memory): two share memory where their storages'
    address ranges on one device overlap, which also catches two storages over one memory
    (two ``torch.from_numpy`` of one array). Without them (a bare split graph) Dynamo's
    example values stand in, which can only tell one storage from another.

    It fails closed: a value an earlier piece computes, an input some piece mutates (or
    might, through a view it returns), one whose memory is not known while some input is
    written (a tensor subclass among them: its storage is not its memory), and a piece
    whose call does not line up with its placeholders get no mark.

    Returns the unmarked tensor inputs of the split graph by name, each with why
    (``splitting``: the names of the pieces of splitting ops, for the reasons' wording).
    """
    inputs = [(call, _piece_inputs(call, getattr(split, call.target))) for call in calls]
    written: dict[fx.Node, str] = {}  # input -> why it may be written
    for call, pairs in inputs:
        if not pairs:  # the piece's inputs unknown: every model input it takes may be written
            why = f"{call.target}'s call does not line up with its inputs"
            for arg in call.all_input_nodes:
                if _is_model_input(arg):
                    written.setdefault(arg, why)
        for arg, node in pairs:
            how = _may_be_written(node) if _is_model_input(arg) else ""
            if how:
                written.setdefault(arg, _written_by(str(call.target), how, splitting))
    model_inputs = {a for call in calls for a in call.all_input_nodes if _is_model_input(a)}
    values = _values_by_input(split, input_values)
    memory = {node: _memory_of(split, node, values) for node in model_inputs}
    for node, why in _sharing_memory(memory, written).items():
        written.setdefault(node, why)
    for call, pairs in inputs:
        for node in getattr(split, call.target).graph.find_nodes(op="placeholder"):
            node.meta.pop(MODEL_INPUT, None)
        for arg, node in pairs:
            if _is_model_input(arg) and arg not in written:
                node.meta[MODEL_INPUT] = True
    return {node.name: why for node, why in written.items() if memory[node] is not _NOT_A_TENSOR}


def _written_by(piece: str, how: str, splitting: AbstractSet[str]) -> str:
    if piece in splitting:
        return f"handed to the splitting ops of {piece}, which {how}"
    return f"{piece} {how}"


def _values_by_input(
    split: fx.GraphModule, input_values: Sequence[object] | None
) -> dict[fx.Node, object]:
    if input_values is None:
        return {}
    placeholders = list(split.graph.find_nodes(op="placeholder"))
    if len(input_values) != len(placeholders):
        raise ValueError(
            f"{len(input_values)} input values for a split graph of {len(placeholders)} inputs"
        )
    return dict(zip(placeholders, input_values))


def _sharing_memory(
    memory: dict[fx.Node, object], written: dict[fx.Node, str]
) -> dict[fx.Node, str]:
    """The model inputs that may share memory with a written one (a buffer registered as a
    view of a parameter is a second input over the parameter's memory), each with why; a
    tensor input whose memory is not known may share any."""
    tensors = {node for node, where in memory.items() if where is not _NOT_A_TENSOR}
    targets = [node for node in written if node in tensors]
    if not targets:
        return {}
    unknown = {node for node in tensors if memory[node] is _UNKNOWN}
    if blind := unknown.intersection(targets):
        blind = min(blind, key=lambda n: n.name)
        why = f"{blind.name}, which may be written, could share its memory (not known)"
        return {node: why for node in tensors}
    shared = {
        node: f"its memory is not known while {targets[0].name} may be written" for node in unknown
    }
    for node in sorted(tensors - unknown, key=lambda n: n.name):
        for target in targets:
            if target is not node and _overlap(memory[node], memory[target]):
                shared[node] = f"shares memory with {target.name}, which may be written"
                break
    return shared


_UNKNOWN, _NOT_A_TENSOR = object(), object()
_NO_DISPATCH = torch.Tensor.__torch_dispatch__


def _memory_of(split: fx.GraphModule, node: fx.Node, values: dict[fx.Node, object]) -> object:
    """Where an input's memory lies: ``("range", device, start, end)`` of a real tensor's
    storage, ``("storage", ref)`` of a fake one (Dynamo's example value), ``_UNKNOWN``
    where that cannot be told, ``_NOT_A_TENSOR`` for a size or other scalar."""
    if node.op == "get_attr":
        value = split
        for part in str(node.target).split("."):
            value = getattr(value, part, None)
    elif node in values:
        value = values[node]
        if value is None:  # a step input or a size
            return _NOT_A_TENSOR
    else:
        value = node.meta.get("example_value", node.meta.get("val"))
    if value is None:
        return _UNKNOWN
    if not isinstance(value, torch.Tensor):
        return _NOT_A_TENSOR
    if is_traceable_wrapper_subclass(value):  # its storage is a stand-in for its tensors'
        return _UNKNOWN
    try:
        storage = value.untyped_storage()
        if isinstance(value, FakeTensor):
            return ("storage", StorageWeakRef(storage))
        # a subclass with a dispatch of its own may keep its memory elsewhere (a plain
        # subclass of Parameter does not)
        if type(value).__torch_dispatch__ is not _NO_DISPATCH or value.layout != torch.strided:
            return _UNKNOWN
        start = storage.data_ptr()
        return ("range", value.device, start, start + storage.nbytes())
    except Exception:  # no plain storage (sparse, mkldnn): may share any
        return _UNKNOWN


def _overlap(a: tuple, b: tuple) -> bool:
    """Whether two ``_memory_of`` places may be the same memory (a fake one and a real one
    cannot be told apart: they may)."""
    if a[0] != b[0]:
        return True
    if a[0] == "storage":
        return a[1] == b[1]
    return a[1] == b[1] and a[2] < b[3] and b[2] < a[3]


def _piece_inputs(call: fx.Node, module: fx.GraphModule) -> list[tuple[object, fx.Node]]:
    """(argument in the split graph, placeholder of the piece) pairs; none where the call's
    arguments do not line up with the placeholders."""
    placeholders = list(module.graph.find_nodes(op="placeholder"))
    if call.kwargs or len(call.args) != len(placeholders):
        return []
    return list(zip(call.args, placeholders))


def _is_model_input(arg: object) -> bool:
    return isinstance(arg, fx.Node) and arg.op in ("placeholder", "get_attr")


# ops whose result may share memory with their first argument (Dynamo's method and function
# names, and ATen's; a conversion to the dtype or device a tensor already has returns it):
# a write through one is a write of the input
_VIEW_NAMES = frozenset(
    [
        "to",
        "float",
        "half",
        "bfloat16",
        "double",
        "type",
        "type_as",
        "cpu",
        "cuda",
        "ravel",
        "broadcast_to",
        "atleast_1d",
        "atleast_2d",
        "atleast_3d",
        "hsplit",
        "vsplit",
        "dsplit",
        "unsafe_split",
        "unsafe_chunk",
        "_get_data_attr",
        "dropout",
        "view",
        "reshape",
        "t",
        "transpose",
        "permute",
        "expand",
        "expand_as",
        "narrow",
        "select",
        "unsqueeze",
        "squeeze",
        "flatten",
        "unflatten",
        "view_as",
        "reshape_as",
        "as_strided",
        "detach",
        "split",
        "chunk",
        "unbind",
        "contiguous",
        "getitem",
        "__getitem__",
        "swapaxes",
        "swapdims",
        "movedim",
        "moveaxis",
        "diagonal",
        "unfold",
        "real",
        "imag",
        "T",
        "mT",
        "H",
        "mH",
        "data",
        "_unsafe_view",
        "alias",
        "slice",
        "tensor_split",
        "split_with_sizes",
    ]
)


def _may_be_written(placeholder: fx.Node) -> str:
    """How the piece may write ``placeholder`` ("" where it does not): in place, through
    itself or a view of it (a higher-order op it is handed to counts), or by returning a view
    of it (another piece could write that)."""
    aliases, pending = {placeholder}, [placeholder]
    while pending:
        for user in pending.pop().users:
            if user.op == "output":
                return "lets it or a view of it leave the piece"
            if _writes(user, aliases):
                return f"may write it ({_name(user) or user.target})"
            if user not in aliases and _is_view(user):
                aliases.add(user)
                pending.append(user)
    return ""


def _name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.partition("::")[2]
    return getattr(target, "__name__", "") or ""


def _any_alias(value: object, aliases: set[fx.Node]) -> bool:
    """``value`` (a node, or a list or tuple of them, as ``out=`` and ``_foreach_*_`` take)
    is or holds one of ``aliases``."""
    values = value if isinstance(value, (list, tuple)) else (value,)
    return any(isinstance(v, fx.Node) and v in aliases for v in values)


def _is_view(node: fx.Node) -> bool:
    if node.op not in ("call_method", "call_function"):
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        return any(r.alias_info is not None for r in node.target._schema.returns)
    return _name(node) in _VIEW_NAMES or node.target is getattr


def _writes(node: fx.Node, aliases: set[fx.Node]) -> bool:
    """Whether ``node`` may write one of ``aliases``: an in-place method or function (its
    name ends in ``_``: ``add_``, ``copy_``, ``index_copy_``, ``_foreach_mul_`` of a list),
    ``x[i] = v`` and ``x += v``, an ``out=`` argument, ``inplace=True``, ``set_`` (which
    makes another tensor an alias), an op whose schema writes an argument, or any
    higher-order op (its body is a graph)."""
    if node.op not in ("call_method", "call_function"):
        return False
    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator):
        return any(a in aliases for a in node.all_input_nodes)
    if isinstance(target, torch._ops.OpOverload):
        arguments = target._schema.arguments
        written = [
            node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            for i, arg in enumerate(arguments)
            if arg.alias_info is not None and arg.alias_info.is_write
        ]
        return any(_any_alias(w, aliases) for w in written)
    if isinstance(target, torch._ops.OpOverloadPacket):  # any overload might write
        return any(a in aliases for a in node.all_input_nodes)
    kwargs = node.kwargs
    if _any_alias(kwargs.get("out"), aliases):  # torch.add(a, b, out=buf)
        return True
    if kwargs.get("inplace") and any(a in aliases for a in node.all_input_nodes):  # F.relu
        return True
    name = _name(node)
    if name == "set_" and any(a in aliases for a in node.all_input_nodes):  # y.set_(buf)
        return True
    first = node.args[0] if node.args else None
    if not _any_alias(first, aliases):  # the one argument the forms below write
        return False
    if target in _INPLACE_OPERATORS:
        return True
    return (name.endswith("_") and not name.endswith("__")) or name == "__setitem__"


# x[i] = v and x += v (and the other augmented assignments) as Dynamo records them
_INPLACE_OPERATORS = frozenset(
    [operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv]
    + [operator.ifloordiv, operator.ipow, operator.imod, operator.iand, operator.ior]
    + [operator.ixor, operator.ilshift, operator.irshift]
)


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

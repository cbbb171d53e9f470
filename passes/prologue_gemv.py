"""Fold the op before a one-row linear layer into its GEMV: residual add + RMSNorm, and
SiLU-and-multiply (``graphattn/kernels/prologue_gemv.py``).

In a one-token build (see ``single_row_gemv.py``) each of these ops is a kernel launch of
~2 us that does almost nothing, between two GEMVs. The passes match them in the post-grad
graph, in the forms a Llama-style model's RMSNorm and MLP decompose to:

    h = add(a, b)                                 # the residual stream, optional
    hf = convert(h, f32)
    n = mul(hf, rsqrt(add(mean(pow(hf, 2), [-1], keepdim), eps)))
    x = convert(mul(n, convert(norm_weight, f32)), dtype)     -> mm(x, permute(W))

    g, u = split(gate_up, I, -1)
    x = mul(convert(silu(convert(g, f32)), dtype), u)         -> mm(x, permute(W))

(``silu`` as ``aten.silu`` or as ``div(g, add(exp(neg(g)), 1))``; products in either
order) and replaces the chain and the ``mm`` with one op. The residual sum ``h`` becomes the
op's second output for the rest of the graph. A chain whose intermediate values have other
users is left alone, as is any ``mm`` ``single_row_gemv`` would not take.

Two passes, each before ``single_row_gemv`` (which would take the ``mm`` first):

- ``rms_norm_gemv`` (a default): on an H200 the fused GEMV of the Llama-3.2-1B shape's
  qkv / gate_up took 6.21 / 18.64 us where Inductor's add + norm kernel and the GEMV took
  6.92 / 20.18 (``docs/results/fused-ops-h200.log``); the decode step lost 31 kernels and
  ran 1.04 -> 0.96 ms at batch 1 (with the Triton argmax; docs/performance-history.md).
- ``silu_mul_gemv`` (opt-in): 12.47 us against 12.04 for the SiLU-mul kernel and the down
  GEMV, slower. Each program computes SiLU over the whole K=8192 row it streams, which
  costs more than the launch it saves.

A third pass folds the same SiLU-and-multiply into the GEMV before it instead, as an
epilogue: ``silu_mul_epilogue`` (a default, after ``rms_norm_gemv``) rewrites a
``rms_norm_gemv`` / ``add_rms_norm_gemv`` whose product feeds nothing but
``silu(gate) * up`` over its two halves into ``rms_norm_gemv_silu_mul`` /
``add_rms_norm_gemv_silu_mul``: each program computes SiLU only for the few outputs it
owns, and the kernel between gate_up and down goes.

A fourth folds the rotary embedding of the query and key heads into the qkv GEMV the same
way: ``rope_epilogue`` (a default, after ``rms_norm_gemv``) rewrites a ``rms_norm_gemv`` /
``add_rms_norm_gemv`` whose product is sliced into ``[q | k]`` and ``v``, with ``[q | k]``
rotated in the rotate-half form::

    x1, x2 = split(convert(view(slice(product, 0, R), [1, -1, D]), f32), D / 2, -1)
    cos_ = convert(unsqueeze(cos, 1), f32)        (each step optional; sin_ alike)
    y = view(convert(cat([x1 * cos_ - x2 * sin_, x2 * cos_ + x1 * sin_], -1), dtype), [1, R])

(products in either order; cos and sin one position's ``[1, D/2]`` rows in fp32, bf16 or
fp16; every term ``[1, H, D/2]`` in fp32, so nothing broadcasts past the heads), into
``rms_norm_gemv_rope`` / ``add_rms_norm_gemv_rope`` whose output is the product with its
first R columns rotated: ``y`` becomes its slice, the other slices read it as they read the
product. The rotary kernel between qkv and attention goes.
"""

from __future__ import annotations

import operator
from abc import abstractmethod
from typing import ClassVar

import torch
from torch import fx

from graphattn.passes import single_row_gemv
from graphattn.passes.pass_manager import GraphPass
from graphattn.passes.single_row_gemv import module_uuid, single_row_linears

aten, prims = torch.ops.aten, torch.ops.prims


@torch.library.custom_op("graphattn::rms_norm_gemv", mutates_args=())
def rms_norm_gemv(
    x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``rms_norm(x) @ weight.T`` for one row."""
    from graphattn.kernels.prologue_gemv import rms_norm_gemv as launch

    return launch(x, weight, norm_weight, eps)[0]


@rms_norm_gemv.register_fake
def _rms_norm_gemv_fake(x, weight, norm_weight, eps):
    return x.new_empty((1, weight.shape[0]))


@torch.library.custom_op("graphattn::add_rms_norm_gemv", mutates_args=())
def add_rms_norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) @ weight.T, x + residual)`` for one row."""
    from graphattn.kernels.prologue_gemv import rms_norm_gemv as launch

    return launch(x, weight, norm_weight, eps, residual)


@add_rms_norm_gemv.register_fake
def _add_rms_norm_gemv_fake(x, residual, weight, norm_weight, eps):
    return weight.new_empty((1, weight.shape[0])), torch.empty_like(residual)


@torch.library.custom_op("graphattn::silu_mul_gemv", mutates_args=())
def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``(silu(gate) * up) @ weight.T`` for one row ``[gate | up]``."""
    from graphattn.kernels.prologue_gemv import silu_mul_gemv as launch

    return launch(gate_up, weight)


@silu_mul_gemv.register_fake
def _silu_mul_gemv_fake(gate_up, weight):
    return gate_up.new_empty((1, weight.shape[0]))


@torch.library.custom_op("graphattn::rms_norm_gemv_silu_mul", mutates_args=())
def rms_norm_gemv_silu_mul(
    x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``silu(gate) * up`` of ``[gate | up] = rms_norm(x) @ weight.T`` for one row."""
    from graphattn.kernels.prologue_gemv import rms_norm_gemv as launch

    return launch(x, weight, norm_weight, eps, epilogue="silu_mul")[0]


@rms_norm_gemv_silu_mul.register_fake
def _rms_norm_gemv_silu_mul_fake(x, weight, norm_weight, eps):
    return x.new_empty((1, weight.shape[0] // 2))


@torch.library.custom_op("graphattn::add_rms_norm_gemv_silu_mul", mutates_args=())
def add_rms_norm_gemv_silu_mul(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(silu(gate) * up, x + residual)`` with ``[gate | up] = rms_norm(x + residual) @
    weight.T``, for one row."""
    from graphattn.kernels.prologue_gemv import rms_norm_gemv as launch

    return launch(x, weight, norm_weight, eps, residual, epilogue="silu_mul")


@add_rms_norm_gemv_silu_mul.register_fake
def _add_rms_norm_gemv_silu_mul_fake(x, residual, weight, norm_weight, eps):
    return weight.new_empty((1, weight.shape[0] // 2)), torch.empty_like(residual)


@torch.library.custom_op("graphattn::rms_norm_gemv_rope", mutates_args=())
def rms_norm_gemv_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_size: int,
    rotated: int,
) -> torch.Tensor:
    """``rms_norm(x) @ weight.T`` for one row, its first ``rotated`` columns rotated by
    ``(cos, sin)`` in heads of ``head_size``."""
    from graphattn.kernels.prologue_gemv import Rotary
    from graphattn.kernels.prologue_gemv import rms_norm_gemv as launch

    rotary = Rotary(cos, sin, head_size, rotated)
    return launch(x, weight, norm_weight, eps, epilogue="rope", rotary=rotary)[0]


@rms_norm_gemv_rope.register_fake
def _rms_norm_gemv_rope_fake(x, weight, norm_weight, eps, cos, sin, head_size, rotated):
    return x.new_empty((1, weight.shape[0]))


@torch.library.custom_op("graphattn::add_rms_norm_gemv_rope", mutates_args=())
def add_rms_norm_gemv_rope(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_size: int,
    rotated: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) @ weight.T`` with its first ``rotated`` columns rotated,
    ``x + residual)`` for one row."""
    from graphattn.kernels.prologue_gemv import Rotary
    from graphattn.kernels.prologue_gemv import rms_norm_gemv as launch

    rotary = Rotary(cos, sin, head_size, rotated)
    return launch(x, weight, norm_weight, eps, residual, epilogue="rope", rotary=rotary)


@add_rms_norm_gemv_rope.register_fake
def _add_rms_norm_gemv_rope_fake(x, residual, weight, norm_weight, eps, cos, sin, d, rotated):
    return weight.new_empty((1, weight.shape[0])), torch.empty_like(residual)


ROPE_TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernel reads
_NORM_GEMVS = (
    torch.ops.graphattn.rms_norm_gemv.default,
    torch.ops.graphattn.add_rms_norm_gemv.default,
)


class _PrologueFold(GraphPass):
    """Folds, where it matches, the op before each one-row ``mm`` into a prologue GEMV."""

    def uuid(self) -> str:  # what it matches also depends on single_row_gemv's rules
        return module_uuid(self.name, __name__, single_row_gemv.__name__)

    def __call__(self, graph: fx.Graph) -> int:
        return sum(self.fold(graph, *linear) for linear in single_row_linears(graph))

    @abstractmethod
    def fold(self, graph: fx.Graph, mm: fx.Node, x: fx.Node, weight: fx.Node) -> bool:
        """Rewrite ``mm`` (of one row ``x`` and ``weight``) and the op before it; True if done."""


class RmsNormGemvPass(_PrologueFold):
    """Rewrites (residual add +) RMSNorm + mm of one row into ``rms_norm_gemv`` /
    ``add_rms_norm_gemv`` (a default pass)."""

    name: ClassVar[str] = "rms_norm_gemv"

    def fold(self, graph: fx.Graph, mm: fx.Node, x: fx.Node, weight: fx.Node) -> bool:
        return _fold_rms_norm(graph, mm, x, weight)


class SiluMulGemvPass(_PrologueFold):
    """Rewrites SiLU-and-multiply + mm of one row into ``silu_mul_gemv`` (opt-in: on par
    with the two kernels it replaces on an H200, see the module)."""

    name: ClassVar[str] = "silu_mul_gemv"

    def fold(self, graph: fx.Graph, mm: fx.Node, x: fx.Node, weight: fx.Node) -> bool:
        return _fold_silu_mul(graph, mm, x, weight)


class _EpilogueFold(GraphPass):
    """Folds, where it matches, the op after each one-row norm GEMV into its epilogue."""

    def uuid(self) -> str:  # what it matches also depends on single_row_gemv's rules
        return module_uuid(self.name, __name__, single_row_gemv.__name__)

    def __call__(self, graph: fx.Graph) -> int:
        calls = [n for n in graph.nodes if n.op == "call_function" and n.target in _NORM_GEMVS]
        return sum(self.fold(graph, call) for call in calls)

    @abstractmethod
    def fold(self, graph: fx.Graph, call: fx.Node) -> bool:
        """Rewrite ``call`` (a norm GEMV) and the op after it; True if done."""


class SiluMulEpiloguePass(_EpilogueFold):
    """Rewrites a one-row ``rms_norm_gemv`` / ``add_rms_norm_gemv`` whose product only feeds
    ``silu(gate) * up`` over its halves into ``rms_norm_gemv_silu_mul`` /
    ``add_rms_norm_gemv_silu_mul`` (a default pass; runs after ``rms_norm_gemv``)."""

    name: ClassVar[str] = "silu_mul_epilogue"

    def fold(self, graph: fx.Graph, call: fx.Node) -> bool:
        return _fold_silu_mul_epilogue(graph, call)


class RotaryEpiloguePass(_EpilogueFold):
    """Rewrites a one-row ``rms_norm_gemv`` / ``add_rms_norm_gemv`` whose product's leading
    columns only feed a rotate-half rotary embedding into ``rms_norm_gemv_rope`` /
    ``add_rms_norm_gemv_rope`` (a default pass; runs after ``rms_norm_gemv``)."""

    name: ClassVar[str] = "rope_epilogue"

    def fold(self, graph: fx.Graph, call: fx.Node) -> bool:
        return _fold_rope_epilogue(graph, call)


def _fold_rms_norm(graph: fx.Graph, mm: fx.Node, x: fx.Node, weight: fx.Node) -> bool:
    match = match_rms_norm(x)
    if match is None:
        return False
    h, norm_weight, eps, chain = match
    residual_add = _residual_add(h)
    rounded = None
    if residual_add is not None:  # an fp32 addend rounded just before: the kernel rounds it
        residual_add, rounded = _fp32_addend(*residual_add)
    # the fused call goes right after h (so every user of h can read its second output),
    # where the weights must already exist: parameters, as graph inputs or attributes
    inputs_first = all(n.op in ("placeholder", "get_attr") for n in (weight, norm_weight))
    if residual_add is not None and inputs_first:
        a, b = residual_add
        with graph.inserting_after(h):
            call = graph.call_function(
                torch.ops.graphattn.add_rms_norm_gemv.default, (a, b, weight, norm_weight, eps)
            )
        vals = (a.meta["val"], b.meta["val"], weight.meta["val"], norm_weight.meta["val"])
        call.meta["val"] = _add_rms_norm_gemv_fake(*vals, eps)
        out, total = _outputs(graph, call)
        mm.replace_all_uses_with(out)
        h.replace_all_uses_with(total)
        chain = [mm, *chain, h, *([rounded] if rounded is not None else [])]
    else:
        with graph.inserting_before(mm):
            out = graph.call_function(
                torch.ops.graphattn.rms_norm_gemv.default, (h, weight, norm_weight, eps)
            )
        vals = (h.meta["val"], weight.meta["val"], norm_weight.meta["val"])
        out.meta["val"] = _rms_norm_gemv_fake(*vals, eps)
        mm.replace_all_uses_with(out)
        chain = [mm, *chain]
    _erase_unused(graph, chain)
    return True


def _fold_silu_mul(graph: fx.Graph, mm: fx.Node, x: fx.Node, weight: fx.Node) -> bool:
    match = match_silu_mul(x, weight.meta["val"].shape[1])
    if match is None:
        return False
    gate_up, chain = match
    with graph.inserting_before(mm):
        out = graph.call_function(torch.ops.graphattn.silu_mul_gemv.default, (gate_up, weight))
    out.meta["val"] = _silu_mul_gemv_fake(gate_up.meta["val"], weight.meta["val"])
    mm.replace_all_uses_with(out)
    _erase_unused(graph, [mm, *chain])
    return True


_EPILOGUE_OPS = {
    torch.ops.graphattn.rms_norm_gemv.default: torch.ops.graphattn.rms_norm_gemv_silu_mul.default,
    torch.ops.graphattn.add_rms_norm_gemv.default: (
        torch.ops.graphattn.add_rms_norm_gemv_silu_mul.default
    ),
}


def _fold_silu_mul_epilogue(graph: fx.Graph, call: fx.Node) -> bool:
    """Fold ``silu(gate) * up`` over ``call``'s product into ``call``; True if done."""
    found = _product_of(call)
    silu_mul = _silu_mul_of(found[0]) if found else None
    if silu_mul is None:
        return False
    x, chain = silu_mul
    # every node between the product and x must die with the rewrite, or the product (and
    # the GEMV streaming the weight) would stay as well
    inside = {*chain, x}
    if any(user not in inside for node in chain if node is not x for user in node.users):
        return False
    out, total = _fused_call(graph, call, _EPILOGUE_OPS[call.target], call.args, found[1])
    x.replace_all_uses_with(out)
    _erase_replaced(graph, [*chain, *found[1].values(), call], total)
    return True


_ROPE_OPS = {
    torch.ops.graphattn.rms_norm_gemv.default: torch.ops.graphattn.rms_norm_gemv_rope.default,
    torch.ops.graphattn.add_rms_norm_gemv.default: torch.ops.graphattn.add_rms_norm_gemv_rope.default,
}


def _fold_rope_epilogue(graph: fx.Graph, call: fx.Node) -> bool:
    """Fold the rotary embedding of ``call``'s leading columns into ``call``; True if done."""
    found = _product_of(call)
    match = _rotary_of(found[0]) if found else None
    if match is None:
        return False
    product, items = found
    rotated_view, cos, sin, head_size, rotated, chain = match
    order = {node: i for i, node in enumerate(graph.nodes)}
    if max(order[cos], order[sin]) > order[call]:
        return False  # the tables come later: the fused call could not take call's place
    args = (*call.args, cos, sin, head_size, rotated)
    out, total = _fused_call(graph, call, _ROPE_OPS[call.target], args, items)
    with graph.inserting_after(out):
        head = graph.call_function(aten.slice.Tensor, (out, 1, 0, rotated))
    head.meta["val"] = aten.slice.Tensor(out.meta["val"], 1, 0, rotated)
    rotated_view.replace_all_uses_with(head)
    product.replace_all_uses_with(out)  # the slices of the columns that do not rotate
    _erase_replaced(graph, [*chain, *items.values(), call], total)
    return True


def _product_of(call: fx.Node) -> tuple[fx.Node, dict[int, fx.Node]] | None:
    """``(product, items)``: the node of ``call``'s product (``call`` itself, or the residual
    variant's getitem 0) and the residual variant's getitems by index (none for the other);
    None when the residual variant has a user that is not one of its getitems."""
    if call.target is not torch.ops.graphattn.add_rms_norm_gemv.default:
        return call, {}
    items = {user.args[1]: user for user in call.users if user.target is operator.getitem}
    product = items.get(0)
    if product is None or len(items) != len(call.users):
        return None
    return product, items


def _fused_call(
    graph: fx.Graph, call: fx.Node, target, args: tuple, items: dict[int, fx.Node]
) -> tuple[fx.Node, fx.Node | None]:
    """``target(*args)`` right after ``call``; returns the node of its product and, for the
    residual variant (``items`` given), of its residual sum, which takes over the users of
    ``call``'s (item 1)."""
    with graph.inserting_after(call):
        fused = graph.call_function(target, args)
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    fused.meta["val"] = _FAKES[target](*vals)
    if not items:
        return fused, None
    out, total = _outputs(graph, fused)
    if 1 in items:
        items[1].replace_all_uses_with(total)
    return out, total


def _erase_replaced(graph: fx.Graph, nodes: list[fx.Node], total: fx.Node | None) -> None:
    """Erase the replaced ``nodes`` (consumers first), and the fused call's residual sum when
    nothing reads it."""
    _erase_unused(graph, nodes)
    if total is not None and not total.users:
        graph.erase_node(total)


_FAKES = {
    torch.ops.graphattn.rms_norm_gemv_silu_mul.default: _rms_norm_gemv_silu_mul_fake,
    torch.ops.graphattn.add_rms_norm_gemv_silu_mul.default: _add_rms_norm_gemv_silu_mul_fake,
    torch.ops.graphattn.rms_norm_gemv_rope.default: _rms_norm_gemv_rope_fake,
    torch.ops.graphattn.add_rms_norm_gemv_rope.default: _add_rms_norm_gemv_rope_fake,
}


def _rotary_of(product: fx.Node):
    """``(y, cos, sin, head_size, rotated, chain)`` when the product's users are column
    slices, one of them ``[:, :rotated]`` rotated as in the module (its result ``y``) and the
    others past ``rotated``, and every node of the rotary lives only for it; else None."""
    val = product.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 2 or val.shape[0] != 1:
        return None
    slices = list(product.users)
    if not all(_is_column_slice(s) for s in slices):
        return None
    head = [s for s in slices if s.args[2] == 0]
    if len(head) != 1 or len(head[0].users) != 1:
        return None
    rotated = head[0].args[3]
    n = val.shape[1]
    if not (isinstance(rotated, int) and 0 < rotated <= n):
        return None
    if any(s.args[2] < rotated for s in slices if s is not head[0]):
        return None  # another user reads columns that would come back rotated
    (view,) = head[0].users
    cast = next(iter(view.users)) if _is_view(view) else None
    if not (_is(cast, prims.convert_element_type.default) and cast.args[1] == torch.float32):
        return None
    halves = next(iter(cast.users))
    d = view.meta["val"].shape[-1]
    if not (view.meta["val"].dim() == 3 and d % 2 == 0 and rotated % d == 0 and n % d == 0):
        return None
    if not (
        _is(halves, aten.split.Tensor, users=2) and halves.args[1:] in ((d // 2, -1), (d // 2, 2))
    ):
        return None
    items = {u.args[1]: u for u in halves.users if u.target is operator.getitem}
    x1, x2 = items.get(0), items.get(1)
    if x1 is None or x2 is None or len(x1.users) != 2 or len(x2.users) != 2:
        return None
    terms = _rotation_terms(x1, x2)
    if terms is None:
        return None
    y, cos_f, sin_f, rotation = terms
    cos, sin = _rope_table(cos_f, d), _rope_table(sin_f, d)
    if cos is None or sin is None or y.meta["val"].shape != (1, rotated):
        return None
    if y.meta["val"].dtype != val.dtype:
        return None
    steps = [*_table_steps(cos_f, cos), *_table_steps(sin_f, sin)]
    chain = [y, *rotation, x1, x2, halves, cast, view, head[0], *steps]
    return y, cos, sin, d, rotated, chain


def _is_view(node: object, users: int | None = 1) -> bool:
    return _is(node, aten.reshape.default, users) or _is(node, aten.view.default, users)


def _is_column_slice(node: fx.Node) -> bool:
    """``slice(t, 1, start, end)`` with step 1 and a non-negative int start."""
    if not _is(node, aten.slice.Tensor, users=None) or len(node.args) < 4:
        return False
    dim, start = node.args[1], node.args[2]
    step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
    return dim in (1, -1) and isinstance(start, int) and start >= 0 and step == 1


def _rotation_terms(x1: fx.Node, x2: fx.Node):
    """``(y, cos_, sin_, nodes)`` when the four users of x1 and x2 are
    ``x1 * cos_, x2 * sin_, x2 * cos_, x1 * sin_`` combined as
    ``y = view(convert(cat([x1 cos_ - x2 sin_, x2 cos_ + x1 sin_], -1)))``; else None."""
    muls = [u for x in (x1, x2) for u in x.users]
    if not all(_is(m, aten.mul.Tensor) for m in muls):  # one user each
        return None
    half = x1.meta["val"]  # [1, H, D/2] fp32; every term has its shape (no broadcast past it)
    if half.dtype != torch.float32 or x2.meta["val"].shape != half.shape:
        return None
    subs = [u for m in x1.users for u in m.users if _is(u, aten.sub.Tensor)]
    if len(subs) != 1 or subs[0].kwargs.get("alpha", 1) != 1:
        return None
    sub = subs[0]
    first, second = sub.args[:2]
    if first not in x1.users or second not in x2.users:
        return None
    cos_ = _other(first, x1)
    sin_ = _other(second, x2)
    x2_cos = next((m for m in x2.users if m is not second), None)
    x1_sin = next((m for m in x1.users if m is not first), None)
    if _other(x2_cos, x2) is not cos_ or _other(x1_sin, x1) is not sin_:
        return None
    (add,) = x2_cos.users
    if not (_is(add, aten.add.Tensor) and set(add.args[:2]) == {x2_cos, x1_sin}):
        return None
    if len(x1_sin.users) != 1 or add.kwargs.get("alpha", 1) != 1:
        return None
    terms = (first, second, x2_cos, x1_sin, sub, add)
    if any(_val_of(t) != (half.shape, torch.float32) for t in terms):
        return None
    (cat,) = sub.users if len(sub.users) == 1 else (None,)
    if not (_is(cat, aten.cat.default) and list(cat.args[0]) == [sub, add]):
        return None
    if (cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)) not in (-1, 2):
        return None  # the last of the three dimensions: [x1 | x2] within each head
    back = next(iter(cat.users))
    if not _is(back, prims.convert_element_type.default):
        return None
    y = next(iter(back.users))
    if not _is_view(y, users=None) or y.meta["val"].dim() != 2:
        return None
    return y, cos_, sin_, [back, cat, add, sub, x1_sin, x2_cos, second, first]


def _val_of(node: fx.Node) -> tuple[torch.Size, torch.dtype] | None:
    val = node.meta.get("val")
    return (val.shape, val.dtype) if isinstance(val, torch.Tensor) else None


def _other(mul: fx.Node | None, x: fx.Node) -> fx.Node | None:
    """The other operand of ``mul = x * other`` (either order)."""
    if mul is None:
        return None
    a, b = mul.args[:2]
    return b if a is x else a if b is x else None


def _rope_table(node: object, d: int) -> fx.Node | None:
    """The ``[1, d / 2]`` cos or sin row (fp32, bf16 or fp16) behind the ``[1, 1, d / 2]``
    fp32 factor ``convert(unsqueeze(row, 1), f32)`` (either step optional, in either order,
    each at most once); else None."""
    if not isinstance(node, fx.Node) or _val_of(node) != ((1, 1, d // 2), torch.float32):
        return None
    steps = {prims.convert_element_type.default: torch.float32, aten.unsqueeze.default: 1}
    while isinstance(node, fx.Node) and node.target in steps:
        if not _is(node, node.target, users=None) or node.args[1] != steps.pop(node.target):
            return None
        node = node.args[0]
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype not in ROPE_TABLE_DTYPES:
        return None
    if tuple(val.shape) != (1, d // 2) or val.stride(-1) != 1:
        return None
    return node


def _table_steps(node: fx.Node, table: fx.Node) -> list[fx.Node]:
    """The unsqueeze / convert steps from ``node`` up to ``table`` (erased once nothing else
    uses them)."""
    steps = []
    while node is not table:
        steps.append(node)
        node = node.args[0]
    return steps


def _silu_mul_of(product: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """``(x, chain)`` when ``product``'s only use is ``x = silu(gate) * up`` over its two
    halves; else None."""
    split = next(iter(product.users)) if len(product.users) == 1 else None
    if not _is(split, aten.split.Tensor, users=2):
        return None
    up = next((u for u in split.users if u.args[1:] == (1,)), None)
    if up is None or len(up.users) != 1:
        return None
    (x,) = up.users
    match = match_silu_mul(x, split.args[1])
    if match is None or match[0] is not product:
        return None
    return x, match[1]


def match_rms_norm(x: fx.Node) -> tuple[fx.Node, fx.Node, float, list[fx.Node]] | None:
    """``(h, norm_weight, eps, chain)`` when ``x`` is ``rms_norm(h) * norm_weight`` rounded to
    h's dtype, with every intermediate used only inside the norm; else None."""
    scaled = _arg_of(x, prims.convert_element_type.default)
    if scaled is None or not _is(scaled, aten.mul.Tensor):
        return None
    normed, weight_f32 = _split_pair(scaled, lambda n: _is_cast_to_f32(n, ndim=1))
    if normed is None or not _is(normed, aten.mul.Tensor):
        return None
    hf, rstd = _split_pair(normed, lambda n: _is(n, aten.rsqrt.default))
    if hf is None or not _is_cast_to_f32(hf, ndim=2, users=2):
        return None
    shifted = rstd.args[0]
    if not _is(shifted, aten.add.Tensor) or not isinstance(shifted.args[1], float):
        return None
    mean = shifted.args[0]
    if not _is(mean, aten.mean.dim) or list(mean.args[1]) not in ([-1], [1]):
        return None
    if not (mean.args[2:3] == (True,) or mean.kwargs.get("keepdim") is True):
        return None
    square = mean.args[0]
    if not (_is(square, aten.pow.Tensor_Scalar) and square.args == (hf, 2)):
        return None
    h, norm_weight = hf.args[0], weight_f32.args[0]
    k = x.meta["val"].shape[1]
    w = norm_weight.meta["val"]
    if h.meta["val"].dtype != x.meta["val"].dtype or w.shape != (k,) or w.stride() != (1,):
        return None
    chain = [x, scaled, normed, weight_f32, rstd, shifted, mean, square, hf]
    return h, norm_weight, float(shifted.args[1]), chain


def match_silu_mul(x: fx.Node, k: object) -> tuple[fx.Node, list[fx.Node]] | None:
    """``(gate_up, chain)`` when ``x`` is ``silu(gate) * up`` over the halves of one
    contiguous ``[1, 2k]`` tensor; else None."""
    if not _is(x, aten.mul.Tensor, users=1):
        return None
    up, silu_cast = _split_pair(x, lambda n: _is(n, prims.convert_element_type.default))
    dtype = x.meta["val"].dtype
    if silu_cast is None or silu_cast.args[1] != dtype:
        return None
    silu = silu_cast.args[0]
    gate_f32, silu_chain = _silu_input(silu)
    if gate_f32 is None or not _is_cast_to_f32(gate_f32, ndim=2, users=len(gate_f32.users)):
        return None
    gate = gate_f32.args[0]
    if not isinstance(k, int):
        return None
    halves = _halves(gate, up, k)
    if halves is None:
        return None
    gate_up, split = halves
    if gate_up.meta["val"].dtype != dtype:
        return None
    return gate_up, [x, silu_cast, *silu_chain, gate_f32, gate, up, split]


# -- helpers ------------------------------------------------------------------------------


def _is(node: object, target: object, users: int | None = 1) -> bool:
    return (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and node.target is target
        and (users is None or len(node.users) == users)
    )


def _arg_of(node: fx.Node, target: object) -> fx.Node | None:
    if not _is(node, target):
        return None
    arg = node.args[0]
    return arg if isinstance(arg, fx.Node) else None


def _is_cast_to_f32(node: object, *, ndim: int, users: int = 1) -> bool:
    if not _is(node, prims.convert_element_type.default, users):
        return False
    source = node.args[0]
    return (
        node.args[1] == torch.float32
        and isinstance(source, fx.Node)
        and isinstance(source.meta.get("val"), torch.Tensor)
        and source.meta["val"].dim() == ndim
    )


def _split_pair(node: fx.Node, is_second) -> tuple[fx.Node | None, fx.Node | None]:
    """The two tensor arguments of a binary op as (other, the one ``is_second`` picks)."""
    a, b = node.args[:2]
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return None, None
    if is_second(b):
        return a, b
    if is_second(a):
        return b, a
    return None, None


def _silu_input(silu: fx.Node) -> tuple[fx.Node | None, list[fx.Node]]:
    """The fp32 gate of ``silu`` (``aten.silu`` or ``g / (1 + exp(-g))``) and the nodes of it."""
    if _is(silu, aten.silu.default):
        return silu.args[0], [silu]
    if not _is(silu, aten.div.Tensor):
        return None, []
    g, denominator = silu.args[:2]
    if not (_is(denominator, aten.add.Tensor) and denominator.args[1] == 1):
        return None, []
    exp = denominator.args[0]
    neg = exp.args[0] if _is(exp, aten.exp.default) else None
    if not (_is(neg, aten.neg.default) and neg.args[0] is g and len(g.users) == 2):
        return None, []
    return g, [silu, denominator, exp, neg]


def _halves(gate: fx.Node, up: fx.Node, k: int) -> tuple[fx.Node, fx.Node] | None:
    """(gate_up, split) when gate and up are items 0 and 1 of ``split(gate_up, k, -1)``."""
    if not (_is(gate, operator.getitem) and _is(up, operator.getitem)):
        return None
    split = gate.args[0]
    if up.args[0] is not split or (gate.args[1], up.args[1]) != (0, 1):
        return None
    if not _is(split, aten.split.Tensor, users=2) or split.args[1] != k:
        return None
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if dim not in (-1, 1):
        return None
    gate_up = split.args[0]
    val = gate_up.meta.get("val")
    if not isinstance(val, torch.Tensor) or tuple(val.shape) != (1, 2 * k) or val.stride(1) != 1:
        return None
    return gate_up, split


def _residual_add(h: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(a, b) when ``h = add(a, b)`` of two one-row tensors of h's shape and dtype."""
    if not _is(h, aten.add.Tensor, users=None) or h.kwargs.get("alpha", 1) != 1:
        return None
    a, b = h.args[:2]
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return None
    want = h.meta["val"]
    for t in (a.meta.get("val"), b.meta.get("val")):
        if not isinstance(t, torch.Tensor) or t.shape != want.shape or t.dtype != want.dtype:
            return None
        if t.stride(-1) != 1:
            return None
    return a, b


def _fp32_addend(a: fx.Node, b: fx.Node) -> tuple[tuple[fx.Node, fx.Node], fx.Node | None]:
    """``((x32, other), cast)`` when one addend is ``cast = convert_element_type(x32, dtype)``
    of an fp32 row read only by the add (the attention op's fp32 o_proj output,
    ``o_proj_fold.py``): the residual GEMV takes x32 and rounds it to the dtype itself.
    Else ``((a, b), None)``."""
    for cast, other in ((a, b), (b, a)):
        if not _is(cast, prims.convert_element_type.default):
            continue
        source = cast.args[0]
        val = source.meta.get("val") if isinstance(source, fx.Node) else None
        if (
            isinstance(val, torch.Tensor)
            and val.dtype == torch.float32
            and val.shape == cast.meta["val"].shape
            and val.stride(-1) == 1
        ):
            return (source, other), cast
    return (a, b), None


def _outputs(graph: fx.Graph, call: fx.Node) -> tuple[fx.Node, fx.Node]:
    """``call[0]`` and ``call[1]`` (the product and the residual sum), right after ``call``,
    with the values of ``call.meta["val"]``."""
    with graph.inserting_after(call):
        out = graph.call_function(operator.getitem, (call, 0))
    with graph.inserting_after(out):
        total = graph.call_function(operator.getitem, (call, 1))
    out.meta["val"], total.meta["val"] = call.meta["val"]
    return out, total


def _erase_unused(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase ``nodes`` (consumers first) that nothing uses any more."""
    for node in nodes:
        if node.op == "call_function" and not node.users:
            graph.erase_node(node)

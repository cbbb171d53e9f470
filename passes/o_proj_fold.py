"""Fold each attention layer's output projection into its attention op (before the split).

A model's layer calls ``graphattn::unified_attention_with_output`` into an ``empty_like(q)``
buffer, views it as ``[T, Hq * D]`` and multiplies it by o_proj's weight. This rewrite,
on the traced (Dynamo) graph before it is split into pieces, replaces the three with
``graphattn::unified_attention_o_proj(q, k, v, weight, out, ...)`` into an fp32 ``[T, N]``
buffer ``out`` made where the old buffer was (in the piece before the op, as attention's:
under piecewise graphs it then lives in their pool, at the address the next piece's graph
reads). The next piece rounds ``out`` to the linear's dtype, where the residual add and
the norm read it (at one token ``passes/prologue_gemv.py`` takes the fp32 row into the
next GEMV's prologue, rounding it there). The backend decides what the op runs
(``AttentionImpl.forward_o_proj``): TRITON multiplies by the weight inside its split-KV
reduction at one token, any backend else runs attention and one matmul.

Only the exact shape is rewritten: the buffer is ``empty_like`` of the query and read by the
one view; the view, ``[T, Hq * D]``, by the one linear; the linear has no bias and its
weight is a graph input of the query's dtype that nothing else in the graph uses (a lifted
parameter: the kernel reads it before its PDL wait, so no kernel of the step may write it;
after the split ``split_graph_of`` also requires the split's model-input mark on it, and
refuses the fold with a ``ConfigError`` where it is missing). Anything else is left as
traced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from graphattn.attention.ops import ATTENTION_O_PROJ_OP, ATTENTION_OP

_ATTENTION_TARGETS = (ATTENTION_OP, ATTENTION_OP.overloadpacket)
_LINEARS = (torch._C._nn.linear, F.linear)
_VIEWS = ("view", "reshape")


def fold_o_proj(graph: fx.Graph) -> int:
    """Rewrite every attention + o_proj of ``graph`` (a Dynamo graph) that matches; returns
    how many."""
    folded = 0
    for node in list(graph.nodes):
        match = _match(node)
        if match is None:
            continue
        args, buffer, view, linear, weight = match
        query, key, value, _, layer_name, dep = args
        q_val, linear_val = query.meta["example_value"], linear.meta["example_value"]
        n = linear_val.shape[1]
        with graph.inserting_before(buffer):
            tokens = graph.call_method("size", (query, 0))
            out = graph.call_method("new_empty", (query, (tokens, n)), {"dtype": torch.float32})
        with graph.inserting_before(node):
            call = graph.call_function(
                ATTENTION_O_PROJ_OP, (query, key, value, weight, out, layer_name, dep)
            )
        with graph.inserting_before(linear):
            rounded = graph.call_method("to", (out, linear_val.dtype))
        tokens.meta["example_value"] = q_val.shape[0]
        with q_val.fake_mode:
            out.meta["example_value"] = q_val.new_empty((q_val.shape[0], n), dtype=torch.float32)
        call.meta["example_value"] = None
        rounded.meta["example_value"] = linear_val
        for new in (tokens, out, call, rounded):
            new.meta["stack_trace"] = linear.meta.get("stack_trace")
        linear.replace_all_uses_with(rounded)
        for dead in (linear, view, node, buffer):
            graph.erase_node(dead)
        folded += 1
    return folded


def _match(node: fx.Node):
    """``(attention args, buffer, view, linear, weight)`` when ``node`` is an attention call
    whose output only o_proj reads; else None."""
    if node.op != "call_function" or node.target not in _ATTENTION_TARGETS:
        return None
    args = _attention_args(node)
    if args is None:
        return None
    query, buffer = args[0], args[3]
    if not (
        isinstance(buffer, fx.Node)
        and buffer.op == "call_function"
        and buffer.target is torch.empty_like
        and buffer.args == (query,)
        and not buffer.kwargs
        and len(buffer.users) == 2
    ):
        return None
    view = next((u for u in buffer.users if u is not node), None)
    if not (view.op == "call_method" and view.target in _VIEWS and view.args[0] is buffer):
        return None
    linear = next(iter(view.users), None) if len(view.users) == 1 else None
    if linear is None or linear.op != "call_function" or linear.target not in _LINEARS:
        return None
    weight = linear.args[1] if len(linear.args) > 1 else linear.kwargs.get("weight")
    bias = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
    if linear.args[0] is not view or bias is not None or not isinstance(weight, fx.Node):
        return None
    if weight.op != "placeholder" or len(weight.users) != 1:  # a lifted parameter
        return None
    q, w, rows = (n.meta.get("example_value") for n in (query, weight, view))
    if not all(isinstance(t, torch.Tensor) for t in (q, w, rows)):
        return None
    if q.dim() != 3 or w.dim() != 2 or rows.dim() != 2 or w.dtype != q.dtype:
        return None
    k = q.shape[1] * q.shape[2]  # the view must be [T, Hq * D], the linear's K
    if not (statically_known_true(rows.shape[0] == q.shape[0]) and rows.shape[1] == k):
        return None
    if w.shape[1] != k:
        return None
    return args, buffer, view, linear, weight


def _attention_args(node: fx.Node) -> tuple | None:
    """The call's (query, key, value, output, layer_name, kv_cache_dep), or None."""
    names = ("query", "key", "value", "output", "layer_name", "kv_cache_dep")
    args = list(node.args) + [None] * (len(names) - len(node.args))
    for i, name in enumerate(names[len(node.args) :], len(node.args)):
        args[i] = node.kwargs.get(name)
    if set(node.kwargs) - set(names) or not isinstance(args[4], str):
        return None
    return tuple(args)

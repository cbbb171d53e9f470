"""A piece graph's fingerprint: equal for pieces that compile to the same code.

The middle layers of a model split into pieces that differ only in the names of their
inputs (``layers_3_..._weight`` against ``layers_4_..._weight``). The fingerprint hashes
what the compiled code depends on and nothing else: each node's operation, target and
arguments (nodes by position), and each input's dtype, device, shape, stride,
``requires_grad`` and whether it is a model input no kernel of the step writes
(``split.MODEL_INPUT``), with symbolic sizes renamed in order of appearance.
"""

from __future__ import annotations

import hashlib
from typing import Any

import sympy
import torch
from torch import fx

from graphattn.passes.split import MODEL_INPUT


def graph_fingerprint(gm: fx.GraphModule) -> str:
    """SHA-256 of ``gm``'s canonical form (see the module docstring)."""
    position: dict[fx.Node, str] = {}
    symbols: dict[sympy.Symbol, sympy.Symbol] = {}
    lines = []
    for i, node in enumerate(gm.graph.nodes):
        position[node] = f"%{i}"
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: position[n])
        lines.append(f"{node.op} {_target(gm, node)} {args!r} {_input_meta(node, symbols)}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _target(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "placeholder":
        return "input"
    if node.op == "get_attr":  # a constant of the piece: its value is part of the code
        return f"const:{_tensor_digest(getattr(gm, node.target))}"
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    module = getattr(target, "__module__", None)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))
    return f"{module}.{name}"


def _input_meta(node: fx.Node, symbols: dict[sympy.Symbol, sympy.Symbol]) -> str:
    if node.op != "placeholder":
        return ""
    value = node.meta.get("example_value", node.meta.get("val"))
    # only a model input no kernel of the step writes may be a GEMV's weight (split.MODEL_INPUT)
    source = " model-input" if node.meta.get(MODEL_INPUT) else ""
    if isinstance(value, torch.Tensor):
        shape = [_size(s, symbols) for s in value.shape]
        stride = [_size(s, symbols) for s in value.stride()]
        # the device index too: Inductor's code for cuda:0 names device 0
        return f"{value.dtype} {value.device} {shape} {stride} {value.requires_grad}{source}"
    return _size(value, symbols) + source


def _size(value: Any, symbols: dict[sympy.Symbol, sympy.Symbol]) -> str:
    """A size as text, its symbols renamed ``S0, S1, ...`` in order of first appearance."""
    if not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return repr(value)
    expr = value.node.expr
    for symbol in sorted(expr.free_symbols, key=str):
        symbols.setdefault(symbol, sympy.Symbol(f"S{len(symbols)}"))
    return f"Sym({expr.xreplace(symbols)})"


def _tensor_digest(value: Any) -> str:
    if not isinstance(value, torch.Tensor):
        return repr(value)
    data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{value.dtype}{list(value.shape)}:{hashlib.sha256(data).hexdigest()[:16]}"

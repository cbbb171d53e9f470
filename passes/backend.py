"""The Dynamo side: trace ``model(input_ids, positions)`` once into an FX graph, then call
that graph without Dynamo.

The trace is ``torch.compile(fullgraph=True)`` with a backend that keeps the graph, the
token dimension of both inputs marked dynamic (``mark_dynamic``). Dynamo's guards are
then dropped by never consulting them: an ``InputBinding`` builds the graph's flat
argument list itself (parameters and buffers as traced, the step's two tensors, and the
token count for every size input), so a step of any size reuses the one graph and no
guard is evaluated per step. This relies only on the backend calling convention, which
is the same on torch 2.11 and 2.13 (``guard_filter_fn`` would work too, but still costs
a guard-set walk and Dynamo's frame hook on every call).

What the graph does assume is checked per call by ``InputSignature``: both inputs 1-D,
of the traced dtype and device, and of the same length when the trace unified them.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx

from graphattn.attention.layer import twice_called_message
from graphattn.errors import GraphAttnError, InvalidInputError
from graphattn.model_contract import FORWARD, output_error
from graphattn.passes.split import op_name

# Dynamo keeps compiled code per code object; each trace gets a fresh copy of this
# function's code, so tracing many models (or one model twice) never piles entries onto
# one code object and never meets Dynamo's recompile limit.


def _call_model(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor):
    return model(input_ids, positions)


@dataclass
class Trace:
    """One Dynamo trace: the graph, how to bind a step's inputs to it, what it assumes of
    them, and the output of the traced run.
    """

    graph_module: fx.GraphModule
    binding: InputBinding
    signature: InputSignature
    output: torch.Tensor
    seconds: float
    # every code object Dynamo traced, and their source files (the trace cache checks them)
    traced_code: tuple[types.CodeType, ...] = ()
    traced_files: tuple[str, ...] = ()


def trace_model(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    bytecode_hook: Callable[[types.CodeType, types.CodeType], None] | None = None,
) -> Trace:
    """Trace ``model(input_ids, positions)`` once with the token dimension dynamic. The
    traced graph is not run: ``Trace.output`` is an uninitialised tensor of the output's
    shape (for the example inputs), dtype and device.
    """
    start = time.perf_counter()
    captured: dict[str, Any] = {}

    def keep_graph(gm: fx.GraphModule, example_inputs: list[Any]):
        captured["gm"], captured["inputs"] = gm, list(example_inputs)
        captured["code"] = _traced_code()

        def run(*args: Any):
            # Nothing reads the traced call's values (the step runs the compiled pieces), so
            # the graph is not run here: outputs of the traced shapes stand in for them.
            captured["graph_output"] = _placeholder_outputs(gm, args)
            return captured["graph_output"]

        return run

    for t in (input_ids, positions):
        torch._dynamo.mark_dynamic(t, 0)
    entry = types.FunctionType(_call_model.__code__.replace(), _call_model.__globals__)
    # dynamic=None (not False): only the marked dimensions are dynamic either way, and
    # mark_dynamic is honoured under every torch this supports; one trace, no recompiles
    traced = torch.compile(entry, backend=keep_graph, fullgraph=True)
    try:
        # automatic dynamic off: Dynamo remembers values per code location across traces, so
        # a second model in the process whose float attributes differ from the first's (an
        # RMSNorm eps at the same module path) would have them traced as dynamic inputs,
        # which the passes do not match and Inductor may refuse
        with (
            _bytecode_hook(bytecode_hook),
            torch._dynamo.config.patch(automatic_dynamic_shapes=False),
        ):
            output = traced(model, input_ids, positions)
    except torch._dynamo.exc.InternalTorchDynamoError:
        raise  # Dynamo's own failure, not the model's
    except torch._dynamo.exc.TorchDynamoException as e:
        raise InvalidInputError(
            f"{type(model).__name__} could not be traced as one graph: {_dynamo_reason(e)} "
            f"graphattn calls model(input_ids, positions) with 1-D token ids and positions and "
            f"needs one tensor back, traced whole (no data-dependent Python branches); "
            f"compile_backend='none' runs the model uncompiled"
        ) from e
    if "gm" not in captured:
        raise GraphAttnError(
            "torch.compile ran the model without tracing it (is TORCH_COMPILE_DISABLE set, or "
            "torch._dynamo disabled?); the piecewise compiler needs one Dynamo trace"
        )
    gm, inputs = captured["gm"], captured["inputs"]
    _check_single_tensor_output(model, output, captured["graph_output"], input_ids.shape[0])
    _check_each_layer_called_once(gm)
    binding = InputBinding(gm, inputs, input_ids, positions)
    signature = InputSignature.of(gm, inputs, input_ids, positions)
    seconds = time.perf_counter() - start
    codes = captured["code"]
    files = tuple(sorted({code.co_filename for code in codes}))
    return Trace(gm, binding, signature, output, seconds, codes, files)


def _dynamo_reason(error: Exception) -> str:
    """Dynamo's first line and, where it gives one, its explanation and the underlying
    error's message (a fake-tensor failure names the real one only in its cause)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    parts = lines[:1] + [line for line in lines[1:] if line.startswith("Explanation:")][:1]
    cause = error.__cause__
    if cause is not None and str(cause).strip():
        parts.append(f"({type(cause).__name__}: {str(cause).strip().splitlines()[0]})")
    return " ".join(parts) or type(error).__name__


def _check_each_layer_called_once(gm: fx.GraphModule) -> None:
    """A ``ga.Attention`` called twice in one forward overwrites its own keys and values."""
    seen: set[str] = set()
    for node in gm.graph.nodes:
        name = op_name(node.target) if node.op == "call_function" else None
        if name is None or name[0] != "graphattn::unified_attention_with_output":
            continue
        layer = node.args[4] if len(node.args) > 4 else node.kwargs.get("layer_name")
        if layer in seen:
            raise InvalidInputError(twice_called_message(layer))
        seen.add(layer)


class InputBinding:
    """Builds the traced graph's flat argument list from a step's ``(input_ids, positions)``.

    Every graph input is one of: a step input (by position), the size of a step input's
    dimension (a symbolic size input), or a value fixed at trace time (parameters,
    buffers, constants), bound once.
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        inputs: list[Any],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        step_nodes = _step_input_nodes(placeholders, inputs, (input_ids, positions))
        self.template = list(inputs)
        self.tensor_slots: list[tuple[int, int]] = []  # (graph input, step input)
        self.size_slots: list[tuple[int, int, int]] = []  # (graph input, step input, dim)
        for i, node in enumerate(placeholders):
            value = node.meta.get("example_value")
            if node in step_nodes:
                self.tensor_slots.append((i, step_nodes.index(node)))
                self.template[i] = None  # never hold the example tensors
            elif isinstance(value, torch.SymInt):
                self.size_slots.append((i, *_size_source(node, value, step_nodes)))
                self.template[i] = None
            else:
                _check_static(node, value)

    @classmethod
    def restore(
        cls,
        template: list[Any],
        tensor_slots: list[tuple[int, int]],
        size_slots: list[tuple[int, int, int]],
    ) -> InputBinding:
        """A binding from its parts (the trace cache saves them in place of a trace)."""
        binding = cls.__new__(cls)
        binding.template = list(template)
        binding.tensor_slots = [tuple(s) for s in tensor_slots]
        binding.size_slots = [tuple(s) for s in size_slots]
        return binding

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> list[Any]:
        steps = (input_ids, positions)
        args = self.template.copy()
        for i, source in self.tensor_slots:
            args[i] = steps[source]
        for i, source, dim in self.size_slots:
            args[i] = steps[source].shape[dim]
        return args


@dataclass(frozen=True)
class InputSignature:
    """What the traced graph assumes of a step's inputs; ``accepts`` checks it per call."""

    dtypes: tuple[torch.dtype, torch.dtype]
    device: torch.device
    same_length: bool  # the trace unified the two token dimensions

    @classmethod
    def of(cls, gm, inputs, input_ids, positions) -> InputSignature:
        return cls(
            (input_ids.dtype, positions.dtype),
            input_ids.device,
            _unified(gm, inputs, input_ids, positions),
        )

    def accepts(self, input_ids: torch.Tensor, positions: torch.Tensor) -> bool:
        return (
            input_ids.dim() == 1
            and positions.dim() == 1
            and input_ids.dtype == self.dtypes[0]
            and positions.dtype == self.dtypes[1]
            and input_ids.device == self.device
            and positions.device == self.device
            and (not self.same_length or input_ids.shape[0] == positions.shape[0])
        )

    def describe(self) -> str:
        length = "of one length T" if self.same_length else ""
        return (
            f"input_ids {self.dtypes[0]} [T] and positions {self.dtypes[1]} [T] on "
            f"{self.device} {length}".rstrip()
        )


def describe_inputs(input_ids: Any, positions: Any) -> str:
    def one(name: str, t: Any) -> str:
        if not isinstance(t, torch.Tensor):
            return f"{name} {type(t).__name__}"
        return f"{name} {t.dtype} {list(t.shape)} on {t.device}"

    return f"{one('input_ids', input_ids)} and {one('positions', positions)}"


# -- helpers ------------------------------------------------------------------------------


def _traced_code() -> tuple[types.CodeType, ...]:
    """The code objects the running Dynamo trace inlined; () where this torch does not
    record them (the trace cache is then not written).
    """
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    codes = getattr(context, "traced_code", None) if context is not None else None
    return tuple(dict.fromkeys(codes)) if codes else ()


def _size_source(
    node: fx.Node, value: torch.SymInt, step_nodes: list[fx.Node | None]
) -> tuple[int, int]:
    """(step input, dim) whose length a symbolic size input stands for."""
    expr = value.node.expr
    for k, tensor_node in enumerate(step_nodes):
        if tensor_node is None:
            continue
        for dim, size in enumerate(tensor_node.meta["example_value"].shape):
            if isinstance(size, torch.SymInt) and size.node.expr == expr:
                return k, dim
    raise GraphAttnError(
        f"the traced graph takes a size input {node.name} = {expr} that is not the length of "
        "input_ids or positions; only the token dimension may be dynamic"
    )


def _check_static(node: fx.Node, value: Any) -> None:
    """A graph input bound once must not have a dynamic size (it would go stale)."""
    shape = getattr(value, "shape", ())
    if any(isinstance(s, torch.SymInt) for s in shape):
        raise GraphAttnError(
            f"graph input {node.name} has the dynamic shape {list(shape)} but is neither "
            "input_ids nor positions; only the two step inputs may change size"
        )


def _step_input_nodes(
    placeholders: list[fx.Node], inputs: list[Any], steps: tuple[torch.Tensor, ...]
) -> list[fx.Node | None]:
    """The placeholders Dynamo bound to each step tensor (None where the graph ignores it)."""
    found: list[fx.Node | None] = [None] * len(steps)
    for node, value in zip(placeholders, inputs):
        for k, step in enumerate(steps):
            if value is step:
                found[k] = node
    return found


def _unified(gm: fx.GraphModule, inputs, input_ids, positions) -> bool:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ids_node, pos_node = _step_input_nodes(placeholders, inputs, (input_ids, positions))
    if ids_node is None or pos_node is None:
        return False
    a = ids_node.meta["example_value"].shape[0]
    b = pos_node.meta["example_value"].shape[0]
    return (
        isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and a.node.expr == b.node.expr
    )


def _placeholder_outputs(gm: fx.GraphModule, args: tuple[Any, ...]) -> list[Any]:
    """Uninitialised tensors shaped like the graph's outputs for this call's sizes (each
    symbolic size bound from the arguments), standing in for a run of the graph.
    """
    sizes: dict[Any, Any] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, arg in zip(placeholders, args):
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt):
            sizes[value.node.expr] = sympy.Integer(int(arg))
        elif isinstance(value, torch.Tensor):
            for size, actual in zip(value.shape, arg.shape):
                if isinstance(size, torch.SymInt):
                    sizes[size.node.expr] = sympy.Integer(actual)
    (outputs,) = (n.args[0] for n in gm.graph.nodes if n.op == "output")
    values = []
    for node in outputs if isinstance(outputs, (tuple, list)) else (outputs,):
        value = node.meta.get("example_value") if isinstance(node, fx.Node) else node
        if not isinstance(value, torch.Tensor):
            values.append(value)
            continue
        shape = [
            int(s.node.expr.xreplace(sizes)) if isinstance(s, torch.SymInt) else int(s)
            for s in value.shape
        ]
        values.append(torch.empty(shape, dtype=value.dtype, device=value.device))
    return values


def _check_single_tensor_output(
    model: torch.nn.Module, output: Any, graph_output: Any, num_tokens: int
) -> None:
    wrong = output_error(model, output, num_tokens)
    if wrong is not None:
        raise InvalidInputError(wrong)
    if not (
        isinstance(graph_output, (tuple, list))
        and len(graph_output) == 1
        and graph_output[0] is output
    ):
        raise InvalidInputError(
            f"graphattn compiles models whose {FORWARD} returns one tensor computed by the "
            f"graph; {type(model).__qualname__} returned one the graph did not compute (an "
            f"input or a tensor made outside the traced code)"
        )


@contextmanager
def _bytecode_hook(hook: Callable[[types.CodeType, types.CodeType], None] | None) -> Iterator[None]:
    if hook is None:
        yield
        return
    from torch._dynamo.convert_frame import register_bytecode_hook

    def observe(old: types.CodeType, new: types.CodeType) -> None:
        hook(old, new)  # returning None keeps Dynamo's bytecode

    handle = register_bytecode_hook(observe)
    try:
        yield
    finally:
        handle.remove()

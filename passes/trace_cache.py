"""The trace cache: a warm start that never runs Dynamo.

A warm start loads every compiled piece from the compile cache, but the Dynamo trace
before it runs in every process (seconds for a 16-layer model). Once a cold start has
built every piece, this cache saves what the runtime needs of its trace: the split graph
(its code and its pieces' code, without the trace's fake values), how a step's inputs
bind to the graph (parameters and buffers by their path in the model), what the graph
assumes of the inputs, each compiled piece's fingerprint (which names its builds in the
compile cache) and the compile cache's factors. A later start with the same key rebuilds
the runtime from the entry. A piece build missing from the compile cache sends the start
back to Dynamo (the entry's pieces have no shapes to compile from).

The key decides whether the entry's graph is still the model's graph, and a stale entry
would run code that no longer exists. It covers what the trace depends on that can be read
before tracing:

- the compile cache's factors without the model's sources (engine settings, passes,
  graphattn's compiler source, torch, Triton and Python versions);
- the model's state (``describe_model``): every module's class, its classes' own
  attributes, and its non-tensor attributes (what Dynamo guards on: eps, head counts,
  flags, config dataclasses, hooks), described by value through containers (dicts in
  their order), plain objects (``__dict__`` and ``__slots__``), dataclasses (fields and
  other attributes), modules held outside the module tree, functions (their code,
  defaults and closure cells) and bound methods (their object); every parameter's and
  buffer's name, shape, stride, dtype, device and tensor type; which names share one
  tensor (tied weights, a tensor shared by two layers);
- the trace inputs' dtypes, device and length; torch's default dtype and device, grad,
  inference and autocast state, function modes, global module hooks, and the Dynamo,
  functorch, FX and compiler configs.

A model holding a value the description cannot capture (nested too deep, or of no known
form: a lock, an extension object) gets no key, and the report says which attribute.

The entry also records what the trace read that only exists after tracing, taken right
after the trace: every source file it went through (the code objects Dynamo inlined, the
model classes and their bases) with a hash of its contents, torch's own files excepted;
and the values of the globals the traced code reads (``describe_globals``: a constant
imported from another file, a module attribute such as ``consts.SCALE``, a function by its
code, a value set from the environment at import). A load checks both; any change is a
miss. A trace through code with no file behind it (exec, a notebook cell) is not saved.
What the key cannot see: state read through torch or the standard library at trace time
(an environment variable read inside ``forward``), the result of a function marked
``assume_constant_result``, and state inside extension objects. Such a model needs
``trace_cache=False``. With ``debug=True`` every start traces anyway and compares the
traced graph with the entry's: a difference is reported and the entry replaced.

Entries are ``<cache_dir>/traces/<key>.bin``, written atomically with a checksum like the
compile cache's; the payload is a pickle, so the cache folder must be as trusted as
Inductor's own cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import importlib
import inspect
import json
import logging
import os
import pickle
import sys
import sysconfig
import types
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import fx, nn

from graphattn._logging import logger
from graphattn.passes.backend import InputBinding, InputSignature, Trace
from graphattn.passes.cache import file_digest, model_source_files, pack, unpack, write_atomic
from graphattn.passes.split import SplitGraph, split_graph_of

_MAGIC = b"GATRACE1"
FORMAT = 2
_DEPTH = 6  # nesting levels of an attribute's value described; deeper ones are opaque


@dataclass
class TraceEntry:
    """One saved trace (see the module docstring)."""

    factors: dict[str, Any]  # the compile cache's factors (its key hashes them)
    split: bytes  # the pickled split graph module, pieces included
    fingerprints: list[str]  # each compiled piece's graph fingerprint, in order
    binding: list[Any]  # per graph input: ["step", k] | ["size", k, dim] | ["tensor", path]
    #                     | ["value", v]
    signature: dict[str, Any]
    sources: dict[str, str]  # source file -> SHA-256 of its contents
    global_reads: dict[str, list[str]]  # module -> names the traced code reads from it
    globals: Any  # describe_globals(global_reads) at the trace


class TraceCache:
    """The trace entries of one cache folder."""

    def __init__(self, root: str) -> None:
        self.dir = os.path.join(root, "traces")
        os.makedirs(self.dir, exist_ok=True)

    def path(self, key: str) -> str:
        return os.path.join(self.dir, f"{key}.bin")

    def load(self, key: str) -> tuple[TraceEntry | None, str]:
        """The entry under ``key`` whose sources are unchanged, or None and why not."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            return None, "no entry"
        payload = unpack(blob, _MAGIC)
        if payload is None:
            return self._discard(path, "its checksum does not match (corrupt or half-written)")
        try:
            entry = pickle.loads(payload)
            if not isinstance(entry, TraceEntry):
                raise TypeError(f"a {type(entry).__name__}, not a TraceEntry")
        except Exception as e:  # an entry of another format or graphattn version
            return self._discard(path, f"it does not load ({type(e).__name__}: {e})")
        try:
            for source, digest in entry.sources.items():
                try:
                    if file_digest(source) != digest:
                        return None, f"{source} changed since the trace"
                except OSError:
                    return None, f"{source} is gone"
            now, why = describe_globals(entry.global_reads)
        except Exception as e:  # an entry this code cannot check: trace instead
            return None, f"its checks failed ({type(e).__name__}: {e})"
        if now is None:
            return None, why
        if now != entry.globals:
            return None, "a global the traced code reads changed since the trace"
        return entry, ""

    def store(self, key: str, entry: TraceEntry) -> str:
        """Write ``entry``; returns its path, or "" when it cannot be written."""
        try:
            write_atomic(self.path(key), pack(pickle.dumps(entry), _MAGIC))
        except Exception as e:  # full disk, read-only folder: the next start traces again
            logger.warning("trace cache: cannot save %s (%s: %s)", key, type(e).__name__, e)
            return ""
        return self.path(key)

    def _discard(self, path: str, why: str) -> tuple[None, str]:
        logger.warning("trace cache: %s: %s; tracing again", path, why)
        with contextlib.suppress(OSError):
            os.remove(path)
        return None, why


def trace_key(
    base_factors: dict[str, Any],
    model: nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[str, str]:
    """The trace cache key of ``model`` traced on these inputs (see the module docstring),
    or "" and why the model cannot have one: it holds a value ``describe_model`` cannot
    describe, so a change to it would go unseen.
    """
    describer = _Describer(model)
    factors = {
        "format": FORMAT,
        "compile": base_factors,
        "model": describer.model(),
        "inputs": [_tensor_meta(input_ids), _tensor_meta(positions)],
        "torch_state": _torch_state(describer),
    }
    if describer.opaque:
        shown = ", ".join(describer.opaque[:3])
        more = f" and {len(describer.opaque) - 3} more" if len(describer.opaque) > 3 else ""
        return "", f"the model holds values it cannot describe: {shown}{more}"
    text = json.dumps(factors, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32], ""


def describe_model(model: nn.Module) -> list[Any]:
    """Every module's path, class, non-tensor attributes, parameters and buffers, and which
    paths share one tensor, as JSON-able values that are equal in two processes exactly
    when these are (values it cannot describe appear as ``opaque <type>``).
    """
    return _Describer(model).model()


def trace_sources(trace: Trace, model: nn.Module) -> tuple[dict[str, Any] | None, str]:
    """What a later load checks, read right after the trace (before a compile long enough
    to edit files): each source file the trace went through or the model's classes come
    from, with the SHA-256 of its contents (torch's files excepted: its version is in the
    key), and the globals the traced code reads (``describe_globals``). None and why when
    the trace cannot be checked later: code with no file behind it (exec, a notebook cell),
    or a global the description cannot capture.
    """
    if not trace.traced_code:
        return None, "this torch does not say which code the trace inlined"
    files = set(trace.traced_files) | set(model_source_files(model, trace.graph_module))
    for module in model.modules():
        for cls in type(module).__mro__:
            with contextlib.suppress(TypeError, OSError):
                files.add(inspect.getsourcefile(cls))
    sources = {}
    for path in sorted(f for f in files if f):
        if _is_torch_file(path):
            continue
        try:
            sources[path] = file_digest(path)
        except OSError:
            return None, f"traced code from {path}, which is not a file that can be checked"
    reads = global_reads(trace.traced_code)
    described, why = describe_globals(reads)
    if described is None:
        return None, why
    return {"sources": sources, "global_reads": reads, "globals": described}, ""


def global_reads(codes: tuple[types.CodeType, ...]) -> dict[str, list[str]]:
    """For each module (torch's excepted) whose code the trace inlined, the names that code
    reads: its globals and attribute names (``co_names``, nested code included).
    """
    by_file = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str):
            by_file.setdefault(os.path.abspath(path), module)
    reads: dict[str, set[str]] = {}
    for code in codes:
        if _is_torch_file(code.co_filename):
            continue
        module = by_file.get(os.path.abspath(code.co_filename))
        if module is not None:
            reads.setdefault(module.__name__, set()).update(_names(code))
    return {name: sorted(names) for name, names in sorted(reads.items())}


def describe_globals(reads: dict[str, list[str]]) -> tuple[Any, str]:
    """The values of the globals ``reads`` names, as they are now: a constant from another
    file (``from consts import SCALE``), a module's attribute (``consts.SCALE``), a
    function's code, a value set at import from the environment. None and why when a
    module is not imported or a value cannot be described.
    """
    describer = _Describer(nn.Module())
    out = {}
    for module_name, names in reads.items():
        module = sys.modules.get(module_name)
        if module is None:
            return None, f"module {module_name} the traced code reads is not imported"
        values = vars(module)
        wanted = set(names)
        out[module_name] = {
            name: describer.global_value(values[name], f"{module_name}.{name}", wanted)
            for name in names
            if name in values and not name.startswith("__")
        }
    if describer.opaque:
        return None, f"the traced code reads globals it cannot describe: {describer.opaque[0]}"
    return out, ""


def make_entry(
    trace: Trace,
    split: SplitGraph,
    fingerprints: list[str],
    factors: dict[str, Any],
    model: nn.Module,
    checks: dict[str, Any],
) -> tuple[TraceEntry | None, str]:
    """The entry for a cold start's trace (``checks`` from ``trace_sources``), or None and
    why it cannot be saved.
    """
    binding, why = _binding_spec(trace.binding, model)
    if binding is None:
        return None, why
    try:
        blob = pickle_split(split)
    except Exception as e:  # a graph with a target pickle cannot name
        return None, f"the split graph does not pickle ({type(e).__name__}: {e})"
    signature = trace.signature
    return (
        TraceEntry(
            factors=factors,
            split=blob,
            fingerprints=list(fingerprints),
            binding=binding,
            signature={
                "dtypes": [str(d).removeprefix("torch.") for d in signature.dtypes],
                "device": str(signature.device),
                "same_length": signature.same_length,
            },
            sources=dict(checks["sources"]),
            global_reads=checks["global_reads"],
            globals=checks["globals"],
        ),
        "",
    )


def restore(
    entry: TraceEntry, model: nn.Module, splitting_ops: frozenset[str]
) -> tuple[InputBinding, InputSignature, SplitGraph]:
    """The binding, signature and split graph an entry saved, bound to ``model``'s tensors."""
    template, tensor_slots, size_slots = [], [], []
    for i, spec in enumerate(entry.binding):
        kind = spec[0]
        if kind == "step":
            tensor_slots.append((i, spec[1]))
        elif kind == "size":
            size_slots.append((i, spec[1], spec[2]))
        template.append(
            _resolve(model, spec[1]) if kind == "tensor" else spec[1] if kind == "value" else None
        )
    binding = InputBinding.restore(template, tensor_slots, size_slots)
    sig = entry.signature
    signature = InputSignature(
        tuple(getattr(torch, d) for d in sig["dtypes"]),
        torch.device(sig["device"]),
        sig["same_length"],
    )
    module = pickle.loads(entry.split)
    return binding, signature, split_graph_of(module, splitting_ops, template)


def same_graph(restored: SplitGraph, fresh: SplitGraph) -> bool:
    """Whether a restored split graph is a fresh trace's. The fresh one goes through the
    same pickle round trip first: unpickling re-traces a graph module's code, which
    rewrites some calls (defaults become keywords) without changing what they do.
    """
    again = pickle.loads(pickle_split(fresh))
    return _code(restored.module) == _code(again)


def _code(module: fx.GraphModule) -> list[str]:
    names = [n.target for n in module.graph.nodes if n.op == "call_module"]
    # the submodules themselves: a runtime installs its builds under the same names
    return [module.code] + [module._modules[name].code for name in names]


def pickle_split(split: SplitGraph) -> bytes:
    """Pickle the split graph without the builds a runtime installed in its ``__dict__``."""
    module = split.module
    installed = {
        p.name: module.__dict__.pop(p.name) for p in split.pieces if p.name in vars(module)
    }
    try:
        return pickle.dumps(module)
    finally:
        module.__dict__.update(installed)


# -- helpers ------------------------------------------------------------------------------


def _binding_spec(binding: InputBinding, model: nn.Module) -> tuple[list[Any] | None, str]:
    paths = _tensor_paths(model)
    steps = {i: k for i, k in binding.tensor_slots}
    sizes = {i: (k, dim) for i, k, dim in binding.size_slots}
    spec: list[Any] = []
    for i, value in enumerate(binding.template):
        if i in steps:
            spec.append(["step", steps[i]])
        elif i in sizes:
            spec.append(["size", *sizes[i]])
        elif isinstance(value, torch.Tensor):
            path = paths.get(id(value))
            if path is None:
                return None, (
                    f"graph input {i} ({_tensor_meta(value)}) is a tensor the model does not "
                    "hold as a parameter, buffer or attribute"
                )
            spec.append(["tensor", path])
        elif value is None or isinstance(value, (bool, int, float, str)):
            spec.append(["value", value])
        else:
            return None, f"graph input {i} is a {type(value).__name__}, not a tensor or number"
    return spec, ""


def _tensor_paths(model: nn.Module) -> dict[int, str]:
    """id of each tensor the model holds -> its dotted path (the first path found)."""
    paths: dict[int, str] = {}
    for path, value in _held_tensors(model):
        paths.setdefault(id(value), path)
    return paths


def _held_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) of every parameter and buffer, then every plain tensor attribute."""
    held = []
    modules = list(model.named_modules(remove_duplicate=False))
    for name, module in modules:
        prefix = f"{name}." if name else ""
        for kind in ("_parameters", "_buffers"):
            held += [(prefix + a, t) for a, t in getattr(module, kind).items() if t is not None]
    for name, module in modules:
        prefix = f"{name}." if name else ""
        held += [(prefix + a, t) for a, t in vars(module).items() if isinstance(t, torch.Tensor)]
    return held


def _resolve(model: nn.Module, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), model)


def _torch_state(describer: _Describer) -> dict[str, Any]:
    """Global torch state a trace reads: modes, defaults, global hooks, tracing configs."""
    state: dict[str, Any] = {
        "default_dtype": str(torch.get_default_dtype()),
        "default_device": str(getattr(torch, "get_default_device", lambda: None)()),
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "autocast": [
            [torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d))]
            for d in ("cpu", "cuda")
        ],
        "function_modes": [
            _qualname(type(m)) for m in torch.overrides._get_current_function_mode_stack()
        ],
    }
    from torch.nn.modules import module as module_globals

    hooks = [n for n in dir(module_globals) if n.startswith("_global_") and "hooks" in n]
    state["global_module_hooks"] = {}
    for name in hooks:
        value = getattr(module_globals, name)
        values = list(value.values()) if isinstance(value, dict) else value
        state["global_module_hooks"][name] = describer.value(values, name, 1)
    configs = [
        "torch._dynamo.config",
        "torch._functorch.config",
        "torch.fx.experimental._config",
        "torch.compiler.config",
    ]
    for name in configs:
        with contextlib.suppress(ImportError):  # torch.compiler.config is newer than 2.11?
            state[name] = config_description(name, describer)
    return state


def config_description(name: str, describer: _Describer | None = None) -> Any:
    """A torch config module's values that change compiled code, described so that two
    processes agree: its compile-ignored keys left out and, where the module has them, its
    cache-ignored prefixes (Inductor's hold the working directory and the CPU count). Its
    own ``get_hash()`` will not do: it reprs sets, whose order changes with each process's
    string hashing.
    """
    config = importlib.import_module(name)
    ignored = set(getattr(config, "_compile_ignored_keys", ()))
    prefixes = tuple(getattr(config, "_cache_config_ignore_prefix", ()))
    values = {
        k: v
        for k, v in config.get_config_copy().items()
        if k not in ignored and not (prefixes and k.startswith(prefixes))
    }
    describer = describer if describer is not None else _Describer(nn.Module())
    return describer.value(values, f"<{name}>", 0)


def _tensor_meta(t: torch.Tensor | None) -> str:
    if t is None:
        return "None"
    kind = {torch.Tensor: "tensor", nn.Parameter: "param"}.get(type(t), _qualname(type(t)))
    return f"{kind} {t.dtype} {list(t.shape)} {list(t.stride())} {t.device} {t.requires_grad}"


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _is_torch_file(path: str) -> bool:
    return os.path.abspath(path).startswith(_TORCH_DIR)


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
_SITE = tuple(os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("purelib", "platlib"))


def _is_library_module(module: types.ModuleType) -> bool:
    """torch, the standard library or a builtin module: its version covers its values."""
    path = getattr(module, "__file__", None)
    if not isinstance(path, str):
        return True  # builtin (sys, math) or a namespace package
    path = os.path.abspath(path)
    in_stdlib = path.startswith(_STDLIB) and not path.startswith(_SITE)
    return path.startswith(_TORCH_DIR) or in_stdlib


def _is_library_class(cls: type) -> bool:
    """A class of torch, numpy, the standard library or a builtin module."""
    module = sys.modules.get(cls.__module__)
    if cls.__module__.split(".")[0] in ("builtins", "torch", "numpy"):
        return True
    return module is None or _is_library_module(module)


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names ``code`` and the code nested in it read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def code_digest(code: types.CodeType) -> str:
    """SHA-256 of what a code object does: its bytecode, names and constants (nested code
    by its own digest, sets sorted), not its line numbers.
    """

    def const(c: Any) -> Any:
        if isinstance(c, types.CodeType):
            return code_digest(c)
        if isinstance(c, (frozenset, set)):
            return ["set", sorted(json.dumps(const(x)) for x in c)]
        if isinstance(c, tuple):
            return ["tuple", [const(x) for x in c]]
        return repr(c)

    parts = [code.co_code.hex(), list(code.co_names), [const(c) for c in code.co_consts]]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


class _Describer:
    """Describes a model and the values it holds as JSON-able data: exact for plain data,
    structural for containers, objects (their ``__dict__`` and ``__slots__``), dataclasses
    (fields and other attributes), functions (their code, defaults and closure cells) and
    bound methods (their object); a registered module by its path. What it cannot describe
    (past ``_DEPTH`` levels, or of no known form) is listed in ``opaque``, and a model
    with any has no trace cache key.
    """

    def __init__(self, model: nn.Module) -> None:
        self.root = model
        self.paths = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        self.opaque: list[str] = []
        self.read: set[str] = set()  # the attribute names the traced code reads (globals)

    def model(self) -> list[Any]:
        out = [
            self.module(m, name, 0) for name, m in self.root.named_modules(remove_duplicate=False)
        ]
        out.append(["aliases", self._aliases()])
        return out

    def module(self, module: nn.Module, path: str, depth: int) -> list[Any]:
        state = vars(module)
        # hook dicts are keyed by handle ids, a global counter: rank them per module instead
        handles = sorted(
            {k for a, v in state.items() if "hooks" in a and isinstance(v, dict) for k in v}
            - {None},
            key=repr,
        )
        rank = {h: i for i, h in enumerate(handles)}
        attrs = {}
        for attr, value in sorted(state.items()):
            if attr in ("_parameters", "_buffers", "_modules"):
                continue
            where = f"{path}.{attr}" if path else attr
            if "hooks" in attr and isinstance(value, dict):
                value = {rank.get(k, k): v for k, v in value.items()}
            attrs[attr] = self.value(value, where, depth)
        tensors = {
            kind: {k: _tensor_meta(t) for k, t in getattr(module, kind).items()}
            for kind in ("_parameters", "_buffers")
        }
        classes = [self._class(cls, path, depth) for cls in type(module).__mro__]
        return [path, _qualname(type(module)), attrs, tensors, [c for c in classes if c]]

    def global_value(self, value: Any, path: str, names: set[str]) -> Any:
        """A module global the traced code reads; of a module, the attributes in ``names``."""
        self.read = names
        if isinstance(value, types.ModuleType):
            return self._module_attrs(value, path, 0)
        return self.value(value, path, 0)

    def _module_attrs(self, module: types.ModuleType, path: str, depth: int) -> Any:
        """A module of the program's own by the attributes the traced code reads (``read``),
        so ``pkg.sub.SCALE`` is seen through ``pkg`` and ``sub``; a library module by name.
        """
        if _is_library_module(module):
            return f"module {module.__name__}"
        attrs = vars(module)
        read = sorted(n for n in self.read if n in attrs and not n.startswith("__"))
        return [
            "module",
            module.__name__,
            {n: self.value(attrs[n], f"{path}.{n}", depth + 1) for n in read},
        ]

    def value(self, value: Any, path: str, depth: int) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return repr(value)
        if isinstance(value, bytes):
            return f"bytes:{hashlib.sha256(value).hexdigest()[:16]}"
        if isinstance(value, enum.Enum):  # its value too: code may read member.value
            member = f"{_qualname(type(value))}.{value.name}"
            return [member, self.value(value.value, f"{path}.value", depth + 1)]
        if isinstance(value, (torch.dtype, torch.device, torch.Size, torch.memory_format)):
            return f"{type(value).__name__}:{value}"
        if isinstance(value, torch.Tensor):
            return _tensor_meta(value)
        if isinstance(value, np.ndarray):
            digest = hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()[:16]
            return f"ndarray {value.dtype} {list(value.shape)} {digest}"
        if isinstance(value, (np.generic,)):
            return f"{type(value).__name__}:{value!r}"
        if isinstance(value, nn.Module) and id(value) in self.paths:
            return f"module at {self.paths[id(value)]!r}"  # described in its own entry
        if isinstance(value, type):  # a class of the program's own: with its constants
            own = depth < _DEPTH and not _is_library_class(value)
            described = self._class_data(value, path, depth) if own else None
            return ["class", described] if described else f"class {_qualname(value)}"
        if isinstance(value, types.ModuleType):
            if depth >= _DEPTH:
                return f"module {value.__name__}"
            return self._module_attrs(value, path, depth)
        if isinstance(value, logging.Logger):
            return f"logger {value.name}"
        if type(value).__module__ == "typing":  # typing.Any, Optional[...]: annotations
            return f"typing {value!r}"
        if depth >= _DEPTH:
            return self._opaque(value, path, "nested too deep")
        inner = depth + 1
        if isinstance(value, nn.Module):  # held outside the module tree
            return ["module", self.module(value, path, inner)]
        if isinstance(value, functools.partial):
            parts = [value.func, value.args, value.keywords]
            return ["partial", self.value(parts, path, inner)]
        if isinstance(value, (classmethod, staticmethod)):
            return [type(value).__name__, self.value(value.__func__, path, inner)]
        if isinstance(value, property):
            parts = [value.fget, value.fset]
            return ["property", self.value(parts, path, inner)]
        if isinstance(value, types.MethodType):
            func = self.value(value.__func__, path, inner)
            return ["method", func, self.value(value.__self__, f"{path}.__self__", inner)]
        if isinstance(value, types.FunctionType):
            cells = [c.cell_contents for c in value.__closure__ or () if _filled(c)]
            parts = [value.__defaults__, value.__kwdefaults__, cells]
            code = code_digest(value.__code__)
            return ["function", _qualname(value), code, self.value(parts, path, inner)]
        if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType)):
            owner = getattr(value, "__self__", None)
            if owner is None or isinstance(owner, types.ModuleType):
                return f"builtin {_qualname(value)}"
            return ["builtin method", value.__name__, self.value(owner, path, inner)]
        if isinstance(value, (list, tuple)):
            items = [self.value(v, f"{path}[{i}]", inner) for i, v in enumerate(value)]
            return [type(value).__name__, items]
        if isinstance(value, (set, frozenset)):
            items = (json.dumps(self.value(v, f"{path}{{}}", inner)) for v in value)
            return ["set", sorted(items)]
        if isinstance(value, dict):  # in insertion order: code may iterate it
            items = [
                [self.value(k, path, inner), self.value(v, f"{path}[{k!r}]", inner)]
                for k, v in value.items()
            ]
            return ["dict", items]
        attrs = self._attributes(value)
        if attrs is None:
            return self._opaque(value, path, "no known form")
        described = {k: self.value(v, f"{path}.{k}", inner) for k, v in attrs.items()}
        # what the object reads from its class (``self.cfg.scale`` set on the class)
        classes = [
            self._class_data(cls, path, inner)
            for cls in type(value).__mro__
            if not _is_library_class(cls)
        ]
        return [_qualname(type(value)), described, [c for c in classes if c]]

    def _attributes(self, value: Any) -> dict[str, Any] | None:
        """An object's state: dataclass fields, ``__slots__`` and ``__dict__``; None for an
        object with none of them (an extension type: a lock, a generator).
        """
        attrs: dict[str, Any] = {}
        found = False
        if dataclasses.is_dataclass(value):
            found = True
            for f in dataclasses.fields(value):
                attrs[f.name] = getattr(value, f.name, _UNSET)
        for cls in type(value).__mro__:
            slots = vars(cls).get("__slots__", ())
            for slot in (slots,) if isinstance(slots, str) else slots:
                if slot not in ("__dict__", "__weakref__"):
                    found = True
                    attrs.setdefault(slot, getattr(value, slot, _UNSET))
        if hasattr(value, "__dict__"):
            found = True
            for k, v in sorted(vars(value).items()):
                attrs.setdefault(k, v)
        return attrs if found else None

    def _class(self, cls: type, path: str, depth: int) -> list[Any] | None:
        """A module class's own attributes (not torch's or object's): class constants the
        code reads and methods a program may have replaced at run time.
        """
        if cls is object or cls.__module__.startswith("torch"):
            return None
        attrs = {
            k: self.value(v, f"{path}<{cls.__name__}>.{k}", depth + 1)
            for k, v in vars(cls).items()
            if not (k.startswith("__") and k.endswith("__")) and k != "_abc_impl"
        }
        return [_qualname(cls), attrs]

    def _class_data(self, cls: type, path: str, depth: int) -> list[Any] | None:
        """A class's own data attributes (constants such as ``Consts.SCALE``), not its
        methods or properties: their code is in the source files the trace's checks hash.
        """
        code = (types.FunctionType, property, classmethod, staticmethod, functools.cached_property)
        attrs = {
            k: self.value(v, f"{path}<{cls.__name__}>.{k}", depth + 1)
            for k, v in vars(cls).items()
            if not (k.startswith("__") and k.endswith("__"))
            and k != "_abc_impl"
            and not isinstance(v, (*code, type))
        }
        return [_qualname(cls), attrs] if attrs else None

    def _opaque(self, value: Any, path: str, why: str) -> str:
        self.opaque.append(f"{path or '<model>'} ({type(value).__name__}: {why})")
        return f"opaque {_qualname(type(value))}"

    def _aliases(self) -> list[list[str]]:
        """[path, first path] for every tensor the model holds under more than one path
        (tied weights, a tensor shared by two layers): the trace binds one graph input to
        all of them.
        """
        first: dict[int, str] = {}
        aliases = []
        for path, t in _held_tensors(self.root):
            if id(t) in first:
                aliases.append([path, first[id(t)]])
            else:
                first[id(t)] = path
        return aliases


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET = _Unset()


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True

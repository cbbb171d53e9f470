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
- the model's state: every module's class and non-tensor attributes (what Dynamo guards
  on: eps, head counts, flags, config dataclasses, hooks), every parameter's and buffer's
  name, shape, stride, dtype and device (``describe_model``);
- the trace inputs' dtypes, device and length; torch's default dtype, grad, inference and
  autocast state; Dynamo's config.

The entry lists every source file the trace went through (the code objects Dynamo inlined,
the module classes' files), with a hash of each file's contents, torch's and the standard
library's excepted (their versions are in the key). A load hashes them again; a file that
changed or is gone is a miss. What the key cannot see: a global of the model's code that
changes at run time without its file changing, or an attribute holding an object that
``describe_model`` reduces to its type beyond three levels of nesting. Such a model needs
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
import json
import os
import pickle
import sysconfig
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphattn._logging import logger
from graphattn.passes.backend import InputBinding, InputSignature, Trace
from graphattn.passes.cache import file_digest, pack, unpack, write_atomic
from graphattn.passes.split import SplitGraph, split_graph_of

_MAGIC = b"GATRACE1"
FORMAT = 1
_DEPTH = 3  # nesting levels of an attribute's value described before only its type is


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
        for source, digest in entry.sources.items():
            try:
                if file_digest(source) != digest:
                    return None, f"{source} changed since the trace"
            except OSError:
                return None, f"{source} is gone"
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
) -> str:
    """The trace cache key of ``model`` traced on these inputs (see the module docstring)."""
    factors = {
        "format": FORMAT,
        "compile": base_factors,
        "model": describe_model(model),
        "inputs": [_tensor_meta(input_ids), _tensor_meta(positions)],
        "torch_state": _torch_state(),
    }
    text = json.dumps(factors, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def describe_model(model: nn.Module) -> list[Any]:
    """Every module's path, class, non-tensor attributes, parameters and buffers, as JSON-able
    values that are equal in two processes exactly when these are.
    """
    out = []
    for name, module in model.named_modules(remove_duplicate=False):
        attrs = {}
        for attr, value in sorted(vars(module).items()):
            if attr in ("_parameters", "_buffers", "_modules"):
                continue
            if "hooks" in attr and isinstance(value, dict):  # handle ids are not the hook
                attrs[attr] = [_describe(v, 1) for v in value.values()]
            else:
                attrs[attr] = _describe(value, 0)
        tensors = {
            kind: {k: _tensor_meta(t) for k, t in getattr(module, kind).items()}
            for kind in ("_parameters", "_buffers")
        }
        out.append([name, _qualname(type(module)), attrs, tensors])
    return out


def make_entry(
    trace: Trace,
    split: SplitGraph,
    fingerprints: list[str],
    factors: dict[str, Any],
    model: nn.Module,
    source_files: list[str],
) -> tuple[TraceEntry | None, str]:
    """The entry for a cold start's trace, or None and why it cannot be saved."""
    if not trace.traced_files:
        return None, "this torch does not say which code the trace inlined"
    binding, why = _binding_spec(trace.binding, model)
    if binding is None:
        return None, why
    try:
        blob = _pickle_split(split)
    except Exception as e:  # a graph with a target pickle cannot name
        return None, f"the split graph does not pickle ({type(e).__name__}: {e})"
    signature = trace.signature
    sources = {}
    for path in sorted(set(trace.traced_files) | set(source_files)):
        if _outside_key(path):
            with contextlib.suppress(OSError):  # "<string>" and the like are no files
                sources[path] = file_digest(path)
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
            sources=sources,
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
    return binding, signature, split_graph_of(module, splitting_ops)


def graph_code(split: SplitGraph) -> list[str]:
    """The split graph's code and each piece's: what ``debug`` compares with a fresh trace."""
    return [split.module.code] + [p.module.code for p in split.pieces]


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
    for name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{name}." if name else ""
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                paths.setdefault(id(value), prefix + attr)
        for kind in ("_parameters", "_buffers"):
            for attr, value in getattr(module, kind).items():
                if value is not None:
                    paths.setdefault(id(value), prefix + attr)
    return paths


def _resolve(model: nn.Module, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), model)


def _pickle_split(split: SplitGraph) -> bytes:
    """Pickle the split graph without the builds a runtime installed in its ``__dict__``."""
    module = split.module
    installed = {
        p.name: module.__dict__.pop(p.name) for p in split.pieces if p.name in vars(module)
    }
    try:
        return pickle.dumps(module)
    finally:
        module.__dict__.update(installed)


def _outside_key(path: str) -> bool:
    """A source file the key's versions do not already cover (not torch's or the stdlib's)."""
    path = os.path.abspath(path)
    covered = (os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"])
    return os.path.isfile(path) and not any(path.startswith(c + os.sep) for c in covered)


def _torch_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "default_dtype": str(torch.get_default_dtype()),
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "autocast": [torch.is_autocast_enabled(d) for d in ("cpu", "cuda")],
    }
    # Dynamo's own get_hash() reprs its sets, whose order changes with each process's
    # string hashing; the description sorts them
    config = torch._dynamo.config
    ignored = getattr(config, "_compile_ignored_keys", set())
    values = {k: v for k, v in config.get_config_copy().items() if k not in ignored}
    state["dynamo_config"] = _describe(values, 0)
    return state


def _tensor_meta(t: torch.Tensor | None) -> str:
    if t is None:
        return "None"
    kind = "param" if isinstance(t, nn.Parameter) else "tensor"
    return f"{kind} {t.dtype} {list(t.shape)} {list(t.stride())} {t.device} {t.requires_grad}"


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _describe(value: Any, depth: int) -> Any:
    """A JSON-able description of an attribute value: exact for plain data, structural for
    containers and objects, the type alone past ``_DEPTH`` levels.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, bytes):
        return f"bytes:{hashlib.sha256(value).hexdigest()[:16]}"
    if isinstance(value, enum.Enum):
        return f"{_qualname(type(value))}.{value.name}"
    if isinstance(value, (torch.dtype, torch.device, torch.Size)):
        return f"{type(value).__name__}:{value}"
    if isinstance(value, torch.Tensor):
        return _tensor_meta(value)
    if isinstance(value, nn.Module):  # a submodule has its own entry
        return f"module {_qualname(type(value))}"
    if isinstance(value, functools.partial):
        parts = [value.func, value.args, value.keywords]
        return ["partial", _describe(parts, depth)]
    if isinstance(value, type) or (callable(value) and hasattr(value, "__qualname__")):
        return f"callable {_qualname(value)}"
    if depth >= _DEPTH:
        return f"object {_qualname(type(value))}"
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [_describe(v, depth + 1) for v in value]]
    if isinstance(value, (set, frozenset)):
        return ["set", sorted(json.dumps(_describe(v, depth + 1)) for v in value)]
    if isinstance(value, dict):
        items = [[_describe(k, depth + 1), _describe(v, depth + 1)] for k, v in value.items()]
        return ["dict", sorted(items, key=json.dumps)]
    if dataclasses.is_dataclass(value):
        fields = {
            f.name: _describe(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)
        }
        return [_qualname(type(value)), fields]
    if hasattr(value, "__dict__"):
        attrs = {k: _describe(v, depth + 1) for k, v in sorted(vars(value).items())}
        return [_qualname(type(value)), attrs]
    return f"object {_qualname(type(value))}"

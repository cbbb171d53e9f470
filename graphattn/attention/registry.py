"""Backend registry and selection: backends in priority order per device, with every rejection kept."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from graphattn.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSelectorConfig,
)
from graphattn.errors import BackendError, BackendSelectionError

_BACKENDS: dict[str, type[AttentionBackend]] = {}
_PRIORITY: dict[str, dict[str, int]] = {}  # device type -> {backend name: priority}


def register_backend(
    backend: type[AttentionBackend], priority: Mapping[str, int], *, replace: bool = False
) -> type[AttentionBackend]:
    """Make ``backend`` selectable; ``priority`` maps a device type to its rank (higher first).

    A backend may be registered for devices it only sometimes serves (its
    ``validate_configuration`` says when not). Names are case-insensitive; re-registering a
    name needs ``replace=True``, and a built-in's name (TORCH_REF, TRITON) takes only its own
    class (with new priorities). A malformed backend or priority is a ``BackendError`` and
    leaves the registry as it was.
    """
    _ensure_builtins()
    name = _checked_name(backend)
    _check_cache_write(backend, name)
    _check_builder_and_block_sizes(backend, name)
    ranks = _checked_priority(name, priority)
    key = name.upper()
    if key in _BACKENDS and _BACKENDS[key] is not backend and _is_builtin(_BACKENDS[key]):
        # replacing one would run the user's class under the built-in's name in every report
        raise BackendError(
            f"{key} is a built-in attention backend ({_BACKENDS[key].full_cls_name()}); "
            f"register {backend.full_cls_name()} under a name of its own (get_name()) and "
            "select it by that name, or rank it above the built-in with its priority"
        )
    if key in _BACKENDS and _BACKENDS[key] is not backend and not replace:
        raise BackendError(
            f"an attention backend named {_BACKENDS[key].get_name()!r} is already registered "
            f"({_BACKENDS[key].full_cls_name()}); pass replace=True to replace it"
        )
    _BACKENDS[key] = backend
    for device_ranks in _PRIORITY.values():
        device_ranks.pop(key, None)
    for device_type, rank in ranks.items():
        _PRIORITY.setdefault(device_type, {})[key] = rank
    return backend


def _checked_name(backend: object) -> str:
    if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
        raise BackendError(f"expected an AttentionBackend subclass, got {backend!r}")
    if inspect.isabstract(backend):
        missing = sorted(backend.__abstractmethods__)
        raise BackendError(f"{backend.__qualname__} does not implement {missing}")
    name = backend.get_name()
    if not isinstance(name, str) or not name:
        raise BackendError(f"{backend.__qualname__}.get_name() must return a name, got {name!r}")
    return name


def _check_cache_write(backend: type[AttentionBackend], name: str) -> None:
    """The impl writes the KV cache where the flag says: inside ``forward`` (True, the
    default), or in ``do_kv_cache_update``, which the engine then calls first (False). A
    mismatch would leave the cache unwritten (attention reads zeros) or fail at the first step.
    """
    impl = backend.get_impl_cls()
    if not (isinstance(impl, type) and issubclass(impl, AttentionImpl)):
        raise BackendError(
            f"{name}.get_impl_cls() must return an AttentionImpl subclass, got {impl!r}"
        )
    flag = backend.forward_includes_kv_cache_update
    if not isinstance(flag, bool):
        raise BackendError(
            f"{name}.forward_includes_kv_cache_update must be True or False, got {flag!r}"
        )
    writes_apart = impl.do_kv_cache_update is not AttentionImpl.do_kv_cache_update
    if flag and writes_apart:
        raise BackendError(
            f"{impl.__qualname__} defines do_kv_cache_update, but {name}."
            "forward_includes_kv_cache_update is True (the default), so the engine never calls "
            "it: set it to False when do_kv_cache_update writes the cache"
        )
    if not flag and not writes_apart:
        raise BackendError(
            f"{name}.forward_includes_kv_cache_update is False, so the engine calls "
            f"do_kv_cache_update before attention, but {impl.__qualname__} does not define it"
        )


def _check_builder_and_block_sizes(backend: type[AttentionBackend], name: str) -> None:
    """What the engine calls on a backend at start-up answers in the types it expects, so a
    slip is named here rather than as a TypeError inside ``ga.compile``."""
    builder = backend.get_builder_cls()
    if not (isinstance(builder, type) and issubclass(builder, AttentionMetadataBuilder)):
        raise BackendError(
            f"{name}.get_builder_cls() must return an AttentionMetadataBuilder subclass, got "
            f"{builder!r}"
        )
    for attr, kind, example in (
        ("supported_dtypes", torch.dtype, "(torch.float16, torch.bfloat16)"),
        ("supported_devices", str, '("cuda", "cpu")'),
    ):
        value = getattr(backend, attr)
        if not isinstance(value, (tuple, list, frozenset, set)) or not all(
            isinstance(v, kind) for v in value
        ):
            # a bare dtype fails in `in`; a bare "cpu" would answer by substring
            raise BackendError(
                f"{name}.{attr} must be a tuple of {kind.__name__}, e.g. {example}, got {value!r}"
            )
    sizes = backend.get_supported_kernel_block_sizes()
    if not isinstance(sizes, (tuple, list)) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes
    ):
        raise BackendError(
            f"{name}.get_supported_kernel_block_sizes() must return a tuple of positive ints "
            f"(empty for any block size), got {sizes!r}"
        )


def _checked_priority(name: str, priority: object) -> dict[str, int]:
    if not isinstance(priority, Mapping):
        raise BackendError(
            f"the priority of {name} must map device types to ranks, e.g. {{'cuda': 10}}, "
            f"got {priority!r}"
        )
    for device_type, rank in priority.items():
        try:
            parsed = torch.device(device_type).type if isinstance(device_type, str) else None
        except RuntimeError:
            parsed = None
        if parsed != device_type:
            raise BackendError(
                f"the priority of {name} names {device_type!r}, not a torch device type "
                "(cpu, cuda, ...)"
            )
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise BackendError(
                f"the priority of {name} on {device_type} must be an int, got {rank!r}"
            )
    return dict(priority)


def registered_backends() -> dict[str, type[AttentionBackend]]:
    _ensure_builtins()
    return dict(_BACKENDS)


def get_backend(name: str) -> type[AttentionBackend]:
    """The backend registered as ``name`` (case-insensitive)."""
    _ensure_builtins()
    if not isinstance(name, str):
        raise BackendSelectionError(f"a backend name must be a str, got {name!r}")
    key = name.upper()
    if key not in _BACKENDS:
        raise BackendSelectionError(
            f"unknown attention backend {name!r}; registered: {sorted(_BACKENDS)}"
        )
    return _BACKENDS[key]


def candidates(device_type: str) -> list[type[AttentionBackend]]:
    """Backends registered for ``device_type``, highest priority first."""
    _ensure_builtins()
    ranks = _PRIORITY.get(device_type, {})
    return [_BACKENDS[n] for n in sorted(ranks, key=lambda n: -ranks[n])]


@dataclass(frozen=True)
class Selection:
    """The chosen backend and the reasons each better-ranked candidate was passed over."""

    backend: type[AttentionBackend]
    rejected: dict[str, list[str]] = field(default_factory=dict)
    explicit: bool = False


def select_backend(cfg: AttentionSelectorConfig, requested: str | None = None) -> Selection:
    """The backend for one layer: ``requested`` if named (its reasons are an error), else the
    first candidate for the device whose ``validate_configuration`` is empty. Backends of the
    other kind (MLA for a plain layer, plain for an MLA one) are not candidates at all.
    """
    if requested is not None:
        backend = get_backend(requested)
        if backend.is_mla() != cfg.use_mla:  # whatever its validate_configuration says
            kind = sorted(n for n, b in _BACKENDS.items() if b.is_mla() == cfg.use_mla)
            raise BackendSelectionError(
                f"attention backend {backend.get_name()} was requested for {_describe(cfg)}, "
                + (
                    "but it is not an MLA backend (is_mla() is False); an MLA layer needs one"
                    if cfg.use_mla
                    else "but it is an MLA backend, which serves only ga.MLAAttention layers"
                )
                + f" (of this layer's kind: {', '.join(kind)}). attention_backend= names one "
                "backend for every layer: a model with both kinds names them on each layer "
                "(backend=) or leaves them to selection"
            )
        reasons = _reasons(backend, cfg)
        if reasons:
            raise BackendSelectionError(
                f"attention backend {backend.get_name()} was requested but cannot serve "
                f"{_describe(cfg)}: {'; '.join(reasons)}"
            )
        return Selection(backend, {}, explicit=True)
    rejected: dict[str, list[str]] = {}
    for backend in candidates(cfg.device_type):
        if backend.is_mla() != cfg.use_mla:
            continue
        reasons = _reasons(backend, cfg)
        if not reasons:
            return Selection(backend, rejected)
        rejected[backend.get_name()] = reasons
    listing = "\n".join(f"  {n}: {'; '.join(r)}" for n, r in rejected.items()) or "  (none)"
    kind = "MLA backends" if cfg.use_mla else "Candidates"
    raise BackendSelectionError(
        f"no attention backend can serve {_describe(cfg)}. {kind} for {cfg.device_type}:\n{listing}"
    )


def _reasons(backend: type[AttentionBackend], cfg: AttentionSelectorConfig) -> list[str]:
    """``backend.validate_configuration(cfg)``, which must be a list of reasons (empty: it
    serves ``cfg``); anything else would read as a yes or as reasons letter by letter."""
    reasons = backend.validate_configuration(cfg)
    if not isinstance(reasons, (list, tuple)) or not all(isinstance(r, str) for r in reasons):
        raise BackendError(
            f"{backend.get_name()}.validate_configuration must return a list of reasons "
            f"(str; empty when it serves the layer), got {reasons!r}"
        )
    return list(reasons)


def _describe(cfg: AttentionSelectorConfig) -> str:
    extra = f", sliding_window={cfg.sliding_window}" if cfg.sliding_window else ""
    extra += " (an MLA layer)" if cfg.use_mla else ""
    return (
        f"head_size={cfg.head_size}, heads={cfg.num_heads}/{cfg.num_kv_heads}, "
        f"dtype={cfg.dtype}, kv_cache_dtype={cfg.kv_cache_dtype}, "
        f"block_size={cfg.block_size}, device={cfg.device_type}{extra}"
    )


def _is_builtin(backend: type[AttentionBackend]) -> bool:
    return backend.__module__.startswith(_BUILTIN_PACKAGE)


_BUILTIN_PACKAGE = "graphattn.attention.backends."


def _ensure_builtins() -> None:
    # The built-in backends register themselves on import; importing here (not at module
    # top) keeps registry -> backends from becoming an import cycle.
    import graphattn.attention.backends  # noqa: F401

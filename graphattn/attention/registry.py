"""Backend registry and selection: backends in priority order per device, with every rejection kept."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from graphattn.attention.backend import AttentionBackend, AttentionSelectorConfig
from graphattn.errors import BackendSelectionError

_BACKENDS: dict[str, type[AttentionBackend]] = {}
_PRIORITY: dict[str, dict[str, int]] = {}  # device type -> {backend name: priority}


def register_backend(
    backend: type[AttentionBackend], priority: Mapping[str, int], *, replace: bool = False
) -> type[AttentionBackend]:
    """Make ``backend`` selectable; ``priority`` maps a device type to its rank (higher first).

    A backend may be registered for devices it only sometimes serves (its
    ``validate_configuration`` says when not). Re-registering a name needs ``replace=True``.
    """
    name = backend.get_name()
    if name in _BACKENDS and _BACKENDS[name] is not backend and not replace:
        raise ValueError(
            f"an attention backend named {name!r} is already registered "
            f"({_BACKENDS[name].full_cls_name()}); pass replace=True to replace it"
        )
    _BACKENDS[name] = backend
    for ranks in _PRIORITY.values():
        ranks.pop(name, None)
    for device_type, rank in priority.items():
        _PRIORITY.setdefault(device_type, {})[name] = rank
    return backend


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
    first candidate for the device whose ``validate_configuration`` is empty.
    """
    if requested is not None:
        backend = get_backend(requested)
        reasons = backend.validate_configuration(cfg)
        if reasons:
            raise BackendSelectionError(
                f"attention backend {backend.get_name()} was requested but cannot serve "
                f"{_describe(cfg)}: {'; '.join(reasons)}"
            )
        return Selection(backend, {}, explicit=True)
    rejected: dict[str, list[str]] = {}
    for backend in candidates(cfg.device_type):
        reasons = backend.validate_configuration(cfg)
        if not reasons:
            return Selection(backend, rejected)
        rejected[backend.get_name()] = reasons
    listing = "\n".join(f"  {n}: {'; '.join(r)}" for n, r in rejected.items()) or "  (none)"
    raise BackendSelectionError(
        f"no attention backend can serve {_describe(cfg)}. Candidates for "
        f"{cfg.device_type}:\n{listing}"
    )


def _describe(cfg: AttentionSelectorConfig) -> str:
    extra = f", sliding_window={cfg.sliding_window}" if cfg.sliding_window else ""
    return (
        f"head_size={cfg.head_size}, heads={cfg.num_heads}/{cfg.num_kv_heads}, "
        f"dtype={cfg.dtype}, kv_cache_dtype={cfg.kv_cache_dtype}, "
        f"block_size={cfg.block_size}, device={cfg.device_type}{extra}"
    )


def _ensure_builtins() -> None:
    # The built-in backends register themselves on import; importing here (not at module
    # top) keeps registry -> backends from becoming an import cycle.
    import graphattn.attention.backends  # noqa: F401

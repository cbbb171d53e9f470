"""What start-up decided, for a person (``str(report)``) and for a program (``report.to_dict()``)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LayerInfo:
    """The backend one attention layer got, and how."""

    name: str
    backend: str
    group_id: int
    selected_by: str  # "auto", "layer" (Attention(backend=...)) or "config" (attention_backend=...)
    passed_over: dict[str, list[str]] = field(default_factory=dict)  # better-ranked, with reasons


@dataclass(frozen=True)
class GroupInfo:
    """One attention group: one builder, one metadata object per step."""

    group_id: int
    backend: str
    kv_cache_group: int
    spec: str
    num_heads: int
    kernel_block_size: int
    layers: list[str]
    cudagraph_support: str


@dataclass
class Report:
    """Start-up decisions of one engine. Fallbacks are every downgrade of the requested mode."""

    device: str
    dtype: str
    requested_mode: str
    resolved_mode: str
    layers: list[LayerInfo]
    groups: list[GroupInfo]
    fallbacks: list[Any] = field(default_factory=list)
    kv_cache: dict[str, Any] = field(default_factory=dict)
    compile: dict[str, Any] = field(default_factory=dict)
    capture: dict[str, Any] = field(default_factory=dict)
    kernels: dict[str, Any] = field(default_factory=dict)  # how graphattn's kernels launch
    startup_seconds: float = 0.0
    # off CUDA, what the requested mode would resolve to on a CUDA device (None on CUDA)
    mode_on_cuda: str | None = None
    # the query tokens of each request in the batches full decode graphs serve
    uniform_decode_query_len: int = 1

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)

    def __str__(self) -> str:
        lines = [
            f"cudagraph mode: requested {self.requested_mode} -> resolved {self.resolved_mode}",
            f"device: {self.device} ({self.dtype}); start-up {self.startup_seconds:.2f} s",
        ]
        if self.mode_on_cuda is not None:
            lines.append(f"on a CUDA device: {self.mode_on_cuda}")
        if self.uniform_decode_query_len > 1:
            lines.append(
                f"decode graphs serve batches of {self.uniform_decode_query_len} tokens a "
                "request (uniform_decode_query_len: speculative decoding's verify steps)"
            )
        lines += (
            ["fallbacks:"] + [f"  - {f}" for f in self.fallbacks]
            if self.fallbacks
            else ["fallbacks: none"]
        )
        lines.append("attention groups:")
        lines += _table(
            [
                "group",
                "backend",
                "kv group",
                "spec",
                "heads",
                "kernel block",
                "layers",
                "cudagraph support",
            ],
            [
                [
                    g.group_id,
                    g.backend,
                    g.kv_cache_group,
                    g.spec,
                    g.num_heads,
                    g.kernel_block_size,
                    _span(g.layers),
                    g.cudagraph_support,
                ]
                for g in self.groups
            ],
        )
        lines.append("layers:")
        lines += _table(
            ["layer", "backend", "group", "selected by", "passed over"],
            [
                [x.name, x.backend, x.group_id, x.selected_by, _passed(x.passed_over)]
                for x in self.layers
            ],
        )
        for title, section in (
            ("kv cache", self.kv_cache),
            ("compile", self.compile),
            ("capture", self.capture),
            ("kernels", self.kernels),
        ):
            if section:
                lines.append(f"{title}: " + ", ".join(f"{k}={_fmt(v)}" for k, v in section.items()))
        return "\n".join(lines)


@dataclass
class EngineStats:
    """Counters of what steps did; per-step fallbacks are counted here, never printed."""

    steps: int = 0
    tokens: int = 0
    runtime_modes: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)  # reason -> steps
    recompiles: int = 0
    # graphs captured after start-up, or asked for then and refused with a CaptureError
    captures_after_startup: int = 0

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)


def _span(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{len(names)}: {names[0]} .. {names[-1]}"


def _passed(passed_over: dict[str, list[str]]) -> str:
    return "; ".join(f"{n} ({', '.join(r)})" for n, r in passed_over.items()) or "-"


def _fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # field by field: dataclasses.asdict rebuilds a Counter from its (key, count) pairs,
        # counting each pair once
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)

"""The CUDA-graph wrapper: capture a callable once per batch key, replay it after.

One ``CaptureState`` per engine holds the memory pool every graph shares, the capture
stream, and whether capture is still open (only during start-up). A wrapper acts only when
the forward context's runtime mode is its own (FULL for the whole-model wrapper, PIECEWISE
for the wrappers around compiled pieces); otherwise it calls straight through.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import torch

from graphattn.attention.forward_context import get_forward_context
from graphattn.capture.mode import CUDAGraphMode
from graphattn.errors import CaptureError


class CaptureState:
    """What every graph of one engine shares: the pool, the stream, the capture window."""

    def __init__(self, device: torch.device, *, debug: bool = False) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self.debug = debug
        self.open = False  # capture allowed (start-up only)
        self.num_graphs = 0
        self.refused = 0  # captures asked for after start-up (each raised a CaptureError)
        self.watched: dict[str, tuple[torch.Tensor, int]] = {}  # checked at replay in debug mode

    def watch(self, tensors: dict[str, torch.Tensor]) -> None:
        """Record where ``tensors`` (the weights) live; debug replays check they never moved."""
        self.watched = {name: (t, t.data_ptr()) for name, t in tensors.items()}

    def check_watched(self) -> None:
        moved = [name for name, (t, address) in self.watched.items() if t.data_ptr() != address]
        if moved:
            raise CaptureError(
                f"{len(moved)} weight tensor(s) moved after capture (first: {moved[0]}); graphs "
                "read weights by address: load new weights in place (param.copy_(...)), never "
                "by replacing or moving the tensors"
            )

    @contextmanager
    def capture_phase(self) -> Iterator[None]:
        """Open capture for the block: garbage collection frozen, work on the capture stream."""
        gc.collect()
        gc.freeze()  # objects alive now are never scanned: capture runs without gc pauses
        gc.disable()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.open = True
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            self.open = False
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            gc.enable()
            gc.unfreeze()


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    output: Any  # non-owning views of the captured output: the next replay overwrites them
    input_addresses: tuple[int, ...]


class CUDAGraphWrapper:
    """Replays ``runnable`` from a graph per ``BatchDescriptor`` under its runtime mode.

    ``runnable`` must read its inputs from fixed addresses (persistent buffers, weights,
    outputs of earlier graphs of the same pool); in debug mode every replay checks that
    the tensor arguments sit where they sat at capture.

    ``prologue(key)``, when given, is captured at the head of every graph and never called
    outside one: work each replay must repeat before ``runnable`` (the runner's host-to-device
    input copies), which then costs no host call per step. When the wrapper calls through
    (another runtime mode), the caller has done that work itself. What the prologue returns,
    when not None, is called after ``runnable`` inside the same capture (to join a stream
    the prologue forked).
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        runtime_mode: CUDAGraphMode,
        state: CaptureState,
        *,
        name: str = "",
        prologue: Callable[[Any], Callable[[], None] | None] | None = None,
    ) -> None:
        self.runnable = runnable
        self.runtime_mode = runtime_mode
        self.state = state
        self.name = name or getattr(runnable, "__name__", type(runnable).__name__)
        self.prologue = prologue
        self.entries: dict[Any, _Entry] = {}

    def __call__(self, *args: Any) -> Any:
        ctx = get_forward_context()
        key = ctx.batch_descriptor
        if ctx.runtime_mode != self.runtime_mode or key is None:
            return self.runnable(*args)
        entry = self.entries.get(key)
        if entry is None:
            return self._capture(key, args)
        if self.state.debug:
            self._check_addresses(key, entry, args)
            self.state.check_watched()
        entry.graph.replay()
        return entry.output

    def _capture(self, key: Any, args: tuple[Any, ...]) -> Any:
        if not self.state.open:
            self.state.refused += 1
            raise CaptureError(
                f"{self.name}: no {self.runtime_mode} graph for {key}, and capture is closed "
                "after start-up (the dispatcher routed a batch to a graph that was never captured)"
            )
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.state.pool)
        try:
            finish = self.prologue(key) if self.prologue is not None else None
            output = self.runnable(*args)
            if finish is not None:
                finish()
        except RuntimeError as e:
            _abandon(graph)
            raise CaptureError(
                f"{self.name}: capturing the {self.runtime_mode} graph for {key} failed: {e}. "
                "Code inside a graph must not synchronize with the host (.item(), .tolist(), "
                ".cpu(), printing a tensor, host-to-device copies of new tensors); a backend "
                "that does must declare AttentionCGSupport.NEVER."
            ) from e
        graph.capture_end()
        # Keep only non-owning views: the memory returns to the shared pool when the caller
        # drops `output`, and graphs captured later (for other sizes, which never replay at
        # the same time) may reuse it.
        self.entries[key] = _Entry(graph, weak_ref(output), _addresses(args))
        self.state.num_graphs += 1
        return output

    def _check_addresses(self, key: Any, entry: _Entry, args: tuple[Any, ...]) -> None:
        now = _addresses(args)
        if now != entry.input_addresses:
            moved = [i for i, (a, b) in enumerate(zip(now, entry.input_addresses)) if a != b]
            raise CaptureError(
                f"{self.name}: replay of {key} got inputs at other addresses than at capture "
                f"(tensor arguments {moved}); graphs read inputs by address"
            )


def _abandon(graph: torch.cuda.CUDAGraph) -> None:
    """End a capture that failed midway, ignoring the error the aborted capture reports.

    An invalidated capture's ``capture_end`` raises before it releases the default CUDA
    generator, which then refuses every later random op ("Offset increment outside graph
    capture"); giving the generator a fresh copy of its state (same seed and offset) ends
    that. Remove the reset when torch's capture_end releases generators on failure.
    """
    with suppress(RuntimeError):
        graph.capture_end()
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    if hasattr(generator, "graphsafe_set_state"):
        generator.graphsafe_set_state(generator.clone_state())
    torch.cuda.synchronize()


def _addresses(args: tuple[Any, ...]) -> tuple[int, ...]:
    return tuple(a.data_ptr() for a in args if isinstance(a, torch.Tensor))


class _DeviceMemory:
    """Exposes a device address range through ``__cuda_array_interface__`` (no ownership)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }


def weak_ref(value: Any) -> Any:
    """``value`` with every tensor replaced by a view that does not own its memory."""
    if isinstance(value, torch.Tensor):
        return _weak_tensor(value)
    if isinstance(value, (list, tuple)):
        return type(value)(weak_ref(v) for v in value)
    return value


def _weak_tensor(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0 or t.device.type != "cuda":
        return t
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1  # elements spanned
    raw = torch.as_tensor(_DeviceMemory(t.data_ptr(), extent * t.element_size()), device=t.device)
    return raw.view(t.dtype).as_strided(t.shape, t.stride())

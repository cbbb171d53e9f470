"""The capture manager: an engine's capture sizes, dispatcher, graph wrappers and capture phase."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from graphattn._logging import logger
from graphattn.capture.dispatcher import BatchDescriptor, CudagraphDispatcher
from graphattn.capture.mode import CUDAGraphMode
from graphattn.capture.sizes import clip_capture_sizes, default_capture_sizes
from graphattn.capture.wrapper import CaptureState, CUDAGraphWrapper

M = CUDAGraphMode


class Capturer(Protocol):
    """What the manager needs of the runner: run warm-ups and captures for given keys."""

    def capture_graphs(self, keys: Sequence[tuple[CUDAGraphMode, BatchDescriptor]]) -> None: ...


class CaptureManager:
    """Owns the graphs of one engine for the resolved mode.

    ``wrap_model`` and ``piece_wrapper`` put FULL and PIECEWISE wrappers in place before
    capture; ``capture`` records every (mode, size) largest first into one pool and then
    closes capture for good; ``dispatcher.dispatch`` picks a graph for each step after.
    """

    def __init__(
        self,
        mode: CUDAGraphMode,
        *,
        capture_sizes: Sequence[int] | None,
        max_num_seqs: int,
        max_num_tokens: int,
        device: torch.device,
        debug: bool = False,
        uniform_decode_query_len: int = 1,
    ) -> None:
        self.mode = mode
        q = uniform_decode_query_len
        if capture_sizes is None:
            sizes, self.clipped = default_capture_sizes(max_num_seqs, max_num_tokens, q), []
        else:
            sizes, self.clipped = clip_capture_sizes(capture_sizes, max_num_tokens)
        if self.clipped:
            logger.warning(
                "capture sizes %s exceed max_num_tokens=%d and are dropped",
                self.clipped,
                max_num_tokens,
            )
        if not sizes and mode != M.NONE:
            logger.warning("no capture size is left: every batch runs without graphs")
            self.mode = mode = M.NONE
        self.dispatcher = CudagraphDispatcher(mode, sizes, max_num_seqs, q)
        self.decode_gap = describe_decode_gap(self.dispatcher)  # the engine warns with it
        self.state = CaptureState(device, debug=debug) if mode != M.NONE else None
        self.graphs_at_startup = 0  # graphs when capture closed (later ones break the rule)

    def piece_wrapper(self) -> Callable[[Callable[..., Any], Any], Callable[..., Any]] | None:
        """The wrapper for compiled pieces, or None when no PIECEWISE graphs are captured."""
        if not self.mode.has_piecewise_cudagraphs():
            return None

        def wrap(piece: Callable[..., Any], info: Any) -> Callable[..., Any]:
            return CUDAGraphWrapper(piece, M.PIECEWISE, self.state, name=f"piece {info.index}")

        return wrap

    def wrap_model(
        self,
        forward: Callable[..., Any],
        prologue: Callable[[Any], Callable[[], None] | None] | None = None,
    ) -> Callable[..., Any]:
        """``forward`` under a FULL wrapper when the mode has full graphs; ``prologue(key)``
        is captured at the head of each full graph (see ``CUDAGraphWrapper``).
        """
        if not self.mode.has_full_cudagraphs():
            return forward
        return CUDAGraphWrapper(forward, M.FULL, self.state, name="model", prologue=prologue)

    def capture(self, runner: Capturer, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Capture every graph (start-up only); what the report shows about it.

        ``weights`` are the tensors the graphs read besides the inputs; debug replays check
        that they have not moved.
        """
        if self.state is None:
            return {}
        self.state.watch(weights)
        order = self.dispatcher.capture_order()
        free_before = torch.cuda.mem_get_info(self.state.device)[0]
        start = time.perf_counter()
        logger.info("capturing %d CUDA graphs (%s)", len(order), self.mode)
        with torch.inference_mode(), self.state.capture_phase():
            runner.capture_graphs(order)
        torch.cuda.synchronize(self.state.device)
        self.graphs_at_startup = self.state.num_graphs
        seconds = time.perf_counter() - start
        used = free_before - torch.cuda.mem_get_info(self.state.device)[0]
        info = summarize_keys(self.dispatcher.keys)
        info |= {
            "graphs": self.state.num_graphs,
            "seconds": round(seconds, 2),
            "graph_memory_mib": round(used / 2**20, 1),
        }
        if self.clipped:
            info["clipped_sizes"] = self.clipped
        if self.dispatcher.q > 1:  # what the uniform-decode graphs' batches look like
            info["uniform_decode_query_len"] = self.dispatcher.q
        if self.decode_gap:
            info["decode_gap"] = self.decode_gap
        logger.info(
            "captured %d graphs in %.1f s, %.0f MiB",
            info["graphs"],
            seconds,
            info["graph_memory_mib"],
        )
        return info


def summarize_keys(keys: dict[CUDAGraphMode, list[BatchDescriptor]]) -> dict[str, Any]:
    """The report's view of the captured keys: each mode's sizes once, and, where there are
    full graphs, which batches they serve at each size (FULL can capture a uniform-decode
    graph and a mixed-batch graph of the same size).
    """
    info: dict[str, Any] = {
        "sizes": {
            str(m): sorted({k.num_tokens for k in keys[m]})
            for m in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE)
            if keys[m]
        }
    }
    full = keys[CUDAGraphMode.FULL]
    kinds = {
        "uniform decode": [k for k in full if k.uniform_decode],
        "mixed": [k for k in full if not k.uniform_decode],
    }
    if full:
        info["full_graphs"] = {
            kind: sorted(k.num_tokens for k in ks) for kind, ks in kinds.items() if ks
        }
    return info


def describe_decode_gap(dispatcher: CudagraphDispatcher) -> str | None:
    """What a start-up warning says when some decode batches get no full graph (see
    ``CudagraphDispatcher.decode_gap``); None when every decode batch up to the largest
    size gets one.
    """
    gap = dispatcher.decode_gap()
    if gap is None:
        return None
    lo, hi = gap
    mode, q = dispatcher.mode, dispatcher.q
    if mode.mixed_mode() == M.PIECEWISE:
        runs = f"run piecewise, padded as mixed batches are (from {dispatcher.pad_to[lo]})"
    else:
        runs = "run without graphs"
    times = "" if q == 1 else f" x {q}"
    whole = "" if q == 1 else f" that are multiples of uniform_decode_query_len={q}"
    return (
        f"decode batches of {lo}-{hi} tokens get no full graph under {mode}: full decode "
        f"graphs exist only for capture sizes <= max_num_seqs{times} "
        f"({dispatcher.max_num_seqs * q}){whole}, none of which holds these batches, so they "
        f"{runs} (counted in engine.stats.fallbacks); a capture size of {hi} gives them one"
    )

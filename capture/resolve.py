"""Mode resolution: lower the requested CUDA-graph mode to what every backend allows, with reasons.

The rules (docs/modes.md), applied in order, each to the result of the one before:

1. The mixed-batch mode is FULL and support is below ALWAYS: NEVER raises; otherwise the
   mode becomes FULL_AND_PIECEWISE if attention is compiled piecewise, else FULL_DECODE_ONLY.
2. The decode mode is FULL and support is NEVER: PIECEWISE if attention is compiled
   piecewise, else NONE.
3. The decode mode is FULL, decode batches have more than one query token per request
   (speculative decoding) and support is below UNIFORM_BATCH: PIECEWISE or NONE as in 2.
4. A mode that still has FULL graphs with support NEVER raises.

Applying the rules in sequence (rather than stopping at the first that fires) matters in
one case only: FULL with UNIFORM_SINGLE_TOKEN_DECODE support and speculative decoding is
lowered by rule 1 and then again by rule 3, since neither its mixed nor its decode
batches can be served by full graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphattn.attention.backend import AttentionCGSupport
from graphattn.capture.mode import CUDAGraphMode
from graphattn.errors import CUDAGraphModeError

M = CUDAGraphMode


@dataclass(frozen=True)
class FallbackRecord:
    """One downgrade of the requested mode: what, why, whose support, and what it costs."""

    requested: CUDAGraphMode
    resolved: CUDAGraphMode
    rule: str
    backend: str
    support: str
    cost: str
    # False for the engine's own rules (no CUDA device, no split at attention, no decode
    # size): the backend's support level did not cause them, and the message does not say so
    from_support: bool = True

    def __str__(self) -> str:
        why = f": backend {self.backend} supports {self.support}" if self.from_support else ""
        return f"cudagraph_mode {self.requested} -> {self.resolved} ({self.rule}){why}; {self.cost}"


def resolve_cudagraph_mode(
    requested: CUDAGraphMode,
    min_support: AttentionCGSupport,
    *,
    attention_is_splitting_op: bool = True,
    uniform_decode_query_len: int = 1,
    backend_name: str = "?",
) -> tuple[CUDAGraphMode, list[FallbackRecord]]:
    """The mode every attention group can serve, and a record for every change.

    A pure function of its arguments: no device is queried. Raises ``CUDAGraphModeError``
    (a ValueError) where no lowering serves the request.
    """
    mode, records = requested, []
    support = AttentionCGSupport(min_support)
    piecewise_or_none = M.PIECEWISE if attention_is_splitting_op else M.NONE

    def lower(new: CUDAGraphMode, rule: str) -> None:
        nonlocal mode
        records.append(
            FallbackRecord(mode, new, rule, backend_name, support.name, _cost(mode, new))
        )
        mode = new

    if mode.mixed_mode() == M.FULL and support < AttentionCGSupport.ALWAYS:
        if support == AttentionCGSupport.NEVER:
            raise CUDAGraphModeError(
                f"cudagraph_mode={requested} needs full CUDA graphs for every batch, but "
                f"attention backend {backend_name} supports {support.name}; try "
                f"cudagraph_mode={piecewise_or_none}"
                + (
                    ""
                    if attention_is_splitting_op
                    else " (or PIECEWISE, with the model compiled and split at attention)"
                )
            )
        lower(
            M.FULL_AND_PIECEWISE if attention_is_splitting_op else M.FULL_DECODE_ONLY,
            "mixed batches need ALWAYS for full graphs",
        )
    if mode.decode_mode() == M.FULL and support == AttentionCGSupport.NEVER:
        lower(piecewise_or_none, "full graphs need a support level above NEVER")
    if (
        mode.decode_mode() == M.FULL
        and uniform_decode_query_len > 1
        and support < AttentionCGSupport.UNIFORM_BATCH
    ):
        lower(
            piecewise_or_none,
            f"decode batches of {uniform_decode_query_len} tokens per request need UNIFORM_BATCH",
        )
    if mode.has_full_cudagraphs() and support == AttentionCGSupport.NEVER:
        raise CUDAGraphModeError(
            f"cudagraph_mode={mode} has full CUDA graphs but attention backend {backend_name} "
            f"supports {support.name}; try cudagraph_mode={piecewise_or_none}"
        )
    return mode, records


def _cost(old: CUDAGraphMode, new: CUDAGraphMode) -> str:
    """Which batches lose their full graph, and how they run instead."""
    lost = []
    if old.decode_mode() == M.FULL and new.decode_mode() != M.FULL:
        lost.append(f"uniform decode batches run {_how(new.decode_mode())}")
    if old.mixed_mode() == M.FULL and new.mixed_mode() != M.FULL:
        lost.append(f"mixed batches run {_how(new.mixed_mode())}")
    if old.mixed_mode() == M.PIECEWISE and new.mixed_mode() == M.NONE:
        lost.append("mixed batches run without graphs")
    return "; ".join(lost) or "no batch loses a graph"


def _how(mode: CUDAGraphMode) -> str:
    return "piecewise (attention eager between graphs)" if mode == M.PIECEWISE else "without graphs"


def resolve_for_engine(
    requested: CUDAGraphMode,
    min_support: AttentionCGSupport,
    *,
    has_cuda: bool,
    attention_is_splitting_op: bool,
    backend_name: str,
    uniform_decode_query_len: int = 1,
    has_decode_size: bool = True,
) -> tuple[CUDAGraphMode, list[FallbackRecord]]:
    """``resolve_cudagraph_mode`` plus what the engine knows: without CUDA every mode is NONE,
    piecewise graphs need the model compiled and split at attention, and FULL_DECODE_ONLY
    captures nothing without a capture size a decode batch of ``max_num_seqs`` requests or
    fewer can pad to (``has_decode_size``).
    """
    if not has_cuda:
        if requested == M.NONE:
            return requested, []
        cost = "every batch runs without graphs"
        return M.NONE, [
            FallbackRecord(
                requested,
                M.NONE,
                "CUDA graphs need a CUDA device",
                backend_name,
                min_support.name,
                cost,
                from_support=False,
            )
        ]
    mode, records = requested, []
    if mode.has_piecewise_cudagraphs() and not attention_is_splitting_op:
        new = M.FULL_DECODE_ONLY if mode == M.FULL_AND_PIECEWISE else M.NONE
        rule = "piecewise graphs need the model compiled and split at attention"
        cost = (
            "mixed batches run without graphs"
            if new == M.FULL_DECODE_ONLY
            else "every batch runs without graphs"
        )
        records.append(
            FallbackRecord(
                mode, new, rule, backend_name, min_support.name, cost, from_support=False
            )
        )
        mode = new
    mode, more = resolve_cudagraph_mode(
        mode,
        min_support,
        attention_is_splitting_op=attention_is_splitting_op,
        uniform_decode_query_len=uniform_decode_query_len,
        backend_name=backend_name,
    )
    records += more
    if mode == M.FULL_DECODE_ONLY and not has_decode_size:
        rule = "full decode graphs need a capture size <= max_num_seqs" + (
            ""
            if uniform_decode_query_len == 1
            else f" x {uniform_decode_query_len} that is a multiple of uniform_decode_query_len"
        )
        cost = "every batch runs without graphs"
        records.append(
            FallbackRecord(
                mode, M.NONE, rule, backend_name, min_support.name, cost, from_support=False
            )
        )
        mode = M.NONE
    return mode, records

"""One step: a batch of requests -> persistent input buffers -> metadata -> dispatch -> model."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from graphattn._logging import logger
from graphattn.attention.backend import CommonAttentionMetadata
from graphattn.attention.forward_context import set_forward_context
from graphattn.attention.groups import AttentionGroup
from graphattn.batch import Batch
from graphattn.buffers import InputBuffers
from graphattn.capture.dispatcher import BatchDescriptor, Dispatch
from graphattn.capture.mode import CUDAGraphMode
from graphattn.errors import BackendError
from graphattn.kernels.precompile import PrecompileReport, compile_ahead
from graphattn.kv_cache import KVCacheGroup, to_kernel_block_table
from graphattn.report import EngineStats
from graphattn.validation import BatchLimits, check_step


@dataclass
class StepPlan:
    """The host-side facts of one step, after reordering and before padding."""

    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    uniform_decode: bool  # every request has the engine's uniform_decode_query_len tokens
    reordered: bool  # False when the caller's order already put decodes first
    num_input_tokens: int = 0  # padded token count the model runs on
    num_reqs_padded: int = 0  # padded request count the metadata covers
    runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    batch_descriptor: Any = None
    fallback: str | None = None  # why a batch that wanted a graph runs without one
    # (mode, key) whose graph the metadata must agree with, when it is not the runtime
    # mode's: a capture's eager warm-up runs the kernels the capture will record
    metadata_as: tuple[CUDAGraphMode, Any] | None = None


class _NoMetadataOnReplay(dict):
    """The forward context's metadata on a FULL replay that skipped it: the graph holds every
    attention launch, so nothing should look a layer up; anything that does gets told why.
    """

    def __missing__(self, layer_name: str) -> Any:
        raise BackendError(
            f"attention layer {layer_name!r} asked for metadata during a FULL replay, which "
            "skips it because every builder declares full_replay_needs_build = False; an "
            "attention op ran outside the graph (a builder whose build a replay needs must "
            "leave full_replay_needs_build True)"
        )


_NO_METADATA_ON_REPLAY = _NoMetadataOnReplay()


# (num_tokens, num_reqs, uniform_decode) -> runtime mode, padded key, fallback reason
Planner = Callable[[int, int, bool], Dispatch]


def no_padding(num_tokens: int, num_reqs: int, uniform_decode: bool) -> Dispatch:
    """The planner without CUDA graphs: run eagerly on exactly the batch."""
    return Dispatch(CUDAGraphMode.NONE, None)


class ModelRunner:
    """Runs steps of one model over its KV cache; owns the persistent input buffers.

    ``forward(input_ids, positions)`` is the model (eager, compiled or graph-wrapped);
    ``planner`` decides the runtime mode and padding of each step.
    """

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        layers: dict[str, Any],
        kv_cache_groups: Sequence[KVCacheGroup],
        attn_groups: Sequence[AttentionGroup],
        limits: BatchLimits,
        device: torch.device,
        planner: Planner = no_padding,
        stats: EngineStats | None = None,
        uniform_decode_query_len: int = 1,
    ) -> None:
        self.forward = forward
        self.layers = layers
        self.kv_cache_groups = list(kv_cache_groups)
        self.attn_groups = list(attn_groups)
        self.limits = limits
        self.device = device
        self.planner = planner
        self.stats = stats if stats is not None else EngineStats()
        # the query tokens of each request in the batches full decode graphs serve (1, or
        # 1 + draft tokens for speculative decoding): what a plan's uniform_decode means
        self.uniform_query_len = uniform_decode_query_len
        max_blocks = -(-limits.max_model_len // limits.block_size)
        ratios = [g.blocks_per_kernel_block for g in self.kv_cache_groups]
        self.buffers = InputBuffers(
            limits.max_num_tokens, limits.max_num_seqs, max_blocks, ratios, device
        )
        thresholds = [
            g.builder.reorder_batch_threshold
            for g in self.attn_groups
            if g.builder is not None and g.builder.reorder_batch_threshold is not None
        ]
        self.reorder_threshold = min(thresholds) if thresholds else None
        if len(set(thresholds)) > 1:
            logger.warning(
                "attention builders ask for reorder_batch_threshold %s; one order serves "
                "every group, so decodes first means at most %d query tokens",
                sorted(set(thresholds)),
                self.reorder_threshold,
            )
        self._builders = tuple(g.builder for g in self.attn_groups if g.builder is not None)
        self.layer_names = list(layers)
        self._arange = np.arange(max(limits.max_num_seqs, limits.max_num_tokens) + 1)
        self._view_cache: dict[tuple[int, int], tuple[dict[str, Any], list]] = {}
        # Each step's host copies must have left the pinned staging buffers before the
        # next step overwrites them. External: full graphs record it (see full_graph_prologue).
        self._copies_done = torch.cuda.Event(external=True) if device.type == "cuda" else None
        # Set by the engine when its full graphs copy the inputs themselves, and how
        # (envs.input_staging: "kernel", the default, or "copies").
        self.copies_in_full_graphs = False
        self.input_staging = "kernel"
        # Threads that compile graphattn's kernels before the capture's warm-ups (set by the
        # engine from envs.precompile_threads; < 2: each compiles at its first launch).
        self.precompile_threads = 0
        self.precompile_skip: str | None = None  # why not, though threads allow it
        self.precompile = PrecompileReport("off: nothing captured")
        self._streams: dict[int, torch.cuda.Stream] = {}  # raw stream -> Stream, for record
        self._event_stream: torch.cuda.Stream | None = None  # full_graph_prologue's branch
        self._device_index = (
            (device.index if device.index is not None else torch.cuda.current_device())
            if device.type == "cuda"
            else -1
        )

    # -- the step ---------------------------------------------------------------------

    def execute(self, batch: Batch, *, clone: bool = True) -> torch.Tensor:
        """Run ``batch``; returns ``[num_tokens, ...]`` rows in the caller's token order
        (``clone=False``: possibly in memory the next step overwrites, see ``restore_order``).
        """
        checked = check_step(batch, self.limits)
        if self._copies_done is not None:
            self._copies_done.synchronize()
        plan = self.prepare_inputs(batch, checked.longest, decode_blocks=checked.decode_blocks)
        hidden = self.run(plan)
        self.stats.steps += 1
        self.stats.tokens += plan.num_tokens
        self.stats.runtime_modes[plan.runtime_mode.name] += 1
        if plan.fallback:
            self.stats.fallbacks[plan.fallback] += 1
        return self.restore_order(hidden, plan, clone=clone)

    def run(self, plan: StepPlan, *, capturing: bool = False) -> torch.Tensor:
        """Metadata for the prepared buffers, then the model under the forward context.

        A FULL replay skips the metadata when no builder needs ``build`` on one
        (``full_replay_needs_build``): the graph's launches were captured with it.
        """
        if plan.runtime_mode == CUDAGraphMode.FULL and not capturing and self.replays_skip_build:
            attn_metadata: Any = _NO_METADATA_ON_REPLAY
        else:
            cams = self.common_metadata(plan)
            attn_metadata = self.build_metadata(cams, capturing=capturing)
        shared, _ = self._views(plan.num_reqs_padded, plan.num_input_tokens)
        with set_forward_context(
            attn_metadata,
            plan.batch_descriptor,
            plan.runtime_mode,
            layers=self.layers,
            slot_mapping=shared["slot_mapping_per_layer"],
        ):
            return self.forward(shared["input_ids"], shared["positions"])

    def prepare_inputs(
        self,
        batch: Batch,
        max_seq_len: int | None = None,
        *,
        decode_blocks: np.ndarray | None = None,
    ) -> StepPlan:
        """Reorder decodes first, fill the host buffers, pad, and copy to the device.

        ``max_seq_len`` and ``decode_blocks``: the longest sequence after the step and, for
        one-token requests, the block each writes, as ``check_step`` returns them (None:
        computed here).
        """
        if max_seq_len is None:
            max_seq_len = int(batch.seq_lens.max())
        if batch.num_tokens == batch.num_reqs:  # every request decodes one token
            plan = self._fill_decode(batch, max_seq_len, decode_blocks)
        else:
            plan = self._fill_mixed(batch, max_seq_len)
        self._pad(plan)
        if not (self.copies_in_full_graphs and plan.runtime_mode == CUDAGraphMode.FULL):
            self._copy_to_device(plan)
        return plan

    def _fill_decode(
        self, batch: Batch, max_seq_len: int, blocks: np.ndarray | None = None
    ) -> StepPlan:
        """``prepare_inputs`` for a batch of one-token requests: already in order, each
        token's position is its request's computed length; ``blocks``: the block each
        request writes, where the checks gathered it.
        """
        r, b = batch.num_reqs, self.buffers
        computed = batch.num_computed_tokens
        b.query_start_loc.np[: r + 1] = self._arange[: r + 1]
        seq_lens = b.seq_lens.np[:r]
        np.add(computed, 1, out=seq_lens)
        b.positions.np[:r] = computed
        b.input_ids.np[:r] = batch.token_ids
        block_size = self.limits.block_size
        if blocks is None:
            blocks = batch.block_table[self._arange[:r], computed // block_size]
        slots = b.slot_mapping.np[:r]
        np.multiply(blocks, block_size, out=slots, dtype=np.int64)
        np.add(slots, computed % block_size, out=slots)
        self._fill_block_tables(batch.block_table, r, -(-max_seq_len // block_size))
        b.is_prefilling_np[:r] = False
        return StepPlan(r, r, 1, max_seq_len, self.uniform_query_len == 1, False)

    def _fill_mixed(self, batch: Batch, max_seq_len: int) -> StepPlan:
        order = self._decode_first_order(batch.query_lens)
        q = batch.query_lens if order is None else batch.query_lens[order]
        computed = batch.num_computed_tokens if order is None else batch.num_computed_tokens[order]
        table = batch.block_table if order is None else batch.block_table[order]
        r, t = batch.num_reqs, batch.num_tokens
        b = self.buffers
        qsl = b.query_start_loc.np
        qsl[0] = 0
        np.cumsum(q, out=qsl[1 : r + 1])
        seq_lens = computed + q
        b.seq_lens.np[:r] = seq_lens
        req_of_token = np.repeat(np.arange(r), q)  # [T]
        offset = np.arange(t) - qsl[req_of_token]  # token's index among its request's new tokens
        positions = computed[req_of_token] + offset
        b.positions.np[:t] = positions
        if order is None:
            b.input_ids.np[:t] = batch.token_ids
        else:
            caller_start = np.cumsum(batch.query_lens) - batch.query_lens
            source = caller_start[order][req_of_token] + offset  # caller index of each token
            b.input_ids.np[:t] = batch.token_ids[source]
            b.output_index.np[source] = np.arange(t)  # inverse permutation
        block_size = self.limits.block_size
        blocks = table[req_of_token, positions // block_size].astype(np.int64)
        b.slot_mapping.np[:t] = blocks * block_size + positions % block_size
        self._fill_block_tables(table, r, -(-max_seq_len // block_size))
        np.greater(q, 1, out=b.is_prefilling_np[:r])
        max_query_len = int(q.max())
        uniform = max_query_len == self.uniform_query_len and t == max_query_len * r
        return StepPlan(r, t, max_query_len, max_seq_len, uniform, order is not None)

    def common_metadata(self, plan: StepPlan) -> list[CommonAttentionMetadata]:
        """One ``CommonAttentionMetadata`` per KV-cache group, over the padded batch."""
        shared, tables = self._views(plan.num_reqs_padded, plan.num_input_tokens)
        mode, key = plan.metadata_as or (plan.runtime_mode, plan.batch_descriptor)
        if mode == CUDAGraphMode.FULL and key is not None:  # the graph serves any batch of key
            uniform_query_len = self.uniform_query_len if key.uniform_decode else None
        elif plan.num_tokens == plan.max_query_len * plan.num_reqs:  # this batch alone
            uniform_query_len = plan.max_query_len
        else:
            uniform_query_len = None
        # Under PIECEWISE the update op may sit in a captured piece while attention runs
        # eagerly: a choice between them made at capture would go stale at replay.
        fuse_kv_update = mode != CUDAGraphMode.PIECEWISE
        return [
            CommonAttentionMetadata(
                max_seq_len=plan.max_seq_len,
                num_reqs=plan.num_reqs_padded,
                num_actual_tokens=plan.num_tokens,
                num_input_tokens=plan.num_input_tokens,
                max_query_len=plan.max_query_len,
                block_table_tensor=table,
                query_start_loc=shared["query_start_loc"],
                query_start_loc_cpu=shared["query_start_loc_cpu"],
                seq_lens=shared["seq_lens"],
                seq_lens_cpu=shared["seq_lens_cpu"],
                slot_mapping=shared["slot_mapping"],
                positions=shared["positions"],
                is_prefilling=shared["is_prefilling"],
                uniform_decode=uniform_query_len == 1,
                uniform_query_len=uniform_query_len,
                fuse_kv_update=fuse_kv_update,
            )
            for table in tables
        ]

    def _views(self, rp: int, tp: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """The buffer slices of a (requests, tokens) size, made once per size: slicing costs
        about a microsecond a tensor, and decode steps repeat a few sizes.
        """
        views = self._view_cache.get((rp, tp))
        if views is None:
            if len(self._view_cache) > 4096:
                self._view_cache.clear()
            b = self.buffers
            shared = dict(
                query_start_loc=b.query_start_loc.gpu[: rp + 1],
                query_start_loc_cpu=b.query_start_loc.cpu[: rp + 1],
                seq_lens=b.seq_lens.gpu[:rp],
                seq_lens_cpu=b.seq_lens.cpu[:rp],
                slot_mapping=b.slot_mapping.gpu[:tp],
                positions=b.positions.gpu[:tp],
                is_prefilling=b.is_prefilling[:rp],
                input_ids=b.input_ids.gpu[:tp],
            )
            shared["slot_mapping_per_layer"] = dict.fromkeys(
                self.layer_names, shared["slot_mapping"]
            )
            tables = [
                b.block_tables[g.blocks_per_kernel_block].gpu[:rp] for g in self.kv_cache_groups
            ]
            views = self._view_cache[(rp, tp)] = (shared, tables)
        return views

    def build_metadata(
        self, cams: Sequence[CommonAttentionMetadata], *, capturing: bool = False
    ) -> dict[str, Any]:
        """One metadata object per attention group, stored under each of its layer names."""
        per_layer: dict[str, Any] = {}
        for group in self.attn_groups:
            cam = cams[group.kv_cache_group.group_id]
            if capturing:
                metadata = group.builder.build_for_cudagraph_capture(cam)
            else:
                metadata = group.builder.build(0, cam)
            if metadata is None:  # an impl would read it as the profile run and write zeros
                raise BackendError(
                    f"{type(group.builder).__qualname__} ({group.backend.get_name()}) built "
                    "no metadata (None) for a step; None means the profile run to an impl"
                )
            per_layer.update(dict.fromkeys(group.layer_names, metadata))
        return per_layer

    def restore_order(
        self, hidden: torch.Tensor, plan: StepPlan, *, clone: bool = True
    ) -> torch.Tensor:
        """The real tokens' rows in the caller's order, in a tensor no later step overwrites;
        with ``clone=False`` a graph's output comes back in place, valid until the next step
        (any later replay may reuse that memory).
        """
        n = plan.num_tokens
        if plan.runtime_mode == CUDAGraphMode.NONE and not plan.reordered:
            return hidden if hidden.shape[0] == n else hidden[:n]  # the caller's already
        out = hidden[:n]  # a new view even unpadded: the graph's own tensor stays the engine's
        if plan.reordered:
            return out.index_select(0, self.buffers.output_index.gpu[:n])
        return out.clone() if clone else out

    @property
    def replays_skip_build(self) -> bool:
        """Whether FULL replays run without metadata: no builder declares
        ``full_replay_needs_build`` (read each step, so a changed class attribute counts).
        """
        return not any(b.full_replay_needs_build for b in self._builders)

    def builders_needing_replay_build(self) -> list[str]:
        """The class names of the builders that declare ``full_replay_needs_build``."""
        return sorted({type(b).__name__ for b in self._builders if b.full_replay_needs_build})

    # -- capture ----------------------------------------------------------------------

    @property
    def can_copy_in_graphs(self) -> bool:
        """Whether full graphs may take the step's host-to-device input copies: on CUDA, and
        when no builder uses the device inputs in ``build`` (which runs before the replay).
        """
        return self._copies_done is not None and not any(
            g.builder is not None and g.builder.uses_device_inputs_in_build
            for g in self.attn_groups
        )

    def full_graph_prologue(self, key: BatchDescriptor) -> Callable[[], None]:
        """Captured at the head of each full graph: the input copies of a step of ``key``'s
        padded size (three memcpy nodes, or one staging kernel: ``input_staging``), then the
        copies-done event. A replay then moves the pinned buffers as it
        runs, so a FULL step makes no copy call; the pinned buffers stay untouched until the
        event (the next ``execute`` waits for it).

        The event is recorded on a branch: a second stream forks after the copies and joins
        at the graph's end (the returned callable, which the wrapper captures after the
        model). On the model's stream an event node would sit between the copies and the
        first kernel: 1.3-1.6 us a replay more on the H200, on two leases; waiting for the
        event and then replaying, as ``execute`` does, takes no longer with the branch
        (``benchmarks/graph_head.py``, its paced loop).
        """
        stream = self._current_stream()
        if self.input_staging == "kernel":
            self.buffers.stage_to_device(key.num_tokens, key.num_reqs)
        else:
            self.buffers.copy_to_device(key.num_tokens, key.num_reqs)
        if self._event_stream is None:
            self._event_stream = torch.cuda.Stream(self._device_index)
        branch = self._event_stream
        branch.wait_stream(stream)
        self._copies_done.record(branch)
        return lambda: stream.wait_stream(branch)

    def capture_graphs(
        self, keys: Sequence[tuple[CUDAGraphMode, BatchDescriptor]], warmups: int = 1
    ) -> None:
        """Warm up and capture each (mode, key) in order; call inside an open capture phase.

        The capture batch is synthetic: every token has slot -1 (the KV cache is not
        written), every request reads block 0, and the lengths fit the key. First, one dry
        warm-up of every key compiles graphattn's Triton kernels on ``precompile_threads``
        threads unless ``precompile_skip`` says why not (``compile_ahead``;
        ``self.precompile`` says what it did).
        """
        ahead = compile_ahead(self.device, self.precompile_threads, self.precompile_skip)
        with ahead as report:
            if report.active:
                try:
                    for mode, key in keys:
                        self._warm_up(mode, key)
                except Exception as e:  # garbage activations upset an op: compile as before
                    report.status = f"stopped: a dry warm-up raised {type(e).__name__}: {e}"[:300]
                    logger.warning("kernel precompile %s", report.status)
        self.precompile = report
        for mode, key in keys:
            plan = self._warm_up(mode, key, warmups)
            self.run(plan, capturing=True)

    def build_once(self) -> None:
        """Every group's metadata built once for a synthetic one-token batch (no model run,
        nothing written): a builder that raises or returns None does so at start-up, not
        at the first step. An engine that captures graphs builds in its warm-ups instead."""
        plan = self._synthetic_plan(CUDAGraphMode.NONE, BatchDescriptor(1, 1))
        self.build_metadata(self.common_metadata(plan))

    def _warm_up(self, mode: CUDAGraphMode, key: BatchDescriptor, times: int = 1) -> StepPlan:
        """Run ``key``'s synthetic batch eagerly ``times`` times, with the kernels the
        capture will record (they compile and load outside the graph); the plan to capture."""
        plan = self._synthetic_plan(mode, key)
        eager = dataclasses.replace(
            plan,
            runtime_mode=CUDAGraphMode.NONE,
            batch_descriptor=None,
            metadata_as=(mode, key),
        )
        for _ in range(times):
            self.run(eager)
        if self._stages_inputs(mode):  # the prologue runs only in a capture: compile it here
            self.buffers.stage_to_device(key.num_tokens, key.num_reqs)
        return plan

    def _stages_inputs(self, mode: CUDAGraphMode) -> bool:
        """Whether a graph of ``mode`` starts with the staging kernel (``input_staging``)."""
        return (
            mode == CUDAGraphMode.FULL
            and self.copies_in_full_graphs
            and self.input_staging == "kernel"
        )

    def _synthetic_plan(self, mode: CUDAGraphMode, key: BatchDescriptor) -> StepPlan:
        if self._copies_done is not None:  # the last key's copies have left the buffers
            self._copies_done.synchronize()
        tokens = key.num_tokens
        reqs = key.num_reqs if key.num_reqs is not None else min(tokens, self.limits.max_num_seqs)
        if key.uniform_decode:  # uniform_decode_query_len tokens each, as its batches have
            q = np.full(reqs, tokens // reqs, dtype=np.int32)
        else:
            q = np.ones(reqs, dtype=np.int32)
            q[0] += tokens - reqs  # the first request takes the tokens beyond one each
        b = self.buffers
        b.query_start_loc.np[0] = 0
        np.cumsum(q, out=b.query_start_loc.np[1 : reqs + 1])
        b.seq_lens.np[:reqs] = q
        b.input_ids.np[:tokens] = 0
        b.positions.np[:tokens] = 0
        b.slot_mapping.np[:tokens] = -1
        np.greater(q, 1, out=b.is_prefilling_np[:reqs])
        for buf in b.block_tables.values():
            buf.np[:reqs] = 0
        plan = StepPlan(
            reqs,
            tokens,
            int(q.max()),
            int(q.max()),
            bool((q == self.uniform_query_len).all()),
            False,
            tokens,
            reqs,
            mode,
            key,
        )
        self._copy_to_device(plan)
        return plan

    # -- helpers ----------------------------------------------------------------------

    def _decode_first_order(self, query_lens: np.ndarray) -> np.ndarray | None:
        """A stable permutation putting decodes first, or None when already so ordered."""
        if self.reorder_threshold is None:
            return None
        is_decode = query_lens <= self.reorder_threshold
        if not (~is_decode[:-1] & is_decode[1:]).any():
            return None
        return np.argsort(~is_decode, kind="stable")

    def _fill_block_tables(self, table: np.ndarray, num_reqs: int, width: int) -> None:
        manager = table[:, :width]
        for ratio, buf in self.buffers.block_tables.items():
            buf.np[:num_reqs, : width * ratio] = to_kernel_block_table(manager, ratio)

    def _pad(self, plan: StepPlan) -> None:
        """Ask the planner for the runtime mode and pad: slot -1 for padding tokens,
        sequence length 0 for padding requests, each owning one padding token where possible.
        """
        out = self.planner(plan.num_tokens, plan.num_reqs, plan.uniform_decode)
        key = out.descriptor
        plan.runtime_mode, plan.batch_descriptor, plan.fallback = out.mode, key, out.fallback
        plan.num_input_tokens = key.num_tokens if key is not None else plan.num_tokens
        plan.num_reqs_padded = (
            plan.num_reqs if key is None or key.num_reqs is None else key.num_reqs
        )
        self._pad_buffers(plan)

    def _pad_buffers(self, plan: StepPlan) -> None:
        tokens, reqs = plan.num_input_tokens, plan.num_reqs_padded
        b, t, r = self.buffers, plan.num_tokens, plan.num_reqs
        if tokens > t:
            b.input_ids.np[t:tokens] = 0
            b.positions.np[t:tokens] = 0
            b.slot_mapping.np[t:tokens] = -1
        if reqs > r:
            # padding request i owns padding token (t + i - r) while there are tokens left;
            # under a uniform decode key each owns uniform_query_len of them (the key's
            # tokens are that many a request), so the padded batch is uniform too
            key = plan.batch_descriptor
            per = self.uniform_query_len if key is not None and key.uniform_decode else 1
            starts = np.minimum(t + per * np.arange(1, reqs - r + 1), tokens)
            b.query_start_loc.np[r + 1 : reqs + 1] = starts
            b.seq_lens.np[r:reqs] = 0
            b.is_prefilling_np[r:reqs] = False

    def _copy_to_device(self, plan: StepPlan) -> None:
        self.buffers.copy_to_device(plan.num_input_tokens, plan.num_reqs_padded)
        if self._copies_done is not None:
            self._copies_done.record(self._current_stream())

    def _current_stream(self) -> torch.cuda.Stream:
        """The current CUDA stream, found by its raw handle: ``torch.cuda.current_stream()``
        builds a new Stream object each call, a sizeable share of a decode step's host time.
        """
        raw = torch._C._cuda_getCurrentRawStream(self._device_index)
        stream = self._streams.get(raw)
        if stream is None:
            stream = self._streams[raw] = torch.cuda.current_stream(self._device_index)
        return stream

"""Persistent input buffers: allocated once at the largest step, read by graphs by address.

Every per-step input lives in one of three flat buffers, each with a pinned host copy, so a
step reaches the device with three asynchronous copies whatever the batch. A FULL step's
graph moves them itself (``ModelRunner.full_graph_prologue``): as one kernel,
``stage_to_device``, or with ``GRAPHATTN_INPUT_STAGING=copies`` as the three copies. The
model's two inputs (``input_ids``, ``positions``) each start a buffer: the traced graph sees
tensors with storage offset 0, so the offset never becomes a symbolic size.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class BufferView:
    """One named input: ``np`` (host numpy), ``cpu`` (host tensor), ``gpu`` (device tensor),
    all views of the flat buffers with the same shape.
    """

    def __init__(
        self, host: torch.Tensor, device: torch.Tensor, start: int, shape: tuple[int, ...]
    ) -> None:
        size = 1
        for n in shape:
            size *= n
        self.cpu = host[start : start + size].view(shape)
        self.np = self.cpu.numpy()
        self.gpu = device[start : start + size].view(shape)
        self.end = start + size


class _Flat:
    """A flat host buffer (pinned on CUDA) and its device twin, carved into views."""

    def __init__(
        self, sizes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device
    ) -> None:
        total = sum(_numel(s) for s in sizes.values())
        self.host = torch.zeros(total, dtype=dtype, pin_memory=device.type == "cuda")
        self.device = (
            self.host if device.type == "cpu" else torch.zeros(total, dtype=dtype, device=device)
        )
        self.views, start = {}, 0
        for name, shape in sizes.items():
            self.views[name] = BufferView(self.host, self.device, start, shape)
            start = self.views[name].end

        self._prefixes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def copy_prefix(self, end: int) -> None:
        if self.device is self.host:
            return
        pair = self._prefixes.get(end)
        if pair is None:  # slicing costs about as much as the copy call: once per length
            pair = self._prefixes[end] = (self.device[:end], self.host[:end])
        pair[0].copy_(pair[1], non_blocking=True)


class InputBuffers:
    """Every per-step input the model and the attention metadata read.

    Sized for ``max_num_tokens`` tokens and ``max_num_seqs`` requests; ``block_tables``
    has one table per kernel-block ratio in use (manager blocks rewritten into kernel
    blocks), each with a fixed row stride so graphs see fixed strides.
    """

    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        kernel_block_ratios: Iterable[int],
        device: torch.device,
    ) -> None:
        t, r = max_num_tokens, max_num_seqs
        # token-sized int64 inputs, so a step copies a prefix of each buffer
        self._i64 = _Flat(
            {"input_ids": (t,), "slot_mapping": (t,), "output_index": (t,)}, torch.int64, device
        )
        self._pos = _Flat({"positions": (t,)}, torch.int64, device)
        ratios = sorted(set(kernel_block_ratios))
        tables = {f"block_table[{k}]": (r, max_blocks_per_seq * k) for k in ratios}
        self._i32 = _Flat(
            {"query_start_loc": (r + 1,), "seq_lens": (r,), **tables}, torch.int32, device
        )
        v64, v32 = self._i64.views, self._i32.views
        self.input_ids, self.positions = v64["input_ids"], self._pos.views["positions"]
        self.slot_mapping, self.output_index = v64["slot_mapping"], v64["output_index"]
        self.query_start_loc, self.seq_lens = v32["query_start_loc"], v32["seq_lens"]
        self.block_tables = {k: v32[f"block_table[{k}]"] for k in ratios}
        self.is_prefilling = torch.zeros(max_num_seqs, dtype=torch.bool)
        self.is_prefilling_np = self.is_prefilling.numpy()
        self._staging: dict[tuple[int, int], object] = {}  # (tokens, requests) -> StagingPlan

    def copy_to_device(self, num_tokens: int, num_reqs: int) -> None:
        """Three asynchronous copies: the int64 inputs of ``num_tokens`` tokens, their
        positions, and the int32 inputs (lengths and block-table rows) of ``num_reqs`` requests.
        """
        self._i64.copy_prefix(self.output_index.end - self.output_index.np.size + num_tokens)
        self._pos.copy_prefix(num_tokens)
        self._i32.copy_prefix(self._i32_prefix(num_reqs))

    def _i32_prefix(self, num_reqs: int) -> int:
        """Elements of the int32 buffer up to ``num_reqs`` rows of its last block table."""
        last = self.block_tables[max(self.block_tables)]
        return last.end - last.np.size + num_reqs * last.np.shape[1]

    def stage_to_device(self, num_tokens: int, num_reqs: int) -> None:
        """``copy_to_device``'s work as one kernel that reads the pinned buffers itself
        (``kernels/stage_inputs.py``; CUDA): each input's first ``num_tokens`` tokens or
        ``num_reqs`` requests."""
        plan = self._staging.get((num_tokens, num_reqs))
        if plan is None:
            plan = self._staging[(num_tokens, num_reqs)] = self._staging_plan(num_tokens, num_reqs)
        _stage_inputs().stage(plan)

    def _staging_plan(self, num_tokens: int, num_reqs: int):
        stage_inputs = _stage_inputs()
        n, r = num_tokens, num_reqs
        views = [self.input_ids, self.slot_mapping, self.output_index]
        segments = [(v.cpu[:n], v.gpu[:n]) for v in views]
        segments.append((self.positions.cpu[:n], self.positions.gpu[:n]))
        tables = [self.block_tables[k] for k in sorted(self.block_tables)]
        if len(segments) + 2 + len(tables) <= stage_inputs.MAX_SEGMENTS:
            segments.append((self.query_start_loc.cpu[: r + 1], self.query_start_loc.gpu[: r + 1]))
            segments.append((self.seq_lens.cpu[:r], self.seq_lens.gpu[:r]))
            segments += [(t.cpu[:r].reshape(-1), t.gpu[:r].reshape(-1)) for t in tables]
        else:  # the int32 prefix copy_to_device moves
            end = self._i32_prefix(r)
            segments.append((self._i32.host[:end], self._i32.device[:end]))
        return stage_inputs.StagingPlan(segments)

    def addresses(self) -> dict[str, int]:
        """Device addresses of every buffer (graphs read them; they must never move)."""
        return {
            name: flat.device.data_ptr()
            for name, flat in (("int64", self._i64), ("positions", self._pos), ("int32", self._i32))
        }


def _stage_inputs():
    """The staging kernel's module, imported on first use (it imports Triton)."""
    from graphattn.kernels import stage_inputs

    return stage_inputs


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n

"""Persistent input buffers: allocated once at the largest step, read by graphs by address."""

from __future__ import annotations

from collections.abc import Iterable

import torch


class HostDeviceBuffer:
    """A device tensor with a host staging copy (pinned on CUDA) and a numpy view of it."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.np = self.cpu.numpy()
        self.gpu = (
            self.cpu if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)
        )

    def copy_to_device(self, rows: int, cols: int | None = None) -> torch.Tensor:
        """Copy the first ``rows`` (and ``cols``) to the device; returns the device slice."""
        if cols is None:
            dst, src = self.gpu[:rows], self.cpu[:rows]
        else:
            dst, src = self.gpu[:rows, :cols], self.cpu[:rows, :cols]
        if self.gpu is not self.cpu:
            dst.copy_(src, non_blocking=True)
        return dst


class InputBuffers:
    """Every per-step input the model and the attention metadata read.

    Sized for ``max_num_tokens`` tokens and ``max_num_seqs`` requests; ``block_tables``
    has one table per kernel-block ratio in use (manager blocks rewritten into kernel blocks).
    """

    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        kernel_block_ratios: Iterable[int],
        device: torch.device,
    ) -> None:
        self.input_ids = HostDeviceBuffer((max_num_tokens,), torch.int64, device)
        self.positions = HostDeviceBuffer((max_num_tokens,), torch.int64, device)
        self.slot_mapping = HostDeviceBuffer((max_num_tokens,), torch.int64, device)
        self.query_start_loc = HostDeviceBuffer((max_num_seqs + 1,), torch.int32, device)
        self.seq_lens = HostDeviceBuffer((max_num_seqs,), torch.int32, device)
        self.output_index = HostDeviceBuffer((max_num_tokens,), torch.int64, device)
        self.block_tables = {
            ratio: HostDeviceBuffer((max_num_seqs, max_blocks_per_seq * ratio), torch.int32, device)
            for ratio in sorted(set(kernel_block_ratios))
        }
        self.is_prefilling = torch.zeros(max_num_seqs, dtype=torch.bool)

    def addresses(self) -> dict[str, int]:
        """Device addresses of every buffer (graphs read them; they must never move)."""
        named = {
            "input_ids": self.input_ids,
            "positions": self.positions,
            "slot_mapping": self.slot_mapping,
            "query_start_loc": self.query_start_loc,
            "seq_lens": self.seq_lens,
        }
        named.update({f"block_table[{r}]": b for r, b in self.block_tables.items()})
        return {name: buf.gpu.data_ptr() for name, buf in named.items()}

"""CUDAGraphMode: which CUDA graphs serve decode batches and which serve mixed batches."""

from __future__ import annotations

import enum


class CUDAGraphMode(enum.Enum):
    """The requested or resolved CUDA-graph mode.

    A mode is a pair (mixed-batch mode, uniform-decode mode), each NONE, PIECEWISE or FULL:

    - NONE: no graphs; the compiled code runs eagerly.
    - PIECEWISE: the pieces between attention ops replay graphs, attention runs eagerly.
    - FULL: one graph for the whole step, attention included, for every batch.
    - FULL_DECODE_ONLY: FULL for uniform decode batches, no graphs for mixed ones.
    - FULL_AND_PIECEWISE: FULL for uniform decode batches, PIECEWISE for mixed ones.
    """

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

    @classmethod
    def parse(cls, value: CUDAGraphMode | str) -> CUDAGraphMode:
        """The mode named by ``value`` (case-insensitive), or a ValueError listing the names."""
        if isinstance(value, CUDAGraphMode):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        names = ", ".join(cls.__members__)
        raise ValueError(f"unknown cudagraph_mode {value!r}; expected one of {names}")

    def decode_mode(self) -> CUDAGraphMode:
        """The mode for uniform decode batches (NONE, PIECEWISE or FULL)."""
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        """The mode for mixed (prefill or chunked) batches (NONE, PIECEWISE or FULL)."""
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def separate_routine(self) -> bool:
        """True when decode and mixed batches have different modes."""
        return isinstance(self.value, tuple)

    def has_full_cudagraphs(self) -> bool:
        return CUDAGraphMode.FULL in (self.decode_mode(), self.mixed_mode())

    def has_piecewise_cudagraphs(self) -> bool:
        return CUDAGraphMode.PIECEWISE in (self.decode_mode(), self.mixed_mode())

    def has_mode(self, mode: CUDAGraphMode) -> bool:
        """True when ``mode`` (NONE, PIECEWISE or FULL) serves some kind of batch."""
        return mode in (self.decode_mode(), self.mixed_mode())

    def __str__(self) -> str:
        return self.name

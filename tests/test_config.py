"""CompileConfig validation and CUDAGraphMode parsing."""

from __future__ import annotations

import pytest
import torch

import graphattn as ga
from graphattn.capture.mode import CUDAGraphMode


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_num_seqs", 0, "max_num_seqs must be a positive int, got 0"),
        ("block_size", 24, "power of two"),
        ("num_blocks", 1.5, "num_blocks must be a positive int"),
        ("dtype", "int8", "dtype must be one of"),
        ("cudagraph_mode", "fully", "unknown cudagraph_mode 'fully'"),
        ("compile_backend", "tvm", "compile_backend must be one of"),
        ("cudagraph_capture_sizes", (1, 0), "must hold positive ints"),
        ("splitting_ops", "graphattn::x", "list of op names"),
    ],
)
def test_bad_fields(field, value, message):
    with pytest.raises(ga.ConfigError, match=message):
        ga.CompileConfig(**{field: value})


def test_unknown_override_is_named():
    with pytest.raises(ga.ConfigError, match=r"unknown CompileConfig field\(s\) \['max_seqs'\]"):
        ga.CompileConfig.from_kwargs(None, max_seqs=3)


def test_parsing_and_derived_fields():
    cfg = ga.CompileConfig(
        dtype="bfloat16", cudagraph_mode="full_and_piecewise", max_model_len=100, block_size=16
    )
    assert cfg.dtype is torch.bfloat16
    assert cfg.cudagraph_mode is CUDAGraphMode.FULL_AND_PIECEWISE
    assert cfg.max_blocks_per_seq == 7
    with pytest.raises(AttributeError):
        cfg.block_size = 32


def test_mode_helpers():
    m = CUDAGraphMode
    assert m.parse("Piecewise") is m.PIECEWISE
    assert (m.FULL_AND_PIECEWISE.decode_mode(), m.FULL_AND_PIECEWISE.mixed_mode()) == (
        m.FULL,
        m.PIECEWISE,
    )
    assert (m.FULL_DECODE_ONLY.decode_mode(), m.FULL_DECODE_ONLY.mixed_mode()) == (m.FULL, m.NONE)
    assert m.FULL.decode_mode() is m.FULL and m.FULL.mixed_mode() is m.FULL
    assert (
        m.FULL_DECODE_ONLY.has_full_cudagraphs()
        and not m.FULL_DECODE_ONLY.has_piecewise_cudagraphs()
    )
    assert not m.NONE.has_full_cudagraphs() and not m.NONE.has_piecewise_cudagraphs()
    assert m.FULL_AND_PIECEWISE.has_piecewise_cudagraphs()


def test_default_passes_are_the_pass_managers():
    # config.py spells them out so importing it does not import Inductor
    from graphattn.passes.pass_manager import DEFAULT_PASSES

    assert ga.CompileConfig().passes == DEFAULT_PASSES

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
        ("strict", "yes", "strict must be True or False, got 'yes'"),
        ("debug", "no", "debug must be True or False, got 'no'"),
        ("trace_cache", 1, "trace_cache must be True or False"),
        ("cache_dir", 5, "cache_dir must be a folder path or None, got 5"),
        ("debug_dump_path", ["x"], "debug_dump_path must be a folder path or None"),
        ("kv_cache_dtype", None, 'kv_cache_dtype must be "auto" or a float dtype, got None'),
        ("attention_backend", 123, "attention_backend must be a backend name or None, got 123"),
        ("max_model_len", 0, "max_model_len must be a positive int, got 0"),
        ("cudagraph_capture_sizes", (8192,), r"needs a capture size <= max_num_tokens=4096"),
        ("cudagraph_capture_sizes", (), r"got cudagraph_capture_sizes=\[\]"),
    ],
)
def test_bad_fields(field, value, message):
    with pytest.raises(ga.ConfigError, match=message):
        ga.CompileConfig(**{field: value})


def test_full_decode_only_needs_a_size_a_decode_batch_pads_to():
    # max_num_seqs=4: no decode batch can use 8 or 16, so the mode would capture nothing
    with pytest.raises(ga.ConfigError) as err:
        ga.CompileConfig(
            cudagraph_mode="FULL_DECODE_ONLY", cudagraph_capture_sizes=(8, 16), max_num_seqs=4
        )
    assert str(err.value) == (
        "cudagraph_mode FULL_DECODE_ONLY captures graphs for decode batches only, of at most "
        "max_num_seqs=4 requests, and needs a capture size <= 4; got "
        "cudagraph_capture_sizes=[8, 16]"
    )
    ok = ga.CompileConfig(
        cudagraph_mode="FULL_DECODE_ONLY", cudagraph_capture_sizes=(4, 16), max_num_seqs=4
    )
    assert ok.has_decode_capture_size()
    for mode in ("FULL", "PIECEWISE", "FULL_AND_PIECEWISE"):  # these have graphs for 8 and 16
        cfg = ga.CompileConfig(cudagraph_mode=mode, cudagraph_capture_sizes=(8, 16), max_num_seqs=4)
        assert not cfg.has_decode_capture_size()
    assert ga.CompileConfig(max_num_seqs=4).has_decode_capture_size()  # the default sizes


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


def test_paths_and_sizes_without_graphs():
    from pathlib import Path

    cfg = ga.CompileConfig(
        cache_dir=Path("/tmp/x"), cudagraph_mode="NONE", cudagraph_capture_sizes=()
    )
    assert cfg.cache_dir == "/tmp/x" and cfg.cudagraph_capture_sizes == ()


def test_config_must_be_a_compile_config():
    with pytest.raises(ga.ConfigError, match=r"config must be a CompileConfig .* got dict"):
        ga.CompileConfig.from_kwargs({"max_num_seqs": 4})
    with pytest.raises(ga.ConfigError, match=r"unknown CompileConfig field\(s\) \['seed'\]"):
        ga.CompileConfig.from_kwargs(None, seed=1)  # it configured nothing, and is gone


@pytest.mark.parametrize("raw, expected", [("", False), ("0", False), ("1", True), ("no", None)])
def test_debug_variable(monkeypatch, raw, expected):
    monkeypatch.setenv("GRAPHATTN_DEBUG", raw)
    if expected is None:
        with pytest.raises(ga.ConfigError, match="GRAPHATTN_DEBUG must be 0 or 1, got 'no'"):
            ga.CompileConfig()
    else:
        assert ga.CompileConfig().debug is expected


@pytest.mark.parametrize(
    "requested, declared, expected",
    [
        (None, 2048, (2048, "the model's max_position_embeddings")),
        (None, 131072, (8192, "the default")),
        (None, None, (8192, "the default")),
        (1024, 2048, (1024, "set")),
        (2048, 2048, (2048, "set")),
        (4096, 2048, None),
    ],
)
def test_max_model_len_against_the_model(requested, declared, expected):
    cfg = ga.CompileConfig(max_model_len=requested)
    if expected is None:
        with pytest.raises(ga.ConfigError, match="max_model_len=4096 exceeds the model's max_pos"):
            cfg.resolved_max_model_len(declared)
    else:
        assert cfg.resolved_max_model_len(declared) == expected
    if requested is None:
        with pytest.raises(ga.ConfigError, match="resolved by the engine"):
            _ = cfg.max_blocks_per_seq

"""Compiling graphattn's Triton kernels ahead of a capture (graphattn/kernels/precompile.py).

On the CPU: the variable, the states in which nothing is held back, and the launch hook
(against a stand-in for Triton's launch); the compile phase's dry run is tested in
test_passes.py. On CUDA: engines built in fresh processes with empty Triton caches, with
and without the pool, count the compiles a real launch had to make in each start-up phase.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

import graphattn as ga
from graphattn import envs
from graphattn.kernels import precompile, triton_import_error

needs_triton = pytest.mark.skipif(triton_import_error() is not None, reason="needs Triton")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(None, 8), ("", 8), ("0", 0), ("1", 1), ("3", 3), ("100000", None)],
)
def test_threads_variable(monkeypatch, raw, expected):
    if raw is None:
        monkeypatch.delenv("GRAPHATTN_PRECOMPILE_THREADS", raising=False)
    else:
        monkeypatch.setenv("GRAPHATTN_PRECOMPILE_THREADS", raw)
    cpus = os.cpu_count() or 1
    want = min(cpus, 100000 if expected is None else expected)
    assert envs.precompile_threads() == want


@pytest.mark.parametrize("raw", ["-1", "two", "1.5"])
def test_a_bad_threads_variable_fails_before_anything_is_allocated(monkeypatch, raw):
    from graphattn.models import LlamaConfig, LlamaForCausalLM

    monkeypatch.setenv("GRAPHATTN_PRECOMPILE_THREADS", raw)
    model = LlamaForCausalLM(LlamaConfig.tiny())
    with pytest.raises(
        ga.ConfigError, match=rf"GRAPHATTN_PRECOMPILE_THREADS must be an int >= 0, got '{raw}'"
    ):
        ga.compile(model, cudagraph_mode="NONE", compile_backend="none", num_blocks=16)


def test_off_skipped_and_unavailable_hold_nothing_back():
    with precompile.compile_ahead(torch.device("cuda", 0), 1) as report:
        assert not report.active
    assert report.as_dict() == {"status": "off: GRAPHATTN_PRECOMPILE_THREADS < 2"}
    with precompile.compile_ahead(torch.device("cuda", 0), 8, skip="a reason") as report:
        assert not report.active
    assert report.as_dict() == {"status": "skipped: a reason"}
    with precompile.compile_ahead(torch.device("cpu"), 8) as report:
        assert not report.active
    assert report.status == "unavailable: kernels compile only for CUDA devices, got cpu"


def test_a_warm_compile_skips_the_pool():
    from graphattn.engine import _precompile_skip

    def compiled(warm):
        return types.SimpleNamespace(info=types.SimpleNamespace(warm=warm))

    assert _precompile_skip(None) is None  # no compile: nothing says Triton's cache is warm
    assert _precompile_skip(compiled(False)) is None
    assert _precompile_skip(compiled(True)).startswith("a warm compile")


def test_a_dry_warm_up_that_raises_leaves_the_capture_to_compile_as_before(monkeypatch):
    """The capture goes on (every key warmed up and captured for real) and the report says
    why the pool stopped."""
    import contextlib

    import graphattn.runner as runner_module
    from graphattn.runner import ModelRunner

    @contextlib.contextmanager
    def ahead(device, threads, skip):
        yield precompile.PrecompileReport("on", threads=threads)

    monkeypatch.setattr(runner_module, "compile_ahead", ahead)
    done = []

    def warm_up(mode, key, times=1):
        if not done:
            done.append("dry")
            raise ValueError("nan in a routing op")
        done.append(("warm", key, times))
        return key

    fake = types.SimpleNamespace(
        device=torch.device("cuda", 0),
        precompile_threads=4,
        precompile_skip=None,
        _warm_up=warm_up,
        run=lambda plan, capturing: done.append(("capture", plan, capturing)),
    )
    ModelRunner.capture_graphs(fake, [("FULL", "k1"), ("FULL", "k2")], warmups=2)
    assert done == [
        "dry",
        ("warm", "k1", 2),
        ("capture", "k1", True),
        ("warm", "k2", 2),
        ("capture", "k2", True),
    ]
    assert fake.precompile.status == "stopped: a dry warm-up raised ValueError: nan in a routing op"
    assert fake.precompile.as_dict() == {"status": fake.precompile.status}


@needs_triton
def test_the_hook_turns_graphattn_launches_into_compiles_and_is_undone(monkeypatch):
    """Inside: a launch of a kernel defined in graphattn goes down the warm-up path (compile,
    no launch); another module's launch is untouched; leaving restores Triton's launch, also
    when the body raises."""
    from triton.runtime.jit import JITFunction

    calls = []

    def launch(self, *args, grid, warmup, **kwargs):  # stands in for Triton's
        calls.append((self.fn.__module__, warmup))

    monkeypatch.setattr(JITFunction, "run", launch)
    monkeypatch.setattr(precompile, "unavailable_reason", lambda device: None)
    ours = types.SimpleNamespace(fn=types.SimpleNamespace(__module__="graphattn.kernels.gemv"))
    theirs = types.SimpleNamespace(fn=types.SimpleNamespace(__module__="torch._inductor.x"))
    with precompile.compile_ahead(torch.device("cuda", 0), 2) as report:
        assert report.active and JITFunction.run is not launch
        JITFunction.run(ours, 1, grid=(1,), warmup=False)
        JITFunction.run(theirs, 1, grid=(1,), warmup=False)
        JITFunction.run(ours, 1, grid=(1,), warmup=True)
    assert calls == [
        ("graphattn.kernels.gemv", True),
        ("torch._inductor.x", False),
        ("graphattn.kernels.gemv", True),
    ]
    assert report.launches == 1 and report.compiled == 0 and report.seconds > 0
    assert JITFunction.run is launch
    with (
        pytest.raises(RuntimeError, match="boom"),
        precompile.compile_ahead(torch.device("cuda", 0), 2),
    ):
        raise RuntimeError("boom")
    assert JITFunction.run is launch


@needs_triton
def test_a_failed_compile_is_reported_and_left_to_the_real_launch():
    report = precompile.PrecompileReport("on", threads=2)
    pool = precompile._CompileAndLoad(2, 0, report)
    try:

        def fails():
            raise ValueError("no such tile")

        future = pool.submit(fails)
        with pytest.raises(ValueError, match="no such tile"):
            future.result()
    finally:
        pool.shutdown()
    assert report.errors == ["ValueError: no such tile"]
    assert report.as_dict()["errors"] == ["ValueError: no such tile"]


def test_ptxas_is_left_alone_off_cuda(monkeypatch):
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    assert precompile.pin_ptxas(torch.device("cpu")) == (
        "not pinned: kernels compile only for CUDA devices, got cpu"
    )
    assert "TRITON_PTXAS_PATH" not in os.environ


@pytest.mark.parametrize(
    ("torch_ships", "expected"),
    [
        ("/torch/bin/ptxas", "TRITON_PTXAS_PATH=/torch/bin/ptxas"),
        (None, "Triton's own (torch ships none)"),
    ],
)
def test_ptxas_is_inductors_choice_made_first(monkeypatch, torch_ships, expected):
    """On CUDA the engine makes Inductor's ptxas choice before anything compiles, so every
    process keys Triton's cache alike (against a stand-in for Inductor's function)."""
    from torch._inductor.runtime import compile_tasks

    calls = []

    def inductors_choice():
        calls.append(1)
        if torch_ships is not None and "TRITON_PTXAS_PATH" not in os.environ:
            os.environ["TRITON_PTXAS_PATH"] = torch_ships

    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    monkeypatch.setattr(compile_tasks, "_set_triton_ptxas_path", inductors_choice)
    assert precompile.pin_ptxas(torch.device("cuda", 0)) == expected
    assert calls == [1]
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/mine/ptxas")  # the user's variable stays
    assert precompile.pin_ptxas(torch.device("cuda")) == "TRITON_PTXAS_PATH=/mine/ptxas"


def test_ptxas_without_inductors_function_is_reported(monkeypatch):
    from torch._inductor.runtime import compile_tasks

    monkeypatch.delattr(compile_tasks, "_set_triton_ptxas_path")
    line = precompile.pin_ptxas(torch.device("cuda"))
    assert line == f"not pinned: torch {torch.__version__} has no _set_triton_ptxas_path"


_BUILD = textwrap.dedent(
    """
    import json, torch
    from triton.runtime.jit import JITFunction
    import graphattn as ga
    from graphattn.models import LlamaConfig, LlamaForCausalLM, init_random_weights
    from graphattn.runner import ModelRunner

    # compiles that a real launch of one of graphattn's kernels had to make, by phase
    lazy = {"compile": [], "capture": []}
    phase = ["compile"]
    compile_one = JITFunction._do_compile

    def counting(self, key, signature, device, constexprs, options, attrs, warmup):
        if not warmup and self.fn.__module__.startswith("graphattn."):
            lazy[phase[0]].append(self.fn.__name__)
        return compile_one(self, key, signature, device, constexprs, options, attrs, warmup)

    capture = ModelRunner.capture_graphs

    def capturing(self, *args, **kwargs):
        phase[0] = "capture"
        return capture(self, *args, **kwargs)

    JITFunction._do_compile = counting
    ModelRunner.capture_graphs = capturing
    torch.manual_seed(0)
    cfg = LlamaConfig.tiny(num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                           num_attention_heads=8, num_key_value_heads=2)
    model = init_random_weights(LlamaForCausalLM(cfg), seed=2).to("cuda", torch.bfloat16)
    engine = ga.compile(model, cudagraph_mode="FULL_AND_PIECEWISE", cudagraph_capture_sizes=[1, 2, 4, 8],
                        max_num_seqs=8, max_num_tokens=64, max_model_len=128, num_blocks=64)
    print(json.dumps({"precompile": engine.report.capture["kernel_precompile"],
                      "compile_precompile": engine.report.compile["kernel_precompile"],
                      "warm": engine.report.compile["warm"],
                      "compile_s": engine.report.compile["seconds"],
                      "capture_s": engine.report.capture["seconds"], "lazy": lazy,
                      "ptxas": engine.report.kernels["ptxas"]}))
    """
)


def _build_in_a_process(root, threads: int) -> dict:
    """The engine built in a fresh process whose caches all live under ``root``."""
    env = os.environ | {
        "GRAPHATTN_PRECOMPILE_THREADS": str(threads),
        "TRITON_CACHE_DIR": str(root / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "GRAPHATTN_CACHE_DIR": str(root / "graphattn"),
    }
    out = subprocess.run(
        [sys.executable, "-c", _BUILD], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_a_cold_start_compiles_every_graphattn_kernel_on_the_pool(tmp_path):
    """With the pool, no real launch compiles one of graphattn's kernels: the compile
    phase's dry run (its run through the pieces and the one-token build) and the capture's
    dry warm-ups found every specialisation they need. Without the pool each compiles at its
    first launch, in both phases. A second, warm start skips the pool in both, and compiles
    nothing: Triton's cache holds every kernel the first wrote."""
    from triton.runtime.jit import JITFunction

    if not hasattr(JITFunction, "_do_compile"):
        pytest.skip("this Triton has no JITFunction._do_compile to count compiles with")
    pooled = _build_in_a_process(tmp_path / "pooled", 4)
    serial = _build_in_a_process(tmp_path / "serial", 0)
    cubins = set((tmp_path / "pooled" / "triton").rglob("*.cubin"))
    again = _build_in_a_process(tmp_path / "pooled", 4)  # warm: the same caches
    # the warm start found every kernel in Triton's cache: it compiled none (round 26: it
    # compiled graphattn's again when Inductor changed the ptxas between the two starts)
    assert set((tmp_path / "pooled" / "triton").rglob("*.cubin")) == cubins
    assert again["ptxas"] == pooled["ptxas"]
    report = pooled["precompile"]
    assert report["status"] == "on" and report["threads"] == 4 and not pooled["warm"]
    assert report["launches"] > 0 and report["compiled"] > 0 and "errors" not in report
    early = pooled["compile_precompile"]
    assert early["status"] == "on" and early["threads"] == 4 and "errors" not in early
    assert early["launches"] > 0 and early["compiled"] > 0
    assert pooled["lazy"] == {"compile": [], "capture": []}
    off = {"status": "off: GRAPHATTN_PRECOMPILE_THREADS < 2"}
    assert serial["precompile"] == serial["compile_precompile"] == off
    assert len(set(serial["lazy"]["compile"])) >= 2  # the one-token GEMVs, ...
    assert len(set(serial["lazy"]["capture"])) >= 3  # attention, reduction, staging, ...
    assert again["warm"] and again["precompile"]["status"].startswith("skipped: a warm compile")
    assert again["compile_precompile"]["status"].startswith("skipped: a warm compile")
    print(
        f"compile {pooled['compile_s']} s with the pool, {serial['compile_s']} s without, "
        f"{again['compile_s']} s warm; capture {pooled['capture_s']} / {serial['capture_s']} / "
        f"{again['capture_s']} s; lazy compiles {pooled['lazy']} / {serial['lazy']}; "
        f"compile-phase pool {early}; ptxas {pooled['ptxas']}"
    )

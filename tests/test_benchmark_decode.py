"""The decode benchmark's plumbing (benchmarks/decode.py) on the CPU: every part writes its
JSON entry, a configuration that cannot run is recorded and the run goes on, the table comes
last, and ``python -m graphattn bench`` reaches the script. Timings here mean nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from graphattn.__main__ import main as graphattn_main

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import decode  # noqa: E402

QUICK = ["--smoke", "--warmup", "1", "--steps", "2", "--trace-steps", "6", "--host-iters", "3"]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One quick smoke run of every part: graphattn eager and the eager baseline only."""
    out = tmp_path_factory.mktemp("bench") / "decode.json"
    args = [*QUICK, "--modes", "eager", "--baselines", "eager", "--out", str(out)]
    args += ["--profile-startup", str(out.parent / "prof")]
    assert decode.main([*args, "--plot", str(out.with_suffix(".png"))]) == 0
    return out, json.loads(out.read_text())


def test_every_part_writes_its_entry(smoke_run):
    out, data = smoke_run
    rows = {r["label"]: r for r in data["latency"]["rows"]}
    assert set(rows) == {"graphattn eager", "baseline eager"}
    for row in rows.values():
        assert row["status"] == "ok"
        assert all(v is not None and v > 0 for v in row["ms"].values())
    assert rows["graphattn eager"]["resolved_mode"] == "NONE"
    trace = data["trace"]["graphattn"]
    assert trace["steps_done"] == 6 and trace["stats"]["captures_after_startup"] == 0
    # the reference runs at the mean batch of the steps the per-step time covers (all 6
    # here: a trace of fewer than 101 steps has no "after 100" window)
    assert trace["fixed_mean_batch"]["batch"] == round(trace["mean_batch_timed"])
    assert trace["mean_batch_timed"] == trace["mean_batch"]
    assert "baseline" not in data["trace"]  # its baseline is reduce-overhead, not selected
    assert data["mixed"]["rows"][0]["tokens_per_s"] > 0
    host = data["host"]["graphattn"]["by_requests"]
    assert set(host) == {"1", "4", "8"}
    assert all(
        r["step_us"]["median"] > 0 and r["step_cloned_us"]["median"] > 0 for r in host.values()
    )
    startup = data["startup"]["graphattn"]
    assert [startup[p]["status"] for p in ("cold", "warm", "warm_no_pyc")] == ["ok"] * 3
    # no Triton kernel compiles on the CPU: every process added no .cubin
    assert [startup[p]["triton_compiles"] for p in ("cold", "warm", "warm_no_pyc")] == [0] * 3
    for process in ("cold", "warm", "warm_no_pyc"):  # --profile-startup: one cProfile text each
        profile = (out.parent / "prof" / f"startup-{process}.txt").read_text()
        assert "function calls" in profile and "engine.py" in profile
    assert data["floor"]["result"]["copy_bytes_per_s"] > 0
    assert data["meta"]["smoke"] and data["errors"] == []
    assert "reduction kernel" in data["meta"]["split_kv_merge"]  # the default, variable unset
    assert "GRAPHATTN_FUSED_SPLIT_MERGE" not in data["meta"]["env"]
    assert out.with_suffix(".png").stat().st_size > 0


def test_cubins_are_counted_through_the_cache_folders(tmp_path):
    """The start-up part's triton_compiles: .cubin files anywhere below Triton's folder."""
    assert decode.count_cubins(tmp_path / "absent") == 0
    for i, name in enumerate(("_gemv_kernel.cubin", "_gemv_kernel.json", "x.cubin")):
        folder = tmp_path / f"HASH{i}"
        folder.mkdir()
        (folder / name).write_bytes(b"")
    assert decode.count_cubins(tmp_path) == 2


def test_an_unavailable_configuration_is_recorded_and_the_run_goes_on(tmp_path):
    out = tmp_path / "decode.json"
    args = [*QUICK, "--parts", "latency", "--modes", "eager", "--baselines", "eager"]
    assert decode.main([*args, "--attention-backend", "NO_SUCH_BACKEND", "--out", str(out)]) == 0
    rows = {r["label"]: r for r in json.loads(out.read_text())["latency"]["rows"]}
    assert rows["graphattn eager"]["status"].startswith("unavailable: BackendSelectionError")
    assert rows["baseline eager"]["status"] == "ok"


def test_bench_subcommand_prints_the_table_last(smoke_run, capsys):
    out, _ = smoke_run
    png = out.parent / "again.png"
    assert graphattn_main(["bench", "--plot-only", str(out), "--plot", str(png)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == decode.SMOKE_NOTE
    assert any(line.startswith("decode step latency") for line in lines)
    assert png.stat().st_size > 0


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="the message of a machine without CUDA"
)
def test_bench_subcommand_says_why_it_stops(capsys):
    """``python -m graphattn bench`` without CUDA (and without --smoke) stops with the
    benchmark's reason on stderr, not silently; a bad option's message comes through too."""
    assert graphattn_main(["bench"]) == 1
    assert "no CUDA device: the full benchmark needs a GPU; use --smoke" in capsys.readouterr().err
    assert graphattn_main(["bench", "--smoke", "--parts", "nonsense"]) == 1
    assert "unknown part(s) ['nonsense']" in capsys.readouterr().err


def test_isolate_runs_each_configuration_in_its_own_process(tmp_path, capsys):
    out = tmp_path / "decode.json"
    args = [*QUICK, "--parts", "floor,latency", "--modes", "eager", "--baselines", "eager"]
    assert decode.main([*args, "--isolate", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {r["label"]: r for r in data["latency"]["rows"]}
    assert set(rows) == {"graphattn eager", "baseline eager"}
    assert all(r["status"] == "ok" and all(v > 0 for v in r["ms"].values()) for r in rows.values())
    assert rows["graphattn eager"]["resolved_mode"] == "NONE"  # the engine entry came along
    assert data["floor"]["result"]["copy_bytes_per_s"] > 0
    assert "own process" in data["meta"]["isolation"] and data["errors"] == []
    pids = data["meta"]["config_pids"]  # three processes, none of them this one
    assert set(pids) == {"floor", "engine:eager", "baselines"}
    assert len(set(pids.values())) == 3 and os.getpid() not in pids.values()
    assert "processes: one per configuration" in capsys.readouterr().out


def test_a_configuration_process_that_fails_is_recorded(tmp_path, monkeypatch):
    out = tmp_path / "decode.json"
    monkeypatch.setattr(sys, "executable", "/bin/false")  # every child exits 1 at once
    args = [*QUICK, "--parts", "floor,latency,trace", "--modes", "eager"]
    args += ["--baselines", "eager,reduce-overhead"]
    assert decode.main([*args, "--isolate", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    status = "unavailable: its process exited 1"
    assert {r["label"]: r["status"] for r in data["latency"]["rows"]} == {
        "graphattn eager": status,
        "baseline eager": status,
        "baseline reduce-overhead": status,
    }
    assert data["trace"]["graphattn"]["status"] == status  # the smoke trace's engine: eager
    assert data["trace"]["baseline"]["status"] == status
    assert data["floor"]["result"] == {"status": status}
    assert [e["where"] for e in data["errors"]] == ["floor", "engine:eager", "baselines"]


def test_graph_count_probe_times_the_target_before_and_after(tmp_path):
    from benchmarks import graph_count

    out = tmp_path / "graph_count.json"
    args = ["--smoke", "--target", "eager", "--before", "eager", "--batches", "1,2"]
    assert graph_count.main([*args, "--target-first", "--replay-piecewise", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["piecewise_steps"] == 0  # the CPU engine has no graphs
    assert data["after"]["eager"] == {"engine_alive": False, "live_cuda_graphs": 0}
    for key in ("target_first_ms", "target_again_ms"):
        assert set(data[key]) == {"1", "2"} and all(v > 0 for v in data[key].values())
    assert set(data["by_batch"]) == {"1", "2"}
    assert all(e["median_ms"] > 0 for e in data["by_batch"].values())


def test_graph_count_prefill_chunks_cover_a_capture_size():
    from benchmarks.graph_count import prefill_chunks

    assert prefill_chunks(256, 512) == [(0, 0, 256)]
    assert prefill_chunks(130, 64) == [(0, 0, 64), (1, 0, 64), (2, 0, 2)]
    assert prefill_chunks(128, 64) == [(0, 0, 64), (1, 0, 64)]


def test_graph_count_critical_path_counts_what_each_kernel_adds_to_the_span():
    """Overlapping kernels (PDL): each adds only the time its end passes the latest end
    before it; a kernel inside another's span adds nothing, idle time is nobody's."""
    from benchmarks.graph_count import critical_path, one_step

    step = [(0.0, 4.0, "stage"), (10.0, 16.0, "gemv"), (12.0, 20.0, "attn"), (13.0, 15.0, "tiny")]
    kernels = step + [(s + 100, e + 100, n) for s, e, n in step]  # two steps
    rows = {r["name"]: r for r in critical_path(kernels, steps=2)}
    assert rows["stage"]["critical_us_per_step"] == 4.0
    assert rows["gemv"]["critical_us_per_step"] == 6.0  # the idle 4..10 is not counted
    assert rows["attn"]["critical_us_per_step"] == 4.0  # 16..20; its 12..16 wait is not
    assert rows["attn"]["us_per_step"] == 8.0
    assert rows["tiny"]["critical_us_per_step"] == 0.0
    span, idle = 20.0, 6.0
    assert sum(r["critical_us_per_step"] for r in rows.values()) == span - idle
    assert [r["name"] for r in critical_path(kernels, 2)][:2] == ["gemv", "stage"]
    middle = one_step(kernels, steps=2)
    assert [r["name"] for r in middle] == ["stage", "gemv", "attn", "tiny"]
    assert middle[0]["start_us"] == 0.0 and middle[2]["end_us"] == 20.0
    assert [r["adds_us"] for r in middle] == [4.0, 6.0, 4.0, 0.0]
    assert one_step(kernels[:-1], steps=2) == []  # steps of unequal kernel counts


@pytest.mark.gpu
def test_graph_count_probe_on_the_gpu(tmp_path):
    """The probe's CUDA path: a FULL engine, dummy graphs, kernels and gaps profiled."""
    from benchmarks import graph_count

    out = tmp_path / "graph_count.json"
    args = ["--smoke", "--target", "FULL", "--target-first", "--dummy-graphs", "20"]
    assert graph_count.main([*args, "--batches", "1", "--out", str(out)]) == 0
    entry = json.loads(out.read_text())["by_batch"]["1"]
    assert entry["median_ms"] > 0 and entry["kernels"] and entry["gaps"]
    assert all(r["per_step"] > 0 for r in entry["kernels"])
    critical = sum(r["critical_us_per_step"] for r in entry["critical"])
    assert 0 < critical <= sum(r["us_per_step"] for r in entry["kernels"]) + 1e-6
    # one step's kernels, where every profiled step had the same count (else none)
    assert {r["name"] for r in entry["one_step"]} <= {r["name"] for r in entry["kernels"]}


@pytest.mark.gpu
def test_latency_profiles_the_first_batch_size_of_a_graph_engine(tmp_path):
    """On CUDA a graph engine's latency row carries its first batch size's kernel summary
    (``kernel_summary``), which the table prints; the other sizes are only timed."""
    out = tmp_path / "decode.json"
    args = ["--smoke", "--parts", "latency", "--modes", "FULL", "--baselines", ""]
    assert decode.main([*args, "--batch-sizes", "1,2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    row = data["latency"]["rows"][0]
    k = row["by_batch"]["1"]["kernels"]
    assert k["steps"] == decode.PROFILED_STEPS and k["kernels_per_step"] >= 5
    assert k["kernel_us_per_step"] > 0 and k["span_us_per_step"] > 0
    assert all(" -> " in g["between"] and g["us_per_step"] > 0 for g in k["largest_gaps"])
    assert 100 < row["by_batch"]["1"]["sm_clock_mhz"] < 5000  # MHz, read after the timed steps
    assert "kernels" not in row["by_batch"]["2"]
    assert any("per profiled step" in line for line in decode.table_latency(data))


@pytest.mark.gpu
def test_graph_count_probe_replays_every_piecewise_size(tmp_path):
    from benchmarks import graph_count

    out = tmp_path / "graph_count.json"
    args = ["--smoke", "--target", "FULL_AND_PIECEWISE", "--replay-piecewise", "--batches", "1"]
    assert graph_count.main([*args, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["piecewise_steps"] > 1  # every capture size but 1 (a decode: FULL) replayed
    assert data["by_batch"]["1"]["median_ms"] > 0


def _fake_python(tmp_path, body: str) -> str:
    """An executable that stands in for sys.executable: runs ``body`` (Python) with the
    arguments decode.py gives a configuration's process."""
    script = tmp_path / "fake_child.py"
    script.write_text(body)
    wrapper = tmp_path / "fake_python"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def test_a_configuration_process_that_hangs_is_killed(tmp_path, monkeypatch):
    out = tmp_path / "decode.json"
    monkeypatch.setattr(sys, "executable", _fake_python(tmp_path, "import time\ntime.sleep(60)\n"))
    args = [*QUICK, "--parts", "latency", "--modes", "eager", "--baselines", "eager"]
    assert decode.main([*args, "--isolate", "--config-timeout", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    status = "unavailable: no answer within --config-timeout 1 s"
    assert {r["label"]: r["status"] for r in data["latency"]["rows"]} == {
        "graphattn eager": status,
        "baseline eager": status,
    }
    assert data["meta"]["settings"]["config_timeout_s"] == 1.0


def test_what_a_failed_process_wrote_is_kept(tmp_path, monkeypatch):
    """A process that wrote its engine's latency row and then died: the row is kept, the
    parts it did not write are marked, and the error says it wrote first."""
    body = """import json, sys
spec = json.loads(sys.argv[sys.argv.index("--config-child") + 1])
out = sys.argv[sys.argv.index("--out") + 1]
if spec["job"] == "engine:eager":
    row = {"label": "graphattn eager", "status": "ok", "ms": {"1": 1.5, "4": 2.5}}
    json.dump({"meta": {}, "errors": [], "latency": {"rows": [row]}}, open(out, "w"))
sys.exit(3)
"""
    monkeypatch.setattr(sys, "executable", _fake_python(tmp_path, body))
    out = tmp_path / "decode.json"
    args = [*QUICK, "--parts", "latency,trace", "--modes", "eager", "--baselines", "eager"]
    assert decode.main([*args, "--isolate", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {r["label"]: r for r in data["latency"]["rows"]}
    assert rows["graphattn eager"]["ms"] == {"1": 1.5, "4": 2.5}  # merged, not overwritten
    assert rows["baseline eager"]["status"] == "unavailable: its process exited 3"
    assert data["trace"]["graphattn"]["status"] == (
        "unavailable: its process exited 3 after writing what it measured"
    )
    assert [e["where"] for e in data["errors"]] == ["engine:eager", "baselines"]


def test_a_trace_stopped_by_the_timeout_says_how_long_it_ran(tmp_path, monkeypatch):
    """The baselines' process saves its trace row as running before the trace; when the
    process is then killed at --config-timeout, the row says so and how long it had run."""
    body = """import json, sys, time
spec = json.loads(sys.argv[sys.argv.index("--config-child") + 1])
out = sys.argv[sys.argv.index("--out") + 1]
if spec["job"] == "baselines":
    sofar = {"steps_done": 3, "first_step_s": 81.25, "first_100_s": None, "elapsed_s": 90.0}
    row = {"label": "baseline", "status": "running", "began_s": 0.0, "progress": sofar}
    json.dump({"meta": {}, "errors": [], "trace": {"baseline": row}}, open(out, "w"))
    time.sleep(60)
"""
    monkeypatch.setattr(sys, "executable", _fake_python(tmp_path, body))
    out = tmp_path / "decode.json"
    args = [*QUICK, "--parts", "trace", "--modes", "eager", "--baselines", "reduce-overhead"]
    assert decode.main([*args, "--isolate", "--config-timeout", "1", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["trace"]["baseline"]
    status = "unavailable: no answer within --config-timeout 1 s: stopped "
    assert row["status"].startswith(status) and row["status"].endswith(
        " s into the trace, before it ended (3 step(s) done, the first in 81.2 s)"
    )
    assert row["ran_s"] >= 1.0
    assert row["progress"]["steps_done"] == 3  # what the process last saved is kept
    table = "\n".join(decode.table_trace(json.loads(out.read_text())))
    assert "(3 step(s) done, the first in 81.2 s)" in table  # the whole status, not cut


def test_run_trace_reports_progress_for_a_process_stopped_inside_it(monkeypatch):
    """run_trace tells its progress callback how far it got after the first step, at the
    100th, and whenever the last report is older than progress_every_s; its result holds the
    same counts."""
    clock = iter(float(t) for t in range(10_000))
    monkeypatch.setattr(decode.time, "perf_counter", lambda: next(clock))
    seen = []
    out = decode.run_trace(
        lambda i: None, 150, "cpu", budget_s=None, progress=seen.append, progress_every_s=60.0
    )
    assert out["steps_done"] == 150
    assert seen[0]["steps_done"] == 1 and seen[0]["first_100_s"] is None
    at_100 = [p for p in seen if p["steps_done"] == 100]
    assert len(at_100) == 1 and at_100[0]["first_100_s"] == out["first_100_s"]
    # each perf_counter call advances the fake clock one second: reports come about every
    # 60 of them (two calls a step), so a few land between the first and the end
    assert 3 <= len(seen) <= 8
    assert [p["steps_done"] for p in seen] == sorted(p["steps_done"] for p in seen)
    assert all(p["first_step_s"] == out["first_step_s"] for p in seen)


def test_baselines_run_the_trace_last(tmp_path, monkeypatch):
    """The reduce-overhead trace, whose first step overruns any budget, runs after every
    latency baseline, so a time limit cuts it rather than torch.compile's row."""
    calls = []
    monkeypatch.setattr(decode, "build_baseline", lambda model, s, rng: object())
    monkeypatch.setattr(
        decode,
        "baseline_latency",
        lambda base, kind, s, rng, deadline: calls.append(kind) or {"label": kind},
    )
    monkeypatch.setattr(
        decode,
        "baseline_trace_entry",
        # the row is saved as running before the trace starts
        lambda base, s, rng, deadline, res: (
            calls.append(res.data["trace"]["baseline"]["status"]) or {"label": "trace"}
        ),
    )
    s = decode.settings_from_args(
        decode.parse_args(
            [*QUICK, "--parts", "latency,trace", "--baselines", "compile,eager,reduce-overhead"]
        )
    )
    res = decode.Results(tmp_path / "out.json", {})
    decode.run_baselines(None, s, res, decode.Deadline(60.0, 0.0))
    assert calls == ["eager", "reduce-overhead", "compile", decode.RUNNING]
    assert res.data["trace"]["baseline"] == {"label": "trace"}


def test_phase_timers_time_the_graph_replay_inside_the_forward_and_restore_it():
    """The host part times CUDAGraph.replay (the driver's launch) within the forward phase,
    puts it back afterwards, and the table shows it beside the forward without summing it
    into "other"."""
    import torch

    class Runner:
        def prepare_inputs(self):
            return "prepared"

    original = torch.cuda.CUDAGraph.__dict__["replay"]
    runner = Runner()
    with decode.phase_timers(runner) as times:
        assert torch.cuda.CUDAGraph.__dict__["replay"] is not original
        assert runner.prepare_inputs() == "prepared"
        with pytest.raises((TypeError, AttributeError)):  # not a graph; the call is timed
            torch.cuda.CUDAGraph.replay(object())
    assert torch.cuda.CUDAGraph.__dict__["replay"] is original
    assert "prepare_inputs" not in runner.__dict__
    assert len(times["prepare_inputs"]) == 1 and len(times[decode.NESTED_PHASE]) == 1

    phases = {"check_batch": 1.0, "forward": 50.0, decode.NESTED_PHASE: 42.5, "other": 3.0}
    step = {"median": 60.0, "p10": 55.25, "p90": 71.5}
    entry = {"step_us": step, "phases_us": phases, "stats": {}}
    data = {"host": {"graphattn": {"label": "x", "by_requests": {"256": entry}}}}
    header, row = decode.table_host(data)[1:3]
    columns, cells = (re.split(r"\s{2,}", line.strip()) for line in (header, row))
    assert "(replay)" in columns
    assert cells[columns.index("forward") + 1] == "42.5"  # the replay column follows forward
    assert cells[columns.index("p10-p90")] == "55.2-71.5"  # the steps' spread beside the median


def test_the_profiled_steps_run_after_every_other_part_of_the_engine(tmp_path, monkeypatch):
    """A torch.profiler session leaves the process's later CUDA calls slower, so the
    latency part's kernel profile runs last in its engine's process, and its kernels land
    in the latency entry as stored."""
    calls = []

    def part(name):
        def run(engine, pool, s, rng):
            calls.append(name)
            by_batch = {str(b): {"median_ms": 1.0} for b in s.batch_sizes}
            return {"by_batch": by_batch} if name == "latency" else {}

        return run

    def profile(engine, pool, s, rng, res, latency):
        calls.append("profile")
        latency["by_batch"]["1"]["kernels"] = {"kernels_per_step": 3.0}

    monkeypatch.setattr(decode, "GRAPHATTN_PARTS", {p: part(p) for p in ("latency", "host")})
    monkeypatch.setattr(decode, "profile_first_batch", profile)
    s = decode.settings_from_args(decode.parse_args([*QUICK, "--batch-sizes", "1,2"]))
    res = decode.Results(tmp_path / "decode.json", {})
    model = decode.build_model(s)
    decode.run_graphattn(model, "eager", ["latency", "host"], s, res, str(tmp_path / "cache"))
    assert calls == ["latency", "host", "profile"]
    saved = json.loads((tmp_path / "decode.json").read_text())
    assert saved["latency"]["rows"][0]["by_batch"]["1"]["kernels"] == {"kernels_per_step": 3.0}


def test_no_profile_without_cuda_graphs(tmp_path):
    """Off CUDA (or without graphs) the latency entry gets no kernel profile."""
    s = decode.settings_from_args(decode.parse_args([*QUICK, "--batch-sizes", "1"]))
    res = decode.Results(tmp_path / "decode.json", {})
    latency = {"label": "x", "by_batch": {"1": {"median_ms": 1.0}}}
    decode.profile_first_batch(None, None, s, None, res, latency)
    assert "kernels" not in latency["by_batch"]["1"] and res.data["errors"] == []


def test_meta_env_records_every_graphattn_and_inductor_variable_but_the_cache_folders():
    environ = {
        "GRAPHATTN_PDL": "0",
        "GRAPHATTN_SOME_EXPERIMENT": "1",  # one an A/B adds, not in any list
        "GRAPHATTN_CACHE_DIR": "/tmp/cache",
        "TORCHINDUCTOR_ENABLE_PDL": "1",
        "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor",
        "PATH": "/usr/bin",
    }
    assert decode.run_variables(environ) == {
        "GRAPHATTN_PDL": "0",
        "GRAPHATTN_SOME_EXPERIMENT": "1",
        "TORCHINDUCTOR_ENABLE_PDL": "1",
    }


def test_kernel_summary_names_where_the_idle_time_is():
    """Two steps of three kernels: an 8 us gap after the staging kernel each step, a 2 us
    gap between the steps, one PDL overlap a step (the attention starts before qkv ends)."""
    kernels = []
    for t in (0.0, 100.0):
        kernels += [
            (t, t + 4, "_stage_kernel"),
            (t + 12, t + 50, "_prologue_gemv_kernel"),
            (t + 40, t + 98, "void at::native::reduce_kernel<512, 1, ReduceOp<float>>"),
        ]
    s = decode.summarize_kernels(kernels, 2)
    assert s["kernels_per_step"] == 3 and s["overlapping_per_step"] == 1
    assert s["idle_us_per_step"] == (8 * 2 + 2) / 2
    assert s["span_us_per_step"] == 198 / 2
    first, second = s["largest_gaps"]
    assert first == {
        "between": "_stage_kernel -> _prologue_gemv_kernel",
        "us_per_step": 8.0,
        "per_step": 1.0,
    }
    assert second["between"] == "void at::native::reduce_kernel<> -> _stage_kernel"
    assert second["us_per_step"] == 1.0 and second["per_step"] == 0.5
    table = decode.kernel_lines(
        [{"label": "graphattn FULL", "by_batch": {"1": {"kernels": s}}}], ["1"]
    )
    assert "idle 8.0 us a step (1.0x) between _stage_kernel -> _prologue_gemv_kernel" in table[1]


def test_sm_clock_is_cycles_over_the_median_time_and_printed_per_row():
    assert decode.clock_mhz(2_000_000, [1.0, 1.25, 1.0]) == 2000.0  # 2M cycles in 1 ms
    assert decode.sm_clock_mhz("cpu") is None
    rows = [
        {"label": "graphattn FULL", "by_batch": {"1": {"sm_clock_mhz": 1980.4}, "8": {}}},
        {"label": "baseline reduce-overhead", "by_batch": {"1": {"median_ms": 1.0}}},
    ]
    assert decode.clock_lines(rows, ["1", "8"]) == [
        "  graphattn FULL: SM clock after the timed steps 1980 / - MHz"
    ]


def test_host_rounds_cut_the_steps_into_near_equal_consecutive_chunks():
    assert decode.host_rounds(200, 5) == [range(i, i + 40) for i in range(0, 200, 40)]
    assert decode.host_rounds(7, 3) == [range(0, 2), range(2, 4), range(4, 7)]
    assert decode.host_rounds(3, 5) == [range(0, 1), range(1, 2), range(2, 3)]  # one step each
    assert decode.host_rounds(0, 5) == []


def test_the_host_part_interleaves_the_sizes_over_its_rounds(monkeypatch):
    """Every round runs a share of every size's steps (plain, cloned, phase-timed), so a
    host that changes speed mid-part cannot land on one size alone; the steps, the rounds'
    medians, the stats and the phases add up over the rounds."""
    import types

    order = []

    class Engine:
        model = types.SimpleNamespace(vocab_size=50)
        runner = types.SimpleNamespace()  # no phases to time

        def step(self, batch, clone=True):
            order.append((batch.num_reqs, clone))

    class Pool:
        block_table = np.zeros((8, 2), dtype=np.int32)
        context = 3

        def decode_batch(self, rows, tokens):
            return types.SimpleNamespace(num_reqs=len(tokens))

    steps = {"n": 0}

    def fake_stats(engine):
        steps["n"] += 1
        return {
            "runtime_modes": {"FULL": steps["n"]},
            "fallbacks": {},
            "steps": steps["n"],
            "recompiles": 0,
            "captures_after_startup": 0,
        }

    monkeypatch.setattr(decode, "stats_of", fake_stats)
    monkeypatch.setattr(decode, "time_batch_building", lambda *a, **k: 1.0)
    s = decode.settings_from_args(decode.parse_args(QUICK + ["--host-sizes", "1,4"]))
    s = dataclasses.replace(s, host_iters=10, device="cpu")
    out = decode.graphattn_host(Engine(), Pool(), s, np.random.default_rng(0))
    timed = order[40:]  # after 20 warm-up steps of each size
    assert order[:40] == [(1, False)] * 20 + [(4, False)] * 20
    rounds = decode.host_rounds(10, decode.HOST_ROUNDS)
    expected = []
    for chunk in rounds:
        for n in (1, 4):
            expected += [(n, False)] * len(chunk) + [(n, True)] * len(chunk)
            expected += [(n, False)] * len(chunk)
    assert timed == expected
    for r in out["by_requests"].values():
        assert len(r["step_us_by_round"]) == len(rounds)
        assert r["step_us"]["median"] > 0 and r["stats"]["runtime_modes"]["FULL"] > 0
        assert r["stats"]["steps"] == 1 + len(rounds)  # the fake counts one per delta


def test_head_in_graph_probe_times_both_and_compares_their_logits(tmp_path):
    from benchmarks import head_in_graph

    out = tmp_path / "head.json"
    assert (
        head_in_graph.main(["--smoke", "--batches", "1,2", "--rounds", "2", "--out", str(out)]) == 0
    )
    data = json.loads(out.read_text())
    for name in ("outside", "inside"):
        assert {b: len(v) for b, v in data["median_ms"][name].items()} == {"1": 2, "2": 2}
    # the same model either way: the wrapper's forward is the model's, then its head
    assert data["agree"] == {
        b: {"max_abs_diff": data["agree"][b]["max_abs_diff"], "same_argmax": True}
        for b in ("1", "2")
    }
    assert all(v["max_abs_diff"] < 0.05 for v in data["agree"].values())
    assert data["kernels"] == {}  # the profile is CUDA's


def test_phase_timers_time_each_phase_of_a_real_step_once():
    """The host part's phases are the functions a step calls: on a real engine's runner,
    one step gives one time each to the checks (the phase named check_batch) and the input
    fill, and the runner module's functions are put back afterwards."""
    from helpers import TableAttentionModel, eager_engine

    import graphattn as ga
    import graphattn.runner

    eng = eager_engine(TableAttentionModel(64, 4, 2, 64, seed=2), cudagraph_mode="NONE")
    blocks = eng.kv_cache.allocate(2)
    batch = ga.Batch.from_requests([ga.Request([3], 0, blocks[:1]), ga.Request([4], 5, blocks[1:])])
    original = graphattn.runner.__dict__[decode._CHECK_FUNCTION]
    with decode.phase_timers(eng.runner) as times:
        eng.step(batch)
    assert len(times["check_batch"]) == 1 and len(times["prepare_inputs"]) == 1
    assert len(times["forward"]) == 1
    assert graphattn.runner.__dict__[decode._CHECK_FUNCTION] is original
    assert "prepare_inputs" not in eng.runner.__dict__

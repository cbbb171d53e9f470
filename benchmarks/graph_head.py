"""What the head of a FULL graph costs: the input staging and the copies-done event (CUDA).

A FULL graph starts with the step's input copies and an external event the next step's
host waits on before it overwrites the pinned buffers (``ModelRunner.full_graph_prologue``).
The decode profile shows ~8 us between the staging kernel and the model's first kernel
(docs/performance-history.md, round 15). This probe times graphs that differ only in their head,
each followed by the same chain of small dependent kernels:

- ``chain``: the chain alone;
- ``stage``: the staging kernel (``kernels/stage_inputs.py``), then the chain;
- ``stage_event``: the staging kernel, the external event on the same stream (the library);
- ``stage_event_branch``: the event recorded on a second stream that forks after the
  staging kernel and joins after the chain;
- ``copies_event``: the memcpy copies (``GRAPHATTN_INPUT_STAGING=copies``) and the event.

The buffers are ``graphattn.buffers.InputBuffers`` at batch 1 (one token, one request, a
512-token context's block table). Each sample replays one graph ``--replays`` times back to
back between two CUDA events (per-replay microseconds); the variants alternate, samples
``--rounds`` times; medians are reported, and each variant's difference to ``chain``.

Paced (the variants with the event): the loop the runner makes, where the host waits for
the event of the replay before, works ``--host-us`` (a busy wait), then replays. Where the
event completes soon after the staging, that work hides under the rest of the graph and a
paced replay takes what a back-to-back one does; where it completes late (at the graph's
end), the host's work adds to every replay.

    python benchmarks/graph_head.py --out $OUT/graph_head.json     # CUDA, about 20 s
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

from graphattn.buffers import InputBuffers

VARIANTS = ("chain", "stage", "stage_event", "stage_event_branch", "copies_event")


def head(name: str, buffers: InputBuffers, done: torch.cuda.Event, branch: torch.cuda.Stream):
    """The graph head of ``name``: a callable captured before the chain, returning the one
    captured after it (or None)."""

    def run() -> Callable[[], None] | None:
        main = torch.cuda.current_stream()
        if name == "chain":
            return None
        if name == "copies_event":
            buffers.copy_to_device(1, 1)
        else:
            buffers.stage_to_device(1, 1)
        if name in ("stage_event", "copies_event"):
            done.record(main)
        elif name == "stage_event_branch":
            branch.wait_stream(main)
            done.record(branch)
            return lambda: main.wait_stream(branch)
        return None

    return run


def capture(name: str, buffers, done, branch, x: torch.Tensor, kernels: int):
    graph = torch.cuda.CUDAGraph()
    start = head(name, buffers, done, branch)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up the kernels outside the graph (Triton compiles here)
            start()
            x.mul_(0.5)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            finish = start()
            for _ in range(kernels):
                x.mul_(0.5).add_(1.0)
            if finish is not None:
                finish()
    torch.cuda.synchronize()
    return graph


def sample(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Microseconds per replay over ``replays`` back-to-back replays."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1e3 / replays


def sample_paced(
    graph: torch.cuda.CUDAGraph, replays: int, done: torch.cuda.Event, host_us: float
) -> float:
    """Microseconds per replay when the host waits for ``done`` (recorded by the replay
    before) and then works ``host_us`` before each replay."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        done.synchronize()
        until = time.perf_counter() + host_us * 1e-6
        while time.perf_counter() < until:
            pass
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1e3 / replays


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kernels", type=int, default=16, help="pairs of small kernels after the head")
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--host-us", type=float, default=10.0, help="host work per paced replay")
    p.add_argument("--out", help="JSON path")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_head.py measures CUDA graphs; no CUDA device here", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    buffers = InputBuffers(64, 8, 33, [1], device)
    buffers.input_ids.np[:1] = 7
    buffers.positions.np[:1] = 512
    buffers.slot_mapping.np[:1] = 512
    buffers.query_start_loc.np[:2] = (0, 1)
    buffers.seq_lens.np[:1] = 513
    buffers.block_tables[1].np[0] = range(33)
    done = torch.cuda.Event(external=True)
    branch = torch.cuda.Stream()
    x = torch.randn(1024, device=device)
    graphs = {n: capture(n, buffers, done, branch, x, a.kernels) for n in VARIANTS}
    for g in graphs.values():  # warm-up replays
        sample(g, 20)
    samples: dict[str, list[float]] = {n: [] for n in VARIANTS}
    for r in range(a.rounds):
        order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
        for n in order:
            samples[n].append(sample(graphs[n], a.replays))
    paced_variants = [n for n in VARIANTS if "event" in n]
    paced: dict[str, list[float]] = {n: [] for n in paced_variants}
    for r in range(a.rounds):
        order = paced_variants if r % 2 == 0 else paced_variants[::-1]
        for n in order:
            paced[n].append(sample_paced(graphs[n], a.replays, done, a.host_us))
    buffers.input_ids.gpu.zero_()
    buffers.seq_lens.gpu.zero_()
    graphs["stage_event"].replay()  # the staged values arrive (the variants' graphs stage them)
    staged = buffers.input_ids.gpu[:1].item(), buffers.seq_lens.gpu[:1].item()
    med = {n: statistics.median(v) for n, v in samples.items()}
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "kernels_after_head": 2 * a.kernels,
        "replays": a.replays,
        "rounds": a.rounds,
        "us_per_replay_median": med,
        "us_over_chain": {n: med[n] - med["chain"] for n in VARIANTS},
        "us_per_replay_samples": samples,
        "paced_host_us": a.host_us,
        "paced_us_per_replay_median": {n: statistics.median(v) for n, v in paced.items()},
        "paced_us_per_replay_samples": paced,
        "staged_check": {"input_ids": staged[0], "seq_lens": staged[1]},
    }
    print(
        f"graph head probe: {result['gpu']}, {2 * a.kernels} kernels after the head, "
        f"{a.replays} replays x {a.rounds} rounds"
    )
    for n in VARIANTS:
        lo, hi = min(samples[n]), max(samples[n])
        print(
            f"  {n:20s} {med[n]:8.2f} us/replay  (+{med[n] - med['chain']:6.2f} over chain; "
            f"{lo:.2f}-{hi:.2f})"
        )
    print(f"  paced: the host waits for the event, works {a.host_us:.0f} us, replays")
    for n in paced_variants:
        m = result["paced_us_per_replay_median"][n]
        print(f"  {n:20s} {m:8.2f} us/replay  (+{m - med[n]:6.2f} over back to back)")
    if staged != (7, 513):
        print(f"staged values wrong: {staged}", file=sys.stderr)
        return 1
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

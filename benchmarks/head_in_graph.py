"""Does the head belong inside the FULL graph? (CUDA)

The decode benchmark's graphattn step is ``engine.step`` (one CUDA graph at batch 1 that
ends with the final RMSNorm), then ``compute_logits`` (the head's one-row GEMV, launched
eagerly after the graph) and the greedy argmax. reduce-overhead captures its head and
argmax with the rest. This probe times the same Llama two ways in one process, alternated:

- ``outside``: the benchmark's step;
- ``inside``: a wrapper whose ``forward`` ends with the head, so ``engine.step`` returns
  logits; the head's GEMV is then a node of the graph, launched with PDL, with the final
  norm's residual add and RMSNorm in its prologue (the ``rms_norm_gemv`` pass).

Each variant is its own engine (FULL, capture sizes ``--batches``), the model and the
requests the decode benchmark's (``benchmarks/decode.py``).

Measured in round 39 (docs/results/head-in-graph-round39-h200.log): the head inside is
2-3 us slower at batch 1 and 2 us at batch 8 (6 us with the o_proj fold), so it stays
outside. Its prologue GEMV does the norm again in each of its 16,032 programs (8 rows
each, for a 128,256-row head): the residual, the hidden row and the norm weight for every
K tile, about 190 MB of L2 reads beside the head's 525 MB.

    python benchmarks/head_in_graph.py --batches 1,8 --rounds 3
    python benchmarks/head_in_graph.py --smoke   # CPU plumbing
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

import graphattn as ga

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))
from benchmarks import decode as D  # noqa: E402


class HeadInForward(nn.Module):
    """``model`` whose forward returns logits (``[T, vocab]``) instead of hidden states."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.vocab_size = model.vocab_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", help="JSON path")
    a = p.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]
    args = ["--parts", "latency", "--baselines", "", "--batch-sizes", a.batches, "--modes", "FULL"]
    s = D.settings_from_args(D.parse_args([*args, *(["--smoke"] if a.smoke else [])]))
    model = D.build_model(s)
    spec = D.ENGINE_SPECS["FULL"]
    kwargs = s.engine_kwargs(spec) | {"cudagraph_capture_sizes": batches}
    engines = {}
    for name, module in (("outside", model), ("inside", HeadInForward(model))):
        engine = ga.compile(module, **kwargs)
        pool = D.RequestPool(engine, s)
        rng = np.random.default_rng(s.seed)
        pool.prefill(engine, list(range(max(batches))), rng, s)
        engines[name] = (engine, pool)
        print(f"{name}: resolved {engine.report.resolved_mode}", flush=True)

    def step_fn(name: str, b: int, tokens: np.ndarray):
        engine, pool = engines[name]
        rows = slice(0, b)

        def step(i: int):
            out = engine.step(pool.decode_batch(rows, tokens[i]), clone=False)
            if name == "outside":
                out = engine.compute_logits(out)
            return ga.greedy(out)

        return step

    rng = np.random.default_rng(1)
    results: dict[str, dict[str, list[float]]] = {n: {str(b): [] for b in batches} for n in engines}
    for r in range(a.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for b in batches:
            tokens = D.random_tokens(rng, model.vocab_size, (s.warmup + s.steps, b))
            for name in order:
                t = D.time_steps(step_fn(name, b, tokens), s.warmup, s.steps, s.device)
                results[name][str(b)].append(t["median_ms"])
                print(f"round {r} bs {b} {name}: {t['median_ms']:.4f} ms", flush=True)
    # the two compute the same logits (the head's input rounded to bf16 on both sides)
    agree = {}
    for b in batches:
        tokens = D.random_tokens(rng, model.vocab_size, (1, b))
        logits = {}
        for name in engines:
            engine, pool = engines[name]
            out = engine.step(pool.decode_batch(slice(0, b), tokens[0]))
            logits[name] = (engine.compute_logits(out) if name == "outside" else out).float()
        o, i = logits["outside"], logits["inside"]
        agree[str(b)] = {
            "max_abs_diff": float((o - i).abs().max()),
            "same_argmax": bool(torch.equal(o.argmax(-1), i.argmax(-1))),
        }
        print(f"bs {b}: logits outside against inside {agree[str(b)]}", flush=True)
    kernels = {}
    if s.device == "cuda":  # last: nothing is timed after the profiler
        for name in engines:
            tokens = D.random_tokens(rng, model.vocab_size, (35, batches[0]))
            step = step_fn(name, batches[0], tokens)
            for i in range(5):
                step(i)
            kernels[name] = D.summarize_kernels(D.device_kernels(step, 5, 30), 30)
            k = kernels[name]
            print(
                f"{name} bs {batches[0]} profiled: {k['kernels_per_step']:.0f} kernels, "
                f"{k['idle_us_per_step']:.1f} us idle, gaps {k['largest_gaps'][:3]}"
            )
    for b in batches:
        o, i = (float(np.median(results[n][str(b)])) for n in ("outside", "inside"))
        print(
            f"bs {b}: outside {o:.4f} ms, inside {i:.4f} ms, inside - outside {1e3 * (i - o):+.1f} us"
        )
    if a.out:
        Path(a.out).write_text(
            json.dumps(
                {"batches": batches, "median_ms": results, "agree": agree, "kernels": kernels},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

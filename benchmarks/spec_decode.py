"""Speculative decoding's verify step under full graphs (``uniform_decode_query_len``).

A verify step scores each request's last token and its k drafts: k + 1 query tokens a
request, logits for every one of them. Three rows per batch size B, on the decode
benchmark's model (Llama-3.2-1B's shape, random weights, bf16, 512 cached tokens a request):

- ``verify FULL``: an engine with ``uniform_decode_query_len=k+1``: the verify batch replays
  a full decode graph, its attention on the decode tiles where one holds a request
  (``TritonImpl.verify_decode_tiles``);
- ``verify FULL, prefill tiles``: the same with that choice off (the tiles of mixed batches);
- ``verify PIECEWISE``: an engine of the default length 1, where the same batch is a mixed
  batch and runs piecewise, on the prefill tiles (what such an engine got before the
  option existed);
- ``decode FULL``: that engine's plain one-token decode step of B requests, for scale.

A step is ``engine.step(batch, clone=False)``, ``compute_logits`` over every row and
``ga.greedy``; fresh random tokens every step, CUDA events, the median of ``--steps``
after ``--warmup``, the rows alternated over ``--rounds``. Both engines live in one
process (each with only the sizes it needs). The two verify rows must agree: their logits
are compared once per batch size.

    python benchmarks/spec_decode.py --batches 1,8,32 --k 3 --rounds 2
    python benchmarks/spec_decode.py --smoke     # CPU plumbing, no results
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

import graphattn as ga
from graphattn.attention.backends.triton_attn import TritonImpl

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))
from benchmarks import decode as D  # noqa: E402

ROWS = ("verify FULL", "verify FULL, prefill tiles", "verify PIECEWISE", "decode FULL")
ENGINE_OF = {
    "verify FULL": "spec",
    "verify FULL, prefill tiles": "spec_prefill_tiles",
    "verify PIECEWISE": "plain",
    "decode FULL": "plain",
}


def verify_batch(pool: D.RequestPool, b: int, q: int, tokens: np.ndarray) -> ga.Batch:
    """``b`` requests of ``q`` tokens each at position CONTEXT (tokens: [b * q])."""
    return ga.Batch.from_arrays(
        tokens,
        np.full(b, q, np.int32),
        pool.computed[:b],
        pool.block_table[:b],
        pool.widths[:b],
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--k", type=int, default=3, help="draft tokens a request (k + 1 verified)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", help="JSON path")
    a = p.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]
    q = a.k + 1
    args = ["--parts", "latency", "--baselines", "", "--batch-sizes", a.batches]
    s = D.settings_from_args(D.parse_args([*args, *(["--smoke"] if a.smoke else [])]))
    model = D.build_model(s)
    base = s.engine_kwargs(D.ENGINE_SPECS["FULL_AND_PIECEWISE"]) | {
        "max_num_tokens": max(s.max_num_tokens, q * max(batches))
    }
    verify_sizes = [q * b for b in batches]
    verify = dict(base, uniform_decode_query_len=q, cudagraph_capture_sizes=verify_sizes)
    engines = {"spec": ga.compile(model, **verify)}
    # the tile choice is read when the graphs are captured (inside compile), then per layer
    TritonImpl.verify_decode_tiles = False
    try:
        engines["spec_prefill_tiles"] = ga.compile(model, **verify)
    finally:
        TritonImpl.verify_decode_tiles = True
    for bound in engines["spec_prefill_tiles"].bound.values():
        bound.impl.verify_decode_tiles = False
    engines["plain"] = ga.compile(
        model, **base, cudagraph_capture_sizes=sorted({*batches, *verify_sizes})
    )
    # its verify batches run piecewise, attention eagerly: planned each step, on the prefill
    # tiles as before the option existed (its one-token decodes are not affected)
    for bound in engines["plain"].bound.values():
        bound.impl.verify_decode_tiles = False
    pools = {}
    for name, engine in engines.items():
        pools[name] = D.RequestPool(engine, s)
        pools[name].prefill(engine, list(range(max(batches))), np.random.default_rng(s.seed), s)
        print(f"{name}: resolved {engine.report.resolved_mode}", flush=True)
    spec = engines["spec"]

    def step_fn(row: str, b: int, tokens: np.ndarray):
        engine, pool = engines[ENGINE_OF[row]], pools[ENGINE_OF[row]]
        if row == "decode FULL":
            return lambda i: ga.greedy(
                engine.compute_logits(engine.step(pool.decode_batch(slice(0, b), tokens[i, :b])))
            )
        return lambda i: ga.greedy(
            engine.compute_logits(engine.step(verify_batch(pool, b, q, tokens[i]), clone=False))
        )

    rng = np.random.default_rng(1)
    results: dict[str, dict[str, list[float]]] = {r: {str(b): [] for b in batches} for r in ROWS}
    modes: dict[str, dict[str, str]] = {r: {} for r in ROWS}
    for r in range(a.rounds):
        order = ROWS if r % 2 == 0 else tuple(reversed(ROWS))
        for b in batches:
            tokens = D.random_tokens(rng, model.vocab_size, (s.warmup + s.steps, b * q))
            for row in order:
                engine = engines[ENGINE_OF[row]]
                before = dict(engine.stats.runtime_modes)
                t = D.time_steps(step_fn(row, b, tokens), s.warmup, s.steps, s.device)
                ran = [m for m, n in engine.stats.runtime_modes.items() if n != before.get(m, 0)]
                modes[row][str(b)] = ",".join(sorted(ran))
                results[row][str(b)].append(t["median_ms"])
                print(f"round {r} bs {b} {row}: {t['median_ms']:.4f} ms ({modes[row][str(b)]})")
    agree = {}
    for b in batches:
        tokens = D.random_tokens(rng, model.vocab_size, b * q)
        logits = {
            n: e.compute_logits(e.step(verify_batch(pools[n], b, q, tokens))).float()
            for n, e in engines.items()
        }
        agree[str(b)] = {
            other: {
                "max_abs_diff": float((logits["spec"] - logits[other]).abs().max()),
                "same_argmax_fraction": float(
                    (logits["spec"].argmax(-1) == logits[other].argmax(-1)).float().mean()
                ),
            }
            for other in ("spec_prefill_tiles", "plain")
        }
    summary = {}
    for b in batches:
        row = {r: float(np.median(results[r][str(b)])) for r in ROWS}
        summary[str(b)] = row
        print(f"bs {b} x {q} tokens: " + ", ".join(f"{r} {ms:.4f} ms" for r, ms in row.items()))
        print(f"  logits against verify FULL: {agree[str(b)]}")
    if a.out:
        Path(a.out).write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name() if s.device == "cuda" else "cpu",
                    "query_len": q,
                    "batches": batches,
                    "median_ms": results,
                    "summary_ms": summary,
                    "runtime_modes": modes,
                    "agree": agree,
                    "spec_capture": spec.report.capture,
                },
                indent=1,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Command line: ``python -m graphattn demo`` and ``python -m graphattn bench`` (benchmarks/decode.py)."""

from __future__ import annotations

import argparse
import logging
import runpy
import sys
import time
from pathlib import Path

import torch


def demo(args: argparse.Namespace) -> None:
    """A tiny random-weight Llama: compile it, generate a few prompts, print the report and speed."""
    import graphattn as ga
    from graphattn.models import LlamaConfig, LlamaForCausalLM, init_random_weights

    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = LlamaConfig.tiny(
        num_hidden_layers=4,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    model = init_random_weights(LlamaForCausalLM(cfg)).to(device, dtype)
    engine = ga.compile(
        model,
        cudagraph_mode=args.mode,
        max_num_seqs=16,
        max_num_tokens=512,
        max_model_len=512,
        num_blocks=256,
    )
    print(engine.report)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
        for n in (5, 17, 33, 64, 9, 100)
    ]
    engine.generate(prompts[:1], 2)  # warm-up
    start = time.perf_counter()
    outputs = engine.generate(prompts, args.new_tokens)
    seconds = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs):
        print(f"prompt of {len(prompt):3d} tokens -> {out[:8]}{' ...' if len(out) > 8 else ''}")
    total = sum(len(o) for o in outputs)
    print(
        f"{total} tokens in {seconds:.2f} s: {total / seconds:.1f} tokens/s "
        f"({len(prompts)} prompts, mode {engine.resolved_mode}, {device})"
    )
    print(f"steps by runtime mode: {dict(engine.stats.runtime_modes)}")


def bench(args: list[str]) -> int:
    """Run benchmarks/decode.py of the source checkout this package was imported from."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "decode.py"
    if not script.is_file():
        print(
            f"graphattn bench runs benchmarks/decode.py from a source checkout, but {script} "
            "does not exist (graphattn was installed without its repository). Clone the "
            "repository, install it with `pip install -e .` and run "
            "`python -m graphattn bench` (or `python benchmarks/decode.py`) there.",
            file=sys.stderr,
        )
        return 2
    saved = sys.argv
    sys.argv = [str(script), *args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # every later argument belongs to benchmarks/decode.py
        return bench(argv[1:])
    parser = argparse.ArgumentParser(prog="graphattn")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="generate with a tiny random-weight Llama")
    p.add_argument("--mode", default="NONE", help="cudagraph mode")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--cpu", action="store_true", help="run on the CPU even if CUDA is present")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=demo)
    sub.add_parser(
        "bench",
        add_help=False,
        help="the decode benchmark (benchmarks/decode.py of a source checkout; "
        "`python -m graphattn bench --help` lists its options)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(name)s %(levelname)s %(message)s",
    )
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

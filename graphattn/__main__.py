"""Command line: ``python -m graphattn demo`` and ``python -m graphattn bench`` (benchmarks/decode.py)."""

from __future__ import annotations

import argparse
import logging
import runpy
import sys
from pathlib import Path

import torch


def demo(args: argparse.Namespace) -> None:
    """A tiny random-weight Llama compiled in each mode: report, fallbacks, speed."""
    from graphattn.demo import run_demo

    if args.modes:
        modes = args.modes
    elif torch.cuda.is_available() and not args.cpu:
        modes = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]
    else:
        modes = ["FULL_AND_PIECEWISE"]  # the default; without CUDA it falls back to NONE
    run_demo(modes, args.new_tokens, args.cpu, args.model)


def _modes(text: str) -> list[str]:
    """``--modes``: known cudagraph mode names, checked before any engine is built."""
    from graphattn.capture.mode import CUDAGraphMode

    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in CUDAGraphMode.__members__]
    if bad or not modes:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated modes among {', '.join(CUDAGraphMode.__members__)}, "
            f"got {text!r}"
        )
    return modes


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


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
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)  # what the interpreter would print for a message
        return 1
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
    p.add_argument(
        "--modes",
        type=_modes,
        default=None,
        help="comma-separated cudagraph modes (default: all five on CUDA, "
        "FULL_AND_PIECEWISE on the CPU)",
    )
    p.add_argument("--new-tokens", type=_positive_int, default=32, help="default 32")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even if CUDA is present")
    p.add_argument(
        "--model",
        choices=("llama", "mla"),
        default="llama",
        help="llama (default) or mla: a DeepSeek-V2-style model on ga.MLAAttention",
    )
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

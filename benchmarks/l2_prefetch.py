"""Does asking L2 for a weight ahead of time make reading it faster? (CUDA)

At batch 1 each layer's attention and split-KV reduction take ~6 us in which the memory is
nearly idle (docs/performance-history.md, round 16). The opt-in pass ``prefetch_next_weight`` asks
L2 for the start of gate_up's weight in that window (``prefetch.global.L2`` from o_proj's
programs, ``kernels/prefetch.py``) and measured no gain in round 13; whether the lines were
still in L2 when gate_up read them was never measured. This probe measures that alone. Each
sample:

1. flushes L2 (a read of a buffer several times its size);
2. runs a head kernel over the first ``MiB`` of a weight-sized buffer W: ``none`` (no head),
   ``prefetch`` (one ``prefetch.global.L2`` per 128-byte line, what graphattn's kernels
   issue), ``prefetch_evict_last`` (the same with the ``::evict_last`` priority),
   ``prefetch_sectors`` (one per 32-byte sector: does a prefetch fill the whole line?) or
   ``load`` (every element loaded, summed into a dummy output so the loads stay);
3. lets the GPU idle ``--idle-us`` (``torch.cuda._sleep``) so the requests can land;
4. times a streaming kernel that reads all of W (each program sums a contiguous
   ``--chunk-kib``, as a one-row GEMV program streams its rows) between two CUDA events.

The variants alternate within each round. Reported per variant and amount: the median of
step 4, its saving against ``none``, and the saving the amount would give if its lines came
from L2 for free (MiB over ``none``'s read bandwidth). On the H200 (round 17,
docs/results/l2-prefetch-h200.log) no prefetch variant moved the read by more than 0.26 us,
and plain loads saved about a fifth of the free amount.

    python benchmarks/l2_prefetch.py --out $OUT/l2_prefetch.json    # CUDA, about 10 s
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton
import triton.language as tl

from graphattn.kernels.prefetch import LINE_BYTES, prefetch_l2

HEADS = ("none", "prefetch", "prefetch_evict_last", "prefetch_sectors", "load")
_MODE = {"prefetch": 0, "prefetch_evict_last": 1, "prefetch_sectors": 2, "load": 3}
LINES_PER_PROGRAM = 64
SECTOR_BYTES = tl.constexpr(32)  # L2 fills and tracks a line in sectors of 32 bytes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--weight-mib", type=int, default=64, help="W's size (gate_up: 64 MiB)")
    p.add_argument("--mib", default="8,16,32", help="amounts the heads touch, comma list")
    p.add_argument("--flush-mib", type=int, default=512, help="the buffer read to flush L2")
    p.add_argument("--idle-us", type=float, default=20.0, help="idle time after the head")
    p.add_argument("--chunk-kib", type=int, default=128, help="bytes of W per streaming program")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--out", help="JSON path")
    return p.parse_args(argv)


@triton.jit
def _prefetch_evict_last(ptrs):
    """``prefetch.global.L2::evict_last`` per pointer: like ``prefetch_l2``, the lines kept
    ahead of normal ones when L2 evicts."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _head_kernel(w_ptr, out_ptr, num_lines, LINES: tl.constexpr, MODE: tl.constexpr):
    """This program's ``LINES`` lines of W from line ``program_id * LINES`` (below
    ``num_lines``): one prefetch per line (MODE 0; 1 with ``::evict_last``), one per 32-byte
    sector (2), or every element loaded and summed (3)."""
    per_line: tl.constexpr = LINE_BYTES * 8 // w_ptr.dtype.element_ty.primitive_bitwidth
    per_sector: tl.constexpr = SECTOR_BYTES * 8 // w_ptr.dtype.element_ty.primitive_bitwidth
    line = tl.program_id(0) * LINES + tl.arange(0, LINES)
    first = w_ptr + tl.minimum(line, num_lines - 1).to(tl.int64) * per_line  # [LINES]
    if MODE == 0:
        prefetch_l2(first)
    elif MODE == 1:
        _prefetch_evict_last(first)
    elif MODE == 2:
        sector = tl.arange(0, per_line // per_sector) * per_sector
        prefetch_l2(first[:, None] + sector[None, :])
    else:
        ok = (line < num_lines)[:, None]
        values = tl.load(first[:, None] + tl.arange(0, per_line)[None, :], mask=ok, other=0.0)
        tl.store(out_ptr + tl.program_id(0), tl.sum(tl.sum(values.to(tl.float32), 1), 0))


@triton.jit
def _stream_kernel(w_ptr, out_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Sum this program's ``CHUNK`` contiguous elements of W in ``BLOCK``-wide loads."""
    base = w_ptr + tl.program_id(0).to(tl.int64) * CHUNK
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, CHUNK, BLOCK):
        acc += tl.load(base + start + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


def sleep_cycles_per_us() -> float:
    """``torch.cuda._sleep`` cycles per microsecond on this GPU, measured."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 2_000_000
    torch.cuda._sleep(cycles)  # warm
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1e3)


class Probe:
    def __init__(self, a: argparse.Namespace) -> None:
        self.w = torch.randn(a.weight_mib << 19, device="cuda").to(torch.bfloat16)
        self.flush = torch.ones(a.flush_mib << 18, device="cuda")  # fp32
        chunk = (a.chunk_kib << 10) // self.w.element_size()
        if self.w.numel() % chunk:
            raise SystemExit(f"--chunk-kib {a.chunk_kib} must divide --weight-mib {a.weight_mib}")
        self.chunk = chunk
        self.stream_out = torch.empty(self.w.numel() // chunk, device="cuda")
        lines = (a.weight_mib << 20) // LINE_BYTES.value
        self.head_out = torch.empty(triton.cdiv(lines, LINES_PER_PROGRAM), device="cuda")
        self.idle_cycles = int(a.idle_us * sleep_cycles_per_us())
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def head(self, name: str, mib: int) -> None:
        if name == "none":
            return
        lines = (mib << 20) // LINE_BYTES.value
        grid = (triton.cdiv(lines, LINES_PER_PROGRAM),)
        _head_kernel[grid](self.w, self.head_out, lines, LINES=LINES_PER_PROGRAM, MODE=_MODE[name])

    def sample(self, name: str, mib: int) -> float:
        """Microseconds of the streaming read of W after flush, head and idle time."""
        self.flush.sum()
        self.head(name, mib)
        torch.cuda._sleep(self.idle_cycles)
        self.start.record()
        _stream_kernel[(self.stream_out.numel(),)](
            self.w, self.stream_out, CHUNK=self.chunk, BLOCK=2048, num_warps=4
        )
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) * 1e3


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        print("l2_prefetch.py: no CUDA device (the heads are PTX prefetches)", file=sys.stderr)
        return 2
    amounts = [int(m) for m in a.mib.split(",") if m]
    if any(not 0 < m <= a.weight_mib for m in amounts):
        raise SystemExit(f"--mib amounts must be in (0, {a.weight_mib}], got {amounts}")
    probe = Probe(a)
    cases = [("none", 0)] + [(h, m) for m in amounts for h in HEADS[1:]]
    for name, mib in cases:  # compile and warm every kernel
        probe.sample(name, mib)
    samples: dict[str, list[float]] = {f"{n} {m}": [] for n, m in cases}
    t0 = time.perf_counter()
    for _ in range(a.rounds):
        for name, mib in cases:
            samples[f"{name} {mib}"].append(probe.sample(name, mib))
    medians = {k: statistics.median(v) for k, v in samples.items()}
    base = medians["none 0"]
    read_bw = (a.weight_mib << 20) / (base * 1e-6)  # bytes per second
    rows = []
    for name, mib in cases[1:]:
        us = medians[f"{name} {mib}"]
        ideal = (mib << 20) / read_bw * 1e6
        rows.append({"head": name, "mib": mib, "us": us, "saved_us": base - us, "ideal_us": ideal})
    device = torch.cuda.get_device_name()
    print(
        f"L2 prefetch probe: {device}, W {a.weight_mib} MiB read in {base:.2f} us "
        f"({read_bw / 1e12:.2f} TB/s) after an L2 flush, {a.idle_us:.0f} us idle after the "
        f"head; medians of {a.rounds} rounds ({time.perf_counter() - t0:.1f} s)"
    )
    print(f"  {'head':22s} {'MiB':>4s} {'read us':>9s} {'saved us':>9s} {'all lines from L2':>18s}")
    for r in rows:
        print(
            f"  {r['head']:22s} {r['mib']:4d} {r['us']:9.2f} {r['saved_us']:9.2f} "
            f"{r['ideal_us']:18.2f}"
        )
    if a.out:
        out = {
            "device": device,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "settings": vars(a),
            "none_us": base,
            "read_tb_per_s": read_bw / 1e12,
            "rows": rows,
            "samples_us": samples,
        }
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

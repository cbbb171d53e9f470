"""Split-KV counts and key tiles for the decode benchmark's attention shape (GPU).

The decode benchmark's model has head size 64 (32 query / 8 KV heads) and 512 cached tokens
per request; ``benchmarks/attention.py`` measures head size 128 at long contexts. This
sweeps the split count and key-tile width of TRITON's decode launch at that shape, with the
same timing (a CUDA graph over rotating input sets larger than L2, median replay) and
marks the split count the backend picks (``choose_num_splits``).

    python benchmarks/decode_splits.py --out $OUT/decode-splits.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import attention as ab  # noqa: E402

BATCHES = (1, 8, 32, 128)
CONTEXT = 512
SPLITS = (1, 2, 4, 8, 16, 32)
TILE_N = (32, 64)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument(
        "--tiles",
        default=";".join(f"16,{n},4,3" for n in TILE_N),
        help="key-tile configurations 'block_m,tile_n,warps,stages;...' (each with every split)",
    )
    p.add_argument("--splits", default=",".join(map(str, SPLITS)))
    a = p.parse_args(argv)
    tiles = [tuple(int(x) for x in t.split(",")) for t in a.tiles.split(";")]
    splits = [int(x) for x in a.splits.split(",")]
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    from graphattn.kernels.attention_plan import choose_num_splits

    ab.HEAD_SIZE = 64  # the decode benchmark's model
    device = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(device).L2_cache_size or ab.DEFAULT_L2
    st = ab.Settings(device, torch.bfloat16, a.reps, False, l2)
    gen = torch.Generator(device=device).manual_seed(0)
    sms = ab.num_sms(device)
    rows = []
    for batch in [int(b) for b in a.batches.split(",")]:
        case = ab.Case("decode", batch, CONTEXT)
        chosen = choose_num_splits(batch, ab.NUM_KV_HEADS, sms)
        configs = [(*t, s) for t in tiles for s in splits]
        for row in ab.run_sweep(case, configs, st, gen):
            row["chosen_splits"] = chosen
            rows.append(row)
            print(
                f"bs {batch:4d} ctx {CONTEXT} {row['variant']:<24} {row.get('us', float('nan')):8.2f} us"
                f"{'  <- backend choice' if row['variant'].endswith(f'split{chosen}') else ''}",
                flush=True,
            )
        ab._release(device)
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows, "num_sms": sms}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

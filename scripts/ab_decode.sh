#!/usr/bin/env bash
# A/B of the decode step between two trees on the GPU machine: FULL latency from
# benchmarks/decode.py, each tree installed in turn and run in its own process, alternated.
#
#   here:        git archive REV | (mkdir -p .scratch/ab-base && tar -x -C .scratch/ab-base)
#   GPU machine: scripts/ab_decode.sh .scratch/ab-base [ROUNDS=3] [BATCHES=1,8]
#                (the device tool: carry .scratch; results under $OUT/ab-{base,this}-N.json)
#   CPU check:   AB_DECODE_ARGS=--smoke scripts/ab_decode.sh .scratch/ab-base 1 1
#
# Prints each run's FULL milliseconds per batch size (AB_DECODE_ARGS: more decode.py
# arguments). Ends with this tree installed.
set -uo pipefail
BASE=$(cd "${1:?usage: scripts/ab_decode.sh BASE_TREE [ROUNDS] [BATCHES]}" 2>/dev/null && pwd) \
  || { echo "no folder $1"; exit 2; }
ROUNDS=${2:-3}
BATCHES=${3:-1,8}
OUT=${OUT:-/tmp/graphattn-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GRAPHATTN_CACHE_DIR=${GRAPHATTN_CACHE_DIR:-/tmp/graphattn-cache}
THIS=$(pwd)
[ -f "$BASE/pyproject.toml" ] || { echo "no checkout at $BASE"; exit 2; }
run() {  # $1 = tree, $2 = label, $3 = round
  (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1) \
    || { echo "install of $1 failed"; return 1; }
  local json="$OUT/ab-$2-$3.json"
  python3 "$1/benchmarks/decode.py" --parts latency --modes FULL --baselines "" \
    --batch-sizes "$BATCHES" --out "$json" ${AB_DECODE_ARGS:-} >/dev/null 2>"$OUT/ab-$2-$3.err" \
    || { tail -5 "$OUT/ab-$2-$3.err"; return 1; }
  python3 - "$json" "$2" "$3" <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
ms = {r["label"]: r["ms"] for r in data["latency"]["rows"]}["graphattn FULL"]
print(f"{sys.argv[2]:5s} round {sys.argv[3]}: FULL ms", {b: round(v, 4) for b, v in ms.items()})
PY
}
status=0
for r in $(seq 1 "$ROUNDS"); do
  run "$BASE" base "$r" || status=1
  run "$THIS" this "$r" || status=1
done
exit $status

#!/usr/bin/env bash
# A/B of the decode step between two trees on the GPU machine: FULL latency from
# benchmarks/decode.py, each tree installed in turn and run in its own process, alternated
# (the base first in odd rounds, this tree first in even ones).
#
#   here:        mkdir -p .scratch/ab-base && git archive REV | tar -x -C .scratch/ab-base \
#                  && git rev-parse REV > .scratch/ab-base/REVISION
#   GPU machine: scripts/ab_decode.sh .scratch/ab-base [ROUNDS=3] [BATCHES=1,8]
#                (the device tool: carry .scratch; results under $OUT/ab-LABEL-N.json, LABEL
#                base, this or an AB_TREES folder's name)
#   CPU check:   AB_DECODE_ARGS=--smoke scripts/ab_decode.sh .scratch/ab-base 1 1
#
# Prints each run's FULL milliseconds per batch size. AB_TREES="DIR ...": more trees (the
# variants of a change), timed between the two and named by their folders.
# AB_DECODE_ARGS: more decode.py arguments. AB_BASELINES=reduce-overhead also times that
# baseline in each run, in its own process, and prints FULL's ratio to it. This tree is
# installed again at the end, whatever failed.
set -uo pipefail
usage="usage: scripts/ab_decode.sh BASE_TREE [ROUNDS] [BATCHES]"
[ $# -ge 1 ] && [ -n "$1" ] || { echo "$usage" >&2; exit 2; }
BASE=$(cd "$1" 2>/dev/null && pwd) || { echo "no folder $1; $usage" >&2; exit 2; }
[ -f "$BASE/pyproject.toml" ] || { echo "no checkout at $BASE (no pyproject.toml)" >&2; exit 2; }
ROUNDS=${2:-3}
BATCHES=${3:-1,8}
THIS=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/graphattn-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GRAPHATTN_CACHE_DIR=${GRAPHATTN_CACHE_DIR:-/tmp/graphattn-cache}
echo "base: $BASE ($(cat "$BASE/REVISION" 2>/dev/null || echo 'revision unknown')); this: $THIS"
install() {  # $1 = tree
  (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e .) \
    >"$OUT/ab-install.log" 2>&1 || { echo "install of $1 failed:" >&2; tail -5 "$OUT/ab-install.log" >&2; return 1; }
}
run() {  # $1 = tree, $2 = label, $3 = round
  install "$1" || return 1
  local json="$OUT/ab-$2-$3.json"
  # The base lies inside this repository: stop git there, or decode.py would record this
  # tree's commit for it.
  GIT_CEILING_DIRECTORIES=$(dirname "$1") python3 "$1/benchmarks/decode.py" --parts latency \
    --modes FULL --baselines "${AB_BASELINES:-}" --batch-sizes "$BATCHES" --out "$json" ${AB_DECODE_ARGS:-} \
    >/dev/null 2>"$OUT/ab-$2-$3.err" || { tail -5 "$OUT/ab-$2-$3.err" >&2; return 1; }
  python3 - "$json" "$2" "$3" <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
rows = {r["label"]: r.get("ms") or {} for r in data["latency"]["rows"]}
ms = rows["graphattn FULL"]
line = f"{sys.argv[2]:5s} round {sys.argv[3]}: FULL ms {({b: round(v, 4) for b, v in ms.items()})}"
base = rows.get("baseline reduce-overhead")
if base:
    ratio = {b: round(v / base[b], 3) for b, v in ms.items() if v and base.get(b)}
    line += f"; reduce-overhead ms {({b: round(v, 4) for b, v in base.items() if v})}; ratio {ratio}"
print(line)
PY
}
# AB_TREES: more trees to time beside the two (variants of a change), each labelled by its
# folder's name, in the order given between base and this (reversed in even rounds).
trees=("$BASE")
labels=(base)
for extra in ${AB_TREES:-}; do
  dir=$(cd "$extra" 2>/dev/null && pwd) || { echo "no folder $extra (AB_TREES)" >&2; exit 2; }
  [ -f "$dir/pyproject.toml" ] || { echo "no checkout at $dir (AB_TREES)" >&2; exit 2; }
  label=$(basename "$dir")
  for taken in base this "${labels[@]}"; do  # each run's JSON is named by its label
    [ "$label" != "$taken" ] || { echo "AB_TREES: a second tree labelled $label" >&2; exit 2; }
  done
  echo "tree $label: $dir ($(cat "$dir/REVISION" 2>/dev/null || echo 'revision unknown'))"
  trees+=("$dir")
  labels+=("$label")
done
trees+=("$THIS")
labels+=(this)
status=0
for r in $(seq 1 "$ROUNDS"); do
  order=$(seq 0 $((${#trees[@]} - 1)))
  [ $((r % 2)) = 1 ] || order=$(echo "$order" | tac)
  for i in $order; do
    run "${trees[$i]}" "${labels[$i]}" "$r" || status=1
  done
done
install "$THIS" || status=1
exit $status

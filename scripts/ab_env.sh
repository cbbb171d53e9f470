#!/usr/bin/env bash
# A/B of the decode step between settings of graphattn's (GRAPHATTN_*) or Inductor's
# (TORCHINDUCTOR_*) environment variables, on this tree: FULL latency from
# benchmarks/decode.py, one process per setting and round, the order reversed in even rounds.
# A setting is a space-separated list of VAR=VALUE ("-" for none).
#
#   scripts/ab_env.sh [ROUNDS=3] [BATCHES=1,8] SETTING...
#   scripts/ab_env.sh 2 1,8,32 - GRAPHATTN_FUSED_SPLIT_MERGE=1 GRAPHATTN_INPUT_STAGING=copies \
#     "GRAPHATTN_FUSED_SPLIT_MERGE=1 GRAPHATTN_INPUT_STAGING=copies"
#   scripts/ab_env.sh 3 1,8 - TORCHINDUCTOR_ENABLE_PDL=1    # Inductor's kernels with PDL too
#   CPU check: AB_DECODE_ARGS=--smoke scripts/ab_env.sh 1 1 - GRAPHATTN_INPUT_STAGING=kernel
#
# Prints each run's FULL milliseconds per batch size; JSON under $OUT/env-N-ROUND.json (N:
# the setting's position). The tree must be installed (device_run.sh does it).
set -uo pipefail
usage="usage: scripts/ab_env.sh ROUNDS BATCHES SETTING..."
[ $# -ge 3 ] || { echo "$usage" >&2; exit 2; }
ROUNDS=$1
BATCHES=$2
shift 2
THIS=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/graphattn-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GRAPHATTN_CACHE_DIR=${GRAPHATTN_CACHE_DIR:-/tmp/graphattn-cache}
settings=("$@")
for s in "${settings[@]}"; do
  [ "$s" = "-" ] && continue
  for pair in $s; do
    [[ "$pair" =~ ^(GRAPHATTN|TORCHINDUCTOR)_[A-Z_]+=[^=]*$ ]] \
      || { echo "not a GRAPHATTN_ or TORCHINDUCTOR_ VAR=VALUE: $pair" >&2; exit 2; }
  done
done
run() {  # $1 = setting index, $2 = round
  local s=${settings[$1]} json="$OUT/env-$1-$2.json" vars=()
  [ "$s" = "-" ] || read -r -a vars <<<"$s"
  env "${vars[@]}" python3 "$THIS/benchmarks/decode.py" --parts latency --modes FULL \
    --baselines "" --batch-sizes "$BATCHES" --out "$json" ${AB_DECODE_ARGS:-} \
    >/dev/null 2>"$OUT/env-$1-$2.err" || { tail -5 "$OUT/env-$1-$2.err" >&2; return 1; }
  python3 - "$json" "$s" "$2" <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
ms = next(r for r in data["latency"]["rows"] if r["label"] == "graphattn FULL").get("ms") or {}
env = data["meta"].get("env", {})
print(f"round {sys.argv[3]} [{sys.argv[2]}] env {env}: FULL ms",
      {b: round(v, 4) for b, v in ms.items() if v})
PY
}
status=0
for r in $(seq 1 "$ROUNDS"); do
  order=$(seq 0 $((${#settings[@]} - 1)))
  [ $((r % 2)) = 1 ] || order=$(echo "$order" | tac)
  for i in $order; do
    run "$i" "$r" || status=1
  done
done
exit $status

#!/usr/bin/env bash
# One call on the GPU machine: install the checkout, then run the named parts, each logging under
# $OUT. Parts: tests (pytest -m gpu; about 700 s since round 38, over one call's limit), tests-1,
# tests-2, tests-3 and tests-4 (the same suite in four calls: files test_[a-f]*, test_[g-z]*, then
# round 40's MLA and speculative-decoding files, which the first two leave out, then round 41's
# DeepSeek-V2 checkpoints in every mode, which tests-2 leaves out), attention
# (benchmarks/attention.py), decode (benchmarks/decode.py), profile (benchmarks/profile_decode.py),
# splits (benchmarks/decode_splits.py), gemv (benchmarks/gemv.py), fused (benchmarks/fused_ops.py),
# pdl (benchmarks/pdl_chain.py), tiles (benchmarks/gemv_tiles.py), l2 (benchmarks/l2_prefetch.py),
# mlp (benchmarks/fused_mlp.py), nodes (benchmarks/graph_nodes.py, GA_NODES_BATCHES), persistent
# (benchmarks/persistent_chain.py), cuda (benchmarks/cuda_chain.py, GA_CUDA_ARGS), trace
# (decode.py's continuous-batching trace alone, with the reduce-overhead baseline given the time the
# full run cannot give it), demo, fold (the o_proj fold's GPU tests, then its A/B at batch 1 and 8),
# spec (benchmarks/spec_decode.py: verify steps with and without uniform_decode_query_len, GA_SPEC_ARGS),
# mla (benchmarks/mla.py: TRITON_MLA's decode and causal kernels and an MLA model's decode step, GA_MLA_ARGS).
# Extra pytest/benchmark arguments come from GA_PYTEST_ARGS and GA_DECODE_ARGS.
#   scripts/device_run.sh tests attention decode
set -uo pipefail
OUT=${OUT:-/tmp/graphattn-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GRAPHATTN_CACHE_DIR=${GRAPHATTN_CACHE_DIR:-/tmp/graphattn-cache}
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv \
  >"$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  >>"$OUT/gpu.txt" 2>&1
status=0
for part in "$@"; do
  start=$(date +%s)
  case "$part" in
    tests) eval "python3 -m pytest -m gpu -q -p no:cacheprovider --durations=15 ${GA_PYTEST_ARGS:-}" 2>&1 \
             | tee "$OUT/gpu-tests.log" | tail -40; rc=${PIPESTATUS[0]} ;;
    tests-1|tests-2|tests-3|tests-4)  # the suite in four calls: it outlasts one call's 600 s
             # tests-3: round 40's MLA and speculative-decoding files; tests-4: round 41's
             # DeepSeek-V2 checkpoints (test_hf_models.py -k deepseek); tests-1 and -2 the rest
             third="tests/test_mla.py tests/test_spec_decode.py tests/test_benchmark_mla.py tests/test_benchmark_spec_decode.py"
             select=""
             case "$part" in
               tests-1) files=$(echo tests/test_[a-f]*.py) ;;
               tests-2) files=$(echo tests/test_[g-z]*.py); select="-k 'not deepseek'" ;;
               tests-3) files=$third ;;
               tests-4) files=tests/test_hf_models.py; select="-k deepseek" ;;
             esac
             case "$part" in tests-1|tests-2) files=$(for f in $files; do case " $third " in *" $f "*) ;; *) echo "$f" ;; esac; done | tr '\n' ' ') ;; esac
             eval "python3 -m pytest -m gpu -q -p no:cacheprovider --durations=15 $files $select ${GA_PYTEST_ARGS:-}" 2>&1 \
             | tee "$OUT/gpu-$part.log" | tail -40; rc=${PIPESTATUS[0]} ;;
    attention) python3 benchmarks/attention.py --out "$OUT/attention.json" 2>&1 \
             | tee "$OUT/attention.log" | tail -40; rc=${PIPESTATUS[0]} ;;
    decode) eval "python3 benchmarks/decode.py --out $OUT/decode.json --plot $OUT/decode.png ${GA_DECODE_ARGS:-}" 2>&1 \
             | tee "$OUT/decode.log" | tail -60; rc=${PIPESTATUS[0]} ;;
    trace) eval "python3 benchmarks/decode.py --out $OUT/decode-trace.json --parts trace --modes FULL_AND_PIECEWISE --baselines reduce-overhead --trace-budget 180 --config-timeout 320 --time-limit 330 ${GA_DECODE_ARGS:-}" 2>&1 \
             | tee "$OUT/decode-trace.log" | tail -40; rc=${PIPESTATUS[0]} ;;
    profile) for b in ${GA_PROFILE_BATCHES:-1 32 256}; do
               python3 benchmarks/profile_decode.py --batch "$b" --host-steps 200 \
                 --out "$OUT/profile-bs$b.json" || exit 1
             done 2>&1 | grep -v "^USDT" | tee "$OUT/profile.log" | tail -120; rc=${PIPESTATUS[0]} ;;
    splits) python3 benchmarks/decode_splits.py --out "$OUT/decode-splits.json" 2>&1 \
             | tee "$OUT/decode-splits.log" | tail -60; rc=${PIPESTATUS[0]} ;;
    gemv) python3 benchmarks/gemv.py --out "$OUT/gemv.json" 2>&1 \
             | tee "$OUT/gemv.log" | tail -60; rc=${PIPESTATUS[0]} ;;
    persistent) python3 benchmarks/persistent_chain.py --layer-scope --rounds 5 \
             --out "$OUT/persistent_chain.json" 2>&1 \
             | tee "$OUT/persistent_chain.log" | tail -40; rc=${PIPESTATUS[0]} ;;
    cuda) eval "python3 benchmarks/cuda_chain.py --out $OUT/cuda_chain.json ${GA_CUDA_ARGS:-}" 2>&1 \
             | tee "$OUT/cuda_chain.log" | tail -40; rc=${PIPESTATUS[0]} ;;
    tiles) python3 benchmarks/gemv_tiles.py --out "$OUT/gemv_tiles.json" 2>&1 \
             | tee "$OUT/gemv_tiles.log" | tail -150; rc=${PIPESTATUS[0]} ;;
    pdl) python3 benchmarks/pdl_chain.py --out "$OUT/pdl_chain.json" 2>&1 \
             | tee "$OUT/pdl_chain.log" | tail -20; rc=${PIPESTATUS[0]} ;;
    fused) python3 benchmarks/fused_ops.py --out "$OUT/fused_ops.json" 2>&1 \
             | tee "$OUT/fused_ops.log" | tail -40; rc=${PIPESTATUS[0]} ;;
    mlp) python3 benchmarks/fused_mlp.py --out "$OUT/fused_mlp.json" 2>&1 \
             | tee "$OUT/fused_mlp.log" | tail -40; rc=${PIPESTATUS[0]} ;;
    l2) python3 benchmarks/l2_prefetch.py --out "$OUT/l2_prefetch.json" 2>&1 \
             | tee "$OUT/l2_prefetch.log" | tail -30; rc=${PIPESTATUS[0]} ;;
    nodes) python3 benchmarks/graph_nodes.py --batches "${GA_NODES_BATCHES:-1,32}" \
             --out "$OUT/graph_nodes.json" 2>&1 | grep -v "^USDT" \
             | tee "$OUT/graph_nodes.log" | tail -80; rc=${PIPESTATUS[0]} ;;
    demo) python3 -m graphattn demo 2>&1 | tee "$OUT/demo.log" | tail -30; rc=${PIPESTATUS[0]} ;;
    mla) eval "python3 benchmarks/mla.py --out $OUT/mla.json ${GA_MLA_ARGS:-}" 2>&1 \
             | tee "$OUT/mla.log" | tail -30; rc=${PIPESTATUS[0]} ;;
    spec) eval "python3 benchmarks/spec_decode.py --out $OUT/spec_decode.json ${GA_SPEC_ARGS:-}" 2>&1 \
             | tee "$OUT/spec_decode.log" | tail -30; rc=${PIPESTATUS[0]} ;;
    fold) { python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_o_proj_fold.py \
              && scripts/ab_env.sh 2 1,8 - GRAPHATTN_FOLD_O_PROJ=1; } 2>&1 \
             | tee "$OUT/o-proj-fold.log" | tail -20; rc=${PIPESTATUS[0]} ;;
    *) echo "unknown part $part"; rc=2 ;;
  esac
  echo "== $part: exit $rc in $(( $(date +%s) - start )) s"
  [ "$rc" = 0 ] || status=$rc
done
cat "$OUT/gpu.txt"
exit $status

#!/usr/bin/env bash
# Device call 1: the staged o_proj microbenchmark (bench_staged.cu), Llama-3.1-8B and Qwen3-0.6B shapes.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvcc -O3 -arch=sm_90a -std=c++17 -I kernels/cuda/common -DACT_BF16 -DWEIGHT_BF16 -DK_BLOCK=256 \
  -DACROSS_SEQUENTIAL docs/experiments/staged-oproj/bench_staged.cu -o /tmp/bench_staged || exit 1
/tmp/bench_staged > "$OUT/staged_call1.json"; rc=$?
cat "$OUT/staged_call1.json"
exit $rc

#!/usr/bin/env bash
# A device round: install, the CUDA tests, then the decode benchmark (KERNELS_BENCH=1: with
# each kernel timed alone). The evidence file comes back under $OUT (a `--record` run appends
# to it there).
# Usage: bash benchmarks/device_round.sh "<pytest -k expr or empty>" "<bench_gpu_decode args>"
set -uo pipefail
OUT=${OUT:-/tmp/out}
bash benchmarks/device_checks.sh --timeout=300 ${1:+-k "$1"} | tail -25
export PYTHONPATH=/tmp/site METRALE_CACHE=/tmp/metrale-cache PYTHONUNBUFFERED=1
python3 benchmarks/bench_gpu_decode.py $2 ${KERNELS_BENCH:+--kernels} 2>&1 \
  | tee "$OUT/bench_decode.log" | grep -v "^    [a-z_]*\[" | tail -60
cp benchmarks/results/gpu_*.json kernels/sm_90/EVIDENCE.toml "$OUT/" 2>/dev/null || true

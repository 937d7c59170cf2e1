#!/usr/bin/env bash
# A device round: install, the CUDA tests, per-kernel bandwidth, then the decode benchmark.
# Usage: bash benchmarks/device_round.sh "<pytest -k expr or empty>" "<bench_gpu_decode args>"
set -uo pipefail
OUT=${OUT:-/tmp/out}
bash benchmarks/device_checks.sh --timeout=300 ${1:+-k "$1"} | tail -25
export PYTHONPATH=/tmp/site METRALE_CACHE=/tmp/metrale-cache PYTHONUNBUFFERED=1
[ -n "${KERNELS_BENCH:-}" ] && python3 benchmarks/bench_gpu_kernels.py qwen3-0.6b llama-3.1-8b 2>&1 \
  | tee "$OUT/bench_kernels.log" | grep -v "^  [a-z_]*\[" | head -40
python3 benchmarks/bench_gpu_decode.py $2 2>&1 | tee "$OUT/bench_decode.log" | tail -12
cp benchmarks/results/gpu_*.json "$OUT/" 2>/dev/null || true

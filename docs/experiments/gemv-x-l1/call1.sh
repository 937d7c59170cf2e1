#!/usr/bin/env bash
# Device call: bf16 GEMVs with the activations read from L1 when used (DOT_X_L1) and more weight
# loads ahead, timed alone (variant sweep) and in whole steps (sweep_gpu_step.sh over gemv.cuh).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site METRALE_CACHE=/tmp/metrale-cache PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
timeout 200 python3 benchmarks/bench_gpu_variants.py --only gemv --weights bf16 2>&1 | tail -60
cp benchmarks/results/gpu_variants_gemv.json "$OUT/" 2>/dev/null
STEP_ARGS="qwen3-0.6b llama-3.1-8b --batches 1,8 --quants bf16 --no-hf" \
  bash benchmarks/sweep_gpu_step.sh gemv.cuh base x8:DOT_X_L1=1,DOT_AHEAD=8 x6:DOT_X_L1=1,DOT_AHEAD=6 base2 2>&1 | grep -v "^$"

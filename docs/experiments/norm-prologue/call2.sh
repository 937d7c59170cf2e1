#!/usr/bin/env bash
# Calls 1 and 2: the norm-prologue kernels' device tests, then exact steps of Qwen3-0.6B against f75a7be.
source docs/experiments/device_setup.sh
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 200 python3 -m pytest tests/cuda/test_kernels_vs_host.py -q -p no:cacheprovider \
  -k "add_rmsnorm or norm_prologue" > "$OUT/tests_norm.log" 2>&1; echo "tests rc $?"
tail -3 "$OUT/tests_norm.log"
echo "t=$(( $(date +%s) - t0 ))"
STEP_ARGS="qwen3-0.6b --batches 1,8 --quants bf16,fp8,mxfp4 --policies exact --no-hf" \
  timeout 380 bash benchmarks/ab_gpu_step.sh run work f75a7be work f75a7be
echo "t=$(( $(date +%s) - t0 ))"

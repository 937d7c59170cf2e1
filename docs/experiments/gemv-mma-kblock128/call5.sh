#!/usr/bin/env bash
# Call 5 (timing only): bounded steps with the tensor-core GEMV in k-blocks of 128 (.ab/kb128:
# gemv_mma.cu redefines K_BLOCK, its tables' shared memory follows) against main.
source docs/experiments/device_setup.sh
t0=$(date +%s)
STEP_ARGS="llama-3.1-8b qwen3-0.6b --batches 1 --quants bf16,mxfp4 --policies bounded --no-hf" \
  timeout 420 bash benchmarks/ab_gpu_step.sh run work kb128 work kb128
echo "t=$(( $(date +%s) - t0 ))"

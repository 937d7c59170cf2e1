#!/usr/bin/env bash
# Run on the device from the repo root, after `bash benchmarks/ab_gpu_step.sh prepare` of the trees it names
# (timing-only trees: copies of prepared ones with timing-only.diff applied); carry [".whl", ".ab"].
# call 3 (timing only, no tests: the hollow trees compute wrong values on purpose)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEP_ARGS="qwen3-0.6b llama-3.1-8b --batches 1 --quants bf16 --no-hf" timeout 500 bash benchmarks/ab_gpu_step.sh run 1a0fce3 hollow e0 e1 4282ce4 1a0fce3

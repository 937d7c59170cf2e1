#!/usr/bin/env bash
# Run on the device from the repo root, after `bash benchmarks/ab_gpu_step.sh prepare` of the trees it names
# (timing-only trees: copies of prepared ones with timing-only.diff applied); carry [".whl", ".ab"].
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site METRALE_CACHE=/tmp/metrale-cache PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
timeout 150 python3 -m pytest tests/cuda/test_kernels_vs_host.py -q -p no:cacheprovider -x -k "linear_add_rmsnorm" > "$OUT/cuda_tests.log" 2>&1
echo "tests rc $?"; grep -E "passed|failed" "$OUT/cuda_tests.log" | tail -2
STEP_ARGS="qwen3-0.6b llama-3.1-8b --batches 1,8 --quants bf16 --no-hf" timeout 420 bash benchmarks/ab_gpu_step.sh run 4282ce4 75bc94e 1a0fce3 4282ce4 75bc94e

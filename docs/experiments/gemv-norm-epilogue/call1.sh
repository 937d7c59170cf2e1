#!/usr/bin/env bash
# Run on the device from the repo root, after `bash benchmarks/ab_gpu_step.sh prepare` of the trees it names
# (timing-only trees: copies of prepared ones with timing-only.diff applied); carry [".whl", ".ab"].
# call 1: the new family's device tests, then whole steps: work, base, work
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site METRALE_CACHE=/tmp/metrale-cache PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
timeout 200 python3 -m pytest tests/cuda/test_kernels_vs_host.py -q -p no:cacheprovider -x -k "linear_add_rmsnorm or rmsnorm or workspace" > "$OUT/cuda_tests.log" 2>&1
echo "tests rc $?"; tail -5 "$OUT/cuda_tests.log"
STEP_ARGS="qwen3-0.6b llama-3.1-8b --batches 1,8 --quants bf16 --no-hf" timeout 330 bash benchmarks/ab_gpu_step.sh run work 1a0fce3 work

#!/usr/bin/env bash
# call 4: Qwen3-0.6B against its peers in one process (main's kernels)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site METRALE_CACHE=/tmp/metrale-cache PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
timeout 540 python3 benchmarks/bench_gpu_decode.py qwen3-0.6b --batches 1 --quants bf16 --compile-batches 1 --hf-timeout 200 --deadline 500 2>&1 | grep -v Warning | tail -20
cp benchmarks/results/gpu_decode.json "$OUT/gpu_decode_peers_qwen_v23.json"

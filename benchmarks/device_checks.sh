#!/usr/bin/env bash
# One device call: install Metrale on the lent GPU machine (offline), then run the CUDA tests.
# Usage (from the repo root, on the device): bash benchmarks/device_checks.sh [pytest args]
# WORKERS=N runs the tests in N processes sharing the GPU (pytest-xdist): the whole tier's
# references and compiles are CPU work, and one process did not finish it in six minutes.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
export METRALE_CACHE=/tmp/metrale-cache PYTHONUNBUFFERED=1
# a build cache filled before the call (benchmarks/warm_cache.py, carried as .devcache, packed
# or not) saves the device compiling what this machine's nvcc compiled already
mkdir -p "$METRALE_CACHE"
if [ -f .devcache.tar.xz ]; then tar -xJf .devcache.tar.xz -C "$METRALE_CACHE"; fi
if [ -d .devcache ]; then cp -r .devcache/. "$METRALE_CACHE"/; fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
workers=()
if [ "${WORKERS:-1}" -gt 1 ]; then workers=(-n "$WORKERS"); fi
python3 -m pytest tests/cuda -q -p no:cacheprovider "${workers[@]}" "$@" 2>&1 \
  | tee "$OUT/cuda_tests.log"

#!/usr/bin/env bash
# Whole decode steps with a kernel source's tuning defines overridden, one step run per variant:
# the variant sweep (bench_gpu_variants.py) times kernels alone, which cannot show an effect
# across launches (what one kernel's prefetch does to the launch before it).
# Usage (on the device, from the repo root, after device_checks.sh or the same installs):
#   bash benchmarks/sweep_gpu_step.sh SOURCE TAG[:NAME=VALUE[,NAME=VALUE...]] ...
# e.g. bash benchmarks/sweep_gpu_step.sh gemv.cu base short:PREFETCH_SHORT=16 base2
# SOURCE is a file of kernels/cuda/common; every `#define NAME ...` line of it becomes
# `#define NAME VALUE` for that variant (a bare TAG runs the source as it is). The source is
# restored after each variant and at exit. STEP_ARGS (default: qwen3-0.6b llama-3.1-8b
# --batches 1 --quants bf16 --no-hf) go to bench_gpu_decode.py; each run's JSON is copied to
# $OUT/gpu_decode_TAG.json. Evidence is never recorded from a sweep (no --record).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
src="kernels/cuda/common/$1"
shift
[ -f "$src" ] || { echo "no such source: $src" >&2; exit 2; }
saved=$(mktemp)
cp "$src" "$saved"
trap 'cp "$saved" "$src"' EXIT
export PYTHONPATH=${PYTHONPATH:-/tmp/site} METRALE_CACHE=${METRALE_CACHE:-/tmp/metrale-cache}
export PYTHONUNBUFFERED=1
# NAME=VALUE pairs of a variant, one per line (none for a bare tag)
pairs() { [ "${1%%:*}" != "$1" ] && tr , '\n' <<< "${1#*:}"; }
for variant in "$@"; do  # every name checked before any device time is spent
  for pair in $(pairs "$variant"); do
    grep -q "^#define ${pair%%=*}\b" "$src" \
      || { echo "${variant%%:*}: no #define ${pair%%=*} in $src" >&2; exit 2; }
  done
done
for variant in "$@"; do
  tag=${variant%%:*}
  cp "$saved" "$src"
  for pair in $(pairs "$variant"); do
    sed -i -E "s/^#define ${pair%%=*}\b.*/#define ${pair%%=*} ${pair#*=}/" "$src"
  done
  # shellcheck disable=SC2086  # STEP_ARGS are separate arguments
  python3 benchmarks/bench_gpu_decode.py ${STEP_ARGS:-qwen3-0.6b llama-3.1-8b --batches 1 \
      --quants bf16 --no-hf} 2>&1 | grep "metrale" | sed "s/^/$tag /"
  cp benchmarks/results/gpu_decode.json "$OUT/gpu_decode_$tag.json"
done

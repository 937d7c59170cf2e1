#!/usr/bin/env bash
# A device round: install, the CUDA tests, then the decode benchmark (KERNELS_BENCH=1: with
# each kernel timed alone; an empty second argument skips it), then, with ROWS="<args>", the
# multi-row GEMVs against the one-row ones (benchmarks/bench_gpu_gemv_rows.py), then, with
# PREFILL="<args>", the prefill benchmark (benchmarks/bench_gpu_prefill.py; PREFILL="--record"
# with its defaults and evidence), then, with PROFILE="MODEL:QUANT ...", one decode layer of each
# under Nsight Compute (benchmarks/profile_gpu_step.py; its CSVs stay in /tmp/profile), then,
# with TUNE="MODEL:QUANT:ROWS[,ROWS...][:MODE] ...", `met tune --policy bounded` of each, in
# decode unless MODE says prefill (ROWS then the prompt's tokens; every alternative's kernels
# timed and recorded, the step before and after; the records reach the evidence export below).
# Back under $OUT come the result files this round wrote and sm_90's evidence export (the
# shipped records and what a `--record` or `met tune` run added to the evidence store), and
# nothing older: a device call returns at most eight files.
# Usage: bash benchmarks/device_round.sh "<pytest -k expr or empty>" "<bench_gpu_decode args>"
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
started=$(mktemp)
bash benchmarks/device_checks.sh --timeout=300 ${1:+-k "$1"} | tail -25
export PYTHONPATH=/tmp/site METRALE_CACHE=/tmp/metrale-cache PYTHONUNBUFFERED=1
if [ -n "${2:-}" ]; then
  # shellcheck disable=SC2086  # the benchmark's arguments are separate words
  python3 benchmarks/bench_gpu_decode.py $2 ${KERNELS_BENCH:+--kernels} 2>&1 \
    | tee "$OUT/bench_decode.log" | grep -v "^    [a-z_]*\[" | tail -60
fi
if [ -n "${ROWS+set}" ]; then
  # shellcheck disable=SC2086
  python3 benchmarks/bench_gpu_gemv_rows.py $ROWS 2>&1 | tee "$OUT/bench_gemv_rows.log" | tail -70
fi
if [ -n "${PREFILL+set}" ]; then
  # shellcheck disable=SC2086
  python3 benchmarks/bench_gpu_prefill.py $PREFILL 2>&1 | tee "$OUT/bench_prefill.log" | tail -90
fi
if [ -n "${PROFILE:-}" ]; then
  # shellcheck disable=SC2086  # the targets are separate arguments
  python3 benchmarks/profile_gpu_step.py $PROFILE --out /tmp/profile 2>&1 \
    | grep -E "^[a-z0-9.-]+ [a-z0-9]+ |wrote" | tail -40
fi
for target in ${TUNE:-}; do
  IFS=: read -r model quant rows mode <<< "$target"
  # shellcheck disable=SC2086  # the rows are separate arguments
  python3 -m metrale tune "$model" --quant "$quant" --rows ${rows//,/ } --hardware sm_90 \
    --mode "${mode:-decode}" --policy bounded --steps 10 --repeats 10 2>&1 | tail -12
done
find benchmarks/results -name 'gpu_*.json' -newer "$started" -exec cp {} "$OUT/" \;
python3 -m metrale evidence export --hardware sm_90 --out "$OUT/EVIDENCE.toml" || true

#!/usr/bin/env bash
# The device call that lands branch exp/raw-stage (the patches beside this script, on main with
# `git am`): fp8 and fp4 weight tiles staged raw by cp.async in the wgmma GEMM at every block
# size (docs/gpu-notes.md, version 28). Device tests of every GEMM point and row invariance; the
# prefill record run only if they pass; the register path (RAW_SMALL=0) against the source at 16
# and 64 rows; the engine's tests. About 8 minutes. Then compare gpu_prefill.json with version
# 27's (benchmarks/results/gpu_prefill.json on main) and update the tables' reasons.
# Run from the repository root with the wheels in .whl (device tool: carry [".whl"]).
source docs/experiments/device_setup.sh
t0=$(date +%s)
timeout 250 python3 -m pytest tests/cuda -q -p no:cacheprovider -k "gemm or row_invariance" \
  > "$OUT/tests.log" 2>&1
trc=$?; echo "tests rc $trc in $(( $(date +%s) - t0 )) s"; tail -2 "$OUT/tests.log" | cut -c1-300
grep -E "^FAILED|^E  " "$OUT/tests.log" | head -8 | cut -c1-300
rec=--record
if [ $trc -ne 0 ]; then rec=""; echo "NO RECORD: tests did not pass"; fi
t0=$(date +%s)
timeout 200 python3 benchmarks/bench_gpu_prefill.py --weights bf16,fp8,mxfp4,nvfp4,f32 \
  --rows 16,64,2048 --gemv-rows 0 --steps 64,2048 --step-quants bf16 --no-hf $rec \
  > "$OUT/prefill.log" 2>&1
echo "prefill rc $? in $(( $(date +%s) - t0 )) s"
cp benchmarks/results/gpu_prefill.json kernels/sm_90/EVIDENCE.toml "$OUT/" 2>/dev/null
grep -E "^prefill|appended" "$OUT/prefill.log" | cut -c1-200
t0=$(date +%s)
timeout 120 python3 benchmarks/bench_gpu_prefill.py --variants --wgmma-only --variant-rows 16,64 \
  --weights fp8,mxfp4,nvfp4 > "$OUT/variants.log" 2>&1
echo "variants rc $? in $(( $(date +%s) - t0 )) s"
grep -E "\[" "$OUT/variants.log" | cut -c1-150
cp benchmarks/results/gpu_prefill_variants.json "$OUT/" 2>/dev/null
t0=$(date +%s)
timeout 60 python3 -m pytest tests/cuda/test_engine_gpu.py -q -p no:cacheprovider \
  -k "engine_matches_host" > "$OUT/engine.log" 2>&1
echo "engine rc $? in $(( $(date +%s) - t0 )) s"; tail -1 "$OUT/engine.log" | cut -c1-200

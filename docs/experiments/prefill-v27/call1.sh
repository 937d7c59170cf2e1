#!/usr/bin/env bash
# One device call for the prepared prefill change (docs/gpu-notes.md, version 26, "What limits it
# now"): the wgmma GEMM at 4 stages and the prefill attention's 16-byte cache append.
# Here, before the call:
#   git checkout -b v27 main && git am docs/experiments/prefill-v27/0001-*.patch
#   mkdir -p .ab/base && git archive main kernels | tar -x -C .ab/base
# then run this script on the device, carrying .whl and .ab. It checks the attention's bytes
# against main's kernel, runs the CUDA tests of both kernels, and records the prefill points
# only if everything holds.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site METRALE_CACHE=/tmp/metrale-cache PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
timeout 120 python3 benchmarks/bench_gpu_prefill_attention.py --baseline .ab/base/kernels \
  > "$OUT/attn.log" 2>&1; echo "attn rc $?"; cut -c1-250 "$OUT/attn.log"
same=$(python3 -c "
import json; d=json.load(open('benchmarks/results/gpu_prefill_attention.json'))
print('yes' if all(v.get('bytes_equal_to_tree', True) and v.get('finite', True)
                   for c in d['cases'] for v in c.values() if isinstance(v, dict)) else 'no')")
echo "attention bytes equal and finite: $same"
timeout 240 python3 -m pytest tests/cuda -q -p no:cacheprovider -x \
  -k "gemm or prefill_attention or row_invariance or relation" > "$OUT/tests.log" 2>&1
trc=$?; echo "tests rc $trc"; tail -3 "$OUT/tests.log"
if [ "$same" = yes ] && [ $trc -eq 0 ]; then
  timeout 330 python3 benchmarks/bench_gpu_prefill.py --weights bf16,fp8,mxfp4,nvfp4,f32 \
    --rows 64,2048 --gemv-rows 0 --steps 512,2048 --step-quants bf16 --record > "$OUT/prefill.log" 2>&1
  echo "prefill rc $?"; grep -E "rows  2048|^prefill|appended" "$OUT/prefill.log" | cut -c1-200
  cp benchmarks/results/gpu_prefill.json kernels/sm_90/EVIDENCE.toml "$OUT/" 2>/dev/null
fi
cp benchmarks/results/gpu_prefill_attention.json "$OUT/" 2>/dev/null

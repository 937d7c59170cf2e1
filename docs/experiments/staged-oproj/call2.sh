#!/usr/bin/env bash
# Device call: the microbenchmark (call1.sh), then whole steps of main (5039f69), staged o_proj
# with the merge releasing only by ending (56a891e) and with the merge releasing first (work).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 120 bash docs/experiments/staged-oproj/call1.sh > /dev/null 2> "$OUT/call1.err"
python3 - "$OUT/staged_call1.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("micro: no JSON:", e); sys.exit(0)
for r in d["results"]:
    print(r["shape"], r["rows"], r["variant"], r["merge_release"], r["with_attention"], r["us_per_layer"], r["same_bytes"])
PY
STEP_ARGS="qwen3-0.6b llama-3.1-8b --batches 1,8 --quants bf16 --no-hf" \
  bash benchmarks/ab_gpu_step.sh run 5039f69 work 56a891e work
export PYTHONPATH=/tmp/site METRALE_CACHE=/tmp/metrale-cache
timeout 200 python3 -m pytest -q -x tests/cuda -k "staged" -p no:cacheprovider 2>&1 | tail -5

#!/usr/bin/env bash
# Call 3: kernels alone (--kernels) for the norm prologue (cp.async.cg), its L1-caching variant
# (.ca) and f75a7be; Qwen3-0.6B exact bf16, batch 1.
source docs/experiments/device_setup.sh
t0=$(date +%s)
STEP_ARGS="qwen3-0.6b --batches 1 --quants bf16 --policies exact --no-hf --kernels" \
  timeout 400 bash benchmarks/ab_gpu_step.sh run ca f75a7be work ca f75a7be
for f in "$OUT"/gpu_decode_*.json; do python3 - "$f" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
def walk(o, path=""):
    if isinstance(o, dict):
        for k, v in o.items():
            if k in ("kernels", "kernel_profile", "per_kernel"):
                print(sys.argv[1].rsplit("/", 1)[1], k, json.dumps(v)[:1500])
            else:
                walk(v, path + "/" + k)
    elif isinstance(o, list):
        for v in o: walk(v, path)
walk(d)
PY
done
echo "t=$(( $(date +%s) - t0 ))"

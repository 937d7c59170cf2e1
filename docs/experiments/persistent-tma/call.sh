#!/usr/bin/env bash
# On the device (carry [".whl"]): `bash docs/experiments/persistent-tma/call.sh`. Builds the
# experiment kernel and the plan's three, checks their bytes agree and times o_proj + MLP both
# ways; about a minute. The results file comes back under $OUT.
source docs/experiments/device_setup.sh
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 300 python3 docs/experiments/persistent-tma/bench_mlp_tma.py 2>&1 | tail -20
cp benchmarks/results/gpu_mlp_tma.json "$OUT/" 2>/dev/null
echo "t=$(( $(date +%s) - t0 ))"

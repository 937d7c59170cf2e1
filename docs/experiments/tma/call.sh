#!/usr/bin/env bash
# On the device (carry [".whl"]): `bash docs/experiments/tma/call.sh`. Builds the
# folder's persistent kernels and the plan's eight launches of a Qwen3-0.6B decode layer, checks
# that every variant writes the chain's bytes, traces the kernels' phases and times the variants
# per layer; about a minute. The results file comes back under $OUT.
source docs/experiments/device_setup.sh
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 300 python3 docs/experiments/tma/bench_layer_tma.py 2>&1 | tail -45
cp benchmarks/results/gpu_layer_tma.json "$OUT/" 2>/dev/null
echo "t=$(( $(date +%s) - t0 ))"

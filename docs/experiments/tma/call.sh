#!/usr/bin/env bash
# On the device (carry [".whl"]): `bash docs/experiments/tma/call.sh`. Three experiments, an
# estimated four minutes (not yet timed): a Qwen3-0.6B decode layer as the plan's eight launches
# against the persistent kernels' two (bench_layer_tma.py); decode attention and its merge in one
# launch (bench_attn_merged.py); the bounded plans' tensor-core GEMV against the same with
# TMA-staged weights (bench_gemv_tma.py). Each checks its kernels' bytes against the plan's before
# timing. The results files come back under $OUT.
source docs/experiments/device_setup.sh
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 300 python3 docs/experiments/tma/bench_layer_tma.py 2>&1 | tail -45
cp benchmarks/results/gpu_layer_tma.json "$OUT/" 2>/dev/null
echo "t=$(( $(date +%s) - t0 ))"
timeout 200 python3 docs/experiments/tma/bench_attn_merged.py 2>&1 | tail -16
cp benchmarks/results/gpu_attn_merged.json "$OUT/" 2>/dev/null
echo "t=$(( $(date +%s) - t0 ))"
timeout 400 python3 docs/experiments/tma/bench_gemv_tma.py > "$OUT/gemv_tma.log" 2>&1
tail -25 "$OUT/gemv_tma.log"
cp benchmarks/results/gpu_gemv_tma.json "$OUT/" 2>/dev/null
echo "t=$(( $(date +%s) - t0 ))"

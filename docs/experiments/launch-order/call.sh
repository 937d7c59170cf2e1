#!/usr/bin/env bash
# On the device (carry [".whl", ".ab"]): `bash docs/experiments/launch-order/call.sh REL POS BOTH`
# with prepare.sh's three revisions. The decode attention device tests on the merge variant's
# tree, then whole steps of every tree in turn, twice, against the working tree (timing only:
# nothing is recorded). About 7 minutes with a warm build cache.
source docs/experiments/device_setup.sh
t0=$(date +%s)
rel=$1 pos=$2 both=$3
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
(cd ".ab/$pos" && python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 \
  && timeout 150 python3 -m pytest tests/cuda/test_kernels_vs_host.py -q -p no:cacheprovider \
     -k "attention and decode" > "$OUT/tests_attention.log" 2>&1; echo "tests rc $?")
tail -2 "$OUT/tests_attention.log"
echo "t=$(( $(date +%s) - t0 ))"
STEP_ARGS="qwen3-0.6b llama-3.1-8b --batches 1,8 --quants bf16 --no-hf" \
  timeout 480 bash benchmarks/ab_gpu_step.sh run work "$rel" "$pos" "$both" "$both" "$pos" "$rel" work
echo "t=$(( $(date +%s) - t0 ))"

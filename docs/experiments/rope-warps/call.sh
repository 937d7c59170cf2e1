#!/usr/bin/env bash
# The device call that lands the patch beside this script (on main with `git am`): rope a warp a
# head, eight heads a block (docs/gpu-notes.md, version 29: the block-a-head rope moved Llama-3.1-8B's
# 2048-token prefill bytes at 0.42 TB/s, 3.3 ms of the step). rope's device tests; then, only if
# they pass, the prefill steps recorded (their kernels one by one, rope among them). About 4 minutes.
# Compare rope's per-kernel time in the steps' "kernels" with version 29's record (103 µs a layer
# at 2048 tokens, gpu_prefill.json on main), then keep the steps' JSON under its own name:
# `--rows ""` writes benchmarks/results/gpu_prefill.json without the GEMM cases.
# Run from the repository root with the wheels in .whl (device tool: carry [".whl"]).
source docs/experiments/device_setup.sh
t0=$(date +%s)
timeout 200 python3 -m pytest tests/cuda -q -p no:cacheprovider -k "rope" > "$OUT/tests.log" 2>&1
trc=$?; echo "tests rc $trc in $(( $(date +%s) - t0 )) s"; tail -1 "$OUT/tests.log" | cut -c1-300
grep -E "^FAILED|^E  " "$OUT/tests.log" | head -8 | cut -c1-300
rec=--record
if [ $trc -ne 0 ]; then rec=""; echo "NO RECORD: tests did not pass"; fi
t0=$(date +%s)
timeout 240 python3 benchmarks/bench_gpu_prefill.py --rows "" --steps 64,2048 --step-quants bf16 \
  --no-hf $rec > "$OUT/prefill.log" 2>&1
echo "prefill rc $? in $(( $(date +%s) - t0 )) s"
grep -E "^prefill|appended" "$OUT/prefill.log" | cut -c1-200
cp benchmarks/results/gpu_prefill.json kernels/sm_90/EVIDENCE.toml "$OUT/" 2>/dev/null
python3 - <<'PY'
import json
d = json.load(open("benchmarks/results/gpu_prefill.json"))
for s in d["steps"]:
    for k in s.get("kernels", []):
        if "rope" in k["kernel"]:
            print(s["model"], s["rows"], k["kernel"], f"{k['seconds'] * 1e6:.1f} us",
                  f"{k['bytes_per_s'] / 1e12:.2f} TB/s")
PY

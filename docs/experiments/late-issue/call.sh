#!/usr/bin/env bash
# The device call that timed the patch beside this script (docs/gpu-notes.md, version 30): tile
# kt + AHEAD's copies issued after tile kt's wgmmas, against the source it applies to, bf16 and
# mxfp4 at 2048 rows, in one call and no record. Run from the repository root of a tree without
# the patch (it applies it itself), with the wheels in .whl (device tool: carry [".whl"]).
source docs/experiments/device_setup.sh > /dev/null 2>&1
here=docs/experiments/late-issue
cases() {
  timeout 120 python3 benchmarks/bench_gpu_prefill.py --weights bf16,mxfp4 --rows 2048 \
    --gemv-rows 0 --steps "" --no-hf
}
t0=$(date +%s); cases > "$OUT/main.log" 2>&1; echo "main rc $? in $(( $(date +%s) - t0 )) s"
cp benchmarks/results/gpu_prefill.json "$OUT/gpu_prefill_main.json"
git apply "$here"/0001-*.patch || exit 1
t0=$(date +%s); cases > "$OUT/late.log" 2>&1; echo "late rc $? in $(( $(date +%s) - t0 )) s"
cp benchmarks/results/gpu_prefill.json "$OUT/gpu_prefill_late.json"
git apply -R "$here"/0001-*.patch
python3 - "$OUT" <<'PY'
import json, statistics, sys
out = sys.argv[1]
load = lambda n: {(c["model"], c["launch"], c["weight"]): c for c in
                  json.load(open(f"{out}/gpu_prefill_{n}.json"))["cases"] if c["rows"] == 2048}
a, b = load("late"), load("main")
by = {}
for key in sorted(a.keys() & b.keys()):
    r = b[key]["seconds"] / a[key]["seconds"]
    by.setdefault(key[2], []).append(r)
    print(key, f"{b[key]['seconds']*1e6:.1f} -> {a[key]['seconds']*1e6:.1f} us x{r:.3f}",
          f"err {a[key]['max_rel_err_vs_peer']:.1e}")
for w, rs in by.items():
    print(w, f"late vs main: min {min(rs):.3f} median {statistics.median(rs):.3f} max {max(rs):.3f}")
PY

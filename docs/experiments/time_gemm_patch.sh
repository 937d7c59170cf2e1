#!/usr/bin/env bash
# Times a GEMM patch against the source it applies to, in one device call and without a record:
# `bash docs/experiments/time_gemm_patch.sh DIR` with DIR holding one `0001-*.patch` (for
# kernels/sm_90/common/gemm_wgmma.cu). bench_gpu_prefill.py's cases at 2048 rows, bf16 and
# mxfp4 weights, first without the patch, then with it (applied with `git apply`, reverted after);
# prints each case's speed-up (time without over time with) and the median per format. Run from
# the repository root of a tree without the patch, with the wheels in .whl (device tool: carry
# [".whl"]). About 3 minutes on a started machine.
dir=${1:?usage: time_gemm_patch.sh DIR}
source docs/experiments/device_setup.sh > /dev/null 2>&1
cases() {  # $1: main or patch, into benchmarks/results/gpu_prefill_$1.json and $OUT
  t0=$(date +%s)
  timeout 120 python3 benchmarks/bench_gpu_prefill.py --weights bf16,mxfp4 --rows 2048 \
    --gemv-rows 0 --steps "" --no-hf --name "gpu_prefill_$1" > "$OUT/$1.log" 2>&1
  echo "$1 rc $? in $(( $(date +%s) - t0 )) s"
  cp "benchmarks/results/gpu_prefill_$1.json" "$OUT/"
}
cases main
git apply "$dir"/0001-*.patch || exit 1
cases patch
git apply -R "$dir"/0001-*.patch
python3 - "$OUT" <<'PY'
import json, statistics, sys
out = sys.argv[1]
load = lambda n: {(c["model"], c["launch"], c["weight"]): c for c in
                  json.load(open(f"{out}/gpu_prefill_{n}.json"))["cases"] if c["rows"] == 2048}
a, b = load("patch"), load("main")
by = {}
for key in sorted(a.keys() & b.keys()):
    r = b[key]["seconds"] / a[key]["seconds"]
    by.setdefault(key[2], []).append(r)
    print(key, f"{b[key]['seconds']*1e6:.1f} -> {a[key]['seconds']*1e6:.1f} us x{r:.3f}",
          f"err {a[key]['max_rel_err_vs_peer']:.1e}")
for w, rs in by.items():
    print(w, f"patch vs main: min {min(rs):.3f} median {statistics.median(rs):.3f} "
          f"max {max(rs):.3f}")
PY

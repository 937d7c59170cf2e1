#!/usr/bin/env bash
# Whole decode steps of several trees of the project, in one device call: the same-run
# comparison a change is judged by (run-to-run spread between calls is as large as most gains).
# Here, before the call:  bash benchmarks/ab_gpu_step.sh prepare REV [REV ...]
#   writes each git revision's tree to .ab/REV (git archive; git-ignored), and prints the carry
#   list for the device tool ([".ab", ...]). The working tree itself is the tag "work".
# On the device:          bash benchmarks/ab_gpu_step.sh run [TAG ...]
#   installs each tree in turn (offline, .whl as device_checks.sh) and runs bench_gpu_decode.py
#   with STEP_ARGS (default: qwen3-0.6b llama-3.1-8b --batches 1,8 --quants bf16 --no-hf); TAG
#   is "work" or a prepared REV, in the order given (default: work, then every prepared tree,
#   then work again). Each run's JSON goes to $OUT/gpu_decode_N_TAG.json, and at the end
#   benchmarks/ab_summary.py puts every tree's medians beside the first tree's
#   ($OUT/ab_summary.json). Evidence is never recorded here (no --record): only the working
#   tree's own run may record.
set -uo pipefail
cmd=${1:-}; shift || true
root=$(pwd)
case "$cmd" in
prepare)
  [ $# -gt 0 ] || { echo "usage: $0 prepare REV [REV ...]" >&2; exit 2; }
  grep -qx "/.ab/" .git/info/exclude 2>/dev/null || echo "/.ab/" >> .git/info/exclude
  for rev in "$@"; do
    git rev-parse --verify -q "$rev^{commit}" > /dev/null \
      || { echo "no such revision: $rev" >&2; exit 2; }
    rm -rf ".ab/$rev" && mkdir -p ".ab/$rev" && git archive "$rev" | tar -x -C ".ab/$rev"
  done
  echo 'carry: [".whl", ".ab"]'
  ;;
run)
  OUT=${OUT:-/tmp/out}
  mkdir -p "$OUT"
  if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
  fi
  export METRALE_CACHE=${METRALE_CACHE:-/tmp/metrale-cache} PYTHONUNBUFFERED=1
  tags=("$@")
  if [ ${#tags[@]} -eq 0 ]; then
    tags=(work)
    for d in .ab/*/; do [ -d "$d" ] && tags+=("$(basename "$d")"); done
    tags+=(work)
  fi
  n=0
  for tag in "${tags[@]}"; do
    dir=$root; [ "$tag" = work ] || dir=$root/.ab/$tag
    [ -f "$dir/pyproject.toml" ] || { echo "$tag: no tree at $dir" >&2; exit 2; }
    (cd "$dir" && python3 -m pip install -q --no-deps --no-build-isolation -e . \
        > "$OUT/install.log" 2>&1) || { cat "$OUT/install.log"; exit 1; }
    n=$((n + 1))
    # shellcheck disable=SC2086  # STEP_ARGS are separate arguments
    (cd "$dir" && python3 benchmarks/bench_gpu_decode.py ${STEP_ARGS:-qwen3-0.6b llama-3.1-8b \
        --batches 1,8 --quants bf16 --no-hf} 2>&1 | grep "metrale" | sed "s/^/$tag /")
    cp "$dir/benchmarks/results/gpu_decode.json" "$OUT/gpu_decode_${n}_$tag.json"
  done
  (cd "$root" && python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1)
  # the verdict: each tree's medians and ratios to the first tree's, into $OUT/ab_summary.json
  if [ -f "$root/benchmarks/ab_summary.py" ]; then
    python3 "$root/benchmarks/ab_summary.py" "$OUT" --base "${tags[0]}" \
      || echo "ab_summary.py failed; the runs' files are in $OUT" >&2
  fi
  ;;
*)
  echo "usage: $0 prepare REV [REV ...] | run [TAG ...]" >&2; exit 2
  ;;
esac

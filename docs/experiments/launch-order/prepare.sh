#!/usr/bin/env bash
# Here, before the device call, from the repository root on main: each patch as a commit of its
# own branch off HEAD (and both together), their trees written to .ab/ for ab_gpu_step.sh.
# Prints the three revisions in the order call.sh takes them (REL POS BOTH).
set -euo pipefail
dir=docs/experiments/launch-order
base=$(git rev-parse --abbrev-ref HEAD)
revs=()
for variant in rel:0001 pos:0002 both:0001,0002; do
  name=${variant%%:*}
  git checkout -q -B "exp/launch-order-$name" "$base"
  for n in $(tr , ' ' <<< "${variant#*:}"); do git am -q "$dir/$n"-*.patch; done
  revs+=("$(git rev-parse --short HEAD)")
done
git checkout -q "$base"
bash benchmarks/ab_gpu_step.sh prepare "${revs[@]}" > /dev/null
echo "${revs[@]}"

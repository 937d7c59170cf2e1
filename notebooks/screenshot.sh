#!/usr/bin/env bash
# Regenerate docs/plan.png, the README's picture of a plan in Jupyter: notebook 03 executed to
# HTML (nbconvert), its first screen captured by a headless Chromium at 1600 x 1800. Run it when
# what the picture shows changes (the plan's kernels, its evidence, the display itself).
# Needs jupyter nbconvert and ipykernel where metrale is installed, and chromium on the PATH.
# Usage: bash notebooks/screenshot.sh
set -euo pipefail
cd "$(dirname "$0")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
jupyter nbconvert --to html --execute 03_plan_a_model.ipynb --output "$tmp/plan.html" >/dev/null 2>&1
chromium --headless=new --no-sandbox --disable-gpu --hide-scrollbars --window-size=1600,1800 \
  --screenshot="$tmp/plan.png" "file://$tmp/plan.html" >/dev/null 2>&1
cp "$tmp/plan.png" ../docs/.plan.png.part && mv ../docs/.plan.png.part ../docs/plan.png
echo "wrote docs/plan.png"

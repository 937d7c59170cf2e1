# Sourced by the experiments' device calls (docs/experiments/*/call.sh), from the repository root
# on the lent GPU: the carried wheels (.whl) into /tmp/site, then Metrale itself, editable.
# Leaves OUT set (the device tool's, or /tmp/out) and the install's log in it.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site METRALE_CACHE=/tmp/metrale-cache PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }

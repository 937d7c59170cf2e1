"""Time ``met build MODEL --quant Q --hardware H`` end to end: cold (empty cache) and warm.

Each run is the command itself in a fresh process (``met build ... --format json``, into a
temporary ``--cache`` that holds the build cache and the registry), so its wall time counts the
interpreter, the imports, planning (the points of the decode rows 1 and 8 and prefill 64
plans), the compiles and the registry. The report's own figures are kept beside it: planning,
the summed compile time, and each binary's compile time (the slowest first). Targets (issue 48,
DESIGN.md §9): cold <= 60 s, warm <= 1 s. Needs nvcc or an NVRTC wheel. The load average at
the start is recorded: on a shared machine the compiles compete for the cores. Writes
``benchmarks/results/build.json`` and prints it.

    python benchmarks/bench_build.py [--model llama-3.1-8b] [--quant bf16] [--hardware sm_90]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import write_result  # noqa: E402

from metrale.realize.compute import NvidiaTarget  # noqa: E402


def timed_command(args: argparse.Namespace, cache: Path) -> dict:
    """One ``met build`` in a fresh process: its wall time and its report's figures."""
    cmd = [sys.executable, "-m", "metrale", "build", args.model, "--quant", args.quant,
           "--hardware", args.hardware, "--cache", str(cache), "--format", "json"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"met build failed:\n{proc.stdout}{proc.stderr}")
    report = json.loads(proc.stdout)
    units = sorted(report["units"], key=lambda u: -u["seconds"])
    return {"wall_s": round(wall, 3), "reported_s": round(report["seconds"], 3),
            "planning_s": round(report["planning_s"], 3),
            "compile_s": round(report["compile_s"], 3), "jobs": report["jobs"],
            "points": len(report["items"]), "counts": report["counts"],
            "compiler": report["compiler"],
            "units": [{"binary": u["binary"], "status": u["status"],
                       "seconds": round(u["seconds"], 3)} for u in units]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--quant", default="bf16")
    ap.add_argument("--hardware", default="sm_90")
    ap.add_argument("--out", default="build")
    args = ap.parse_args()
    available = NvidiaTarget().available()
    if not available:
        raise SystemExit(f"bench_build: {available.reason}")
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="metrale-bench-build-") as tmp:
        cold = timed_command(args, Path(tmp))
        warm = timed_command(args, Path(tmp))
    payload = {"target": f"{args.hardware}/{args.model}/{args.quant}", "cores": os.cpu_count(),
               "load_average_at_start": round(load, 2), "cold": cold, "warm": warm,
               "targets": {"cold_s": 60, "warm_s": 1},
               "meets": {"cold": cold["wall_s"] <= 60, "warm": warm["wall_s"] <= 1}}
    path = write_result(args.out, payload)
    print(json.dumps(payload, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Time ``met build qwen3-0.6b --quant bf16 --hardware sm_90``: cold (empty cache) and warm.

In process: the plan's points (``plan_points``: decode rows 1 and 8, prefill 64), then the
build into a fresh cache and registry; then the same again warm (cache hits only, summand
rewritten). Also the warm ``met build`` command end to end in a subprocess (interpreter start
included). Targets (DESIGN.md §9): cold < 60 s, warm < 1 s on a 2-core machine. Needs nvcc or
an NVRTC wheel. Writes ``benchmarks/results/build.json`` and prints it.

    python benchmarks/bench_build.py [--model qwen3-0.6b] [--quant bf16] [--hardware sm_90]
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

from metrale.lkb.target import KernelTarget  # noqa: E402
from metrale.plan.points import plan_points  # noqa: E402
from metrale.realize.build import build  # noqa: E402
from metrale.realize.cache import BuildCache  # noqa: E402
from metrale.realize.compute import NvidiaTarget  # noqa: E402
from metrale.realize.registry import Registry  # noqa: E402


def timed_build(args: argparse.Namespace, cache: Path, registry: Path) -> dict:
    t0 = time.perf_counter()
    points = plan_points(args.model, args.quant, args.hardware)
    t1 = time.perf_counter()
    report = build(points, args.hardware,
                   target=KernelTarget(args.hardware, args.model, args.quant),
                   cache=BuildCache(cache), registry=Registry(registry), progress=False)
    t2 = time.perf_counter()
    if not report.ok:
        raise SystemExit(report.summary() + "".join(f"\n{e}" for e in report.errors))
    return {"points": len(points), "plan_points_s": round(t1 - t0, 4),
            "build_s": round(t2 - t1, 4), "total_s": round(t2 - t0, 4),
            "counts": report.counts(), "compiler": report.compiler}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--quant", default="bf16")
    ap.add_argument("--hardware", default="sm_90")
    ap.add_argument("--out", default="build")
    args = ap.parse_args()
    available = NvidiaTarget().available()
    if not available:
        raise SystemExit(f"bench_build: {available.reason}")
    with tempfile.TemporaryDirectory(prefix="metrale-bench-build-") as tmp:
        cache, registry = Path(tmp) / "cache", Path(tmp) / "registry"
        cold = timed_build(args, cache, registry)
        warm = timed_build(args, cache, registry)
        cmd = [sys.executable, "-m", "metrale", "build", args.model, "--quant", args.quant,
               "--hardware", args.hardware, "--cache", str(cache), "--registry",
               str(registry), "--no-progress"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
        cli_warm = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"met build failed:\n{proc.stdout}{proc.stderr}")
    payload = {"target": f"{args.hardware}/{args.model}/{args.quant}", "cores": os.cpu_count(),
               "cold": cold, "warm": warm, "cli_warm_s": round(cli_warm, 4),
               "targets": {"cold_s": 60, "warm_s": 1},
               "meets": {"cold": cold["total_s"] < 60, "warm": warm["total_s"] < 1}}
    path = write_result(args.out, payload)
    print(json.dumps(payload, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Time to the first token of ``met run MODEL --hardware H`` on a fresh machine, then warm.

"Fresh" means every cache a first run fills is empty: Metrale's (``METRALE_CACHE``: the build
cache, the registry, the evidence store) and the CUDA driver's (``CUDA_CACHE_PATH``: the machine
code it makes from the PTX a build ships). Each run is ``met run MODEL --hardware H --steps 1``
in a fresh process, so its wall time counts the interpreter, the imports, planning, the
compiles (on every core, with their progress), loading, the module loads and the prefill that
draws the first token; the process ends right after it, so the wall time bounds the time to the
first token from above. The run's own figures are kept beside it: the load time and the
prefill's. The same command then runs again with the caches it filled (warm), and once more
with Metrale's cache warm and the driver's empty (what the driver's own compiles of PTX cost,
nothing where the build made machine code). Python's bytecode is compiled first, for
Metrale's modules and those on ``PYTHONPATH``, as ``pip install`` compiles it (an editable
install from a fresh clone has none, and the first run would otherwise pay for it, about 0.8 s
on the lent H100's CPU, where the model after it would not). Goal (issue 48):
tiny-qwen3's first token within 5 s, cold. Run on the lent GPU; writes
``benchmarks/results/cold_start.json`` and prints it.

    python benchmarks/bench_cold_start.py [--models tiny-qwen3,tiny-llama] [--hardware sm_90]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import write_result  # noqa: E402

GOAL_S = 5.0
"""Issue 48: tiny-qwen3's first token within 5 s of ``met run`` on a fresh machine."""

LOADED = re.compile(r"loaded in ([0-9.]+) s")
PREFILL = re.compile(r"prefill: (\d+) tokens in ([0-9.]+) ms")


def parse_run(text: str) -> dict:
    """The figures ``met run`` prints for its ids path: load seconds and the prefill's.

    >>> parse_run("x; loaded in 1.25 s\\nprefill: 8 tokens in 54.3 ms (147.4 tokens/s)")
    {'load_s': 1.25, 'prefill_tokens': 8, 'prefill_ms': 54.3}
    >>> parse_run("no figures")
    Traceback (most recent call last):
    ...
    ValueError: met run printed no load time and prefill line: 'no figures'
    """
    loaded, prefill = LOADED.search(text), PREFILL.search(text)
    if loaded is None or prefill is None:
        raise ValueError(f"met run printed no load time and prefill line: {text[-300:]!r}")
    return {"load_s": float(loaded.group(1)), "prefill_tokens": int(prefill.group(1)),
            "prefill_ms": float(prefill.group(2))}


def byte_compile() -> list[str]:
    """Compile the bytecode of Metrale's packages and of every ``PYTHONPATH`` folder, as ``pip
    install`` does for what it installs; returns the folders."""
    import compileall

    import metrale
    import metrale.lkb
    import metrale.plan
    import metrale.realize
    import metrale.runtime

    folders = {Path(m.__file__).parent for m in (metrale, metrale.lkb, metrale.plan,
                                                  metrale.realize, metrale.runtime)}
    folders |= {Path(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    for folder in sorted(folders):
        compileall.compile_dir(folder, quiet=1, workers=0)
    return sorted(map(str, folders))


def timed_run(model: str, hardware: str, caches: Path, driver: str = "cuda") -> dict:
    """One ``met run`` in a fresh process against the caches under ``caches`` (the driver's in
    ``caches / driver``)."""
    env = {**os.environ, "METRALE_CACHE": str(caches / "metrale"),
           "CUDA_CACHE_PATH": str(caches / driver), "PYTHONWARNINGS": "ignore"}
    env.pop("METRALE_EVIDENCE", None)
    cmd = [sys.executable, "-m", "metrale", "run", model, "--hardware", hardware, "--steps", "1",
           "--no-progress"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
    return {"wall_s": round(wall, 3), **parse_run(proc.stdout + proc.stderr)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny-qwen3,tiny-llama")
    ap.add_argument("--hardware", default="sm_90")
    args = ap.parse_args()
    compiled = byte_compile()
    rows = []
    for model in args.models.split(","):
        with tempfile.TemporaryDirectory(prefix="metrale-cold-") as tmp:
            cold = timed_run(model, args.hardware, Path(tmp))
            warm = timed_run(model, args.hardware, Path(tmp))
            driver_cold = timed_run(model, args.hardware, Path(tmp), driver="cuda-fresh")
        rows.append({"model": model, "cold": cold, "warm": warm, "driver_cold": driver_cold})
        print(f"{model}: cold {cold['wall_s']:.2f} s (loaded in {cold['load_s']:.2f} s, prefill "
              f"{cold['prefill_ms']:.0f} ms), warm {warm['wall_s']:.2f} s, driver cache empty "
              f"{driver_cold['wall_s']:.2f} s", flush=True)
    payload = {"hardware": args.hardware, "cores": os.cpu_count(), "goal_s": GOAL_S,
               "goal_model": "tiny-qwen3", "bytecode_compiled": compiled, "rows": rows}  # write_result adds the GPU's name
    path = write_result("cold_start", payload)
    print(json.dumps(payload, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

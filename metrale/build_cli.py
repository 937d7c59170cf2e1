"""``met build``: plan a model's points on a class, compile them ahead of time, and report.

The command is the composite the design names: the planner says which points a model's plans
use (``plan.points.plan_points``), then ``realize.build`` compiles them in parallel through the
build cache into the registry. Its reported time is the whole command's, planning included, and
each compiled binary's own time is reported too (the slowest few by default, all with
``--verbose`` or ``--format json``). ``--cache DIR`` puts everything under ``DIR``: the build
cache and, unless ``--registry`` says otherwise, the registry in ``DIR/registry``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SLOWEST = 5
"""Compiled binaries listed by default, slowest first."""


def configure(p: argparse.ArgumentParser) -> None:
    """The arguments of ``met build``."""
    p.add_argument("model", help="a built-in name, a config.json, or a checkpoint directory")
    p.add_argument("--quant", required=True, help="bf16, fp8, mxfp4 or nvfp4")
    p.add_argument("--hardware", required=True, help="the hardware class to build for")
    p.add_argument("--cache", default=None, metavar="DIR", help="folder for everything the build writes: the "
                   "build cache, and the registry in DIR/registry (default: $METRALE_CACHE, "
                   "else $XDG_CACHE_HOME/metrale, else ~/.cache/metrale)")
    p.add_argument("--registry", default=None, metavar="DIR", help="registry folder (default: "
                   "$METRALE_REGISTRY, else registry/ in the cache folder)")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="compiles run at once (default: one per CPU core)")
    p.add_argument("--output", choices=("ptx", "cubin"), default="cubin",
                   help="what an NVIDIA class compiles to: cubin, machine code, what `met run` "
                        "and `met serve` load on a device of the class's arch (so a build warms "
                        "them), its report giving each entry's code size; ptx, what they load "
                        "on a device that runs the class's PTX only")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true",
                   help="list every point, and every compiled binary with its time")


def registry_root(cache: str | None, registry: str | None) -> Path | None:
    """Where the registry goes: ``--registry``, else ``registry/`` under ``--cache``, else
    ``None`` (the default: ``$METRALE_REGISTRY`` or the default cache's ``registry/``).

    >>> registry_root("/data/c", None), registry_root("/data/c", "/r"), registry_root(None, None)
    (PosixPath('/data/c/registry'), PosixPath('/r'), None)
    """
    if registry is not None:
        return Path(registry)
    if cache is not None:
        return Path(cache) / "registry"
    return None


def model_name(model: str) -> str:
    """The registry's model coordinate: a checkpoint or config's folder name, else the name.

    >>> model_name("qwen3-0.6b"), model_name("/tmp")
    ('qwen3-0.6b', 'tmp')
    """
    path = Path(model)
    if path.is_file():
        path = path.parent
    return path.resolve().name if path.exists() else model


def run(args: argparse.Namespace) -> int:
    """Run ``met build``; 0 when every point built, 1 otherwise (the report says which)."""
    from rich.console import Console

    from metrale.lkb.errors import ConfigError
    from metrale.lkb.target import KernelTarget
    from metrale.plan.points import plan_points
    from metrale.realize.build import build
    from metrale.realize.cache import BuildCache
    from metrale.realize.registry import Registry

    if args.jobs is not None and args.jobs < 1:
        raise ConfigError("bad job count", key="--jobs", expected="an int >= 1",
                          found=args.jobs)
    from metrale import names

    args.hardware = names.hardware_class(args.hardware, args.kernels)
    t0 = time.perf_counter()
    from metrale.realize.cache import default_cache_root

    # the points, kept under the digest of what chooses them: a warm build plans nothing
    memo = (Path(args.cache) if args.cache else default_cache_root()) / "points"
    points = plan_points(args.model, args.quant, args.hardware, args.kernels, memo=memo)
    planning = time.perf_counter() - t0
    report = build(points, args.hardware,
                   target=KernelTarget(args.hardware, model_name(args.model), args.quant),
                   kernels_dir=args.kernels, cache=BuildCache(args.cache),
                   registry=Registry(registry_root(args.cache, args.registry)),
                   progress=not args.no_progress and args.format == "table",
                   jobs=args.jobs, output=args.output).with_planning(planning)
    if args.format == "json":
        print(json.dumps(report.to_json(), indent=2))
        return 0 if report.ok else 1
    console = Console(highlight=False, soft_wrap=True)
    if args.verbose or not report.ok:
        console.print(report.table())
    if report.count("built"):
        console.print(report.compile_table(None if args.verbose else SLOWEST))
    for e in report.errors:
        console.print(str(e), markup=False)
    console.print(report.summary(), markup=False)
    if report.registry:
        console.print(f"registry summand: {report.registry}", markup=False)
    return 0 if report.ok else 1

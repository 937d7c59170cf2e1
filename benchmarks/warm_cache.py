"""Compile, ahead of a device call, every kernel a class realizes into a build cache folder.

A lent GPU's time is short and its first call starts with an empty cache: the CUDA tests bind
each family point's kernel, and the benchmarks each plan's, and each distinct (source, defines)
compiles once. The build cache is content-addressed (source, headers, defines, arch and the
compiler's version), so a folder filled here with the same ``nvcc`` is a hit there:

    METRALE_CACHE=.devcache python3 benchmarks/warm_cache.py --hardware sm_90 \
        --models llama-3.1-8b qwen3-0.6b --quants bf16 fp8 mxfp4 nvfp4

compiles every point sm_90 realizes (what ``tests/cuda`` binds) and every kernel of the named
models' plans (what ``met build`` compiles), in parallel, and prints one line per group. The
device call then carries the folder and points ``METRALE_CACHE`` at it. Writes only the cache.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="sm_90")
    ap.add_argument("--models", nargs="*", default=[], help="models whose plans to build too")
    ap.add_argument("--quants", nargs="*", default=["bf16"])
    ap.add_argument("--jobs", type=int, default=None)
    args = ap.parse_args(argv)

    from metrale.realize.build import compile_kernels
    from metrale.realize.cache import BuildCache
    from metrale.realize.compute import NvidiaTarget
    from metrale.realize.functor import realization
    from metrale.realize.hardware import default_kernels_dir

    F = realization(args.hardware)
    cache = BuildCache()
    t0 = time.perf_counter()
    done = compile_kernels(F.kernels(), F.hw.arch, cache=cache,
                           kernels_dir=default_kernels_dir(), compute=NvidiaTarget("cubin"),
                           jobs=args.jobs, what=f"{args.hardware} points")
    failed = [(key, got) for key, (got, _, _) in done.items() if isinstance(got, Exception)]
    print(f"points: {len(done)} binaries, {len(failed)} failed, "
          f"{time.perf_counter() - t0:.1f} s, cache {cache.root}")
    for key, err in failed:
        print(f"  failed {key[0]} {' '.join(key[1])}: {str(err).splitlines()[0]}")
    if args.models:
        from metrale.cli import main as met

        for model in args.models:
            for quant in args.quants:
                rc = met(["build", model, "--quant", quant, "--hardware", args.hardware,
                          "--no-progress"])
                if rc:
                    print(f"met build {model} --quant {quant}: exit {rc}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

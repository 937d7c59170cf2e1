"""What the folder's device benchmarks share: the folder's sources staged where the build looks,
programmatic dependent launches of CuPy functions, and a norm's weights as bf16 bits."""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
from bench_gpu_variants import _arg, _function  # noqa: E402

from metrale.realize.hardware import default_kernels_dir  # noqa: E402
from metrale.runtime.cuda_driver import DriverLauncher  # noqa: E402


@contextlib.contextmanager
def staged(*names: str) -> Iterator[None]:
    """The folder's files ``names`` copied into the installed kernels folder's cuda/common (where
    ``bench_gpu_variants.build`` finds sources and headers) while the block runs, removed after
    it whatever happens."""
    kernels = default_kernels_dir() / "cuda" / "common"
    copied = []
    try:
        for name in names:
            shutil.copy(Path(__file__).with_name(name), kernels / name)
            copied.append(kernels / name)
        yield
    finally:
        for path in copied:
            path.unlink()


def dependent_launcher(cp: Any) -> Callable[..., None]:
    """go(fn, grid, block, shared, args): ``fn`` (a CuPy function) launched on the current stream
    as the decode step launches (a programmatic dependent launch), device arrays by address."""
    driver = DriverLauncher()

    def go(fn: Any, grid: tuple, block: tuple, shared: int, args: tuple) -> None:
        driver.launch_dependent(_function(fn), grid, block, shared,
                                cp.cuda.get_current_stream().ptr, tuple(_arg(a) for a in args))
    return go


def norm_weight(cp: Any, n: int) -> Any:
    """A norm's n weights, 1 + noise, as bf16 bits (uint16)."""
    w = cp.random.standard_normal(n, dtype=cp.float32) * np.float32(0.1) + 1
    return (w.view(cp.uint32) >> 16).astype(cp.uint16)

"""What the folder's emulated checks share: random bf16 bit patterns, poisoned outputs, and
running a set of named checks on the host emulation (tests/host/simt) with a report."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from tests.host import simt  # noqa: E402


def bf16(rng: np.random.Generator, shape: tuple[int, ...], std: float, mean: float = 0.0
         ) -> np.ndarray:
    """Normal values as bf16 bit patterns (uint16), truncated from f32."""
    x = (rng.standard_normal(shape) * std + mean).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def poison(n: int) -> np.ndarray:
    """n bf16 NaNs: an output a kernel must write."""
    return np.full(n, 0xFFFF, np.uint16)


def finite(bits: np.ndarray) -> bool:
    """Whether every bf16 bit pattern is a finite value."""
    return bool(np.isfinite((bits.astype(np.uint32) << 16).view(np.float32)).all())


def report(checks: Callable[[Path], dict[str, bool]]) -> int:
    """Run ``checks(build_dir)`` (a temporary folder for the emulation's builds), print each
    check, and return the exit status: 0 if all hold, 1 if one does not or there is no
    emulation here."""
    ok, why = simt.available()
    if not ok:
        print(f"no host emulation: {why}")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        results = checks(Path(tmp))
    for what, good in results.items():
        print(f"{what}: {good}")
    return 0 if all(results.values()) else 1

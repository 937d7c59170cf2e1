"""What the folder's emulated checks share: random bf16 bit patterns, poisoned outputs, the decode
attention kernel as the sm_90 plans realize it (defines, entries, KERNELS.toml's launch rules),
checks over a list of cases, and running them on the host emulation (tests/host/simt) with a
report."""

from __future__ import annotations

import functools
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
from bench_gpu_variants import decode_kernel  # noqa: E402

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


@functools.cache
def decode_attention() -> Any:
    """The sm_90 realization of qk_norm_rope_kv_append_attention's bf16 decode point (NeoX rope),
    the attention the chain runs: ``launches_for(sizes)`` gives the decode launch and its merge."""
    return decode_kernel("qk_norm_rope_kv_append_attention")


def defines(kernel: Any) -> tuple[str, ...]:
    """A realized kernel's defines as the emulation takes them (NAME or NAME=VALUE)."""
    return tuple(d.removeprefix("-D") for d in kernel.defines)


def build_realized(build: Path, kernel: Any) -> Any:
    """A realized kernel's source built for the emulation with its defines and every entry the
    sm_90 plans call with them."""
    return simt.build(build, kernel.source, defines(kernel),
                      simt.class_entries(kernel.hw)[(kernel.source, kernel.defines)])


def barrier_rested(sync: np.ndarray, generation: int) -> bool:
    """A grid barrier's two words after a launch: the count back to zero, the generation at
    ``generation`` (one step a meeting)."""
    return int(sync[0]) == 0 and int(sync[1]) == generation


def per_case(prepare: Callable[[Path], Any], check: Callable[[Any, Any, np.random.Generator],
                                                             dict[str, bool]],
             cases: Iterable[Any], seed: int) -> Callable[[Path], dict[str, bool]]:
    """checks(build): ``prepare(build)`` once (the libraries), then ``check(it, case, rng)`` for
    each case, one random stream from ``seed``, the checks merged."""
    def checks(build: Path) -> dict[str, bool]:
        rng = np.random.default_rng(seed)
        prepared = prepare(build)
        out: dict[str, bool] = {}
        for case in cases:
            out |= check(prepared, case, rng)
        return out
    return checks


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

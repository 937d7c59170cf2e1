"""Shared helpers for the benchmark scripts: timing medians and writing JSON results."""

from __future__ import annotations

import gc
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from metrale.lkb.files import atomic_write

RESULTS = Path(__file__).resolve().parent / "results"


def median_time(fn: Callable[[], Any], repeats: int = 5) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs, in seconds."""
    times = []
    for _ in range(repeats):
        gc.collect()  # start each run from the same heap, not the previous run's garbage
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def result_name(name: str) -> str:
    """``name`` as a results file's stem (letters, digits, ``_``, ``-``, ``.``; no folders), for
    argparse's ``type=``.

    >>> result_name("gpu_prefill_late_v30")
    'gpu_prefill_late_v30'
    >>> result_name("../x")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: results name '../x': letters, digits, '_', '-', '.' (not first)
    """
    import argparse
    import re

    if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*", name):
        raise argparse.ArgumentTypeError(f"results name {name!r}: letters, digits, '_', '-', "
                                         "'.' (not first)")
    return name


def cache_keyword(forward: Any) -> str:
    """The keyword a transformers model's ``forward`` takes its KV cache by, which is also the
    output's field: ``cache`` from transformers 5 on, ``past_key_values`` before (deprecated
    there, to be removed)."""
    import inspect

    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def array_sha256(a: Any) -> str:
    """The SHA-256 of an array's bytes in C order: two steps' logits hash alike exactly when they
    are the same bytes (how an A/B of kernel folders tells a bit-identical change).

    >>> import numpy as np
    >>> array_sha256(np.zeros(2, np.float32)) == array_sha256(np.zeros((1, 2), np.float32))
    True
    """
    import hashlib

    import numpy as np

    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def gpu_name() -> str | None:
    """The GPU this process ran on (CUDA device 0, as CuPy names it), ``None`` on a machine
    without one: results name the card, since an H100's figures are no H200's."""
    try:
        import cupy as cp

        return cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: no GPU to name
        return None


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` (plus the machine and its GPU, where it has one) to
    ``benchmarks/results/<name>.json`` atomically."""
    gpu = {"gpu": g} if (g := gpu_name()) is not None else {}
    payload = {"benchmark": name, "machine": platform.platform(),
               "python": platform.python_version(), **gpu, **payload}
    path = RESULTS / f"{name}.json"
    atomic_write(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return path


def device_copy_rate(nbytes: int = 2 * 2**30) -> float:
    """Bytes read + written per second of a device-to-device copy on the GPU (CuPy), median
    of 10 event-timed copies after two warm-ups: the bandwidth ceiling measured in the run."""
    import cupy as cp

    a = cp.empty(nbytes, cp.uint8)
    a.fill(3)
    b = cp.empty_like(a)
    times = []
    for _ in range(12):
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record()
        b[...] = a
        e.record()
        e.synchronize()
        times.append(cp.cuda.get_elapsed_time(s, e) / 1e3)
    del a, b
    return 2 * nbytes / statistics.median(times[2:])

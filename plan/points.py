"""The points a model's plans use on a class: what ``met build`` compiles ahead of time.

The matmul points are the ones the search chooses by cost: on sm_90, GEMV-shaped for decode
and GEMM-shaped (tensor cores) for a 64-row prefill.

>>> pts = plan_points("qwen3-0.6b", "bf16", "sm_90")
>>> sorted({p.param("shape") for p in pts if p.family == "qkv"})
['gemm', 'gemv']
>>> any(p.family == "sample" for p in plan_points("tiny-qwen3", "bf16", "host"))
True
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from metrale.lkb.family import Point

from .plan import plan_for

DECODE_ROWS = (1, 8)
"""The decode rows ``met build`` plans: one row, and a batch of eight."""

PREFILL_ROWS = 64
"""A long prompt's prefill: GEMM-shaped matmuls on tensor cores."""

SHORT_PROMPT_ROWS = 2
"""A short prompt's prefill, which plans GEMV-shaped matmuls the longer prompts' plans do not
launch: with it prepared, tiny-qwen3's first prefill of 8 tokens on a fresh H100 compiled
nothing (without it and the long prompt's plan as generation runs it, two units compiled
inside the step, 1.99 s of a 5.59 s first token: ``benchmarks/bench_cold_start.py``)."""

Step = tuple[str, int, str, bool]
"""A step's plan: (mode, rows, logits, sample)."""


def prepared_steps(slots: int = 1, max_ctx: int | None = None) -> list[Step]:
    """The steps whose plans' kernels an Engine on a GPU compiles before its first step, in
    the order generation first runs them: a short and a long prompt's prefills (the last row's
    logits, then ``sample``), then the decode plans of one row and of all ``slots`` (ending in
    ``sample``); prompts no longer than ``max_ctx``. A step no generation runs (the engine's
    ``prefill`` with every row's logits) compiles when first asked for, still in parallel.

    >>> prepared_steps(4)[2:]
    [('decode', 1, 'all', True), ('decode', 4, 'all', True)]
    >>> [rows for _, rows, _, _ in prepared_steps(1, max_ctx=16)]
    [2, 16, 1]
    """
    cap = max_ctx if max_ctx is not None else PREFILL_ROWS
    steps: list[Step] = [("prefill", min(rows, cap), "last", True)
                         for rows in (SHORT_PROMPT_ROWS, PREFILL_ROWS)]
    steps += [("decode", rows, "all", True) for rows in sorted({1, slots})]
    return steps


def built_steps(slots: int = 1) -> list[Step]:
    """What ``met build`` compiles ahead of time: :func:`prepared_steps`, and a long prompt's
    prefill with every row's logits (the engine's ``prefill``, whose output head is a GEMM).

    >>> built_steps()[-1]
    ('prefill', 64, 'all', False)
    """
    return [*prepared_steps(slots), ("prefill", PREFILL_ROWS, "all", False)]


def plan_points(model: Any, quant: str, hardware: str, kernels_dir: Any = None, *,
                act: str = "bf16", memo: Path | None = None) -> frozenset[Point]:
    """Every point launched by the plans of :func:`built_steps` with a batch of eight
    (``DECODE_ROWS``): what an Engine prepares, for one slot or eight, and the engine's
    full-logits prefill.

    ``memo``: a folder where the points are kept under the digest of everything that chooses
    them (:func:`points_digest`), so that the same question asked again plans nothing (a warm
    ``met build``: its five plans of Llama-3.1-8B took 1.3 s on the CPU machine)."""
    if memo is not None:
        path = Path(memo) / f"points-{points_digest(model, quant, hardware, kernels_dir, act)}.json"
        kept = _read_points(path)
        if kept is not None:
            return kept
        got = plan_points(model, quant, hardware, kernels_dir, act=act)
        from metrale.lkb.files import atomic_write

        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({"points": [[p.family, [list(kv) for kv in p.params]]
                                                  for p in sorted(got, key=str)]}))
        return got
    points: set[Point] = set()
    steps = dict.fromkeys(built_steps(max(DECODE_ROWS)) + built_steps(1))
    for mode, rows, logits, sample in steps:
        points |= plan_for(model, quant, hardware, mode=mode, rows=rows, act=act,
                           kernels_dir=kernels_dir, logits=logits, sample=sample).points()
    return frozenset(points)


def points_digest(model: Any, quant: str, hardware: str, kernels_dir: Any = None,
                  act: str = "bf16") -> str:
    """SHA-256 of what chooses a model's plan points: the model's config, the weight format,
    the class, the activation type, every file of the kernels folder (sources, tables, shipped
    evidence), the evidence store's size and time of change (``met tune`` writes it), and
    Metrale's own planning code (the files of ``lkb``, ``realize`` and ``plan``)."""
    import metrale.lkb
    import metrale.realize
    from metrale.realize.evidence_store import default_store_path
    from metrale.realize.hardware import default_kernels_dir

    from .config import ModelConfig

    config = model if not isinstance(model, str | os.PathLike) else ModelConfig.load(model)
    h = hashlib.sha256(repr((repr(config), quant, hardware, act)).encode())
    code = [Path(m.__file__).parent for m in (metrale.lkb, metrale.realize)]
    code.append(Path(__file__).parent)
    kernels = Path(kernels_dir) if kernels_dir is not None else default_kernels_dir()
    for root in [*code, kernels]:
        for f in sorted(root.rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts:
                h.update(f"{f.relative_to(root)}\0".encode())
                h.update(f.read_bytes())
    store = default_store_path()
    if store.is_file():
        st = store.stat()
        h.update(f"store {st.st_size} {st.st_mtime_ns}".encode())
    return h.hexdigest()


def _read_points(path: Path) -> frozenset[Point] | None:
    """The points kept at ``path``, or None where there are none or they do not read back."""
    try:
        rows = json.loads(path.read_text())["points"]
        return frozenset(Point(str(family), tuple((str(k), v) for k, v in params))
                         for family, params in rows)
    except (OSError, ValueError, KeyError, TypeError):
        return None

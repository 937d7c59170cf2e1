"""benchmarks/stale_evidence.py lists each kernel without a current record once, under the first
benchmarked plan that launches it (tests/mock/test_evidence.py asserts it lists nothing for the
shipped sm_90 records)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from stale_evidence import STEPS, unmeasured  # noqa: E402

from metrale.plan.plan import plan_for  # noqa: E402


def test_a_class_without_records_lists_every_kernel_once_under_its_first_plan():
    """sm_80 has no records: every kernel of Qwen3-0.6B's exact bf16 plans is listed, once, under
    the first of the four plans (decode at 1 and 8 rows, prefill with every row's logits and the
    last row's) that launches it."""
    found = unmeasured("sm_80", ["qwen3-0.6b"], ["bf16"], ["exact"])
    plans = [plan_for("qwen3-0.6b", "bf16", "sm_80", mode=m, rows=r, policy="exact", logits=lg)
             for m, r, lg in STEPS]
    points = [[str(k.point) for k in p.kernels if k.kernel is not None] for p in plans]
    listed = [p for ps in found.values() for p in ps]
    assert len(listed) == len(set(listed)) == len(set().union(*points))
    first = found["qwen3-0.6b exact bf16 decode 1 all"]
    assert set(first) == set(points[0]) and "linear" in " ".join(first)
    for plan, ps in found.items():  # a point is listed under the first plan that has it
        i = next(i for i, (m, r, lg) in enumerate(STEPS) if plan.endswith(f"{m} {r} {lg}"))
        assert all(p in points[i] and not any(p in q for q in points[:i]) for p in ps), plan

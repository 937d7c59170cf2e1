"""The evidence report of a class: each kernel F_H gives, with its evidence status and record.

``evidence_report(hw, points)`` realizes each point on ``hw`` and reads every class's
``EVIDENCE.toml``: a kernel is "measured on <hw>" when a record of this class matches its
current source hash (the report shows the latest such record: value, floor, date), "stale" when
only records of an older source exist, "shared, unmeasured" otherwise, and "evidence
unreadable" where a damaged record may concern it. Host kernels are the reference semantics.

>>> r = evidence_report("sm_80")  # a class nothing has been measured on
>>> r.counts()["shared, unmeasured"] == len(r.rows) > 0
True
>>> print(str(r).splitlines()[0])
evidence on sm_80: 319 kernels; shared, unmeasured 319
>>> r = evidence_report("sm_90")  # the H200's records count on sm_90 only
>>> r.counts()["measured on sm_90"] > 0
True
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs

from metrale.lkb.family import Point
from metrale.realize.evidence import (
    EvidenceLoad,
    EvidenceRecord,
    evidence_status,
    find_record,
    load_all_evidence,
)
from metrale.realize.functor import Realization, realization

REFERENCE = "reference semantics"


@attrs.frozen
class EvidenceRow:
    """One kernel of the report: its point, kernel identity, provenance, status and record."""

    point: Point
    kernel: str
    provenance: str
    status: str
    record: EvidenceRecord | None = None

    def __str__(self) -> str:
        rec = ""
        if self.record is not None:
            r = self.record
            rec = f" ({r.metric} {r.value:g} {r.unit}" + (
                "" if r.floor is None else f", floor {r.floor:g}") + f", {r.date})"
        return f"{self.point}: {self.status}{rec}"


@attrs.frozen
class EvidenceReport:
    """What is measured, stale or shared among the kernels of one class; see the module."""

    hw: str
    rows: tuple[EvidenceRow, ...]
    errors: tuple[str, ...] = ()

    def counts(self) -> dict[str, int]:
        """How many kernels have each status (statuses in order of first appearance)."""
        return dict(Counter(r.status for r in self.rows))

    def to_json(self) -> dict[str, Any]:
        return {"hardware": self.hw, "counts": self.counts(), "errors": list(self.errors),
                "kernels": [{"point": str(r.point), "kernel": r.kernel,
                             "provenance": r.provenance, "status": r.status,
                             "record": None if r.record is None else attrs.asdict(r.record)}
                            for r in self.rows]}

    def __str__(self) -> str:
        counts = "; ".join(f"{k} {v}" for k, v in self.counts().items())
        lines = [f"evidence on {self.hw}: {len(self.rows)} kernels; {counts}"]
        lines += [f"  {r}" for r in self.rows if r.record is not None or r.status != "shared, "
                  "unmeasured"]
        lines += [f"  error: {e}" for e in self.errors]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        from metrale.realize.display import evidence_report_html

        return evidence_report_html(self)


def evidence_report(hw: str | Realization, points: Iterable[Point] | None = None, *,
                    kernels_dir: Path | str | None = None,
                    records: EvidenceLoad | None = None) -> EvidenceReport:
    """The report for ``points`` (default: every compiled point) on class ``hw``; points not
    realized there are left out (the realization's display says why)."""
    F = hw if isinstance(hw, Realization) else realization(hw, kernels_dir=kernels_dir)
    load = records if records is not None else load_all_evidence(F.kernels_dir)
    wanted = F.presentation.points() if points is None else tuple(points)
    rows = []
    for p in sorted(set(wanted), key=lambda q: (q.family, str(q))) if points is not None \
            else wanted:
        k = F.realize(p)
        if k is None:
            continue
        if k.source is None:
            rows.append(EvidenceRow(k.point, k.key, k.provenance, REFERENCE))
            continue
        status = evidence_status(load, F.name, p.family, str(k.point), k.source_hash)
        rec = find_record(load, F.name, p.family, str(k.point), k.source_hash)
        rows.append(EvidenceRow(k.point, k.key, k.provenance, status, rec))
    return EvidenceReport(F.name, tuple(rows), tuple(str(e) for e in load.errors))


def current_sources(hw: str | Realization, kernels_dir: Path | str | None = None
                    ) -> dict[tuple[str, str], frozenset[str]]:
    """``{(family, point): source hashes}`` of the kernels class ``hw`` realizes today: its
    compiled points and those of its leaf folders (``kernels/<hw>/<model>/<quant>/``)."""
    from metrale.realize.residual import leaf_targets

    F = hw if isinstance(hw, Realization) else realization(hw, kernels_dir=kernels_dir)
    found: dict[tuple[str, str], set[str]] = {}
    views = [F] + [realization(F.name, kernels_dir=F.kernels_dir, presentation=F.presentation,
                               target=t) for t in leaf_targets(F.name, F.kernels_dir)]
    for view in views:
        for k in view.kernels():
            if k.source is not None:
                found.setdefault((k.point.family, str(k.point)), set()).add(k.source_hash)
    return {key: frozenset(v) for key, v in found.items()}


def counting(records: Iterable[EvidenceRecord],
             current: dict[tuple[str, str], frozenset[str]]) -> tuple[EvidenceRecord, ...]:
    """The records that count: those of a current source, and of these the latest for each
    point, metric and shape (a later one wins a tie of dates), in the order given.

    >>> r = EvidenceRecord("sm_90", "H200", "add", "add[f32]", "bandwidth", 9.0, None, "GB/s",
    ...                    "2026-12-01", "nvcc", "ab")
    >>> later = attrs.evolve(r, value=10.0, date="2026-12-02")
    >>> stale = attrs.evolve(r, source_hash="old", date="2026-12-03")
    >>> counting([r, later, stale], {("add", "add[f32]"): {"ab"}}) == (later,)
    True
    """
    latest: dict[tuple, tuple[int, EvidenceRecord]] = {}
    for i, r in enumerate(records):
        if r.source_hash not in current.get((r.family, r.point), ()):
            continue
        key = (r.hw, r.family, r.point, r.metric, r.shape, r.source_hash)
        if key not in latest or r.date >= latest[key][1].date:
            latest[key] = (i, r)
    return tuple(r for _, r in sorted(latest.values(), key=lambda ir: ir[0]))

"""Relations on H: whether each LKB relation holds bit-identically on a class, or only bounded.

A relation holds bit-identically on H at a compiled rhs point exactly when every point of
both sides is realized on H and the lhs kernels and the rhs kernel declare the same
reduction orders. It holds up to its bound when it is declared ``bounded``. A relation
declared bit-identical whose realizations declare different orders on H "differs": it has
no bound to fall back on, so no numerics policy may apply it there.

Orders are compared as *sets* of declared strings, not multisets: a fused kernel states each
distinct order once, so ``qkv``'s one k-order stands for the three ``linear`` k-orders it
replaces.

>>> from metrale.realize.functor import realization
>>> F = realization("sm_90")
>>> r = relation_on(F.presentation.relation("add_rmsnorm"), F)
>>> r.status, r.points[0].status
('bit_identical', 'bit_identical')
>>> relation_on(F.presentation.relation("splitk_pairwise"), F).status
'bounded'
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import attrs

from metrale.lkb.family import Point
from metrale.lkb.presentation import Presentation
from metrale.lkb.relation import Bound, Relation
from metrale.realize.functor import Realization, canonical_point

BIT_IDENTICAL = "bit_identical"
BOUNDED = "bounded"
DIFFERS = "differs"
NOT_REALIZED = "not realized"
NOT_APPLICABLE = "not applicable"
MIXED = "mixed"
STATUSES = (BIT_IDENTICAL, BOUNDED, DIFFERS, NOT_REALIZED, NOT_APPLICABLE, MIXED)


@attrs.frozen
class PointVerdict:
    """The relation at one compiled rhs point and the lhs points it replaces."""

    rhs: Point
    lhs: tuple[Point, ...]
    status: str
    reason: str

    def __str__(self) -> str:
        return f"{self.rhs}: {self.status} ({self.reason})"


@attrs.frozen
class RelationOnH:
    """A relation on one class: a summary status with its reason, and a verdict per point.

    ``status`` is one of bit_identical, bounded, differs, not realized (every applicable
    point shares it), mixed (they do not), or not applicable (no rhs point has a compiled
    lhs). ``bound`` is the relation's declared bound, where it has one.
    """

    relation: Relation
    hw: str
    status: str
    reason: str
    points: tuple[PointVerdict, ...] = ()
    bound: Bound | None = None

    def at(self, rhs: Point) -> tuple[PointVerdict, ...]:
        """The verdicts at one rhs point (one per compiled lhs instance)."""
        return tuple(v for v in self.points if v.rhs == rhs)

    def holds_exactly(self, rhs: Point) -> bool:
        """Whether the relation is bit-identical on this class at ``rhs`` for every lhs."""
        found = self.at(rhs)
        return bool(found) and all(v.status == BIT_IDENTICAL for v in found)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready summary with every point verdict."""
        return {"relation": self.relation.name, "hardware": self.hw, "status": self.status,
                "reason": self.reason,
                "bound": None if self.bound is None else {"rel": self.bound.rel,
                                                          "abs": self.bound.abs},
                "points": [{"rhs": str(v.rhs), "lhs": [str(p) for p in v.lhs],
                            "status": v.status, "reason": v.reason} for v in self.points]}

    def __str__(self) -> str:
        return f"{self.relation.name} on {self.hw}: {self.status} ({self.reason})"


def _matches(point: Point, pins: dict[str, Any]) -> bool:
    params = dict(point.params)
    return all(params.get(k) == v for k, v in pins.items())


def lhs_instances(rel: Relation, rhs: Point, P: Presentation) -> list[tuple[Point, ...] | str]:
    """Each way to instantiate the lhs at ``rhs``: a tuple of compiled lhs points, or the
    reason an instance is not compiled. Unpinned rhs parameters are shared by name with the
    lhs; lhs parameters left open range over their family's compiled points.

    >>> P = Presentation.load()
    >>> rel = P.relation("dequant_linear")
    >>> rhs = P.family("linear").point(act="f32", weight="fp8", shape="gemv", k_block=256,
    ...                                across="sequential")
    >>> [str(p) for p in lhs_instances(rel, rhs, P)[0]]
    ['dequant[weight=fp8]', 'linear[act=f32,weight=f32,shape=gemv,k_block=256,across=sequential]']
    """
    rhs_call = rel.rhs.calls[0]
    rhs_pins = dict(rhs_call.pins)
    shared = {k: v for k, v in rhs.params if k not in rhs_pins}
    options: list[list[Point]] = []
    for call in rel.lhs.calls:
        fam = P.family(call.family)
        fixed = {**{k: v for k, v in shared.items() if k in fam.domains}, **dict(call.pins)}
        found = [p for p in fam.points if _matches(p, fixed)]
        if not found:
            want = canonical_point(fam, {k: v for k, v in fixed.items()})
            return [f"lhs point {want} is not compiled"]
        options.append(found)
    out: list[tuple[Point, ...] | str] = []
    for combo in itertools.product(*options):
        # lhs parameters not fixed by the rhs are still shared by name among lhs calls
        seen: dict[str, Any] = {}
        ok = True
        for p, call in zip(combo, rel.lhs.calls):
            for k, v in p.params:
                if k in dict(call.pins):
                    continue
                if seen.setdefault(k, v) != v:
                    ok = False
        if ok:
            out.append(tuple(combo))
    return out


def _verdict(rel: Relation, F: Realization, rhs: Point, lhs: tuple[Point, ...]) -> PointVerdict:
    for p in (*lhs, rhs):
        if not F.realizes(p):
            return PointVerdict(rhs, lhs, NOT_REALIZED, F.why_not(p))
    if not rel.exact:
        b = rel.bound
        return PointVerdict(rhs, lhs, BOUNDED, f"declared bounded: rel {b.rel}, abs {b.abs}"
                            if b else "declared bounded")
    left = {r for p in lhs for r in F.realize(p).reduction}
    right = set(F.realize(rhs).reduction)
    if left == right:
        why = "same reduction orders" if right else "no reductions on either side"
        return PointVerdict(rhs, lhs, BIT_IDENTICAL, why)
    return PointVerdict(rhs, lhs, DIFFERS,
                        f"reduction orders differ on {F.name} (lhs: {sorted(left)}; rhs: "
                        f"{sorted(right)}) and the relation declares no bound")


def relation_on(rel: Relation, F: Realization, presentation: Presentation | None = None
                ) -> RelationOnH:
    """The relation on F's class, decided per compiled rhs point and summarized."""
    P = presentation if presentation is not None else F.presentation
    rhs_call = rel.rhs.calls[0]
    rhs_fam = P.family(rhs_call.family)
    verdicts: list[PointVerdict] = []
    skipped = 0
    for rhs in rhs_fam.points:
        if not _matches(rhs, dict(rhs_call.pins)):
            continue
        for inst in lhs_instances(rel, rhs, P):
            if isinstance(inst, str):
                skipped += 1
                continue
            verdicts.append(_verdict(rel, F, rhs, inst))
    bound = rel.bound
    if not verdicts:
        return RelationOnH(rel, F.name, NOT_APPLICABLE,
                           f"no compiled rhs point of {rhs_fam.name} has a compiled lhs", (),
                           bound)
    counts = Counter(v.status for v in verdicts)
    if len(counts) == 1:
        status = verdicts[0].status
        reasons = list(dict.fromkeys(v.reason for v in verdicts))
        reason = reasons[0] + (f" (+{len(reasons) - 1} other reason"
                               f"{'s' if len(reasons) > 2 else ''})" if len(reasons) > 1 else "")
    else:
        status = MIXED
        reason = ", ".join(f"{s} at {n} point{'s' if n != 1 else ''}"
                           for s, n in sorted(counts.items(),
                                              key=lambda kv: (-kv[1], STATUSES.index(kv[0]))))
    if skipped:
        reason += f"; {skipped} rhs point{'s' if skipped != 1 else ''} without a compiled lhs"
    return RelationOnH(rel, F.name, status, reason, tuple(verdicts), bound)


def relations_on(F: Realization) -> tuple[RelationOnH, ...]:
    """Every relation of F's presentation on F's class.

    >>> from metrale.realize.functor import realization
    >>> sorted({r.status for r in relations_on(realization("host"))})
    ['bit_identical', 'bounded']
    """
    return tuple(relation_on(r, F) for r in F.presentation.relations)

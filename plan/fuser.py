"""rewrite_H: apply the relations a hardware class realizes to a lowered LKB diagram.

The rewriter is generic over FUSIONS.toml: a relation is an equation between two diagrams
(``Presentation.equation``), and its lhs, a diagram whose boxes are named by their families and
carry the pinned parameters, is the pattern, matched by a small backtracking search anchored
on box families and grown through shared wires; the fused box is the rhs's, with the matched
parameters. No code path names a relation. Relations apply by priority,
then in diagram order. Every candidate match that is not applied is kept with its reason:

- the policy is ``exact`` and the relation is bounded (declared, or on this class because the
  two sides' realizations declare different reduction orders);
- the rhs point is not a compiled point, or is not realized on the class (with why);
- it overlaps a match already applied (higher priority or earlier);
- an intermediate value is used outside the pattern, or fusing would create a cycle;
- the boxes' runtime attributes disagree;
- the rhs point's kernel cannot serve the plan's sizes (its limits, or the class's shared
  memory), when the rewrite is given them.

>>> from metrale.plan.circuit import circuit_for
>>> from metrale.plan.lower import lowering
>>> from metrale.realize.functor import realization
>>> c = circuit_for("tiny-qwen3")
>>> lowered = lowering(c).functor(c.diagram)
>>> result = rewrite(lowered, realization("host"), policy="exact")
>>> sorted({a.relation for a in result.applied})[:3]
['add_rmsnorm', 'gate_up_swiglu', 'kv_append_attention']
>>> len(result.diagram) < len(lowered)
True
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import attrs

from metrale.lkb.diagram import Box, Diagram, Source
from metrale.lkb.errors import LaunchError
from metrale.lkb.family import Point
from metrale.lkb.presentation import Presentation
from metrale.lkb.relation import Relation
from metrale.realize.kernel import box_numbers

POLICIES = ("exact", "bounded")


class Realizer(Protocol):
    """What the rewriter asks of F_H."""

    hw: Any

    def realize(self, point: Point) -> Any: ...

    def why_not(self, point: Point) -> str: ...


@attrs.frozen
class Applied:
    """A relation applied at some boxes of the lowered diagram, giving one fused box."""

    relation: str
    boxes: tuple[int, ...]
    fused: Box
    numerics: str  # "bit_identical" or "bounded" (on this class)


@attrs.frozen
class Declined:
    """A candidate match that was not applied, and why."""

    relation: str
    boxes: tuple[int, ...]
    families: tuple[str, ...]
    reason: str


@attrs.frozen
class Rewrite:
    """The rewritten diagram, with what was applied and what was declined."""

    diagram: Diagram
    applied: tuple[Applied, ...]
    declined: tuple[Declined, ...]
    origin: tuple[tuple[int, ...], ...]
    """For each box of ``diagram``, the boxes of the lowered diagram it stands for."""
    steps: tuple[RewriteStep, ...] = attrs.field(default=(), eq=False, repr=False)
    """The rewriting step by step: for each relation that applied, the diagram it applied to
    and where (its provenance, which ``metrale.testing.rewriting_laws`` checks)."""
    met: tuple[tuple[Signature, tuple[int, ...], str], ...] = attrs.field(
        default=(), eq=False, repr=False)
    """Every match met, as ``(signature, lowered boxes, status)``, status one of applied,
    overlap (another match took a box), skipped (not chosen) and refused (any other reason):
    the alternatives the search (``plan.search``) chooses among are the first three."""


@attrs.frozen
class RewriteStep:
    """One relation applied, at once, at disjoint matches of ``before``: each match's boxes
    (indices into ``before``) and the fused box that replaced them."""

    relation: str
    before: Diagram = attrs.field(eq=False, repr=False)
    matches: tuple[tuple[tuple[int, ...], Box], ...]


@attrs.frozen
class _Match:
    boxes: tuple[int, ...]          # diagram box per lhs box (the pattern's order)
    names: tuple[tuple[Source, Source], ...]  # pattern source -> diagram source
    params: tuple[tuple[str, Any], ...]


_ORDERS: dict[int, tuple[Diagram, list[int]]] = {}


def _order(lhs: Diagram) -> list[int]:
    """The pattern's boxes in an order where each shares a wire with an earlier one (the lhs
    is connected, so a match grows from one anchor through shared wires); memoized per
    pattern object (the presentation builds each relation's sides once)."""
    hit = _ORDERS.get(id(lhs))
    if hit is not None and hit[0] is lhs:
        return hit[1]
    if len(_ORDERS) > 4096:
        _ORDERS.clear()
    out = _order_of(lhs)
    _ORDERS[id(lhs)] = (lhs, out)
    return out


def _order_of(lhs: Diagram) -> list[int]:
    def wires(i: int) -> set[Source]:
        return set(lhs.wiring[i]) | {(i, p) for p in range(len(lhs.boxes[i].cod))}

    order, seen = [0], wires(0)
    while len(order) < len(lhs.boxes):
        for i in range(len(lhs.boxes)):
            if i not in order and wires(i) & seen:
                order.append(i)
                seen |= wires(i)
                break
        else:  # pragma: no cover - the presentation check refuses disconnected sides
            raise AssertionError("disconnected lhs")
    return order


class _Index:
    """Lookups over one flat diagram: boxes by family, consumers of each source."""

    def __init__(self, d: Diagram) -> None:
        self.d = d
        self.by_name: dict[str, list[int]] = {}
        for j, b in enumerate(d.boxes):
            self.by_name.setdefault(b.name, []).append(j)
        self.consumers = d.consumers()
        self.params = [dict(b.params) for b in d.boxes]


def _matches(lhs: Diagram, P: Presentation, ix: _Index) -> Iterator[_Match]:
    """Every match of the pattern diagram ``lhs`` (a relation's lhs: boxes named by their
    families, their parameters the pins) in ``ix.d``: boxes of those families with the pinned
    parameters, the parameters the pattern leaves free equal wherever they recur, wired as the
    pattern is wired (each pattern wire one diagram wire)."""
    pattern = lhs.boxes
    order = _order(lhs)
    keys = [[k for k, _ in P.family(b.name).params] for b in pattern]
    pins_of = [dict(b.params) for b in pattern]
    boxes, wiring = ix.d.boxes, ix.d.wiring

    def fits(ci: int, j: int, names: dict[Source, Source], params: dict[str, Any]
             ) -> tuple[dict, dict] | None:
        # cheap refusals first; the maps are copied only for a box that fits
        if boxes[j].name != pattern[ci].name:
            return None
        bp, pins = ix.params[j], pins_of[ci]
        fresh: dict[str, Any] = {}
        for k in keys[ci]:
            v = bp.get(k)
            if k in pins:
                if v != pins[k]:
                    return None
            elif k in params:
                if params[k] != v:
                    return None
            else:
                fresh[k] = v
        added: dict[Source, Source] = {}
        for arg, src in zip(lhs.wiring[ci], wiring[j]):
            have = names.get(arg) or added.get(arg)
            if have is None:
                added[arg] = src
            elif have != src:
                return None
        for p in range(len(pattern[ci].cod)):
            have = names.get((ci, p)) or added.get((ci, p))
            if have is None:
                added[(ci, p)] = (j, p)
            elif have != (j, p):
                return None
        return ({**names, **added} if added else names,
                {**params, **fresh} if fresh else params)

    def candidates(ci: int, names: dict[Source, Source]) -> list[int]:
        for p in range(len(pattern[ci].cod)):
            if (ci, p) in names:
                s, q = names[(ci, p)]
                return [s] if s >= 0 and q == p else []
        for i, arg in enumerate(lhs.wiring[ci]):
            if arg in names:
                return sorted({j for j, port in ix.consumers.get(names[arg], ())
                               if port == i and j < len(boxes)})
        return list(ix.by_name.get(pattern[ci].name, ()))

    def search(k: int, chosen: dict[int, int], names: dict, params: dict) -> Iterator[_Match]:
        if k == len(order):
            yield _Match(tuple(chosen[i] for i in range(len(pattern))),
                         tuple(sorted(names.items())), tuple(sorted(params.items())))
            return
        ci = order[k]
        for j in candidates(ci, names):
            if j in chosen.values():
                continue
            got = fits(ci, j, names, params)
            if got is not None:
                yield from search(k + 1, {**chosen, ci: j}, *got)

    seen: set[frozenset[int]] = set()
    for m in search(0, {}, {}, {}):
        key = frozenset(m.boxes)
        if key not in seen:
            seen.add(key)
            yield m


Signature = tuple
"""What a match is, up to the layer it sits in: the relation, the matched boxes (values, so
equal across layers of equal shapes) and, for each wire entering the match, the box that
produces it (family and types) or the step input's type. The search (``plan.search``) chooses
by signature, so one choice holds for every layer where the same match recurs."""


def match_signature(rel: str, boxes: tuple[int, ...], d: Diagram, ix: _Index) -> Signature:
    """The :data:`Signature` of a match of ``rel`` at ``boxes`` (sorted indices) of the lowered
    diagram ``d``: taken there, not in the diagram being rewritten, so that a match has one
    signature whichever other matches applied before it."""
    inside = set(boxes)
    context = []
    for j in boxes:
        for s in d.wiring[j]:
            if s[0] in inside:
                continue
            if s[0] < 0:
                context.append(("input", d.dom.types[s[1]]))
            else:
                b = d.boxes[s[0]]
                context.append((b.name, b.dom, b.cod, s[1]))
    return (rel, tuple(d.boxes[j] for j in boxes), tuple(context))


def _reductions(F: Realizer, P: Presentation, point: Point) -> frozenset[str]:
    kernel = F.realize(point)
    if kernel is not None:
        return frozenset(r for r in kernel.reduction if r)
    return frozenset(P.family(point.family).reductions(point))


def rewrite(d: Diagram, F: Realizer, *, policy: str = "exact",
            presentation: Presentation | None = None,
            sizes: Mapping[str, int] | None = None,
            skip: frozenset[Signature] = frozenset(),
            frame: tuple[Diagram, Any, tuple[int, ...]] | None = None,
            served: dict[tuple, str] | None = None,
            only: frozenset[str] | None = None, record: bool = False) -> Rewrite:
    """Apply every relation ``F``'s class realizes, under ``policy``; keep what was declined.

    With the circuit's ``sizes``, a match whose rhs kernel cannot be launched at them is
    declined, so that a kernel serving only some shapes never leaves a plan unrunnable.
    A match whose signature (:func:`match_signature`) is in ``skip`` is declined as not
    chosen: the search by cost (``plan.search``) found the plan cheaper without it. Where
    matches overlap, the relations not skipped apply by priority, so any set of
    non-overlapping matches is the result of some ``skip``. ``frame`` (a lowered diagram, its
    index and the box of it each box of ``d`` is) says that ``d`` is a part of a larger
    lowered diagram: signatures are then taken there (the search rewrites parts); ``served``
    memoizes, across calls, why a kernel cannot serve a box's sizes; ``only`` restricts the
    relations tried to those named (the search's parts, where no other can match); ``record``
    keeps every match met with its signature (``Rewrite.met``, what the search reads)."""
    P = presentation if presentation is not None else F.presentation
    if policy not in POLICIES:
        from metrale.lkb.errors import ConfigError

        raise ConfigError("unknown numerics policy", key="policy",
                          expected="exact or bounded", found=repr(policy))
    origin: list[tuple[int, ...]] = [(j,) for j in range(len(d.boxes))]
    applied: list[Applied] = []
    declined: list[Declined] = []
    relations = sorted((r for r in P.relations if only is None or r.name in only),
                       key=lambda r: -r.priority)
    lowered = ix = _Index(d)
    sides = {rel.name: P.equation(rel.name) for rel in relations}
    # the lowered diagram's matches, found once, serve until a relation splices
    candidates = initial = {rel.name: list(_matches(sides[rel.name][0], P, lowered))
                            for rel in relations}
    frame_d, frame_ix, fmap = frame if frame is not None else (d, lowered, None)

    def signature(rel: str, where: tuple[int, ...]) -> tuple[Signature, tuple[int, ...]]:
        w = where if fmap is None else tuple(sorted(fmap[o] for o in where))
        return match_signature(rel, w, frame_d, frame_ix), w
    if served is None:
        served = {}  # (point, sizes at the box) -> why its kernel cannot serve
    trace: list[RewriteStep] = []
    met: list[tuple[Signature, tuple[int, ...], str]] = []
    for rel in relations:
        if ix.d is not d:  # the last relation spliced its matches in
            ix = _Index(d)
        used: dict[int, str] = {}
        lhs, rhs = sides[rel.name]
        fused_here: list[tuple[_Match, Box, list[Source], list[Source]]] = []
        # the lowered diagram's matches, found once, serve until a relation splices
        for m in initial[rel.name] if ix is lowered else _matches(lhs, P, ix):
            fams = tuple(d.boxes[j].name for j in m.boxes)
            where = tuple(sorted(o for j in m.boxes for o in origin[j]))
            sig, at = signature(rel.name, where) if skip or record else (None, where)
            if skip and sig in skip:
                if any(j in used for j in m.boxes):
                    reason = f"overlaps a match of {used[next(j for j in m.boxes if j in used)]}" \
                             " already applied"
                else:
                    reason = ("not chosen: the plan costs less without it (the search by "
                              "cost)")
                if record:
                    admissible = not _judge(rel, lhs, rhs, m, d, ix, F, P, policy, {}, sizes,
                                            served)[0]
                    met.append((sig, at, "skipped" if admissible else "refused"))
                declined.append(Declined(rel.name, where, fams, reason))
                continue
            reason, box, numerics = _judge(rel, lhs, rhs, m, d, ix, F, P, policy, used, sizes,
                                           served)
            if record:
                status = "applied" if not reason else "refused"
                if reason.startswith("overlaps") and not _judge(rel, lhs, rhs, m, d, ix, F, P,
                                                                policy, {}, sizes, served)[0]:
                    status = "overlap"  # admissible but for the overlap: an alternative
                met.append((sig, at, status))
            if reason:
                declined.append(Declined(rel.name, where, fams, reason))
                continue
            for j in m.boxes:
                used[j] = rel.name
            names = dict(m.names)
            fused_here.append((m, box, [names[s] for s in rhs.wiring[0]],
                               [names[s] for s in lhs.outputs]))
            applied.append(Applied(rel.name, where, box, numerics))
        if fused_here:
            trace.append(RewriteStep(rel.name, d, tuple((m.boxes, box)
                                                        for m, box, _, _ in fused_here)))
            d, origin = _splice(d, fused_here, origin)
    boxes_of = {rel: [m.boxes for m in ms] for rel, ms in candidates.items()}
    shadowed = _shadowed(relations, boxes_of, applied, declined, lowered)
    declined.extend(shadowed)
    by_rel = {rel.name: rel for rel in relations}
    for x in shadowed if record else ():
        m = next(m for m in candidates[x.relation] if tuple(sorted(m.boxes)) == x.boxes)
        lhs, rhs = sides[x.relation]
        ok = not _judge(by_rel[x.relation], lhs, rhs, m, lowered.d, lowered, F, P, policy, {},
                        sizes, served)[0]
        sig, at = signature(x.relation, x.boxes)
        met.append((sig, at, "overlap" if ok else "refused"))
    return Rewrite(d, tuple(applied), tuple(declined), tuple(origin), tuple(trace), tuple(met))


@attrs.frozen(eq=False, repr=False)
class Rewriting:
    """rewrite_H as a value: ``LKB → LKB``, composable with functors by ``>>``.

    Built from data (the class's F_H, the presentation, the policy, the circuit's sizes), it
    compares and hashes by them. ``R(d)`` is the rewritten diagram; ``R.run(d)`` the whole
    :class:`Rewrite` (what was applied and declined, and where each box came from), computed
    once per diagram object. Laws (``metrale.testing.rewriting_laws``): it keeps the
    interface, it is idempotent, each step is an instance of a relation, and under the exact
    policy the bytes the diagram computes are unchanged.

    >>> from metrale.plan.circuit import circuit_for
    >>> from metrale.plan.lower import lowering
    >>> from metrale.realize.functor import realization
    >>> c = circuit_for("tiny-qwen3")
    >>> F = realization("host")
    >>> L = lowering(c).functor >> rewriting(F, "exact")
    >>> print(L)
    lower >> rewrite_host[exact]
    >>> d = L(c.diagram)
    >>> (d.dom, d.cod) == (c.diagram.dom, c.diagram.cod), L == lowering(c).functor >> rewriting(F)
    (True, True)
    """

    realization: Any
    policy: str = "exact"
    presentation: Presentation | None = None
    sizes: tuple[tuple[str, int], ...] | None = None
    skip: frozenset = frozenset()
    """Signatures of the matches the search by cost chose not to apply (``rewrite``)."""
    _last: list = attrs.field(factory=list)

    dom = cod = "LKB"

    def _key(self) -> tuple:
        F = self.realization
        return (F.functor, self.policy, self.presentation, self.sizes, self.skip)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Rewriting) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def last_input(self) -> Diagram:
        """The diagram this rewriting was last applied to (whose record ``run`` keeps)."""
        if not self._last:
            from metrale.lkb.errors import PlanError

            raise PlanError("this rewriting has not been applied yet", key=str(self))
        return self._last[0][0]

    def run(self, d: Diagram) -> Rewrite:
        """The rewrite of ``d`` with its record (kept for the last diagram rewritten)."""
        if self._last and self._last[0][0] is d:
            return self._last[0][1]
        out = rewrite(d, self.realization, policy=self.policy, presentation=self.presentation,
                      sizes=None if self.sizes is None else dict(self.sizes), skip=self.skip)
        self._last[:] = [(d, out)]
        return out

    def __call__(self, d: Box | Diagram) -> Diagram:
        return self.run(d.diagram if isinstance(d, Box) else d).diagram

    def __rshift__(self, other: Any) -> Any:
        from metrale.lkb.pipeline import Pipeline

        return Pipeline((self,)) >> other

    def __str__(self) -> str:
        return f"rewrite_{self.realization.hw.name}[{self.policy}]"

    __repr__ = __str__


def rewriting(F: Any, policy: str = "exact", *, presentation: Presentation | None = None,
              sizes: Mapping[str, int] | None = None,
              skip: frozenset = frozenset()) -> Rewriting:
    """rewrite_H for F's class under ``policy`` (see :class:`Rewriting`); ``presentation``
    (default F's) gives the relations, ``sizes`` the circuit's, to decline matches whose
    kernel cannot serve them, ``skip`` the matches the search chose not to apply."""
    if policy not in POLICIES:
        from metrale.lkb.errors import ConfigError

        raise ConfigError("unknown numerics policy", key="policy",
                          expected="exact or bounded", found=repr(policy))
    return Rewriting(F, policy, presentation,
                     None if sizes is None else tuple(sorted(sizes.items())), frozenset(skip))


def fuser(circuit: Any, F: Any, policy: str = "exact", *, context: int = 1024,
          presentation: Presentation | None = None, shape: str = "gemv",
          skip: frozenset = frozenset()) -> Any:
    """L_H for ``circuit`` on F's class: ``lowering(circuit).functor >> rewriting(F, policy)``
    with the circuit's sizes at ``context`` (what ``plan_for`` composes with ``F.functor``);
    ``shape`` and ``skip`` are the search's choices (``plan.search.Choice``).

    >>> from metrale.plan.circuit import circuit_for
    >>> from metrale.realize.target import target
    >>> c = circuit_for("tiny-llama")
    >>> F = target("sm_90").realization()
    >>> image = (fuser(c, F) >> F.functor)(c.diagram)
    >>> sorted({b.name for b in image.boxes})[:3]
    ['merge_heads', 'metrale_add_rmsnorm', 'metrale_embedding']
    """
    from .lower import lowering

    P = presentation if presentation is not None else F.presentation
    sizes = {**circuit.sizes(context), "context": context}
    return lowering(circuit, P, max_ctx=context, shape=shape).functor >> rewriting(
        F, policy, presentation=P, sizes=sizes, skip=skip)


def _shadowed(relations: list[Relation], candidates: Mapping[str, list[tuple[int, ...]]],
              applied: list[Applied], declined: list[Declined], lowered: _Index
              ) -> list[Declined]:
    """Matches of the lowered diagram that vanished because another relation took a box."""
    owner: dict[int, str] = {}
    for a in applied:
        for j in a.boxes:
            owner.setdefault(j, a.relation)
    seen = {(x.relation, tuple(sorted(x.boxes))) for x in (*applied, *declined)}
    covered: dict[str, list[set[int]]] = {}
    for x in (*applied, *declined):
        covered.setdefault(x.relation, []).append(set(x.boxes))
    out = []
    for rel in relations:
        for boxes in candidates[rel.name]:
            key = (rel.name, tuple(sorted(boxes)))
            if key in seen or any(set(boxes) <= c for c in covered.get(rel.name, ())):
                continue
            others = sorted({owner[j] for j in boxes if j in owner and owner[j] != rel.name})
            if others:
                out.append(Declined(rel.name, key[1],
                                    tuple(lowered.d.boxes[j].name for j in boxes),
                                    f"overlaps a higher-priority match ({', '.join(others)})"))
    return out


def _judge(rel: Relation, lhs: Diagram, rhs: Diagram, m: _Match, d: Diagram, ix: _Index,
           F: Realizer, P: Presentation, policy: str, used: Mapping[int, str],
           sizes: Mapping[str, int] | None, served: dict[tuple, str]
           ) -> tuple[str, Box | None, str]:
    for j in m.boxes:
        if j in used:
            return (f"overlaps a match of {used[j]} already applied", None, "")
    names = dict(m.names)
    inside = set(m.boxes)
    outputs = set(lhs.outputs)
    for ci, box in enumerate(lhs.boxes):
        for p in range(len(box.cod)):
            if (ci, p) in outputs:
                continue
            for j, _port in ix.consumers.get(names[(ci, p)], ()):
                if j not in inside:
                    name = rel.lhs.calls[ci].outs[p]  # the relation's name for the wire
                    return (f"intermediate value {name} is used outside the pattern", None,
                            "")
    for (ci, p), src in sorted(names.items()):
        if ci < 0 and src[0] in inside:  # e.g. add(y, y) matched as linear_add's r = y
            return (f"input {p} of the pattern is computed inside it", None, "")
    if not _convex(d, ix, inside):
        return ("fusing would create a cycle (a path leaves the pattern and comes back)",
                None, "")
    rhs_box = rhs.boxes[0]
    rhs_fam = P.family(rhs_box.name)
    params = dict(m.params)
    point_params = {k: dict(rhs_box.params).get(k, params.get(k)) for k, _ in rhs_fam.params}
    point = Point(rhs_fam.name, tuple(point_params.items()))
    if point not in rhs_fam.points:
        return (f"rhs point {point} is not a compiled point of {rhs_fam.name}", None, "")
    if F.realize(point) is None:
        return (f"rhs point not realized on {F.hw.name}: {F.why_not(point)}", None, "")
    attrs_: dict[str, Any] = {}
    for j in m.boxes:
        fam = P.family(d.boxes[j].name)
        domains = fam.domains
        for k, v in d.boxes[j].params:
            if k in domains:
                continue
            if k in attrs_ and attrs_[k] != v:
                return (f"attribute {k} disagrees between the matched boxes "
                        f"({attrs_[k]!r} vs {v!r})", None, "")
            attrs_[k] = v
    missing = [a for a in rhs_fam.attrs if a not in attrs_]
    if missing:
        return (f"rhs needs attributes {missing} that the lhs does not carry", None, "")
    numerics = "bit_identical"
    if not rel.exact:
        numerics = "bounded"
    else:
        lhs_orders = frozenset().union(*(
            _reductions(F, P, P.family(d.boxes[j].name).point_of(d.boxes[j])) for j in m.boxes))
        if lhs_orders != _reductions(F, P, point):
            numerics = "bounded"
            if policy == "exact":
                return (f"holds only up to its bound on {F.hw.name}: the realizations declare "
                        "different reduction orders", None, "")
    if numerics == "bounded" and policy == "exact":
        return ("bounded relation under the exact policy", None, "")
    dom = tuple(d.source_type(names[s]) for s in rhs.wiring[0])
    cod = tuple(d.source_type(names[s]) for s in lhs.outputs)
    from metrale.lkb.ty import Ty

    box = Box(rhs_fam.name, Ty(*dom), Ty(*cod),
              {**point_params, **{k: v for k, v in attrs_.items() if k in rhs_fam.attrs}})
    if sizes is not None:
        numbers = box_numbers(box, rhs_fam, sizes)
        at = (point, tuple(sorted(numbers.items())))
        if at not in served:
            served[at] = launch_refusal(F.realize(point), numbers, F.hw)
        if served[at]:
            return (f"rhs kernel cannot serve these sizes: {served[at]}", None, "")
    return ("", box, numerics)


def launch_refusal(kernel: Any, numbers: Mapping[str, int | float], hw: Any) -> str:
    """Why ``kernel`` cannot be launched at ``numbers`` (a box's sizes, ``box_numbers``): its
    limits, or more shared memory than ``hw`` allows, in words; empty when it can, or when it
    is a host callable (nothing to launch)."""
    if kernel is None or kernel.launch is None:
        return ""
    try:
        launches = kernel.launches_for(numbers)
    except LaunchError as e:
        return f"{e.expected} does not hold ({e.found})" if e.expected else e.message
    over = shared_excess(launches, hw)
    return f"{over[0]} needs {over[1]} bytes of shared memory, {hw.name} allows {over[2]}" \
        if over else ""


def shared_excess(launches: tuple, hw: Any) -> tuple[str, int, int] | None:
    """``(entry, bytes, cap)`` of the first of a kernel's ``launches`` (as
    ``Kernel.launches_for`` gives them) that asks more dynamic shared memory than ``hw``'s
    blocks may have; None when every one fits."""
    cap = hw.capabilities.max_shared_mem_per_block
    for entry, _, (_, _, shared) in launches:
        if cap and shared > cap:
            return entry, shared, cap
    return None


def _convex(d: Diagram, ix: _Index, inside: set[int]) -> bool:
    """No path leaves the matched boxes and re-enters them."""
    hi = max(inside)
    stack = [j for b in inside for p in range(len(d.boxes[b].cod))
             for j, _ in ix.consumers.get((b, p), ()) if j not in inside and j < hi]
    seen = set(stack)
    while stack:
        j = stack.pop()
        for p in range(len(d.boxes[j].cod)):
            for k, _ in ix.consumers.get((j, p), ()):
                if k in inside:
                    return False
                if k < hi and k not in seen:
                    seen.add(k)
                    stack.append(k)
    return True


def _splice(d: Diagram, fused: list[tuple[_Match, Box, list[Source], list[Source]]],
            origin: list[tuple[int, ...]]) -> tuple[Diagram, list[tuple[int, ...]]]:
    """Replace each match by its fused box; re-sort topologically, stable by first position."""
    n = len(d.boxes)
    node_of: dict[int, int] = {}          # old box -> new node
    nodes: list[tuple[Box, list[tuple[str, Any]], tuple[int, ...]]] = []  # box, -, origin
    remap: dict[Source, tuple[int, int]] = {}  # old source -> (node, port)
    fused_at: dict[int, list[Source]] = {}  # fused node -> the sources it reads
    for m, box, reads, replaces in fused:
        k = len(nodes)
        for j in m.boxes:
            node_of[j] = k
        fused_at[k] = reads
        nodes.append((box, [], tuple(o for j in sorted(m.boxes) for o in origin[j])))
        for p, out in enumerate(replaces):
            remap[out] = (k, p)
    for j in range(n):
        if j in node_of:
            continue
        k = len(nodes)
        node_of[j] = k
        nodes.append((d.boxes[j], [], origin[j]))
        for p in range(len(d.boxes[j].cod)):
            remap[(j, p)] = (k, p)
    box_of_node = {k: j for j, k in node_of.items() if k not in fused_at}
    inputs: list[list[Source]] = []
    for k in range(len(nodes)):
        if k in fused_at:
            inputs.append(list(fused_at[k]))
        else:
            inputs.append(list(d.wiring[box_of_node[k]]))
    first = {k: min(o for o in nodes[k][2]) for k in range(len(nodes))}
    deps: list[set[int]] = [{remap[s][0] for s in srcs if s[0] >= 0} for srcs in inputs]
    users: list[list[int]] = [[] for _ in nodes]
    for k, ds in enumerate(deps):
        for dd in ds:
            users[dd].append(k)
    indeg = [len(ds) for ds in deps]
    heap = [(first[k], k) for k in range(len(nodes)) if indeg[k] == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        _, k = heapq.heappop(heap)
        order.append(k)
        for u in users[k]:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(heap, (first[u], u))
    pos = {k: i for i, k in enumerate(order)}

    def src(s: Source) -> Source:
        if s[0] < 0:
            return s
        k, p = remap[s]
        return (pos[k], p)

    boxes = tuple(nodes[k][0] for k in order)
    wiring = tuple(tuple(src(s) for s in inputs[k]) for k in order)
    outputs = tuple(src(s) for s in d.outputs)
    new_origin = [nodes[k][2] for k in order]
    return Diagram.flat(d.dom, d.cod, boxes, wiring, outputs), new_origin

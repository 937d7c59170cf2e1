"""The search: the cheapest plan among the alternatives the presentation allows on H.

The alternatives are the matmul point lowering gives (``lower.MATMUL_SHAPES``) and, for every
match of a relation H realizes under the policy, whether it applies (``fuser.rewrite``'s
``skip``): where matches overlap, skipping one lets another apply, so every set of
non-overlapping matches is some ``skip``. Under the exact policy the alternatives are
bit-identical to each other on H: the relations are, and a decode bucket may only take a matmul
point whose realization declares the reduction orders of the first bucket's.

The search is exact, on a two-layer cut of the model (the same shapes, so the same matches:
a match is chosen by its signature, ``fuser.match_signature``, which is the same in every
layer where it recurs):

1. sites: the matches met, grouped into connected components by shared boxes (a chained
   match, found only after another applied, joins the site of the boxes it covers);
2. sites are independent: the cost of a site's kernels depends on its own choices only, so
   each site's alternatives (the subsets of its matches to skip) are enumerated on the site's
   part of the diagram alone (its boxes, the wires entering and leaving them), and each site
   keeps its cheapest (the priority order's where none is ``MARGIN`` cheaper); matches met for
   the first time (chains that another choice uncovers) join their sites and the enumeration
   repeats;
3. the check: the plan made of every site's choice is rewritten, and its cost must equal the
   sum of the sites' chosen costs and the rest; if it does not, the sites were not independent
   and the cheapest plan rewritten during the search is taken instead (said in ``note``).

Time bound: a site of m matches has 2^m alternatives; sites of more than ``SITE_LIMIT``
matches try two under the bounded policy, the priority order and that order with the site's
bounded relations skipped, and keep the priority order under the exact one (said in ``note``).
Per matmul point: two rewrites of the two-layer cut, and per round (at most ``ROUNDS``) the sum
over sites of 2^m rewrites of a part of a few boxes.

>>> from metrale.realize.target import target
>>> from metrale.plan.config import ModelConfig
>>> T = target("host")
>>> c = choose(ModelConfig.load("tiny-llama"), "bf16", "decode", 1, T=T)
>>> c.shape in ("gemv", "gemm"), c.bucket, c.note
(True, 1, '')
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping
from typing import Any

import attrs

from metrale.lkb.diagram import Box, Diagram, Source
from metrale.lkb.presentation import Presentation
from metrale.lkb.ty import Ty

from .fuser import Rewrite, Signature, _Index, _reductions, launch_refusal, rewrite
from .lower import MATMUL_SHAPES, lowering

SITE_LIMIT = 6
"""Sites of more matches than this keep the priority order (2^6 = 64 alternatives each)."""
MARGIN = 0.02
"""A site leaves the priority order's choice only for an alternative at least this much
cheaper (a fraction of the site's cost), and a cut its first matmul point only for another at
least this much cheaper: below it the difference is inside what the analytic model's figures and
a measurement's repeatability can tell apart, and the presentation's priorities (the order its
authors measured) decide."""
ROUNDS = 4
"""Enumerations repeated at most this often as chained matches are uncovered."""
ALTERNATIVE = ("applied", "overlap", "skipped")


@attrs.frozen
class Site:
    """Matches that share boxes, the alternatives enumerated, and what was chosen."""

    relations: tuple[str, ...]
    skipped: tuple[str, ...]
    alternatives: int
    cost_us: float
    priority_us: float
    """The site's cost with nothing skipped (the priority order's plan)."""
    matches: tuple[Signature, ...] = attrs.field(default=(), eq=False, repr=False)
    """The matches' signatures, in the order the alternatives are numbered (bit i: skip i)."""
    masks: tuple[int, ...] = attrs.field(default=(), eq=False, repr=False)
    """Where not every subset was enumerated (a site of more than ``SITE_LIMIT`` matches), the
    skip masks of the alternatives that were, in order."""

    def skip_of(self, a: int) -> frozenset[Signature]:
        """The matches alternative ``a`` of this site skips."""
        a %= max(1, self.alternatives)
        return _subset(list(self.matches), self.masks[a] if self.masks else a)


@attrs.frozen
class Choice:
    """The search's result for one (model cut, mode, bucket): the matmul point, the matches
    not applied, the predicted cost of the two-layer cut, and how the search went."""

    shape: str
    skip: frozenset[Signature] = attrs.field(eq=False)
    bucket: int
    sites: tuple[Site, ...]
    predicted_us: float
    rewrites: int
    seconds: float = attrs.field(eq=False)
    note: str = ""
    shapes: tuple[tuple[str, float], ...] = ()
    """Each matmul point tried, with the cut's cost under its best choice (inf: not runnable)."""
    per_shape: tuple[tuple[str, tuple[Site, ...]], ...] = attrs.field(default=(), eq=False,
                                                                       repr=False)
    """Each matmul point tried, with its sites (what ``alternatives`` enumerates)."""


def alternatives(choice: Choice) -> tuple[Choice, ...]:
    """Choices that together hold every alternative of every site, for each matmul point the
    search tried: the a-th takes each site's a-th alternative (so as many as the largest
    site has), the first being the priority order's. ``met tune`` times their kernels.

    >>> from metrale.realize.target import target
    >>> from metrale.plan.config import ModelConfig
    >>> c = choose(ModelConfig.load("tiny-llama"), "bf16", "decode", 1, T=target("host"))
    >>> alts = alternatives(c)
    >>> len(alts) >= 2 and alts[0].skip == frozenset()
    True
    """
    out = []
    for shape, sites in choice.per_shape:
        n = max((x.alternatives for x in sites), default=1)
        for a in range(n):
            skip = frozenset().union(*(x.skip_of(a) if a < x.alternatives else frozenset()
                                       for x in sites))
            out.append(attrs.evolve(choice, shape=shape, skip=skip, sites=sites,
                                    note=f"alternative {a} of {shape}"))
    return tuple(out)


_CHOICES: dict[tuple, tuple[Any, Choice, Any]] = {}


def bucket_of(T: Any, mode: str, rows: int) -> int:
    """The rows a plan of ``rows`` is chosen at: a decode's bucket (``[cost] decode_buckets``),
    a prefill's own rows."""
    from .cost import cost_info

    if mode != "decode":
        return rows
    info, _ = cost_info(T.hw, T.chain)
    return info.bucket(rows)


def choose(config: Any, quant: str, mode: str, rows: int, *, T: Any, F: Any = None,
           policy: str | None = None, act: str = "bf16", context: int = 1024,
           logits: str = "all", presentation: Presentation | None = None,
           device: str | None = None) -> Choice:
    """The cheapest alternative for a plan of ``rows`` (chosen at its bucket) on ``device``
    (``plan.cost.CostModel``), memoized per Target (whose evidence it reads), model, quant,
    mode, bucket, policy, context and device."""
    policy = policy or T.policy
    bucket = bucket_of(T, mode, rows)
    P = presentation if presentation is not None else T.presentation
    # by the identities of the Target and of its evidence: a Target is rebuilt when its files
    # change (a rebuilt one compares equal to the old), its evidence is read again when the
    # export or the store changes (a record made since can change the choice)
    evidence = T.evidence
    key = (id(T), id(evidence), config, quant, mode, bucket, act, context, logits, policy, P,
           device)
    hit = _CHOICES.get(key)
    if hit is not None and hit[0] is T and hit[2] is evidence:
        return hit[1]
    F = F if F is not None else T.realization()
    allowed = MATMUL_SHAPES
    if mode == "decode" and policy == "exact":
        first = bucket_of(T, mode, 1)
        if bucket != first:
            ref = choose(config, quant, mode, first, T=T, F=F, policy=policy, act=act,
                         context=context, logits=logits, presentation=P, device=device)
            allowed = tuple(s for s in MATMUL_SHAPES
                            if s == ref.shape or _same_orders(config, quant, mode, bucket, act,
                                                              logits, context, F, P, s,
                                                              ref.shape))
    out = _search(config, quant, mode, bucket, act, context, logits, T, F, P, policy, allowed,
                  device=device)
    if len(_CHOICES) >= 256:
        _CHOICES.clear()
    _CHOICES[key] = (T, out, evidence)
    return out


def _cut(config: Any, quant: str, mode: str, rows: int, act: str, logits: str) -> Any:
    from .circuit import circuit_for

    small = config.with_layers(min(2, config.num_hidden_layers))
    return circuit_for(small, quant, mode, rows, act=act, logits=logits)


def _same_orders(config: Any, quant: str, mode: str, rows: int, act: str, logits: str,
                 context: int, F: Any, P: Presentation, a: str, b: str) -> bool:
    """Whether lowering at matmul point ``a`` and at ``b`` gives kernels declaring the same
    reduction orders on F's class (then they are bit-identical there)."""
    c = _cut(config, quant, mode, rows, act, logits)
    da = lowering(c, P, max_ctx=context, shape=a).functor(c.diagram)
    db = lowering(c, P, max_ctx=context, shape=b).functor(c.diagram)
    for x, y in zip(da.boxes, db.boxes):
        if x != y:
            px, py = P.family(x.name).point_of(x), P.family(y.name).point_of(y)
            if _reductions(F, P, px) != _reductions(F, P, py):
                return False
    return True


class _Evaluator:
    """Rewrites of one lowered diagram, or of parts of it, under skip sets, and their costs."""

    def __init__(self, lowered: Diagram, F: Any, P: Presentation, policy: str,
                 sizes: Mapping[str, int], model: Any) -> None:
        self.lowered, self.F, self.P, self.policy = lowered, F, P, policy
        self.sizes, self.model = dict(sizes), model
        self.index = _Index(lowered)
        self.runs: dict[frozenset, tuple[float, Rewrite, list[float]]] = {}
        self.parts = 0
        self._box: dict[Box, float] = {}
        self.served: dict[tuple, str] = {}

    def box_cost(self, box: Box) -> float:
        hit = self._box.get(box)
        if hit is None:
            hit = self._box[box] = self._box_cost(box)
        return hit

    def _box_cost(self, box: Box) -> float:
        from metrale.realize.kernel import box_numbers

        fam = self.P.family(box.name)
        if fam.view:
            return 0.0
        kernel = self.F.realize(fam.point_of(box))
        if kernel is None:
            return math.inf
        if launch_refusal(kernel, box_numbers(box, fam, self.sizes), self.F.hw):
            return math.inf
        return self.model.kernel(box, fam, kernel).us

    def __call__(self, skip: frozenset) -> tuple[float, Rewrite, list[float]]:
        """The whole lowered diagram rewritten under ``skip``: its cost, record, box costs."""
        hit = self.runs.get(skip)
        if hit is None:
            rw = rewrite(self.lowered, self.F, policy=self.policy, presentation=self.P,
                         sizes=self.sizes, skip=skip, served=self.served, record=True)
            costs = [self.box_cost(b) for b in rw.diagram.boxes]
            hit = self.runs[skip] = (sum(costs), rw, costs)
        return hit

    def part(self, cover: set[int]) -> tuple[Diagram, tuple[int, ...]]:
        """The part of the lowered diagram made of the boxes ``cover``: the wires entering it
        are its inputs, those leaving it (read by another box or a step output) its outputs."""
        full = self.lowered
        order = sorted(cover)
        local = {j: i for i, j in enumerate(order)}
        ins: list[Source] = []
        pos: dict[Source, int] = {}
        wiring = []
        for j in order:
            w = []
            for src in full.wiring[j]:
                if src[0] in local:
                    w.append((local[src[0]], src[1]))
                else:
                    if src not in pos:
                        pos[src] = len(ins)
                        ins.append(src)
                    w.append((-1, pos[src]))
            wiring.append(tuple(w))
        outs = [(j, p) for j in order for p in range(len(full.boxes[j].cod))
                if any(c not in local for c, _ in self.index.consumers.get((j, p), ()))]
        d = Diagram.flat(Ty(*(full.source_type(s) for s in ins)),
                         Ty(*(full.boxes[j].cod.types[p] for j, p in outs)),
                         [full.boxes[j] for j in order], wiring,
                         [(local[j], p) for j, p in outs])
        return d, tuple(order)

    def rewrite_part(self, part: Diagram, fmap: tuple[int, ...], skip: frozenset
                     ) -> tuple[float, Rewrite]:
        """A part rewritten under ``skip`` (signatures taken in the whole), and its cost."""
        self.parts += 1
        rw = rewrite(part, self.F, policy=self.policy, presentation=self.P, sizes=self.sizes,
                     skip=skip, frame=(self.lowered, self.index, fmap), served=self.served,
                     only=self.playable(frozenset(b.name for b in part.boxes)), record=True)
        return sum(self.box_cost(b) for b in rw.diagram.boxes), rw

    @functools.lru_cache(maxsize=64)  # noqa: B019 - one evaluator per search, dropped after
    def playable(self, families: frozenset[str]) -> frozenset[str]:
        """The relations that can match in a part of these ``families``: admissible under the
        policy, and every family of their lhs present or made by another such relation's rhs."""
        rels = [r for r in self.P.relations if r.exact or self.policy == "bounded"]
        sides = {r.name: self.P.equation(r.name) for r in rels}
        have = set(families)
        out: set[str] = set()
        grew = True
        while grew:
            grew = False
            for r in rels:
                lhs, rhs = sides[r.name]
                if r.name not in out and {b.name for b in lhs.boxes} <= have:
                    out.add(r.name)
                    have |= {b.name for b in rhs.boxes}
                    grew = True
        return frozenset(out)


def _components(boxes_of: Mapping[Signature, set[int]], order: list[Signature]
                ) -> list[list[Signature]]:
    parent = {s: s for s in order}

    def find(s: Signature) -> Signature:
        while parent[s] != s:
            parent[s] = parent[parent[s]]
            s = parent[s]
        return s

    owner: dict[int, Signature] = {}
    for s in order:
        for j in boxes_of[s]:
            if j in owner:
                ra, rb = find(owner[j]), find(s)
                if ra != rb:
                    parent[rb] = ra
            else:
                owner[j] = s
    groups: dict[Signature, list[Signature]] = {}
    for s in order:
        groups.setdefault(find(s), []).append(s)
    return list(groups.values())


def _subset(comp: list[Signature], a: int) -> frozenset[Signature]:
    return frozenset(s for i, s in enumerate(comp) if a >> i & 1)


def _masks(site: list[Signature], names: Mapping[Signature, str], ev: _Evaluator
           ) -> list[int]:
    """The skip masks a site's enumeration tries: every subset of its matches, or past
    ``SITE_LIMIT`` the priority order (0) and, where the site has bounded relations, that order
    with them skipped."""
    if len(site) <= SITE_LIMIT:
        return list(range(1 << len(site)))
    loose = sum(1 << i for i, s in enumerate(site) if not ev.P.relation(names[s]).exact)
    return [0, loose] if loose and ev.policy == "bounded" else [0]


def _site_choice(alts: Mapping[int, float], margin: float) -> int:
    """A site's alternative (a skip mask) from each one's cost: the cheapest, where it is at
    least ``margin`` cheaper than the priority order's (0), else the priority order's.

    >>> _site_choice({0: 10.0, 1: 9.0, 2: 9.9}, 0.02), _site_choice({0: 10.0, 1: 9.9}, 0.02)
    (1, 0)
    """
    best = min(alts, key=lambda a: (alts[a], bin(a).count("1"), a))
    return best if alts[best] < alts[0] * (1 - margin) else 0


def _shape_choice(totals: list[float], margin: float) -> int:
    """The matmul point of a cut (an index of the allowed points' costs) as a site's
    alternative is chosen: the cheapest, where it is at least ``margin`` cheaper than the first
    allowed (the priority order's), else the first, so that a cut whose points cost about the
    same keeps its choice as records come and go.

    >>> inf = float("inf")
    >>> [_shape_choice(t, 0.02) for t in ([46.3, 46.2], [54.9, 52.3], [inf, 5.0])]
    [0, 1, 1]
    """
    best = min(range(len(totals)), key=lambda i: (totals[i], i))
    return best if totals[best] < totals[0] * (1 - margin) else 0


def _search_shape(ev: _Evaluator, margin: float = MARGIN
                  ) -> tuple[frozenset, float, list[Site], str]:
    boxes_of: dict[Signature, set[int]] = {}
    names: dict[Signature, str] = {}
    order: list[Signature] = []

    def learn(rw: Rewrite) -> bool:
        new = False
        for sig, where, status in rw.met:
            if status not in ALTERNATIVE:
                continue
            if sig not in boxes_of:
                boxes_of[sig] = set()
                names[sig] = sig[0]
                order.append(sig)
                new = True
            if not set(where) <= boxes_of[sig]:
                boxes_of[sig] |= set(where)
                new = True
        return new

    learn(ev(frozenset())[1])
    note = ""
    comps: list[list[Signature]] = []
    table: dict[int, dict[int, float]] = {}  # a site's alternatives' costs, by skip mask
    done: dict[tuple, dict[int, float]] = {}  # a site's enumeration, by its matches and boxes
    for _ in range(ROUNDS):
        comps = _components(boxes_of, order)
        table = {}
        new = False
        for i, c in enumerate(comps):
            cover = set().union(*(boxes_of[s] for s in c))
            key = (tuple(c), frozenset(cover))
            if key in done:
                table[i] = done[key]
                continue
            part, fmap = ev.part(cover)
            table[i] = done[key] = {}
            for a in _masks(c, names, ev):
                table[i][a], rw = ev.rewrite_part(part, fmap, _subset(c, a))
                new |= learn(rw)
        if not new:
            break
    else:
        note = f"chained matches still uncovered after {ROUNDS} rounds"
    if any(len(c) > SITE_LIMIT for c in comps):
        note = (note + "; " if note else "") + (
            f"a site of more than {SITE_LIMIT} matches " + (
                "tried the priority order and that order without its bounded relations"
                if ev.policy == "bounded" else "kept the priority order"))
    chosen: frozenset = frozenset()
    sites = []
    site_total = 0.0
    for i, c in enumerate(comps):
        best = _site_choice(table[i], margin)
        chosen |= _subset(c, best)
        site_total += table[i][best]
        sites.append(Site(tuple(names[s] for s in c), tuple(names[s] for s in _subset(c, best)),
                          len(table[i]), table[i][best], table[i][0], tuple(c),
                          tuple(table[i]) if len(c) > SITE_LIMIT else ()))
    # the check: the whole rewritten with every site's choice costs what the sites predict
    covered = set().union(*boxes_of.values()) if boxes_of else set()
    _, rw0, costs0 = ev(frozenset())
    rest = sum(x for x, o in zip(costs0, rw0.origin) if not covered & set(o))
    total = ev(chosen)[0] if chosen else sum(costs0)
    predicted = site_total + rest
    if not (math.isclose(total, predicted, rel_tol=1e-9, abs_tol=1e-9)
            or (math.isinf(total) and math.isinf(predicted))):
        chosen, (total, _, _) = min(ev.runs.items(), key=lambda kv: kv[1][0])
        note = (note + "; " if note else "") + (
            "sites not independent here: the cheapest whole plan rewritten was taken")
    return chosen, total, sites, note


def _search(config: Any, quant: str, mode: str, rows: int, act: str, context: int,
            logits: str, T: Any, F: Any, P: Presentation, policy: str,
            allowed: tuple[str, ...], margin: float = MARGIN, device: str | None = None
            ) -> Choice:
    from .cost import CostModel

    t0 = time.perf_counter()
    circuit = _cut(config, quant, mode, rows, act, logits)
    sizes = {**circuit.sizes(context), "context": context}
    model = CostModel.of(T, sizes, device)
    found = []
    tried = []
    per_shape = []
    rewrites = 0
    for shape in allowed:
        lowered = lowering(circuit, P, max_ctx=context, shape=shape).functor(circuit.diagram)
        ev = _Evaluator(lowered, F, P, policy, sizes, model)
        skip, total, sites, note = _search_shape(ev, margin)
        rewrites += len(ev.runs) + ev.parts
        tried.append((shape, total))
        per_shape.append((shape, tuple(sites)))
        found.append((shape, total, skip, sites, note))
    shape, total, skip, sites, note = found[_shape_choice([t for _, t in tried], margin)]
    return Choice(shape, skip, rows, tuple(sites), total, rewrites, time.perf_counter() - t0,
                  note, tuple(tried), tuple(per_shape))

"""Property-test your own functors: Hypothesis strategies and law suites (public API).

Strategies build well-typed diagrams *by construction* (no filtering): each new box reads wires
that already exist, so every draw is valid. Law suites run Hypothesis inside and, on a failure,
raise :class:`LawViolation` naming the law with the minimal counterexample drawn as text.

>>> from metrale.lkb import Box, Ty, TensorType, Functor
>>> from metrale.lkb.dtype import BF16
>>> X = Ty(TensorType(("n",), BF16))
>>> gens = [Box("f", X, X), Box("g", X @ X, X)]
>>> category_laws(diagrams_over(gens, X), max_examples=20)
>>> functor_laws(Functor("C", "C", ar=lambda b: b.diagram, name="same"), gens, max_examples=20)

Hypothesis is needed only when this module is imported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.lkb.category import SmallCategory
from metrale.lkb.diagram import Box, Builder, Diagram, Wire, let_syntax
from metrale.lkb.dtype import BF16, F32, I32
from metrale.lkb.functor import Functor
from metrale.lkb.ty import TensorType, Ty

__all__ = [
    "LawViolation", "tensor_types", "tys", "boxes", "diagrams", "diagrams_over",
    "composable_chains", "tensor_products", "category_laws", "monoidal_laws", "functor_laws",
    "small_category_laws", "product_laws", "coproduct_laws", "rewriting_laws",
    "rewrite_laws_at", "is_relation_instance",
]

DIMS = ("rows", "hidden", "heads", 4)
DTYPES = (BF16, F32, I32)


class LawViolation(AssertionError):
    """A law that failed, with its counterexample drawn."""


def _show(**diagrams: Any) -> str:
    lines = []
    for name, d in diagrams.items():
        if isinstance(d, Diagram):
            lines.append(f"  {name}: {d.dom} -> {d.cod}\n    {let_syntax(d)}")
        else:
            lines.append(f"  {name}: {d!r}")
    return "\n".join(lines)


def _law(ok: bool, law: str, **witnesses: Any) -> None:
    if not ok:
        raise LawViolation(f"law violated: {law}\ncounterexample:\n{_show(**witnesses)}")


# strategies --------------------------------------------------------------------------------

def tensor_types(dims: Sequence[Any] = DIMS, dtypes: Sequence[Any] = DTYPES) -> st.SearchStrategy:
    """Tensor types over a small alphabet of dims and dtypes (so wires often match)."""
    return st.builds(TensorType, st.lists(st.sampled_from(list(dims)), min_size=1, max_size=2)
                     .map(tuple), st.sampled_from(list(dtypes)))


def tys(min_size: int = 0, max_size: int = 3, types: st.SearchStrategy | None = None):
    """Types: lists of tensor types."""
    return st.lists(types or tensor_types(), min_size=min_size, max_size=max_size).map(
        lambda ts: Ty(*ts))


_NAMES = st.sampled_from(["f", "g", "h", "k", "norm", "linear"])


def boxes(dom: Ty | None = None, cod: Ty | None = None) -> st.SearchStrategy:
    """Boxes with the given (or random) domain and codomain."""
    return st.builds(Box, _NAMES, st.just(dom) if dom is not None else tys(),
                     st.just(cod) if cod is not None else tys())


@st.composite
def diagrams(draw: Callable, dom: Ty | None = None, cod: Ty | None = None,
             max_boxes: int = 6) -> Diagram:
    """Random well-typed diagrams ``dom → cod`` (random when not given), by construction.

    Each new box reads a random selection of the wires built so far (copies allowed);
    outputs pick existing wires of the needed types, adding one box where none exists.
    """
    dom = dom if dom is not None else draw(tys())
    b = Builder(dom)
    wires: list[Wire] = list(b.inputs)
    for _ in range(draw(st.integers(0, max_boxes))):
        k = draw(st.integers(0, min(3, len(wires))))
        ins = [wires[draw(st.integers(0, len(wires) - 1))] for _ in range(k)]
        out_ty = draw(tys(0, 2))
        box = Box(draw(_NAMES), Ty(*(w.type for w in ins)), out_ty)
        wires.extend(b.add(box, *ins))
    if cod is None:
        picks = draw(st.lists(st.integers(0, max(len(wires) - 1, 0)), max_size=3)) if wires else []
        return b.build(*(wires[i] for i in picks))
    outs = []
    for t in cod:
        same = [w for w in wires if w.type == t]
        if same:
            outs.append(same[draw(st.integers(0, len(same) - 1))])
        else:
            k = draw(st.integers(0, min(2, len(wires))))
            ins = [wires[draw(st.integers(0, len(wires) - 1))] for _ in range(k)]
            (w,) = b.add(Box(draw(_NAMES), Ty(*(x.type for x in ins)), Ty(t)), *ins)
            wires.append(w)
            outs.append(w)
    return b.build(*outs)


@st.composite
def diagrams_over(draw: Callable, generators: Sequence[Box], dom: Ty,
                  max_boxes: int = 6) -> Diagram:
    """Random diagrams from ``dom`` using only ``generators`` (e.g. a functor's domain).

    At each step a generator is applicable when every input type has a wire; the outputs are
    a random selection of wires (so ``cod`` varies).
    """
    b = Builder(dom)
    wires: list[Wire] = list(b.inputs)
    for _ in range(draw(st.integers(0, max_boxes))):
        usable = [g for g in generators if all(any(w.type == t for w in wires) for t in g.dom)]
        if not usable:
            break
        g = usable[draw(st.integers(0, len(usable) - 1))]
        ins = []
        for t in g.dom:
            same = [w for w in wires if w.type == t]
            ins.append(same[draw(st.integers(0, len(same) - 1))])
        wires.extend(b.add(g, *ins))
    picks = draw(st.lists(st.integers(0, len(wires) - 1), max_size=3)) if wires else []
    return b.build(*(wires[i] for i in picks))


@st.composite
def composable_chains(draw: Callable, length: int = 3, over: Sequence[Box] | None = None,
                      dom: Ty | None = None) -> list[Diagram]:
    """``length`` diagrams ``d0, d1, …`` with ``d_i.cod == d_{i+1}.dom``."""
    if over is not None:
        first_dom = dom if dom is not None else Ty(*over[0].dom)
        chain = [draw(diagrams_over(over, first_dom))]
        for _ in range(length - 1):
            chain.append(draw(diagrams_over(over, chain[-1].cod)))
        return chain
    ty = dom if dom is not None else draw(tys())
    chain = []
    for _ in range(length):
        nxt = draw(tys())
        chain.append(draw(diagrams(ty, nxt)))
        ty = nxt
    return chain


def tensor_products(n: int = 2) -> st.SearchStrategy:
    """``n`` independent diagrams, to be tensored."""
    return st.lists(diagrams(), min_size=n, max_size=n)


# law suites ------------------------------------------------------------------------------

def _run(test: Callable, max_examples: int | None) -> None:
    if max_examples is not None:
        test = settings(max_examples=max_examples, deadline=None)(test)
    test()


def category_laws(diagram_strategy: st.SearchStrategy | None = None, *,
                  max_examples: int | None = None) -> None:
    """Unit and associativity of ``>>`` over diagrams drawn from ``diagram_strategy``."""
    ds = diagram_strategy

    @given(st.data())
    def check(data: Any) -> None:
        if ds is None:
            f, g, h = data.draw(composable_chains(3))
        else:
            f = data.draw(ds)
            g = data.draw(diagrams(f.cod))
            h = data.draw(diagrams(g.cod))
        _law(Diagram.id(f.dom) >> f == f, "Id >> f == f", f=f)
        _law(f >> Diagram.id(f.cod) == f, "f >> Id == f", f=f)
        _law((f >> g) >> h == f >> (g >> h), "(f >> g) >> h == f >> (g >> h)", f=f, g=g, h=h)
        _law(hash((f >> g) >> h) == hash(f >> (g >> h)), "hash agrees with ==", f=f, g=g, h=h)

    _run(check, max_examples)


def monoidal_laws(*, max_examples: int | None = None) -> None:
    """Unit and associativity of ``@``, interchange, and the symmetry's involution."""

    @given(st.data())
    def check(data: Any) -> None:
        f, g, h = data.draw(tensor_products(3))
        unit = Diagram.id(Ty())
        _law(f @ unit == f == unit @ f, "f @ Id(I) == f", f=f)
        _law((f @ g) @ h == f @ (g @ h), "(f @ g) @ h == f @ (g @ h)", f=f, g=g, h=h)
        k = data.draw(diagrams(f.cod))
        m = data.draw(diagrams(g.cod))
        _law((f @ g) >> (k @ m) == (f >> k) @ (g >> m),
             "(f @ g) >> (k @ m) == (f >> k) @ (g >> m)", f=f, g=g, k=k, m=m)
        s = Diagram.swap(f.dom, g.dom)
        _law(s >> Diagram.swap(g.dom, f.dom) == Diagram.id(f.dom @ g.dom), "swap ; swap == id")
        _law((f @ g) >> Diagram.swap(f.cod, g.cod) == s >> (g @ f),
             "naturality of the symmetry", f=f, g=g)

    _run(check, max_examples)


def functor_laws(functor: Functor, generators: Sequence[Box], *, dom: Ty | None = None,
                 max_examples: int | None = None) -> None:
    """F(f >> g) == F(f) >> F(g), F(f @ g) == F(f) @ F(g) and F(id) == id, on diagrams built
    from ``generators`` (boxes in the functor's domain)."""
    start = dom if dom is not None else Ty(*generators[0].dom)

    @given(st.data())
    def check(data: Any) -> None:
        f, g = data.draw(composable_chains(2, over=generators, dom=start))
        F = functor
        _law(F(f >> g) == F(f) >> F(g), "F(f >> g) == F(f) >> F(g)", f=f, g=g)
        _law(F(f @ g) == F(f) @ F(g), "F(f @ g) == F(f) @ F(g)", f=f, g=g)
        _law(F(Diagram.id(f.dom)) == Diagram.id(F(f.dom)), "F(id) == id", f=f)

    _run(check, max_examples)


def small_category_laws(c: SmallCategory) -> None:
    """Identity and associativity over every arrow of a finite category (exhaustive)."""
    arrows = list(c.arrows())
    for f in arrows:
        _law(c.compose(c.identity(f.dom), f) == f, "id ; f == f", f=f)
        _law(c.compose(f, c.identity(f.cod)) == f, "f ; id == f", f=f)
        for g in (g for g in arrows if g.dom == f.cod):
            for h in (h for h in arrows if h.dom == g.cod):
                _law(c.compose(c.compose(f, g), h) == c.compose(f, c.compose(g, h)),
                     "(f ; g) ; h == f ; (g ; h)", f=f, g=g, h=h)


def product_laws(p: Any) -> None:
    """Each projection is a functor and an arrow is determined by its components."""
    arrows = list(p.arrows())
    for i in range(len(p.factors)):
        pi = p.projection(i)
        for a in p.objects():
            _law(pi(p.identity(a)) == p.factors[i].identity(a[i]), "π(id) == id", a=a)
        for f in arrows:
            for g in (g for g in arrows if g.dom == f.cod):
                _law(pi(p.compose(f, g)) == p.factors[i].compose(pi(f), pi(g)),
                     "π(f ; g) == π(f) ; π(g)", f=f, g=g)
    for f in arrows:
        for g in arrows:
            same = all(p.projection(i)(f) == p.projection(i)(g) for i in range(len(p.factors)))
            _law(same == (f == g), "an arrow is its components", f=f, g=g)


def coproduct_laws(c: Any) -> None:
    """Injections are disjoint and injective, and send identities to identities."""
    seen: dict[Any, tuple[int, Any]] = {}
    for i, s in enumerate(c.summands):
        for x in s.objects():
            tagged = c.inject(i, x)
            _law(tagged not in seen, "injections are disjoint and injective", x=x,
                 other=seen.get(tagged))
            seen[tagged] = (i, x)
            _law(c.inject(i, s.identity(x)) == c.identity(tagged), "ι(id) == id", x=x)


def is_relation_instance(rel: Any, P: Any, d: Diagram, boxes: Sequence[int], fused: Box) -> str:
    """Why replacing ``boxes`` of ``d`` by ``fused`` is not an instance of relation ``rel``
    of presentation ``P`` (empty when it is): the boxes are the lhs's calls (family and pinned
    parameters, shared parameters equal, wired as the lhs wires them, each intermediate read
    only inside), and ``fused`` is the rhs point with the lhs's shared parameters, typed by
    the wires it reads and replaces. Written apart from the rewriter, so that it checks it."""
    import itertools

    calls, rhs = rel.lhs.calls, rel.rhs.calls[0]
    if len(calls) != len(boxes):
        return f"{len(boxes)} boxes for {len(calls)} lhs calls"
    consumers = d.consumers()
    for perm in itertools.permutations(boxes):
        names: dict[str, Any] = {}
        shared: dict[str, Any] = {}
        ok = True
        for c, j in zip(calls, perm):
            box = d.boxes[j]
            fam = P.family(c.family)
            params = dict(box.params)
            if box.name != c.family or any(params.get(k) != v for k, v in c.pins):
                ok = False
                break
            for k in fam.domains:
                if k not in dict(c.pins) and shared.setdefault(k, params.get(k)) != params.get(k):
                    ok = False
            for a, src in zip(c.args, d.wiring[j]):
                ok = ok and names.setdefault(a, src) == src
            for p, o in enumerate(c.outs):
                ok = ok and names.setdefault(o, (j, p)) == (j, p)
        if not ok:
            continue
        inside = set(boxes)
        if any(k not in inside for name in rel.lhs.defined if name not in rel.outputs
               for k, _ in consumers.get(names[name], ())):
            continue
        fam = P.family(rhs.family)
        want = {k: dict(rhs.pins).get(k, shared.get(k)) for k in fam.domains}
        got = dict(fused.params)
        if fused.name != rhs.family or any(got.get(k) != v for k, v in want.items()):
            return f"the fused box {fused!r} is not the rhs point {want}"
        dom = tuple(d.source_type(names[a]) for a in rhs.args)
        cod = tuple(d.source_type(names[o]) for o in rhs.outs)
        if fused.dom.types != dom or fused.cod.types != cod:
            return "the fused box is not typed by the wires it reads and replaces"
        return ""
    return f"boxes {sorted(boxes)} are not an instance of the lhs of {rel.name}"


def rewrite_laws_at(rewriting: Any, d: Diagram, args: list | None = None) -> Any:
    """The laws of :func:`rewriting_laws` at one diagram ``d`` (``args``: arrays for its
    domain, to check the bytes under the exact policy); returns the rewrite's record."""
    from metrale.lkb.evaluate import evaluate

    P = rewriting.presentation if rewriting.presentation is not None else \
        rewriting.realization.presentation
    result = rewriting.run(d)
    r = result.diagram
    _law(r.dom == d.dom and r.cod == d.cod, "R keeps the interface", d=d, r=r)
    _law(rewriting(r) == r, "R(R(d)) == R(d)", d=d, r=r)
    _law(sum(len(s.matches) for s in result.steps) == len(result.applied),
         "every application is a step of the trace", d=d)
    for step in result.steps:
        for boxes, fused in step.matches:
            why = is_relation_instance(P.relation(step.relation), P, step.before, boxes, fused)
            _law(not why, f"each step is an instance of a relation: {step.relation}: {why}",
                 before=step.before)
    if rewriting.policy == "exact":
        for a in result.applied:
            _law(a.numerics == "bit_identical", "exact policy applies bit-identical steps",
                 relation=a.relation)
        if args is not None:
            before = evaluate(d, [x.copy() for x in args], P)
            after = evaluate(r, [x.copy() for x in args], P)
            _law(all(x.tobytes() == y.tobytes() for x, y in zip(before, after)),
                 "the exact policy keeps the bytes", d=d, r=r)
    return result


def rewriting_laws(lower: Functor, rewriting: Any, generators: Sequence[Box], dom: Ty, *,
                   inputs: Callable[[Diagram, int], list] | None = None,
                   max_examples: int | None = None) -> None:
    """The laws of a rewriting by relations (``plan.fuser.Rewriting``), on lowered random
    circuits ``lower(c)``, ``c`` drawn from ``generators`` (boxes of the circuit category):

    - it keeps the interface: ``R(d).dom == d.dom`` and ``R(d).cod == d.cod``;
    - it is idempotent: ``R(R(d)) == R(d)``;
    - every step it takes is an instance of a relation of its presentation
      (:func:`is_relation_instance`), and every relation it applies under the exact policy is
      bit-identical on the class;
    - under the exact policy it keeps the bytes: with ``inputs(d, seed)`` (arrays for ``d``'s
      domain), ``R(d)`` and ``d`` evaluated by the reference semantics give equal bytes.
    """
    @given(st.data(), st.integers(0, 2**31 - 1))
    def check(data: Any, seed: int) -> None:
        d = lower(data.draw(diagrams_over(generators, dom)))
        rewrite_laws_at(rewriting, d, None if inputs is None else inputs(d, seed))

    _run(check, max_examples)

"""Small categories as values: posets, discrete categories, products and coproducts.

The target category 𝒯 ≅ Hw × Mod × Quant is built from these: Hw is a poset (H → H' when H
inherits from H'), Mod and Quant are discrete. An arrow is an ``Arrow(dom, cod, label)``;
``ProductCategory`` has projection functors, ``Coproduct`` has disjoint injections.

Laws:

>>> P = Poset("P", ["a", "b", "c"], [("a", "b"), ("b", "c")])
>>> f, g = P.arrow("a", "b"), P.arrow("b", "c")
>>> P.compose(P.identity("a"), f) == f == P.compose(f, P.identity("b"))
True
>>> P.compose(f, g) == P.arrow("a", "c")
True
>>> T = ProductCategory((P, Discrete("M", ["m1", "m2"])))
>>> x = T.arrow(("a", "m1"), ("c", "m1"))
>>> T.projection(0)(x) == P.arrow("a", "c")
True
>>> S = Coproduct((Discrete("X", [1]), Discrete("Y", [1])))
>>> S.inject(0, 1) != S.inject(1, 1)
True
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from typing import Any

import attrs

from .errors import AxiomError, nearest


@attrs.frozen
class Arrow:
    """An arrow of a small category; ``label`` tells parallel arrows apart (``"id"`` for identities)."""

    dom: Any
    cod: Any
    label: Hashable = "id"

    def __str__(self) -> str:
        return f"{self.dom} → {self.cod}"


class SmallCategory:
    """What every small category offers: objects, hom-sets, identities, composition."""

    name: str

    def objects(self) -> tuple:  # pragma: no cover - interface
        raise NotImplementedError

    def hom(self, a: Any, b: Any) -> tuple[Arrow, ...]:  # pragma: no cover - interface
        raise NotImplementedError

    def identity(self, a: Any) -> Arrow:
        self._check_object(a)
        return Arrow(a, a)

    def compose(self, f: Arrow, g: Arrow) -> Arrow:  # pragma: no cover - interface
        raise NotImplementedError

    def arrows(self) -> Iterator[Arrow]:
        """Every arrow, identities included."""
        for a in self.objects():
            for b in self.objects():
                yield from self.hom(a, b)

    def _check_object(self, a: Any) -> None:
        if a not in self.objects():
            raise AxiomError(f"{a!r} is not an object of {self.name}",
                             suggestion=nearest(str(a), map(str, self.objects())))

    def _check_composable(self, f: Arrow, g: Arrow) -> None:
        if f.cod != g.dom:
            raise AxiomError(f"cannot compose in {self.name}: {f} then {g}",
                             expected=f"domain {f.cod}", found=g.dom)


@attrs.frozen
class Discrete(SmallCategory):
    """A discrete category: objects and their identities only.

    >>> D = Discrete("Quant", ["bf16", "fp8"])
    >>> D.hom("bf16", "fp8")
    ()
    """

    name: str
    elements: tuple = attrs.field(converter=tuple)

    def objects(self) -> tuple:
        return self.elements

    def hom(self, a: Any, b: Any) -> tuple[Arrow, ...]:
        return (Arrow(a, a),) if a == b and a in self.elements else ()

    def compose(self, f: Arrow, g: Arrow) -> Arrow:
        self._check_composable(f, g)
        return f


@attrs.frozen
class Poset(SmallCategory):
    """A poset as a category: one arrow ``a → b`` exactly when ``a ≤ b``.

    ``covers`` lists generating pairs ``(a, b)``; the order is their reflexive-transitive
    closure. A cycle among distinct elements is refused (antisymmetry).

    >>> Poset("H", ["x", "y"], [("x", "y"), ("y", "x")])
    Traceback (most recent call last):
    ...
    metrale.lkb.errors.AxiomError: not a poset: cycle through x, y
    """

    name: str
    elements: tuple = attrs.field(converter=tuple)
    covers: tuple = attrs.field(converter=lambda c: tuple(tuple(p) for p in c))
    _up: dict = attrs.field(init=False, eq=False, hash=False, repr=False)

    def __attrs_post_init__(self) -> None:
        up: dict[Any, set] = {e: {e} for e in self.elements}
        for a, b in self.covers:
            for x in (a, b):
                if x not in up:
                    raise AxiomError(f"{x!r} is not an element of {self.name}")
        changed = True
        while changed:
            changed = False
            for a, b in self.covers:
                new = up[b] - up[a]
                if new:
                    up[a] |= new
                    changed = True
        for a in self.elements:
            for b in up[a]:
                if b != a and a in up[b]:
                    raise AxiomError(f"not a poset: cycle through {a}, {b}")
        object.__setattr__(self, "_up", {k: frozenset(v) for k, v in up.items()})

    def objects(self) -> tuple:
        return self.elements

    def leq(self, a: Any, b: Any) -> bool:
        """``a ≤ b``: there is an arrow ``a → b``."""
        return b in self._up.get(a, ())

    def hom(self, a: Any, b: Any) -> tuple[Arrow, ...]:
        return (Arrow(a, b, "≤" if a != b else "id"),) if self.leq(a, b) else ()

    def arrow(self, a: Any, b: Any) -> Arrow:
        """The arrow ``a → b``; an error when ``a ≰ b``."""
        hom = self.hom(a, b)
        if not hom:
            raise AxiomError(f"no arrow {a} → {b} in {self.name}")
        return hom[0]

    def compose(self, f: Arrow, g: Arrow) -> Arrow:
        self._check_composable(f, g)
        return self.arrow(f.dom, g.cod)


@attrs.frozen
class ProductCategory(SmallCategory):
    """The product of small categories: objects and arrows are tuples, composed componentwise."""

    factors: tuple = attrs.field(converter=tuple)

    @property
    def name(self) -> str:  # type: ignore[override]
        return " × ".join(f.name for f in self.factors)

    def objects(self) -> tuple:
        out: list[tuple] = [()]
        for f in self.factors:
            out = [o + (x,) for o in out for x in f.objects()]
        return tuple(out)

    def _check_object(self, a: Any) -> None:
        if not isinstance(a, tuple) or len(a) != len(self.factors):
            raise AxiomError(f"{a!r} is not an object of {self.name}")
        for f, x in zip(self.factors, a):
            f._check_object(x)

    def hom(self, a: tuple, b: tuple) -> tuple[Arrow, ...]:
        out: list[tuple] = [()]
        for f, x, y in zip(self.factors, a, b):
            out = [o + (h,) for o in out for h in f.hom(x, y)]
        return tuple(Arrow(a, b, tuple(h.label for h in hs)) for hs in out)

    def arrow(self, a: tuple, b: tuple) -> Arrow:
        """The arrow ``a → b`` when every factor has exactly one."""
        hom = self.hom(a, b)
        if len(hom) != 1:
            raise AxiomError(f"{len(hom)} arrows {a} → {b} in {self.name}", expected="exactly 1")
        return hom[0]

    def identity(self, a: Any) -> Arrow:
        self._check_object(a)
        return Arrow(a, a, tuple("id" for _ in self.factors))

    def component(self, f: Arrow, i: int) -> Arrow:
        """The ``i``-th component of a product arrow."""
        label = f.label[i] if isinstance(f.label, tuple) else f.label
        return Arrow(f.dom[i], f.cod[i], label)

    def compose(self, f: Arrow, g: Arrow) -> Arrow:
        self._check_composable(f, g)
        parts = [fac.compose(self.component(f, i), self.component(g, i))
                 for i, fac in enumerate(self.factors)]
        return Arrow(f.dom, g.cod, tuple(p.label for p in parts))

    def projection(self, i: int) -> Projection:
        """π_i: the functor reading off coordinate ``i``."""
        return Projection(self, i)


@attrs.frozen
class Projection:
    """π_i of a product: on objects the ``i``-th coordinate, on arrows the ``i``-th component.

    Functorial: π(g ∘ f) = π(g) ∘ π(f) and π(id) = id.
    """

    product: ProductCategory
    index: int

    def __call__(self, x: Any) -> Any:
        if isinstance(x, Arrow):
            return self.product.component(x, self.index)
        return x[self.index]


@attrs.frozen
class Tagged:
    """An element of a coproduct: which summand, and the element there."""

    summand: int
    value: Any


@attrs.frozen
class Coproduct(SmallCategory):
    """The coproduct (disjoint union) of small categories, with injections ``ι_i``."""

    summands: tuple = attrs.field(converter=tuple)

    @property
    def name(self) -> str:  # type: ignore[override]
        return " ⊔ ".join(s.name for s in self.summands)

    def objects(self) -> tuple:
        return tuple(Tagged(i, x) for i, s in enumerate(self.summands) for x in s.objects())

    def hom(self, a: Tagged, b: Tagged) -> tuple[Arrow, ...]:
        if a.summand != b.summand:
            return ()
        return tuple(Arrow(a, b, h.label)
                     for h in self.summands[a.summand].hom(a.value, b.value))

    def compose(self, f: Arrow, g: Arrow) -> Arrow:
        self._check_composable(f, g)
        s = self.summands[f.dom.summand]
        h = s.compose(Arrow(f.dom.value, f.cod.value, f.label),
                      Arrow(g.dom.value, g.cod.value, g.label))
        return Arrow(f.dom, g.cod, h.label)

    def inject(self, i: int, x: Any) -> Any:
        """ι_i on an object or an arrow of summand ``i``."""
        if isinstance(x, Arrow):
            return Arrow(Tagged(i, x.dom), Tagged(i, x.cod), x.label)
        return Tagged(i, x)

    def injection(self, i: int) -> Any:
        """ι_i as a callable."""
        return lambda x: self.inject(i, x)


def identities(c: SmallCategory) -> Iterable[Arrow]:
    """The identity arrows of ``c``."""
    return (c.identity(a) for a in c.objects())

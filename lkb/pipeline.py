"""Pipelines: functors and diagram rewritings composed with ``>>``, applied in order.

A rewriting (``plan.fuser.Rewriting``, say) is not a functor: it replaces whole sub-diagrams,
not box by box. Composed with functors it gives a ``Pipeline``, a value like them: it has a
domain and a codomain, applies to diagrams, composes with ``>>`` (associatively, checking that
the categories meet) and compares by its steps. ``F >> R >> G`` for functors F, G and a
rewriting R is ``Pipeline((F, R, G))``; two functors alone still compose to a ``Functor``.

>>> from metrale.lkb.diagram import Box, Diagram
>>> from metrale.lkb.dtype import BF16
>>> from metrale.lkb.functor import Functor
>>> from metrale.lkb.ty import TensorType, Ty
>>> X = Ty(TensorType(("n",), BF16))
>>> F = Functor("C", "D", ar=lambda b: Box(b.name.upper(), X, X).diagram, name="up", key="up")
>>> twice = Step("D", "D", lambda d: d >> d, name="twice")
>>> P = F >> twice
>>> print(P), print(P(Box("f", X, X)))
up >> twice
F >> F
(None, None)
>>> (F >> twice) >> Functor.id("D") == F >> (twice >> Functor.id("D"))
True
>>> twice >> F
Traceback (most recent call last):
...
metrale.lkb.errors.AxiomError: cannot compose: twice ends in D, up starts in C
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from .diagram import Box, Diagram
from .errors import AxiomError


@attrs.frozen(eq=False, repr=False)
class Step:
    """A named map of diagrams ``dom → cod`` given by a callable (compared by ``key`` when
    given, else by the callable's identity)."""

    dom: Any
    cod: Any
    fn: Callable[[Diagram], Diagram]
    name: str = ""
    key: Any = None

    def _key(self) -> tuple:
        return ("data", self.key) if self.key is not None else ("fn", id(self.fn))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Step) and (self.dom, self.cod, self._key()) == (
            other.dom, other.cod, other._key())

    def __hash__(self) -> int:
        return hash((self.dom, self.cod, self._key()))

    def __call__(self, d: Box | Diagram) -> Diagram:
        return self.fn(d.diagram if isinstance(d, Box) else d)

    def __rshift__(self, other: Any) -> Pipeline:
        return Pipeline((self,)) >> other

    def __str__(self) -> str:
        return self.name or f"Step({self.dom} -> {self.cod})"

    def __repr__(self) -> str:
        return f"Step({self.dom!r}, {self.cod!r}, name={self.name!r})"


@attrs.frozen(repr=False)
class Pipeline:
    """Steps (functors, rewritings) applied left to right; ``>>`` appends."""

    steps: tuple[Any, ...]

    @property
    def dom(self) -> Any:
        return self.steps[0].dom

    @property
    def cod(self) -> Any:
        return self.steps[-1].cod

    def __call__(self, x: Any) -> Any:
        for step in self.steps:
            x = step(x)
        return x

    def __rshift__(self, other: Any) -> Pipeline:
        more = other.steps if isinstance(other, Pipeline) else (other,)
        if self.cod != more[0].dom:
            raise AxiomError(f"cannot compose: {self.steps[-1]} ends in {self.cod}, "
                             f"{more[0]} starts in {more[0].dom}")
        steps = [s for s in (*self.steps, *more) if getattr(s, "stages", None) != ()]
        return Pipeline(tuple(steps) or self.steps[:1])

    def __str__(self) -> str:
        return " >> ".join(str(s) for s in self.steps)

    def __repr__(self) -> str:
        return f"Pipeline({', '.join(map(str, self.steps))})"

"""Strict monoidal functors between categories of string diagrams.

A ``Functor`` maps each tensor type to a ``Ty`` (``ob``) and each box to a ``Diagram`` (``ar``),
given as mappings or callables; applying it to a diagram substitutes box by box in one linear
pass. ``F >> G`` is "F then G" and ``compose(G, F)`` is G ∘ F. A functor is the list of its
*stages*; the identity has none, so ``Functor.id(C) >> F == F`` holds exactly, not up to
extensional equality.

Laws (checked here on small diagrams; ``metrale.testing.functor_laws`` checks them with
Hypothesis):

>>> from metrale.lkb.dtype import BF16, F32
>>> X, Y = Ty(TensorType(("n",), BF16)), Ty(TensorType(("n",), F32))
>>> f, g = Box("f", X, X), Box("g", X, X)
>>> up = {TensorType(("n",), BF16): Y}
>>> F = Functor("C", "D", ob=up, ar=lambda b: Box(b.name.upper(), Y, Y).diagram)
>>> F(f.diagram >> g.diagram) == F(f.diagram) >> F(g.diagram)
True
>>> F(f.diagram @ g.diagram) == F(f.diagram) @ F(g.diagram)
True
>>> F(Diagram.id(X)) == Diagram.id(F(X))
True
>>> Functor.id("C") >> F == F == F >> Functor.id("D")
True
>>> print(F(f.diagram >> g.diagram))
F >> G
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import attrs

from .diagram import Box, Diagram, Source, _Flat
from .errors import AxiomError
from .ty import TensorType, Ty

ObMap = Mapping[TensorType, Ty] | Callable[[TensorType], Ty] | None
ArMap = Mapping[Box, Diagram] | Callable[[Box], Diagram] | None


def _freeze(m: Any) -> Any:
    return MappingProxyType(dict(m)) if isinstance(m, Mapping) else m


def _map_key(m: Any) -> Any:
    if m is None:
        return None
    if isinstance(m, Mapping):
        return ("map", frozenset(m.items()))
    return ("fn", id(m))


@attrs.frozen(eq=False, repr=False)
class Stage:
    """One primitive functor: an object map and an arrow map (``None`` means identity)."""

    ob: Any = attrs.field(default=None, converter=_freeze)
    ar: Any = attrs.field(default=None, converter=_freeze)
    name: str = ""
    key: Any = None
    """The data the maps are built from, when they are callables made from data (a hardware
    class and its kernel tables, say): stages with equal keys are equal."""

    def _key(self) -> tuple:
        if self.key is not None:
            return ("data", self.key)
        return (_map_key(self.ob), _map_key(self.ar))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stage) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def on_type(self, t: TensorType) -> Ty:
        if self.ob is None:
            return Ty(t)
        if isinstance(self.ob, Mapping):
            if t not in self.ob:
                return Ty(t)
            img = self.ob[t]
        else:
            img = self.ob(t)
        if isinstance(img, TensorType):
            img = Ty(img)
        if not isinstance(img, Ty):
            raise AxiomError(f"object map of {self.name or 'functor'} must return a Ty",
                             found=type(img).__name__)
        return img

    def on_ty(self, ty: Ty) -> Ty:
        if self.ob is None:  # the identity on objects
            return ty
        out = Ty()
        for t in ty:
            out = out @ self.on_type(t)
        return out

    def on_box(self, box: Box) -> Diagram:
        if self.ar is None:
            return box.diagram
        if isinstance(self.ar, Mapping):
            if box not in self.ar:
                raise AxiomError(f"{self.name or 'functor'} has no image for box {box.name}",
                                 found=repr(box))
            img = self.ar[box]
        else:
            img = self.ar(box)
        if isinstance(img, Box):
            img = img.diagram
        if not isinstance(img, Diagram):
            raise AxiomError(f"arrow map of {self.name or 'functor'} must return a Diagram",
                             key=box.name, found=type(img).__name__)
        return img

    def on_diagram(self, d: Diagram) -> Diagram:
        """Substitute every box of ``d`` by its image, in one pass."""
        if self.ar is None and self.ob is None:
            return d
        dom = self.on_ty(d.dom)
        cod = self.on_ty(d.cod)
        # Where each wire of d lands in the image: a tuple of sources (a type may map to several).
        same_objects = self.ob is None
        width = [1 if same_objects else len(self.on_type(t)) for t in d.dom]
        starts = [sum(width[:k]) for k in range(len(width))]
        where: dict[Source, tuple[Source, ...]] = {
            (-1, k): tuple((-1, starts[k] + i) for i in range(width[k])) for k in range(len(width))
        }
        boxes: list[Box] = []
        wiring: list[tuple[Source, ...]] = []
        cache: dict[Box, Diagram] = {}
        for j, (box, srcs) in enumerate(zip(d.boxes, d.wiring)):
            img = cache.get(box)
            if img is None:
                img = self.on_box(box)
                want_dom, want_cod = self.on_ty(box.dom), self.on_ty(box.cod)
                if img.dom != want_dom or img.cod != want_cod:
                    raise AxiomError(
                        f"{self.name or 'functor'}: image of {box.name} has the wrong type",
                        expected=f"{want_dom} -> {want_cod}", found=f"{img.dom} -> {img.cod}")
                cache[box] = img
            ins = tuple(s for src in srcs for s in where[src])
            flat = img._flat_form
            offset = len(boxes)
            for b, bs in zip(flat.boxes, flat.wiring):
                boxes.append(b)
                wiring.append(tuple(ins[p] if s < 0 else (s + offset, p) for s, p in bs))
            outs = [ins[p] if s < 0 else (s + offset, p) for s, p in flat.outputs]
            pos = 0
            for p, t in enumerate(box.cod):
                w = 1 if same_objects else len(self.on_type(t))
                where[(j, p)] = tuple(outs[pos:pos + w])
                pos += w
        outputs = tuple(s for src in d.outputs for s in where[src])
        return Diagram(dom, cod, ("flat", _Flat(tuple(boxes), tuple(wiring), outputs)))


@attrs.frozen(repr=False, init=False, eq=False)
class Functor:
    """A strict monoidal functor ``dom → cod``, a composite of stages applied in order.

    >>> from metrale.lkb.dtype import BF16
    >>> X = Ty(TensorType(("n",), BF16))
    >>> rename = Functor("C", "C", ar={Box("f", X, X): Box("g", X, X).diagram}, name="rename")
    >>> print(rename(Box("f", X, X).diagram))
    g

    Mappings compare by their items; callables by identity, unless ``key`` names the data
    they are built from (hashable), in which case functors with equal keys are equal:

    >>> up = lambda b: Box(b.name.upper(), b.dom, b.cod)
    >>> Functor("C", "C", ar=up, key="upper") == Functor("C", "C", ar=lambda b: b, key="upper")
    True
    """

    dom: Any
    cod: Any
    stages: tuple[Stage, ...] = ()
    name: str = ""

    def __init__(self, dom: Any, cod: Any, ob: ObMap = None, ar: ArMap = None, *,
                 name: str = "", stages: tuple[Stage, ...] | None = None,
                 key: Any = None) -> None:
        if stages is None:
            stages = ((Stage(ob, ar, name, key),) if (ob is not None or ar is not None)
                      else ())
        self.__attrs_init__(dom, cod, tuple(stages), name)

    @staticmethod
    def id(category: Any) -> Functor:
        """The identity functor on ``category``: no stages."""
        return Functor(category, category, name=f"Id({category})", stages=())

    def __call__(self, x: Any) -> Any:
        """Apply to a ``Ty``, a ``TensorType``, a ``Box`` or a ``Diagram``."""
        if isinstance(x, Box):
            x = x.diagram
        if isinstance(x, TensorType):
            x = Ty(x)
        for stage in self.stages:
            if isinstance(x, Ty):
                x = stage.on_ty(x)
            elif isinstance(x, Diagram):
                x = stage.on_diagram(x)
            else:
                raise AxiomError("a functor applies to types and diagrams",
                                 found=type(x).__name__)
        return x

    def __rshift__(self, other: Any) -> Any:
        """``F >> G``: first F, then G (requires ``F.cod == G.dom``); with a rewriting or
        any other step, a :class:`~metrale.lkb.pipeline.Pipeline`."""
        if not isinstance(other, Functor):
            from .pipeline import Pipeline

            return Pipeline((self,)) >> other
        if self.cod != other.dom:
            raise AxiomError(f"cannot compose functors: {self.cod} is not {other.dom}")
        return Functor(self.dom, other.cod, stages=self.stages + other.stages,
                       name=_join(self, other))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Functor):
            return NotImplemented
        return (self.dom, self.cod, self.stages) == (other.dom, other.cod, other.stages)

    def __hash__(self) -> int:
        return hash((self.dom, self.cod, self.stages))

    def __str__(self) -> str:
        return self.name or f"Functor({self.dom} -> {self.cod})"

    def __repr__(self) -> str:
        return f"Functor({self.dom!r}, {self.cod!r}, name={self.name!r}, {len(self.stages)} stages)"

    def _repr_html_(self) -> str:
        from .functor_html import functor_html

        return functor_html(self)


def _join(f: Functor, g: Functor) -> str:
    if not f.stages:
        return g.name
    if not g.stages:
        return f.name
    return f"{g.name} ∘ {f.name}" if f.name and g.name else ""


def compose(g: Functor, f: Functor) -> Functor:
    """``G ∘ F``, the same functor as ``F >> G``.

    >>> compose(Functor.id("C"), Functor.id("C")) == Functor.id("C")
    True
    """
    return f >> g

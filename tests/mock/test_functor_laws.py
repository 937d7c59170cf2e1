"""Functor laws: identity, composition of functors, strictness on >> and @, type checking."""

import pytest

from metrale.lkb import AxiomError, Box, Diagram, Functor, TensorType, Ty, compose
from metrale.lkb.dtype import BF16, F32
from metrale.testing import functor_laws

X = Ty(TensorType(("n",), BF16))
Y = Ty(TensorType(("n",), F32))
f, g, h = Box("f", X, X), Box("g", X @ X, X), Box("h", X, X @ X)
GENS = [f, g, h]

upcast = Functor("C", "D", ob={TensorType(("n",), BF16): Y},
                 ar=lambda b: Box(b.name.upper(), Ty(*(Y.types * len(b.dom))),
                                  Ty(*(Y.types * len(b.cod)))).diagram, name="upcast")
split = Functor("C", "C", ob=lambda t: Ty(t, t),
                ar=lambda b: Box(b.name + "2", Ty(*(t for t in b.dom for _ in (0, 1))),
                                 Ty(*(t for t in b.cod for _ in (0, 1)))).diagram, name="split")


def test_functor_laws_upcast():
    functor_laws(upcast, GENS)


def test_functor_laws_type_splitting():
    """An object map onto several wires (one tensor becomes two) is still strict monoidal."""
    functor_laws(split, GENS)


def test_composite_functor_laws():
    functor_laws(split >> split, GENS)


def test_identity_functor_is_a_unit_exactly():
    assert Functor.id("C") >> upcast == upcast
    assert upcast >> Functor.id("D") == upcast
    assert hash(Functor.id("C") >> upcast) == hash(upcast)


def test_composition_of_functors_is_associative_and_matches_compose():
    a = split >> split >> split
    assert (split >> split) >> split == split >> (split >> split) == a
    assert compose(split, split) == split >> split
    d = f.diagram >> h.diagram >> g.diagram
    assert (split >> split)(d) == split(split(d))


def test_functor_composition_checks_categories():
    with pytest.raises(AxiomError, match="cannot compose functors"):
        upcast >> upcast


def test_image_of_wrong_type_is_refused():
    bad = Functor("C", "D", ob={TensorType(("n",), BF16): Y}, ar=lambda b: b.diagram)
    with pytest.raises(AxiomError, match="wrong type"):
        bad(f.diagram)


def test_missing_box_in_mapping_is_an_error():
    partial = Functor("C", "C", ar={f: f.diagram})
    with pytest.raises(AxiomError, match="no image for box g"):
        partial(g.diagram)


def test_functor_on_identity_and_types():
    assert upcast(X) == Y
    assert upcast(Diagram.id(X @ X)) == Diagram.id(Y @ Y)

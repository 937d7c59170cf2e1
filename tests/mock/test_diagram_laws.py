"""The laws of the symmetric monoidal category of diagrams, as Hypothesis properties."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrale.lkb import AxiomError, Box, Builder, Diagram, TensorType, Ty
from metrale.lkb.dtype import BF16, F32
from metrale.testing import LawViolation, category_laws, monoidal_laws
from tests.strategies import composable_chains, diagrams, tensor_products

X = Ty(TensorType(("rows", "hidden"), BF16))
W = Ty(TensorType(("hidden",), BF16))
Y = Ty(TensorType(("rows", "hidden"), F32))


def test_category_laws():
    category_laws()


def test_monoidal_laws():
    monoidal_laws()


@given(composable_chains(2))
def test_composition_types(chain):
    f, g = chain
    d = f >> g
    assert d.dom == f.dom and d.cod == g.cod
    assert len(d) == len(f) + len(g)


@given(tensor_products(2))
def test_tensor_types(pair):
    f, g = pair
    d = f @ g
    assert d.dom == f.dom @ g.dom and d.cod == f.cod @ g.cod


@given(diagrams())
def test_hash_agrees_with_eq_after_rebuild(d):
    rebuilt = Diagram.flat(d.dom, d.cod, d.boxes, d.wiring, d.outputs)
    assert rebuilt == d and hash(rebuilt) == hash(d)


@given(diagrams(), st.randoms(use_true_random=False))
def test_relabelled_topological_order_is_equal(d, rnd):
    """Reorder independent boxes (another topological order): still the same port graph."""
    n = len(d.boxes)
    deps = [{s for s, _ in srcs if s >= 0} for srcs in d.wiring]
    placed: list[int] = []
    remaining = set(range(n))
    while remaining:
        ready = sorted(j for j in remaining if deps[j] <= set(placed))
        j = rnd.choice(ready)
        placed.append(j)
        remaining.remove(j)
    new_index = {old: new for new, old in enumerate(placed)}

    def move(src):
        s, p = src
        return (s, p) if s < 0 else (new_index[s], p)

    boxes = [d.boxes[j] for j in placed]
    wiring = [tuple(move(s) for s in d.wiring[j]) for j in placed]
    other = Diagram.flat(d.dom, d.cod, boxes, wiring, [move(s) for s in d.outputs])
    assert other == d
    assert hash(other) == hash(d)


def test_isomorphic_diagrams_built_in_different_orders_are_equal():
    f, g = Box("f", X, X), Box("g", X, X)
    join = Box("join", X @ X, X)
    a = Builder(X)
    (x,) = a.inputs
    (fx,) = a.add(f, x)
    (gx,) = a.add(g, x)
    (out,) = a.add(join, fx, gx)
    first = a.build(out)
    b = Builder(X)
    (x,) = b.inputs
    (gx,) = b.add(g, x)
    (fx,) = b.add(f, x)
    (out,) = b.add(join, fx, gx)
    second = b.build(out)
    assert first.boxes != second.boxes  # really built in another order
    assert first == second and hash(first) == hash(second)
    assert first == (Diagram.copy(X) >> (f @ g) >> join)


def test_changing_one_port_wiring_makes_diagrams_unequal():
    f, g = Box("f", X, X), Box("g", X, X)
    join = Box("join", X @ X, X)
    straight = (f @ g) >> join
    crossed = (f @ g) >> Diagram.swap(X, X) >> join
    assert straight != crossed
    b = Builder(X @ X)
    x0, x1 = b.inputs
    (fx,) = b.add(f, x0)
    (gx,) = b.add(g, x0)  # reads input 0 instead of input 1
    (out,) = b.add(join, fx, gx)
    assert b.build(out) != straight


def test_sharing_is_not_the_same_as_copies():
    f = Box("f", X, X)
    join = Box("join", X @ X, X)
    shared = f.diagram >> Diagram.copy(X) >> join
    copies = Diagram.copy(X) >> (f @ f) >> join
    assert shared != copies


def test_dead_boxes_count_for_equality():
    f, sink = Box("f", X, X), Box("sink", X, Ty())
    with_dead = Builder(X)
    (x,) = with_dead.inputs
    with_dead.add(sink, x)
    (y,) = with_dead.add(f, x)
    assert with_dead.build(y) != f.diagram
    assert with_dead.build(y) == (Diagram.copy(X) >> (f @ sink))


def test_dead_parts_equal_up_to_isomorphism_not_construction_order():
    """Hypothesis's counterexample to the naturality of the symmetry: ``f @ g == g @ f`` on
    empty types, where the dead readers of ``g`` tie on their upstream structure alone."""
    A, B = Ty(TensorType(("rows",), BF16)), Ty(TensorType(("rows", "hidden"), F32))
    source, pair = Box("f", Ty(), A), Box("g", Ty(), A @ B)
    unit, reader, fork = Box("f", Ty(), Ty()), Box("f", A, Ty()), Box("g", A, A @ B)

    def dead(*wiring):
        boxes = [source, pair, unit, reader, reader][:len(wiring)]
        return Diagram.flat(Ty(), Ty(), boxes, wiring, [])

    f = dead((), (), (), ((1, 0),))
    g = dead((), (), (), ((1, 0),), ((1, 0),))
    assert f @ g == g @ f and hash(f @ g) == hash(g @ f)
    assert (f @ g) >> Diagram.swap(f.cod, g.cod) == Diagram.swap(f.dom, g.dom) >> (g @ f)

    def readers(*reads, fed=False):
        """Two dead ``g`` boxes, both fed by one dead ``f`` when ``fed``, and for each ``k``
        in ``reads`` a dead ``f`` reading output 0 of ``g`` number ``k``."""
        gs = [(source, ()), (fork, ((0, 0),)), (fork, ((0, 0),))] if fed else [(pair, ())] * 2
        rs = [(reader, ((k + fed, 0),)) for k in reads]
        boxes, wiring = zip(*gs, *rs)
        return Diagram.flat(Ty(), Ty(), boxes, wiring, [])

    for fed in (False, True):
        # sharing one g is not each reading its own
        assert readers(0, 0, fed=fed) != readers(0, 1, fed=fed)
        # the same port graph, readers reordered: the two g stay tied under colour
        # refinement, and only individualising one of them orders the readers
        assert readers(0, 1, 0, 1, fed=fed) == readers(0, 0, 1, 1, fed=fed)
        assert hash(readers(0, 1, 0, 1, fed=fed)) == hash(readers(0, 0, 1, 1, fed=fed))
        assert readers(0, 0, 1, fed=fed) == readers(1, 0, 1, fed=fed)


def test_ill_typed_composition_names_both_types():
    f = Box("rmsnorm", X @ W, X)
    g = Box("cast", Y, Y)
    with pytest.raises(AxiomError) as e:
        f >> g
    assert "bf16[rows,hidden]" in str(e.value) and "f32[rows,hidden]" in str(e.value)


def test_builder_refuses_ill_typed_wire():
    b = Builder(Y)
    (y,) = b.inputs
    with pytest.raises(AxiomError, match="expected bf16"):
        b.add(Box("f", X, X), y)


def test_printers():
    f = Box("rmsnorm", X @ W, X)
    g = Box("linear", X, X)
    assert str(f >> g) == "rmsnorm >> linear"
    assert str(Diagram.id(X)) == "Id(bf16[rows,hidden])"
    d = (g @ g) >> Box("add", X @ X, X)
    assert str(d) == "(linear @ linear) >> add" or str(d) == "linear @ linear >> add"
    copy = eval(repr(f >> g), {"Diagram": Diagram, "Box": Box, "Ty": Ty, "TensorType": TensorType,
                               "BF16": BF16, "F32": F32})
    assert copy == f >> g


def test_svg_snapshot_of_small_diagram():
    svg = (Box("rmsnorm", X @ W, X) >> Box("linear", X, X))._repr_svg_()
    assert svg.startswith('<svg xmlns="http://www.w3.org/2000/svg" width="')
    assert svg.count("<rect") == 2 and ">rmsnorm</text>" in svg and ">linear</text>" in svg
    assert "bf16[rows,hidden]" in svg


def test_law_suite_reports_a_non_functor_with_its_counterexample():
    """A map whose image depends on how often it was called is not a functor."""
    from itertools import count

    from metrale.lkb import Functor
    from metrale.testing import functor_laws

    f = Box("f", X, X)
    calls = count()
    stateful = Functor("C", "C", ar=lambda b: Box(f"{b.name}#{next(calls)}", X, X).diagram)
    with pytest.raises(LawViolation) as e:
        functor_laws(stateful, [f], max_examples=30)
    assert "F(f >> g) == F(f) >> F(g)" in str(e.value)
    assert "counterexample" in str(e.value) and "= f(" in str(e.value)


def test_functor_laws_pass_for_a_real_functor():
    from metrale.lkb import Functor
    from metrale.testing import functor_laws

    f, g = Box("f", X, X), Box("g", X @ X, X)
    double = Functor("C", "C", ar=lambda b: b.diagram >> Box("tap", b.cod, b.cod).diagram)
    functor_laws(double, [f, g], max_examples=30)

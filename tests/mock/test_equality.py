"""Equality is exact: diagrams up to isomorphism (dead parts included), a box as its one-box
diagram, functors by the data they are built from."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.lkb import Box, Builder, Diagram, Functor, TensorType, Ty
from metrale.lkb.dtype import BF16

X = Ty(TensorType(("a",), BF16))
u, v = Box("u", X, X), Box("v", X @ X, Ty())


def dead(s: list[int]) -> Diagram:
    """The issue's example: ``len(s)`` boxes ``u`` no output reads, joined pairwise by ``v``
    as the permutation ``s`` says."""
    b = Builder(X)
    (x,) = b.inputs
    us = [b.add(u, x)[0] for _ in s]
    for i, j in enumerate(s):
        b.add(v, us[i], us[j])
    return b.build(x)


def test_isomorphic_dead_parts_are_equal():
    assert dead([0, 2, 1]) == dead([1, 0, 2])
    assert hash(dead([0, 2, 1])) == hash(dead([1, 0, 2]))


def test_dead_parts_of_different_cycle_types_differ():
    # a fixed point and a 2-cycle against three fixed points: the same colours, not isomorphic
    assert dead([0, 2, 1]) != dead([0, 1, 2])
    assert dead([1, 2, 0]) != dead([0, 2, 1])


@settings(max_examples=60, deadline=None)
@given(st.permutations(range(5)), st.permutations(range(5)))
def test_relabelled_dead_parts_are_equal(s: list[int], relabel: list[int]):
    """Relabelling the ``u`` boxes of ``dead(s)`` by a permutation gives an isomorphic diagram
    (conjugate permutation), which must compare equal with an equal hash."""
    inv = {r: i for i, r in enumerate(relabel)}
    conj = [inv[s[relabel[i]]] for i in range(5)]
    assert dead(s) == dead(conj) and hash(dead(s)) == hash(dead(conj))


def _cycle_type(s: list[int]) -> tuple[int, ...]:
    seen, lengths = set(), []
    for i in range(len(s)):
        n, j = 0, i
        while j not in seen:
            seen.add(j)
            j, n = s[j], n + 1
        if n:
            lengths.append(n)
    return tuple(sorted(lengths))


def test_equality_is_isomorphism_on_every_permutation_of_four():
    """Two permutation diagrams are isomorphic exactly when the permutations are conjugate
    (same cycle type): ``==`` decides it for every pair."""
    perms = [list(p) for p in itertools.permutations(range(4))]
    for s, t in itertools.product(perms, perms):
        assert (dead(s) == dead(t)) == (_cycle_type(s) == _cycle_type(t)), (s, t)


def test_a_box_is_its_one_box_diagram():
    f = Box("f", X, X)
    assert f == Diagram.id(X) >> f and Diagram.id(X) >> f == f
    assert hash(f) == hash(Diagram.id(X) >> f) == hash(f.diagram)
    assert f != f >> f and {f: 1}[f.diagram] == 1


def test_functors_built_from_data_compare_by_it():
    from metrale.realize.functor import realization

    assert realization("sm_90").functor == realization("sm_90").functor
    assert hash(realization("sm_90").functor) == hash(realization("sm_90").functor)
    assert realization("sm_90").functor != realization("sm_80").functor
    same = Functor("C", "C", ar=lambda b: b.diagram, name="same")
    assert same == same and same != Functor("C", "C", ar=lambda b: b.diagram, name="same")


def test_large_dead_parts_are_decided_part_by_part():
    """300 tied boxes: a relabelling is equal, a transposition (another cycle type) is not;
    parts are compared by their invariants first, so neither case searches the whole part."""
    import random

    s = list(range(300))
    random.Random(1).shuffle(s)
    relabel = list(range(300))
    random.Random(2).shuffle(relabel)
    inv = {r: i for i, r in enumerate(relabel)}
    assert dead(s) == dead([inv[s[relabel[i]]] for i in range(300)])
    swapped = list(s)
    swapped[0], swapped[1] = swapped[1], swapped[0]
    assert dead(s) != dead(swapped)

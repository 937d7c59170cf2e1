"""A relation as an equation between two diagrams over the presentation's generators.

``equation(rel, P)`` builds both sides of a relation with the public :class:`Builder`: each
call becomes a box of its family (named by the family, its parameters the call's pins), typed
by the family's ports, and the Builder checks every wire as for any diagram. The sides share
their domain (the lhs's inputs, in order) and codomain (the rhs's outputs). Types are
*patterns*: the dims of wires the relation joins are unified and named after the first one
met, and a dtype the relation leaves to a parameter (``{act}``) is a dtype variable,
:func:`dtype_variable`, bound when the rewriter matches the lhs in a diagram.

>>> from metrale.lkb.presentation import Presentation
>>> P = Presentation.load()
>>> lhs, rhs = equation(P.relation("add_rmsnorm"), P)
>>> print(lhs)
x0, x1, x2 -> v0 = add(x0, x1); v1 = rmsnorm(v0, x2) -> v0, v1
>>> print(rhs)
add_rmsnorm
>>> lhs.dom == rhs.dom and lhs.cod == rhs.cod, str(lhs.dom)
(True, '{act}[rows,h] @ {act}[rows,h] @ bf16[h]')
>>> [b.params for b in equation(P.relation("splitk_pairwise"), P)[1].boxes]
[(('across', 'pairwise'),)]
"""

from __future__ import annotations

from typing import Any

from .diagram import Box, Builder, Diagram, Wire
from .dtype import DType
from .errors import AxiomError
from .family import Family
from .relation import Relation
from .ty import TensorType, Ty


def dtype_variable(param: str) -> DType:
    """The dtype a relation leaves to parameter ``param``: a variable of pattern types, never
    the type of a real wire.

    >>> dtype_variable("act").name
    '{act}'
    """
    return DType("{" + param + "}", 0, "void")


def equation(rel: Relation, P: Any) -> tuple[Diagram, Diagram]:
    """``(lhs, rhs)`` of ``rel`` as diagrams (see the module docstring); an ill-typed side
    raises the Builder's ``AxiomError`` naming the relation."""
    from .presentation import _call_types, _Unifier

    families: dict[str, Family] = {f.name: f for f in P.generators}
    u = _Unifier()
    wires: dict[tuple[str, str], tuple] = {}
    for which, side in (("lhs", rel.lhs), ("rhs", rel.rhs)):
        for idx, c in enumerate(side.calls):
            ins, outs = _call_types(which, idx, c, families[c.family], dict(c.pins))
            for arg, t in zip(c.args, ins):
                wire = (which, arg) if arg in side.defined else ("in", arg)
                if wire in wires:
                    _unify(u, wires[wire], t)
                else:
                    wires[wire] = t
            for out, t in zip(c.outs, outs):
                wires[(which, out)] = t
    for name in rel.rhs.defined:
        _unify(u, wires[("lhs", name)], wires[("rhs", name)])
    names: dict[Any, str | int] = {}

    def dim(x: Any) -> str | int:
        root = u.find(x)
        if root[0] == "const":
            return root[1]
        if root not in names:
            base = str(x[2])
            taken = set(names.values())
            name = base
            while name in taken:
                name += "'"
            names[root] = name
        return names[root]

    def ttype(t: tuple) -> TensorType:
        dt, dims = t
        root = u.find(dt)
        dtype = (DType.parse(str(root[1])) if root[0] == "const" else dtype_variable(root[1]))
        return TensorType(tuple(dim(x) for x in dims), dtype)

    for which, side in (("lhs", rel.lhs),):  # name dims in the lhs's order first
        for idx, c in enumerate(side.calls):
            for d in (*families[c.family].inputs, *families[c.family].outputs):
                for x in d.dims:
                    if isinstance(x, str):
                        dim((which, idx, x))
    dom = Ty(*(ttype(wires[("in", a)]) for a in rel.lhs.inputs))

    def build(which: str) -> Diagram:
        side = rel.lhs if which == "lhs" else rel.rhs
        b = Builder(dom)
        env: dict[str, Wire] = dict(zip(rel.lhs.inputs, b.inputs))
        for idx, c in enumerate(side.calls):
            fam = families[c.family]
            ins, outs = _call_types(which, idx, c, fam, dict(c.pins))
            box = Box(c.family, Ty(*map(ttype, ins)), Ty(*map(ttype, outs)), dict(c.pins))
            try:
                got = b.add(box, *(env[a] for a in c.args))
            except AxiomError as e:
                raise AxiomError(f"relation {rel.name}: {which}: {e.message}", key=c.family,
                                 expected=e.expected, found=e.found) from None
            env.update(zip(c.outs, got))
        return b.build(*(env[o] for o in rel.rhs.defined))

    return build("lhs"), build("rhs")


def _unify(u: Any, a: tuple, b: tuple) -> None:
    (da, dims_a), (db, dims_b) = a, b
    u.union(da, db)
    for x, y in zip(dims_a, dims_b):
        u.union(x, y)


__all__ = ["dtype_variable", "equation"]

"""A relation drawn: its lhs and rhs as string diagrams side by side, with its numerics.

Each side's let-syntax becomes a port graph: a box per call (the family, with its pinned
parameters), wires named by the relation's variables, the relation's inputs in the same order
on both sides (their order of first use on the lhs) and its outputs at the bottom. Types are
left out: a relation holds at every compiled point of its rhs, so its wires have one type per
point, not one type.

>>> from metrale.lkb.presentation import Presentation
>>> rel = Presentation.load().relation("add_rmsnorm")
>>> html = relation_html(rel)
>>> html.count("<svg") == 2 and ">add_rmsnorm</text>" in html and "bit_identical" in html
True
>>> [n.label for n in side_graph(rel.lhs, rel.lhs.inputs, rel.outputs).nodes]
['x', 'r', 'w', 'add', 'rmsnorm', 's', 'y']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .drawing import Edge, Node, PortGraph, graph_svg
from .html_table import badge, code, esc

if TYPE_CHECKING:
    from .relation import Relation, Side


def side_graph(side: Side, inputs: Sequence[str], outputs: Sequence[str]) -> PortGraph:
    """The port graph of one side: ``inputs`` enter in order, ``outputs`` leave in order."""
    names = list(inputs) + [n for n in side.inputs if n not in inputs]
    nodes = [Node(n, 0, 1, "input") for n in names]
    where = {n: (k, 0) for k, n in enumerate(names)}
    edges = []
    for call in side.calls:
        v = len(nodes)
        pins = ",".join(f"{k}={val}" for k, val in call.pins)
        label = f"{call.family}[{pins}]" if pins else call.family
        nodes.append(Node(label, len(call.args), len(call.outs), "box", call.outs, str(call)))
        edges += [Edge(where[a], (v, i)) for i, a in enumerate(call.args)]
        where.update({o: (v, p) for p, o in enumerate(call.outs)})
    for name in outputs:
        edges.append(Edge(where[name], (len(nodes), 0)))
        nodes.append(Node(name, 1, 0, "output"))
    return PortGraph(tuple(nodes), tuple(edges))


def relation_html(rel: Relation, *, engine: str = "python") -> str:
    """lhs and rhs drawn side by side, the let-syntax of each, and the numerics contract."""
    inputs = rel.lhs.inputs
    sides = []
    for title, side in (("lhs", rel.lhs), ("rhs", rel.rhs)):
        svg = graph_svg(side_graph(side, inputs, rel.outputs), engine=engine)
        sides.append(f"<div><b>{title}</b><br>{code(side.text)}<br>{svg}</div>")
    numerics = badge(rel.numerics, "ok" if rel.exact else "warn")
    if rel.bound is not None:
        numerics += (f" |lhs − rhs| ≤ ({esc(rel.bound.rel)})·|lhs| + "
                     f"({esc(rel.bound.abs)})·rms(lhs)")
    doc = f"<br><small>{esc(rel.doc)}</small>" if rel.doc else ""
    return (f"<div><b>{esc(rel.name)}</b>: {numerics}{doc}"
            f'<div style="display:flex;gap:3em;align-items:flex-start">{"".join(sides)}</div>'
            f"</div>")

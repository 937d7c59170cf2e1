"""Jupyter views of plans: one layer's kernel dataflow drawn, a plan with a layer expanded, diffs.

``show(plan, layer=3)`` is the plan's display (totals, kernel table, the graph collapsed by
layer, declined fusions) with layer 3 expanded and its kernel dataflow drawn: fused kernels
filled green, views dashed, residual kernels orange, every wire labelled with its bound type.
``PlanDiff`` displays as two columns of kernels only in one plan or the other, with the
reasons the planner gave.

>>> from metrale.plan.plan import plan_for
>>> p = plan_for("tiny-qwen3", "bf16", "host")
>>> svg = layer_graph_svg(p, 0, engine="python")
>>> svg.count("<rect") == len([k for k in p.kernels if k.layer == 0])
True
>>> "bf16[1,64]" in svg and "#dcead7" in svg
True
>>> "only in host/tiny-qwen3/fp8" in plan_diff_html(p.diff(plan_for("tiny-qwen3", "fp8", "host")))
True
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import attrs

from metrale.lkb.drawing import Edge, Node, PortGraph, graph_svg
from metrale.lkb.html_table import badge, code, details, esc, table

if TYPE_CHECKING:
    from .plan import Plan, PlanDiff

STYLE = ("<style>div.metrale-plan td, div.metrale-plan th {text-align: left !important; "
         "vertical-align: top}</style>")
"""Jupyter right-aligns table cells; the kernel table reads better left-aligned."""

LEGEND = ("<div><small>" + badge("fused by a relation", "ok") + " " + badge("unfused", "info")
          + " " + badge("residual kernel", "warn") + " dashed: a view (no launch)</small></div>")


def _short(name: str, layer: int, kind: str) -> str:
    """A buffer's name as a terminal: a weight by its module (``q_proj``), else as planned."""
    if kind == "weight":
        parts = name.split(".")
        return parts[-2] if len(parts) > 1 else name
    return re.sub(rf"^model\.layers\.{layer}\.", "", name)


def layer_graph(p: Plan, layer: int) -> PortGraph:
    """The dataflow of one layer's kernels: buffers from outside enter as terminals (weights,
    by module name, caches, the residual stream, with their types), buffers read after the
    layer (or kept, like caches) leave."""
    ks = [k for k in p.kernels if k.layer == layer]
    inside = {k.index for k in ks}
    types = {b.name: b.type for b in p.buffers}
    kinds = {b.name: b.kind for b in p.buffers}
    read_after: set[str] = set(p.output_names)
    for k in p.kernels:
        if k.index not in inside:
            read_after.update(k.inputs)
    nodes: list[Node] = []
    edges: list[Edge] = []
    entering: dict[str, int] = {}
    producer: dict[str, tuple[int, int]] = {}
    wiring: list[tuple[int, list[str]]] = []
    for k in ks:
        wiring.append((len(nodes), list(k.inputs)))
        style = "view" if k.view else "residual" if k.residual else "fused" if k.relation else ""
        title = (f"#{k.index} {k.point}\n{k.provenance}; {k.evidence}; {k.numerics}"
                 + (f"; fused by {k.relation}" if k.relation else ""))
        nodes.append(Node(k.family, len(k.inputs), len(k.outputs), "box",
                          tuple(str(types[o]) if o in types else "" for o in k.outputs), title,
                          style))
    # terminals first would be conventional; the layout does not need it, so they follow
    for (v, ins), k in zip(wiring, ks):
        for i, name in enumerate(ins):
            src = producer.get(name)
            if src is None:
                if name not in entering:
                    entering[name] = len(nodes)
                    kind = kinds.get(name, "")
                    nodes.append(Node(_short(name, layer, kind), 0, 1, "input",
                                      () if kind == "weight" else (str(types.get(name, "")),)))
                src = (entering[name], 0)
            edges.append(Edge(src, (v, i)))
        for p_, name in enumerate(k.outputs):
            producer[name] = (v, p_)
    for name, (v, p_) in producer.items():
        if name in read_after or kinds.get(name) == "cache":
            edges.append(Edge((v, p_), (len(nodes), 0)))
            nodes.append(Node(_short(name, layer, kinds.get(name, "")), 1, 0, "output"))
    return PortGraph(tuple(nodes), tuple(edges))


def layer_graph_svg(p: Plan, layer: int, *, engine: str = "auto") -> str:
    """The drawing of :func:`layer_graph`."""
    return graph_svg(layer_graph(p, layer), engine=engine)


def plan_view_html(p: Plan, layer: int | None = None, *, engine: str = "auto") -> str:
    """The plan's display with ``layer`` (default: the first) expanded and its dataflow drawn."""
    from .printers import plan_html

    layers = sorted({k.layer for k in p.kernels if k.layer is not None})
    shown = layers[0] if layer is None and layers else layer
    graph = ""
    if shown is not None:
        graph = details(f"<b>layer {shown}</b>: kernel dataflow",
                        layer_graph_svg(p, shown, engine=engine), open_=True)
    return f'<div class="metrale-plan">{STYLE}{LEGEND}{plan_html(p, layer=layer)}{graph}</div>'


@attrs.frozen
class PlanView:
    """A plan shown with one layer expanded (what :func:`show` returns)."""

    plan: Any
    layer: int | None = None

    def _repr_html_(self) -> str:
        return plan_view_html(self.plan, self.layer)


def show(plan: Plan, layer: int | None = None) -> PlanView:
    """Display ``plan`` in Jupyter with ``layer`` expanded and its kernel dataflow drawn.

    >>> from metrale.plan.plan import plan_for
    >>> "layer 1</b>: kernel dataflow" in show(plan_for("tiny-llama"), 1)._repr_html_()
    True
    """
    return PlanView(plan, layer)


def plan_diff_html(d: PlanDiff) -> str:
    """Kernels (by point) only in the left plan and only in the right, and the reasons."""
    left = [[code(p), str(n)] for p, n in d.only_left]
    right = [[code(p), str(n)] for p, n in d.only_right]
    head = f"<div><b>{esc(d.left)}</b> vs <b>{esc(d.right)}</b></div>"
    if not left and not right:
        body = "<div>the same kernels</div>"
    else:
        body = ('<div style="display:flex;gap:2em">'
                + table(["point", "×"], left, caption=f"only in {esc(d.left)}")
                + table(["point", "×"], right, caption=f"only in {esc(d.right)}") + "</div>")
    why = "".join(f"<li>{esc(r)}</li>" for r in d.reasons)
    return head + body + (f"<div>why (declined fusions):</div><ul>{why}</ul>" if why else "")

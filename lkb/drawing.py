"""SVG drawings of string diagrams: boxes with ordered ports, wires labelled by their type.

A diagram becomes a :class:`PortGraph` (input terminals, boxes, output terminals; one wire per
input port), which is laid out in layers — by the system Graphviz (``dot``) when it is on the
PATH, else by the pure-Python layered layout here — and written as SVG by one writer, so both
engines draw the same way: a box is one ``<rect>``, its input ports are dots along its top edge
and its output ports along its bottom edge, left to right in port order, and each wire's type is
written once, at the port that produces it. The Python layout is deterministic, so its drawings
are snapshot-tested.

The layout is Sugiyama's: layers by longest path from the inputs, a chain of bend points for a
wire that skips layers (so it runs between boxes, not through them), orders within layers by
port-aware barycenter sweeps with the diagram's own input and output order fixed, and x
positions by isotonic regression onto the neighbours' ports (pool-adjacent-violators). No
pip-installable library does this layout without Graphviz, hence the hand-written one.

>>> from metrale.lkb.dtype import BF16
>>> from metrale.lkb.ty import Ty, TensorType
>>> from metrale.lkb.diagram import Box
>>> X = Ty(TensorType(("n",), BF16))
>>> svg = diagram_svg(Box("f", X, X @ X) >> Box("g", X @ X, X), engine="python")
>>> svg.startswith("<svg") and ">f</text>" in svg and ">g</text>" in svg
True

One rect per box, a dot per port (terminals included), a type label per box output:

>>> svg.count("<rect"), svg.count('class="port"'), svg.count(">bf16[n]</text>")
(2, 8, 3)
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from html import escape
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from .diagram import Diagram

BOX_H, GAP_X, GAP_Y, MARGIN = 34, 22, 58, 16
PORT_GAP, DUMMY_W, CHAR_W, MONO_W = 16, 6, 7.0, 5.6
MAX_BOXES = 200
"""Diagrams with more boxes draw as a summary card (counts by box name), never as a wall."""

ENGINES = ("auto", "python", "graphviz")

FILL = {"": "#eef3fb", "fused": "#dcead7", "view": "#ffffff", "residual": "#fbe9d7"}


@attrs.frozen
class Node:
    """A node of a port graph: a box, or a terminal (``input``: one output port; ``output``:
    one input port). ``out_labels`` are written at the output ports (the wires' types)."""

    label: str
    inputs: int
    outputs: int
    kind: str = "box"  # box | input | output
    out_labels: tuple[str, ...] = ()
    title: str = ""
    style: str = ""  # "" | fused | view | residual


@attrs.frozen
class Edge:
    """A wire from output port ``src = (node, port)`` to input port ``dst = (node, port)``."""

    src: tuple[int, int]
    dst: tuple[int, int]


@attrs.frozen
class PortGraph:
    """Nodes (terminals of the inputs first, of the outputs last, by convention) and their
    wires, an acyclic graph; what both layout engines take."""

    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]

    @property
    def boxes(self) -> int:
        return sum(n.kind == "box" for n in self.nodes)


@attrs.frozen
class Placed:
    """A laid-out port graph: node rectangles (x, y, w, h), port positions, wire paths."""

    width: float
    height: float
    rects: tuple[tuple[float, float, float, float], ...]
    in_ports: tuple[tuple[tuple[float, float], ...], ...]
    out_ports: tuple[tuple[tuple[float, float], ...], ...]
    wires: tuple[str, ...]


def diagram_graph(d: Diagram) -> PortGraph:
    """The port graph of ``d``: input terminals ``in0 …``, one node per box, then ``out0 …``."""
    n_in = len(d.dom)
    nodes = [Node(f"in{k}", 0, 1, "input", (str(t),)) for k, t in enumerate(d.dom)]
    for b in d.boxes:
        params = ", ".join(f"{k}={v}" for k, v in b.params)
        title = f"{b.name}({params}): {b.dom} → {b.cod}" if params else f"{b.name}: {b.dom} → {b.cod}"
        nodes.append(Node(b.name, len(b.dom), len(b.cod), "box", tuple(map(str, b.cod)), title))
    nodes += [Node(f"out{k}", 1, 0, "output") for k in range(len(d.cod))]

    def node_of(src: tuple[int, int]) -> tuple[int, int]:
        s, p = src
        return (p, 0) if s < 0 else (n_in + s, p)

    edges = [Edge(node_of(src), (n_in + j, i))
             for j, srcs in enumerate(d.wiring) for i, src in enumerate(srcs)]
    first_out = n_in + len(d.boxes)
    edges += [Edge(node_of(src), (first_out + k, 0)) for k, src in enumerate(d.outputs)]
    return PortGraph(tuple(nodes), tuple(edges))


def diagram_svg(d: Diagram, *, max_boxes: int = MAX_BOXES, engine: str = "auto") -> str:
    """An SVG string of ``d``; over ``max_boxes`` boxes, a summary card of box counts.

    ``engine``: ``"graphviz"`` (needs ``dot``), ``"python"``, or ``"auto"`` (Graphviz when
    ``dot`` is on the PATH).
    """
    if len(d.boxes) > max_boxes:
        return summary_svg([b.name for b in d.boxes], f"{len(d.boxes)} boxes")
    return graph_svg(diagram_graph(d), engine=engine)


def graph_svg(g: PortGraph, *, engine: str = "auto") -> str:
    """Lay out ``g`` with ``engine`` and write it as SVG."""
    if engine not in ENGINES:
        from .errors import ConfigError

        raise ConfigError("unknown drawing engine", key="engine", expected=" or ".join(ENGINES),
                          found=repr(engine))
    placed = None
    if engine == "graphviz" or (engine == "auto" and has_graphviz()):
        from .drawing_dot import graphviz_layout

        placed = graphviz_layout(g, required=engine == "graphviz")
    return write_svg(g, placed if placed is not None else layered_layout(g))


def has_graphviz() -> bool:
    """Whether the system Graphviz ``dot`` is on the PATH."""
    return shutil.which("dot") is not None


def summary_svg(names: Sequence[str], what: str) -> str:
    """A card listing how many of each name, for graphs too large to draw usefully."""
    counts: dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    rows = "".join(
        f'<text x="{MARGIN}" y="{MARGIN + 40 + 16 * i}" font-size="12">{escape(k)} × {v}</text>'
        for i, (k, v) in enumerate(sorted(counts.items())))
    h = MARGIN * 2 + 40 + 16 * len(counts)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="420" height="{h}" '
            f'font-family="sans-serif"><text x="{MARGIN}" y="{MARGIN + 12}" font-size="14" '
            f'font-weight="bold">{escape(what)} (too many to draw; counts by name)</text>'
            f"{rows}</svg>")


# -- the pure-Python layered layout --------------------------------------------------------------


def node_width(n: Node) -> float:
    """Box width: room for the name and for the ports; terminals: room for their label."""
    if n.kind == "box":
        return max(64.0, CHAR_W * len(n.label) + 18, PORT_GAP * (max(n.inputs, n.outputs) + 1))
    text = n.label + (f": {n.out_labels[0]}" if n.kind == "input" and n.out_labels else "")
    return max(24.0, MONO_W * len(text) + 6)


def port_x(x: float, w: float, i: int, n: int) -> float:
    """The i-th of n ports along a node's edge, evenly spaced, left to right."""
    return x + w * (i + 1) / (n + 1)


def _isotonic(targets: list[float]) -> list[float]:
    """The non-decreasing sequence nearest ``targets`` in least squares (pool adjacent
    violators)."""
    blocks: list[list[float]] = []  # [sum, count]
    for t in targets:
        blocks.append([t, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    out: list[float] = []
    for s, c in blocks:
        out += [s / c] * int(c)
    return out


def _place_row(order: list[int], left: list[float], right: list[float],
               desired: list[float]) -> list[float]:
    """Centers for one layer, in order, a gap apart (nodes reach ``left``/``right`` of their
    centers, type labels included), nearest ``desired`` (by index)."""
    offsets = [0.0]
    for a, b in zip(order, order[1:]):
        offsets.append(offsets[-1] + right[a] + left[b] + GAP_X)
    ys = _isotonic([desired[v] - o for v, o in zip(order, offsets)])
    return [y + o for y, o in zip(ys, offsets)]


def _topological(n: int, edges: Sequence[Edge]) -> list[int]:
    """Node indices in a topological order, the smallest ready index first (deterministic)."""
    import heapq

    indegree = [0] * n
    after: list[list[int]] = [[] for _ in range(n)]
    for e in edges:
        indegree[e.dst[0]] += 1
        after[e.src[0]].append(e.dst[0])
    ready = [v for v in range(n) if indegree[v] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        v = heapq.heappop(ready)
        order.append(v)
        for w in after[v]:
            indegree[w] -= 1
            if indegree[w] == 0:
                heapq.heappush(ready, w)
    if len(order) != n:
        from .errors import AxiomError

        raise AxiomError("a port graph to draw must be acyclic", found=f"{n - len(order)} "
                         "nodes on cycles")
    return order


def layered_layout(g: PortGraph) -> Placed:
    """The pure-Python layout of ``g`` (see the module docstring); deterministic."""
    nodes = list(g.nodes)
    n = len(nodes)
    if n == 0:
        return Placed(2 * MARGIN, 2 * MARGIN, (), (), (), ())
    feeds: list[list[Edge]] = [[] for _ in range(n)]
    for e in g.edges:
        feeds[e.dst[0]].append(e)
    layer = [0] * n
    for v in _topological(n, g.edges):
        if nodes[v].kind != "input":
            layer[v] = 1 + max((layer[e.src[0]] for e in feeds[v]), default=0)
    last = max([layer[v] for v in range(n) if nodes[v].kind != "output"] + [0]) + 1
    for v, node in enumerate(nodes):
        if node.kind == "output":
            layer[v] = last
    # an input enters just above its first reader (weights join the layer that reads them)
    first_read: dict[int, int] = {}
    for e in g.edges:
        first_read[e.src[0]] = min(first_read.get(e.src[0], last), layer[e.dst[0]])
    for v, node in enumerate(nodes):
        if node.kind == "input":
            layer[v] = max(first_read.get(v, 1) - 1, 0)
    base = min(layer, default=0)  # no inputs: the roots make the first row
    layer = [lv - base for lv in layer]
    last -= base
    # virtual nodes: one chain of bend points per source port, down to its last consumer
    widths = [node_width(x) for x in nodes]
    left = [w / 2 for w in widths]
    right = [max([w / 2] + [w * ((p + 1) / (x.outputs + 1) - 0.5) + 4 + MONO_W * len(t)
                            for p, t in enumerate(x.out_labels) if x.kind == "box"])
             for w, x in zip(widths, nodes)]
    ports_in = [x.inputs for x in nodes]
    ports_out = [x.outputs for x in nodes]
    chains: dict[tuple[int, int], list[int]] = {}
    up: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]  # (node, its out port, my in)
    segments: list[tuple[tuple[int, int], tuple[int, int]]] = []
    for e in sorted(g.edges, key=lambda e: (layer[e.dst[0]], e.dst)):
        chain = chains.setdefault(e.src, [e.src[0]])
        while layer[chain[-1]] < layer[e.dst[0]] - 1:
            dummy = len(layer)
            layer.append(layer[chain[-1]] + 1)
            widths.append(DUMMY_W)
            left.append(DUMMY_W / 2)
            right.append(DUMMY_W / 2)
            ports_in.append(1)
            ports_out.append(1)
            up.append([(chain[-1], e.src[1] if len(chain) == 1 else 0, 0)])
            segments.append(((chain[-1], e.src[1] if len(chain) == 1 else 0), (dummy, 0)))
            chain.append(dummy)
        k = next(i for i, v in enumerate(chain) if layer[v] == layer[e.dst[0]] - 1)
        tail = (chain[k], e.src[1] if k == 0 else 0)
        up[e.dst[0]].append((tail[0], tail[1], e.dst[1]))
        segments.append((tail, e.dst))
    total = len(layer)
    down: list[list[tuple[int, int, int]]] = [[] for _ in range(total)]  # (node, its in, my out)
    for v in range(total):
        for u, p, i in up[v]:
            down[u].append((v, i, p))
    rows: list[list[int]] = [[] for _ in range(last + 1)]
    for v in range(total):
        rows[layer[v]].append(v)
    x = [0.0] * total
    for row in rows:
        for v, c in zip(row, _place_row(row, left, right, [0.0] * total)):
            x[v] = c

    def port_offset(v: int, i: int, count: int) -> float:
        return widths[v] * ((i + 1) / (count + 1) - 0.5)

    def sweep(direction: int, reorder: bool) -> None:
        span = range(1, last + 1) if direction > 0 else range(last - 1, -1, -1)
        for lv in span:
            row = rows[lv]
            want = list(x)
            for v in row:
                links = up[v] if direction > 0 else down[v]
                if not links:
                    continue
                if direction > 0:
                    acc = [x[u] + port_offset(u, p, ports_out[u]) - port_offset(v, i, ports_in[v])
                           for u, p, i in links]
                else:
                    acc = [x[u] + port_offset(u, i, ports_in[u]) - port_offset(v, p, ports_out[v])
                           for u, i, p in links]
                want[v] = sum(acc) / len(acc)
            if reorder and 0 < lv < last:
                row.sort(key=lambda v: (want[v], x[v]))
            for v, c in zip(row, _place_row(row, left, right, want)):
                x[v] = c

    for _ in range(4):
        sweep(+1, True)
        sweep(-1, True)
    for _ in range(2):
        sweep(+1, False)
        sweep(-1, False)
    sweep(+1, False)
    shift = MARGIN - min(x[v] - left[v] for v in range(total))
    top = MARGIN + 14

    def y_of(v: int) -> float:
        return top + layer[v] * (BOX_H + GAP_Y)

    rects = []
    for v in range(total):
        h = BOX_H if v < n and nodes[v].kind == "box" else 0.0
        yy = y_of(v) + (BOX_H / 2 if v < n and nodes[v].kind == "input" else 0.0)
        if v < n and nodes[v].kind == "output":
            yy = y_of(v)
        rects.append((x[v] - widths[v] / 2 + shift, yy, widths[v], h))

    def pin(v: int, i: int, count: int, bottom: bool) -> tuple[float, float]:
        rx, ry, w, h = rects[v]
        if v >= n:  # a bend point: wires pass straight through the box row
            return rx + w / 2, ry + (BOX_H if bottom else 0.0)
        return port_x(rx, w, i, count), ry + (h if bottom else 0.0)

    wires = []
    for (u, p), (v, i) in segments:
        (x1, y1), (x2, y2) = pin(u, p, ports_out[u], True), pin(v, i, ports_in[v], False)
        my = (y1 + y2) / 2
        path = f"M{x1:.1f},{y1:.1f} C{x1:.1f},{my:.1f} {x2:.1f},{my:.1f} {x2:.1f},{y2:.1f}"
        if v >= n:
            path += f" L{x2:.1f},{y2 + BOX_H:.1f}"
        wires.append(path)
    width = max(x[v] + right[v] for v in range(total)) + shift + MARGIN
    height = max(r[1] + r[3] for r in rects) + 30
    return Placed(width, height, tuple(rects[:n]),
                  tuple(tuple(pin(v, i, ports_in[v], False) for i in range(ports_in[v]))
                        for v in range(n)),
                  tuple(tuple(pin(v, p, ports_out[v], True) for p in range(ports_out[v]))
                        for v in range(n)),
                  tuple(wires))


# -- the writer ------------------------------------------------------------------------------------


def write_svg(g: PortGraph, placed: Placed) -> str:
    """The SVG of a placed port graph: wires, then boxes, ports, names and type labels."""
    # natural size, shrunk to the page where it is wider (viewBox keeps the proportions)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{placed.width:.0f}" '
             f'height="{placed.height:.0f}" viewBox="0 0 {placed.width:.0f} '
             f'{placed.height:.0f}" style="max-width:100%;height:auto" font-family="sans-serif">']
    parts += [f'<path d="{w}" fill="none" stroke="#555"/>' for w in placed.wires]
    for v, node in enumerate(g.nodes):
        x, y, w, h = placed.rects[v]
        if node.kind == "box":
            dash = ' stroke-dasharray="4 3"' if node.style == "view" else ""
            title = f"<title>{escape(node.title)}</title>" if node.title else ""
            parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="4" '
                         f'fill="{FILL.get(node.style, FILL[""])}" stroke="#2b5797"{dash}>'
                         f"{title}</rect>")
            parts.append(f'<text x="{x + w / 2:.1f}" y="{y + h / 2 + 4:.1f}" font-size="12" '
                         f'text-anchor="middle">{escape(node.label)}</text>')
        elif node.kind == "input":
            px, py = placed.out_ports[v][0]
            text = node.label + "".join(f": {t}" for t in node.out_labels[:1])
            parts.append(f'<text x="{px:.1f}" y="{py - 6:.1f}" font-size="10" '
                         f'font-family="monospace" text-anchor="middle">{escape(text)}</text>')
        else:
            px, py = placed.in_ports[v][0]
            parts.append(f'<text x="{px:.1f}" y="{py + 14:.1f}" font-size="10" '
                         f'font-family="monospace" text-anchor="middle">{escape(node.label)}'
                         f"</text>")
        numbered = node.kind == "box" and node.inputs > 1
        for i, (px, py) in enumerate(placed.in_ports[v]):
            parts.append(f'<circle class="port" cx="{px:.1f}" cy="{py:.1f}" r="2.5" '
                         f'fill="#2b5797"/>')
            if numbered:
                parts.append(f'<text x="{px:.1f}" y="{py + 10:.1f}" font-size="7" fill="#888" '
                             f'text-anchor="middle">{i}</text>')
        for p, (px, py) in enumerate(placed.out_ports[v]):
            parts.append(f'<circle class="port" cx="{px:.1f}" cy="{py:.1f}" r="2.5" '
                         f'fill="#2b5797"/>')
            if node.kind == "box" and p < len(node.out_labels) and node.out_labels[p]:
                parts.append(f'<text x="{px + 4:.1f}" y="{py + 11 + 9 * p:.1f}" font-size="9" '
                             f'font-family="monospace" fill="#666">'
                             f"{escape(node.out_labels[p])}</text>")
    parts.append("</svg>")
    return "".join(parts)

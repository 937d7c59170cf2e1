"""The Graphviz engine of :mod:`metrale.lkb.drawing`: ``dot`` lays a port graph out, we draw it.

A port graph becomes DOT with one HTML-table node per box (a row of input-port cells, the
name, a row of output-port cells, so ``dot`` routes each wire to its own port, in order) and a
plain-text node per terminal; ``dot -Tjson`` returns node positions and wire splines, which
become a :class:`~metrale.lkb.drawing.Placed` for the shared SVG writer. So a drawing looks
the same whichever engine made it; only the positions differ.

>>> from metrale.lkb.drawing import Edge, Node, PortGraph
>>> g = PortGraph((Node("in0", 0, 1, "input", ("f32[n]",)), Node("f", 1, 1, "box", ("f32[n]",)),
...                Node("out0", 1, 0, "output")), (Edge((0, 0), (1, 0)), Edge((1, 0), (2, 0))))
>>> print(graph_dot(g).splitlines()[4])
  n0 [shape=plaintext, fontname="Courier", fontsize=9, label="in0: f32[n]"];
"""

from __future__ import annotations

import json
import shutil
import subprocess
from html import escape

from .drawing import BOX_H, MARGIN, Placed, PortGraph, node_width, port_x
from .errors import UnavailableError

DOT_TIMEOUT_S = 20
PT = 72.0  # points per inch: dot's sizes are in inches, positions in points


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _ports(prefix: str, count: int, width: float) -> str:
    if count == 0:
        return ""
    cell = max(width / count, 4.0)
    cells = "".join(f'<TD PORT="{prefix}{i}" WIDTH="{cell:.0f}" HEIGHT="2" FIXEDSIZE="TRUE">'
                    f"</TD>" for i in range(count))
    return (f'<TR><TD><TABLE BORDER="0" CELLSPACING="0" CELLPADDING="0"><TR>{cells}</TR>'
            f"</TABLE></TD></TR>")


def graph_dot(g: PortGraph) -> str:
    """The DOT text of ``g`` (wires undirected in the drawing, ranked top to bottom)."""
    lines = ["digraph G {",
             "  graph [rankdir=TB, nodesep=0.3, ranksep=0.45];",
             '  node [fontname="Helvetica", fontsize=12];',
             "  edge [dir=none];"]
    outputs = []
    for v, n in enumerate(g.nodes):
        if n.kind == "box":
            w = node_width(n)
            label = (f'<<TABLE BORDER="0" CELLSPACING="0" CELLPADDING="0">'
                     f"{_ports('i', n.inputs, w)}"
                     f'<TR><TD WIDTH="{w:.0f}" HEIGHT="{BOX_H - 4}" FIXEDSIZE="TRUE">'
                     f"{escape(n.label)}</TD></TR>{_ports('o', n.outputs, w)}</TABLE>>")
            lines.append(f"  n{v} [shape=plain, label={label}];")
        else:
            text = n.label + "".join(f": {t}" for t in n.out_labels[:1])
            lines.append(f'  n{v} [shape=plaintext, fontname="Courier", fontsize=9, '
                         f"label={_quote(text)}];")
            if n.kind == "output":
                outputs.append(v)
    for k, e in enumerate(g.edges):
        (u, p), (v, i) = e.src, e.dst
        tail = f"n{u}:o{p}:s" if g.nodes[u].kind == "box" else f"n{u}:s"
        head = f"n{v}:i{i}:n" if g.nodes[v].kind == "box" else f"n{v}:n"
        lines.append(f'  {tail} -> {head} [id="e{k}"];')
    if outputs:  # the codomain keeps its order: one rank, chained by invisible edges
        lines.append("  {rank=sink; " + " ".join(f"n{v};" for v in outputs) + "}")
        lines += [f"  n{a} -> n{b} [style=invis];" for a, b in zip(outputs, outputs[1:])]
    lines.append("}")
    return "\n".join(lines)


def _points(pos: str) -> list[tuple[float, float]]:
    """The cubic B-spline control points of an edge's ``pos`` (arrow end points dropped)."""
    out = []
    for tok in pos.split():
        if tok.startswith(("e,", "s,")):
            continue
        x, y = tok.split(",")
        out.append((float(x), float(y)))
    return out


def graphviz_layout(g: PortGraph, *, required: bool = False) -> Placed | None:
    """``dot``'s layout of ``g``; ``None`` when ``dot`` is missing or fails (unless
    ``required``: then an :class:`UnavailableError` says why)."""
    exe = shutil.which("dot")
    try:
        if exe is None:
            raise UnavailableError("Graphviz is not installed", key="dot",
                                   expected="the dot program on the PATH", found="none")
        run = subprocess.run([exe, "-Tjson"], input=graph_dot(g), capture_output=True,
                             text=True, timeout=DOT_TIMEOUT_S)
        if run.returncode != 0:
            raise UnavailableError("Graphviz dot failed", key="dot",
                                   found=run.stderr.strip()[:200] or f"status {run.returncode}")
        data = json.loads(run.stdout)
    except (UnavailableError, OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        if required:
            if isinstance(e, UnavailableError):
                raise
            raise UnavailableError("Graphviz dot gave no layout", key="dot",
                                   found=f"{type(e).__name__}: {e}") from None
        return None
    return _placed(g, data)


def _placed(g: PortGraph, data: dict) -> Placed:
    _, _, bb_w, bb_h = (float(t) for t in data["bb"].split(","))
    top = MARGIN + 14

    def at(x: float, y: float) -> tuple[float, float]:
        return x + MARGIN, bb_h - y + top

    by_name = {o["name"]: o for o in data.get("objects", []) if "pos" in o}
    rects = []
    for v, n in enumerate(g.nodes):
        o = by_name[f"n{v}"]
        cx, cy = at(*(float(t) for t in o["pos"].split(",")))
        w, h = float(o["width"]) * PT, float(o["height"]) * PT
        if n.kind == "box":
            rects.append((cx - w / 2, cy - h / 2, w, h))
        else:
            rects.append((cx - w / 2, cy + (h / 2 if n.kind == "input" else -h / 2), w, 0.0))
    ins = [[(port_x(r[0], r[2], i, n.inputs), r[1]) for i in range(n.inputs)]
           for r, n in zip(rects, g.nodes)]
    outs = [[(port_x(r[0], r[2], p, n.outputs), r[1] + r[3]) for p in range(n.outputs)]
            for r, n in zip(rects, g.nodes)]
    wires = []
    for e in data.get("edges", []):
        if not str(e.get("id", "")).startswith("e"):
            continue
        edge = g.edges[int(e["id"][1:])]
        pts = [at(x, y) for x, y in _points(e["pos"])]
        if len(pts) < 4:
            continue
        path = f"M{pts[0][0]:.1f},{pts[0][1]:.1f}"
        for k in range(1, len(pts) - 2, 3):
            path += " C" + " ".join(f"{x:.1f},{y:.1f}" for x, y in pts[k:k + 3])
        wires.append(path)
        # the ports sit where dot's splines end
        outs[edge.src[0]][edge.src[1]] = pts[0]
        ins[edge.dst[0]][edge.dst[1]] = pts[-1]
    return Placed(bb_w + 2 * MARGIN + 120, bb_h + top + 30, tuple(rects),
                  tuple(tuple(p) for p in ins), tuple(tuple(p) for p in outs), tuple(wires))

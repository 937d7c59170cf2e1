"""Pure-Python SVG drawings of string diagrams: a layered layout, no Graphviz needed.

Boxes sit in layers by longest path from the inputs; wires are drawn top to bottom and
labelled with their type. Deterministic output, so drawings can be snapshot-tested.

>>> from metrale.lkb.dtype import BF16
>>> from metrale.lkb.ty import Ty, TensorType
>>> from metrale.lkb.diagram import Box
>>> X = Ty(TensorType(("n",), BF16))
>>> svg = diagram_svg(Box("f", X, X) >> Box("g", X, X))
>>> svg.startswith("<svg") and ">f</text>" in svg and ">g</text>" in svg
True
"""

from __future__ import annotations

from html import escape
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .diagram import Diagram

BOX_W, BOX_H, GAP_X, GAP_Y, MARGIN = 120, 34, 28, 46, 20


def _layers(d: Diagram) -> list[int]:
    layer = []
    for srcs in d.wiring:
        layer.append(1 + max((layer[s] for s, _ in srcs if s >= 0), default=0))
    return layer


def diagram_svg(d: Diagram, *, max_boxes: int = 400) -> str:
    """An SVG string of ``d``; diagrams over ``max_boxes`` boxes draw as a summary card."""
    n = len(d.boxes)
    if n > max_boxes:
        names: dict[str, int] = {}
        for b in d.boxes:
            names[b.name] = names.get(b.name, 0) + 1
        rows = "".join(
            f'<text x="{MARGIN}" y="{MARGIN + 40 + 16 * i}" font-size="12">{escape(k)} × {v}</text>'
            for i, (k, v) in enumerate(sorted(names.items())))
        h = MARGIN * 2 + 40 + 16 * len(names)
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="360" height="{h}">'
                f'<text x="{MARGIN}" y="{MARGIN + 12}" font-size="14" font-weight="bold">'
                f'{n} boxes (too many to draw; counts by name)</text>{rows}</svg>')
    layer = _layers(d)
    depth = max(layer, default=0) + 1
    by_layer: dict[int, list[int]] = {}
    for j, lv in enumerate(layer):
        by_layer.setdefault(lv, []).append(j)
    width_slots = max([len(v) for v in by_layer.values()] + [len(d.dom), len(d.cod), 1])
    width = MARGIN * 2 + width_slots * (BOX_W + GAP_X)
    height = MARGIN * 2 + (depth + 1) * (BOX_H + GAP_Y)

    def row_y(lv: int) -> float:
        return MARGIN + lv * (BOX_H + GAP_Y)

    def slot_x(i: int, count: int) -> float:
        span = count * (BOX_W + GAP_X)
        return (width - span) / 2 + i * (BOX_W + GAP_X) + GAP_X / 2

    pos: dict[int, tuple[float, float]] = {}
    for lv, js in by_layer.items():
        for i, j in enumerate(js):
            pos[j] = (slot_x(i, len(js)), row_y(lv))

    def out_port(src: tuple[int, int]) -> tuple[float, float]:
        s, p = src
        if s < 0:
            x = slot_x(p, max(len(d.dom), 1)) + BOX_W / 2
            return x, MARGIN + 6
        x, y = pos[s]
        m = len(d.boxes[s].cod)
        return x + BOX_W * (p + 1) / (m + 1), y + BOX_H

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
             f'font-family="sans-serif">']
    for k, t in enumerate(d.dom):
        x = slot_x(k, max(len(d.dom), 1)) + BOX_W / 2
        parts.append(f'<text x="{x:.1f}" y="{MARGIN:.1f}" font-size="10" text-anchor="middle">'
                     f'in{k}: {escape(str(t))}</text>')

    def wire(a: tuple[float, float], b: tuple[float, float], label: str) -> None:
        (x1, y1), (x2, y2) = a, b
        my = (y1 + y2) / 2
        parts.append(f'<path d="M{x1:.1f},{y1:.1f} C{x1:.1f},{my:.1f} {x2:.1f},{my:.1f} '
                     f'{x2:.1f},{y2:.1f}" fill="none" stroke="#555"/>')
        parts.append(f'<text x="{(x1 + x2) / 2 + 3:.1f}" y="{my:.1f}" font-size="8" '
                     f'fill="#777">{escape(label)}</text>')

    for j, srcs in enumerate(d.wiring):
        x, y = pos[j]
        for i, src in enumerate(srcs):
            target = (x + BOX_W * (i + 1) / (len(srcs) + 1), y)
            wire(out_port(src), target, str(d.source_type(src)))
    out_y = row_y(depth)
    for k, src in enumerate(d.outputs):
        x = slot_x(k, max(len(d.cod), 1)) + BOX_W / 2
        wire(out_port(src), (x, out_y), str(d.source_type(src)))
        parts.append(f'<text x="{x:.1f}" y="{out_y + 14:.1f}" font-size="10" '
                     f'text-anchor="middle">out{k}</text>')
    for j, box in enumerate(d.boxes):
        x, y = pos[j]
        parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{BOX_W}" height="{BOX_H}" rx="4" '
                     f'fill="#eef3fb" stroke="#2b5797"/>')
        parts.append(f'<text x="{x + BOX_W / 2:.1f}" y="{y + BOX_H / 2 + 4:.1f}" font-size="12" '
                     f'text-anchor="middle">{escape(box.name)}</text>')
    parts.append("</svg>")
    return "".join(parts)

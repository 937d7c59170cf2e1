"""A functor as HTML for Jupyter: its stages, and its object and arrow maps on given generators.

A functor's maps may be callables, so a display cannot list them in general; it shows what it
can name: each stage's maps (a mapping's entries, a callable's name), and, for generators
passed in, the image of each type and each box — after every stage, for a composite — with
the error where a box has no image (a point a class does not realize, say).

>>> from metrale.lkb.dtype import BF16, F32
>>> from metrale.lkb.diagram import Box
>>> from metrale.lkb.functor import Functor
>>> from metrale.lkb.ty import TensorType, Ty
>>> x = TensorType(("n",), BF16)
>>> X, Y = Ty(x), Ty(TensorType(("n",), F32))
>>> F = Functor("C", "D", ob={x: Y}, ar=lambda b: Box(b.name.upper(), Y, Y).diagram, name="up")
>>> html = functor_html(F, [Box("f", X, X)])
>>> "<b>up</b>: C → D" in html, "<td><code>F</code></td>" in html, "f32[n]" in html
(True, True, True)

A box without an image shows why, in place of its image:

>>> "no image" in functor_html(Functor("C", "C", ar={}, name="empty"), [Box("f", X, X)])
True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .diagram import Box, Diagram
from .drawing import diagram_svg
from .errors import MetraleError
from .functor import Functor, Stage
from .html_table import badge, code, esc, table
from .ty import TensorType, Ty

LIMIT = 24
"""Rows shown per map before "… N more"."""


def _describe(m: Any, what: str) -> str:
    if m is None:
        return "identity"
    if isinstance(m, Mapping):
        return f"a mapping of {len(m)} {what}"
    name = getattr(m, "__qualname__", None) or type(m).__name__
    return f"callable <code>{esc(name)}</code>"


def _stage_rows(F: Functor) -> list[list[str]]:
    return [[str(i), esc(s.name or "—"), _describe(s.ob, "types"), _describe(s.ar, "boxes")]
            for i, s in enumerate(F.stages)]


def _image(stage: Stage, x: Diagram) -> Diagram:
    return stage.on_diagram(x)


def _show_diagram(d: Diagram, draw: bool) -> str:
    kernels = [b.param("kernel") for b in d.boxes if b.param("kernel") is not None]
    text = code(d) + (f" <small>({len(d.boxes)} boxes)</small>" if len(d.boxes) != 1 else "")
    if kernels:
        text += "<br><small>" + "<br>".join(esc(k) for k in kernels[:4]) + "</small>"
    if draw and 0 < len(d.boxes) <= 12:
        text += "<br>" + diagram_svg(d, engine="python")
    return text


def _generator_label(b: Box | Diagram) -> str:
    if isinstance(b, Box):
        params = ", ".join(f"{k}={v}" for k, v in b.params)
        return (f"<b>{esc(b.name)}</b>" + (f"<br><small>{esc(params)}</small>" if params else "")
                + f"<br><small>{esc(b.dom)} → {esc(b.cod)}</small>")
    return code(b)


def functor_html(F: Functor, generators: Sequence[Box | Diagram] = (), *, limit: int = LIMIT,
                 draw: bool = False) -> str:
    """The display of ``F``: name, dom → cod, stages; with ``generators``, the object map on
    their types and the arrow map on them (the image after each stage of a composite), the
    first ``limit`` of each; ``draw`` adds a drawing of each small image."""
    title = f"<b>{esc(F.name or 'Functor')}</b>: {esc(F.dom)} → {esc(F.cod)}"
    parts = [f"<div>{title}"]
    if not F.stages:
        parts.append(" <small>(the identity: no stages)</small>")
    else:
        parts.append(table(["stage", "name", "object map", "arrow map"], _stage_rows(F)))
    if not generators:
        named = _named_entries(F, limit)
        if named:
            parts.append(named)
        return "".join(parts) + "</div>"
    gens = list(generators)
    types: list[TensorType] = []
    for g in gens:
        for t in (*g.dom, *g.cod):
            if t not in types:
                types.append(t)
    ob_rows = []
    for t in types[:limit]:
        try:
            img = esc(F(Ty(t)))
        except MetraleError as e:
            img = badge(e.message, "bad")
        ob_rows.append([code(t), img])
    parts.append(table(["type", "image"], ob_rows, caption=f"object map on {len(types)} types"
                       + _more(len(types), limit)))
    stages = F.stages if len(F.stages) > 1 else F.stages[-1:] if F.stages else ()
    heads = ["generator"] + ([f"after {esc(s.name or f'stage {i}')}" for i, s in
                              enumerate(stages)] if len(stages) > 1 else ["image"])
    ar_rows = []
    for g in gens[:limit]:
        x = g.diagram if isinstance(g, Box) else g
        row = [_generator_label(g)]
        for s in stages:
            try:
                x = _image(s, x)
                row.append(_show_diagram(x, draw))
            except MetraleError as e:
                row.append(badge(f"no image: {e.message}", "bad"))
                row += ["—"] * (len(heads) - len(row))
                break
        if not stages:
            row.append(_show_diagram(x, draw))
        ar_rows.append(row)
    parts.append(table(heads, ar_rows, caption=f"arrow map on {len(gens)} generators"
                       + _more(len(gens), limit)))
    return "".join(parts) + "</div>"


def _more(total: int, limit: int) -> str:
    return f" (first {limit} shown)" if total > limit else ""


def _named_entries(F: Functor, limit: int) -> str:
    """The entries of a one-stage functor's mappings (what it names without being given)."""
    if len(F.stages) != 1:
        return ""
    s = F.stages[0]
    out = []
    if isinstance(s.ob, Mapping) and s.ob:
        rows = [[code(k), esc(v)] for k, v in list(s.ob.items())[:limit]]
        out.append(table(["type", "image"], rows, caption=f"object map ({len(s.ob)} types)"
                         + _more(len(s.ob), limit)))
    if isinstance(s.ar, Mapping) and s.ar:
        rows = [[_generator_label(k), code(v)] for k, v in list(s.ar.items())[:limit]]
        out.append(table(["generator", "image"], rows, caption=f"arrow map ({len(s.ar)} boxes)"
                         + _more(len(s.ar), limit)))
    return "".join(out)

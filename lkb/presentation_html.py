"""The presentation as HTML for Jupyter: a generators table and a relations table.

>>> from metrale.lkb.presentation import Presentation
>>> html = presentation_html(Presentation.load())
>>> html.count("<table") == 2 and "add_rmsnorm" in html
True
"""

from __future__ import annotations

from html import escape
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .presentation import Presentation


def _row(cells: list[str], tag: str = "td") -> str:
    return "<tr>" + "".join(f"<{tag}>{c}</{tag}>" for c in cells) + "</tr>"


def presentation_html(P: Presentation) -> str:
    """Generators (family, signature, parameters, points, row-invariance) and relations."""
    gens = [_row(["family", "signature", "parameters", "points", "row-invariant"], "th")]
    for f in P.generators:
        sig = escape(", ".join(map(str, f.inputs)) + " → " + ", ".join(map(str, f.outputs)))
        params = escape("; ".join(f"{k} ∈ {{{', '.join(map(str, v))}}}" for k, v in f.params))
        gens.append(_row([f"<b>{escape(f.name)}</b><br><small>{escape(f.doc)}</small>", sig,
                          params, str(len(f.points)), "yes" if f.row_invariant else "no"]))
    rels = [_row(["relation", "lhs", "rhs", "numerics"], "th")]
    for r in P.relations:
        numerics = r.numerics if r.bound is None else \
            f"bounded (rel {escape(r.bound.rel)}, abs {escape(r.bound.abs)})"
        rels.append(_row([f"<b>{escape(r.name)}</b>", f"<code>{escape(r.lhs.text)}</code>",
                          f"<code>{escape(r.rhs.text)}</code>", numerics]))
    return (f"<div><h4>LKB: {len(P.generators)} generators, {len(P.relations)} relations</h4>"
            f"<table>{''.join(gens)}</table><table>{''.join(rels)}</table></div>")

"""Small HTML builders shared by the Jupyter displays: tables, badges, collapsible sections.

Cells are given as HTML (callers escape text with :func:`esc`); output is deterministic, so the
displays built from it can be pinned by exact-string tests.

>>> table(["a", "b"], [[esc("x<y"), "1"]])[len(STYLE):]
'<table class="metrale"><tr><th>a</th><th>b</th></tr><tr><td>x&lt;y</td><td>1</td></tr></table>'
>>> badge("exact", "ok")
'<span style="background:#dcead7;border-radius:3px;padding:0 4px">exact</span>'
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from html import escape

STYLE = ("<style>table.metrale td, table.metrale th "
         "{text-align: left !important; vertical-align: top}</style>")
"""Jupyter right-aligns table cells (a rule more specific than a class); text reads better
left-aligned, so this rule is marked important."""

TONES = {"ok": "#dcead7", "warn": "#fbe9d7", "bad": "#f6d5d5", "info": "#eef3fb", "": "#eeeeee"}


def esc(value: object) -> str:
    """``str(value)``, escaped for HTML text."""
    return escape(str(value))


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], *, caption: str = "") -> str:
    """An HTML table; ``headers`` and cells are HTML already."""
    head = "<tr>" + "".join(f"<th>{h}</th>" for h in headers) + "</tr>"
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    cap = f"<caption>{caption}</caption>" if caption else ""
    return f'{STYLE}<table class="metrale">{cap}{head}{body}</table>'


def badge(text: str, tone: str = "") -> str:
    """A coloured label (``tone``: ok, warn, bad, info or plain)."""
    return (f'<span style="background:{TONES.get(tone, TONES[""])};border-radius:3px;'
            f'padding:0 4px">{esc(text)}</span>')


def details(summary: str, body: str, *, open_: bool = False) -> str:
    """A collapsible section (HTML ``<details>``); ``summary`` and ``body`` are HTML."""
    return f"<details{' open' if open_ else ''}><summary>{summary}</summary>{body}</details>"


def code(text: object) -> str:
    """Escaped text in ``<code>``."""
    return f"<code>{esc(text)}</code>"

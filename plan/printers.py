"""Printers of a plan: a text table, a stable JSON document, Graphviz DOT, and HTML with SVG.

The JSON schema (``schema: "metrale.plan/1"``) is documented in docs/plan-json.md; its keys
only grow. Large plans draw collapsed by layer: one row per layer, the kernel sequence of the
first layer drawn once (``layer=`` expands another).
"""

from __future__ import annotations

import math
from collections import Counter
from html import escape
from io import StringIO
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape as escape_markup
from rich.table import Table

if TYPE_CHECKING:
    from .plan import Plan, PlannedKernel

SCHEMA = "metrale.plan/1"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n} B"  # pragma: no cover


def summary_lines(p: Plan) -> list[str]:
    """The totals: kernel count, bytes moved, floor, numerics, row-invariance."""
    per_layer = Counter(k.layer for k in p.launches if k.layer is not None)
    max_layer = max(per_layer.values(), default=0)
    bound = ("" if p.bound is None else
             " (per-kernel bound: not stated; a bit-identical relation applied where its sides "
             "declare different orders)" if math.isinf(p.bound[0]) else
             f" (per-kernel bound: rel {p.bound[0]:.3g}, abs {p.bound[1]:.3g} × magnitude)")
    ranks = dict(p.sizes).get("ranks", 1)
    sharded = [] if ranks == 1 else [
        f"tensor parallel: one rank of {ranks} (heads, MLP and vocabulary split); "
        f"{sum(k.family in ('rank_sum', 'all_reduce') for k in p.kernels)} all-reduces (summed in "
        "rank order, f32): the unsharded step within a reordered sum"]
    return [
        f"plan {p.target} {p.mode} rows={p.rows} context={p.context} act={p.act} "
        f"policy={p.policy}" + (f" logits={p.logits}" if p.logits != "all" else ""),
        f"kernels: {p.kernel_count} launches ({max_layer} per decoder layer at most), "
        f"{len(p.applied)} fusions applied, {len(p.declined)} declined",
        f"bytes moved per step: {_fmt_bytes(p.bytes_moved)}; floor on {p.device} at "
        f"{_fmt_bytes(p.bandwidth)}/s: {p.floor_s * 1e3:.3f} ms",
        f"numerics: {'exact' if p.exact else 'bounded'}{bound}; "
        f"row-invariant: {'yes' if p.row_invariant else 'no'}",
        *sharded,
    ]


def _kernel_rows(p: Plan, layer: int | None) -> list[PlannedKernel]:
    """Non-layer kernels and the kernels of one layer (layer 0 by default)."""
    want = 0 if layer is None else layer
    return [k for k in p.launches if k.layer is None or k.layer == want]


def plan_text(p: Plan, *, layer: int | None = None, width: int = 140) -> str:
    """A rich table of the kernels (the first layer and the rest of the step), then totals."""
    t = Table(title=f"{p.target} — layer {0 if layer is None else layer} shown; every layer "
              "launches the same kernels" if p.target else "")
    for col in ("#", "kernel", "point", "provenance", "evidence", "numerics", "bytes"):
        t.add_column(col, overflow="fold")
    for k in _kernel_rows(p, layer):
        params = ",".join(f"{a}={b}" for a, b in k.point.params)
        t.add_row(str(k.index), k.label, params, k.provenance, k.evidence,
                  k.numerics + ("" if k.row_invariant else ", not row-invariant"),
                  _fmt_bytes(k.bytes_moved))
    out = StringIO()
    console = Console(file=out, width=width, color_system=None, soft_wrap=False)
    console.print(t)
    for line in summary_lines(p):
        console.print(line, markup=False)
    return out.getvalue()


def plan_json(p: Plan) -> dict[str, Any]:
    """A JSON-ready dict with a stable schema (keys sorted when dumped)."""
    return {
        "schema": SCHEMA,
        "target": {"hw": p.target.hw, "model": p.target.model, "quant": p.target.quant},
        "mode": p.mode, "rows": p.rows, "context": p.context, "act": p.act, "policy": p.policy,
        "logits": p.logits,
        "device": p.device, "bandwidth_bytes_per_s": p.bandwidth,
        "kernel_count": p.kernel_count, "bytes_moved": p.bytes_moved, "floor_s": p.floor_s,
        "exact": p.exact, "row_invariant": p.row_invariant,
        "bound": None if p.bound is None else {
            "stated": not math.isinf(p.bound[0]),
            "rel": None if math.isinf(p.bound[0]) else p.bound[0],
            "abs_times_magnitude": None if math.isinf(p.bound[1]) else p.bound[1],
            "scope": "per kernel"},
        "kernels": [{
            "index": k.index, "family": k.family, "point": str(k.point),
            "params": {a: b for a, b in k.point.params}, "layer": k.layer,
            "inputs": list(k.inputs), "outputs": list(k.outputs),
            "entry": (k.launched[0] if k.launched
                      else None if k.kernel is None else k.kernel.entry),
            "then": list(k.launched[1:]),
            "source": None if k.kernel is None else k.kernel.source,
            "provenance": k.provenance, "shadow": k.shadow, "residual": k.residual,
            "evidence": k.evidence, "relation": k.relation, "numerics": k.numerics,
            "row_invariant": k.row_invariant, "bytes_moved": k.bytes_moved, "view": k.view,
            "cost": None if k.cost is None else {"us": k.cost.us, "source": k.cost.source,
                                                 "kind": k.cost.kind},
        } for k in p.kernels],
        "buffers": [{"name": b.name, "shape": list(b.type.shape), "dtype": str(b.type.dtype),
                     "format": b.type.fmt or None, "bytes": b.nbytes, "kind": b.kind,
                     "first": b.first, "last": b.last, "alias": b.alias} for b in p.buffers],
        "applied": [{"relation": a.relation, "boxes": list(a.boxes), "fused": a.fused.name,
                     "numerics": a.numerics} for a in p.applied],
        "declined": [{"relation": d.relation, "boxes": list(d.boxes),
                      "families": list(d.families), "reason": d.reason} for d in p.declined],
        "predicted_us": p.predicted_us, "cost_device": p.cost_device,
        "cost_sources": dict(sorted(Counter(k.cost.kind for k in p.kernels
                                            if k.cost is not None).items())),
        "search": _search_json(p),
    }


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _search_json(p: Plan) -> dict[str, Any] | None:
    c = p.choice
    if c is None:
        return None
    return {"bucket": c.bucket, "shape": c.shape,
            "shapes": {s: _finite(us) for s, us in c.shapes},
            "cut_predicted_us": _finite(c.predicted_us), "rewrites": c.rewrites,
            "note": c.note or None,
            "sites": [{"relations": list(x.relations), "skipped": list(x.skipped),
                       "alternatives": x.alternatives, "cost_us": _finite(x.cost_us),
                       "priority_us": _finite(x.priority_us)} for x in c.sites]}


_KIND = {"measured": "measured", "model": "by the model", "view": "views"}


def plan_costs_text(p: Plan, *, layer: int | None = None, width: int = 160) -> str:
    """The predicted microseconds of each launch (the step's first layer and the rest), where
    each number came from, the per-layer and step totals, and what the search chose."""
    t = Table(title=f"{p.target} {p.mode} rows={p.rows} (bucket {p.bucket}) — predicted cost, "
              f"layer {0 if layer is None else layer} shown")
    for col in ("#", "kernel", "µs", "source"):
        t.add_column(col, overflow="fold")
    for k in _kernel_rows(p, layer):
        t.add_row(str(k.index), escape_markup(k.label),
                  "" if k.cost is None else f"{k.cost.us:.2f}",
                  "" if k.cost is None else escape_markup(k.cost.source))
    out = StringIO()
    console = Console(file=out, width=width, color_system=None, soft_wrap=False)
    console.print(t)
    per_layer = Counter()
    for k in p.launches:
        if k.layer is not None and k.cost is not None:
            per_layer[k.layer] += k.cost.us
    kinds = Counter(k.cost.kind for k in p.launches if k.cost is not None)
    lines = [f"predicted step: {p.predicted_us:.1f} µs on {p.cost_device} "
             f"({', '.join(f'{n} {_KIND[kind]}' for kind, n in sorted(kinds.items()))}); "
             f"memory floor {p.floor_s * 1e6:.1f} µs"]
    if per_layer:
        lo, hi = min(per_layer.values()), max(per_layer.values())
        lines.append(f"per decoder layer: {lo:.2f} µs"
                     + (f" to {hi:.2f} µs" if f"{hi:.2f}" != f"{lo:.2f}" else ""))
    c = p.choice
    if c is not None:
        shapes = ", ".join(f"{s} {us:.1f} µs" if math.isfinite(us) else f"{s} not runnable"
                           for s, us in c.shapes)
        lines.append(f"search (two-layer cut, bucket {c.bucket}): matmul point {c.shape} "
                     f"[{shapes}]; {len(c.sites)} sites, {c.rewrites} rewrites")
        for x in c.sites:
            if x.skipped:
                lines.append(f"  chose without {', '.join(x.skipped)} among "
                             f"{', '.join(sorted(set(x.relations)))}: {x.cost_us:.2f} µs "
                             f"against {x.priority_us:.2f} µs by priority")
        if c.note:
            lines.append(f"  note: {c.note}")
    for line in lines:
        console.print(line, markup=False)
    return out.getvalue()


def plan_dot(p: Plan) -> str:
    """Graphviz DOT of the launched kernels and the activations between them."""
    lines = ["digraph plan {", "  rankdir=TB; node [shape=box, fontname=Helvetica];"]
    producer: dict[str, int] = {}
    for k in p.kernels:
        for o in k.outputs:
            producer[o] = k.index
    for k in p.kernels:
        style = ', style=filled, fillcolor="#dcead7"' if k.relation else ""
        shape = ", shape=ellipse" if k.view else ""
        lines.append(f'  k{k.index} [label="{k.family}\\n{k.layer if k.layer is not None else ""}"'
                     f"{style}{shape}];")
    for k in p.kernels:
        for i in k.inputs:
            if i in producer:
                lines.append(f"  k{producer[i]} -> k{k.index};")
    lines.append("}")
    return "\n".join(lines)


def plan_svg(p: Plan, *, layer: int | None = None) -> str:
    """The kernel graph collapsed by layer: step prologue, one expanded layer, the epilogue,
    and one summary row per other layer (never hundreds of boxes)."""
    rows = []
    pre = [k for k in p.launches if k.layer is None and k.index < _first_layer_index(p)]
    post = [k for k in p.launches if k.layer is None and k.index >= _first_layer_index(p)]
    layers = sorted({k.layer for k in p.launches if k.layer is not None})
    show = layers[0] if layer is None and layers else layer
    rows.append(("step", pre))
    for lv in layers:
        ks = p.layer_kernels(lv)
        rows.append((f"layer {lv}", ks if lv == show else None if lv != show else ks))
    rows.append(("head", post))
    box_h, gap, pad = 26, 8, 10

    def box_w(k: PlannedKernel) -> int:  # room for the family's name at 11 px (~6.5 px a letter)
        return max(118, math.ceil(6.5 * len(k.family)) + 12)

    widest = max([sum(box_w(k) + gap for k in ks) for _, ks in rows if ks] + [118 + gap])
    width = pad * 2 + 80 + widest
    parts = []
    y = pad
    for name, ks in rows:
        parts.append(f'<text x="{pad}" y="{y + 17}" font-size="11">{escape(name)}</text>')
        if ks is None:
            count = len(p.layer_kernels(int(name.split()[1])))
            parts.append(f'<text x="{pad + 80}" y="{y + 17}" font-size="11" fill="#666">'
                         f'{count} kernels, as layer {show} (collapsed)</text>')
            y += 20
            continue
        x = pad + 80
        for k in ks:
            fill = "#dcead7" if k.relation else "#eef3fb"
            w = box_w(k)
            parts.append(f'<rect x="{x}" y="{y}" width="{w}" height="{box_h}" rx="3" '
                         f'fill="{fill}" stroke="#2b5797"><title>{escape(str(k.point))}\n'
                         f'{escape(k.provenance)}; {escape(k.evidence)}</title></rect>')
            parts.append(f'<text x="{x + w / 2}" y="{y + 17}" font-size="11" '
                         f'text-anchor="middle">{escape(k.family)}</text>')
            x += w + gap
        y += box_h + gap
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y + pad}" '
            f'font-family="sans-serif">{"".join(parts)}</svg>')


def _first_layer_index(p: Plan) -> int:
    layered = [k.index for k in p.launches if k.layer is not None]
    return min(layered) if layered else 0


def plan_html(p: Plan, *, layer: int | None = None) -> str:
    """The Jupyter display: totals, the kernel table of one layer, the collapsed graph, and
    the declined fusions with their reasons."""
    head = "".join(f"<div>{escape(line)}</div>" for line in summary_lines(p))
    rows = "".join(
        f"<tr><td>{k.index}</td><td>{escape(k.label)}</td><td><code>{escape(str(k.point))}"
        f"</code></td><td>{escape(k.provenance)}</td><td>{escape(k.evidence)}</td>"
        f"<td>{k.numerics}</td><td>{_fmt_bytes(k.bytes_moved)}</td></tr>"
        for k in _kernel_rows(p, layer))
    reasons = Counter((d.relation, d.reason) for d in p.declined)
    declined = "".join(f"<li><b>{escape(r)}</b> ×{n}: {escape(why)}</li>"
                       for (r, why), n in sorted(reasons.items()))
    return (f"<div>{head}<table><tr><th>#</th><th>kernel</th><th>point</th><th>provenance</th>"
            f"<th>evidence</th><th>numerics</th><th>bytes</th></tr>{rows}</table>"
            f"{plan_svg(p, layer=layer)}<h4>declined fusions</h4><ul>{declined}</ul></div>")

"""Jupyter displays of the realization layer: hardware classes and Hw, F_H, residual, evidence.

Each function returns an HTML string (deterministic for the same kernels tree); the classes'
``_repr_html_`` methods call them. A class shows its chain, the capabilities of every class in
it and what each one supplies to its realization (tables, sources, points realized from its
folder); Hw draws as its Hasse diagram; F_H shows its arrow map on every compiled point of
the presentation, with what is residual and why a point is not realized.

>>> from metrale.realize.hardware import load_hardware
>>> html = hardware_html(load_hardware().get("sm_90"))
>>> "sm_90 → sm_80 → cuda" in html and "wgmma" in html and "supplies" in html
True
>>> from metrale.realize.residual import residual
>>> "Residual(sm_90): 34" in residual_html(residual("sm_90"))
True
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from metrale.lkb.drawing import Edge, Node, PortGraph, graph_svg
from metrale.lkb.errors import MetraleError
from metrale.lkb.html_table import badge, code, details, esc, table

CAPABILITY_COLUMNS = ("bf16", "fp8", "fp4", "tensor_core", "max_shared_mem_per_block",
                      "max_threads_per_block", "warp_size", "compute_capability")


def _root(hw: Any, kernels_dir: Path | str | None) -> Path:
    from metrale.realize.hardware import default_kernels_dir

    if kernels_dir is not None:
        return Path(kernels_dir)
    if getattr(hw, "file", None) is not None:
        return Path(hw.file).parent.parent
    return default_kernels_dir()


def _cap(value: Any) -> str:
    if isinstance(value, bool):
        return badge("yes", "ok") if value else badge("no")
    if isinstance(value, tuple):
        return esc(".".join(map(str, value)))
    return esc("—" if value is None else value)


def hardware_html(hw: Any, *, kernels_dir: Path | str | None = None) -> str:
    """One hardware class: device, chain, capabilities along the chain, and what each class
    of the chain supplies to F_H (kernel tables, source files, points realized from it)."""
    from metrale.realize.compute import target_for
    from metrale.realize.functor import realization
    from metrale.realize.hardware import load_hardware

    root = _root(hw, kernels_dir)
    registry = load_hardware(root)
    chain = registry.chain(hw.name)
    dev = hw.device
    head = (f"<div><b>{esc(hw.name)}</b> ({esc(hw.vendor.value)}, arch "
            f"{esc(hw.arch or 'none')}): device {esc(dev.name)}, "
            f"{dev.hbm_bandwidth_gbs:g} GB/s{' (nominal)' if dev.nominal else ''}"
            + "".join(f"; peer {esc(p.name)}, {p.hbm_bandwidth_gbs:g} GB/s"
                      f"{' (nominal)' if p.nominal else ''}" for p in hw.peers)
            + f"<br>chain: {' → '.join(esc(c.name) for c in chain)}</div>")
    caps = table(["class", *CAPABILITY_COLUMNS],
                 [[esc(c.name), *(_cap(getattr(c.capabilities, k)) for k in CAPABILITY_COLUMNS)]
                  for c in chain], caption="capabilities along the chain")
    try:
        F = realization(hw.name, kernels_dir=root)
    except MetraleError as e:
        return head + caps + badge(f"F_{hw.name} cannot be built: {e}", "bad")
    supplied = Counter(k.provenance for k in F.kernels())
    ext = target_for(hw.vendor).source_extension
    rows = []
    for folder in F.folders:
        path = root / folder.path
        sources = sorted(p.name for p in path.glob(f"*{ext}")) if path.is_dir() else []
        rows.append([esc(folder.owner), code(folder.path), str(len(folder.tables)),
                     str(len(sources)), str(supplied.get(folder.owner, 0))])
    total = len(F.presentation.points())
    supplies = table(["class", "folder", "kernel tables", "sources", "points realized"], rows,
                     caption=f"what each class supplies: {sum(supplied.values())} of {total} "
                             f"compiled points realized on {esc(hw.name)}")
    return head + caps + supplies


def hardware_registry_html(registry: Any) -> str:
    """Hw: its Hasse diagram (a class below each class it inherits) and a row per class."""
    names = list(registry.names)
    children: dict[str, list[str]] = {n: [] for n in names}
    for c in registry.classes:
        for parent in c.inherits:
            children[parent].append(c.name)
    nodes = tuple(Node(c.name, len(c.inherits), len(children[c.name]), "box",
                       title=f"{c.name}: {c.vendor.value}, arch {c.arch or 'none'}, "
                             f"tensor cores {c.capabilities.tensor_core}")
                  for c in registry.classes)
    index = {n: i for i, n in enumerate(names)}
    edges = tuple(Edge((index[p], children[p].index(c.name)), (index[c.name], i))
                  for c in registry.classes for i, p in enumerate(c.inherits))
    svg = graph_svg(PortGraph(nodes, edges), engine="python")
    rows = [[esc(c.name), esc(c.vendor.value), esc(c.arch or "none"),
             esc(" → ".join(x.name for x in registry.chain(c.name))),
             esc(c.capabilities.tensor_core), esc(c.device.name)] for c in registry.classes]
    return (f"<div><b>Hw</b>: {len(names)} hardware classes (a line joins a class, below, to "
            f"a class it inherits)<br>{svg}"
            + table(["class", "vendor", "arch", "chain", "tensor cores", "device"], rows)
            + "</div>")


def realization_html(F: Any, *, open_families: bool = False) -> str:
    """F_H on the presentation's compiled points: per family, each point's kernel (entry,
    source, provenance, declared reductions), what is residual, and why a point is not
    realized; totals by providing class."""
    P = F.presentation
    supplied: Counter[str] = Counter()
    missing = residual = 0
    sections = []
    for fam in P.generators:
        if fam.view:
            sections.append(f"<div><b>{esc(fam.name)}</b>: {len(fam.points)} points, "
                            f"{badge('a view: no kernel, no launch', 'info')}</div>")
            continue
        rows = []
        for point in fam.points:
            k = F.realize(point)
            if k is None:
                missing += 1
                rows.append([code(point), badge("not realized", "bad"), esc(F.why_not(point)),
                             "", ""])
                continue
            supplied[k.provenance] += 1
            kind = k.residual_kind or ("shadow" if k.shadow else "")
            if kind:
                residual += 1
            res = (badge(kind, "warn") + f" {esc(k.residual_reason)}") if kind else ""
            src = code(k.source) if k.source else "reference semantics"
            rows.append([code(point), code(k.entry), src, esc(k.provenance),
                         esc("; ".join(k.reduction) or "none") + (f"<br>{res}" if res else "")])
        realized = sum(1 for r in rows if "not realized" not in r[1])
        summary = (f"<b>{esc(fam.name)}</b>: {realized}/{len(fam.points)} points"
                   + (f" {badge(f'{len(fam.points) - realized} not realized', 'bad')}"
                      if realized < len(fam.points) else ""))
        sections.append(details(summary, table(
            ["point", "entry", "source", "provenance", "reductions / residual"], rows),
            open_=open_families))
    by = ", ".join(f"{n} from {esc(c)}" for c, n in sorted(supplied.items()))
    head = (f"<div><b>F_{esc(F.name)}</b>: LKB → Impl_{esc(F.name)}; chain "
            f"{' → '.join(esc(c.name) for c in F.chain)}"
            + (f"; target {esc(F.target)}" if F.target else "")
            + f"<br>{sum(supplied.values())} of {len(P.points())} compiled points realized"
            f" ({by}); {missing} not realized; {residual} residual</div>")
    return head + "".join(sections)


def residual_html(r: Any) -> str:
    """Residual(H): the count by kind, then every entry with its reason and evidence."""
    kinds = ", ".join(f"{n} {esc(k)}" for k, n in r.by_kind().items())
    head = f"<div><b>Residual({esc(r.hw)}): {r.count}</b> ({kinds})</div>"
    if not r.entries:
        return head + ("<div>Nothing outside the shared image of F_H: every kernel this class "
                       "uses is an inherited, shared one.</div>")
    rows = [[badge(e.kind, "warn"), code(e.name), code(e.file), esc(e.reason),
             _evidence_badge(e.evidence)] for e in r.entries]
    return head + table(["kind", "name", "file", "reason", "evidence"], rows)


def _evidence_badge(status: str) -> str:
    from metrale.realize.evidence import SHARED, STALE, UNREADABLE

    tone = ("warn" if status in (STALE, SHARED) else "bad" if status == UNREADABLE
            else "ok" if status.startswith("measured on") else "")
    return badge(status, tone)


def evidence_html(load: Any) -> str:
    """An evidence load: its records (class, device, family, point, metric, value against
    the floor, date, toolchain, source hash) and every error, with where it is."""
    rows = []
    for r in load.records:
        vs = f"{r.value:g} {esc(r.unit)}" + ("" if r.floor is None else
                                            f" (floor {r.floor:g}, {r.floor / r.value:.0%})")
        rows.append([esc(r.hw), esc(r.device), esc(r.family), code(r.point), esc(r.metric), vs,
                     esc(r.date), esc(r.toolchain), code(r.source_hash[:12])])
    out = (f"<div><b>evidence</b>: {len(load.records)} records"
           + (f", {badge(f'{len(load.errors)} errors', 'bad')}" if load.errors else "")
           + "</div>")
    if rows:
        out += table(["class", "device", "family", "point", "metric", "value", "date",
                      "toolchain", "source"], rows)
    if load.errors:
        out += "<ul>" + "".join(f"<li>{esc(e)}</li>" for e in load.errors) + "</ul>"
    return out


def relations_html(found: Any) -> str:
    """Relations on one class (``realize.relations.relations_on``): status and reason each."""
    tone = {"bit_identical": "ok", "bounded": "warn", "differs": "bad", "not realized": "bad",
            "mixed": "warn"}
    rows = [[f"<b>{esc(r.relation.name)}</b>", code(r.relation.lhs.text),
             code(r.relation.rhs.text), badge(r.status, tone.get(r.status, "")), esc(r.reason)]
            for r in found]
    hw = found[0].hw if found else "?"
    return table(["relation", "lhs", "rhs", f"on {esc(hw)}", "reason"], rows,
                 caption=f"{len(rows)} relations on {esc(hw)}")


def evidence_report_html(report: Any) -> str:
    """An evidence report: counts by status, then the kernels with a record or a problem;
    the shared, unmeasured ones collapsed."""
    from metrale.realize.evidence import SHARED

    counts = " ".join(_evidence_badge(s) + f" {n}" for s, n in report.counts().items())
    head = f"<div><b>evidence on {esc(report.hw)}</b>: {len(report.rows)} kernels {counts}</div>"

    def row(r: Any) -> list[str]:
        rec = "—"
        if r.record is not None:
            x = r.record
            rec = (f"{esc(x.metric)} {x.value:g} {esc(x.unit)}"
                   + ("" if x.floor is None else f", floor {x.floor:g} ({x.floor / x.value:.0%})")
                   + f", {esc(x.date)}, {esc(x.device)}")
        return [code(r.point), code(r.kernel), esc(r.provenance), _evidence_badge(r.status), rec]

    cols = ["point", "kernel", "provenance", "status", "latest record"]
    notable = [row(r) for r in report.rows if r.status != SHARED]
    shared = [row(r) for r in report.rows if r.status == SHARED]
    out = head
    if notable:
        out += table(cols, notable)
    if shared:
        out += details(f"{len(shared)} shared, unmeasured", table(cols, shared))
    if report.errors:
        out += "<ul>" + "".join(f"<li>{esc(e)}</li>" for e in report.errors) + "</ul>"
    return out

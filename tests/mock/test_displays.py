"""Jupyter displays: pinned drawings and HTML, layout properties, and large plans staying usable.

Snapshots (exact strings under tests/snapshots/) pin the pure-Python drawing of a small
diagram, the HTML of a small plan and the drawing of one of its layers; a change to a printer
shows as a diff there. ``METRALE_UPDATE_SNAPSHOTS=1`` rewrites them (then review the diff).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from hypothesis import given, settings

from metrale.lkb import Box, Diagram, Functor, TensorType, Ty
from metrale.lkb.drawing import diagram_graph, diagram_svg, has_graphviz, layered_layout
from metrale.lkb.dtype import BF16, F32
from metrale.lkb.errors import UnavailableError
from metrale.lkb.files import atomic_write
from metrale.lkb.functor_html import functor_html
from metrale.plan.display import layer_graph, layer_graph_svg, plan_diff_html, plan_view_html
from metrale.plan.plan import plan_for
from metrale.realize.display import hardware_html, realization_html, residual_html
from metrale.realize.evidence import EvidenceLoad, EvidenceRecord
from metrale.realize.evidence_report import evidence_report
from metrale.realize.functor import realization
from metrale.realize.hardware import load_hardware
from metrale.realize.residual import SHADOW, Residual, ResidualEntry
from metrale.testing import diagrams

SNAPSHOTS = Path(__file__).resolve().parents[1] / "snapshots"
X = Ty(TensorType(("rows", "hidden"), BF16))
W = Ty(TensorType(("hidden", "hidden"), BF16))


def matches_snapshot(name: str, text: str) -> None:
    path = SNAPSHOTS / name
    if os.environ.get("METRALE_UPDATE_SNAPSHOTS") == "1":
        atomic_write(path, text)
    assert path.is_file(), f"no snapshot {name}: run with METRALE_UPDATE_SNAPSHOTS=1"
    want = path.read_text(encoding="utf-8")
    assert text == want, f"{name} changed (METRALE_UPDATE_SNAPSHOTS=1 rewrites it)"


def small_diagram() -> Diagram:
    """add, then rmsnorm with a weight that skips a layer, then two outputs."""
    add, norm = Box("add", X @ X, X), Box("rmsnorm", X @ W, X)
    return (add @ Diagram.id(W)) >> norm >> Diagram.copy(X, 2)


@pytest.fixture(scope="module")
def tiny_plan():
    return plan_for("tiny-qwen3", "bf16", "host")


# -- snapshots ---------------------------------------------------------------------------------


def test_small_diagram_drawing_snapshot():
    matches_snapshot("diagram_small.svg", diagram_svg(small_diagram(), engine="python"))


def test_small_plan_html_snapshot(tiny_plan):
    matches_snapshot("plan_tiny_qwen3.html", tiny_plan._repr_html_())


def test_small_plan_layer_drawing_snapshot(tiny_plan):
    matches_snapshot("plan_tiny_qwen3_layer0.svg", layer_graph_svg(tiny_plan, 0, engine="python"))


# -- the drawing -------------------------------------------------------------------------------


def _numbers(svg: str, attr: str) -> list[float]:
    return [float(v) for v in re.findall(rf' {attr}="(-?[\d.]+)"', svg)]


def test_small_drawing_shows_ordered_ports_and_typed_wires():
    svg = diagram_svg(small_diagram(), engine="python")
    assert svg.count("<rect") == 2
    assert svg.count('class="port"') == 3 + (2 + 1) + (2 + 1) + 2  # terminals + box ports
    assert ">in2: bf16[hidden,hidden]</text>" in svg
    assert svg.count(">bf16[rows,hidden]</text>") == 2  # one label per box output
    # rmsnorm's ports 0 and 1 are numbered, left to right
    rms = re.search(r'<rect x="([\d.]+)" y="([\d.]+)" width="([\d.]+)"[^>]*><title>rmsnorm', svg)
    x, y, w = (float(v) for v in rms.groups())
    ports = [(float(a), float(b)) for a, b in
             re.findall(r'<circle class="port" cx="([\d.]+)" cy="([\d.]+)"', svg)]
    top = sorted(px for px, py in ports if abs(py - y) < 0.05 and x <= px <= x + w)
    assert len(top) == 2 and top[0] < top[1]


@settings(max_examples=25, deadline=None)
@given(diagrams(max_boxes=7))
def test_python_layout_is_complete_inside_and_deterministic(d):
    svg = diagram_svg(d, engine="python")
    assert svg == diagram_svg(d, engine="python")
    g = diagram_graph(d)
    assert svg.count("<rect") == len(d.boxes)
    assert svg.count('class="port"') == sum(n.inputs + n.outputs for n in g.nodes)
    assert svg.count("<path") >= len(g.edges)  # one segment per wire at least
    width, height = _numbers(svg, "width")[0], _numbers(svg, "height")[0]
    for cx in _numbers(svg, "cx"):
        assert 0 <= cx <= width
    for cy in _numbers(svg, "cy"):
        assert 0 <= cy <= height
    placed = layered_layout(g)
    for ins, outs, (x, y, w, h) in zip(placed.in_ports, placed.out_ports, placed.rects):
        # ports in port order, left to right, on the box's top and bottom edges
        for ports, edge in ((ins, y), (outs, y + h)):
            assert [px for px, _ in ports] == sorted(px for px, _ in ports)
            assert len({px for px, _ in ports}) == len(ports)
            assert all(x <= px <= x + w and py == edge for px, py in ports)
    for box in d.boxes:
        assert f">{box.name}</text>" in svg
    # boxes of one row never overlap
    rows: dict[float, list[tuple[float, float]]] = {}
    for node, (x, y, w, _) in zip(g.nodes, placed.rects):
        if node.kind == "box":
            rows.setdefault(y, []).append((x, x + w))
    for spans in rows.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_drawing_of_an_acyclic_graph_in_any_node_order():
    """Hw has parents after children alphabetically; the layout sorts topologically."""
    html = load_hardware()._repr_html_()
    assert html.count("<rect") == len(load_hardware().names)


def test_large_diagram_draws_as_a_summary():
    d = Diagram.then(*[Box("f", X, X).diagram] * 250)
    start = time.perf_counter()
    svg = diagram_svg(d)
    assert time.perf_counter() - start < 2.0
    assert "250 boxes (too many to draw" in svg and "f × 250" in svg and "<rect" not in svg


def test_graphviz_missing_is_a_clear_error(monkeypatch):
    import metrale.lkb.drawing_dot as dot

    monkeypatch.setattr(dot.shutil, "which", lambda name: None)
    with pytest.raises(UnavailableError, match="Graphviz is not installed"):
        diagram_svg(small_diagram(), engine="graphviz")
    monkeypatch.setattr("metrale.lkb.drawing.shutil.which", lambda name: None)
    assert diagram_svg(small_diagram()) == diagram_svg(small_diagram(), engine="python")


@pytest.mark.skipif(not has_graphviz(), reason="Graphviz dot is not installed")
def test_graphviz_engine_draws_the_same_elements():
    svg = diagram_svg(small_diagram(), engine="graphviz")
    assert svg.startswith('<svg xmlns="http://www.w3.org/2000/svg" width="')
    assert svg.count("<rect") == 2 and svg.count('class="port"') == 11
    assert ">in2: bf16[hidden,hidden]</text>" in svg and svg.count("<path") == 6  # one spline per wire


def test_relations_draw_both_sides_with_one_order_of_inputs_and_outputs():
    from metrale.lkb.presentation import Presentation
    from metrale.lkb.relation_drawing import side_graph

    P = Presentation.load()

    def terminals(g, kind):
        return [n.label for n in g.nodes if n.kind == kind]

    for rel in P.relations:
        lhs = side_graph(rel.lhs, rel.lhs.inputs, rel.outputs)
        rhs = side_graph(rel.rhs, rel.lhs.inputs, rel.outputs)
        assert terminals(lhs, "input") == terminals(rhs, "input") == list(rel.lhs.inputs)
        assert terminals(lhs, "output") == terminals(rhs, "output") == list(rel.outputs)
        assert lhs.boxes == len(rel.lhs.calls) and rhs.boxes == 1
    html = P.relation("qkv_concat")._repr_html_()
    assert html.count("<svg") == 2 and html.count(">linear</text>") == 3 and ">qkv</text>" in html
    assert "bounded" in P.relation("splitk_pairwise")._repr_html_()


# -- plans ---------------------------------------------------------------------------------------


def test_36_layer_plan_renders_collapsed_within_2_s():
    p = plan_for("qwen3-8b", "bf16", "sm_90")
    assert len({k.layer for k in p.launches if k.layer is not None}) == 36
    start = time.perf_counter()
    html = p._repr_html_()
    view = plan_view_html(p, layer=17)
    seconds = time.perf_counter() - start
    assert seconds < 2.0, f"{seconds:.2f} s"
    assert html.count("(collapsed)") == 35 and html.count("<rect") < 20
    assert view.count("(collapsed)") == 35 and "layer 17</b>: kernel dataflow" in view
    assert diagram_svg(p.diagram).count("<rect") == 0  # 435 boxes: the summary card


def test_every_kernel_name_fits_its_box_in_the_plan_drawing():
    """The collapsed drawing sizes each box to its family's name (Qwen3-0.6B's fused
    qk_norm_rope_kv_append_attention ran over its neighbour in a box of the common width), and
    the drawing is as wide as its widest row."""
    from metrale.plan.printers import plan_svg

    svg = plan_svg(plan_for("qwen3-0.6b", "bf16", "sm_90"))
    boxes = re.findall(r'<rect x="(\d+)" y="(\d+)" width="(\d+)".*?</rect><text x="([\d.]+)" '
                       r'y="\d+" font-size="11" text-anchor="middle">([^<]+)</text>', svg, re.S)
    assert boxes and any(name == "qk_norm_rope_kv_append_attention" for *_, name in boxes)
    for x, _, w, mid, name in boxes:
        assert int(w) >= 6.5 * len(name) + 12 and float(mid) == int(x) + int(w) / 2, name
    ends = [int(x) + int(w) for x, _, w, *_ in boxes]
    assert max(ends) <= int(re.search(r'<svg [^>]*width="(\d+)"', svg).group(1))
    rows: dict[str, list[tuple[int, int]]] = {}
    for x, y, w, *_ in boxes:
        rows.setdefault(y, []).append((int(x), int(w)))
    for row in rows.values():  # no box overlaps the next
        row.sort()
        assert all(a + w < b for (a, w), (b, _) in zip(row, row[1:])), row


def test_layer_graph_marks_fused_kernels_and_views(tiny_plan):
    ks = [k for k in tiny_plan.kernels if k.layer == 1]
    g = layer_graph(tiny_plan, 1)
    boxes = [n for n in g.nodes if n.kind == "box"]
    assert [n.label for n in boxes] == [k.family for k in ks]
    assert sum(n.style == "fused" for n in boxes) == sum(bool(k.relation) and not k.view
                                                        for k in ks) > 0
    assert sum(n.style == "view" for n in boxes) == sum(k.view for k in ks) > 0
    svg = layer_graph_svg(tiny_plan, 1, engine="python")
    assert svg.count('stroke-dasharray="4 3"') == sum(k.view for k in ks)
    assert ">q_proj</text>" in svg and "kv.1.k" in svg  # weights by module; caches by name


def test_plan_diff_display():
    a = plan_for("tiny-qwen3", "bf16", "host")
    html = a.diff(plan_for("tiny-qwen3", "fp8", "host"))._repr_html_()
    assert "only in host/tiny-qwen3/bf16" in html and "only in host/tiny-qwen3/fp8" in html
    assert "weight=fp8" in html and "weight=bf16" in html and "why" in html
    assert "the same kernels" in plan_diff_html(a.diff(a))


# -- functors, classes, residual, evidence ------------------------------------------------------


def test_functor_display_shows_maps_and_what_has_no_image():
    F = realization("sm_90")
    fam = F.presentation.family("split_heads")
    view = fam.box(fam.points[0])
    stranger = Box("not_a_family", view.dom, view.cod)
    gens = [F.presentation.family("add").box(F.presentation.family("add").points[0]), view,
            stranger]
    html = functor_html(F.functor, gens)
    assert "<b>F_sm_90</b>: LKB → Impl_sm_90" in html
    assert "metrale_add" in html and "cuda:cuda/common/misc.cu:metrale_add -DACT_BF16" in html
    # F_H is total on the LKB: a view has its zero-cost image; only a stranger has none
    assert html.count("no image") == 1 and "not_a_family" in html and "split_heads" in html
    assert "(the identity: no stages)" in Functor.id("C")._repr_html_()
    x = TensorType(("n",), BF16)
    named = Functor("C", "D", ob={x: Ty(TensorType(("n",), F32))}, name="up")._repr_html_()
    assert "object map (1 types)" in named and "f32[n]" in named


def test_composite_functor_display_shows_each_stage():
    from metrale.plan.circuit import circuit_for
    from metrale.plan.lower import lowering

    c = circuit_for("tiny-qwen3")
    F = lowering(c).functor >> realization("host").functor
    gens = [b for b in c.diagram.boxes if b.name == "rmsnorm"][:1]
    html = functor_html(F, gens)
    assert "after lower" in html and "after F_host" in html and "rmsnorm" in html


def test_hardware_class_display():
    html = load_hardware().get("sm_90")._repr_html_()
    assert "chain: sm_90 → sm_80 → cuda" in html and "NVIDIA H200" in html
    assert "; peer NVIDIA H100 80GB HBM3, 3030 GB/s<br>" in html
    assert "319 of 323 compiled points realized on sm_90" in html
    assert re.search(r"<td>cuda</td><td><code>cuda/common</code></td><td>\d+</td><td>\d+</td>"
                     r"<td>285</td>", html)
    # sm_90's own folder: 29 tables, five sources (the wgmma GEMM, the TMA-fed one, the one
    # chain's, the quantized weights made bf16 for the last two, the prefill attention), the 31
    # gemm points and the three prefill attention points
    assert "<td>sm_90</td><td><code>sm_90/common</code></td><td>29</td><td>5</td><td>34</td>" in html
    assert hardware_html(load_hardware().get("host")).count("<tr>") >= 3


def test_realization_display_counts_and_reasons():
    html = realization_html(realization("sm_90"))
    assert ("319 of 323 compiled points realized (285 from cuda, 34 from sm_90); 0 not realized; "
            "34 residual") in html
    assert "a view: no kernel, no launch" in html
    assert realization("host")._repr_html_().count("reference semantics") == 319


def test_residual_display():
    entry = ResidualEntry(SHADOW, "rmsnorm[act=bf16,h_block=256]", "sm_90/common/norm.cu",
                          "one warp per row is faster on Hopper", "stale")
    html = residual_html(Residual("sm_90", [entry]))
    assert "Residual(sm_90): 1</b> (1 shadow, 0 class-only source, 0 per-point copy)" in html
    assert "one warp per row is faster on Hopper" in html and ">stale</span>" in html
    assert "Nothing outside the shared image" in Residual("sm_90", [])._repr_html_()


def test_evidence_report_and_display():
    F = realization("sm_90")
    point = F.presentation.family("rmsnorm").points[0]
    k = F.realize(point)
    rec = EvidenceRecord("sm_90", "NVIDIA H200", "rmsnorm", str(k.point), "time", 3.1, 2.4, "us",
                         "2025-06-01", "nvcc", k.source_hash)
    old = EvidenceRecord("sm_90", "NVIDIA H200", "rmsnorm", str(k.point), "time", 3.5, 2.4, "us",
                         "2025-05-01", "nvcc", "0" * 64)
    measured = evidence_report(F, [point], records=EvidenceLoad((rec,)))
    assert measured.rows[0].status == "measured on sm_90" and measured.rows[0].record == rec
    stale = evidence_report(F, [point], records=EvidenceLoad((old,)))
    assert stale.rows[0].status == "stale" and stale.rows[0].record is None
    html = measured._repr_html_()
    assert "time 3.1 us, floor 2.4 (77%)" in html and "measured on sm_90" in html
    load_html = EvidenceLoad((rec, old))._repr_html_()
    assert "2 records" in load_html and load_html.count("<tr>") == 3

"""The plan is the composite (lower_H >> rewrite_H >> F_H)(circuit), then annotated.

F_H is total on what L_H produces (views included), L_H is a value one composes by ``>>``,
and one memoized Target per (class, presentation, kernels folder, policy) is carried by plans.
"""

from __future__ import annotations

import shutil

import pytest

from metrale.lkb.errors import AxiomError
from metrale.lkb.pipeline import Pipeline
from metrale.lkb.presentation import FAMILIES_FILE, FUSIONS_FILE, default_kernels_dir
from metrale.lkb.target import KernelTarget
from metrale.plan.circuit import circuit_for
from metrale.plan.config import ModelConfig
from metrale.plan.fuser import fuser, rewriting
from metrale.plan.lower import lowering
from metrale.plan.models import builtin_names
from metrale.plan.plan import plan_for
from metrale.realize.functor import realization
from metrale.realize.hardware import load_hardware
from metrale.realize.target import presentation_at, target
from tests.tiers import sampled

QUANTS = ("bf16", "fp8", "mxfp4", "nvfp4")


def _classes() -> list[str]:
    names = load_hardware(default_kernels_dir()).names
    return sorted(names() if callable(names) else names)


@pytest.mark.parametrize("hw", ["sm_90", "sm_80", "cuda", "host"])
def test_F_is_total_on_what_lowering_produces(hw):
    c = circuit_for("tiny-qwen3")
    F = realization(hw)
    lowered = lowering(c).functor(c.diagram)
    image = F.functor(lowered)  # split_heads and merge_heads are views: zero-cost view boxes
    assert len(image) == len(lowered)
    assert {b.name for b in image.boxes if b.param("kernel") == "view"} == {
        "split_heads", "merge_heads"}
    fused = (lowering(c).functor >> rewriting(F) >> F.functor)(c.diagram)
    assert fused.dom == c.diagram.dom and fused.cod == c.diagram.cod and len(fused) < len(image)


def test_F_still_refuses_what_is_not_a_generator():
    from metrale.lkb.diagram import Box

    X = circuit_for("tiny-qwen3").diagram.dom
    with pytest.raises(AxiomError, match="not a generator"):
        realization("sm_90").functor(Box("nope", X, X))


# one model of each architecture at its published shapes in the default tier; their siblings and
# the tiny ones in the full tier
SHAPED = ("gpt-oss-20b", "llama-3.1-8b", "qwen3-0.6b", "qwen3-30b-a3b")


@pytest.mark.parametrize("model", sampled(builtin_names(),
                                          keep=[builtin_names().index(m) for m in SHAPED]))
def test_plan_kernels_are_the_image_of_the_composite(model):
    """For every built-in model (two decoder layers: the rest repeat them), quant and class,
    the plan's kernels, in order, are the boxes of (L_H >> F_H)(circuit) as a user composes
    it, L_H taking the search's choice (its matmul point and the matches it skips): the same
    kernel at every position, views where the image has views."""
    config = ModelConfig.load(model)
    config = config.with_layers(min(config.num_hidden_layers, 2))
    for quant in QUANTS:
        c = circuit_for(config, quant)
        for hw in _classes():
            F = target(hw).realization(KernelTarget(hw, config.name, quant))
            plan = plan_for(config, quant, hw)
            L = fuser(c, F, shape=plan.choice.shape, skip=plan.choice.skip)
            image = (L >> F.functor)(c.diagram)
            assert [b.param("kernel") for b in image.boxes] == [
                "view" if k.view else k.kernel.key for k in plan.kernels], (hw, quant)
            assert [F.kernel_of(b) for b in image.boxes] == [
                None if k.view else k.kernel for k in plan.kernels]


def test_L_H_is_a_value():
    c = circuit_for("tiny-llama")
    F = target("sm_90").realization()
    L = fuser(c, F)
    assert isinstance(L, Pipeline) and str(L) == "lower >> rewrite_sm_90[exact]"
    assert L == fuser(c, F) and hash(L) == hash(fuser(c, F))
    assert L != fuser(c, F, "bounded")
    composite = L >> F.functor
    assert str(composite) == "lower >> rewrite_sm_90[exact] >> F_sm_90"
    with pytest.raises(AxiomError, match="cannot compose"):
        F.functor >> L


def test_one_target_per_class_presentation_folder_and_policy():
    T = target("sm_90")
    assert T is target("sm_90") and T is not target("sm_90", policy="bounded")
    p = plan_for("tiny-llama", "bf16", "sm_90")
    assert p.hw_target is T and p.hw_target.presentation is presentation_at()
    assert plan_for("tiny-llama", "bf16", "sm_90").hw_target is T


def test_a_plan_carries_the_presentation_it_was_made_over():
    P = presentation_at()
    smaller = P.extend()  # equal to P, another object
    other = P.__class__(P.generators, tuple(r for r in P.relations if r.name != "add_rmsnorm"))
    p = plan_for("tiny-llama", "bf16", "sm_90", presentation=other)
    assert p.hw_target.presentation is other
    assert "add_rmsnorm" not in {a.relation for a in p.applied}
    assert plan_for("tiny-llama", "bf16", "sm_90", presentation=smaller).hw_target is target(
        "sm_90")


def test_target_rebuilds_when_its_files_change(tmp_path):
    root = tmp_path / "kernels"
    shutil.copytree(default_kernels_dir(), root)
    T = target("sm_80", kernels_dir=root)
    assert target("sm_80", kernels_dir=root) is T
    toml = root / "cuda" / "common" / "KERNELS.toml"
    toml.write_text(toml.read_text() + "\n# touched\n")
    assert target("sm_80", kernels_dir=root) is not T
    fus = root / FUSIONS_FILE
    fus.write_text(fus.read_text() + "\n# touched\n")
    assert presentation_at(root) is not T.presentation
    assert (root / FAMILIES_FILE).is_file()


def test_relations_are_equations_between_diagrams():
    """Both sides of every relation are Diagrams over the presentation's generators, built by
    the public Builder (typed and checked), with one domain and one codomain."""
    from metrale.lkb.diagram import Diagram

    P = presentation_at()
    for rel in P.relations:
        lhs, rhs = P.equation(rel.name)
        assert isinstance(lhs, Diagram) and isinstance(rhs, Diagram)
        assert lhs.dom == rhs.dom and lhs.cod == rhs.cod, rel.name
        assert [b.name for b in lhs.boxes] == list(rel.families)
        assert len(rhs.boxes) == 1 and rhs.boxes[0].name == rel.rhs.calls[0].family
        for box, call in zip(lhs.boxes, rel.lhs.calls):
            assert box.params == tuple(sorted(call.pins)) and box.name in P.family_names


def test_an_ill_typed_relation_is_no_diagram():
    from metrale.lkb.equation import equation
    from metrale.lkb.relation import Relation, parse_side

    P = presentation_at()
    bad = Relation("bad", parse_side("y = rmsnorm(x, w); z = linear(w, y)", "F", "lhs"),
                   parse_side("z = linear(x, w)", "F", "rhs"), "bit_identical")
    with pytest.raises(AxiomError, match="relation bad"):
        equation(bad, P)


def test_a_pattern_input_computed_inside_the_match_is_declined():
    """add(y, y) after y = linear(x, w) looks like linear_add(x, w, r) with r = y, but r is the
    pattern's own output: fusing it would read a wire nothing produces any more."""
    from metrale.lkb.diagram import Diagram
    from metrale.lkb.ty import Ty

    c = circuit_for("tiny-qwen3", "bf16")
    F = target("sm_90").realization(KernelTarget("sm_90", "tiny-qwen3", "bf16"))
    down = next(b for b in c.diagram.boxes if dict(b.params).get("role") == "down_proj")
    add = next(b for b in c.diagram.boxes if b.name == "add")
    d = Diagram.flat(down.dom, Ty(), (down, add), (((-1, 0), (-1, 1)), ((0, 0), (0, 0))), ())
    R = rewriting(F, "exact", sizes={**c.sizes(1024), "context": 1024})
    out = (lowering(c).functor >> R)(d)
    assert [b.name for b in out.boxes] == ["linear", "add"]
    assert out.wiring[1] == ((0, 0), (0, 0))

"""The public law suites on lower_H >> rewrite_H >> F_H, for every class in kernels/ and
every quant: F_H and lower_H are strict monoidal functors; rewrite_H keeps the interface, is
idempotent, takes only steps that are instances of relations, and under the exact policy keeps
the bytes (evaluated by the reference semantics); on random circuits of each tiny model."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.lkb.presentation import default_kernels_dir
from metrale.lkb.target import KernelTarget
from metrale.plan.circuit import circuit_for
from metrale.plan.fuser import rewriting
from metrale.plan.lower import lowering
from metrale.realize.hardware import load_hardware
from metrale.realize.target import target
from metrale.testing import functor_laws, is_relation_instance, rewrite_laws_at, rewriting_laws

_names = load_hardware(default_kernels_dir()).names
CLASSES = sorted(_names() if callable(_names) else _names)
QUANTS = ("bf16", "fp8", "mxfp4", "nvfp4")
MODELS = ("tiny-llama", "tiny-qwen3", "tiny-qwen3-moe")


def _generators(c):
    return sorted(set(c.diagram.boxes), key=lambda b: (b.name, repr(b.params)))


def _inputs(c):
    sizes = c.sizes(16)

    def make(d, seed):
        rng = np.random.default_rng(seed)
        out = []
        for t in d.dom:
            shape = tuple(sizes[x] if isinstance(x, str) else x for x in t.bind(sizes).shape)
            if t.dtype.numpy.kind in "iu":
                out.append(np.zeros(shape, t.dtype.numpy))  # rows=1, one slot: 0 indexes all
            else:
                v = rng.standard_normal(shape).astype(np.float32) / np.float32(4)
                out.append(v.astype(t.dtype.numpy))
        return out

    return make


@pytest.mark.parametrize("hw", CLASSES)
@pytest.mark.parametrize("quant", QUANTS)
def test_the_composite_is_lawful(hw, quant):
    for model in MODELS:
        c = circuit_for(model, quant)
        F = target(hw).realization(KernelTarget(hw, c.config.name, quant))
        lower = lowering(c, F.presentation, max_ctx=16).functor
        for policy in ("exact", "bounded"):
            R = rewriting(F, policy, sizes={**c.sizes(16), "context": 16})
            rewriting_laws(lower, R, _generators(c), c.diagram.dom, max_examples=4)
        fused = (lower >> rewriting(F))(c.diagram)
        functor_laws(F.functor, sorted(set(fused.boxes), key=repr), dom=fused.dom,
                     max_examples=4)


@pytest.mark.parametrize("model", MODELS)
def test_the_exact_rewriting_keeps_the_bytes_of_random_circuits(model):
    c = circuit_for(model, "bf16", rows=1, act="f32")
    F = target("host").realization()
    lower = lowering(c, F.presentation, max_ctx=16).functor
    rewriting_laws(lower, rewriting(F, "exact"), _generators(c), c.diagram.dom,
                   inputs=_inputs(c), max_examples=15)


@pytest.mark.parametrize("hw", CLASSES)
def test_the_laws_hold_on_whole_circuits(hw):
    """Not only on small random circuits: every tiny model's whole step, every quant, both
    policies, where the relations really apply (several steps each)."""
    for model in MODELS:
        for quant in QUANTS:
            c = circuit_for(model, quant)
            F = target(hw).realization(KernelTarget(hw, c.config.name, quant))
            lowered = lowering(c, F.presentation, max_ctx=16).functor(c.diagram)
            for policy in ("exact", "bounded"):
                R = rewriting(F, policy, sizes={**c.sizes(16), "context": 16})
                result = rewrite_laws_at(R, lowered)
                assert result.steps and result.applied


def test_the_exact_policy_keeps_the_bytes_of_whole_circuits():
    for model in MODELS:
        c = circuit_for(model, "bf16", rows=1, act="f32")
        F = target("host").realization()
        d = lowering(c, F.presentation, max_ctx=16).functor(c.diagram)
        result = rewrite_laws_at(rewriting(F, "exact"), d, _inputs(c)(d, 7))
        assert len(result.applied) >= 4


def test_a_step_that_is_no_instance_is_caught():
    c = circuit_for("tiny-llama")
    F = target("host").realization()
    d = lowering(c, F.presentation).functor(c.diagram)
    step = rewriting(F).run(d).steps[0]
    boxes, fused = step.matches[0]
    P = F.presentation
    other = next(r for r in P.relations if r.name != step.relation)
    assert is_relation_instance(other, P, step.before, boxes, fused)
    wrong = type(fused)(fused.name, fused.dom, fused.cod, {**dict(fused.params), "act": "f32"})
    assert "not the rhs point" in is_relation_instance(P.relation(step.relation), P,
                                                       step.before, boxes, wrong)

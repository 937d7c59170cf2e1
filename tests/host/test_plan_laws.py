"""L_H = rewrite_H ∘ lower_H: lower_H is a strict functor; L_H is a functor up to the relations.

Random well-typed circuits are built from a tiny model's own ops (Hypothesis, by construction);
executing L_H(f >> g) and L_H(f) >> L_H(g) on the host must give the same bytes under the exact
policy.
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.lkb.diagram import Diagram
from metrale.lkb.evaluate import evaluate
from metrale.lkb.presentation import Presentation
from metrale.plan.circuit import circuit_for
from metrale.plan.fuser import rewrite
from metrale.plan.lower import lowering
from metrale.realize.functor import realization
from metrale.testing import composable_chains, functor_laws

P = Presentation.load()
F_HOST = realization("host", presentation=P)
CIRCUITS = {arch: circuit_for(f"tiny-{arch}", rows=1, act="f32")
            for arch in ("llama", "qwen3", "qwen3-moe")}


def _generators(c):
    return sorted(set(c.diagram.boxes), key=lambda b: (b.name, repr(b.params)))


def _L(c, d: Diagram) -> Diagram:
    return rewrite(lowering(c, P, max_ctx=16).functor(d), F_HOST, presentation=P).diagram


def _inputs(c, d: Diagram, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = c.sizes(16)
    out = []
    for t in d.dom:
        shape = tuple(sizes[x] if isinstance(x, str) else x for x in t.bind(sizes).shape)
        if t.dtype.numpy.kind in "iu":
            out.append(np.zeros(shape, t.dtype.numpy))  # rows=1, one slot: 0 is every index
        else:
            v = rng.standard_normal(shape).astype(np.float32) / np.float32(4)
            out.append(v.astype(t.dtype.numpy))
    return out


def test_lower_is_a_strict_functor():
    for c in CIRCUITS.values():
        functor_laws(lowering(c, P).functor, _generators(c), dom=c.diagram.dom, max_examples=15)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(sorted(CIRCUITS)), st.data(), st.integers(0, 2**31 - 1))
def test_L_is_a_functor_up_to_the_relations(arch, data, seed):
    c = CIRCUITS[arch]
    f, g = data.draw(composable_chains(2, over=_generators(c), dom=c.diagram.dom))
    whole = _L(c, f >> g)
    parts = _L(c, f) >> _L(c, g)
    x = _inputs(c, f, seed)
    a = evaluate(whole, [v.copy() for v in x], P)
    b = evaluate(parts, [v.copy() for v in x], P)
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert u.dtype == v.dtype and u.tobytes() == v.tobytes()


def test_whole_circuit_fused_equals_unfused_bytes():
    """The full tiny circuits: rewrite_H changes kernels, never bytes (exact policy)."""
    for c in CIRCUITS.values():
        low = lowering(c, P, max_ctx=16).functor(c.diagram)
        fused = rewrite(low, F_HOST, presentation=P).diagram
        assert len(fused) < len(low)
        x = _inputs(c, c.diagram, 7)
        a = evaluate(low, [v.copy() for v in x], P)
        b = evaluate(fused, [v.copy() for v in x], P)
        assert all(u.tobytes() == v.tobytes() for u, v in zip(a, b))
        logits = a[0]
        assert np.isfinite(logits).all() and np.abs(logits).max() > 0


def test_bounded_policy_stays_within_the_declared_bound():
    """A linear lowered under the bounded policy (split-K reassociated) against the exact one:
    every output within rel·|exact| + abs·rms(exact) of the relation applied. The presentation
    keeps splitk_pairwise alone, which the mma_gemv relations otherwise take first."""
    from metrale.lkb.diagram import Diagram
    from metrale.lkb.presentation import Presentation

    c = CIRCUITS["llama"]
    gate = next(b for b in c.diagram.boxes if b.name == "linear" and b.param("role") == "gate_proj")
    d = Diagram.from_box(gate)
    low = lowering(c, P, max_ctx=16).functor(d)
    split = Presentation(P.generators, (P.relation("splitk_pairwise"),))
    exact = rewrite(low, F_HOST, presentation=split, policy="exact")
    bounded = rewrite(low, F_HOST, presentation=split, policy="bounded")
    assert [a.relation for a in bounded.applied] == ["splitk_pairwise"] and not exact.applied
    rel = P.relation("splitk_pairwise")
    from metrale.lkb.relation import UNIT_ROUNDOFF, eval_bound

    k = c.sizes(16)["hidden"]
    env = {**{f"eps_{n}": u for n, u in UNIT_ROUNDOFF.items()}, "eps_act": UNIT_ROUNDOFF["f32"],
           "k": k}
    for seed in range(5):
        x = _inputs(c, d, seed)
        a = evaluate(exact.diagram, x, P)[0].astype(np.float64)
        b = evaluate(bounded.diagram, x, P)[0].astype(np.float64)
        allowed = eval_bound(rel.bound.rel, env) * np.abs(a) + \
            eval_bound(rel.bound.abs, env) * np.sqrt(np.mean(a * a))
        assert (np.abs(a - b) <= allowed).all()

"""Bounds are sound and bit-identity covers NaN: the relations hold on adversarial inputs.

Each bounded relation's bound is ``rel * |lhs| + abs * magnitude`` with the magnitude the sum
of the magnitudes of what it combines; a bound in |lhs| alone (with an rms term) fails as
soon as a reduction cancels, which these tests show on the examples that exposed it."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.lkb.check import KINDS, check_relation
from metrale.lkb.presentation import Presentation
from metrale.lkb.relation import UNIT_ROUNDOFF, eval_bound
from metrale.lkb.semantics import BF16, add, linear, linear_add

P = Presentation.load()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rel", P.relations, ids=lambda r: r.name)
def test_every_relation_holds_on_every_kind_of_input(rel, kind):
    findings = check_relation(P, rel, seed=3, kinds=(kind,))
    assert findings and all(f.ok for f in findings), [str(f) for f in findings if not f.ok]


def _block_sums_example(k_block: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """One row whose k-block sums are [1e8, 1, -1e8, 1] (the weight all ones)."""
    x = np.zeros((1, 4 * k_block), np.float32)
    for b, total in enumerate((1e8, 1.0, -1e8, 1.0)):
        x[0, b * k_block] = total
    return x, np.ones((1, 4 * k_block), np.float32)


def test_splitk_pairwise_bound_survives_cancelling_block_sums():
    x, w = _block_sums_example()
    (seq,) = linear(x, w, k_block=16, across="sequential", act="f32")
    (pair,) = linear(x, w, k_block=16, across="pairwise", act="f32")
    assert float(seq[0, 0]) != float(pair[0, 0])  # the reassociation really differs here
    (mag,) = linear(np.abs(x), np.abs(w), k_block=16, across="sequential", act="f32")
    bound = P.relation("splitk_pairwise").bound
    env = {**{f"eps_{k}": v for k, v in UNIT_ROUNDOFF.items()}, "eps_act": UNIT_ROUNDOFF["f32"],
           "k": 64.0}
    allowed = eval_bound(bound.rel, env) * abs(float(seq[0, 0])) \
        + eval_bound(bound.abs, env) * float(mag[0, 0])
    assert abs(float(seq[0, 0]) - float(pair[0, 0])) <= allowed
    # the former bound, rel * |lhs| + abs * rms(lhs) with rel 2 eps_act and abs k eps_f32,
    # allowed 2 * 2**-24 * 1 + 64 * 2**-24 * 1: far less than the difference of 1
    assert abs(float(seq[0, 0]) - float(pair[0, 0])) > 66 * 2.0 ** -24


def test_linear_residual_is_bit_identical_on_nan_payloads():
    """x = [inf, 0, 0, 0] and w = 0 make t = inf * 0 a NaN of one sign; r a NaN of the other:
    ``add(r, t)`` and the fused kernel must keep the same one."""
    x = np.array([[np.inf, 0, 0, 0]], np.float32).astype(BF16)
    w = np.zeros((2, 4), np.float32)
    r = np.full((1, 2), np.uint32(0x7FC00000)).view(np.float32).astype(BF16)
    with np.errstate(invalid="ignore"):
        (t,) = linear(x, w, k_block=4, act="bf16")
        (lhs,) = add(r, t, act="bf16")
        (rhs,) = linear_add(x, w, r, k_block=4, act="bf16")
    assert np.isnan(lhs.astype(np.float32)).all()
    assert lhs.tobytes() == rhs.tobytes()

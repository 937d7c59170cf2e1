"""The search by cost: exact against exhaustive enumeration; synthetic evidence switches the
plan; the switched plan (and every decode bucket's) computes the same bytes under the exact
policy; ``met tune`` measures, records and re-plans on the host."""

import hashlib
import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale.plan.circuit import circuit_for
from metrale.plan.config import ModelConfig
from metrale.plan.cost import CostModel
from metrale.plan.fuser import fuser
from metrale.plan.lower import lowering
from metrale.plan.plan import plan_for
from metrale.plan.search import ALTERNATIVE, SITE_LIMIT, _Evaluator, _search_shape, alternatives
from metrale.realize.evidence_store import EvidenceStore
from metrale.realize.target import target
from metrale.runtime.engine import random_weights
from metrale.runtime.executor import Program, bind_externals
from metrale.runtime.host_backend import HostBackend
from tests.mock.test_cost import record_family_times

# -- exact against exhaustive enumeration ---------------------------------------------------

@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.sampled_from(["tiny-llama", "tiny-qwen3"]), seed=st.integers(0, 2**32 - 1))
def test_the_search_finds_the_cheapest_plan_that_enumeration_finds(model, seed):
    """Every box gets a pseudo-random cost (a hash of the box and the seed), so the cheapest
    plan is rarely the priority order's; enumerating every subset of the matches the search
    met (each a whole rewrite) finds no cheaper plan than the search's."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _enumerate_against_search(model, seed, monkeypatch)


def _enumerate_against_search(model, seed, monkeypatch):
    def box_cost(self, box):
        if self.P.family(box.name).view:
            return 0.0
        h = hashlib.sha256(f"{seed}:{box!r}".encode()).digest()
        return 1.0 + int.from_bytes(h[:4], "little") / 2**32 * 99.0

    monkeypatch.setattr(_Evaluator, "box_cost", box_cost)
    T = target("host")
    config = ModelConfig.load(model).with_layers(1)
    c = circuit_for(config, "bf16", "decode", 1)
    sizes = {**c.sizes(64), "context": 64}
    lowered = lowering(c, T.presentation, max_ctx=64).functor(c.diagram)
    ev = _Evaluator(lowered, T.realization(), T.presentation, "exact", sizes,
                    CostModel.of(T, sizes))
    skip, total, sites, note = _search_shape(ev, margin=0.0)
    assert note == ""
    sigs = sorted({sig for _, rw, _ in list(ev.runs.values()) for sig, _, st in rw.met
                   if st in ALTERNATIVE}, key=repr)
    assert 4 <= len(sigs) <= 12, len(sigs)
    best = min(ev(frozenset(s))[0] for n in range(len(sigs) + 1)
               for s in itertools.combinations(sigs, n))
    assert total == pytest.approx(best, rel=1e-12)
    assert ev(skip)[0] == pytest.approx(total, rel=1e-12)
    priority = ev(frozenset())[0]
    assert best <= priority


# -- synthetic evidence switches the plan; the bytes stay -----------------------------------

def _logits(plan, weights, tokens, positions, slots) -> np.ndarray:
    be = HostBackend()
    prog = Program(plan, be, bindings=bind_externals(plan, be, weights))
    prog.write("tokens", tokens)
    prog.write("positions", positions)
    prog.write("slots", slots)
    prog.run()
    out = prog.read("logits").copy()
    prog.close()
    return out


def _adversarial_weights(model: str, seed: int) -> dict[str, np.ndarray]:
    """Random weights with large opposite entries, signed zeros and denormal-sized values mixed
    in, so that a different summation order would show in the bytes."""
    w = random_weights(model, seed=seed)
    rng = np.random.default_rng(seed)
    for name, a in w.items():
        if a.ndim == 2 and "embed" not in name:
            flat = a.reshape(-1)
            idx = rng.choice(flat.size, size=max(4, flat.size // 50), replace=False)
            flat[idx[0::4]] = 1e4
            flat[idx[1::4]] = -1e4
            flat[idx[2::4]] = -0.0
            flat[idx[3::4]] = 1e-39
    return w


def test_synthetic_evidence_makes_the_plan_switch_and_the_bytes_stay(kernels: Path) -> None:
    base = plan_for("tiny-llama", "bf16", "host", kernels_dir=kernels)
    assert any(k.family == "add_rmsnorm" for k in base.launches)
    assert not any(k.family == "linear_add" for k in base.launches)
    record_family_times(kernels, base, "add_rmsnorm", 1e6)  # the priority order's choice made dear
    switched = plan_for("tiny-llama", "bf16", "host", kernels_dir=kernels)
    fams = [k.family for k in switched.launches]
    assert "add_rmsnorm" not in fams and "linear_add" in fams, fams
    assert switched.predicted_us < 1e6
    assert any("not chosen" in d.reason for d in switched.declined if d.relation == "add_rmsnorm")
    assert switched.exact and switched.row_invariant
    # the switched plan is still the composite (L_H >> F_H)(circuit), L_H taking the choice
    c = circuit_for("tiny-llama", "bf16")
    F = switched.hw_target.realization()
    image = (fuser(c, F, shape=switched.choice.shape, skip=switched.choice.skip)
             >> F.functor)(c.diagram)
    assert [b.param("kernel") for b in image.boxes] == [
        "view" if k.view else k.kernel.key for k in switched.kernels]
    assert [b.param("kernel") for b in (fuser(c, F) >> F.functor)(c.diagram).boxes] != [
        "view" if k.view else k.kernel.key for k in switched.kernels]  # not the priority order
    for seed in (0, 1):
        weights = _adversarial_weights("tiny-llama", seed)
        args = ([5], [0], [0])
        a = _logits(base, weights, *args)
        b = _logits(switched, weights, *args)
        assert np.isfinite(a).any() and a.tobytes() == b.tobytes()


def test_evidence_makes_the_matmul_point_switch(kernels: Path) -> None:
    base = plan_for("tiny-llama", "bf16", "host", kernels_dir=kernels)
    assert base.choice.shape == "gemv"
    for fam in ("qkv", "gate_up_swiglu", "linear", "lm_head"):
        record_family_times(kernels, base, fam, 1e5)
    switched = plan_for("tiny-llama", "bf16", "host", kernels_dir=kernels)
    assert switched.choice.shape == "gemm"
    assert {dict(k.point.params).get("shape") for k in switched.launches} >= {"gemm"}
    weights = _adversarial_weights("tiny-llama", 3)
    assert (_logits(base, weights, [7], [0], [0]).tobytes()
            == _logits(switched, weights, [7], [0], [0]).tobytes())


def test_decode_buckets_choose_apart_and_keep_row_invariance(kernels: Path) -> None:
    """add_rmsnorm dear at one row, linear_add dear at four: the bucket of one row and the
    bucket of 2-4 rows choose different kernels, and a row's logits are the same bytes in
    either."""
    one = plan_for("tiny-llama", "bf16", "host", kernels_dir=kernels, rows=1)
    other = next(a for a in alternatives(one.choice) if a.shape == "gemv"
                 and any(s[0] == "add_rmsnorm" for s in a.skip))
    plans = {(rows, alt): plan_for("tiny-llama", "bf16", "host", kernels_dir=kernels,
                                   rows=rows, choice=other if alt else None)
             for rows in (1, 4) for alt in (False, True)}
    record_family_times(kernels, plans[1, False], "add_rmsnorm", 1e6)
    record_family_times(kernels, plans[1, True], "linear_add", 1.0)
    record_family_times(kernels, plans[4, False], "add_rmsnorm", 1.0)
    record_family_times(kernels, plans[4, True], "linear_add", 1e6)
    p1 = plan_for("tiny-llama", "bf16", "host", kernels_dir=kernels, rows=1)
    p3 = plan_for("tiny-llama", "bf16", "host", kernels_dir=kernels, rows=3)
    assert (p1.bucket, p3.bucket) == (1, 4)
    f1 = {k.family for k in p1.launches}
    f3 = {k.family for k in p3.launches}
    assert "linear_add" in f1 and "add_rmsnorm" not in f1, f1
    assert "add_rmsnorm" in f3 and "linear_add" not in f3, f3
    assert plan_for("tiny-llama", "bf16", "host", kernels_dir=kernels, rows=2).choice == \
        p3.choice
    weights = _adversarial_weights("tiny-llama", 4)
    a = _logits(p1, weights, [9], [0], [0])
    b = _logits(p3, weights, [9, 2, 11], [0, 0, 0], [0, 1, 2])
    assert a[0].tobytes() == b[0].tobytes()


def test_a_site_past_the_limit_can_leave_its_bounded_relations(analytic: Path) -> None:
    """A site of more matches than SITE_LIMIT tries two alternatives, the priority order and
    that order without its bounded relations: where the tensor-core GEMVs are measured dearer
    (synthetic records), the bounded plan keeps the CUDA-core ones there too."""
    kernels = analytic  # by priority first, whatever ships
    def mma(plan):
        return {k.family for k in plan.launches
                if dict(k.point.params).get("shape") == "gemv_mma"}

    before = plan_for("tiny-llama", "bf16", "sm_90", kernels_dir=kernels, policy="bounded")
    assert "a site of more than" in before.choice.note
    big = [x for x in before.choice.sites if len(x.relations) > SITE_LIMIT]
    assert big and all(x.alternatives == 2 for x in big)
    assert {"linear", "qkv", "gate_up_swiglu", "lm_head"} <= mma(before)  # by priority
    after = before
    for _ in range(3):  # each plan's tensor-core GEMVs measured dear, until none is left
        for fam in mma(after):
            record_family_times(kernels, after, fam, 1e4)
        after = plan_for("tiny-llama", "bf16", "sm_90", kernels_dir=kernels, policy="bounded")
    assert not mma(after), mma(after)
    assert after.predicted_us < before.predicted_us
    left = [x for x in after.choice.sites if len(x.relations) > SITE_LIMIT]
    assert left and all(any(r.startswith("mma_gemv") for r in x.skipped) for x in left)
    # met tune's alternatives hold the large sites' two: the second skips the bounded matches
    alts = [a for a in alternatives(after.choice) if a.shape == after.choice.shape]
    assert any(any(sig[0].startswith("mma_gemv") for sig in a.skip) for a in alts[1:])


# -- met tune on the host -------------------------------------------------------------------

def _tune_tiny_llama(kernels: Path, capsys, *extra: str) -> dict:
    """`met tune tiny-llama` on the host at one row, briefly: its JSON row."""
    import json

    from metrale.cli import main

    assert main(["tune", "tiny-llama", "--hardware", "host", "--rows", "1", "--context", "32",
                 "--steps", "2", "--repeats", "2", "--kernels", str(kernels),
                 "--format", "json", *extra]) == 0
    [row] = json.loads(capsys.readouterr().out)
    return row


def test_met_tune_times_records_and_replans(kernels: Path, evidence_store: EvidenceStore,
                                            capsys, monkeypatch) -> None:
    """Each kernel is timed once, at the first alternative that launches it (the alternatives
    share most of their kernels: timing each again took most of a device round)."""
    from metrale.runtime import bench

    timings = []
    time_launches = bench._time_launches
    monkeypatch.setattr(bench, "_time_launches", lambda *a: timings.append(a[1]) or
                        time_launches(*a))
    row = _tune_tiny_llama(kernels, capsys)
    assert row["recorded"] == row["kernels_timed"] > 0 and row["alternatives"] >= 2
    assert len(timings) == row["kernels_timed"]
    assert row["measured_before_us"] > 0 and row["measured_after_us"] > 0
    # what tuning swapped is named (a plan whose kernels differ is a changed plan)
    assert isinstance(row["kernels_in"], list) and isinstance(row["kernels_out"], list)
    assert row["changed"] or not (row["kernels_in"] or row["kernels_out"])
    records = evidence_store.records("host")  # in the store; the kernels folder is left as it was
    assert len(records) == row["recorded"]
    assert all(r.metric.startswith("time@") and r.unit == "us" for r in records)
    assert not (kernels / "host" / "EVIDENCE.toml").exists()
    after = plan_for("tiny-llama", "bf16", "host", kernels_dir=kernels, context=33)
    assert all(k.cost.kind == "measured" for k in after.launches), [
        k.cost.source for k in after.launches if k.cost.kind != "measured"]
    assert row["predicted_after_us"] == pytest.approx(after.predicted_us)


def test_met_tune_leaves_alternatives_predicted_far_past_the_plan_untimed(
        kernels: Path, evidence_store: EvidenceStore, capsys, monkeypatch) -> None:
    """An alternative predicted at more than PRUNE times the plan's step is not timed (on
    sm_90 a prefill's 64 GEMV-shaped alternatives at 2,048 rows, predicted at 17 times the GEMM
    plan, whose records then priced 8-row plans); tiny-llama's decode alternatives on the host
    are predicted at 1.0-1.7 times its plan, so a PRUNE of 1.3 leaves the costlier untimed."""
    from metrale import tune_cli

    every = _tune_tiny_llama(kernels, capsys, "--no-record")
    assert every["pruned"] == 0
    monkeypatch.setattr(tune_cli, "PRUNE", 1.3)
    some = _tune_tiny_llama(kernels, capsys, "--no-record")
    assert 0 < some["pruned"] < some["alternatives"] == every["alternatives"]
    assert some["kernels_timed"] < every["kernels_timed"]


# -- the engine runs the bucket's program -----------------------------------------------------

def test_the_engine_runs_the_bucket_program_and_a_row_keeps_its_bytes() -> None:
    """Three rows run the 2-4 bucket's program (four rows, the last repeated); their logits
    and the cache they leave are the bytes of an engine of three slots, which runs three."""
    from metrale.runtime.engine import Engine

    out = {}
    for slots in (4, 3):
        with Engine.load("tiny-llama", max_ctx=16, slots=slots, graphs=False) as eng:
            steps = [eng.decode([5, 17, 3]), eng.decode([8, 1, 250])]
            assert ("decode", min(4, slots), "all", False) in eng._programs  # False: no sample
            caches = {n: eng.backend.copy_d2h(p, p.nbytes)[:3 * eng._slot_bytes[n]]
                      for n, p in eng.caches.items()}
            out[slots] = (steps, caches)
    (a, ca), (b, cb) = out[4], out[3]
    assert all(x.shape == (3, 256) and x.tobytes() == y.tobytes() for x, y in zip(a, b))
    assert ca.keys() == cb.keys() and all(bytes(ca[n]) == bytes(cb[n]) for n in ca)
    assert any(bytes(ca[n]).strip(b"\0") for n in ca)  # the steps wrote the caches

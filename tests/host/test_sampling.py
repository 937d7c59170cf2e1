"""The sample family: Philox-4x32-10, the reference semantics, the CUDA kernel on the emulation,
and the batcher's law (a request's tokens are the same alone or batched, however requests
arrive).

Reference: greedy is argmax; the drawn id is in the kept set that top-k, top-p and min-p define
(checked against brute-force definitions); the draws follow the softmax (a chi-square test over
a fixed set of keys); a key reproduces its draw. Kernel: ``kernels/cuda/common/sample.cu`` on
the SIMT emulation gives the reference's ids on adversarial rows (NaN, ±inf, ties, top-k at the
ends, tiny and huge temperatures, vocabularies below and above the block size), poisoned output.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.lkb.family import Point
from metrale.lkb.presentation import Presentation
from metrale.lkb.semantics_sample import philox4x32, sample, uniform
from metrale.runtime.batching import Batcher, Request
from metrale.runtime.engine import Engine
from metrale.runtime.sampling import Sampling, key_row

P = Presentation.load()

# Random123's known answers for philox4x32_10 (kat_vectors): counter, key, result
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,want", KAT)
def test_philox_known_answers(counter, key, want):
    got = philox4x32(np.array([counter], np.uint32), np.array([key], np.uint32))[0]
    assert tuple(int(v) for v in got) == want


def _row(t=1.0, k=0, p=1.0, m=0.0):
    return np.array([[t, k, p, m]], np.float32)


def _draw(logits, params, key):
    return int(sample(logits[None].astype(np.float32), params, key[None])[0][0])


logit_rows = st.lists(st.floats(-8, 8, width=32), min_size=2, max_size=40).map(
    lambda v: np.array(v, np.float32))


@given(logit_rows, st.integers(0, 2 ** 64 - 1), st.integers(0, 1000))
def test_greedy_is_argmax_and_top1_takes_a_largest(l, seed, pos):
    key = key_row(seed, request=0, position=pos)
    assert _draw(l, _row(t=0.0), key) == int(np.argmax(l))
    assert l[_draw(l, _row(t=0.7, k=1), key)] == l.max()


def _kept(l, t, k, p, m):
    """The kept set, by brute force over sorted weights (the module's definition)."""
    z = l / np.float32(t)
    w = np.exp(z - z.max())
    keep = np.ones(l.size, bool)
    if 1 <= k < l.size:
        keep &= z >= np.sort(z)[::-1][int(k) - 1]
    if 0 < p < 1:
        total = w[keep].astype(np.float64).sum()
        keep &= np.array([w[keep & (w > w[i])].astype(np.float64).sum() < p * total
                          for i in range(l.size)])
    if m > 0:
        keep &= w >= np.float32(m)
    return keep


@given(logit_rows, st.floats(0.05, 4), st.integers(0, 45), st.floats(0.05, 1.0),
       st.floats(0, 0.9), st.integers(0, 2 ** 32 - 1))
def test_the_draw_is_in_the_kept_set(l, t, k, p, m, seed):
    params = _row(t, k, p, m)
    t, k, p, m = (float(v) for v in params[0])
    i = _draw(l, params, key_row(seed, request=1, position=3))
    assert _kept(l, t, k, p, m)[i]


def test_draws_follow_the_softmax():
    l = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2], np.float32)
    n = 20000
    logits = np.repeat(l[None], n, 0)
    params = np.repeat(_row(t=1.0), n, 0)
    keys = np.stack([key_row(1234, request=7, position=i) for i in range(n)])
    ids = sample(logits, params, keys)[0]
    probs = np.exp(l - l.max()) / np.exp(l - l.max()).sum()
    counts = np.bincount(ids, minlength=l.size)
    chi2 = float(((counts - n * probs) ** 2 / (n * probs)).sum())
    assert chi2 < 40.0, (chi2, counts, n * probs)  # 7 dof: p < 1e-5 beyond 40
    assert 0.0 <= uniform(keys).min() and uniform(keys).max() < 1.0


def test_a_key_reproduces_its_draw_and_rows_are_independent():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((6, 50)).astype(np.float32)
    params = np.repeat(_row(t=1.2, k=20, p=0.9, m=0.01), 6, 0)
    keys = np.stack([key_row(99, request=r, position=5) for r in range(6)])
    whole = sample(logits, params, keys)[0]
    for r in range(6):
        assert sample(logits[r:r + 1], params[r:r + 1], keys[r:r + 1])[0][0] == whole[r]
    many = [sample(logits, params, np.stack([key_row(s, request=r, position=5)
                                             for r in range(6)]))[0] for s in range(8)]
    assert len({m.tobytes() for m in many}) > 1  # the seed matters


@pytest.mark.parametrize("field,value", [("temperature", -1), ("temperature", "x"),
                                         ("top_k", 1.5), ("top_p", 0), ("min_p", 2),
                                         ("seed", -3), ("seed", True)])
def test_bad_sampling_fields_are_named(field, value):
    from metrale.lkb.errors import ConfigError

    with pytest.raises(ConfigError, match=f"^{field}: bad sampling parameter"):
        Sampling(**{field: value})


# -- the CUDA kernel on the emulation ----------------------------------------------------------

def _adversarial(n: int, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = []
    base = lambda: (rng.standard_normal(n) * 2).astype(np.float32)  # noqa: E731
    rows.append((base(), (0.0, 0, 1.0, 0.0)))  # greedy
    ties = base()
    ties[[3, 7, n - 1]] = ties.max() + 1
    rows.append((ties, (0.0, 0, 1.0, 0.0)))  # greedy, ties: the first
    rows.append((ties, (1.0, 3, 1.0, 0.0)))  # top-k keeps the tied three
    nan = base()
    nan[[5, 9]] = np.nan
    rows.append((nan, (0.0, 0, 1.0, 0.0)))
    rows.append((nan, (0.8, 0, 0.9, 0.0)))  # NaN logit while sampling: argmax of z
    inf = base()
    inf[11] = np.inf
    rows.append((inf, (1.0, 0, 1.0, 0.0)))
    ninf = base()
    ninf[: n // 2] = -np.inf
    rows.append((ninf, (1.0, 0, 1.0, 0.0)))  # half the vocabulary impossible
    rows.append((np.full(n, -np.inf, np.float32), (1.0, 0, 1.0, 0.0)))
    rows.append((base(), (1e-6, 0, 1.0, 0.0)))  # tiny temperature
    rows.append((base(), (100.0, 0, 1.0, 0.0)))  # huge: near uniform
    rows.append((base(), (1.0, 1, 1.0, 0.0)))
    rows.append((base(), (1.0, n - 1, 1.0, 0.0)))
    rows.append((base(), (1.0, n, 1.0, 0.0)))  # top-k off at the vocabulary
    rows.append((base(), (1.0, 0, 0.05, 0.0)))
    rows.append((base(), (1.0, 0, 0.999, 0.0)))
    rows.append((base(), (0.7, 10, 0.8, 0.05)))
    rows.append((base(), (1.3, 0, 1.0, 0.2)))
    rows.append((base(), (1.0, 0, 1.0, 1.0)))  # min-p 1: the largest only
    rows.append((-np.abs(base()) * 0, (1.0, 0, 1.0, 0.0)))  # all equal (±0 included)
    for _ in range(13):
        rows.append((base(), (float(rng.uniform(0.3, 2)), int(rng.integers(0, n)),
                              float(rng.uniform(0.3, 1)), float(rng.uniform(0, 0.3)))))
    logits = np.stack([r[0] for r in rows]).astype(np.float32)
    logits[-14, ::2] = -0.0  # signed zeros in the all-equal row
    params = np.array([r[1] for r in rows], np.float32)
    keys = rng.integers(-2 ** 31, 2 ** 31, (len(rows), 4)).astype(np.int32)
    return logits, params, keys


@pytest.mark.parametrize("n", [40, 256, 1000])
def test_cuda_kernel_on_the_emulation_gives_the_reference_ids(build_dir, n):
    from tests.host import simt

    ok, why = simt.available()
    if not ok:
        pytest.skip(f"no host emulation: {why}")
    from tests.host.test_kernels_emulated import run

    fam = P.family("sample")
    logits, params, keys = _adversarial(n, np.random.default_rng(n))
    rows = logits.shape[0]
    want = sample(logits, params, keys)[0]
    (got,) = run(build_dir, fam, Point("sample", ()), {"rows": rows, "n": n, "four": 4},
                 {"logits": (logits,), "params": (params,), "keys": (keys,)})
    np.testing.assert_array_equal(got, want)
    alone = [run(build_dir, fam, Point("sample", ()), {"rows": 1, "n": n, "four": 4},
                 {"logits": (logits[r:r + 1],), "params": (params[r:r + 1],),
                  "keys": (keys[r:r + 1],)})[0][0] for r in (0, 4, rows - 1)]
    assert alone == [got[0], got[4], got[rows - 1]]


# -- the batcher's law --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine():
    with Engine.load("tiny-qwen3", act="f32", max_ctx=48, slots=6) as eng:
        yield eng


@settings(max_examples=6, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(1, 255), min_size=1,
                                                      max_size=6), st.integers(1, 8),
                          st.booleans()), min_size=1, max_size=6))
def test_tokens_are_the_same_alone_or_batched_however_requests_arrive(engine, plan):
    """Requests arrive after ``delay`` steps each (greedy or seeded sampling); each one's ids
    equal its ids alone, and every slot is free at the end."""
    reqs = [Request(p, n, Sampling(temperature=0.9, top_p=0.95, seed=i) if sampled
                    else Sampling(), request=i) for i, (_, p, n, sampled) in enumerate(plan)]
    alone = [tuple(Batcher(engine).run_alone(r).ids) for r in reqs]
    b = Batcher(engine)
    waiting = sorted(zip((d for d, *_ in plan), range(len(reqs))))
    runs = {}
    step = 0
    while waiting or any(not r.done for r in runs.values()):
        while waiting and waiting[0][0] <= step:
            _, i = waiting.pop(0)
            runs[i] = b.admit(reqs[i])
        b.step()
        step += 1
        assert step < 200
    assert [tuple(runs[i].ids) for i in range(len(reqs))] == alone
    assert b.free_slots() == engine.slots


@pytest.mark.slow
def test_sm90_engine_draws_on_the_emulation_what_the_reference_draws(build_dir):
    """The sm_90 plans ending in ``sample`` (the kernel, its params and keys bound through the
    CUDA plan loader) on the emulation: each drawn id is the reference's draw from the logits the
    same engine's logits plan gives, in prefill and in a decode of two rows."""
    from tests.host import simt

    ok, why = simt.available()
    if not ok:
        pytest.skip(f"no host emulation: {why}")
    from metrale.runtime.host_backend import HostBackend

    params = np.array([[0.8, 40, 0.9, 0.02], [0.0, 0, 1.0, 0.0]], np.float32)
    keys = np.stack([key_row(5, request=r, position=9) for r in range(2)])
    prompts = [[5, 17, 3, 99, 42, 7, 1, 250], [9, 8, 7]]
    with Engine.load("tiny-qwen3", hardware="sm_90", max_ctx=32, slots=2, backend=HostBackend(),
                     loader=simt.plan_loader(build_dir)) as emu:
        for r, p in enumerate(prompts):
            logits = emu.prefill(p, slot=r, last=True)
            want = sample(logits, params[r:r + 1], keys[r:r + 1])[0][0]
            assert emu.prefill_ids(p, slot=r, params=params[r:r + 1], keys=keys[r:r + 1]) == want
        logits = emu.decode([11, 12])
        for r, p in enumerate(prompts):
            emu.prefill(p, slot=r, last=True)  # back to the state before that decode
        got = emu.decode_ids([11, 12], params, keys)
        np.testing.assert_array_equal(got, sample(logits, params, keys)[0])
        assert got[1] == int(logits[1].argmax())

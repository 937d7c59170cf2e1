"""Tensor parallelism on the host: n simulated ranks (threads) against one device.

A rank's plan splits reductions (o_proj's and down_proj's columns, each expert's), so a sharded
step agrees with the unsharded one within the bound of a reordered sum, not byte for byte:
with f32 activations the logits differ by a few f32 units (a reordered k-term sum errs by at
most about k·u·Σ|terms|); with bf16 activations each rank's partial sum is rounded to bf16
before the all-reduce adds them, which the bf16 tolerance covers. The all-reduce itself is
exact where the reference says: its sum is in rank order, so one rank is byte-identical.
"""

from __future__ import annotations

import threading
import time

import attrs
import numpy as np
import pytest

from metrale.lkb.errors import ConfigError, DeviceFault
from metrale.lkb.semantics_collective import rank_sum
from metrale.plan.config import ModelConfig
from metrale.runtime.engine import Engine
from metrale.runtime.parallel import HostGroup, ParallelEngine

WIDE = {name: attrs.evolve(ModelConfig.load(name), num_attention_heads=8,
                           num_key_value_heads=4)
        for name in ("tiny-llama", "tiny-qwen3-moe", "tiny-gpt-oss")}
PROMPT = [5, 17, 3, 99, 42, 7, 1, 25, 64, 2, 11, 200]  # longer than none of the windows


def _compare(model: str, tp: int, act: str, rtol: float) -> None:
    config = WIDE[model]
    with ParallelEngine.load(config, tp=tp, max_ctx=32, act=act) as many, \
            Engine.load(config, max_ctx=32, act=act) as one:
        got, want = many.prefill(PROMPT), one.prefill(PROMPT)
        for step in range(4):
            scale = float(np.abs(want).max())
            assert np.isfinite(got).all() and scale > 0.1
            err = float(np.abs(got - want).max())
            assert err <= rtol * scale, (model, tp, act, step, err / scale)
            token = int(want[-1].argmax())
            got, want = many.decode([token]), one.decode([token])


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("model", sorted(WIDE))
def test_sharded_f32_steps_are_the_unsharded_within_a_reordered_sum(model, tp):
    # 2 layers, k <= 128 terms per split sum, u = 2^-24: a few 1e-6 of the logit scale
    _compare(model, tp, "f32", 2e-5)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("model", ["tiny-llama"])
def test_sharded_bf16_steps_are_the_unsharded_within_the_bf16_tolerance(model, tp):
    """Dense only: in a MoE a bf16 difference in the router's input can pick another expert
    where two logits nearly tie, and the step then differs by more than any rounding (the
    MoE models are held to the f32 bound above, where no choice flips)."""
    _compare(model, tp, "bf16", 1.6e-2)


def test_one_rank_is_the_engine_byte_for_byte():
    with ParallelEngine.load("tiny-qwen3", tp=1, max_ctx=16) as many, \
            Engine.load("tiny-qwen3", max_ctx=16) as one:
        assert many.prefill([3, 1, 4]).tobytes() == one.prefill([3, 1, 4]).tobytes()
        assert many.decode([9]).tobytes() == one.decode([9]).tobytes()


def test_every_rank_holds_the_same_logits_and_rows_stay_apart():
    """The gathered logits are the same bytes on every rank; a row decoded with 3 others has
    the bytes it has alone (the collectives keep rows apart, as every kernel does)."""
    config = WIDE["tiny-llama"]
    with ParallelEngine.load(config, tp=2, max_ctx=16, slots=4) as batch, \
            ParallelEngine.load(config, tp=2, max_ctx=16) as alone:
        prompts = [[1 + s, 9, 2 * s + 3] for s in range(4)]
        for s, p in enumerate(prompts):
            batch.prefill(p, slot=s)
        many = batch.decode([7, 8, 9, 10])
        alone.prefill(prompts[2])
        one = alone.decode([9])
        assert many[2].tobytes() == one[0].tobytes()
        both = [np.array(e.program("decode", 4).read("logits")) for e in batch.engines]
        assert both[0].tobytes() == both[1].tobytes()


def test_generate_runs_on_the_ranks():
    with ParallelEngine.load("tiny-llama", tp=2, max_ctx=32) as many, \
            Engine.load("tiny-llama", max_ctx=32, act="bf16") as one:
        got = many.generate([3, 1, 4, 1, 5], max_tokens=6)
        want = one.generate([3, 1, 4, 1, 5], max_tokens=6)
        assert len(got.ids) == 6 and all(0 <= i < 256 for i in got.ids)
        # greedy ids agree while no two logits sit within the sharding's bf16 error
        assert got.ids[0] == want.ids[0]


def test_a_bad_request_is_refused_and_the_ranks_keep_serving():
    with ParallelEngine.load("tiny-llama", tp=2, max_ctx=16) as many:
        with pytest.raises(ConfigError, match="token id out of range"):
            many.prefill([1, 999])
        assert np.isfinite(many.prefill([1, 2])).all()


def test_a_failing_rank_stops_every_rank_with_its_fault_named():
    """Rank 1 faults inside a step: rank 0, waiting at the step's first collective, is
    released at once (not after the timeout), the step raises a DeviceFault naming rank 1
    and its error, and so does every later step."""
    with ParallelEngine.load("tiny-llama", tp=2, max_ctx=16, timeout=60) as many:
        many.prefill([1, 2])
        broken = many.engines[1]
        original = broken.decode

        def fault(token_ids):
            raise RuntimeError("illegal memory access (injected)")

        broken.decode = fault
        t0 = time.monotonic()
        with pytest.raises(DeviceFault, match="rank 1 failed: RuntimeError: illegal memory"):
            many.decode([3])
        assert time.monotonic() - t0 < 10
        broken.decode = original
        with pytest.raises(DeviceFault, match="rank 1 failed"):
            many.decode([3])


def test_a_rank_that_never_arrives_is_a_fault_not_a_hang():
    g = HostGroup(2, timeout=0.5)
    with pytest.raises(DeviceFault, match="rank 0 failed: TimeoutError"):
        g.comm(0).all_gather(np.ones(3, np.float32))


def test_the_group_gathers_in_rank_order_under_concurrency():
    """Four ranks gather twenty times in a row, each from its own thread, each time its own
    values: every rank sees every rank's values of that round, in rank order."""
    n, rounds = 4, 20
    g = HostGroup(n, timeout=30)
    seen: dict[int, list] = {}

    def rank(r: int) -> None:
        comm = g.comm(r)
        seen[r] = [comm.all_gather(np.full(2, 10 * i + r, np.float32)) for i in range(rounds)]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in range(n):
        for i, parts in enumerate(seen[r]):
            assert [float(p[0]) for p in parts] == [10 * i + q for q in range(n)]


# -- the all-reduce's sum: its declared order, on the inputs that tell orders apart ---------


def _parts(*columns: list[float]) -> np.ndarray:
    """parts [rows=1, ranks, n] from per-rank lists."""
    return np.array(columns, np.float32)[None]


def test_rank_sum_adds_in_rank_order_in_f32():
    big = np.float32(2**25)
    # (2^25 + 1) + (-2^25) = 0 in f32 (the 1 is lost), but 2^25 + (1 + -2^25) = ... = 0 too;
    # 1 + (2^25 + -2^25) would be 1: only the declared order gives the column its bytes
    got = rank_sum(_parts([big, 1.0], [1.0, big], [-big, -big]), act="f32")[0]
    assert got.tolist() == [[0.0, 0.0]]
    got = rank_sum(_parts([1.0], [big], [-big]), act="f32")[0]
    assert got.tolist() == [[0.0]]


def test_rank_sum_keeps_signed_zeros_denormals_inf_and_nan():
    tiny = np.float32(1e-45)  # the smallest f32 denormal: no flush to zero
    got = rank_sum(_parts([-0.0, tiny, np.inf, np.inf, np.nan],
                          [-0.0, tiny, 1.0, -np.inf, 0.0]), act="f32")[0][0]
    assert np.signbit(got[0]) and got[0] == 0
    assert got[1] == tiny + tiny and got[1] > tiny
    assert got[2] == np.inf and np.isnan(got[3]) and np.isnan(got[4])


def test_rank_sum_rounds_once_to_bf16():
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    # 1 + 2^-8 + 2^-8: rounding to bf16 after each add gives 1 (1 + 2^-8 ties to even, twice);
    # the f32 sum rounded once is 1 + 2^-7, a bf16 value
    parts = np.array([[[1.0], [2**-8], [2**-8]]], bf16)
    assert float(rank_sum(parts, act="bf16")[0][0, 0]) == 1 + 2**-7


@pytest.mark.parametrize("act", ["bf16", "f32"])
def test_the_cuda_rank_sum_gives_the_references_bytes_on_adversarial_parts(build_dir, act):
    """sm_90's rank_sum (collective.cu) on the emulation: cancellation that only the declared
    order resolves, signed zeros, denormals, inf - inf and NaN: the reference's bytes, NaN
    where it has NaN."""
    from tests.host import simt
    from tests.host.test_kernels_emulated import P, run

    ok, why = simt.available()
    if not ok:
        pytest.skip(f"no host emulation: {why}")
    import ml_dtypes

    dt = np.float32 if act == "f32" else ml_dtypes.bfloat16
    big = 2.0**25 if act == "f32" else 2.0**10
    rng = np.random.default_rng(3)
    columns = [[big, 1.0, -big], [1.0, big, -big], [-0.0, -0.0, -0.0], [1e-45, 1e-45, 0.0],
               [np.inf, -np.inf, 1.0], [np.nan, 1.0, 2.0], [1.0, 2**-8, 2**-8]]
    parts = np.array(columns, np.float64).T[None]  # rows=1, ranks=3, n=7
    noise = rng.standard_normal((5, 3, 300)) * 10.0 ** rng.integers(-3, 4, (5, 3, 300))
    for p in (parts, noise):
        p = p.astype(dt)
        fam = P.family("rank_sum")
        point = fam.point(act=act)
        rows, ranks, n = p.shape
        got = run(build_dir, fam, point, {"rows": rows, "ranks": ranks, "n": n},
                  {"parts": (p,)})[0]
        want = rank_sum(p.copy(), act=act)[0]
        # NaN where the reference has NaN (the device's canonical payload, the host's own);
        # every other value byte for byte
        nan = np.isnan(want.astype(np.float32))
        assert (np.isnan(got.astype(np.float32)) == nan).all()
        assert got[~nan].tobytes() == want[~nan].tobytes()


def _adversarial_table(vocab: int, hidden: int, dt) -> np.ndarray:
    """A table of ±0, denormals, ±inf, NaN and ordinary values (bf16 or f32)."""
    rng = np.random.default_rng(7)
    specials = np.array([0.0, -0.0, 1e-40, -1e-40, np.inf, -np.inf, np.nan, 3.5], np.float32)
    t = rng.standard_normal((vocab, hidden)).astype(np.float32)
    mask = rng.random((vocab, hidden)) < 0.4
    t[mask] = rng.choice(specials, mask.sum())
    return t.astype(dt)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("act", ["bf16", "f32"])
def test_the_split_embedding_summed_is_the_embedding_bit_for_bit(act, n):
    """Each rank's rows (-0.0 outside its part) added by rank_sum give every id's row of the
    whole table, ±0, denormals, infinities and NaN payloads included."""
    import ml_dtypes

    from metrale.lkb.semantics import SEMANTICS

    dt = np.float32 if act == "f32" else ml_dtypes.bfloat16
    vocab, hidden = 64, 24
    table = _adversarial_table(vocab, hidden, dt)
    part = vocab // n
    ids = np.array([0, part - 1, part, vocab - 1, 5, 2 * part - 1, 33], np.int32)
    rows = [SEMANTICS["embedding_part"](ids, table[r * part:(r + 1) * part],
                                        np.array([r * part], np.int32), act=act)[0]
            for r in range(n)]
    (summed,) = rank_sum(np.stack(rows, axis=1), act=act)
    (whole,) = SEMANTICS["embedding"](ids, table, act=act)
    assert summed.tobytes() == whole.tobytes()


@pytest.mark.parametrize("act", ["bf16", "f32"])
def test_the_cuda_embedding_part_gives_the_references_bytes(build_dir, act):
    """sm_90's embedding_part on the emulation: the rows of the ids inside the part (at both
    edges), -0.0 for ids below and above it, over an adversarial table (NaN where the
    reference has NaN)."""
    from tests.host import simt
    from tests.host.test_kernels_emulated import P, run

    ok, why = simt.available()
    if not ok:
        pytest.skip(f"no host emulation: {why}")
    import ml_dtypes

    from metrale.lkb.semantics import SEMANTICS

    part, hidden = 16, 300
    table = _adversarial_table(part, hidden, ml_dtypes.bfloat16)
    first = np.array([16], np.int32)
    ids = np.array([15, 16, 31, 32, 20, 0, 2**31 - 1], np.int32)
    fam = P.family("embedding_part")
    got = run(build_dir, fam, fam.point(act=act),
              {"rows": ids.size, "part": part, "h": hidden, "vocab": 64},
              {"ids": (ids,), "table": (table,), "first": (first,)})[0]
    (want,) = SEMANTICS["embedding_part"](ids, table.astype(np.float32), first, act=act)
    nan = np.isnan(want.astype(np.float32))
    assert (np.isnan(got.astype(np.float32)) == nan).all()
    assert got[~nan].tobytes() == want[~nan].tobytes()
    assert np.signbit(got[0]).all() and not got[0].any()  # below the part: -0.0


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_sm90_plans_on_the_emulation_with_their_transport(build_dir, tp):
    """Each rank runs its sm_90 plan (the kernels' own CUDA sources on the emulation), the
    all_gather transport (the loader's launch before the layout kernel) meeting in a host
    group, decode steps captured and replayed as graphs: within the bf16 tolerance of the
    unsharded sm_90 plan on the emulation, every rank with the same logits."""
    from tests.host import simt

    ok, why = simt.available()
    if not ok:
        pytest.skip(f"no host emulation: {why}")
    from metrale.plan.shard import Sharding
    from metrale.runtime.engine import random_weights
    from metrale.runtime.host_backend import HostBackend

    config = WIDE["tiny-llama"]
    weights = random_weights(config, "bf16")
    group = HostGroup(tp, timeout=60)
    ranks = [Engine(Sharding(tp).config(config), "bf16", Sharding(tp).weights(weights, config, r),
                    hardware="sm_90", backend=HostBackend(),
                    loader=simt.plan_loader(build_dir, comm=group.comm(r)), act="bf16",
                    max_ctx=32, slots=1, blocking=False, debug=True, graphs=True, fuse=True,
                    policy="exact") for r in range(tp)]
    kinds = {ln.kernel.family for ln in ranks[0].program("decode", 1).launches}
    assert {"all_reduce", "all_gather", "embedding_part"} <= kinds
    with ParallelEngine(ranks, group) as many, \
            Engine(config, "bf16", weights, hardware="sm_90", backend=HostBackend(),
                   loader=simt.plan_loader(build_dir), act="bf16", max_ctx=32, slots=1,
                   blocking=False, debug=True, graphs=True, fuse=True, policy="exact") as one:
        got, want = many.prefill(PROMPT), one.prefill(PROMPT)
        for step in range(3):
            scale = float(np.abs(want).max())
            assert np.isfinite(got).all() and scale > 0.1
            assert float(np.abs(got - want).max()) <= 1.6e-2 * scale, step
            logits = [np.array(e.program("decode", 1).read("logits")) for e in ranks]
            if step:
                assert all(x.tobytes() == logits[0].tobytes() for x in logits), step
            token = int(want[-1].argmax())
            got, want = many.decode([token]), one.decode([token])


# -- ranks as processes: the loopback simulation of one process per GPU ---------------------


def test_process_ranks_give_the_thread_ranks_bytes_and_survive_bad_requests():
    from metrale.runtime.ranks import ProcessEngine

    config = WIDE["tiny-qwen3-moe"]
    with ProcessEngine.load(config, tp=2, max_ctx=32, slots=2) as procs, \
            ParallelEngine.load(config, tp=2, max_ctx=32, slots=2) as threads:
        assert procs.prefill(PROMPT).tobytes() == threads.prefill(PROMPT).tobytes()
        procs.prefill([4, 5], slot=1)
        threads.prefill([4, 5], slot=1)
        assert procs.decode([3, 9]).tobytes() == threads.decode([3, 9]).tobytes()
        assert procs.lengths == threads.lengths == [len(PROMPT) + 1, 3]
        with pytest.raises(ConfigError, match="token id out of range"):
            procs.decode([3, 10**6])
        assert procs.generate([1, 2, 3], max_tokens=3).ids == \
            threads.generate([1, 2, 3], max_tokens=3).ids


def test_a_lost_rank_process_stops_the_group_with_its_rank_named():
    """Rank 1's process is killed: the next step, rank 0 waiting for it at a collective, is
    released at once and raises a DeviceFault naming rank 1; so does every later step."""
    from metrale.runtime.ranks import ProcessEngine

    with ProcessEngine.load("tiny-llama", tp=2, max_ctx=16) as procs:
        procs.prefill([1, 2])
        procs.ranks._procs[1].kill()
        procs.ranks._procs[1].join(10)
        t0 = time.monotonic()
        with pytest.raises(DeviceFault, match="rank 1 failed: its process ended"):
            procs.decode([3])
        assert time.monotonic() - t0 < 20
        with pytest.raises(DeviceFault, match="rank 1 failed"):
            procs.decode([3])


def test_the_server_serves_from_ranks_and_batched_streams_equal_each_alone(tmp_path):
    """``met serve --tp 2``'s engine: two ranks behind the OpenAI API; greedy requests sent
    together, sharing decode steps, get the tokens each gets alone (exact plans keep rows
    apart on every rank, and the collectives do too)."""
    import concurrent.futures

    from starlette.testclient import TestClient

    from metrale.serve import Server, make_app
    from tests.text_checkpoint import make_text_checkpoint

    ckpt = make_text_checkpoint(tmp_path / "ck")
    prompts = ["The quick brown fox", "Hello, world!", "A category has objects", "Über"]
    with ParallelEngine.load(ckpt, tp=2, act="f32", max_ctx=64, slots=4) as ranks, \
            TestClient(make_app(server := Server(ranks, "ck"))) as client:
        def ids(prompt: str) -> list[int]:
            r = client.post("/v1/completions", json={"model": "ck", "prompt": prompt,
                                                      "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        alone = [ids(p) for p in prompts]
        server.batcher.peak_rows = 0
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(ids, prompts))
        assert server.batcher.peak_rows >= 2, "the requests never shared a decode step"
        assert together == alone and len({tuple(a) for a in alone}) > 1
        bad = client.post("/v1/completions", json={"model": "ck", "prompt": [1, 10**6]})
        assert bad.status_code == 400 and "token_ids[1]" in bad.text
        assert ids(prompts[0]) == alone[0]

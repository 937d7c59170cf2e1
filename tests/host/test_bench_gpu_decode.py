"""benchmarks/bench_gpu_decode.py's plans without named relations, checked where there is no
GPU (its weights are the runtime's pooled ones: tests/host/test_pooled_weights.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_gpu_decode as bench  # noqa: E402

from metrale.plan.config import ModelConfig  # noqa: E402
from metrale.runtime.engine import Engine, _weight_shapes  # noqa: E402


def test_without_drops_only_the_named_relations_and_the_engine_plans_over_what_is_left():
    from metrale.lkb.errors import ConfigError
    from metrale.lkb.presentation import Presentation

    assert bench.without_relations("") is None
    shipped = {r.name for r in Presentation.load().relations}
    P = bench.without_relations("add_rmsnorm,qkv_concat")
    assert {r.name for r in P.relations} == shipped - {"add_rmsnorm", "qkv_concat"}
    with pytest.raises(ConfigError, match="add_rmsnorn"):
        bench.without_relations("add_rmsnorn")
    config = ModelConfig.load("tiny-llama")
    weights = {n: np.zeros(s, np.float32) for n, (s, _) in _weight_shapes(config, "bf16").items()}
    families = {}
    for presentation in (None, P):
        eng = Engine(config, "bf16", weights, hardware="host", backend=None, loader=None,
                     act="f32", max_ctx=8, slots=1, blocking=True, debug=False, graphs=False,
                     fuse=True, policy="exact", presentation=presentation)
        try:
            families[presentation is None] = {k.family for k in eng.plan("decode", 1).kernels}
        finally:
            eng.close()
    assert {"add_rmsnorm", "qkv"} <= families[True]
    assert not {"add_rmsnorm", "qkv"} & families[False]
    assert {"rmsnorm", "linear"} <= families[False]  # the adds go to linear_residual instead


def test_every_metrale_step_is_timed_and_saved_before_the_first_peer(monkeypatch, capsys):
    """A device call that runs out of time in the peers (torch.compile takes minutes a model)
    still brings back every Metrale figure: the run times each step of each model and batch
    first, writing the result after each, then the peers, merging their figures into the rows
    and writing again; compile peers stop past the deadline, counted from the peers' start."""
    events: list[tuple] = []
    clock = iter(range(0, 1000, 100))  # each perf_counter read 100 s later

    def step(model, quant, batch, *a, policy="exact", **k):
        events.append(("step", model, batch, policy))
        return {"step_s": 1e-3 * batch, "launches": 9, "floor_s": 5e-4, "predicted_s": 1e-3,
                "bytes": 4e9}

    def peers(model, batch, compile_too, timeout):
        events.append(("peers", model, batch, compile_too))
        return {"eager_s": 2e-2, **({"compiled_s": 3e-3} if compile_too else {})}

    saved: list[list[dict]] = []
    monkeypatch.setattr(bench, "metrale_step", step)
    monkeypatch.setattr(bench, "hf_child", peers)
    monkeypatch.setattr(bench, "device_copy_rate", lambda: 4e12)
    monkeypatch.setattr(bench, "write_result", lambda name, d: saved.append(
        [dict(r) for r in d["rows"]]) or Path(f"/results/{name}.json"))
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(sys, "argv", ["bench", "qwen3-0.6b", "llama-3.1-8b", "--batches", "1,8",
                                      "--policies", "exact,bounded", "--deadline", "150"])
    bench.main()
    kinds = [e[0] for e in events]
    assert kinds == ["step"] * 8 + ["peers"] * 4, events
    # the peers in the cells' order; compiled while the deadline (150 s from the peers' start,
    # each clock read 100 s on) had not passed
    assert [e[1:] for e in events[8:]] == [("qwen3-0.6b", 1, True), ("qwen3-0.6b", 8, False),
                                          ("llama-3.1-8b", 1, False), ("llama-3.1-8b", 8, False)]
    assert [len(s) for s in saved] == [1, 2, 3, 4, 5, 6, 7, 8, 8, 8, 8, 8, 8]
    assert all("eager_s" not in r for r in saved[7]), "a peer figure before every step was saved"
    final = saved[-1]
    assert all(r["eager_s"] == 2e-2 for r in final)
    assert [("compiled_s" in r) for r in final] == [True] * 2 + [False] * 6
    out = capsys.readouterr().out
    assert out.index("llama-3.1-8b   bf16   bounded b=8: metrale") < out.index("peers of metrale")
    assert "HF+compile 3.00 ms (3.00x ours)" in out


def test_records_are_stored_before_the_first_peer(monkeypatch):
    """``--record`` stores the kernels' records once the Metrale steps are timed, before the
    peers: a device call cut short in torch.compile keeps them (they were stored last, after
    the peers, and a peer past the call's limit lost them)."""
    import metrale.realize.evidence as evidence

    events: list[str] = []

    def step(model, quant, batch, kernels=False, records=None, **k):
        events.append("step")
        if records is not None:
            records.append(f"record of {model} {quant}")
        return {"step_s": 1e-3, "launches": 9, "floor_s": 5e-4, "predicted_s": 1e-3,
                "bytes": 4e9}

    monkeypatch.setattr(bench, "metrale_step", step)
    monkeypatch.setattr(bench, "hf_child", lambda *a: events.append("peers") or {"eager_s": 1.0})
    monkeypatch.setattr(bench, "device_copy_rate", lambda: 4e12)
    monkeypatch.setattr(bench, "write_result", lambda name, d: Path(f"/results/{name}.json"))
    monkeypatch.setattr(evidence, "record_evidence",
                        lambda records: events.append(f"stored {len(records)}") or len(records))
    monkeypatch.setattr(sys, "argv", ["bench", "gpt-oss-20b", "--batches", "1", "--quants",
                                      "mxfp4", "--policies", "exact,bounded", "--record"])
    bench.main()
    assert events == ["step", "step", "stored 2", "peers"], events


def test_each_variant_prints_its_step_and_whether_its_logits_are_the_shipped_plans():
    """A variant without a bit-identical relation must give the shipped plan's logits, byte for
    byte (every engine of a run draws its cache from the same seed); its line says whether it
    did."""
    row = {"model": "qwen3-0.6b", "quant": "bf16", "policy": "exact", "batch": 1,
           "step_s": 0.001, "launches": 199, "floor_s": 0.0003, "copy_floor_s": 0.00031,
           "predicted_s": 0.0011, "logits_sha256": "a",
           "without": [{"relations": "qkv_concat", "step_s": 0.0012, "launches": 255,
                        "logits_sha256": "a"},
                       {"relations": "mma_gemv_linear", "step_s": 0.0009, "launches": 199,
                        "logits_sha256": "b"}]}
    line = bench.metrale_line(row)
    assert "| without qkv_concat 1.200 ms (255 launches, same logits)" in line
    assert "| without mma_gemv_linear 0.900 ms (199 launches, other logits)" in line


def test_rounds_time_the_shipped_step_and_each_variant_in_turn_and_keep_medians(monkeypatch,
                                                                                capsys):
    """``--rounds 3`` with two variants: A B C, then A B C twice more (a new engine each, in
    that order), each one's median kept as its step and its figures beside it."""
    calls: list[str | None] = []
    times = iter([5, 9, 7, 4, 8, 7, 6, 10, 7])  # ms: A B C, A B C, A B C

    def step(model, quant, batch, *a, policy="exact", presentation=None, **k):
        calls.append(None if presentation is None else ",".join(sorted(
            {r.name for r in full} - {r.name for r in presentation.relations})))
        return {"step_s": next(times) * 1e-3, "launches": 9, "floor_s": 5e-4,
                "predicted_s": 1e-3, "bytes": 4e9, "logits_sha256": "h"}

    from metrale.lkb.presentation import Presentation

    full = Presentation.load().relations
    saved: list[dict] = []
    monkeypatch.setattr(bench, "metrale_step", step)
    monkeypatch.setattr(bench, "device_copy_rate", lambda: 4e12)
    monkeypatch.setattr(bench, "write_result", lambda name, d: saved.append(d) or Path("/r.json"))
    monkeypatch.setattr(sys, "argv", ["bench", "qwen3-0.6b", "--batches", "1", "--no-hf",
                                      "--without", "qkv_concat", "--without", "add_rmsnorm",
                                      "--rounds", "3"])
    bench.main()
    assert calls == [None, "qkv_concat", "add_rmsnorm"] * 3
    row = saved[-1]["rows"][0]
    assert row["step_s_rounds"] == pytest.approx([5e-3, 4e-3, 6e-3])
    assert row["step_s"] == pytest.approx(5e-3)
    b, c = row["without"]
    assert b["step_s_rounds"] == pytest.approx([9e-3, 8e-3, 10e-3])
    assert (b["step_s"], c["step_s"]) == pytest.approx((9e-3, 7e-3))
    out = capsys.readouterr().out
    assert "5.000 ms (median of 3: 4.000-6.000 ms)" in out
    assert "without qkv_concat 9.000 ms (median of 3: 8.000-10.000 ms) (9 launches, same" in out


def test_l2_resident_times_are_printed_beside_the_from_memory_ones_and_need_kernels(
        monkeypatch, capsys):
    """--l2-resident without --kernels is a usage error (exit 2, the flag named), not a run that
    silently times nothing; the profile prints each kernel's L2-resident time beside its time
    from memory, and their sum beside the summed medians."""
    monkeypatch.setattr(sys, "argv", ["bench_gpu_decode.py", "qwen3-0.6b", "--l2-resident"])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2 and "--l2-resident" in capsys.readouterr().err
    kernels = [{"point": "qkv[act=bf16]", "count": 2, "seconds": 10e-6, "resident_s": 6e-6,
                "bytes_per_s": 2e12},
               {"point": "rmsnorm[act=bf16]", "count": 1, "seconds": 2e-6, "resident_s": 2e-6,
                "bytes_per_s": 1e10}]
    bench.print_kernels(kernels, 23e-6)
    out = capsys.readouterr().out
    assert "sum of kernel medians 0.022 ms" in out
    assert "sum with each kernel's inputs resident in L2 0.014 ms" in out
    assert "10.0 us" in out and "(L2-resident 6.0 us)" in out

"""`met bench`: the decode step and each kernel timed where the class runs; evidence records."""

from __future__ import annotations

import json
import shutil

import pytest

from metrale.cli import main
from metrale.lkb.family import Point
from metrale.realize.functor import realization
from metrale.realize.hardware import default_kernels_dir, load_hardware
from metrale.runtime.bench import KernelTiming, evidence


def test_met_bench_on_the_host(capsys):
    assert main(["bench", "tiny-qwen3", "--steps", "5", "--context", "32",
                 "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["step_s"] > 0 and doc["floor_s"] > 0 and doc["graph"] is True
    assert all(k["seconds"] > 0 and k["bytes"] > 0 for k in doc["kernels"])
    assert sum(k["count"] for k in doc["kernels"]) == doc["launches"]
    assert doc["recorded"] == 0


def test_met_bench_and_met_run_take_the_bounded_policy(capsys):
    """Under --policy bounded the plan's GEMV-shaped matmuls are the gemv_mma points (on the
    host the reference semantics realize them); the exact policy never picks them."""
    for policy in ("exact", "bounded"):
        assert main(["bench", "tiny-qwen3", "--steps", "3", "--context", "16", "--rows", "2",
                     "--policy", policy, "--format", "json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        mma = [k for k in doc["kernels"] if "shape=gemv_mma" in k["point"]]
        assert doc["policy"] == policy and doc["step_s"] > 0
        assert (len(mma) >= 3) == (policy == "bounded"), [k["point"] for k in doc["kernels"]]
    assert main(["run", "tiny-llama", "--steps", "3", "--context", "32", "--policy", "bounded",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "policy=bounded" in out and "tokens:" in out


def test_met_bench_times_a_prefill_step(capsys):
    assert main(["bench", "tiny-qwen3", "--mode", "prefill", "--rows", "20", "--steps", "2",
                 "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["mode"] == "prefill" and doc["rows"] == 20
    assert doc["step_s"] > 0 and doc["floor_s"] > 0 and doc["launches"] > 0
    assert main(["bench", "tiny-qwen3", "--mode", "prefill", "--rows", "20", "--record"]) == 3
    assert "--record" in capsys.readouterr().err


def test_record_is_refused_where_kernels_have_no_source(capsys):
    assert main(["bench", "tiny-qwen3", "--steps", "2", "--context", "16", "--record"]) == 3
    assert "nothing to record" in capsys.readouterr().err


def test_evidence_records_make_a_kernel_measured_on_its_class_only(tmp_path, evidence_store):
    """Records from timings count on the class that ran them, for the source that ran."""
    from metrale.plan.plan import plan_for

    root = tmp_path / "kernels"  # the shipped tree without its measured evidence
    shutil.copytree(default_kernels_dir(), root, ignore=shutil.ignore_patterns("EVIDENCE.toml"))
    hw = load_hardware(root).get("sm_90")
    F = realization("sm_90", kernels_dir=root)
    point = Point("rmsnorm", (("act", "bf16"), ("h_block", 256)))
    kernel = F.realize(point)
    timing = KernelTiming("#1 rmsnorm", "rmsnorm", str(point), 1, 2e-6, 6144, kernel)
    records = evidence([timing], hw, "NVIDIA H200", "nvcc test")
    assert len(records) == 1 and records[0].source_hash == kernel.source_hash
    assert records[0].floor == hw.device.hbm_bytes_per_s / 1e9
    from metrale.realize.evidence import record_evidence

    assert record_evidence(records) == 1 and evidence_store.records() == tuple(records)
    statuses = {k.family: k.evidence for k in plan_for("tiny-llama", "bf16", "sm_90",
                                                        kernels_dir=root).launches}
    assert statuses["rmsnorm"] == "measured on sm_90"
    assert statuses["qkv"] == "shared, unmeasured"
    other = {k.family: k.evidence for k in plan_for("tiny-llama", "bf16", "sm_80",
                                                     kernels_dir=root).launches}
    assert other["rmsnorm"] == "shared, unmeasured"  # counts only where it was measured


@pytest.mark.parametrize("model, families", [
    ("tiny-qwen3-moe", {"moe_gate_up_swiglu", "moe_down"}),
    ("tiny-gpt-oss", {"moe_gate_up_clamp", "moe_down_bias"}),
])
def test_kernel_times_route_the_expert_kernels_to_other_experts(monkeypatch, model, families):
    """An expert kernel reads only its routed experts' rows, so its timing copies route each row
    to other experts (top_k distinct ids in range) over the same weights, where copying the
    step's own ids would time one set of experts out of L2 (and, for a plan whose step has not
    run, read ids never written). Every family whose ids the presentation ranges by the experts
    is routed, whatever model brought it."""
    import numpy as np

    from metrale.runtime import bench as rb
    from metrale.runtime.engine import Engine

    routes: dict[str, list[np.ndarray]] = {}
    shared: dict[str, int] = {}
    with Engine.load(model, max_ctx=64, slots=3) as eng:
        P = eng.plan("decode", 3).hw_target.presentation

        def record(be, lns, chains, repeats):  # the sets as timed, read before they are freed
            k = lns[0].kernel
            sets = [chain[0] for chain in chains]  # each set's arguments of the kernel's launch
            at = rb.expert_ids_arg(P.family(k.family), k.inputs, lns[0].arg_names)
            if at is not None:
                routes[k.family] = [be.copy_d2h(s[at]).view(np.int32) for s in sets]
                shared[k.family] = sum(
                    all(s[j] == sets[0][j] for s in sets) for j in range(len(sets[0])))
            return 1e-6

        monkeypatch.setattr(rb, "_time_launches", record)
        rb.kernel_times(eng, 3, repeats=2)
        top_k, experts = eng.config.num_experts_per_tok, eng.config.num_experts
    assert set(routes) == families
    for family, ids in routes.items():
        assert len(ids) == 8 and len({r.tobytes() for r in ids}) == 8, family
        for r in ids:
            rows = r.reshape(3, top_k)
            assert rows.min() >= 0 and rows.max() < experts
            assert all(len(set(row)) == top_k for row in rows.tolist())
        # the weights (and the activations, the output) are the same buffers in every copy
        assert shared[family] >= (2 if "gate_up" in family else 1), family


def test_resident_kernel_times_run_one_set_of_inputs_every_time(monkeypatch):
    """kernel_times(resident=True) times each kernel on one set of inputs, every argument the
    same buffer run after run (so what fits in L2 stays there); the expert kernels' set is
    routed once, to valid distinct experts, never the step's own unwritten ids. Without it a
    dense kernel's inputs rotate over several copies."""
    import numpy as np

    from metrale.runtime import bench as rb
    from metrale.runtime.engine import Engine

    sets_of: dict[str, dict[bool, list]] = {}
    with Engine.load("tiny-gpt-oss", max_ctx=64, slots=2) as eng:
        P = eng.plan("decode", 2).hw_target.presentation
        resident = [False]

        def record(be, lns, chains, repeats):
            k = lns[0].kernel
            sets = [chain[0] for chain in chains]
            at = rb.expert_ids_arg(P.family(k.family), k.inputs, lns[0].arg_names)
            ids = [be.copy_d2h(s[at]).view(np.int32) for s in sets] if at is not None else None
            sets_of.setdefault(k.family, {})[resident[0]] = (sets, ids)
            return 1e-6

        monkeypatch.setattr(rb, "_time_launches", record)
        rb.kernel_times(eng, 2, repeats=2)
        resident[0] = True
        timed = rb.kernel_times(eng, 2, repeats=2, resident=True)
        top_k, experts = eng.config.num_experts_per_tok, eng.config.num_experts
    assert {t.family for t in timed} == set(sets_of)
    for family, modes in sets_of.items():
        sets, ids = modes[True]
        assert len(sets) == 1, family
        if ids is not None:
            rows = ids[0].reshape(2, top_k)
            assert rows.min() >= 0 and rows.max() < experts
            assert all(len(set(row)) == top_k for row in rows.tolist())
    assert len(sets_of["rmsnorm"][False][0]) > 1  # rotated where not resident


def test_a_device_fault_while_timing_names_the_kernel(monkeypatch):
    """A graph replay that faults knows no kernel; kernel_times names the one it was timing."""
    from metrale.lkb.errors import DeviceFault
    from metrale.runtime import bench as rb
    from metrale.runtime.backend import device_fault
    from metrale.runtime.engine import Engine

    def fault(be, lns, chains, repeats):
        if lns[0].kernel.family == "gate_up_swiglu":
            raise device_fault("synchronize", None, "unspecified launch failure")
        return 1e-6

    monkeypatch.setattr(rb, "_time_launches", fault)
    with Engine.load("tiny-llama", max_ctx=16, slots=1) as eng:
        index = next(k.index for k in eng.plan("decode", 1).kernels
                     if k.family == "gate_up_swiglu")
        with pytest.raises(DeviceFault) as err:
            rb.kernel_times(eng, 1, repeats=2)
    text = str(err.value)
    assert f"in kernel '#{index} gate_up_swiglu gate_up_swiglu[" in text, text
    assert "unspecified launch failure" in text and "kernel_times" in text


def test_met_bench_record_writes_to_the_store_not_the_package(evidence_store, monkeypatch):
    """`met bench --record` hands its records, with the shape they measured, to the evidence
    store; the kernels folder (the installed package) is left as it was."""
    import attrs

    from metrale import commands
    from metrale.realize.evidence import EvidenceRecord
    from metrale.runtime import bench

    made = EvidenceRecord("sm_90", "NVIDIA H200", "add", "add[act=bf16]", "bandwidth", 500.0,
                          4300.0, "GB/s", "2026-12-05", "nvcc test", "ab" * 32)
    shipped = default_kernels_dir() / "sm_90" / "EVIDENCE.toml"
    before = shipped.read_bytes()
    monkeypatch.setattr(bench, "evidence", lambda *a, **k: [made])
    monkeypatch.setattr(commands, "_toolchain", lambda hw: "nvcc test")
    assert main(["bench", "tiny-qwen3", "--steps", "2", "--context", "8", "--record",
                 "--format", "json"]) == 0
    assert evidence_store.records() == (attrs.evolve(made, shape="rows=1,context=8"),)
    assert shipped.read_bytes() == before

"""Costs: each kernel priced by the class's evidence at the nearest shape, else the model from
HARDWARE.toml's [cost] table, each number with its source; the plan JSON carries them; the
``met plan --costs`` printout is pinned."""

import json
from pathlib import Path
from typing import Any

import pytest

from metrale.lkb.errors import ConfigError, ManyErrors
from metrale.plan.cost import (
    CostModel,
    parse_shape_metric,
    record_times,
    shape_metric,
    shape_of,
    time_records,
)
from metrale.plan.plan import plan_for
from metrale.realize.hardware import load_hardware

SNAPSHOTS = Path(__file__).resolve().parents[1] / "snapshots"


def record_family_times(root: Path, plan, family: str, us: float, *, hw: str | None = None,
                        source_hash: str | None = None, device: str = "test CPU",
                        date: str = "2026-12-01") -> None:
    """Record ``us`` as the time of every distinct kernel of ``family`` in ``plan``, at its
    shape, measured on class ``hw`` of the hardware tree ``root`` (default: the plan's class)."""
    rows = {}
    for k in plan.launches:
        if k.family == family:
            shape = shape_of(plan.hw_target.presentation.family(family), k.box, dict(plan.sizes))
            rows[(str(k.point), tuple(sorted(shape.items())))] = (k.kernel, shape, us)
    assert rows, family
    hardware = plan.hw_target.hw if hw is None else load_hardware(root).get(hw)
    records = time_records(rows.values(), hardware, device, "numpy", date)
    if source_hash is not None:
        import attrs

        records = [attrs.evolve(r, source_hash=source_hash) for r in records]
    assert record_times(records) == len(records)


def test_every_kernel_is_costed_by_the_model_with_its_source(analytic: Path) -> None:
    p = plan_for("tiny-qwen3", "bf16", "sm_90", kernels_dir=analytic)
    assert all(k.cost is not None for k in p.kernels)
    for k in p.launches:
        assert k.cost.kind == "model" and k.cost.us >= 2.0, k.cost  # one launch at least
        assert "4300 GB/s" in k.cost.source and "cost figures of sm_90" in k.cost.source
    assert all(k.cost.us == 0 and k.cost.kind == "view" for k in p.kernels if k.view)
    assert p.predicted_us == pytest.approx(sum(k.cost.us for k in p.launches))


def test_the_model_reads_bytes_flops_and_the_engine_of_the_declared_order(analytic: Path
                                                                         ) -> None:
    """A GEMM-shaped prefill matmul on sm_90 declares a tensor-core order: its FLOPs go at the
    tensor rate; the GEMV's at the vector rate. The multi-row GEMV's grid tiles 16 rows into one
    block of rows, so its weights are read once; at 17 rows, twice."""
    p = plan_for("llama-3.1-8b", "bf16", "sm_90", mode="prefill", rows=64, kernels_dir=analytic)
    qkv = next(k for k in p.launches if k.family == "qkv")
    assert dict(qkv.point.params)["shape"] == "gemm"
    assert "989 TFLOP/s tensor" in qkv.cost.source
    d = plan_for("llama-3.1-8b", "bf16", "sm_90", mode="decode", rows=16, kernels_dir=analytic)
    qkv16 = next(k for k in d.launches if k.family == "qkv")
    assert "67 TFLOP/s vector" in qkv16.cost.source
    assert "by row tiles" not in qkv16.cost.source
    d17 = plan_for("llama-3.1-8b", "bf16", "sm_90", mode="decode", rows=17, kernels_dir=analytic)
    qkv17 = next(k for k in d17.launches if k.family == "qkv")
    assert "weights read 2× by row tiles" in qkv17.cost.source
    # 2 * rows * (nq + nk + nv) * k FLOPs: 2 * 16 * 6144 * 4096
    assert "805 MFLOP" in qkv16.cost.source


def test_a_kernel_that_tiles_its_reads_declares_what_it_moves(analytic: Path) -> None:
    """The family's traffic reads every cached row once per query row (what decode's rows, each
    its own sequence, do); sm_90's two-pass blocks read the keys twice (both passes) and the
    values once per 64 query rows and group of q heads, and its table says so: the plan's bytes,
    its floor and the cost model all take the tile count. At Qwen3-0.6B's 2048-token prefill (G
    = 2, both heads a block) that is 32 tiles, 64 reads of each cached key and 32 of each value,
    not 2048: the floor stays below the step measured on an H100 (13.7 ms)."""
    p = plan_for("qwen3-0.6b", "bf16", "sm_90", mode="prefill", rows=2048, context=2048,
                 kernels_dir=analytic)
    att = next(k for k in p.launches if k.family == "kv_append_attention")
    assert dict(att.kernel.traffic)["k_cache"].startswith("2 * ceil(rows / 64)")
    row = 2048 * 8 * 128 * 2  # context × hkv × d × bf16
    cache = 2 * 32 * row + 32 * row  # the keys twice, the values once, a tile of 64 rows
    appended = 2048 * 8 * 128 * 2
    io = 2048 * 16 * 128 * 2 * 2 + 2048 * 8 * 128 * 2 * 2 + 2 * 2048 * 4  # q, o; k, v; slots
    assert abs(att.bytes_moved - (cache + 2 * appended + io)) <= 2048 * 8, att.bytes_moved
    assert f"{att.bytes_moved / 1e6:.3g} MB".split()[0] in att.cost.source
    assert p.floor_s < 0.0137
    # decode rows are sequences of their own: the family's count, a row's cache read once
    d = plan_for("qwen3-0.6b", "bf16", "sm_90", mode="decode", rows=8, context=1024)
    datt = next(k for k in d.launches if "attention" in k.family)
    assert not datt.kernel.traffic
    assert datt.bytes_moved > 2 * 8 * 1024 * 8 * 128 * 2


@pytest.mark.parametrize("rows", [8, 16])
def test_an_expert_matrix_is_read_once_per_expert_the_rows_chose(analytic: Path, rows: int
                                                                  ) -> None:
    """The expert families declare their weights' traffic (``min(rows * top_k, e)`` experts'
    matrices), which counts the reads at these rows already: the grid's row tiles do not
    multiply it again. Qwen3-30B-A3B's gate and up at 16 rows read all 128 experts once (806 MB),
    where the row tiles read them 16 times over (12.9 GB) and priced its step at 41.8 ms on
    an H100 that measured 24.8."""
    p = plan_for("qwen3-30b-a3b", "bf16", "sm_90", rows=rows, kernels_dir=analytic)
    gate_up = next(k for k in p.launches if k.family == "moe_gate_up_swiglu")
    experts = min(rows * 8, 128)
    matrix = 768 * 2048 * 2  # n × k × bf16
    assert experts * 2 * matrix <= gate_up.bytes_moved < (experts * 2 + 1) * matrix
    assert "by row tiles" not in gate_up.cost.source
    assert f"{gate_up.bytes_moved / 1e6:.3g} MB /" in gate_up.cost.source


def test_a_time_record_at_the_shape_is_the_cost(kernels: Path) -> None:
    base = plan_for("tiny-llama", "bf16", "host", kernels_dir=kernels)
    record_family_times(kernels, base, "rmsnorm", 123.0)
    p = plan_for("tiny-llama", "bf16", "host", kernels_dir=kernels)
    norms = [k for k in p.launches if k.family == "rmsnorm"]
    assert norms and all(k.cost.us == 123.0 for k in norms)
    assert norms[0].cost.source.startswith("measured: on host (test CPU, 2026-12-01) at h=")
    assert "measured" in json.dumps(p.to_json()["cost_sources"])


def test_a_sliding_and_a_full_layer_are_priced_by_their_own_records(kernels: Path) -> None:
    """gpt-oss's sliding and full layers launch one attention point at one size, their windows
    apart: a time record's shape names the window, so each layer is priced by its own record. A
    record made before the window counted (its metric without one) still prices both, and a
    record that names the window comes before it."""
    fam = "rope_kv_append_attention_sink"

    def attention_launches(p) -> list[tuple[Any, dict]]:
        """Each of the plan's attention launches, with its time record's shape."""
        family = p.hw_target.presentation.family(fam)
        return [(k, shape_of(family, k.box, dict(p.sizes))) for k in p.launches
                if k.family == fam]

    def attention_costs() -> dict[int, set[float]]:
        out: dict[int, set[float]] = {}
        for k, shape in attention_launches(plan_for("tiny-gpt-oss", "bf16", "host",
                                                    kernels_dir=kernels)):
            out.setdefault(shape["window"], set()).add(k.cost.us)
        return out

    base = plan_for("tiny-gpt-oss", "bf16", "host", kernels_dir=kernels)
    rows = {shape["window"]: (k.kernel, shape, 0.5 if shape["window"] else 0.9)
            for k, shape in attention_launches(base)}
    assert sorted(rows) == [0, 8], rows  # tiny-gpt-oss: full layers and a window of 8
    # times below the model's, so the fused attention stays the plan's choice
    hw = base.hw_target.hw
    kernel, shape, _ = rows[0]
    legacy = {n: v for n, v in shape.items() if n != "window"}
    record_times(time_records([(kernel, legacy, 0.7)], hw, "test CPU", "numpy", "2026-12-01"))
    assert attention_costs() == {0: {0.7}, 8: {0.7}}
    record_times(time_records(rows.values(), hw, "test CPU", "numpy", "2026-11-01"))
    assert attention_costs() == {0: {0.9}, 8: {0.5}}


def test_the_device_a_plan_is_costed_for_counts_first(kernels: Path) -> None:
    """An H100's and an H200's records are both sm_90's: a plan costed for one device takes its
    records before the other's, whatever their dates, and the newest of the others' where it has
    none; a plan made without a device is costed for the class's representative one."""
    base = plan_for("tiny-llama", "bf16", "host", kernels_dir=kernels)
    record_family_times(kernels, base, "rmsnorm", 100.0, device="card A", date="2026-12-01")
    record_family_times(kernels, base, "rmsnorm", 300.0, device="card B", date="2026-12-03")

    def norm_cost(device):
        p = plan_for("tiny-llama", "bf16", "host", kernels_dir=kernels, device=device)
        costs = {k.cost.us for k in p.launches if k.family == "rmsnorm"}
        assert len(costs) == 1, costs
        return p, costs.pop()

    a, us = norm_cost("card A")
    assert us == 100.0 and a.cost_device == "card A"
    assert a.to_json()["cost_device"] == "card A"
    assert next(k for k in a.launches if k.family == "rmsnorm").cost.source.startswith(
        "measured: on host (card A, 2026-12-01)")
    assert norm_cost("card B")[1] == 300.0
    assert norm_cost("card C")[1] == 300.0  # none of its own: the newest
    default, us = norm_cost(None)
    assert default.cost_device == default.device and us == 300.0
    assert a.predicted_us < default.predicted_us


def test_a_record_at_another_shape_is_scaled_by_the_model(kernels: Path) -> None:
    base = plan_for("tiny-llama", "bf16", "host", kernels_dir=kernels)
    record_family_times(kernels, base, "rmsnorm", 123.0)
    p = plan_for("tiny-llama", "bf16", "host", rows=8, kernels_dir=kernels)
    k = next(k for k in p.launches if k.family == "rmsnorm")
    assert "rows=1, scaled by the model to" in k.cost.source and "rows=8" in k.cost.source
    model = CostModel.of(p.hw_target, dict(p.sizes))
    fam = p.hw_target.presentation.family("rmsnorm")
    here = model.parts(k.box, fam, k.kernel, {**dict(p.sizes), **shape_of(fam, k.box,
                                                                          dict(p.sizes))})
    there = model.parts(k.box, fam, k.kernel, {**dict(p.sizes), "rows": 1, "h": 64})
    assert 123.0 > there.us  # slower than the model: both parts at the measured ratio
    assert k.cost.us == pytest.approx(123.0 / there.us * here.us)


@pytest.mark.parametrize("ratio", [None, 2.0])
def test_a_short_kernels_record_never_prices_a_long_one_below_its_work(analytic: Path,
                                                                      ratio: float | None
                                                                      ) -> None:
    """A record faster than the model saves on the launch and pays the work's growth in full:
    Llama-3.1-8B's first norm, measured at 1 µs for one row, prices its 2,048-row prefill above
    its bytes at the bandwidth, where scaling the whole time by the model's ratio priced it at a
    fraction of them. A record slower than the model (``ratio`` times it) is slower in both
    parts alike: that ratio times the model at one shape, and at the other. (The shipped time
    records are left out: an H100's nearer the prefill's shape would price it instead.)"""
    decode = plan_for("llama-3.1-8b", "bf16", "sm_90", rows=1, kernels_dir=analytic)
    norm = next(k for k in decode.launches if k.family == "rmsnorm")
    fam = decode.hw_target.presentation.family("rmsnorm")
    one = CostModel.of(decode.hw_target, dict(decode.sizes)).parts(
        norm.box, fam, norm.kernel, {**dict(decode.sizes),
                                     **shape_of(fam, norm.box, dict(decode.sizes))})
    assert one.us > 1.0  # a record of 1 µs is faster than the model: mostly launch
    us = 1.0 if ratio is None else ratio * one.us
    record_family_times(analytic, decode, "rmsnorm", us, device="NVIDIA H200")
    prefill = plan_for("llama-3.1-8b", "bf16", "sm_90", mode="prefill", rows=2048,
                       context=2048, kernels_dir=analytic)
    big = next(k for k in prefill.launches if k.family == "rmsnorm")
    assert big.cost.kind == "measured" and "scaled by the model" in big.cost.source
    floor = big.bytes_moved / 4300e3  # µs at the H200's 4,300 GB/s
    assert floor > 5
    if ratio is None:
        assert floor < big.cost.us < floor + 1.0
    else:
        assert big.cost.us == pytest.approx(ratio * (one.launch_us + floor), rel=1e-3)


def test_a_peer_devices_record_is_scaled_to_the_costed_device(kernels: Path) -> None:
    """sm_90 knows the H100 beside its representative H200 ([[peers]]): an H100's record prices
    the H200's plan scaled by the model at the two devices' bandwidths; the H100's own plan
    takes it as is, and models what has no record at the H100's figures; a record of a device
    the class does not know is taken as is, after a known peer's (its figures cannot scale it),
    and first by that device's own plans."""
    h100 = "NVIDIA H100 80GB HBM3"
    base = plan_for("tiny-llama", "bf16", "sm_90", kernels_dir=kernels)
    record_family_times(kernels, base, "embedding", 50.0, device=h100)
    p = plan_for("tiny-llama", "bf16", "sm_90", kernels_dir=kernels)
    assert p.cost_device == "NVIDIA H200"
    k = next(k for k in p.launches if k.family == "embedding")
    fam = p.hw_target.presentation.family("embedding")
    model = CostModel.of(p.hw_target, dict(p.sizes))
    env = {**dict(p.sizes), **shape_of(fam, k.box, dict(p.sizes))}
    here = model.parts(k.box, fam, k.kernel, env)
    there = model.parts(k.box, fam, k.kernel, env, device=h100)
    assert there.us > here.us and "3030 GB/s" in there.source
    assert there.launch_us == here.launch_us
    assert there.work_us == pytest.approx(here.work_us * 4300 / 3030)
    assert 50.0 > there.us  # slower than the model: both parts at the measured ratio
    assert k.cost.us == pytest.approx(50.0 * here.us / there.us)
    assert k.cost.source.endswith("scaled by the model to NVIDIA H200"), k.cost.source
    own = plan_for("tiny-llama", "bf16", "sm_90", kernels_dir=kernels, device=h100)
    mine = next(k for k in own.launches if k.family == "embedding")
    assert mine.cost.us == 50.0 and "scaled" not in mine.cost.source
    assert all("3030 GB/s" in k.cost.source for k in own.launches if k.cost.kind == "model")
    record_family_times(kernels, base, "embedding", 7.0, device="card X", date="2026-12-09")
    p = plan_for("tiny-llama", "bf16", "sm_90", kernels_dir=kernels)
    assert next(k for k in p.launches if k.family == "embedding").cost.us == pytest.approx(
        50.0 * here.us / there.us)
    x = plan_for("tiny-llama", "bf16", "sm_90", kernels_dir=kernels, device="card X")
    assert next(k for k in x.launches if k.family == "embedding").cost.us == 7.0
    record_family_times(kernels, base, "rmsnorm", 9.0, device="card X")
    p = plan_for("tiny-llama", "bf16", "sm_90", kernels_dir=kernels)
    assert next(k for k in p.launches if k.family == "rmsnorm").cost.us == 9.0  # the only one


def test_a_peer_at_the_shape_counts_before_the_device_far_from_it(kernels: Path) -> None:
    """The devices' distance adds to the shapes': an H200 plan of 8 rows takes an H100's
    record at 8 rows (|log2(4300 / 3030)|, about 0.5) before the H200's own at one row (3),
    and the H200's at one row before the H100's at 8 for a plan of 2 rows (1 against 2.5).
    A prefill's records at 2,048 rows, nearest by device alone, priced an H200's 8-row GEMVs
    at the model's bytes and split Llama-3.1-8B's qkv where the H100's 8-row records said not
    to."""
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    one = plan_for("tiny-llama", "bf16", "sm_90", rows=1, kernels_dir=kernels)
    eight = plan_for("tiny-llama", "bf16", "sm_90", rows=8, kernels_dir=kernels)
    record_family_times(kernels, one, "rmsnorm", 1.0, device=h200)
    record_family_times(kernels, eight, "rmsnorm", 50.0, device=h100)

    def norm(rows: int):
        p = plan_for("tiny-llama", "bf16", "sm_90", rows=rows, kernels_dir=kernels)
        return next(k for k in p.launches if k.family == "rmsnorm").cost

    assert norm(8).source.startswith(f"measured: on sm_90 ({h100}, 2026-12-01) at h=64,rows=8")
    assert norm(8).source.endswith("scaled by the model to NVIDIA H200")
    assert norm(8).us > 25.0  # the H100's 50 µs at the bandwidths' ratio, not the 1 µs's
    assert norm(2).source.startswith(f"measured: on sm_90 ({h200}, 2026-12-01) at h=64,rows=1")
    assert norm(1).us == 1.0


def test_a_record_of_another_source_does_not_count(kernels: Path) -> None:
    base = plan_for("tiny-llama", "bf16", "host", kernels_dir=kernels)
    record_family_times(kernels, base, "rmsnorm", 123.0, source_hash="0" * 64)
    p = plan_for("tiny-llama", "bf16", "host", kernels_dir=kernels)
    assert all(k.cost.kind == "model" for k in p.launches if k.family == "rmsnorm")


def test_shape_metric_round_trip_and_refusals() -> None:
    shape = {"rows": 8, "k": 4096, "context": 1024}
    assert parse_shape_metric(shape_metric(shape)) == shape
    assert parse_shape_metric("bandwidth") is None
    assert parse_shape_metric("time@rows") is None
    assert parse_shape_metric("time@rows=x") is None


@pytest.mark.parametrize("line,key", [
    ("decode_buckets = [4, 1]", "cost.decode_buckets"),
    ("decode_buckets = []", "cost.decode_buckets"),
    ("launch_us = -1.0", "cost.launch_us"),
    ("vector_tflops = 0.0", "cost.vector_tflops"),
    ("launch_ms = 1.0", "cost.launch_ms"),
])
def test_a_bad_cost_table_names_the_file_and_key(kernels: Path, line: str, key: str) -> None:
    path = kernels / "sm_90" / "HARDWARE.toml"
    text = path.read_text()
    name = line.split(" =")[0]
    if f"\n{name} =" in text:
        start = text.index(f"\n{name} =") + 1
        text = text[:start] + line + text[text.index("\n", start):]
    else:
        text = text.replace("\n[cost]\n", f"\n[cost]\n{line}\n")
    path.write_text(text)
    with pytest.raises((ConfigError, ManyErrors)) as e:
        load_hardware(kernels)
    assert key in str(e.value) and "sm_90" in str(e.value), str(e.value)


def test_every_class_declares_its_buckets_and_rates() -> None:
    for c in load_hardware():
        assert c.cost is not None and c.cost.buckets[0] == 1, c.name
        assert c.cost.vector_tflops > 0 and c.cost.launch_us >= 0
    assert load_hardware().get("sm_90").cost.bucket(3) == 4


def test_the_plan_json_carries_costs_and_the_search() -> None:
    doc = plan_for("tiny-qwen3", "bf16", "host", rows=3).to_json()
    assert doc["predicted_us"] == pytest.approx(
        sum(k["cost"]["us"] for k in doc["kernels"] if not k["view"]))
    assert all(k["cost"]["source"] and k["cost"]["kind"] in ("model", "view")
               for k in doc["kernels"])
    s = doc["search"]
    assert s["bucket"] == 4 and s["shape"] in s["shapes"] and s["sites"]
    assert all(x["alternatives"] == 2 ** len(x["relations"]) for x in s["sites"])
    json.dumps(doc, allow_nan=False)  # every number is finite JSON


def test_met_plan_costs_snapshot(capsys, analytic: Path) -> None:
    from metrale.cli import main

    assert main(["plan", "tiny-qwen3", "--hardware", "sm_90", "--costs", "--kernels",
                 str(analytic)]) == 0
    out = capsys.readouterr().out
    snap = SNAPSHOTS / "plan_costs_tiny_qwen3_sm90.txt"
    assert out == snap.read_text(encoding="utf-8")


ROW_SAMPLE = (*range(1, 72), 120, 127, 128, 129, 200, 255, 256, 257, 300, 383, 384, 385, 520)


@pytest.mark.parametrize("hw", ["sm_80", "sm_90", "sm_120"])
def test_a_launch_runs_from_a_row_count_on_so_row_tiles_may_bisect(hw: str) -> None:
    """The cost model finds the fewest rows at which a launch runs by bisection (first_rows),
    which holds only where the rows a launch runs at, up to any count, are those from some
    count on. Every table's rules keep to that: at each family's example sizes, each launch of
    each kernel's chain, row by row (every count to 71, then around the tables' thresholds), is
    empty, then runs, then may be empty again, and never empty between two counts it runs at.
    The example sizes are small, and some rules choose by them (a GEMV's columns past 1024), so
    each kernel is also checked with its matrices at Llama-3.1-8B's width."""
    from metrale.lkb.errors import LaunchError
    from metrale.lkb.presentation import Presentation
    from metrale.realize.functor import realization

    F, P = realization(hw), Presentation.load()
    checked = 0
    for fam in P.generators:
        if "rows" not in dict(fam.example):
            continue
        attrs = {a: v for a, v in fam.attr_examples
                 if isinstance(v, int | float) and not isinstance(v, bool)}
        example = dict(fam.example)
        wide = {**example, **{d: 4096 for d in ("k", "n", "nq", "h") if d in example},
                **({"n2": 8192} if "n2" in example else {})}
        for point in fam.points:
            kernel = F.realize(point)
            if kernel is None or kernel.launch is None:
                continue
            for dims in (example, wide):
                runs: list[tuple[bool, ...] | None] = []
                for r in ROW_SAMPLE:
                    sizes = {**attrs, **dims, "rows": r}
                    if "slots" in sizes:
                        sizes["slots"] = max(sizes["slots"], r)
                    try:
                        runs.append(tuple(0 not in s[0] for s in kernel.chain_shapes(sizes)))
                    except LaunchError:
                        runs.append(None)
                for i in range(1 + len(kernel.then)):
                    at = [j for j, ran in enumerate(runs) if ran is not None and ran[i]]
                    gaps = [ROW_SAMPLE[j] for j in range(at[0], at[-1] + 1)
                            if runs[j] is not None and not runs[j][i]] if at else []
                    assert not gaps, (hw, kernel.entry, i, gaps)
                    checked += bool(at)
    assert checked > 200, checked

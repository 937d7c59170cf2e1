"""Evidence records: status rules, partial loads of damaged files, format-preserving appends."""

import datetime
import sys
from pathlib import Path

import attrs
import pytest

from metrale.lkb.errors import ConfigError, EvidenceError
from metrale.realize.evidence import (
    SHARED,
    STALE,
    UNREADABLE,
    EvidenceLoad,
    EvidenceRecord,
    append_records,
    evidence_status,
    find_record,
    hash_source,
    load_all_evidence,
    load_evidence,
    measured_on,
    write_export,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from stale_evidence import (  # noqa: E402
    MODELS,
    PARTLY,
    POLICIES,
    QUANTS,
    STEPS,
    awaiting_device,
    stale_kernels,
    unmeasured,
)

H = hash_source("__global__ void rmsnorm() {}")


def rec(**kw) -> EvidenceRecord:
    base = dict(hw="sm_90", device="NVIDIA H200", family="rmsnorm", point="rmsnorm[bf16,4096]",
                metric="time", value=3.25, floor=2.5, unit="us", date="2025-06-01",
                toolchain="nvcc 13.0.88", source_hash=H)
    base.update(kw)
    return EvidenceRecord(**base)


# --- status rules ----------------------------------------------------------------------------

def test_measured_only_on_the_recording_class_with_matching_hash() -> None:
    rs = [rec()]
    assert evidence_status(rs, "sm_90", "rmsnorm", "rmsnorm[bf16,4096]", H) == "measured on sm_90"
    assert evidence_status(rs, "sm_90", "rmsnorm", "rmsnorm[bf16,4096]", "0" * 64) == STALE
    assert evidence_status(rs, "sm_80", "rmsnorm", "rmsnorm[bf16,4096]", H) == SHARED
    assert evidence_status(rs, "sm_90", "rmsnorm", "rmsnorm[bf16,8192]", H) == SHARED
    assert evidence_status(rs, "sm_90", "add_rmsnorm", "rmsnorm[bf16,4096]", H) == SHARED
    assert evidence_status([], "sm_90", "rmsnorm", "p", H) == SHARED


def test_one_current_record_beats_stale_ones() -> None:
    rs = [rec(source_hash="old", date="2025-01-01"), rec()]
    assert evidence_status(rs, "sm_90", "rmsnorm", "rmsnorm[bf16,4096]", H) == measured_on("sm_90")
    assert find_record(rs, "sm_90", "rmsnorm", "rmsnorm[bf16,4096]", H) == rs[1]
    assert find_record(rs, "sm_80", "rmsnorm", "rmsnorm[bf16,4096]", H) is None


def test_find_record_takes_the_latest() -> None:
    rs = [rec(value=4.0, date="2025-01-01"), rec(value=3.0, date="2025-03-01"),
          rec(value=5.0, date="2025-02-01")]
    assert find_record(rs, "sm_90", "rmsnorm", "rmsnorm[bf16,4096]", H).value == 3.0


def test_unreadable_wins_where_damage_may_concern_the_kernel() -> None:
    load = EvidenceLoad((rec(),), (EvidenceError("x"),), (("sm_90", "rmsnorm", None),))
    assert evidence_status(load, "sm_90", "rmsnorm", "rmsnorm[bf16,4096]", H) == UNREADABLE
    assert evidence_status(load, "sm_90", "rope", "p", H) == SHARED
    assert evidence_status(load, "sm_80", "rmsnorm", "p", H) == SHARED


def test_record_values_are_validated() -> None:
    with pytest.raises(ConfigError, match="not a finite number"):
        rec(value=float("nan"))
    with pytest.raises(ConfigError, match="not an ISO date"):
        rec(date="June 1st")
    assert rec(date=datetime.date(2025, 6, 1)).date == "2025-06-01"
    assert rec(floor=None).floor is None and rec(value=3).value == 3.0


# --- loading ---------------------------------------------------------------------------------

GOOD = """# Evidence for sm_90
[[record]]
hw = "sm_90"
device = "NVIDIA H200"
family = "rmsnorm"
point = "rmsnorm[bf16,4096]"
metric = "time"
value = 3.25
floor = 2.5
unit = "us"
date = 2025-06-01
toolchain = "nvcc 13.0.88"
source_hash = "{h}"
"""


def write(tmp_path: Path, text: str, hw: str = "sm_90") -> Path:
    p = tmp_path / "kernels" / hw / "EVIDENCE.toml"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def test_good_file_loads_with_native_toml_date(tmp_path: Path) -> None:
    load = load_evidence(write(tmp_path, GOOD.format(h=H)), hw="sm_90")
    assert load.ok and load.records == (rec(),)


def test_missing_file_is_no_evidence(tmp_path: Path) -> None:
    load = load_evidence(tmp_path / "nope.toml")
    assert load.ok and load.records == ()


def test_invalid_records_give_errors_and_a_partial_load(tmp_path: Path) -> None:
    bad_value = GOOD.format(h=H).split("\n", 1)[1].replace("value = 3.25", 'value = "fast"')
    bad_value = bad_value.replace('family = "rmsnorm"', 'family = "rope"')
    bad_key = GOOD.format(h=H).split("\n", 1)[1].replace('unit = "us"', 'units = "us"')
    bad_key = bad_key.replace('family = "rmsnorm"', 'family = "swiglu"')
    p = write(tmp_path, GOOD.format(h=H) + bad_value + bad_key)
    load = load_evidence(p, hw="sm_90")
    assert load.records == (rec(),)
    assert len(load.errors) == 3  # wrong type; unknown key; the missing key it replaced
    assert all(isinstance(e, EvidenceError) and e.file == str(p) for e in load.errors)
    keys = sorted(e.key for e in load.errors)
    assert keys == ["record[1].value", "record[2].unit", "record[2].units"]
    units = next(e for e in load.errors if e.key == "record[2].units")
    assert units.suggestion == "unit"
    # the plan still prints: the good kernel is measured, the damaged ones say so
    assert evidence_status(load, "sm_90", "rmsnorm", "rmsnorm[bf16,4096]", H) == "measured on sm_90"
    assert evidence_status(load, "sm_90", "rope", "rmsnorm[bf16,4096]", H) == UNREADABLE
    assert evidence_status(load, "sm_90", "swiglu", "rmsnorm[bf16,4096]", H) == UNREADABLE
    assert evidence_status(load, "sm_90", "embed", "e", H) == SHARED


def test_syntax_error_makes_the_whole_class_unreadable(tmp_path: Path) -> None:
    p = write(tmp_path, GOOD.format(h=H) + "\nvalue = = 3\n")
    load = load_evidence(p, hw="sm_90")
    assert load.records == () and len(load.errors) == 1
    e = load.errors[0]
    assert isinstance(e, EvidenceError) and e.line is not None and "syntax" in str(e)
    assert evidence_status(load, "sm_90", "anything", "p", H) == UNREADABLE
    assert evidence_status(load, "sm_80", "anything", "p", H) == SHARED


def test_record_of_another_class_is_an_error(tmp_path: Path) -> None:
    p = write(tmp_path, GOOD.format(h=H).replace('hw = "sm_90"', 'hw = "sm_80"'))
    load = load_evidence(p, hw="sm_90")
    assert load.records == ()
    assert load.errors[0].key == "record[0].hw" and "another class" in str(load.errors[0])
    assert evidence_status(load, "sm_90", "rmsnorm", "rmsnorm[bf16,4096]", H) == UNREADABLE


def test_unknown_top_level_key(tmp_path: Path) -> None:
    load = load_evidence(write(tmp_path, "[[recrod]]\nhw = 'x'\n"), hw="sm_90")
    assert load.errors[0].suggestion == "record" and load.records == ()


def test_load_all_evidence_checks_each_folder(tmp_path: Path) -> None:
    write(tmp_path, GOOD.format(h=H), "sm_90")
    write(tmp_path, GOOD.format(h=H), "sm_80")  # says sm_90 inside sm_80's folder
    load = load_all_evidence(tmp_path / "kernels", store=None)
    assert load.records == (rec(),)
    assert len(load.errors) == 1 and "sm_80" in load.errors[0].file


def test_a_plan_reads_only_its_own_points_of_the_export(tmp_path: Path, monkeypatch) -> None:
    """The shipped export is read lazily: asking for one point parses that point's lines and no
    other; an export rewritten (the file replaced) is seen at once."""
    import tomllib

    p = tmp_path / "kernels" / "sm_90" / "EVIDENCE.toml"
    rs = [rec(point=f"rmsnorm[bf16,{n}]") for n in (1024, 2048, 4096)]
    write_export(p, "sm_90", rs)
    parsed: list[str] = []
    real = tomllib.loads
    monkeypatch.setattr(tomllib, "loads", lambda text, **k: parsed.append(text) or real(text, **k))
    first = load_all_evidence(tmp_path / "kernels", store=None)
    assert evidence_status(first, "sm_90", "rmsnorm", "rmsnorm[bf16,4096]", H) == \
        measured_on("sm_90")
    assert len(parsed) == 1 and "rmsnorm[bf16,4096]" in parsed[0]
    assert evidence_status(first, "sm_90", "rmsnorm", "rmsnorm[bf16,512]", H) == SHARED
    again = load_all_evidence(tmp_path / "kernels", store=None)  # unchanged: nothing re-read
    assert evidence_status(again, "sm_90", "rmsnorm", "rmsnorm[bf16,4096]", H) == \
        measured_on("sm_90")
    assert len(parsed) == 1
    write_export(p, "sm_90", [*rs, rec(point="rmsnorm[bf16,512]")])
    after = load_all_evidence(tmp_path / "kernels", store=None)
    assert evidence_status(after, "sm_90", "rmsnorm", "rmsnorm[bf16,512]", H) == \
        measured_on("sm_90")
    monkeypatch.undo()
    assert after.load().records == (*rs, rec(point="rmsnorm[bf16,512]"))  # sorted by point


def test_a_damaged_export_line_concerns_its_point_only(tmp_path: Path) -> None:
    p = tmp_path / "kernels" / "sm_90" / "EVIDENCE.toml"
    write_export(p, "sm_90", [rec(), rec(point="rmsnorm[bf16,8192]")])
    lines = p.read_text().splitlines()
    n = next(i for i, ln in enumerate(lines) if "8192" in ln)
    lines[n] = lines[n].replace("value = 3.25", 'value = "fast"')
    p.write_text("\n".join(lines) + "\n")
    load = load_all_evidence(tmp_path / "kernels", store=None)
    assert evidence_status(load, "sm_90", "rmsnorm", "rmsnorm[bf16,4096]", H) == \
        measured_on("sm_90")
    assert evidence_status(load, "sm_90", "rmsnorm", "rmsnorm[bf16,8192]", H) == UNREADABLE
    (e,) = load.errors
    assert isinstance(e, EvidenceError) and e.file == str(p) and e.line == n + 1
    assert e.key == "record.value"


def test_a_file_in_the_old_layout_is_read_whole(tmp_path: Path) -> None:
    """``[[record]]`` tables (the layout ``met bench --record`` appended before the store)
    still count: a file not in the export's layout is parsed whole."""
    second = GOOD.format(h=H).split("\n", 1)[1].replace("4096", "8192")
    write(tmp_path, GOOD.format(h=H) + second)
    load = load_all_evidence(tmp_path / "kernels", store=None)
    for n in (4096, 8192):
        assert evidence_status(load, "sm_90", "rmsnorm", f"rmsnorm[bf16,{n}]", H) == \
            measured_on("sm_90")
    assert len(load.records) == 2 and load.ok


def test_export_keeps_shapes_and_refuses_another_class(tmp_path: Path) -> None:
    p = tmp_path / "E.toml"
    shaped = rec(shape="rows=8,context=1024")
    write_export(p, "sm_90", [shaped, rec()])
    assert load_evidence(p, hw="sm_90").records == (rec(), shaped)
    with pytest.raises(ConfigError, match="another class"):
        write_export(p, "sm_80", [rec()])


# --- appending -------------------------------------------------------------------------------

def test_append_creates_then_round_trips(tmp_path: Path) -> None:
    p = tmp_path / "kernels" / "sm_90" / "EVIDENCE.toml"
    rs = [rec(), rec(point="rmsnorm[bf16,8192]", floor=None, value=6.0)]
    append_records(p, rs[:1])
    append_records(p, rs[1:])
    load = load_evidence(p, hw="sm_90")
    assert load.ok and load.records == tuple(rs)
    assert p.read_text().startswith("# Evidence for hardware class sm_90")


def test_append_keeps_comments_and_layout(tmp_path: Path) -> None:
    original = GOOD.format(h=H).replace("value = 3.25", "value = 3.25  # median of 100 runs")
    original += "\n# trailing note kept by hand\n"
    p = write(tmp_path, original)
    append_records(p, [rec(point="rmsnorm[bf16,8192]")])
    text = p.read_text()
    assert text.startswith(original.rstrip("\n").split("# trailing")[0].rstrip("\n"))
    assert "value = 3.25  # median of 100 runs" in text
    assert "# trailing note kept by hand" in text
    assert "# Evidence for sm_90" in text
    load = load_evidence(p, hw="sm_90")
    assert load.ok and [r.point for r in load.records] == ["rmsnorm[bf16,4096]",
                                                          "rmsnorm[bf16,8192]"]
    assert not list(p.parent.glob("*.tmp"))


def test_append_refuses_an_unparseable_file_and_leaves_it(tmp_path: Path) -> None:
    p = write(tmp_path, "record = = 1\n")
    with pytest.raises(EvidenceError, match="unparseable"):
        append_records(p, [rec()])
    assert p.read_text() == "record = = 1\n"


def test_append_refuses_records_it_could_not_read_back(tmp_path: Path) -> None:
    p = tmp_path / "E.toml"
    with pytest.raises(EvidenceError, match="must not be empty"):
        append_records(p, [attrs.evolve(rec(), family=" ")])
    assert not p.exists()


def test_two_processes_appending_at_once_keep_every_record(tmp_path):
    """Concurrent appends (four processes, five records each) lose nothing."""
    import multiprocessing as mp

    path = tmp_path / "sm_90" / "EVIDENCE.toml"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_append_five, args=(str(path), w)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    loaded = load_evidence(path, hw="sm_90")
    assert not loaded.errors
    assert sorted(r.value for r in loaded.records) == sorted(
        float(w * 10 + i) + 1 for w in range(4) for i in range(5))


def _append_five(path: str, worker: int) -> None:
    for i in range(5):
        append_records(path, [EvidenceRecord("sm_90", "NVIDIA H200", "add", f"add[w{worker}]",
                                             "bandwidth", worker * 10 + i + 1, None, "GB/s",
                                             "2026-11-29", "nvcc 13.0", "ab")])


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("policy", POLICIES)
def test_the_shipped_evidence_measures_every_kernel_of_the_benchmarked_plans(model, policy):
    """Every kernel the sm_90 decode (1 and 8 rows) and prefill plans (every row's logits or
    the last row's) of the benchmarked models (a dense qwen3, a llama and the qwen3_moe)
    launch, in bf16, fp8, mxfp4 and nvfp4 under either policy, has a record whose source hash
    matches the kernel's source today: a kernel edited without a new record run shows here as
    unmeasured, listed by benchmarks/stale_evidence.py under the first plan that launches it,
    unless kernels/sm_90/AWAITING_DEVICE.toml lists its source as awaiting a device run."""
    left = unmeasured("sm_90", [model], policies=[policy], awaiting=awaiting_device("sm_90"))
    assert not left, left


@pytest.mark.parametrize("model, quants, steps", PARTLY, ids=[m for m, _, _ in PARTLY])
@pytest.mark.parametrize("policy", POLICIES)
def test_the_shipped_evidence_measures_the_partly_benchmarked_models_steps(model, quants, steps,
                                                                           policy):
    """gpt-oss-20b's decode in its published format (mxfp4) under either policy: its kernels'
    records are held current as the benchmarked models' are (its router and experts share
    sources with no other model's plans, so an edit there shows only here)."""
    left = unmeasured("sm_90", [model], quants, [policy], awaiting=awaiting_device("sm_90"),
                      steps=steps)
    assert not left, left


@pytest.mark.parametrize("source", sorted(awaiting_device("sm_90")))
def test_a_source_awaiting_a_device_run_is_one_whose_records_are_stale(source):
    """The sources listed as awaiting a device run are exactly ones whose records are stale:
    with every other listed source excused, this one still leaves kernels of the benchmarked
    plans unmeasured (once a device run records it again, its entry must leave the list). The
    walk stops at the first such kernel, planning the fewest steps first: gpt-oss's decode, then
    the MoE qwen3's plans, then the dense one's."""
    others = set(awaiting_device("sm_90")) - {source}
    walks = [([m], q, st) for m, q, st in PARTLY] + [(["qwen3-30b-a3b"], QUANTS, STEPS),
                                                    (["qwen3-0.6b"], QUANTS, STEPS)]
    assert any(next(stale_kernels("sm_90", ms, q, awaiting=others, steps=st), None)
               for ms, q, st in walks), source

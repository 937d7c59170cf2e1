"""The evidence store: SQLite in the cache directory, atomic, safe with concurrent writers and
killed ones, a damaged file named and rebuilt; ``met evidence`` over it."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sqlite3
import sys
from pathlib import Path

import pytest

from metrale.cli import main
from metrale.lkb.errors import EvidenceError
from metrale.realize.evidence import (
    UNREADABLE,
    EvidenceRecord,
    append_records,
    evidence_status,
    load_all_evidence,
    load_evidence,
    measured_on,
    record_evidence,
)
from metrale.realize.evidence_store import EvidenceStore, default_store_path
from metrale.realize.functor import realization
from metrale.realize.hardware import default_kernels_dir


def rec(i: int = 0, **kw) -> EvidenceRecord:
    base = dict(hw="sm_90", device="NVIDIA H200", family="add", point=f"add[w{i}]",
                metric="bandwidth", value=float(i + 1), floor=4300.0, unit="GB/s",
                date="2026-12-01", toolchain="nvcc 13.0", source_hash="ab" * 32)
    base.update(kw)
    return EvidenceRecord(**base)


@pytest.fixture
def store(tmp_path, monkeypatch) -> EvidenceStore:
    path = tmp_path / "cache" / "evidence.sqlite"
    monkeypatch.setenv("METRALE_EVIDENCE", str(path))
    return EvidenceStore(path)


def test_the_store_lives_in_the_cache_root(monkeypatch, tmp_path):
    monkeypatch.delenv("METRALE_EVIDENCE")
    monkeypatch.setenv("METRALE_CACHE", str(tmp_path / "c"))
    assert default_store_path() == tmp_path / "c" / "evidence.sqlite"


def test_records_are_stored_once_indexed_and_read_by_point(store):
    assert store.records() == () and not store.path.exists()  # reading creates nothing
    assert store.add([rec(0), rec(1), rec(0)]) == 2
    assert store.add([rec(1), rec(2, shape="rows=8")]) == 1
    assert store.records_of("sm_90", "add", "add[w1]") == (rec(1),)
    assert store.records_of("sm_90", "add", "add[w2]") == (rec(2, shape="rows=8"),)
    assert store.records_of("sm_80", "add", "add[w1]") == ()
    with sqlite3.connect(store.path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        (cols,) = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'record_by_point'")
        assert "(hw, point, source_hash, shape)" in cols[0]
        plan = conn.execute("EXPLAIN QUERY PLAN SELECT * FROM record WHERE hw = 'sm_90' AND "
                            "point = 'add[w1]' AND family = 'add'").fetchall()
    assert "record_by_point" in str(plan)


def test_a_plan_counts_the_stores_records_on_their_class(store):
    F = realization("sm_90")
    k = next(k for k in F.kernels() if k.point.family == "rmsnorm")
    fresh = rec(family="rmsnorm", point=str(k.point), source_hash=k.source_hash)
    empty = load_all_evidence(default_kernels_dir(), store=None)
    record_evidence([fresh])
    assert store.records_of("sm_90", "rmsnorm", str(k.point)) == (fresh,)
    load = load_all_evidence(default_kernels_dir())
    assert evidence_status(load, "sm_90", "rmsnorm", str(k.point), k.source_hash) == \
        measured_on("sm_90")
    assert fresh in load.records_of("sm_90", "rmsnorm", str(k.point))
    assert fresh not in empty.records_of("sm_90", "rmsnorm", str(k.point))


def test_two_processes_recording_at_once_keep_every_record(store):
    """Two writers, twenty transactions each, started together: nothing lost, nothing twice."""
    ctx = mp.get_context("fork")
    start = ctx.Barrier(2)
    procs = [ctx.Process(target=_record_twenty, args=(str(store.path), w, start))
             for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    got = sorted(r.point for r in store.records())
    assert got == sorted(f"add[w{w * 100 + i}]" for w in range(2) for i in range(20))


def _record_twenty(path: str, worker: int, start) -> None:
    start.wait(30)
    for i in range(20):
        EvidenceStore(path).add([rec(worker * 100 + i)])


def test_a_writer_killed_mid_record_leaves_the_store_whole(store):
    """SIGKILL while a transaction of many records is open (some already inserted): the store
    opens, is intact, holds what was committed before and none of the killed call's records;
    the next writer is not blocked."""
    store.add([rec(0)])
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_record_forever, args=(str(store.path), ready))
    child.start()
    try:
        assert ready.wait(60), "the writer never reached the middle of its transaction"
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
    finally:
        if child.is_alive():
            child.kill()
    assert child.exitcode == -signal.SIGKILL
    store.check()
    assert store.records() == (rec(0),)
    assert store.add([rec(1)]) == 1
    assert [r.point for r in store.records()] == ["add[w0]", "add[w1]"]


def _record_forever(path: str, ready) -> None:
    def records():
        for i in range(1, 1_000_000):
            if i == 20_000:  # the transaction is open and holds 20,000 rows: kill it here
                ready.set()
                signal.pause()
            yield rec(i, device="NVIDIA H200 " + "x" * 200)

    EvidenceStore(path).add(records())


def test_a_damaged_store_is_named_and_rebuilt_from_the_shipped_evidence(store, capsys):
    store.path.parent.mkdir(parents=True)
    store.path.write_bytes(b"this is not an SQLite file\n" * 64)
    with pytest.raises(EvidenceError, match="met evidence rebuild") as e:
        store.records()
    assert e.value.file == str(store.path)
    with pytest.raises(EvidenceError, match="not a readable evidence store"):
        record_evidence([rec(0)])
    assert main(["evidence", "list"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(store.path) in err and "rebuild" in err
    # a plan still prints: the kernels the store may concern say their evidence is unreadable
    F = realization("sm_90")
    k = next(k for k in F.kernels() if k.point.family == "rmsnorm")
    load = load_all_evidence(default_kernels_dir())
    assert evidence_status(load, "sm_90", "rmsnorm", str(k.point), k.source_hash) == UNREADABLE
    assert any(str(store.path) in str(x) for x in load.errors)

    assert main(["evidence", "rebuild"]) == 0
    out = capsys.readouterr().out
    aside = store.path.with_name("evidence.sqlite.damaged-1")
    assert aside.read_bytes().startswith(b"this is not") and str(aside) in out
    shipped = load_evidence(default_kernels_dir() / "sm_90" / "EVIDENCE.toml", hw="sm_90")
    assert set(store.records()) == set(shipped.records) and shipped.records
    store.check()


def test_rebuild_keeps_what_can_be_read_of_the_old_store(store):
    store.add([rec(0), rec(1)])
    aside, salvaged, total = store.rebuild([rec(2)])
    assert aside is not None and salvaged == 2 and total == 3
    assert sorted(r.point for r in store.records()) == ["add[w0]", "add[w1]", "add[w2]"]


def test_met_evidence_imports_lists_exports_and_prunes(store, tmp_path, capsys):
    """Records in the layout ``met bench --record`` appended before the store import; the
    export keeps what counts (current source, latest per point, metric and shape); prune
    deletes the rest from the store."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from stale_evidence import awaiting_device

    F = realization("sm_90")
    awaiting = set(awaiting_device("sm_90"))
    shipped_points = {r.point for r in load_evidence(
        default_kernels_dir() / "sm_90" / "EVIDENCE.toml", hw="sm_90").records}
    # a kernel with a shipped record of its current source, so the later import supersedes it
    k = next(k for k in F.kernels() if k.point.family in ("rmsnorm", "add_rmsnorm", "embedding")
             and k.source not in awaiting and str(k.point) in shipped_points)
    fam = k.point.family
    old = tmp_path / "records.toml"
    current = rec(family=fam, point=str(k.point), source_hash=k.source_hash,
                  date="2027-01-02", value=1000.0)  # later than the shipped record
    older = rec(family=fam, point=str(k.point), source_hash=k.source_hash,
                date="2027-01-01", value=900.0)
    stale = rec(family=fam, point=str(k.point), source_hash="00" * 32, date="2027-01-03")
    append_records(old, [older, current, stale])
    assert main(["evidence", "import", str(old)]) == 0
    assert "imported 3 new of 3" in capsys.readouterr().out
    assert main(["evidence", "import", str(old)]) == 0
    assert "imported 0 new of 3" in capsys.readouterr().out

    assert main(["evidence", "list", "--hardware", "sm_90", "--format", "json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    rows = {(r["value"], r["from"]): r["status"] for r in listed}
    assert rows[(1000.0, "store")] == "counts"
    assert rows[(900.0, "store")] == "superseded"
    assert rows[(stale.value, "store")] == "stale"
    shipped = {(r["point"], r["metric"], r["source_hash"]): r["status"] for r in listed
               if r["from"] == "shipped"}
    # superseded by the later record imported (of its point and metric; the point's records of
    # other metrics, or shapes, still count)
    assert shipped.pop((str(k.point), current.metric, k.source_hash)) == "superseded"
    # the shipped records count where they measured the kernel's current source, else are stale
    # (a source edited since, awaiting a device run)
    source_hash = {str(k.point): k.source_hash for k in F.kernels()}
    assert shipped and all(status == ("counts" if source_hash.get(p) == h else "stale")
                           for (p, _, h), status in shipped.items()), shipped

    out = tmp_path / "EVIDENCE.toml"
    assert main(["evidence", "export", "--hardware", "sm_90", "--out", str(out)]) == 0
    exported = load_evidence(out, hw="sm_90").records
    mine = [r for r in exported if r.point == str(k.point) and r.metric == current.metric]
    assert mine == [current]  # the point's records of other metrics (shapes) stay beside it
    assert older not in exported and stale not in exported

    assert main(["evidence", "prune", "--dry-run"]) == 0
    assert "would delete 2 " in capsys.readouterr().out and len(store.records()) == 3
    assert main(["evidence", "prune"]) == 0
    assert "deleted 2 " in capsys.readouterr().out
    assert store.records() == (current,)


def test_import_refuses_a_damaged_file_whole(store, tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[record]]\nhw = "sm_90"\n')
    assert main(["evidence", "import", str(bad)]) == 3
    assert str(bad) in capsys.readouterr().err and store.records() == ()

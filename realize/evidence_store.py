"""The evidence store: the records a user measures, in SQLite in the cache directory.

``met bench --record`` (and any other recording) adds records here, never to the installed
package. The file is ``$METRALE_EVIDENCE`` if set, else ``evidence.sqlite`` in the cache root
(``$METRALE_CACHE``, ``$XDG_CACHE_HOME/metrale`` or ``~/.cache/metrale``, as the build cache).

- Indexed by class, point, source hash and shape: a plan asks for its own points only.
- Atomic: a call to :meth:`EvidenceStore.add` is one transaction, all of its records or none;
  a process killed mid-write leaves the store as it was before the call.
- Concurrent writers: write-ahead log, a busy timeout, and ``BEGIN IMMEDIATE`` transactions,
  so writers queue instead of failing; readers never wait on them.
- A record is stored once: its digest (every field) is unique, so importing twice adds nothing.
- A file that is not a readable store raises :class:`~metrale.lkb.errors.EvidenceError`
  naming it; ``met evidence rebuild`` sets it aside and makes a new store.

>>> import tempfile, pathlib
>>> from metrale.realize.evidence import EvidenceRecord
>>> store = EvidenceStore(pathlib.Path(tempfile.mkdtemp()) / "evidence.sqlite")
>>> r = EvidenceRecord("sm_90", "NVIDIA H200", "rmsnorm", "rmsnorm[act=bf16]", "bandwidth",
...                    2000.0, 4300.0, "GB/s", "2026-12-01", "nvcc 13.0", "ab12")
>>> store.add([r, r])            # the same record twice is stored once
1
>>> store.records_of("sm_90", "rmsnorm", "rmsnorm[act=bf16]") == (r,)
True
>>> store.records_of("sm_80", "rmsnorm", "rmsnorm[act=bf16]")
()
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs

from metrale.lkb.errors import EvidenceError

STORE_FILE = "evidence.sqlite"
SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 60.0
"""How long a writer waits for another writer's transaction before it gives up."""

_FIELDS = ("hw", "device", "family", "point", "shape", "metric", "value", "floor", "unit",
           "date", "toolchain", "source_hash")
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS record (
    id INTEGER PRIMARY KEY,
    digest TEXT NOT NULL UNIQUE,
    hw TEXT NOT NULL, device TEXT NOT NULL, family TEXT NOT NULL, point TEXT NOT NULL,
    shape TEXT NOT NULL, metric TEXT NOT NULL, value REAL NOT NULL, floor REAL,
    unit TEXT NOT NULL, date TEXT NOT NULL, toolchain TEXT NOT NULL, source_hash TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS record_by_point ON record (hw, point, source_hash, shape);
PRAGMA user_version = {SCHEMA_VERSION};
"""


def _set_up(conn: Any, version: int) -> None:
    """WAL, and the schema where the file is new. Two writers opening a new store at once race
    for the journal-mode switch, which SQLite answers "locked" at once rather than through the
    busy handler: the loser waits and tries again, within the busy timeout."""
    import sqlite3
    import time

    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")  # in WAL: a crash loses no commit
            if version == 0:
                conn.executescript(_SCHEMA)  # idempotent: IF NOT EXISTS, then the version
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def default_store_path() -> Path:
    """``$METRALE_EVIDENCE``, else ``evidence.sqlite`` in the cache root."""
    if os.environ.get("METRALE_EVIDENCE"):
        return Path(os.environ["METRALE_EVIDENCE"]).expanduser()
    from metrale.realize.cache import default_cache_root

    return default_cache_root() / STORE_FILE


def record_digest(record) -> str:
    """SHA-256 of every field of ``record``: the key that stores a record once."""
    fields = attrs.asdict(record)
    return hashlib.sha256(json.dumps([fields[k] for k in _FIELDS]).encode()).hexdigest()


def _unreadable(path: Path, e: BaseException) -> EvidenceError:
    return EvidenceError(f"not a readable evidence store ({e}); `met evidence rebuild` sets it "
                         "aside and makes a new one from the shipped evidence", file=path)


@attrs.frozen
class EvidenceStore:
    """The SQLite file of recorded evidence at ``path``; see the module. Reading a store that
    does not exist finds nothing and creates nothing."""

    path: Path = attrs.field(converter=Path)

    @classmethod
    def default(cls) -> EvidenceStore:
        """The user's store (:func:`default_store_path`)."""
        return cls(default_store_path())

    @contextlib.contextmanager
    def _connect(self, write: bool) -> Iterator[Any]:
        import sqlite3  # here, not at import: a plan with no store never loads it

        if write:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = None
        try:
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise EvidenceError("evidence store of another schema version", file=self.path,
                                    expected=SCHEMA_VERSION, found=version)
            if write:
                _set_up(conn, version)
            yield conn
        except sqlite3.DatabaseError as e:
            raise _unreadable(self.path, e) from None
        finally:
            if conn is not None:
                conn.close()

    def add(self, records: Iterable) -> int:
        """Store ``records`` in one transaction; returns how many were new.

        >>> EvidenceStore("/nonexistent/dir/e.sqlite").records()  # reading creates nothing
        ()
        """
        def row(r) -> tuple:
            fields = attrs.asdict(r)
            return (record_digest(r), *(fields[k] for k in _FIELDS))

        rows = (row(r) for r in records)  # consumed inside the transaction
        with self._connect(write=True) as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                before = conn.total_changes
                conn.executemany(
                    f"INSERT OR IGNORE INTO record (digest, {', '.join(_FIELDS)}) "
                    f"VALUES ({', '.join('?' * (len(_FIELDS) + 1))})", rows)
                added = conn.total_changes - before
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return added

    def _select(self, where: str = "", args: tuple = ()) -> tuple:
        from metrale.realize.evidence import EvidenceRecord

        if not self.path.is_file():
            return ()
        with self._connect(write=False) as conn:
            if conn.execute("PRAGMA user_version").fetchone()[0] == 0:
                return ()  # created by another process that has not made its tables yet
            rows = conn.execute(f"SELECT {', '.join(_FIELDS)} FROM record {where} ORDER BY id",
                                args).fetchall()
        return tuple(EvidenceRecord(**dict(zip(_FIELDS, row))) for row in rows)

    def records_of(self, hw: str, family: str, point: str) -> tuple:
        """The records of ``point`` of ``family`` on class ``hw``, oldest first."""
        return self._select("WHERE hw = ? AND point = ? AND family = ?", (hw, point, family))

    def records(self, hw: str | None = None) -> tuple:
        """Every record (of class ``hw``), oldest first."""
        return self._select(*(("WHERE hw = ?", (hw,)) if hw else ()))

    def remove(self, records: Iterable) -> int:
        """Delete ``records`` in one transaction; returns how many were there."""
        digests = [(record_digest(r),) for r in records]
        if not self.path.is_file():
            return 0
        with self._connect(write=True) as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                before = conn.total_changes
                conn.executemany("DELETE FROM record WHERE digest = ?", digests)
                removed = conn.total_changes - before
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return removed

    def check(self) -> None:
        """Raise :class:`EvidenceError` naming the file unless SQLite finds it intact."""
        if not self.path.is_file():
            return
        with self._connect(write=False) as conn:
            result = conn.execute("PRAGMA integrity_check").fetchall()
        if result != [("ok",)]:
            raise _unreadable(self.path, RuntimeError("; ".join(r[0] for r in result[:3])))

    def salvage(self) -> tuple:
        """Whatever records can still be read from a damaged store, row by row (may be none)."""
        import sqlite3

        from metrale.realize.evidence import EvidenceRecord

        out = []
        try:
            conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
        except sqlite3.DatabaseError:
            return ()
        try:
            cursor = conn.execute(f"SELECT {', '.join(_FIELDS)} FROM record")
            while True:
                try:
                    row = cursor.fetchone()
                except sqlite3.DatabaseError:
                    break
                if row is None:
                    break
                with contextlib.suppress(Exception):
                    out.append(EvidenceRecord(**dict(zip(_FIELDS, row))))
        except sqlite3.DatabaseError:
            pass
        finally:
            conn.close()
        return tuple(out)

    def rebuild(self, seed: Iterable = ()) -> tuple[Path | None, int, int]:
        """Set a damaged (or any) store aside as ``<file>.damaged-N`` and make a new one holding
        ``seed`` and what could be salvaged from the old one. Returns (where the old file went,
        or ``None`` when there was none; records salvaged; records in the new store)."""
        salvaged: tuple = ()
        aside = None
        if self.path.exists():
            salvaged = self.salvage()
            n = 1
            while self.path.with_name(f"{self.path.name}.damaged-{n}").exists():
                n += 1
            aside = self.path.with_name(f"{self.path.name}.damaged-{n}")
            os.replace(self.path, aside)
            for suffix in ("-wal", "-shm"):  # they belong to the old file
                side = self.path.with_name(self.path.name + suffix)
                if side.exists():
                    os.replace(side, aside.with_name(aside.name + suffix))
        total = self.add((*seed, *salvaged))
        return aside, len(salvaged), total

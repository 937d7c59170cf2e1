"""Evidence: measurements of kernels, kept per hardware class in ``kernels/<hw>/EVIDENCE.toml``.

A record counts only on the class that recorded it, and only while the hash of the kernel's
source still matches; elsewhere the kernel is "shared, unmeasured". A damaged file or record
does not stop a plan: the loader returns the good records with the errors, and the kernels
the damage may concern read "evidence unreadable".

>>> r = EvidenceRecord("sm_90", "NVIDIA H200", "rmsnorm", "rmsnorm[bf16,4096]", "time",
...                    3.1, 2.4, "us", "2025-06-01", "nvcc 13.0.88", "ab12")
>>> evidence_status([r], "sm_90", "rmsnorm", "rmsnorm[bf16,4096]", "ab12")
'measured on sm_90'
>>> evidence_status([r], "sm_90", "rmsnorm", "rmsnorm[bf16,4096]", "cd34")
'stale'
>>> evidence_status([r], "sm_100", "rmsnorm", "rmsnorm[bf16,4096]", "ab12")
'shared, unmeasured'
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import math
import os
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import tomlkit
import tomlkit.exceptions
import tomlkit.items

from metrale.lkb.errors import ConfigError, EvidenceError, MetraleError
from metrale.lkb.files import Fields, atomic_write, read_toml

EVIDENCE_FILE = "EVIDENCE.toml"
STALE = "stale"
SHARED = "shared, unmeasured"
UNREADABLE = "evidence unreadable"


def measured_on(hw: str) -> str:
    """The status of a kernel measured on ``hw`` with its current source."""
    return f"measured on {hw}"


def hash_source(text: str | bytes) -> str:
    """SHA-256 hex of a kernel source, the ``source_hash`` records are compared on.

    >>> hash_source("k")[:12]
    '8254c329a928'
    """
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def _iso_date(value: Any) -> str:
    if isinstance(value, datetime.date):  # a datetime is a date too
        return value.isoformat()
    if isinstance(value, str):
        for parse in (datetime.date.fromisoformat, datetime.datetime.fromisoformat):
            try:
                return parse(value).isoformat()
            except ValueError:
                pass
    raise ConfigError("not an ISO date", expected="YYYY-MM-DD or an ISO date-time",
                      found=repr(value))


def _finite(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError("not a finite number", expected="a finite number", found=repr(value))
    return float(value)


@attrs.frozen
class EvidenceRecord:
    """One measurement: where (class, device), what (family, point, metric), the value and the
    floor it is judged against (``None`` when there is none), when, with which toolchain, and
    the hash of the source that was measured.

    >>> EvidenceRecord("host", "host CPU", "add", "add[f32]", "time", 1, None, "us",
    ...                "2025-06-01", "numpy 2.3", "ab").value
    1.0
    """

    hw: str
    device: str
    family: str
    point: str
    metric: str
    value: float = attrs.field(converter=_finite)
    floor: float | None = attrs.field(converter=attrs.converters.optional(_finite))
    unit: str
    date: str = attrs.field(converter=_iso_date)
    toolchain: str
    source_hash: str


_STR_FIELDS = ("hw", "device", "family", "point", "metric", "unit", "toolchain", "source_hash")


@attrs.frozen
class EvidenceLoad:
    """What a load found: the good records, the errors, and for each bad record the
    ``(hw, family, point)`` it may concern (``None`` where that part is unknown, i.e. any).

    >>> EvidenceLoad().ok
    True
    """

    records: tuple[EvidenceRecord, ...] = ()
    errors: tuple[EvidenceError, ...] = ()
    unreadable: tuple[tuple[str | None, str | None, str | None], ...] = ()
    _hashes: dict[tuple[str, str, str], frozenset[str]] = attrs.field(
        init=False, eq=False, repr=False, hash=False)

    def __attrs_post_init__(self) -> None:
        # (hw, family, point) -> the source hashes recorded for it, so that a plan asks
        # about each of its kernels in constant time rather than scanning every record
        index: dict[tuple[str, str, str], set[str]] = {}
        for r in self.records:
            index.setdefault((r.hw, r.family, r.point), set()).add(r.source_hash)
        object.__setattr__(self, "_hashes", {k: frozenset(v) for k, v in index.items()})

    def hashes_of(self, hw: str, family: str, point: str) -> frozenset[str]:
        """The source hashes of the records of ``point`` on ``hw`` (empty when none)."""
        return self._hashes.get((hw, family, point), frozenset())

    @property
    def ok(self) -> bool:
        return not self.errors

    def __add__(self, other: EvidenceLoad) -> EvidenceLoad:
        return EvidenceLoad(self.records + other.records, self.errors + other.errors,
                            self.unreadable + other.unreadable)

    def __iter__(self):
        return iter(self.records)

    def _repr_html_(self) -> str:
        from metrale.realize.display import evidence_html

        return evidence_html(self)


def _evidence_error(e: MetraleError, file: Path) -> EvidenceError:
    return EvidenceError(e.message, file=e.file or file, key=e.key, line=e.line, col=e.col,
                         expected=e.expected, found=e.found, suggestion=e.suggestion)


def load_evidence(path: os.PathLike | str, hw: str | None = None) -> EvidenceLoad:
    """Read one ``EVIDENCE.toml``; a missing file is no evidence. With ``hw``, a record of
    another class is an error too. Never raises for bad content: see :class:`EvidenceLoad`.
    """
    path = Path(path)
    if not path.is_file():
        return EvidenceLoad()
    try:
        data = read_toml(path)
    except ConfigError as e:
        return EvidenceLoad((), (_evidence_error(e, path),), ((hw, None, None),))
    errors: list[MetraleError] = []
    top = Fields(data, path, "", errors)
    tables = top.take("record", list, default=[])
    top.close()
    if errors:
        return EvidenceLoad((), tuple(_evidence_error(e, path) for e in errors),
                            ((hw, None, None),))
    records, bad, unreadable = [], [], []
    for i, table in enumerate(tables):
        errs: list[MetraleError] = []
        rec = _record_from_table(table, path, f"record[{i}]", errs)
        if rec is not None and hw is not None and rec.hw != hw:
            errs.append(ConfigError("record of another class in this class's evidence",
                                    file=path, key=f"record[{i}].hw", expected=repr(hw),
                                    found=repr(rec.hw)))
        if errs:
            bad += [_evidence_error(e, path) for e in errs]
            t = table if isinstance(table, dict) else {}
            unreadable.append(tuple(t.get(k) if isinstance(t.get(k), str) else None
                                    for k in ("hw", "family", "point")))
            if hw is not None:
                unreadable[-1] = (hw, *unreadable[-1][1:])
        else:
            records.append(rec)
    return EvidenceLoad(tuple(records), tuple(bad), tuple(unreadable))


def load_all_evidence(kernels_dir: os.PathLike | str) -> EvidenceLoad:
    """Every ``<kernels_dir>/<hw>/EVIDENCE.toml``, each checked against its folder's class.

    A file read before and not changed since (same inode, size and modification time: records
    are written by replacing the file) is not parsed again; every plan reads them all."""
    total = EvidenceLoad()
    for sub in sorted(p for p in Path(kernels_dir).iterdir() if (p / EVIDENCE_FILE).is_file()):
        path = sub / EVIDENCE_FILE
        try:
            st = path.stat()
        except OSError:
            total += load_evidence(path, hw=sub.name)
            continue
        key = (str(path.resolve()), sub.name, st.st_ino, st.st_size, st.st_mtime_ns)
        if key not in _LOADED:
            if len(_LOADED) >= 64:
                _LOADED.clear()
            _LOADED[key] = load_evidence(path, hw=sub.name)
        total += _LOADED[key]
    return total


_LOADED: dict[tuple, EvidenceLoad] = {}


def _record_from_table(table: Any, file: Path, prefix: str,
                       errors: list[MetraleError]) -> EvidenceRecord | None:
    f = Fields(table, file, prefix, errors)
    values = {k: f.take(k, str) for k in _STR_FIELDS}
    for k, v in values.items():
        if v is not None and not v.strip():
            f.fail(k, "must not be empty", "a non-empty string", repr(v))
    values["value"] = f.take("value", (int, float), convert=_finite)
    values["floor"] = f.take("floor", (int, float), default=None, convert=_finite)
    values["date"] = f.take("date", (str, datetime.date), convert=_iso_date)
    f.close()
    return EvidenceRecord(**values) if f.ok else None


def _record_table(r: EvidenceRecord) -> dict[str, Any]:
    out: dict[str, Any] = {k: getattr(r, k) for k in ("hw", "device", "family", "point",
                                                      "metric", "value")}
    if r.floor is not None:
        out["floor"] = r.floor
    out.update(unit=r.unit, date=r.date, toolchain=r.toolchain, source_hash=r.source_hash)
    return out


def append_records(path: os.PathLike | str, records: Iterable[EvidenceRecord]) -> None:
    """Append ``records`` as ``[[record]]`` tables, keeping the file's comments and layout;
    the file is replaced atomically. A file that does not parse is left alone (an error).

    Writers take an exclusive lock on ``<file>.lock`` for the read-modify-replace, so two
    processes appending at once both keep their records.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            _append_locked(path, records)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _append_locked(path: Path, records: Iterable[EvidenceRecord]) -> None:
    new = [_record_table(r) for r in records]
    for i, t in enumerate(new):  # write only what the loader will read back
        errs: list[MetraleError] = []
        _record_from_table(t, path, f"new record[{i}]", errs)
        if errs:
            raise _evidence_error(errs[0], path)
    if path.is_file():
        try:  # the shared reader's guards first: size, nesting, UTF-8, syntax at line:col
            read_toml(path)
        except ConfigError as e:
            raise EvidenceError(f"cannot append to an unparseable evidence file: {e.message}",
                                file=path, line=e.line, col=e.col, expected=e.expected,
                                found=e.found) from None
        try:
            text = path.read_text(encoding="utf-8")
            # A hand-edited file may lack its final newline; tomlkit would glue the new
            # [[record]] onto the last line and write a file that no longer parses.
            doc = tomlkit.parse(text if text.endswith("\n") or not text else text + "\n")
        except tomlkit.exceptions.ParseError as e:
            raise EvidenceError(f"cannot append to an unparseable evidence file: {e}",
                                file=path, line=e.line, col=e.col) from None
    else:
        doc = tomlkit.document()
        doc.add(tomlkit.comment(f"Evidence for hardware class {path.parent.name}: one [[record]] "
                                "per measurement (realize/evidence.py)."))
        doc.add(tomlkit.nl())
    aot = doc.get("record")
    if aot is None:
        aot = tomlkit.aot()
        doc.append("record", aot)
    elif not isinstance(aot, tomlkit.items.AoT):
        raise EvidenceError("'record' is not an array of tables", file=path, key="record",
                            expected="[[record]] tables", found=type(aot).__name__)
    for t in new:
        aot.append(tomlkit.item(t))
    out = tomlkit.dumps(doc)
    try:  # never replace a readable file with one the loader cannot read
        tomllib.loads(out)
    except tomllib.TOMLDecodeError as e:
        raise EvidenceError(f"appending would make the evidence file unparseable: {e}",
                            file=path) from None
    atomic_write(path, out)


def _matches(pattern: tuple[str | None, str | None, str | None], key: tuple[str, str, str]) -> bool:
    return all(p is None or p == k for p, k in zip(pattern, key))


def find_record(records: EvidenceLoad | Iterable[EvidenceRecord], hw: str, family: str,
                point: str, source_hash: str) -> EvidenceRecord | None:
    """The latest record that counts for this kernel on ``hw`` (same class, same source hash)."""
    found = [r for r in records if (r.hw, r.family, r.point, r.source_hash)
             == (hw, family, point, source_hash)]
    return max(found, key=lambda r: r.date, default=None)


def evidence_status(records: EvidenceLoad | Iterable[EvidenceRecord], hw: str, family: str,
                    point: str, source_hash: str) -> str:
    """``"measured on <hw>"``, ``"stale"``, ``"shared, unmeasured"`` or ``"evidence unreadable"``.

    Unreadable wins when a damaged record or file may concern this kernel; then a record of
    ``hw`` with the current hash makes it measured, one with another hash makes it stale.

    >>> bad = EvidenceLoad(unreadable=(("sm_90", None, None),))
    >>> evidence_status(bad, "sm_90", "rmsnorm", "p", "ab")
    'evidence unreadable'
    >>> evidence_status(bad, "sm_80", "rmsnorm", "p", "ab")
    'shared, unmeasured'
    """
    key = (hw, family, point)
    if not isinstance(records, EvidenceLoad):
        records = EvidenceLoad(tuple(records))
    if any(_matches(u, key) for u in records.unreadable):
        return UNREADABLE
    hashes = records.hashes_of(*key)
    if source_hash in hashes:
        return measured_on(hw)
    return STALE if hashes else SHARED

"""Evidence: measurements of kernels, the rules that say when one counts, and the shipped export.

A record counts only on the class that recorded it, and only while the hash of the kernel's
source still matches; elsewhere the kernel is "shared, unmeasured". Records come from two
places: the export shipped with the kernels (``kernels/<hw>/EVIDENCE.toml``: for each point,
metric and shape the latest record of the current source, one record a line, written by
``met evidence export``) and the user's store (:mod:`metrale.realize.evidence_store`), where
``met bench --record`` writes. :func:`load_all_evidence` reads both lazily: a plan reads only
the lines and rows of its own points. A damaged file, line or store does not stop a plan: the
kernels the damage may concern read "evidence unreadable", and the errors say where.

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
import hashlib
import math
import os
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs

from metrale.lkb.errors import ConfigError, EvidenceError, MetraleError
from metrale.lkb.files import Fields, atomic_write, exclusive, read_toml

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
    shape: str = ""
    """The sizes it was measured at (``rows=8,context=1024``); empty when not recorded."""


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

    def records_of(self, hw: str, family: str, point: str) -> tuple[EvidenceRecord, ...]:
        """The records of ``point`` of ``family`` on ``hw``, in the order loaded."""
        if not self._hashes.get((hw, family, point)):
            return ()
        return tuple(r for r in self.records if (r.hw, r.family, r.point) == (hw, family, point))

    def unreadable_for(self, hw: str, family: str, point: str) -> bool:
        """Whether a damaged record or file may concern ``point`` of ``family`` on ``hw``."""
        return any(_matches(u, (hw, family, point)) for u in self.unreadable)

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


_POINT_KEY = re.compile(r'[{,]\s*point\s*=\s*"((?:[^"\\]|\\.)*)"')
EXPORT_HEADER = "Evidence that counts on hardware class {hw}"


@attrs.frozen(eq=False)
class ExportFile:
    """One class's shipped export, read lazily: the file is split into lines once, and the
    records of a point are parsed only when a plan asks for that point. A file not in the
    export's layout (``record = [`` with one inline table a line; e.g. ``[[record]]`` tables
    appended by hand) is parsed whole on first use instead.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "EVIDENCE.toml"
    >>> r = EvidenceRecord("sm_90", "H200", "add", "add[f32]", "bandwidth", 9.0, None,
    ...                    "GB/s", "2026-12-01", "nvcc", "ab")
    >>> write_export(p, "sm_90", [r])
    >>> ExportFile(p, "sm_90").records_of("sm_90", "add", "add[f32]") == (r,)
    True
    """

    path: Path
    hw: str
    _lines: dict[str, list[int]] = attrs.field(init=False, factory=dict)
    _state: dict[str, Any] = attrs.field(init=False, factory=dict)
    _errors: list[EvidenceError] = attrs.field(init=False, factory=list)
    _unreadable: list[tuple[str | None, str | None, str | None]] = attrs.field(init=False,
                                                                             factory=list)
    _parsed: dict[str, EvidenceLoad] = attrs.field(init=False, factory=dict)

    def _index(self) -> EvidenceLoad | None:
        """Index the lines by point; a file not in the export layout is loaded whole (the
        returned load). Runs once."""
        if "whole" in self._state:
            return self._state["whole"]
        whole = None
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            whole = load_evidence(self.path, self.hw)  # reports the error with the file
        else:
            lines = text.splitlines()
            body = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
            if (body[:1] == ["record = ["] and body[-1:] == ["]"]
                    and all(b.startswith("{") for b in body[1:-1])):
                self._state["lines"] = lines
                for n, ln in enumerate(lines):
                    m = _POINT_KEY.search(ln) if ln.lstrip().startswith("{") else None
                    if m is None and ln.lstrip().startswith("{"):
                        self._lines.setdefault("", []).append(n)  # a line with no point
                    elif m is not None:
                        self._lines.setdefault(_unescape(m.group(1)), []).append(n)
                for n in self._lines.get("", []):
                    self._fail(n, ConfigError("a record without a point", expected="point = "
                                              "\"...\""), (self.hw, None, None))
            else:
                whole = load_evidence(self.path, self.hw)
        self._state["whole"] = whole
        return whole

    def _fail(self, n: int, e: MetraleError, concerns: tuple) -> None:
        self._errors.append(EvidenceError(e.message, file=self.path, line=n + 1, key=e.key,
                                          expected=e.expected, found=e.found))
        self._unreadable.append(concerns)

    def _load_point(self, point: str) -> EvidenceLoad:
        if point not in self._parsed:
            records = []
            for n in self._lines.get(point, []):
                line = self._state["lines"][n].strip().removesuffix(",")
                errs: list[MetraleError] = []
                try:
                    table = tomllib.loads("r = " + line)["r"]
                except tomllib.TOMLDecodeError as e:
                    errs.append(ConfigError(f"not a TOML inline table: {e}"))
                    table = None
                rec = None if table is None else _record_from_table(table, self.path,
                                                                    "record", errs)
                if rec is not None and rec.hw != self.hw:
                    errs.append(ConfigError("record of another class in this class's evidence",
                                            key="record.hw", expected=repr(self.hw),
                                            found=repr(rec.hw)))
                if errs:
                    fam = table.get("family") if isinstance(table, dict) else None
                    self._fail(n, errs[0], (self.hw, fam if isinstance(fam, str) else None,
                                            point))
                else:
                    records.append(rec)
            self._parsed[point] = EvidenceLoad(tuple(records))
        return self._parsed[point]

    def records_of(self, hw: str, family: str, point: str) -> tuple[EvidenceRecord, ...]:
        if hw != self.hw:
            return ()
        whole = self._index()
        if whole is not None:
            return whole.records_of(hw, family, point)
        return self._load_point(point).records_of(hw, family, point)

    def unreadable_for(self, hw: str, family: str, point: str) -> bool:
        whole = self._index()
        if whole is not None:
            return whole.unreadable_for(hw, family, point)
        if hw == self.hw:
            self._load_point(point)
        return any(_matches(u, (hw, family, point)) for u in self._unreadable)

    @property
    def errors(self) -> tuple[EvidenceError, ...]:
        """The errors found so far (a lazy read finds those of the points it was asked)."""
        whole = self._index()
        return whole.errors if whole is not None else tuple(self._errors)

    def load(self) -> EvidenceLoad:
        """Every record of the file, with the errors: a whole read."""
        whole = self._index()
        if whole is not None:
            return whole
        for point in self._lines:
            if point:
                self._load_point(point)
        records = tuple(r for p in self._lines if p for r in self._parsed[p].records)
        return EvidenceLoad(records, tuple(self._errors), tuple(self._unreadable))


def _unescape(raw: str) -> str:
    return tomllib.loads(f'p = "{raw}"')["p"] if "\\" in raw else raw


def export_text(hw: str, records: Iterable[EvidenceRecord], file: object = "export") -> str:
    """The compact export of class ``hw``: one inline table a line, sorted by family, point,
    metric and shape; checked to read back as the same records."""
    import tomlkit  # the writers' library: a plan, which only reads, does not import it

    records = sorted(records, key=lambda r: (r.family, r.point, r.metric, r.shape, r.date))
    for i, r in enumerate(records):
        errs: list[MetraleError] = []
        _record_from_table(_record_table(r), file, f"record[{i}]", errs)
        if r.hw != hw:
            errs.append(ConfigError("record of another class", file=file, key=f"record[{i}].hw",
                                    expected=repr(hw), found=repr(r.hw)))
        if errs:
            raise _evidence_error(errs[0], Path(str(file)))
    doc = tomlkit.document()
    for line in (EXPORT_HEADER.format(hw=hw) + ": for each point, metric and shape,",
                 "the latest record of the kernel's current source (`met evidence export`).",
                 "One record a line: a plan parses only the lines of its own points."):
        doc.add(tomlkit.comment(line))
    array = tomlkit.array()
    array.multiline(True)
    for r in records:
        table = tomlkit.inline_table()
        table.update(_record_table(r))
        array.append(table)
    doc.add("record", array)
    out = tomlkit.dumps(doc)
    back = tuple(_record_from_table(t, file, "", []) for t in tomllib.loads(out)["record"])
    if back != tuple(records):
        raise EvidenceError("the export would not read back as the records given", file=file)
    return out


def write_export(path: os.PathLike | str, hw: str, records: Iterable[EvidenceRecord]) -> None:
    """Replace ``path`` atomically with :func:`export_text`."""
    atomic_write(path, export_text(hw, records, Path(path)))


def without_time_records(kernels_dir: os.PathLike | str, dest: os.PathLike | str) -> Path:
    """A copy at ``dest`` of the kernels folder ``kernels_dir`` whose shipped evidence keeps no
    time records (``time@<shape>``, what ``met tune`` writes): its plans are priced by the
    analytic model and chosen as the priorities choose, as before any tuning, so the two can be
    timed side by side (``bench_gpu_decode.py --priority-too``).

    >>> import tempfile
    >>> from metrale.realize.hardware import default_kernels_dir
    >>> out = without_time_records(default_kernels_dir(), Path(tempfile.mkdtemp()) / "k")
    >>> kept = load_evidence(out / "sm_90" / "EVIDENCE.toml").records
    >>> len(kept) > 0 and not any(r.metric.startswith("time@") for r in kept)
    True
    """
    import shutil

    dest = Path(dest)
    shutil.copytree(kernels_dir, dest)
    for path in sorted(dest.glob("*/EVIDENCE.toml")):
        hw = path.parent.name
        records = load_evidence(path, hw=hw).records
        kept = [r for r in records if not r.metric.startswith("time@")]
        if len(kept) != len(records):
            write_export(path, hw, kept)
    return dest


@attrs.frozen(eq=False)
class Evidence:
    """The evidence of every class under one kernels folder: the shipped exports and the user's
    store, read lazily (see the module). Answers the same questions as :class:`EvidenceLoad`."""

    exports: tuple[ExportFile, ...]
    store: Any = None  # an EvidenceStore, or None for the shipped evidence alone
    _store_cache: dict[tuple[str, str, str], tuple[EvidenceRecord, ...]] = attrs.field(
        init=False, factory=dict)
    _store_errors: list[EvidenceError] = attrs.field(init=False, factory=list)

    def _from_store(self, hw: str, family: str, point: str) -> tuple[EvidenceRecord, ...]:
        if self.store is None or self._store_errors:
            return ()
        key = (hw, family, point)
        if key not in self._store_cache:
            try:
                self._store_cache[key] = self.store.records_of(hw, family, point)
            except EvidenceError as e:
                self._store_errors.append(e)
                return ()
        return self._store_cache[key]

    def records_of(self, hw: str, family: str, point: str) -> tuple[EvidenceRecord, ...]:
        """The shipped records of ``point`` on ``hw``, then the store's."""
        shipped = tuple(r for f in self.exports for r in f.records_of(hw, family, point))
        return shipped + self._from_store(hw, family, point)

    def hashes_of(self, hw: str, family: str, point: str) -> frozenset[str]:
        return frozenset(r.source_hash for r in self.records_of(hw, family, point))

    def unreadable_for(self, hw: str, family: str, point: str) -> bool:
        self._from_store(hw, family, point)
        return bool(self._store_errors) or any(f.unreadable_for(hw, family, point)
                                               for f in self.exports)

    @property
    def errors(self) -> tuple[EvidenceError, ...]:
        return tuple(e for f in self.exports for e in f.errors) + tuple(self._store_errors)

    @property
    def ok(self) -> bool:
        return not self.errors

    def load(self) -> EvidenceLoad:
        """Everything, read whole: the exports' records and the store's, with the errors."""
        total = EvidenceLoad()
        for f in self.exports:
            total += f.load()
        if self.store is not None and not self._store_errors:
            try:
                total += EvidenceLoad(self.store.records())
            except EvidenceError as e:
                self._store_errors.append(e)
        if self._store_errors:
            total += EvidenceLoad((), (self._store_errors[0],), ((None, None, None),))
        return total

    @property
    def records(self) -> tuple[EvidenceRecord, ...]:
        return self.load().records

    def __iter__(self):
        return iter(self.records)

    def _repr_html_(self) -> str:
        return self.load()._repr_html_()


_DEFAULT_STORE = object()


def load_all_evidence(kernels_dir: os.PathLike | str, store: Any = _DEFAULT_STORE) -> Evidence:
    """The evidence of every class: each ``<kernels_dir>/<hw>/EVIDENCE.toml`` (checked against
    its folder's class) and ``store`` (default: the user's store; ``None``: none), read lazily.

    An export file unchanged since it was last read (same inode, size and modification time:
    exports are written by replacing the file) keeps what was parsed of it; the store is asked
    afresh by each call's :class:`Evidence`, so a record made since shows.
    """
    from metrale.realize.evidence_store import EvidenceStore

    files = []
    for sub in sorted(p for p in Path(kernels_dir).iterdir() if (p / EVIDENCE_FILE).is_file()):
        path = sub / EVIDENCE_FILE
        try:
            st = path.stat()
            key = (str(path.resolve()), sub.name, st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            files.append(ExportFile(path, sub.name))
            continue
        if key not in _LOADED:
            if len(_LOADED) >= 64:
                _LOADED.clear()
            _LOADED[key] = ExportFile(path, sub.name)
        files.append(_LOADED[key])
    return Evidence(tuple(files), EvidenceStore.default() if store is _DEFAULT_STORE else store)


_LOADED: dict[tuple, ExportFile] = {}


def record_evidence(records: Iterable[EvidenceRecord], store: Any = None) -> int:
    """Add ``records`` to ``store`` (default: the user's store, never the installed package);
    returns how many were new."""
    from metrale.realize.evidence_store import EvidenceStore

    records = tuple(records)
    for i, r in enumerate(records):  # store only what the loaders will read back
        errs: list[MetraleError] = []
        _record_from_table(_record_table(r), "records to store", f"record[{i}]", errs)
        if errs:
            raise _evidence_error(errs[0], Path("records to store"))
    return (store or EvidenceStore.default()).add(records)


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
    values["shape"] = f.take("shape", str, default="")
    f.close()
    return EvidenceRecord(**values) if f.ok else None


def _record_table(r: EvidenceRecord) -> dict[str, Any]:
    out: dict[str, Any] = {k: getattr(r, k) for k in ("hw", "device", "family", "point")}
    if r.shape:
        out["shape"] = r.shape
    out.update(metric=r.metric, value=r.value)
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
    with exclusive(path.with_name(path.name + ".lock")):
        _append_locked(path, records)


def _append_locked(path: Path, records: Iterable[EvidenceRecord]) -> None:
    import tomlkit
    import tomlkit.exceptions
    import tomlkit.items

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


def _view(records: Any) -> Any:
    return records if hasattr(records, "records_of") else EvidenceLoad(tuple(records))


def find_record(records: Any, hw: str, family: str, point: str,
                source_hash: str) -> EvidenceRecord | None:
    """The latest record that counts for this kernel on ``hw`` (same class, same source hash)."""
    found = [r for r in _view(records).records_of(hw, family, point)
             if r.source_hash == source_hash]
    return max(reversed(found), key=lambda r: r.date, default=None)


def evidence_status(records: Any, hw: str, family: str, point: str, source_hash: str) -> str:
    """``"measured on <hw>"``, ``"stale"``, ``"shared, unmeasured"`` or ``"evidence unreadable"``.

    ``records``: an :class:`Evidence`, an :class:`EvidenceLoad` or records. Unreadable wins when
    a damaged record, file or store may concern this kernel; then a record of ``hw`` with the
    current hash makes it measured, one with another hash makes it stale.

    >>> bad = EvidenceLoad(unreadable=(("sm_90", None, None),))
    >>> evidence_status(bad, "sm_90", "rmsnorm", "p", "ab")
    'evidence unreadable'
    >>> evidence_status(bad, "sm_80", "rmsnorm", "p", "ab")
    'shared, unmeasured'
    """
    view = _view(records)
    if view.unreadable_for(hw, family, point):
        return UNREADABLE
    hashes = view.hashes_of(hw, family, point)
    if source_hash in hashes:
        return measured_on(hw)
    return STALE if hashes else SHARED

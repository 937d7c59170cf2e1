"""Fuzzing the registry loaders: mutated copies of the shipped files give typed errors only.

Each example takes a valid file (``KERNEL_FAMILIES.toml``, ``FUSIONS.toml``, a
``HARDWARE.toml``, an ``EVIDENCE.toml``, a ``config.json``), damages it at random (byte flips,
truncations, insertions, deletions; for the parsed structure also key renames, value type
swaps, deletions and duplications) and loads it. The only exceptions allowed out are
``MetraleError`` s that name the file; an ``IndexError``, ``KeyError``, ``TypeError``,
``ValueError``, ``RecursionError``, ``MemoryError`` or ``UnicodeDecodeError`` fails the test,
and so does an example that runs past its time budget (a hang).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import signal
import tempfile
import tomllib
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import tomlkit
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from metrale.lkb.errors import EvidenceError, ManyErrors, MetraleError
from metrale.lkb.files import read_toml
from metrale.lkb.presentation import FAMILIES_FILE, FUSIONS_FILE, Presentation, default_kernels_dir
from metrale.lkb.relation import eval_bound, parse_side
from metrale.plan.config import ModelConfig
from metrale.plan.models import builtin_config
from metrale.realize.evidence import (
    EVIDENCE_FILE,
    EvidenceLoad,
    EvidenceRecord,
    append_records,
    load_evidence,
)
from metrale.realize.hardware import HARDWARE_FILE, load_hardware

BUDGET_S = 5.0
"""Wall-clock seconds one example may take before it counts as a hang."""

DEEP = int(os.environ.get("METRALE_FUZZ_EXAMPLES", "0"))
"""Set ``METRALE_FUZZ_EXAMPLES=5000`` for a long, randomized run; CI runs a fixed, short one."""
FUZZ = settings(max_examples=DEEP or 60, deadline=timedelta(seconds=BUDGET_S),
                derandomize=not DEEP,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Hang(Exception):
    """An example ran past its budget (raised by the alarm, so pytest shows where it hung)."""


@contextlib.contextmanager
def time_budget(seconds: float = BUDGET_S) -> Iterator[None]:
    """Raise ``Hang`` in the main thread if the body runs longer than ``seconds``."""

    def ring(signum: int, frame: Any) -> None:
        raise Hang(f"example ran past its {seconds} s budget")

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def only_typed_errors(load: Callable[[], Any], file: Path) -> Any:
    """Run ``load``; a ``MetraleError`` must name a file of the tree; anything else escapes."""
    with time_budget():
        try:
            result = load()
        except MetraleError as e:
            errors = e.errors if isinstance(e, ManyErrors) else (e,)
            event(f"{type(e).__name__}: {errors[0].message[:40]}" if errors else "empty")
            assert errors, "ManyErrors without errors"
            for err in errors:
                assert err.file is not None, f"error names no file: {err}"
                assert str(file.parent) in err.file or file.name in err.file, str(err)
            assert str(e)
            return None
        event("loaded")
        return result


# -- mutations ---------------------------------------------------------------------------------

NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_.0123456789-", min_size=1, max_size=12)
"""Key spellings: sensible enough for TOML and JSON writers, random enough to be unknown."""

SCALARS = st.one_of(
    st.integers(-3, 3), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=True),
    st.booleans(), st.text(max_size=20), st.sampled_from(["fp9", "bf16", "sm_90a", "", "{act}",
                                                          "x: bf16[rows, h]", "nvidia", "none",
                                                          "y = add(x, r)", "2 * eps_act"]),
    st.dates(min_value=datetime.date(1, 1, 1)),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(NAMES, inner, max_size=3)), max_leaves=6)


def _paths(obj: Any, prefix: tuple = ()) -> Iterator[tuple]:
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _parent(obj: Any, path: tuple) -> Any:
    for part in path[:-1]:
        obj = obj[part]
    return obj


def _typo(data: st.DataObject, text: str) -> str:
    """A one-character edit of ``text`` (what a hand edit usually does)."""
    if not text:
        return data.draw(NAMES)
    i = data.draw(st.integers(0, len(text) - 1))
    how = data.draw(st.sampled_from(["drop", "swap", "insert", "double"]))
    c = data.draw(st.sampled_from("abcdefghijklmnopqrstuvwxyz_[]{}(),;=:. 0123456789\"'"))
    if how == "drop":
        return text[:i] + text[i + 1:]
    if how == "swap":
        return text[:i] + c + text[i + 1:]
    if how == "insert":
        return text[:i] + c + text[i:]
    return text[:i] + text[i] + text[i:]


def mutate_structure(data: st.DataObject, doc: Any) -> Any:
    """Apply 1-3 random edits to a parsed document: rename a key, swap a value for one of
    another type, edit a string, delete or duplicate an entry."""
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        paths = [p for p in _paths(doc) if p]
        if not paths:
            return doc
        path = data.draw(st.sampled_from(paths), label="path")
        parent, last = _parent(doc, path), path[-1]
        op = data.draw(st.sampled_from(["rename", "swap", "edit", "delete", "duplicate"]),
                       label="op")
        if op == "rename" and isinstance(parent, dict):
            new = data.draw(st.one_of(NAMES, st.just(_typo(data, last))), label="new key")
            if new and new not in parent:
                parent[new] = parent.pop(last)
        elif op == "swap":
            parent[last] = data.draw(VALUES, label="value")
        elif op == "edit" and isinstance(parent[last], str):
            parent[last] = _typo(data, parent[last])
        elif op == "delete":
            del parent[last]
        elif op == "duplicate" and isinstance(parent, list):
            parent.insert(last, parent[last])
    return doc


def mutate_bytes(data: st.DataObject, raw: bytes) -> bytes:
    """Apply 1-4 byte-level edits: flip, truncate, insert, delete a span, repeat a span."""
    buf = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4), label="byte edits")):
        if not buf:
            break
        i = data.draw(st.integers(0, len(buf) - 1), label="at")
        op = data.draw(st.sampled_from(["flip", "truncate", "insert", "delete", "repeat"]))
        if op == "flip":
            buf[i] = data.draw(st.integers(0, 255))
        elif op == "truncate":
            del buf[i:]
        elif op == "insert":
            buf[i:i] = data.draw(st.one_of(st.binary(min_size=1, max_size=8),
                                           st.sampled_from([b"[", b"{", b"]", b'"', b"\n",
                                                            b"=", b"[[", b"\xff", b"\x00"])))
        elif op == "delete":
            del buf[i:i + data.draw(st.integers(1, 64))]
        else:
            j = min(len(buf), i + data.draw(st.integers(1, 64)))
            buf[i:i] = buf[i:j] * data.draw(st.integers(1, 50))
    return bytes(buf)


def mutated_text(data: st.DataObject, text: str, kind: str) -> bytes:
    """Either a byte-level mutation of ``text`` or a structural one, written back as ``kind``."""
    if data.draw(st.booleans(), label="structural"):
        doc = tomllib.loads(text) if kind == "toml" else json.loads(text)
        doc = mutate_structure(data, doc)
        return dump(doc, kind).encode()
    return mutate_bytes(data, text.encode())


def dump(doc: Any, kind: str) -> str:
    """The document as text again (tomlkit writes any nesting, dates and non-finite floats)."""
    return json.dumps(doc, default=str) if kind == "json" else tomlkit.dumps(doc)


# -- the registries ----------------------------------------------------------------------------

SHIPPED = default_kernels_dir()
HW_FOLDERS = sorted(p.parent.name for p in SHIPPED.glob(f"*/{HARDWARE_FILE}"))


def _presentation_tree(root: Path) -> Path:
    for name in (FAMILIES_FILE, FUSIONS_FILE):
        shutil.copy(SHIPPED / name, root / name)
    return root


@FUZZ
@given(data=st.data(), which=st.sampled_from([FAMILIES_FILE, FUSIONS_FILE]))
def test_mutated_presentation_gives_typed_errors_only(data, which):
    with tempfile.TemporaryDirectory() as tmp:
        root = _presentation_tree(Path(tmp))
        target = root / which
        target.write_bytes(mutated_text(data, target.read_text(), "toml"))
        P = only_typed_errors(lambda: Presentation.load(root), target)
        if P is not None:  # what loads is a usable value: printable, hashable, checkable
            with time_budget():
                assert str(P) and isinstance(hash(P), int)
                assert P.check() == []


@FUZZ
@given(data=st.data(), which=st.sampled_from(HW_FOLDERS))
def test_mutated_hardware_class_gives_typed_errors_only(data, which):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "kernels"
        for name in HW_FOLDERS:
            (root / name).mkdir(parents=True)
            shutil.copy(SHIPPED / name / HARDWARE_FILE, root / name / HARDWARE_FILE)
        target = root / which / HARDWARE_FILE
        target.write_bytes(mutated_text(data, target.read_text(), "toml"))
        hw = only_typed_errors(lambda: load_hardware(root), target)
        if hw is not None:
            with time_budget():
                assert str(hw) and hash(hw) is not None
                assert all(hw.chain(n)[0].name == n for n in hw.names)


def _good_evidence(path: Path) -> None:
    records = [EvidenceRecord("sm_90", "NVIDIA H200", fam, f"{fam}[act=bf16]", "time", v, 1.0,
                              "us", "2025-06-01", "nvcc 13.0.88", "ab" * 32)
               for fam, v in (("rmsnorm", 3.1), ("linear", 40.0), ("rope", 2.5))]
    append_records(path, records)


@FUZZ
@given(data=st.data())
def test_mutated_evidence_is_reported_never_raised(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sm_90" / EVIDENCE_FILE
        path.parent.mkdir()
        _good_evidence(path)
        path.write_bytes(mutated_text(data, path.read_text(), "toml"))
        with time_budget():
            got = load_evidence(path, hw="sm_90")
        assert isinstance(got, EvidenceLoad)
        for e in got.errors:  # every problem is an EvidenceError naming the file
            assert isinstance(e, EvidenceError) and e.file == str(path), repr(e)
        assert bool(got.errors) == bool(got.unreadable)
        before = path.read_bytes()
        extra = EvidenceRecord("sm_90", "NVIDIA H200", "add", "add[act=f32]", "time", 1.0, None,
                               "us", "2025-06-02", "nvcc 13.0.88", "cd" * 32)
        try:
            with time_budget():
                append_records(path, [extra])
        except MetraleError as e:  # refused: the file is left exactly as it was
            assert e.file == str(path), str(e)
            assert path.read_bytes() == before
        else:  # appended: what was readable still is, and the new record with it
            again = load_evidence(path, hw="sm_90")
            assert set(got.records) <= set(again.records)
            if got.ok:
                assert extra in again.records


@FUZZ
@given(data=st.data(), name=st.sampled_from(["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe",
                                             "llama-3.1-8b"]))
def test_mutated_config_json_gives_typed_errors_only(data, name):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_bytes(mutated_text(data, json.dumps(builtin_config(name), indent=2), "json"))
        c = only_typed_errors(lambda: ModelConfig.load(path), path)
        if c is not None:
            with time_budget():
                assert str(c) and c.sizes()


# -- the mini-languages inside the registries ------------------------------------------------

SIDES = ["s = add(x, r); y = rmsnorm(s, w)", "y = linear[k_block=256, weight=fp8](x, w)",
         "qr, kr = qk_norm_rope(q, k, wq, wk, positions, cos, sin)"]
BOUNDS = ["2 * eps_act + sqrt(k) * eps_f32", "k * eps_f32", "max(1, log2(k)) * eps_bf16"]


@FUZZ
@given(data=st.data(), text=st.sampled_from(SIDES))
def test_relation_sides_parse_or_say_where(data, text):
    for _ in range(data.draw(st.integers(1, 4))):
        text = _typo(data, text)
    with time_budget():
        try:
            side = parse_side(text, "F.toml", "relation.r.lhs")
        except MetraleError as e:
            assert str(e).startswith("F.toml: relation.r.lhs: col "), str(e)
        else:
            assert side.calls


@FUZZ
@given(data=st.data(), text=st.one_of(st.sampled_from(BOUNDS), st.text(max_size=40)))
def test_bound_formulas_evaluate_or_say_where(data, text):
    for _ in range(data.draw(st.integers(0, 4))):
        text = _typo(data, text)
    env = {"k": 4096.0, "eps_act": 2.0**-8, "eps_f32": 2.0**-24, "eps_bf16": 2.0**-8}
    with time_budget():
        try:
            value = eval_bound(text, env, "F.toml", "relation.r.bound.rel")
        except MetraleError as e:
            assert str(e).startswith("F.toml: relation.r.bound.rel: "), str(e)
        else:
            assert isinstance(value, float)


@pytest.mark.parametrize("formula", ["9 ** 9 ** 9", "1 / 0", "(" * 300 + "1" + ")" * 300,
                                     "k\x00", "-" * 5000 + "1", "sqrt(-1)", "log2(0)",
                                     "max()", "ceil(1e400)", "1" * 5000])
def test_hostile_bound_formulas_are_config_errors(formula):
    env = {"k": 4096.0}
    with time_budget():
        with pytest.raises(MetraleError) as e:
            eval_bound(formula, env, "F.toml", "relation.r.bound.abs")
    assert e.value.file == "F.toml" and e.value.key == "relation.r.bound.abs"


def test_read_toml_keeps_its_guards():
    # a sanity check of the harness: the reader the loaders share refuses what it should
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "x.toml"
        p.write_text("a = " + "[" * 100 + "]" * 100 + "\n")
        with pytest.raises(MetraleError, match="nested too deeply"):
            read_toml(p)

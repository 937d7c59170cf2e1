"""Registries and configs fail clearly (issue 10, cases 1, 3, 4 and 7), across every loader.

Cases 2, 5 and 6 and most of 3 and 4 are tested next to their loaders
(``test_presentation.py``, ``test_hardware.py``, ``test_model_config.py``); this file adds
what holds for all loaders at once (a syntax error is ``file:line:col`` plus the parser's own
message; a huge or deeply nested file is refused before any parser sees it) and the relation
errors not covered there.
"""

from __future__ import annotations

import json
import shutil
import tomllib
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from metrale.lkb import files
from metrale.lkb.errors import ConfigError, ManyErrors, MetraleError
from metrale.lkb.presentation import FAMILIES_FILE, FUSIONS_FILE, Presentation, default_kernels_dir
from metrale.plan.config import ModelConfig
from metrale.plan.models import builtin_config
from metrale.realize.evidence import EVIDENCE_FILE, load_evidence
from metrale.realize.hardware import HARDWARE_FILE, load_hardware

SHIPPED = default_kernels_dir()


def _tree(tmp_path: Path) -> Path:
    """A copy of the shipped registries (families, fusions, every HARDWARE.toml) and an
    evidence file and a config.json, each loadable as it is."""
    root = tmp_path / "kernels"
    root.mkdir()
    for name in (FAMILIES_FILE, FUSIONS_FILE):
        shutil.copy(SHIPPED / name, root / name)
    for hw in SHIPPED.glob(f"*/{HARDWARE_FILE}"):
        (root / hw.parent.name).mkdir()
        shutil.copy(hw, root / hw.parent.name / HARDWARE_FILE)
    (root / "sm_90" / EVIDENCE_FILE).write_text(
        '[[record]]\nhw = "sm_90"\ndevice = "NVIDIA H200"\nfamily = "rmsnorm"\n'
        'point = "rmsnorm[act=bf16]"\nmetric = "time"\nvalue = 3.0\nunit = "us"\n'
        'date = 2025-06-01\ntoolchain = "nvcc 13.0.88"\nsource_hash = "ab"\n')
    (tmp_path / "config.json").write_text(json.dumps(builtin_config("tiny-llama"), indent=2))
    return root


def _raise_evidence(path: Path) -> None:
    """``load_evidence`` never raises; it reports. Raise its one error to test it alike."""
    (error,) = load_evidence(path, hw="sm_90").errors
    raise error


# file, relative to tmp_path -> how that file is loaded
LOADERS: dict[str, Callable[[Path], object]] = {
    f"kernels/{FAMILIES_FILE}": lambda p: Presentation.load(p.parent),
    f"kernels/{FUSIONS_FILE}": lambda p: Presentation.load(p.parent),
    f"kernels/sm_90/{HARDWARE_FILE}": lambda p: load_hardware(p.parent.parent),
    f"kernels/sm_90/{EVIDENCE_FILE}": _raise_evidence,
    "config.json": ModelConfig.load,
}


def _only_error(e: MetraleError) -> MetraleError:
    assert not isinstance(e, ManyErrors), str(e)
    return e


def _load_edited(tmp_path: Path, name: str, old: str, new: str
                 ) -> tuple[Path, tuple[MetraleError, ...]]:
    """The shipped registries with ``old`` replaced by ``new`` once in file ``name``: that file's
    path and the errors loading the presentation raises."""
    root = _tree(tmp_path)
    path = root / name
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new, 1))
    with pytest.raises(ConfigError) as e:
        Presentation.load(root)
    return path, (e.value.errors if isinstance(e.value, ManyErrors) else (e.value,))


def test_every_shipped_copy_loads(tmp_path):
    root = _tree(tmp_path)
    for rel, load in LOADERS.items():
        if rel.endswith(EVIDENCE_FILE):
            assert load_evidence(tmp_path / rel, hw="sm_90").ok
        else:
            assert load(tmp_path / rel) is not None, rel
    assert root.is_dir()


# -- case 1: a syntax error is file:line:col and the parser's own message -------------------


@pytest.mark.parametrize("rel", sorted(LOADERS))
def test_syntax_error_gives_file_line_col_and_the_parsers_message(tmp_path, rel):
    _tree(tmp_path)
    path = tmp_path / rel
    lines = path.read_text().splitlines(keepends=True)
    at = len(lines) // 2  # a line in the middle: the position must be found, not guessed
    lines.insert(at, "oops = = 1\n" if path.suffix == ".toml" else "  oops\n")
    path.write_text("".join(lines))
    text = path.read_text()
    if path.suffix == ".toml":
        with pytest.raises(tomllib.TOMLDecodeError) as parser:
            tomllib.loads(text)
        message = str(parser.value).split(" (at line")[0]
    else:
        with pytest.raises(json.JSONDecodeError) as parser:
            json.loads(text)
        message = parser.value.msg
    with pytest.raises(ConfigError) as e:
        LOADERS[rel](path)
    err = _only_error(e.value)
    assert err.file == str(path) and err.line == at + 1 and err.col is not None
    kind = "TOML" if path.suffix == ".toml" else "JSON"
    assert str(err) == f"{path}:{at + 1}:{err.col}: {kind} syntax error: {message}"


# -- case 3: a wrong dtype is named at its port, with the allowed values ----------------------


def test_unknown_dtype_names_file_port_and_allowed_values(tmp_path):
    root = _tree(tmp_path)
    path = root / FAMILIES_FILE
    path.write_text(path.read_text().replace('outputs = ["s: {act}[rows, h]"]',
                                             'outputs = ["s: fp9[rows, h]"]', 1))
    with pytest.raises(ConfigError) as e:
        Presentation.load(root)
    err = _only_error(e.value)
    assert (err.file, err.key) == (str(path), "family.add.outputs[0]")
    assert err.found == "'fp9'" and "bf16" in err.expected and "e4m3" in err.expected
    assert str(err).startswith(f"{path}: family.add.outputs[0]: unknown dtype (expected one of ")


@pytest.mark.parametrize("old,new,key,expected,found", [
    ('example = { rows = 3, h = 64 }', 'example = { rows = [3], h = 64 }',
     "family.add.example.rows", "int", "[3]"),
    ('attrs = { eps = 1e-6 }', 'attrs = { eps = { value = 1e-6 } }',
     "family.rmsnorm.attrs.eps", "str/int/float/bool", "{'value': 1e-06}"),
    ('params = { act = ["bf16", "f32"] }', 'params = { act = [["bf16"], ["f32"]] }',
     "family.embedding.params.act", "strings, integers, floats or booleans",
     "[['bf16'], ['f32']]"),
])
def test_values_a_family_keeps_must_be_scalars(tmp_path, old, new, key, expected, found):
    # found by tests/host/test_fuzz_toml.py: a list here made the loaded Presentation unhashable
    path, errors = _load_edited(tmp_path, FAMILIES_FILE, old, new)
    err = next(x for x in errors if x.key == key)
    assert err.file == str(path) and err.expected == expected and err.found == found


# -- case 4: relations over points that do not exist, sides that do not match -------------------


@pytest.mark.parametrize("old,new,key,parts", [
    ('rhs = "y = linear[across=pairwise](x, w)"',
     'rhs = "y = linear[across=pairwise, shape=gemm](x, w)"', "relation.splitk_pairwise.rhs",
     ["the rhs is not a compiled point of its family", "expected one of the points of linear",
      "found y = linear[across=pairwise, shape=gemm](x, w)"]),
    ('rhs = "w, ids = softmax_topk(l)"', 'rhs = "ids, w = softmax_topk(l)"',
     "relation.router_softmax_topk",
     ["dom/cod mismatch between sides at output ids", "expected i32[rows,top_k]",
      "found f32[rows,top_k]"]),
    ('lhs = "p = softmax(l); w, ids = topk(p)"', 'lhs = "p = softmax(l); w, ids = topk(p, p)"',
     "relation.router_softmax_topk.lhs",
     ["col 17: topk takes 1 inputs and gives 2 outputs", "found 2 inputs, 2 outputs"]),
    ('lhs = "s = add(x, r); y = rmsnorm(s, w)"', 'lhs = "s = add(x, r); y = rmsnorm[h_block=7](s, w)"',
     "relation.add_rmsnorm.lhs",
     ["col 16: rmsnorm.h_block outside its domain", "expected one of 256", "found 7"]),
])
def test_relation_errors_name_file_relation_expected_found(tmp_path, old, new, key, parts):
    path, errors = _load_edited(tmp_path, FUSIONS_FILE, old, new)
    err = errors[0]
    assert err.file == str(path) and err.key == key
    for part in parts:
        assert part in str(err), (part, str(err))


# -- case 7: huge or deeply nested files are refused before any parser sees them ---------------


@pytest.fixture
def no_parsing(monkeypatch):
    """The parsers ``files`` uses, wrapped to fail the test if they see an over-large or
    over-nested text (the other files of a registry are parsed as usual)."""

    def guarded(parse):
        def parse_checked(text, *args, **kwargs):
            too_deep = "[" * (files.MAX_NESTING + 1)
            assert len(text) <= files.MAX_REGISTRY_BYTES and too_deep not in text, \
                "a parser was called on a file that should have been refused"
            return parse(text, *args, **kwargs)
        return parse_checked

    monkeypatch.setattr(files, "tomllib", types.SimpleNamespace(
        loads=guarded(tomllib.loads), TOMLDecodeError=tomllib.TOMLDecodeError))
    monkeypatch.setattr(files, "json", types.SimpleNamespace(
        loads=guarded(json.loads), JSONDecodeError=json.JSONDecodeError))


@pytest.mark.parametrize("rel", sorted(LOADERS))
def test_a_file_of_hundreds_of_mb_is_refused_by_size(tmp_path, rel, no_parsing):
    _tree(tmp_path)
    path = tmp_path / rel
    with open(path, "r+b") as f:
        f.truncate(300 * 1024 * 1024)  # sparse: instant here, and never read by the loader
    with pytest.raises(ConfigError) as e:
        LOADERS[rel](path)
    err = _only_error(e.value)
    assert err.file == str(path) and "too large" in err.message
    assert err.expected == f"at most {files.MAX_REGISTRY_BYTES} bytes"
    assert err.found == f"{300 * 1024 * 1024} bytes"


@pytest.mark.parametrize("rel", sorted(LOADERS))
def test_a_deeply_nested_file_is_refused_before_parsing(tmp_path, rel, no_parsing):
    _tree(tmp_path)
    path = tmp_path / rel
    depth = files.MAX_NESTING + 1
    if path.suffix == ".toml":
        path.write_text(path.read_text() + "\nnest = " + "[" * depth + "]" * depth + "\n")
    else:
        data = json.loads(path.read_text())
        path.write_text(json.dumps({**data, "nest": 0}).replace(
            '"nest": 0', '"nest": ' + "[" * depth + "]" * depth))
    with pytest.raises(ConfigError) as e:
        LOADERS[rel](path)
    err = _only_error(e.value)
    assert err.file == str(path) and "nested too deeply" in err.message
    assert err.expected == f"at most {files.MAX_NESTING} levels"


def test_brackets_inside_strings_and_comments_do_not_count_as_nesting(tmp_path):
    path = tmp_path / "x.toml"
    deep = "[" * 500
    path.write_text(f'a = "{deep}"\nc = \'{deep}\'\nd = """\n{deep}\n"""\n# {deep}\n'
                    "b = [[1], [2]]\n")
    assert files.read_toml(path)["b"] == [[1], [2]]


def test_an_apostrophe_in_a_comment_does_not_hide_nesting(tmp_path):
    # the guard once took the ' of "family's" in a comment for a string running on and on
    path = tmp_path / "x.toml"
    depth = files.MAX_NESTING + 1
    path.write_text("# a family's doc\nnest = " + "[" * depth + "]" * depth + "\n")
    with pytest.raises(ConfigError, match="nested too deeply"):
        files.read_toml(path)


@pytest.mark.parametrize("text,kind", [("a = " + "1" * 5000, "toml"),
                                       ('{"a": ' + "1" * 5000 + "}", "json")])
def test_an_integer_too_long_to_convert_is_a_config_error(tmp_path, text, kind):
    # found by the fuzz tests: Python's 4300-digit limit raised a bare ValueError
    path = tmp_path / f"x.{kind}"
    path.write_text(text)
    read = files.read_toml if kind == "toml" else files.read_json
    with pytest.raises(ConfigError) as e:
        read(path)
    assert e.value.file == str(path) and "4300 digits" in str(e.value)


@pytest.mark.parametrize("make", ["folder", "long name"])
def test_an_unreadable_path_is_a_config_error(tmp_path, make):
    path = tmp_path / "x.toml"
    if make == "folder":
        path.mkdir()
    else:
        path = tmp_path / ("n" * 5000)
    with pytest.raises(ConfigError) as e:
        files.read_toml(path)
    assert e.value.file == str(path) and "cannot read TOML file" in str(e.value)

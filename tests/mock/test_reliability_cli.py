"""``met`` turns every error type into one line and its documented exit status (issue 10).

``docs/errors.md`` lists each ``MetraleError`` subclass with the status ``met`` exits with;
these tests keep the table and the classes in agreement, and check the CLI's behaviour for
each type, for ``--debug`` and for Ctrl-C.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import metrale
from metrale import cli
from metrale.lkb.errors import (
    EXIT_INTERRUPTED,
    EXIT_OS_ERROR,
    ConfigError,
    ManyErrors,
    MetraleError,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"
_ROW = re.compile(r"^\| `(\w+)` \| `([\w/.]+)` \| (\d+) \| (.+) \|$")
PACKAGES = ("metrale", "metrale.lkb", "metrale.realize", "metrale.plan", "metrale.runtime")


def documented() -> dict[str, tuple[str, int, str]]:
    """``{error name: (defining file, exit status, when)}`` from the table in docs/errors.md."""
    rows = {}
    for line in DOC.read_text().splitlines():
        m = _ROW.match(line)
        if m:
            rows[m.group(1)] = (m.group(2), int(m.group(3)), m.group(4))
    return rows


def library_errors() -> dict[str, type[MetraleError]]:
    """Every ``MetraleError`` subclass the library defines (all its modules imported)."""
    for name in PACKAGES:
        pkg = importlib.import_module(name)
        for info in pkgutil.walk_packages(pkg.__path__, name + "."):
            if not info.name.endswith("__main__"):
                importlib.import_module(info.name)
    found, todo = {}, [MetraleError]
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("metrale."):
            found[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return found


def _source_file(cls: type) -> str:
    module = importlib.import_module(cls.__module__)
    return Path(module.__file__).resolve().relative_to(Path(metrale.lkb.__file__).resolve()
                                                       .parents[1]).as_posix()


def test_the_table_lists_every_error_type_with_its_status_and_file():
    rows, classes = documented(), library_errors()
    assert set(rows) == set(classes), (set(rows) ^ set(classes))
    for name, cls in classes.items():
        file, status, when = rows[name]
        assert status == cls.exit_status, name
        assert file == _source_file(cls), name
        assert len(when) > 20, name  # says when it is raised


def test_statuses_tell_the_kinds_of_failure_apart():
    rows = documented()
    by_status: dict[int, set[str]] = {}
    for name, (_, status, _) in rows.items():
        by_status.setdefault(status, set()).add(name)
    assert by_status[3] == {"ConfigError", "ManyErrors", "EvidenceError", "Busy"}
    assert by_status[5] == {"CompileError", "CacheError"}  # the build's failures
    assert by_status[8] == {"LaunchError", "PointerError", "SemanticsError"}
    assert all(s not in by_status for s in (0, 2, EXIT_OS_ERROR, EXIT_INTERRUPTED))  # the CLI's
    assert f"| {EXIT_OS_ERROR} | The operating system refused" in DOC.read_text()
    assert f"| {EXIT_INTERRUPTED} | Interrupted by Ctrl-C" in DOC.read_text()


def _with_command(monkeypatch, run) -> None:
    monkeypatch.setitem(cli._COMMANDS, "fail-test", (lambda p: None, run, "raises"))


def _instance(cls: type[MetraleError]) -> MetraleError:
    if issubclass(cls, ManyErrors):
        return cls([ConfigError("a", file="f.toml", key="x")])
    return cls("went wrong", file="f.toml", key="some.key", expected="X", found="Y")


@pytest.mark.parametrize("name", sorted(documented()))
def test_met_prints_one_line_and_exits_with_the_status(monkeypatch, capsys, name):
    cls = library_errors()[name]
    err = _instance(cls)

    def run(args):
        raise err

    _with_command(monkeypatch, run)
    assert cli.main(["fail-test"]) == cls.exit_status
    captured = capsys.readouterr()
    assert captured.out == ""
    if cls is ManyErrors:
        assert captured.err == "met: 1 problem:\n  f.toml: x: a\n"
    else:
        assert captured.err == "met: f.toml: some.key: went wrong (expected X, found Y)\n"


def test_debug_shows_the_traceback_instead(monkeypatch):
    def run(args):
        raise ConfigError("bad", file="f.toml")

    _with_command(monkeypatch, run)
    with pytest.raises(ConfigError, match="f.toml: bad"):
        cli.main(["--debug", "fail-test"])
    with pytest.raises(ConfigError):
        cli.main(["fail-test", "--debug"])


def test_ctrl_c_is_status_130_and_one_line(monkeypatch, capsys):
    def run(args):
        raise KeyboardInterrupt

    _with_command(monkeypatch, run)
    assert cli.main(["fail-test"]) == EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err == "met: interrupted\n"


def test_a_file_system_refusal_is_one_line_too(monkeypatch, capsys):
    def run(args):
        open("/nonexistent-dir/x" + "y" * 5000)

    _with_command(monkeypatch, run)
    assert cli.main(["fail-test"]) == EXIT_OS_ERROR == 12
    err = capsys.readouterr().err
    assert err.startswith("met: /nonexistent-dir/xyyy") and err.endswith(": File name too long\n")
    assert err.count("\n") == 1
    with pytest.raises(OSError):
        cli.main(["--debug", "fail-test"])


def test_a_real_command_reports_a_bad_registry_in_one_line(tmp_path, capsys):
    (tmp_path / "KERNEL_FAMILIES.toml").write_text("[family.add\n")
    (tmp_path / "FUSIONS.toml").write_text("")
    assert cli.main(["families", "--kernels", str(tmp_path)]) == ConfigError.exit_status
    err = capsys.readouterr().err
    assert err.startswith(f"met: {tmp_path / 'KERNEL_FAMILIES.toml'}:1:12: TOML syntax error: ")
    assert err.count("\n") == 1

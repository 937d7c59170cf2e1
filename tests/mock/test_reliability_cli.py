"""``met`` turns every error type into one line and its documented exit status (issue 10).

``docs/errors.md`` lists each ``MetraleError`` subclass with the status ``met`` exits with;
these tests keep the table and the classes in agreement, and check the CLI's behaviour for
each type, for ``--debug`` and for Ctrl-C.
"""

from __future__ import annotations

import importlib
import json
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


# -- issue 53 and 54: arguments refused before anything runs, one line each ------------------


def _met(capsys, *argv):
    try:
        status = cli.main(list(argv))
    except SystemExit as e:  # argparse: usage errors exit 2, --version and --help exit 0
        status = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return status, out, err


@pytest.mark.parametrize("argv,says", [
    (["run", "--prompt", "1,99999999999999999999"], "argument --prompt: expected token ids in"),
    (["run", "--prompt", "1,x"], "argument --prompt: expected comma-separated token ids"),
    (["run", "--prompt", ","], "argument --prompt: expected at least one token id"),
    (["run", "--seed", "-1"], "argument --seed: expected an integer >= 0"),
    (["run", "--steps", "0"], "argument --steps: expected an integer >= 1, found '0'"),
    (["run", "--context", "0"], "argument --context: expected an integer >= 1"),
    (["bench", "tiny-qwen3", "--steps", "0"], "argument --steps: expected an integer >= 1"),
    (["bench", "tiny-qwen3", "--rows", "0"], "argument --rows: expected an integer >= 1"),
    (["plan", "tiny-qwen3", "--rows", "-3"], "argument --rows: expected an integer >= 1"),
    (["plan", "tiny-qwen3", "--layer", "-1"], "argument --layer: expected an integer >= 0"),
    (["quantize", "a", "b", "--to", "fp8", "--format", "fp8"],
     "--format is the output format (table or json), found 'fp8'; the weight format is --to"),
])
def test_bad_numbers_are_usage_errors_naming_the_flag(capsys, argv, says):
    status, out, err = _met(capsys, *argv)
    assert status == 2 and out == ""
    assert says in err and err.rstrip().splitlines()[-1].startswith(f"met {argv[0]}: error: ")
    assert "slot" not in err


def test_rows_zero_speaks_of_rows_not_slots(capsys):
    _, _, err = _met(capsys, "bench", "tiny-qwen3", "--rows", "0")
    assert "--rows" in err and "slot" not in err


@pytest.mark.parametrize("layer,layers", [("99", 2), ("2", 2)])
def test_a_layer_past_the_last_is_refused(capsys, layer, layers):
    status, out, err = _met(capsys, "plan", "tiny-qwen3", "--layer", layer)
    assert status == ConfigError.exit_status and out == ""
    assert err == (f"met: --layer: no such layer (expected 0 <= layer < {layers} (tiny-qwen3 has "
                   f"{layers}), found {layer})\n")


def test_layer_40_on_a_28_layer_model_is_refused(capsys):
    status, _, err = _met(capsys, "plan", "qwen3-0.6b", "--layer", "40")
    assert status == 3 and "0 <= layer < 28" in err
    status, out, _ = _met(capsys, "plan", "qwen3-0.6b", "--layer", "27")
    assert status == 0 and "layer 27 shown" in out


def test_a_bad_diff_target_is_named_as_one(capsys):
    status, _, err = _met(capsys, "plan", "tiny-qwen3", "--diff", "foo")
    assert status == 3
    assert err.startswith("met: --diff: bad diff target (expected a hardware class (cuda, host, ")
    assert "or a quant (bf16, fp8, mxfp4, nvfp4), found 'foo')" in err
    assert "quant" in err and "unknown quantization format" not in err


@pytest.mark.parametrize("product,cls", [("h100", "sm_90"), ("H200", "sm_90"),
                                         ("a100", "sm_80"), ("RTX 4090", "sm_89"),
                                         ("rtx5090", "sm_120"), ("b200", "sm_100"),
                                         ("gb10", "sm_121"), ("L40S", "sm_89")])
def test_a_gpu_product_is_answered_with_its_class(capsys, product, cls):
    status, out, err = _met(capsys, "plan", "tiny-qwen3", "--hardware", product)
    assert status == 3 and out == ""
    assert f"{product!r} is a GPU, not a hardware class: its class is {cls}" in err
    assert err.rstrip().endswith(f"did you mean {cls!r}?")


def test_a_misspelt_class_still_gets_the_nearest_spelling(capsys):
    _, _, err = _met(capsys, "residual", "--hardware", "sm90")
    assert "unknown hardware class" in err and "did you mean 'sm_90'?" in err


def test_met_version_flag_and_command_agree(capsys):
    status, out, _ = _met(capsys, "--version")
    assert status == 0 and out == f"met {metrale.__version__}\n"
    assert _met(capsys, "version")[1] == f"{metrale.__version__}\n"


def test_every_help_states_the_defaults(capsys):
    parser = cli.parser()
    sub = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    for name, sp in sub.choices.items():
        text = sp.format_help()
        for action in sp._actions:
            if (not action.option_strings or action.nargs == 0 or action.default is None
                    or action.default is __import__("argparse").SUPPRESS):
                continue
            assert "default" in (action.help or "") or "(default: " in text, (name, action.dest)
            shown = (",".join(map(str, action.default)) if isinstance(action.default, list)
                     else str(action.default))
            assert shown in " ".join(text.split()), (name, action.dest)


def test_run_and_plan_say_they_default_to_the_host(capsys):
    for name in ("run", "plan", "bench"):
        _, out, _ = _met(capsys, name, "--help")
        flat = " ".join(out.split())
        assert "(default: host)" in flat, name


def test_models_lists_every_built_in_with_what_it_is(capsys):
    from metrale.plan.models import builtin_names

    status, out, _ = _met(capsys, "models", "--format", "json")
    rows = json.loads(out)
    assert status == 0 and [r["model"] for r in rows] == list(builtin_names())
    assert {r["model"]: r["test_model"] for r in rows}["tiny-qwen3"] is True
    assert {r["model"]: r["layers"] for r in rows}["qwen3-0.6b"] == 28
    status, out, _ = _met(capsys, "models")
    assert all(n in out for n in builtin_names()) and "tiny-*: test models" in out


def test_hardware_lists_every_class_with_its_products(capsys):
    from metrale.realize.hardware import load_hardware

    status, out, _ = _met(capsys, "hardware", "--format", "json")
    rows = json.loads(out)
    assert status == 0 and [r["class"] for r in rows] == list(load_hardware().names)
    about = {r["class"]: r["about"] for r in rows}
    assert "H100" in about["sm_90"] and "A100" in about["sm_80"]


def test_warnings_are_one_line(monkeypatch, capsys):
    import warnings

    def run(args):
        warnings.warn("something to know", UserWarning, stacklevel=1)
        return 0

    _with_command(monkeypatch, run)
    assert cli.main(["fail-test"]) == 0
    assert capsys.readouterr().err == "met: warning: something to know\n"


def test_quantize_names_its_formats_the_same_in_help_and_error(capsys):
    from metrale.names import quant_names

    _, out, _ = _met(capsys, "quantize", "--help")
    assert quant_names() in " ".join(out.split())
    status, _, err = _met(capsys, "quantize", "src", "dst", "--to", "fp9")
    assert status == 3
    assert err == f"met: --to: unknown weight format (expected {quant_names()}, found 'fp9'); did you mean 'fp8'?\n"
    status, _, err = _met(capsys, "quantize", "src", "dst", "--to", "bf16")
    assert status == 3 and "found 'bf16')\n" in err


@pytest.mark.parametrize("host", ["../..", "", "☃", "x" * 300])
def test_serve_refuses_an_address_that_does_not_resolve_before_loading(capsys, host):
    status, out, err = _met(capsys, "serve", "/nonexistent/model", "--host", host)
    assert status == 3 and out == ""  # the model (which does not exist) was never loaded
    assert err == ("met: --host: cannot resolve the address (expected an IP address or a host "
                   f"name this machine resolves, found {host!r})\n")


def test_serve_refuses_a_port_in_use_before_loading(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        status, out, err = _met(capsys, "serve", "/nonexistent/model", "--port", str(port))
    assert status == 3 and out == ""
    assert err.startswith(f"met: --port: cannot listen on the address (expected a free port on an "
                          f"address of this machine, found 127.0.0.1:{port} (")

"""The README's commands and Python snippets run as written (issue 54), whatever README lands.

The README is read generically, fence by fence; this is the convention its authors follow:

* In a ``bash``, ``sh``, ``shell``, ``console`` or ``text`` fence, every ``met …`` is a command:
  a line's ``$ `` prompt is dropped, ``a && b`` and ``met x | met y`` give each part, an indented
  line continuing a ``text`` synopsis belongs to the line before, and the description after two
  or more spaces is not part of it. Each command's grammar is checked against ``met``'s parser
  with its ``[optional groups]`` in (the subcommand exists, every flag is one of its options,
  every literal value parses); then it runs with the optional groups left out and must exit 0.
* UPPERCASE words are placeholders, replaced by :data:`PLACEHOLDERS` (``a|b|c`` by ``a``).
* ``# needs: gpu`` (or any ``# needs: REASON``) at the end of a command line: checked, not run.
  ``met run``/``bench``/``build`` on a GPU class run only where ``nvidia-smi`` answers.
* ``python`` fences run in README order in one namespace (a snippet may use an earlier one's
  names); a fence whose first line is ``# needs: REASON`` is skipped.
* ``<!-- readme-test: skip -->`` on the line before a fence skips that fence.
* A command that serves until interrupted (``met serve``) runs as a user runs it: in its own
  process on a free port, until ``GET /health`` answers 200; then Ctrl-C must stop it with
  status 0.

Commands run in a scratch folder, with ``METRALE_CACHE`` and ``METRALE_REGISTRY`` there too.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from metrale import cli
from tests.host.conftest import run_met
from tests.text_checkpoint import make_text_checkpoint

README = Path(__file__).resolve().parents[2] / "README.md"
SHELL_FENCES = {"bash", "sh", "shell", "console", "text"}
PLACEHOLDERS = {
    "MODEL": "tiny-qwen3", "Q": "bf16", "QUANT": "bf16", "H": "host", "HW": "host",
    "HARDWARE": "host", "N": "2", "P": "exact", "POLICY": "exact", "HW_OR_QUANT": "fp8",
    "DIR": "{ckpt}", "CHECKPOINT": "{ckpt}", "SRC": "{ckpt}", "DST": "{dst}",
    "T": "0.7", "TOP_P": "0.9", "S": "1",
}
_NEEDS = re.compile(r"#\s*needs:\s*(\S.*)$")
SERVERS = {"serve"}
"""Subcommands that serve until interrupted (run by :func:`_serve`, not in-process)."""


def fences(text: str) -> list[tuple[str, str, int, bool]]:
    """``(language, body, first line number, skipped)`` of every fenced block."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^\s*```+\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        skipped = i > 0 and "readme-test: skip" in lines[i - 1]
        j = i + 1
        while j < len(lines) and not re.match(r"^\s*```", lines[j]):
            j += 1
        out.append((m.group(1).lower(), "\n".join(lines[i + 1:j]), i + 2, skipped))
        i = j + 1
    return out


def commands(body: str, synopsis: bool) -> list[tuple[str, str | None]]:
    """``(command, needs)`` for every ``met …`` of a shell or text fence."""
    joined: list[str] = []
    for line in body.splitlines():
        if synopsis and joined and re.match(r"^\s+[\[-]", line):
            joined[-1] += " " + re.split(r"\s{2,}", line.strip())[0]
        else:
            joined.append(line)
    out = []
    for line in joined:
        m = _NEEDS.search(line)
        needs = m.group(1).strip() if m else None
        line = _NEEDS.sub("", line).strip().removeprefix("$ ")
        for part in re.split(r"\s&&\s|\s;\s", line):
            for cmd in re.split(r"\s\|\s(?=met\b)", part.strip()):
                cmd = re.split(r"\s{2,}", cmd.strip())[0] if synopsis else cmd.strip()
                if cmd.startswith("met ") or cmd == "met":
                    out.append((cmd, needs))
    return out


def _fill(words: list[str], values: dict[str, str]) -> list[str]:
    out = []
    for w in words:
        w = w.split("|")[0] if "|" in w and not w.startswith("|") else w
        out.append(values.get(w, w).format(**values) if w in values else w)
    return out


def variants(cmd: str, values: dict[str, str]) -> tuple[list[str], list[str]]:
    """The command with its optional groups in (grammar) and out (run), placeholders filled."""
    full = cmd.replace("[", " ").replace("]", " ")
    minimal = cmd
    while re.search(r"\[[^\[\]]*\]", minimal):
        minimal = re.sub(r"\s*\[[^\[\]]*\]", "", minimal)
    return (_fill(shlex.split(full)[1:], values), _fill(shlex.split(minimal)[1:], values))


def _gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def _runnable(argv: list[str]) -> str | None:
    """Why ``argv`` cannot run here, or ``None``."""
    if argv and argv[0] in ("run", "bench", "build") and "--hardware" in argv:
        hw = argv[argv.index("--hardware") + 1]
        if hw != "host" and not _gpu():
            return f"--hardware {hw} needs a GPU"
    return None


def _readme_commands() -> list[tuple[int, str, str | None]]:
    out = []
    for lang, body, line, skipped in fences(README.read_text(encoding="utf-8")):
        if lang in SHELL_FENCES and not skipped:
            out += [(line, c, n) for c, n in commands(body, synopsis=lang == "text")]
    return out


def test_the_readme_has_a_cli_section_to_check():
    found = _readme_commands()
    assert len(found) >= 5, found  # the reader below sees the README's commands
    assert {shlex.split(c.replace("[", " "))[1] for _, c, _ in found
            if len(shlex.split(c)) > 1} >= {"run", "plan"}


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    d = tmp_path_factory.mktemp("readme")
    make_text_checkpoint(d / "ckpt")
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(argv: list[str], ready_s: float = 120.0) -> tuple[int, str]:
    """Start the server ``met *argv`` on a free port, wait for ``GET /health`` to answer 200,
    then interrupt it as Ctrl-C does: its exit status and output (-1 if it never answered)."""
    port = _free_port()
    if "--port" in argv:
        argv = argv[:argv.index("--port")] + argv[argv.index("--port") + 2:]
    proc = subprocess.Popen([sys.executable, "-m", "metrale", *argv, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    answered, deadline = False, time.monotonic() + ready_s
    try:
        while not answered and proc.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    answered = r.status == 200
            except OSError:
                time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            return -1, out + "\n(did not stop within 60 s of Ctrl-C)"
    return (proc.returncode if answered else -1), out


@pytest.mark.slow
@pytest.mark.parametrize("k", range(len(_readme_commands())))
def test_each_readme_command_parses_and_runs(k, scratch, monkeypatch):
    line, cmd, needs = _readme_commands()[k]
    monkeypatch.chdir(scratch)
    monkeypatch.setenv("METRALE_CACHE", str(scratch / "cache"))
    monkeypatch.setenv("METRALE_REGISTRY", str(scratch / "registry"))
    values = dict(PLACEHOLDERS, ckpt=str(scratch / "ckpt"), dst=str(scratch / f"out-{k}"))
    full, minimal = variants(cmd, values)
    try:
        cli.parser().parse_args(full)
    except SystemExit:
        pytest.fail(f"README.md (fence at line {line}): `{cmd}` does not parse as `met {' '.join(full)}`")
    why = f"needs {needs}" if needs else _runnable(minimal)
    if why:
        pytest.skip(f"README.md:{line}: {why}")
    status, text = _serve(minimal) if minimal[0] in SERVERS else run_met(minimal)
    assert status == 0, f"README.md (fence at line {line}): `met {' '.join(minimal)}` exited {status}:\n{text}"


def _python_blocks() -> list[tuple[int, str]]:
    return [(line, body) for lang, body, line, skipped in fences(README.read_text("utf-8"))
            if lang in ("python", "py", "pycon") and not skipped
            and not _NEEDS.match(body.lstrip().splitlines()[0] if body.strip() else "")]


@pytest.mark.slow
def test_the_readme_python_snippets_run_in_order(tmp_path, monkeypatch):
    import doctest

    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    blocks = _python_blocks()
    assert blocks, "the README shows no Python"
    for line, body in blocks:
        if body.lstrip().startswith(">>>"):
            test = doctest.DocTestParser().get_doctest(body, namespace, "README", "README.md",
                                                       line)
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
            assert runner.run(test, out=lambda s: None).failed == 0, f"README.md:{line}"
            continue
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                exec(compile(body, f"README.md:{line}", "exec"), namespace)
            except Exception as e:
                pytest.fail(f"README.md:{line}: the snippet raised {type(e).__name__}: {e}")


def test_the_reader_follows_the_convention():
    text = ("```text\nmet plan MODEL --quant Q [--mode decode|prefill]\n"
            "         [--why]  one step\nmet families | met relations [--hardware H]  list\n```\n"
            "<!-- readme-test: skip -->\n```bash\nmet run\n```\n"
            "```bash\n$ pip install . && met run --steps 2  # needs: gpu\n```\n")
    found = fences(text)
    assert [(lang, skipped) for lang, _, _, skipped in found] == [
        ("text", False), ("bash", True), ("bash", False)]
    assert commands(found[0][1], synopsis=True) == [
        ("met plan MODEL --quant Q [--mode decode|prefill] [--why]", None),
        ("met families", None), ("met relations [--hardware H]", None)]
    assert commands(found[2][1], synopsis=False) == [("met run --steps 2", "gpu")]
    full, minimal = variants("met plan MODEL --quant Q [--mode decode|prefill] [--why]",
                             dict(PLACEHOLDERS, ckpt="c", dst="d"))
    assert full == ["plan", "tiny-qwen3", "--quant", "bf16", "--mode", "decode", "--why"]
    assert minimal == ["plan", "tiny-qwen3", "--quant", "bf16"]

"""Every ``met`` command's output at 80 and 120 columns, pinned as exact text (issue 54).

Each case runs ``met`` in-process with ``COLUMNS`` set (rich and argparse read it when there is
no terminal) and compares stdout and stderr with ``tests/snapshots/cli/<case>.<width>.txt``.
Timings are the only parts that vary between runs: they are masked (``<t>``) before comparing;
``met bench``'s per-kernel rows, ordered by time, are replaced by their count. Regenerate
after a deliberate change with ``METRALE_UPDATE_SNAPSHOTS=1`` and review the diff.
``met build`` is left out: its output and timing are the build's own.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from metrale.cli import main
from tests.host.test_reliability_weights import tiny_checkpoint

SNAPSHOTS = Path(__file__).resolve().parents[1] / "snapshots" / "cli"
UPDATE = os.environ.get("METRALE_UPDATE_SNAPSHOTS") == "1"
WIDTHS = (80, 120)

CASES: dict[str, list[str]] = {
    "help": ["--help"],
    "version": ["version"],
    "models": ["models"],
    "hardware": ["hardware"],
    "families": ["families"],
    "relations": ["relations"],
    "relations-sm_90": ["relations", "--hardware", "sm_90"],
    "check": ["check", "--hardware", "host", "--seeds", "1"],
    "plan": ["plan", "tiny-qwen3"],
    "plan-why": ["plan", "tiny-qwen3-moe", "--quant", "fp8", "--why"],
    "plan-layer": ["plan", "qwen3-0.6b", "--hardware", "sm_90", "--layer", "27"],
    "plan-diff-hw": ["plan", "qwen3-0.6b", "--hardware", "sm_90", "--diff", "sm_80"],
    "plan-diff-quant": ["plan", "tiny-qwen3", "--diff", "nvfp4"],
    "residual-sm_90": ["residual", "--hardware", "sm_90"],
    "residual-host": ["residual", "--hardware", "host"],
    "quantize": ["quantize", "src", "dst", "--to", "mxfp4"],
    "run": ["run", "--steps", "4"],
    "run-checkpoint": ["run", "--checkpoint", "src", "--steps", "3", "--prompt", "5,6"],
    "bench": ["bench", "tiny-qwen3", "--steps", "3"],
    "bench-prefill": ["bench", "tiny-qwen3", "--mode", "prefill", "--rows", "4", "--steps", "2"],
    "tune": ["tune", "tiny-qwen3", "--no-record", "--steps", "2", "--repeats", "1",
             "--context", "16"],
    "error-hardware": ["plan", "tiny-qwen3", "--hardware", "h100"],
    "error-usage": ["bench", "tiny-qwen3", "--steps", "0"],
}

_TABLE = re.compile("[│┃┏┗┡└┌]")
_TIME = re.compile(r"\b\d+(?:\.\d+)?(?= (?:ms|s|tokens/s)\b)")


def _mask(case: str, text: str) -> str:
    text = _TIME.sub("<t>", text)
    if case in ("bench", "tune"):  # the rows hold measured times
        lines = text.splitlines(keepends=True)
        body = [x for x in lines if x.startswith("│")]
        text = "".join(x for x in lines if not x.startswith("│"))
        text += f"<{len(body)} kernel rows>\n"
    return text


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("snap")
    tiny_checkpoint(d / "src")
    return d


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_output_matches_its_snapshot(case, width, workdir, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", str(width))
    monkeypatch.chdir(workdir)
    if case == "quantize" and (workdir / "dst").exists():
        shutil.rmtree(workdir / "dst")
    try:
        status = main(CASES[case])
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    got = _mask(case, f"$ met {' '.join(CASES[case])}\n[exit {status}]\n--- stdout\n{out}"
                      f"--- stderr\n{err}")
    path = SNAPSHOTS / f"{case}.{width}.txt"
    if UPDATE:
        path.write_text(got, encoding="utf-8")
    assert path.is_file(), f"no snapshot {path}: run with METRALE_UPDATE_SNAPSHOTS=1"
    assert got == path.read_text(encoding="utf-8")
    for line in out.splitlines():  # every table fits the width it was printed at (prose
        if _TABLE.search(line):     # lines are the terminal's to wrap)
            assert len(line) <= width, (case, line)


def test_every_command_has_a_snapshot():
    from metrale import cli

    cli.parser()
    covered = {argv[0] for argv in CASES.values()}
    assert set(cli._COMMANDS) - covered <= {"build", "serve", "evidence"}, (
        set(cli._COMMANDS) - covered)

"""Issue 54, numbers that mislead and flags that do not do what they say: each a test."""

from __future__ import annotations

import json

import pytest

from metrale.cli import main


def _met(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return status, out, err


def test_steps_32_generates_32_tokens_and_says_so(capsys):
    status, out, _ = _met(capsys, "run", "--steps", "32")
    assert status == 0
    assert "generated 32 token(s): 1 by the prefill, then 31 decode step(s) at " in out
    tokens = json.loads(next(x for x in out.splitlines() if x.startswith("tokens: "))[8:])
    assert len(tokens) == 32


def test_host_memory_says_the_host_holds_f32(capsys):
    for quant in ("bf16", "nvfp4"):
        status, out, _ = _met(capsys, "run", "--quant", quant, "--steps", "2")
        line = next(x for x in out.splitlines() if x.startswith("peak memory: "))
        assert status == 0 and "the host holds weights as f32, whatever the format" in line


def test_bench_on_the_host_never_prints_zero_percent_of_a_floor(capsys):
    status, out, _ = _met(capsys, "bench", "tiny-qwen3", "--steps", "3")
    assert status == 0
    assert "0% of the floor" not in out and "of the floor" not in out
    assert "no memory floor on the host (it runs the reference semantics)" in out
    assert " 0% " not in out  # a kernel's share below 1% is shown as such, never as 0%


def test_share_never_rounds_to_zero():
    from metrale.commands import _share

    assert _share(0.004) == "0.40%" and _share(0.00001) == "< 0.01%" and _share(0.0) == "0%"
    assert _share(0.456) == "46%"


@pytest.mark.parametrize("diff", ["sm_80", "fp8"])
def test_diff_lists_only_the_reasons_that_differ(capsys, diff):
    from metrale.plan.plan import plan_for

    hw, quant = ("sm_90", "bf16")
    a = plan_for("qwen3-0.6b", quant, hw)
    b = plan_for("qwen3-0.6b", quant, diff) if diff.startswith("sm") else plan_for(
        "qwen3-0.6b", diff, hw)

    def declined(p):
        return {f"{d.relation}: {d.reason}" for d in p.declined
                if not d.reason.startswith("overlaps")}

    status, out, _ = _met(capsys, "plan", "qwen3-0.6b", "--hardware", hw, "--diff", diff)
    assert status == 0
    shown = [x.removeprefix("  why: ") for x in out.splitlines() if x.startswith("  why: ")]
    want = sorted(f"{r} (only {a.target})" for r in declined(a) - declined(b)) + sorted(
        f"{r} (only {b.target})" for r in declined(b) - declined(a))
    assert shown == want
    common = declined(a) & declined(b)
    assert common and not any(r.rsplit(" (only ", 1)[0] in common for r in shown)


def _on_a_terminal(*argv: str) -> str:
    """What ``met ARGV`` writes to stderr when stderr is a terminal (a pseudo-terminal)."""
    import os
    import pty
    import subprocess
    import sys

    main_fd, tty_fd = pty.openpty()
    env = dict(os.environ, COLUMNS="100", TERM="xterm")
    proc = subprocess.Popen([sys.executable, "-m", "metrale", *argv], stdout=subprocess.PIPE,
                            stderr=tty_fd, env=env)
    os.close(tty_fd)
    chunks = []
    while True:
        try:
            data = os.read(main_fd, 4096)
        except OSError:  # the terminal closed with the process
            break
        if not data:
            break
        chunks.append(data)
    proc.communicate(timeout=120)
    os.close(main_fd)
    assert proc.returncode == 0
    return b"".join(chunks).decode(errors="replace")


def test_progress_shows_on_a_terminal_and_never_with_no_progress():
    shown = _on_a_terminal("run", "--steps", "2")
    assert "loading tiny-qwen3 (random weights (seed 0))" in shown
    assert _on_a_terminal("run", "--steps", "2", "--no-progress") == ""


def test_progress_stays_off_a_pipe(capsys):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "metrale", "run", "--steps", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == ""

"""Compiler processes: each in its own process group, stopped together on an interrupt, and
never left running (nor their scratch folders left behind) by a parent that was killed.

Every compiler process (:func:`run`) gets its own process group, and its scratch folders
(:func:`scratch`) live in this process's session folder ``<tmp>/metrale-build-<pid>-<hex>/``.

- :func:`interrupt` kills every live compiler group at once and refuses new compilers until
  :func:`resume`; a build calls it when Ctrl-C arrives, so its compilers stop at once rather
  than after the queued compiles have run.
- A parent killed outright (SIGKILL) runs no code of its own. With the first compiler a small
  *reaper* process starts (this module run as a script), reading a pipe whose write end only
  the parent holds; when the parent dies, however it dies, the pipe closes and the reaper
  kills the process groups the parent recorded (one empty file per group in ``procs/``, and
  on Linux any process working inside the session folder) and deletes the folder.
- A session folder whose owner and reaper are both gone is swept by the next process that
  starts a session.

>>> import sys
>>> run([sys.executable, "-c", "print(6 * 7)"], cwd=".").stdout
'42\\n'
>>> session().name.startswith(f"metrale-build-{os.getpid()}-")
True
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

_SESSION = re.compile(r"metrale-build-(\d+)-[0-9a-f]{8}")
_lock = threading.Lock()
_live: dict[int, subprocess.Popen] = {}
_stopped = threading.Event()
_state: dict[str, object] = {}

class Interrupted(KeyboardInterrupt):
    """A compiler was stopped, or refused to start, because the build was interrupted."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _groups(root: Path) -> set[int]:
    """The compiler process groups of session ``root``: those it recorded in ``procs/``, and
    (on Linux) every process working inside it, which covers a compiler started just before
    its parent died, before the record was written."""
    found = set()
    for f in (root / "procs").iterdir() if (root / "procs").is_dir() else ():
        with contextlib.suppress(ValueError):
            found.add(int(f.name))
    inside = str(root) + os.sep
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError):
            if (os.readlink(proc / "cwd") + os.sep).startswith(inside):
                found.add(os.getpgid(int(proc.name)))
    found.discard(os.getpgid(0))  # never the reaper's (or the sweeping process's) own group
    return found


def reap(root: Path) -> None:
    """Kill the compiler groups of session ``root`` and delete it (the reaper's whole job,
    and the sweep's for each stale session)."""
    for group in _groups(root):
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGKILL)
    shutil.rmtree(root, ignore_errors=True)


def sweep(tmp: Path | None = None) -> list[Path]:
    """Delete the session folders under ``tmp`` whose owner process is gone, killing any
    compiler group they recorded first; returns the folders deleted."""
    tmp = Path(tmp if tmp is not None else tempfile.gettempdir())
    gone = []
    for d in tmp.glob("metrale-build-*"):
        m = _SESSION.fullmatch(d.name)
        if m is None or not d.is_dir() or _alive(int(m.group(1))):
            continue
        reap(d)
        gone.append(d)
    return gone


def session() -> Path:
    """This process's session folder (made, with its reaper, on first use; stale ones swept)."""
    with _lock:
        root = _state.get("root")
        if isinstance(root, Path) and root.is_dir() and _state.get("pid") == os.getpid():
            return root
        tmp = Path(tempfile.gettempdir())
        sweep(tmp)
        root = tmp / f"metrale-build-{os.getpid()}-{secrets.token_hex(4)}"
        (root / "procs").mkdir(parents=True)
        reaper = subprocess.Popen([sys.executable, "-I", "-S", __file__, "--reap", str(root)],
                                  stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)
        _state.update(root=root, pid=os.getpid(), reaper=reaper)
        if not _state.get("atexit"):
            atexit.register(close)
            _state["atexit"] = True
        return root


def close() -> None:
    """End the session: kill live compilers, delete the folder, let the reaper exit."""
    with _lock:
        for proc in list(_live.values()):
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
        root, reaper = _state.pop("root", None), _state.pop("reaper", None)
        owner = _state.pop("pid", None)
    if owner != os.getpid():  # a forked child does not own its parent's session
        return
    if isinstance(root, Path):
        shutil.rmtree(root, ignore_errors=True)
    if isinstance(reaper, subprocess.Popen):
        with contextlib.suppress(OSError):
            reaper.stdin.close()  # type: ignore[union-attr]
        with contextlib.suppress(subprocess.TimeoutExpired):
            reaper.wait(timeout=5)


def scratch(prefix: str) -> tempfile.TemporaryDirectory:
    """A temporary folder inside the session folder (deleted on exit, or by the reaper)."""
    return tempfile.TemporaryDirectory(prefix=prefix, dir=session())


def run(cmd: Sequence[str], *, cwd: os.PathLike | str, timeout: float | None = None
        ) -> subprocess.CompletedProcess:
    """Run a compiler in its own process group; its text output is captured.

    Raises :class:`Interrupted` when :func:`interrupt` stopped it or was called before it
    could start, and ``subprocess.TimeoutExpired`` (its group killed) past ``timeout``.
    """
    procs = session() / "procs"
    with _lock:
        if _stopped.is_set():
            raise Interrupted("build interrupted: compiler not started")
        proc = subprocess.Popen(list(cmd), cwd=cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        _live[proc.pid] = proc
        (procs / str(proc.pid)).touch()
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    finally:
        with _lock:
            _live.pop(proc.pid, None)
            with contextlib.suppress(OSError):
                (procs / str(proc.pid)).unlink()
    if _stopped.is_set():
        raise Interrupted("build interrupted: compiler stopped")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def interrupt() -> int:
    """Kill every live compiler group and refuse new ones until :func:`resume`; returns how
    many were killed."""
    with _lock:
        _stopped.set()
        live = list(_live.values())
        for proc in live:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
    return len(live)


def resume() -> None:
    """Allow compilers again after :func:`interrupt`."""
    _stopped.clear()


def live() -> tuple[int, ...]:
    """The process ids of the compilers running now."""
    with _lock:
        return tuple(_live)


if __name__ == "__main__" and sys.argv[1:2] == ["--reap"]:
    # The reaper (``python -I -S jobs.py --reap ROOT``, standard library only): wait for the
    # parent to exit, however it exits (the pipe on stdin closes), then clean up after it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stdin.buffer.read()
    reap(Path(sys.argv[2]))

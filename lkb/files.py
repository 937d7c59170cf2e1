"""Reading registries and writing artifacts safely: size-capped TOML/JSON, atomic writes, schemas.

Every file Metrale writes goes through :func:`atomic_write` (temp file in the same folder,
fsync, rename), so an interrupt never leaves half a file in place of a good one. Every TOML
or JSON file it reads goes through :func:`read_toml` / :func:`read_json`, which refuse huge
or deeply nested files before parsing and report syntax errors as ``file:line:col``.

>>> import tempfile, pathlib
>>> p = pathlib.Path(tempfile.mkdtemp()) / "x.toml"
>>> atomic_write(p, 'a = 1\\nb = "two"\\n')
>>> read_toml(p)
{'a': 1, 'b': 'two'}
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import tomllib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from .errors import ConfigError, ManyErrors, MetraleError, nearest

MAX_REGISTRY_BYTES = 16 * 1024 * 1024
"""TOML and JSON files larger than this are refused before parsing."""
MAX_NESTING = 64
"""Brackets nested deeper than this are refused before parsing."""


@contextlib.contextmanager
def exclusive(lock: os.PathLike | str) -> Iterator[None]:
    """Hold the file ``lock`` (made if missing) exclusively: writers of one thing take turns
    across processes. Where ``fcntl`` is missing (not POSIX) it holds
    nothing: one writer at a time is then the user's care."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def atomic_write(path: os.PathLike | str, data: bytes | str) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never half.

    The bytes go to a temporary file in the same folder, are flushed to disk, and the file is
    renamed over ``path``; on any error (including ``KeyboardInterrupt``) the temporary file is
    removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else bytes(data)
    # The name is drawn before the file exists (64 random bits: no clash in practice) and the
    # file is made inside the ``try``, so an interrupt landing anywhere, even just after the
    # open, still finds the temporary file to remove; ``tempfile.mkstemp`` leaves that gap.
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    try:
        # mode 0o666 less the umask: the usual mode of a new file
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                     0o666)
        with os.fdopen(fd, "wb") as out:
            out.write(raw)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _guard(path: Path, text_bytes: int, text: str, kind: str) -> None:
    if text_bytes > MAX_REGISTRY_BYTES:
        raise ConfigError(
            f"{kind} file too large to be a registry or config",
            file=path,
            expected=f"at most {MAX_REGISTRY_BYTES} bytes",
            found=f"{text_bytes} bytes",
        )
    depth = 0
    for m in _TOKENS[kind].finditer(text):
        token = m.group()
        if token in ("[", "{"):
            depth += 1
            if depth > MAX_NESTING:
                raise ConfigError(
                    f"{kind} file nested too deeply",
                    file=path,
                    expected=f"at most {MAX_NESTING} levels",
                    found=f"more than {MAX_NESTING}",
                )
        elif token in ("]", "}"):
            depth = max(0, depth - 1)


# Brackets count only outside strings and comments. TOML: multi-line strings, basic strings
# with escapes, literal strings without, and a single-line string ends at its line's end
# (unterminated, the parser reports it); comments run to the end of the line. Every pattern
# matches (an unterminated multi-line string runs to the end), so the scan stays linear.
_TOKENS = {
    "TOML": re.compile(r'"""(?:\\.|[^\\])*?(?:"""|\Z)|\'\'\'.*?(?:\'\'\'|\Z)'
                       r'|"(?:\\.|[^"\\\n])*"?|\'[^\'\n]*\'?|#[^\n]*|[\[\]{}]', re.DOTALL),
    "JSON": re.compile(r'"(?:\\.|[^"\\])*"?|[\[\]{}]', re.DOTALL),
}


def _read_text(path: Path, kind: str) -> str:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ConfigError(f"{kind} file not found", file=path) from None
    except OSError as e:  # a name too long, a permission refused …
        raise ConfigError(f"cannot read {kind} file", file=path, found=e.strerror) from None
    if size > MAX_REGISTRY_BYTES:
        _guard(path, size, "", kind)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{kind} file is not UTF-8 text", file=path, found=str(e)) from None
    except OSError as e:  # a folder where the file should be, a permission refused …
        raise ConfigError(f"cannot read {kind} file", file=path, found=e.strerror) from None
    _guard(path, len(text), text, kind)
    return text


_TOML_POS = re.compile(r"\(at line (\d+), column (\d+)\)")


def read_toml(path: os.PathLike | str) -> dict[str, Any]:
    """Parse a TOML file; a syntax error becomes ``ConfigError`` at ``file:line:col``."""
    path = Path(path)
    text = _read_text(path, "TOML")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        m = _TOML_POS.search(msg)
        line, col = (int(m.group(1)), int(m.group(2))) if m else (None, None)
        raise ConfigError(
            "TOML syntax error: " + _TOML_POS.sub("", msg).strip(), file=path, line=line, col=col
        ) from None
    except RecursionError:
        raise ConfigError("TOML file nested too deeply", file=path) from None
    except ValueError as e:  # an integer past Python's 4300-digit conversion limit
        raise ConfigError(f"TOML value unreadable: {e}", file=path) from None


def read_json(path: os.PathLike | str) -> Any:
    """Parse a JSON file; a syntax error becomes ``ConfigError`` at ``file:line:col``."""
    path = Path(path)
    text = _read_text(path, "JSON")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"JSON syntax error: {e.msg}", file=path, line=e.lineno, col=e.colno) from None
    except RecursionError:
        raise ConfigError("JSON file nested too deeply", file=path) from None
    except ValueError as e:  # an integer past Python's 4300-digit conversion limit
        raise ConfigError(f"JSON value unreadable: {e}", file=path) from None


_MISSING = object()


class Fields:
    """Reads one table of a registry against its schema, collecting every violation.

    ``take`` pulls a key with its expected type (and choices); ``close`` reports keys nobody
    took as unknown, with the nearest valid key. Errors accumulate in ``errors`` so a loader
    can report all of them at once.

    >>> errs = []
    >>> f = Fields({"name": "rmsnorm", "dtpye": "bf16"}, "F.toml", "family.rmsnorm", errs)
    >>> f.take("name", str)
    'rmsnorm'
    >>> f.take("dtype", str, default="f32")
    'f32'
    >>> f.close()
    >>> print(errs[0])
    F.toml: family.rmsnorm.dtpye: unknown key; did you mean 'dtype'?
    """

    def __init__(self, data: Any, file: object, prefix: str, errors: list[MetraleError]):
        self.file = file
        self.prefix = prefix
        self.errors = errors
        self.ok = True
        if not isinstance(data, dict):
            self._fail(prefix, "expected a table", "a table", type(data).__name__)
            data = {}
        self.data = data
        self._taken: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def _fail(self, key: str, message: str, expected: Any = None, found: Any = None,
              suggestion: str | None = None) -> None:
        self.ok = False
        self.errors.append(ConfigError(message, file=self.file, key=key, expected=expected,
                                       found=found, suggestion=suggestion))

    def fail(self, name: str, message: str, expected: Any = None, found: Any = None) -> None:
        """Record a violation at ``prefix.name``."""
        self._fail(self.key(name), message, expected, found)

    def take(self, name: str, types: type | tuple[type, ...], default: Any = _MISSING,
             choices: Iterable[Any] | None = None,
             convert: Callable[[Any], Any] | None = None) -> Any:
        """The value at ``name`` if it has the right type (and is one of ``choices``)."""
        self._taken.add(name)
        if name not in self.data:
            if default is _MISSING:
                self._fail(self.key(name), "missing key")
                return None
            return default
        value = self.data[name]
        types_t = types if isinstance(types, tuple) else (types,)
        if isinstance(value, bool) and bool not in types_t:
            ok = False
        else:
            ok = isinstance(value, types_t)
        if not ok:
            self._fail(self.key(name), "wrong type", "/".join(t.__name__ for t in types_t),
                       f"{type(value).__name__} {value!r}")
            return None if default is _MISSING else default
        if choices is not None:
            allowed = list(choices)
            if value not in allowed:
                self._fail(self.key(name), "value not allowed",
                           "one of " + ", ".join(map(str, allowed)), repr(value),
                           nearest(str(value), map(str, allowed)))
                return None if default is _MISSING else default
        if convert is not None:
            try:
                return convert(value)
            except MetraleError as e:
                self._fail(self.key(name), e.message, e.expected, e.found, e.suggestion)
                return None if default is _MISSING else default
        return value

    def close(self) -> None:
        """Report every key of the table that no ``take`` asked for."""
        for name in self.data:
            if name not in self._taken:
                self._fail(self.key(name), "unknown key",
                           suggestion=nearest(name, self._taken))


def raise_all(errors: list[MetraleError]) -> None:
    """Raise nothing, the one error, or all of them together as ``ManyErrors``.

    An error reported twice word for word (one bad port seen from each point of its family)
    is raised once.
    """
    first: dict[str, MetraleError] = {}
    for e in errors:
        first.setdefault(str(e), e)
    errors = list(first.values())
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ManyErrors(errors)

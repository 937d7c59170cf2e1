"""Typed errors: every failure names where it happened, what was expected and what was found.

All message formatting lives here, so every layer reports a bad input the same way:
``file:line:col: dotted.key: what went wrong (expected X, found Y); did you mean 'Z'?``

>>> err = ConfigError("unknown key", file="kernels/FUSIONS.toml", key="relation.numerix",
...                   suggestion="numerics")
>>> str(err)
"kernels/FUSIONS.toml: relation.numerix: unknown key; did you mean 'numerics'?"
>>> err.exit_status
3
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any, ClassVar


def nearest(name: str, valid: Iterable[str]) -> str | None:
    """The valid name closest to ``name``, or ``None`` when none is close.

    >>> nearest("numerix", ["numerics", "lhs", "rhs"])
    'numerics'
    """
    found = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return found[0] if found else None


class MetraleError(Exception):
    """Base of every error Metrale raises on purpose; carries where and what.

    ``exit_status`` is the status ``met`` exits with (docs/errors.md lists them all).
    """

    exit_status: ClassVar[int] = 1

    def __init__(
        self,
        message: str,
        *,
        file: object = None,
        key: str | None = None,
        line: int | None = None,
        col: int | None = None,
        expected: Any = None,
        found: Any = None,
        suggestion: str | None = None,
    ) -> None:
        self.message = message
        self.file = None if file is None else str(file)
        self.key = key
        self.line = line
        self.col = col
        self.expected = expected
        self.found = found
        self.suggestion = suggestion
        super().__init__(self._render())

    @property
    def where(self) -> str:
        """``file:line:col: key`` with whatever parts are known."""
        parts = []
        if self.file is not None:
            loc = self.file
            if self.line is not None:
                loc += f":{self.line}"
                if self.col is not None:
                    loc += f":{self.col}"
            parts.append(loc)
        if self.key:
            parts.append(self.key)
        return ": ".join(parts)

    def _render(self) -> str:
        text = self.message
        if self.expected is not None and self.found is not None:
            text += f" (expected {self.expected}, found {self.found})"
        elif self.expected is not None:  # say only what is known: never "found None"
            text += f" (expected {self.expected})"
        elif self.found is not None:
            text += f" (found {self.found})"
        if self.suggestion:
            text += f"; did you mean {self.suggestion!r}?"
        return f"{self.where}: {text}" if self.where else text


class AxiomError(MetraleError):
    """A composition that the category does not allow (ill-typed ``>>``, bad functor image)."""

    exit_status = 10


class ConfigError(MetraleError):
    """A bad TOML registry, config.json or option value."""

    exit_status = 3


class ManyErrors(ConfigError):
    """Several violations reported at once; ``errors`` holds each one.

    >>> e = ManyErrors([ConfigError("a", file="f", key="x"), ConfigError("b", file="f", key="y")])
    >>> print(e)
    2 problems:
      f: x: a
      f: y: b
    """

    def __init__(self, errors: Iterable[MetraleError]) -> None:
        self.errors = tuple(errors)
        lines = [f"{len(self.errors)} problem{'s' if len(self.errors) != 1 else ''}:"]
        lines += [f"  {e}" for e in self.errors]
        Exception.__init__(self, "\n".join(lines))
        self.message = "\n".join(lines)
        self.file = self.errors[0].file if self.errors else None
        self.key = None
        self.line = self.col = None
        self.expected = self.found = self.suggestion = None

    def __str__(self) -> str:
        return self.message


class CheckpointError(MetraleError):
    """A checkpoint file, header or tensor that cannot be used as it is."""

    exit_status = 4


class CompileError(MetraleError):
    """A kernel source that did not compile, or a compiler that is missing."""

    exit_status = 5


class CacheError(MetraleError):
    """A build-cache entry that could not be read or written."""

    exit_status = 5


class PlanError(MetraleError):
    """A circuit or plan that cannot be built for the asked target."""

    exit_status = 6


class AllocationError(MetraleError):
    """A device allocation that failed (out of memory); names the buffer and the bytes."""

    exit_status = 7


class LaunchError(MetraleError):
    """A launch refused before it reached the device (bad grid, block, args, shared memory)."""

    exit_status = 8


class DeviceFault(MetraleError):
    """A sticky device fault: once latched, every later device call raises it again."""

    exit_status = 9


class UnavailableError(MetraleError):
    """A backend, compiler or device that is not present here; says why."""

    exit_status = 11


class EvidenceError(ConfigError):
    """An evidence file or record that cannot be read."""


EXIT_INTERRUPTED = 130
"""``met`` exit status after Ctrl-C (128 + SIGINT)."""
EXIT_OS_ERROR = 12
"""``met`` exit status when the operating system refuses a file operation (permission, disk
full, a name too long): an ``OSError`` that no Metrale error type describes."""

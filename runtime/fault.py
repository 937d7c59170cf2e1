"""Sticky device faults and fallible teardown: the two ways a runtime fails without lying.

A :class:`FaultLatch` keeps the first :class:`DeviceFault` a backend saw; every later check
raises a fault with the same text (the CUDA context is dead and stays dead). A
:class:`Teardown` releases resources in reverse order of acquisition; every release runs even
when one fails, and the first error is the one that surfaces, never a second one over it.

Laws:

1. After ``latch(f)``, ``check()`` raises a ``DeviceFault`` whose text is ``str(f)``, every time.
2. Only the first latched fault counts: ``latch(g)`` after ``latch(f)`` returns ``f``.
3. ``Teardown`` releases in reverse order; a failing release does not stop the others, and the
   first error (the body's, else the first release's) is the one re-raised.

>>> from metrale.lkb.errors import DeviceFault
>>> latch = FaultLatch()
>>> latch.check()                       # nothing latched: no error
>>> first = latch.latch(DeviceFault("device fault in kernel 'rmsnorm'", key="launch"))
>>> latch.latch(DeviceFault("another one")) is first
True
>>> try:
...     latch.check()
... except DeviceFault as e:
...     str(e) == str(first)
True
>>> order = []
>>> with Teardown() as td:
...     td.callback(order.append, "a")
...     td.callback(order.append, "b")
>>> order
['b', 'a']
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from metrale.lkb.errors import DeviceFault

T = TypeVar("T")


def _twin(fault: DeviceFault) -> DeviceFault:
    """A fresh error of the same class and text (re-raising one object grows its traceback)."""
    twin = type(fault).__new__(type(fault))
    twin.__dict__.update(fault.__dict__)
    twin.args = fault.args
    return twin


class FaultLatch:
    """The first device fault of a backend, re-raised by every later :meth:`check`.

    >>> latch = FaultLatch()
    >>> latch.latched
    False
    >>> _ = latch.latch(DeviceFault("device fault in kernel 'k'"))
    >>> latch.latched, str(latch.fault)
    (True, "device fault in kernel 'k'")
    """

    def __init__(self) -> None:
        self.fault: DeviceFault | None = None

    @property
    def latched(self) -> bool:
        """Whether a fault has latched (the backend is dead)."""
        return self.fault is not None

    def latch(self, fault: DeviceFault) -> DeviceFault:
        """Latch ``fault`` unless one already is; return the latched one (raise it yourself)."""
        if self.fault is None:
            self.fault = fault
        return self.fault

    def check(self) -> None:
        """Raise a ``DeviceFault`` with the latched text, if one has latched."""
        if self.fault is not None:
            raise _twin(self.fault) from self.fault


class Teardown:
    """An ordered, fallible resource scope: releases run in reverse order of acquisition.

    Every release runs even when an earlier one raised. The error that surfaces is the first
    one: the body's if it raised (release errors are attached to it as notes), otherwise the
    first release's. ``contextlib.ExitStack`` is not used because it lets a later error replace
    an earlier one, which is exactly the "second error over the first" this scope forbids.

    >>> released = []
    >>> def bad():
    ...     raise RuntimeError("release failed")
    >>> td = Teardown()
    >>> td.callback(released.append, 1)
    >>> td.callback(bad)
    >>> td.callback(released.append, 3)
    >>> td.close()
    Traceback (most recent call last):
    ...
    RuntimeError: release failed
    >>> released
    [3, 1]
    """

    def __init__(self) -> None:
        self._stack: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self.errors: list[Exception] = []

    def callback(self, release: Callable[..., Any], *args: Any) -> None:
        """Run ``release(*args)`` at close, before everything registered earlier."""
        self._stack.append((release, args))

    def acquire(self, value: T, release: Callable[[T], Any]) -> T:
        """Register ``release(value)`` and hand ``value`` back.

        >>> with Teardown() as td:
        ...     x = td.acquire([1, 2], list.clear)
        ...     x
        [1, 2]
        >>> x
        []
        """
        self._stack.append((release, (value,)))
        return value

    def __len__(self) -> int:
        return len(self._stack)

    def _release_all(self) -> list[Exception]:
        errors: list[Exception] = []
        while self._stack:
            release, args = self._stack.pop()
            try:
                release(*args)
            except Exception as e:  # a release may fail any way; the others still run
                errors.append(e)
        self.errors.extend(errors)
        return errors

    def close(self) -> None:
        """Release everything (reverse order); re-raise the first release error, if any."""
        errors = self._release_all()
        if errors:
            first = errors[0]
            for later in errors[1:]:
                first.add_note(f"also during teardown: {type(later).__name__}: {later}")
            raise first

    def __enter__(self) -> Teardown:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if exc is None:
            self.close()
            return False
        for later in self._release_all():
            exc.add_note(f"also during teardown: {type(later).__name__}: {later}")
        return False

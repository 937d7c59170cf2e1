"""What ``met`` shows a terminal and takes from one: tables that fit its width, progress that
appears only on a terminal, and argument types that refuse bad numbers as usage errors.

Tables are rich tables at the terminal's width (``COLUMNS`` where there is no terminal), their
columns folding long names rather than cutting them, and cells are plain text (``[act=bf16]``
in a point name is not markup). Steps that can take seconds show a spinner on stderr, only
when stderr is a terminal and ``--no-progress`` is not given.

>>> t = table("t", ("name", "n"), right=("n",))
>>> add(t, "linear[act=bf16]", "3")
>>> [c.overflow for c in t.columns], [c.justify for c in t.columns]
(['fold', 'fold'], ['left', 'right'])
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator

from rich.console import Console
from rich.table import Table
from rich.text import Text


def console() -> Console:
    """The console of stdout, as wide as the terminal (``COLUMNS`` without one)."""
    return Console(soft_wrap=True)


def table(title: str, columns: tuple[str, ...], right: tuple[str, ...] = ()) -> Table:
    """A table whose cells fold long names onto more lines instead of cutting them."""
    t = Table(title=title)
    for col in columns:
        t.add_column(col, overflow="fold", justify="right" if col in right else "left")
    return t


def add(t: Table, *cells: str) -> None:
    """Add a row of plain text: ``[act=bf16]`` in a point name is text, not rich markup."""
    t.add_row(*(Text(c) for c in cells))


def print_table(t: Table) -> None:
    """Print at the terminal's width; the first column (the names) keeps its widest cell's
    width whenever the other columns can still fold to fit beside it."""
    out = console()
    if t.columns:
        first = t.columns[0]
        widest = max([out.measure(c).maximum for c in first._cells]
                     + [len(str(first.header))])
        others = sum(max([out.measure(c).minimum for c in col._cells]
                         + [len(str(col.header))]) for col in t.columns[1:])
        frame = 3 * len(t.columns) + 1  # borders and one space of padding either side
        if widest + others + frame <= out.width:
            first.no_wrap = True
    out.print(t, soft_wrap=False)


@contextlib.contextmanager
def progress(args: argparse.Namespace, text: str) -> Iterator[None]:
    """A spinner saying ``text`` on stderr while the block runs (a terminal only)."""
    if getattr(args, "no_progress", False) or not sys.stderr.isatty():
        yield
        return
    with Console(stderr=True).status(text):
        yield


def no_progress_arg(p: argparse.ArgumentParser) -> None:
    """Add ``--no-progress`` to a subcommand."""
    p.add_argument("--no-progress", action="store_true",
                   help="no progress display (never shown when stderr is not a terminal)")


def int_at_least(low: int, high: int | None = None):
    """An argparse ``type``: an integer in ``[low, high]``; anything else is a usage error
    (status 2) saying what was expected.

    >>> int_at_least(1)("3")
    3
    >>> int_at_least(1)("0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: expected an integer >= 1, found '0'
    """
    def parse(text: str) -> int:
        want = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, found {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {want}, found {text!r}")
        return value

    parse.__name__ = "integer"
    return parse


MAX_TOKEN_ID = 2**31 - 1


def token_ids(text: str) -> list[int]:
    """An argparse ``type``: comma-separated token ids, each an int in ``[0, 2**31 - 1]``.

    >>> token_ids("1, 2,3")
    [1, 2, 3]
    """
    try:
        ids = [int(t, 10) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, found "
                                         f"{text[:80]!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id, found none")
    bad = next((t for t in ids if not 0 <= t <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(f"expected token ids in [0, {MAX_TOKEN_ID}], found "
                                         f"{str(bad)[:40]}")
    return ids

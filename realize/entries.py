"""The entries of a CUDA source, and the source cut down to the entries one kernel launches.

A kernel source holds the entries of many kernels (``gemv.cu``: 27, for linear, linear_add, qkv,
gate_up_swiglu, lm_head and their multi-row and bias variants), and a compile unit of the whole
source compiles them all, though a kernel launches a few. The build compiles each kernel's unit
from the source with the other entries left out (:func:`keep_entries`): the units are smaller
and compile in parallel, so the slowest one, which a cold start waits for, is short (on this
project's CPU machine, ``gemv.cu`` for sm_90a: 6.6 s whole, 1.8 s with linear's six entries).
The source file is not changed (its hash, which evidence counts on, is the file's), and a kept
entry is the same text, so the same code.

An entry is ``extern "C" __global__`` at the top level, its name the identifier before its
parameter list, its body the braces after it; comments, strings and character literals are
skipped while scanning, and a removed entry leaves as many newlines as it spanned, so that a
compiler's line numbers still point into the file.

>>> src = 'extern "C" __global__ void a(int x) { /* } */ }\\nextern "C" __global__ void b() {}\\n'
>>> sorted(entry_spans(src))
['a', 'b']
>>> keep_entries(src, ["b"]).splitlines()
['', 'extern "C" __global__ void b() {}']
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

from metrale.lkb.errors import CompileError

_ENTRY = re.compile(r'extern\s+"C"\s+__global__\b')
_NAME_BEFORE_PARAMS = re.compile(r"([A-Za-z_]\w*)\s*$")


def _skip(text: str, i: int) -> int:
    """The index after the comment, string or character literal starting at ``i``, or ``i``
    where none starts there."""
    if text.startswith("//", i):
        end = text.find("\n", i)
        return len(text) if end < 0 else end
    if text.startswith("/*", i):
        end = text.find("*/", i + 2)
        return len(text) if end < 0 else end + 2
    if text[i] in "\"'":
        quote, j = text[i], i + 1
        while j < len(text) and text[j] != quote:
            j += 2 if text[j] == "\\" else 1
        return j + 1
    return i


def _code_positions(text: str) -> Iterable[int]:
    """The indices of ``text`` outside comments, strings and character literals."""
    i = 0
    while i < len(text):
        j = _skip(text, i)
        if j != i:
            i = j
            continue
        yield i
        i += 1


@functools.lru_cache(maxsize=64)
def entry_spans(text: str) -> dict[str, tuple[int, int]]:
    """``{entry: (start, end)}``: each top-level ``extern "C" __global__`` function with a body,
    from ``extern`` to its closing brace (a declaration without a body is not an entry here).
    A source whose braces do not balance raises ``CompileError``. Cached by text: a plan's
    kernels cut the same few sources (callers must not change the mapping)."""
    depth, out = 0, {}
    pending: int | None = None  # an entry's ``extern`` at depth 0, its body not yet opened
    opened_at = -1
    for i in _code_positions(text):
        c = text[i]
        if depth == 0 and c == "e" and _ENTRY.match(text, i):
            pending = i
        elif c == ";" and depth == 0:
            pending = None  # a declaration
        elif c == "{":
            if depth == 0 and pending is not None:
                opened_at = i
            depth += 1
        elif c == "}":
            depth -= 1
            if depth < 0:
                raise CompileError("unbalanced braces in a kernel source", key=f"offset {i}")
            if depth == 0 and pending is not None and opened_at >= 0:
                head = text[pending:opened_at]
                # the parameter list is the last balanced (...) before the body; its name precedes
                depth_p, k = 0, head.rfind(")")
                while k >= 0:
                    depth_p += {")": 1, "(": -1}.get(head[k], 0)
                    if depth_p == 0:
                        break
                    k -= 1
                m = _NAME_BEFORE_PARAMS.search(head[:k])
                if m is None:
                    raise CompileError("an entry without a name", key=head[:60])
                out[m.group(1)] = (pending, i + 1)
                pending, opened_at = None, -1
    if depth != 0:
        raise CompileError("unbalanced braces in a kernel source", expected="balanced",
                           found=f"{depth} left open")
    return out


def keep_entries(text: str, entries: Iterable[str]) -> str:
    """``text`` with every entry not in ``entries`` left out (its lines kept as blank lines);
    the text unchanged where it cannot be cut (braces that do not balance, an entry asked for
    that it does not define), so that the compiler and the build report that fault as they
    would for the whole source.

    >>> keep_entries('extern "C" __global__ void a() {', ["a"])
    'extern "C" __global__ void a() {'
    >>> keep_entries('extern "C" __global__ void a() {}', ["b"])
    'extern "C" __global__ void a() {}'
    """
    want = set(entries)
    try:
        spans = entry_spans(text)
    except CompileError:
        return text
    if want - set(spans):
        return text
    out, at = [], 0
    for name, (start, end) in sorted(spans.items(), key=lambda kv: kv[1]):
        if name in want:
            continue
        out.append(text[at:start])
        out.append("\n" * text.count("\n", start, end))
        at = end
    out.append(text[at:])
    return "".join(out)


def keep_included_entries(text: str, entries: Iterable[str]) -> str:
    """An included source's ``text`` cut to the ``entries`` it defines (a source that includes
    another, as ``gemm_tma.cu`` does ``gemm_wgmma.cu``, launches some of its entries and defines
    others of its own): every other entry left out, as :func:`keep_entries` leaves them.

    >>> src = 'extern "C" __global__ void a() {}\\nextern "C" __global__ void b() {}\\n'
    >>> keep_included_entries(src, ["b", "c"]).splitlines()
    ['', 'extern "C" __global__ void b() {}']
    """
    try:
        spans = entry_spans(text)
    except CompileError:
        return text
    return keep_entries(text, [e for e in entries if e in spans])


def entry_names(text: str) -> tuple[str, ...]:
    """The entries ``text`` defines (none where it cannot be scanned).

    >>> entry_names('extern "C" __global__ void a() {}')
    ('a',)
    """
    try:
        return tuple(entry_spans(text))
    except CompileError:
        return ()

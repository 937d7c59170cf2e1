"""Reference semantics of the collectives that join tensor-parallel ranks.

They register into :data:`metrale.lkb.semantics.SEMANTICS`, under that module's conventions.

A collective runs on every rank at once. Its semantics here is one rank's view: ``all_gather``
takes this rank's ``x`` and a communicator (``comm``, anything with ``all_gather(x)`` giving
every rank's ``x`` in rank order; ``None`` is the one-rank group) and returns the ranks' rows
side by side, ``y[row, r] = x of rank r [row]``, rows leading so a row's bytes never depend on
the other rows. The reduction of an all-reduce is not left to the transport: ``rank_sum``
adds the gathered parts in rank order, ``((p0 + p1) + p2) + …``, in f32, rounded once, so the
host, every GPU class and any number of runs agree byte for byte.

Laws: with one rank, ``all_gather`` is ``x[:, None]`` and ``rank_sum`` of it is ``x``, bytes
and all; ``rank_sum`` is independent of how the parts were computed (it sees only their bytes).

>>> import numpy as np
>>> x = np.array([[1.0, 2.0]], np.float32)
>>> all_gather(x, act="f32")[0].shape
(1, 1, 2)
>>> parts = np.array([[[1.0, 1e8], [1e-8, -1e8]]], np.float32)   # rows=1, ranks=2, n=2
>>> rank_sum(parts, act="f32")[0]
array([[1., 0.]], dtype=float32)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from .semantics import (
    F32,
    Reduction,
    _bf16,
    _fail,
    _rand,
    _shape,
    act_dtype,
    round_to,
    semantics,
)


class Communicator(Protocol):
    """What a collective needs of a rank group: its size, this rank, and the gather."""

    rank: int
    size: int

    def all_gather(self, x: np.ndarray) -> list[np.ndarray]:
        """Every rank's ``x``, in rank order (each rank passes the same shape and dtype)."""
        ...


def _ex_all_gather(rng, rows, act):
    return (_rand(rng, (rows, 40), act),), {"act": act}


@semantics("all_gather", rows=(0,), example=_ex_all_gather)
def all_gather(x: np.ndarray, *, act: str, comm: Communicator | None = None
               ) -> tuple[np.ndarray]:
    """``y[row, r] = x_r[row]``: every rank's ``x`` [rows, n], rows leading: [rows, ranks, n].

    >>> class Two:
    ...     rank, size = 0, 2
    ...     def all_gather(self, x):
    ...         return [x, -x]
    >>> all_gather(np.ones((1, 2), np.float32), act="f32", comm=Two())[0].tolist()
    [[[1.0, 1.0], [-1.0, -1.0]]]
    """
    fam, sizes = "all_gather", {}
    dt = act_dtype(fam, act)
    _shape(fam, "x", x, ("rows", "n"), sizes, (dt,))
    parts = [x] if comm is None else comm.all_gather(x)
    for r, p in enumerate(parts):
        if p.shape != x.shape or p.dtype != x.dtype:
            raise _fail(fam, f"x[rank {r}]", "ranks disagree on the gathered shape",
                        f"{x.dtype}{list(x.shape)}", f"{p.dtype}{list(p.shape)}")
    return (np.stack(parts, axis=1),)


def _rank_orders(p: Mapping[str, Any]) -> tuple[Reduction, ...]:
    return (Reduction("ranks", "f32", 0, "sequential", within="sequential", of="parts"),)


def _ex_rank_sum(rng, rows, act):
    return (_rand(rng, (rows, 3, 40), act),), {"act": act}


@semantics("rank_sum", rows=(0,), orders=_rank_orders, example=_ex_rank_sum)
def rank_sum(parts: np.ndarray, *, act: str) -> tuple[np.ndarray]:
    """``round(((f32 p0 + p1) + p2) + …)`` over the ranks axis of ``parts`` [rows, ranks, n].

    >>> rank_sum(np.full((2, 3, 4), 0.5, np.float32), act="f32")[0][0].tolist()
    [1.5, 1.5, 1.5, 1.5]
    """
    fam, sizes = "rank_sum", {}
    dt = act_dtype(fam, act)
    _shape(fam, "parts", parts, ("rows", "ranks", "n"), sizes, (dt,))
    acc = parts[:, 0].astype(F32)
    for r in range(1, parts.shape[1]):
        acc = acc + parts[:, r].astype(F32)
    return (round_to(acc, dt).astype(dt),)


def _ex_embedding_part(rng, rows, act):
    part, hidden = 50, 64
    ids = rng.integers(0, 3 * part, rows).astype(np.int32)
    return (ids, _rand(rng, (part, hidden), act), np.array([part], np.int32)), {"act": act}


@semantics("embedding_part", rows=(0,), example=_ex_embedding_part)
def embedding_part(ids: np.ndarray, table: np.ndarray, first: np.ndarray, *, act: str
                   ) -> tuple[np.ndarray]:
    """One rank's rows of a vocabulary-split embedding: ``table[id - first]`` for the ids its
    part holds (``first <= id < first + part``), ``-0.0`` for the others. ``-0.0`` is the
    identity of IEEE addition (``-0.0 + x`` is ``x``, bit for bit, ``±0`` and NaN included),
    so the ranks' rows added by ``rank_sum`` are each id's row of the whole table exactly.

    >>> t = np.array([[1.0, -0.0]], np.float32)   # the part of rows [1, 2)
    >>> embedding_part(np.array([1, 0], np.int32), t, np.array([1], np.int32), act="f32")[0]
    array([[ 1., -0.],
           [-0., -0.]], dtype=float32)
    """
    fam, sizes = "embedding_part", {}
    dt = act_dtype(fam, act)
    _shape(fam, "ids", ids, ("rows",), sizes, "int")
    _shape(fam, "table", table, ("part", "hidden"), sizes, (_bf16(), F32))
    _shape(fam, "first", first, ("one",), sizes, "int")
    local = ids.astype(np.int64) - int(first[0])
    inside = (local >= 0) & (local < sizes["part"])
    out = np.full((ids.shape[0], sizes["hidden"]), -0.0, dt)
    out[inside] = table[local[inside]].astype(dt)
    return (out,)


def _ex_all_reduce(rng, rows, act):
    return (_rand(rng, (rows, 40), act),), {"act": act}


@semantics("all_reduce", rows=(0,), orders=_rank_orders, example=_ex_all_reduce)
def all_reduce(x: np.ndarray, *, act: str, comm: Communicator | None = None
               ) -> tuple[np.ndarray]:
    """Every rank's ``x`` added in rank order, in f32, rounded once: ``rank_sum`` of
    ``all_gather`` (the relation ``all_reduce`` says so, bit for bit).

    >>> class Two:
    ...     rank, size = 1, 2
    ...     def all_gather(self, x):
    ...         return [x, 2 * x]
    >>> all_reduce(np.ones((1, 2), np.float32), act="f32", comm=Two())[0].tolist()
    [[3.0, 3.0]]
    """
    (parts,) = all_gather(x, act=act, comm=comm)
    return rank_sum(parts, act=act)

"""Continuous batching over an engine's KV slots: requests join between decode steps.

A :class:`Batcher` owns an :class:`~metrale.runtime.engine.Engine`. :meth:`~Batcher.admit`
gives a request the lowest free slot (or raises :class:`Busy`); :meth:`~Batcher.step` runs one
decode step for every running request at the plan of the rows bucket covering the highest busy
slot (rows below it without a running request carry a pad token at position 0 and do not
advance), then prefills the requests admitted since the last step (each through the prefill
plan ending in ``sample``, which draws its first token), and returns one :class:`Event` per
request that moved. :meth:`~Batcher.cancel`
frees a slot at once. The slot table has its own lock, held only for bookkeeping (never while
the engine runs), so a server thread may step while request handlers admit and cancel.

Laws (the exact policy's plans are row-invariant, and a row's draw is keyed by its own
(seed, request, position)):

1. A request's tokens are the same whether it runs alone or beside others.
2. Every slot is free again once each request has finished or been cancelled.

>>> from metrale.runtime.engine import Engine
>>> eng = Engine.load("tiny-qwen3", act="f32", max_ctx=32, slots=2)
>>> b = Batcher(eng)
>>> r = b.admit(Request((1, 2, 3), max_tokens=3))
>>> while not r.done:
...     _ = b.step()
>>> tuple(r.ids) == eng.generate([1, 2, 3], 3).ids, r.finish, b.free_slots()
(True, 'length', 2)
>>> eng.close()
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from metrale.lkb.errors import ConfigError

from .sampling import GREEDY, Sampling, key_row, random_seed

__all__ = ["Batcher", "Busy", "Event", "Request", "Running"]


class Busy(ConfigError):
    """Every KV slot holds a request (a server answers 429)."""


@attrs.frozen
class Request:
    """One generation: prompt ids, limits and how to draw.

    ``stop_ids`` end it (the id is not part of the output); ``stop`` strings end it where the
    text first contains one (cut before it); ``request`` is the index keyed into the draw.
    """

    prompt: tuple[int, ...] = attrs.field(converter=tuple)
    max_tokens: int = 16
    sampling: Sampling = GREEDY
    stop_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    stop: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    request: int = 0


@attrs.frozen
class Event:
    """What one step did for one request: the new id (``None`` when none was kept), the text it
    completes, and the finish reason once it is done (``stop``, ``length``, ``cancelled``)."""

    running: Running
    token: int | None
    text: str
    finish: str | None


class Running:
    """A request in a slot: its ids and text so far, and its finish reason once done."""

    def __init__(self, request: Request, slot: int, seed: int, stream: Any) -> None:
        self.request, self.slot, self.seed, self.stream = request, slot, seed, stream
        self.ids: list[int] = []
        self.text = ""  # all text decoded so far
        self.sent = 0  # characters of ``text`` already given out
        self.finish: str | None = None
        self.prefilled = False
        self.last: int | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None

    def __repr__(self) -> str:
        return f"Running(slot={self.slot}, ids={len(self.ids)}, finish={self.finish!r})"


def buckets(slots: int) -> tuple[int, ...]:
    """Decode rows the batcher runs at: powers of two below ``slots``, then ``slots``.

    >>> buckets(6)
    (1, 2, 4, 6)
    """
    out = [1]
    while out[-1] * 2 < slots:
        out.append(out[-1] * 2)
    if out[-1] != slots:
        out.append(slots)
    return tuple(out)


class Batcher:
    """Continuous batching over ``engine``'s slots (see the module docstring)."""

    def __init__(self, engine: Any, text: Any = None) -> None:
        self.engine = engine
        self.text = text if text is not None else getattr(engine, "text", None)
        self.lock = threading.RLock()  # the slot table
        self.step_lock = threading.Lock()  # one step at a time
        self.slots: list[Running | None] = [None] * engine.slots
        self.buckets = buckets(engine.slots)
        self.steps = 0
        self.peak_rows = 0  # the most requests one decode step has served

    def warm(self) -> None:
        """Build (and capture) the decode program of every rows bucket now, so that no
        request waits for one to be planned when the batch first grows to it."""
        with self.step_lock:
            for rows in self.buckets:
                self.engine.program("decode", rows, sample=True)

    # -- admission ---------------------------------------------------------------------------

    def free_slots(self) -> int:
        with self.lock:
            return sum(s is None for s in self.slots)

    def busy(self) -> list[Running]:
        with self.lock:
            return [s for s in self.slots if s is not None]

    def check(self, request: Request) -> None:
        """A request this engine cannot serve is a ``ConfigError`` naming the field."""
        eng = self.engine
        n = len(request.prompt)
        if n == 0:
            raise ConfigError("the prompt is empty", key="prompt", expected="at least 1 token")
        if not isinstance(request.max_tokens, int) or isinstance(request.max_tokens, bool) \
                or request.max_tokens < 1:
            raise ConfigError("bad token limit", key="max_tokens", expected="an integer >= 1",
                              found=repr(request.max_tokens))
        if n + request.max_tokens - 1 > eng.max_ctx:  # the last token is sampled, never fed
            key = "prompt" if n > eng.max_ctx else "max_tokens"
            raise ConfigError("prompt and steps do not fit the context", key=key,
                              expected=f"prompt + max_tokens - 1 <= {eng.max_ctx} (at most "
                                       f"{max(eng.max_ctx - n + 1, 0)} steps)",
                              found=f"{n} + {request.max_tokens} - 1")
        eng._check_ids(request.prompt)

    def admit(self, request: Request) -> Running:
        """Give ``request`` the lowest free slot; :class:`Busy` when there is none. Its prefill
        runs at the next :meth:`step`."""
        self.check(request)
        with self.lock:
            free = [i for i, s in enumerate(self.slots) if s is None]
            if not free:
                raise Busy("every KV slot is busy", key="slots",
                           expected=f"fewer than {len(self.slots)} running requests",
                           found=len(self.slots))
            seed = request.sampling.seed
            stream = self.text.stream(request.prompt) if self.text is not None else None
            run = Running(request, free[0], random_seed() if seed is None else seed, stream)
            self.slots[run.slot] = run
            return run

    def cancel(self, run: Running, reason: str = "cancelled") -> None:
        """Free ``run``'s slot now (the slot takes another request at the next step)."""
        with self.lock:
            if self.slots[run.slot] is run:
                self.slots[run.slot] = None
                self.engine.lengths[run.slot] = 0
            if run.finish is None:
                run.finish = reason

    # -- steps ---------------------------------------------------------------------------------

    def _key(self, run: Running, position: int) -> np.ndarray:
        return key_row(run.seed, request=run.request.request, position=position)

    def step(self) -> list[Event]:
        """One decode step for the running requests, then the prefills of those admitted; the
        events. The slot table is locked only around bookkeeping, never while the engine runs,
        so admitting and cancelling never wait for a step; a request cancelled while its row
        runs gets no event (what its row wrote into the slot is overwritten by the next
        prompt's prefill, or written again at its position before that position is read)."""
        with self.step_lock:
            events: list[Event] = []
            # decode first: a pad row writes position 0 of its slot, which a prefill after it
            # overwrites, but which would clobber a prompt prefilled before it
            with self.lock:
                ready = [r for r in self.slots if r is not None and r.prefilled]
                if ready:
                    top = max(r.slot for r in ready) + 1
                    rows = next(b for b in self.buckets if b >= top)
                    tokens = np.zeros(rows, np.int32)
                    params = np.zeros((rows, 4), np.float32)
                    keys = np.zeros((rows, 4), np.int32)
                    live = np.zeros(rows, bool)
                    for r in ready:
                        tokens[r.slot] = r.last
                        params[r.slot] = r.request.sampling.row()
                        # the key of the position the drawn token takes
                        keys[r.slot] = self._key(r, self.engine.lengths[r.slot] + 1)
                        live[r.slot] = True
            if ready:
                ids = self.engine.decode_ids(tokens, params, keys, live=live)
                with self.lock:
                    self.peak_rows = max(self.peak_rows, len(ready))
                    events += [self._emit(r, int(ids[r.slot])) for r in ready
                               if self.slots[r.slot] is r]
            with self.lock:
                fresh = [r for r in self.slots if r is not None and not r.prefilled]
            for run in fresh:
                req = run.request
                token = self.engine.prefill_ids(
                    req.prompt, slot=run.slot, params=req.sampling.row()[None],
                    keys=self._key(run, len(req.prompt))[None])
                with self.lock:
                    if self.slots[run.slot] is run:
                        run.prefilled = True
                        events.append(self._emit(run, int(token)))
            self.steps += 1
            return events

    def _emit(self, run: Running, token: int) -> Event:
        req = run.request
        if token in req.stop_ids:
            return self._finish(run, None, "stop")
        run.ids.append(token)
        run.last = token
        if run.stream is not None:
            run.text += run.stream.push(token)
        cut = _find_stop(run.text, req.stop, run.sent)
        if cut is not None:
            run.text = run.text[:cut]
            return self._finish(run, token, "stop", flush=False)
        full = self.engine.lengths[run.slot] >= self.engine.max_ctx
        if len(run.ids) >= req.max_tokens or full:
            return self._finish(run, token, "length")
        hold = max((len(s) - 1 for s in req.stop), default=0)
        upto = max(run.sent, len(run.text) - hold)
        delta, run.sent = run.text[run.sent:upto], upto
        return Event(run, token, delta, None)

    def _finish(self, run: Running, token: int | None, reason: str, flush: bool = True
                ) -> Event:
        if run.stream is not None and flush:  # a character still held back comes out now
            run.text += run.stream.flush()
        delta, run.sent = run.text[run.sent:], len(run.text)
        self.cancel(run, reason)
        return Event(run, token, delta, reason)

    def run_alone(self, request: Request) -> Running:
        """Admit ``request`` and step until it is done (what ``Engine.generate`` does)."""
        run = self.admit(request)
        try:
            while not run.done:
                self.step()
        finally:
            self.cancel(run)
        return run


def _find_stop(text: str, stops: Sequence[str], sent: int) -> int | None:
    """Where the first stop string starts in ``text`` (searching from what may still hold one)."""
    if not stops:
        return None
    start = max(0, sent - max(len(s) for s in stops))
    hits = [i for s in stops if s and (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None

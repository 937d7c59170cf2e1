"""Tensor parallelism at run time: one engine per rank, stepping together through collectives.

A :class:`ParallelEngine` holds ``n`` engines, each running the plan of one rank
(``plan.shard.Sharding``: the rank's circuit, the same on every rank) over the rank's slice of
the weights and its own KV cache (its KV heads). A step runs on every rank at once; the
``all_gather`` launches of the plan meet in a communicator, and every rank ends the step
holding the whole logits (or the sampled ids), which the group returns once.

On the host the ranks are threads of this process sharing a :class:`HostGroup` (the CI
simulation of n GPUs): ``all_gather`` hands each rank's bytes over under a barrier. A rank that
fails aborts the group: the other ranks' collectives raise at once instead of waiting, and
every later step raises the same :class:`~metrale.lkb.errors.DeviceFault`, naming the rank
that failed first and its error.

>>> with ParallelEngine.load("tiny-llama", tp=2, max_ctx=16) as tp, \\
...         Engine.load("tiny-llama", max_ctx=16) as one:
...     a, b = tp.prefill([3, 1, 4]), one.prefill([3, 1, 4])
>>> a.shape == b.shape, bool(abs(a - b).max() <= 2e-2 * abs(b).max())
(True, True)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from metrale.lkb.errors import ConfigError, DeviceFault
from metrale.plan.config import ModelConfig
from metrale.plan.shard import Sharding

from .engine import Engine

__all__ = ["HostComm", "HostGroup", "ParallelEngine", "load_engine"]

COLLECTIVE_TIMEOUT_S = 120.0
"""How long a rank waits for the others at a collective before the group is called broken
(a rank that never arrives is a fault, not a hang)."""


def load_engine(model: Any, tp: int = 1, **kw: Any) -> Any:
    """An :class:`Engine` (``tp`` 1), or ``tp`` ranks loaded alike (the keywords of
    :meth:`Engine.load`): on the host a :class:`ParallelEngine` (threads), on a GPU class a
    :class:`~metrale.runtime.ranks.ProcessEngine` (one process per GPU, NCCL)."""
    if tp == 1:
        return Engine.load(model, **kw)
    from metrale.lkb.vendor import Vendor
    from metrale.realize.hardware import load_hardware

    if load_hardware().get(kw.get("hardware", "host")).vendor == Vendor.HOST:
        return ParallelEngine.load(model, tp=tp, **kw)
    from .ranks import ProcessEngine

    return ProcessEngine.load(model, tp=tp, **kw)


class HostGroup:
    """``size`` ranks in one process: the meeting place of their collectives.

    >>> g = HostGroup(1)
    >>> g.comm(0).all_gather(np.ones(2, np.float32))[0].tolist()
    [1.0, 1.0]
    """

    def __init__(self, size: int, timeout: float = COLLECTIVE_TIMEOUT_S) -> None:
        self.size = size
        self._slots: list[np.ndarray | None] = [None] * size
        self._barrier = threading.Barrier(size, timeout=timeout)
        self.failure: tuple[int, BaseException] | None = None

    def comm(self, rank: int) -> HostComm:
        return HostComm(self, rank)

    def abort(self, rank: int, error: BaseException) -> None:
        """Rank ``rank`` failed: the group is broken from now on, every waiting rank raises."""
        if self.failure is None:
            self.failure = (rank, error)
        self._barrier.abort()

    def check(self) -> None:
        """Raise the group's fault, once it has one."""
        if self.failure is not None:
            rank, error = self.failure
            raise DeviceFault(f"rank {rank} failed: {type(error).__name__}: {error}",
                              key="ranks")

    def _meet(self, rank: int) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            if self.failure is None:  # nobody failed: a rank did not arrive in time
                self.failure = (rank, TimeoutError(
                    f"rank {rank} waited {self._barrier._timeout:.0f} s at a collective"))
            self.check()

    def all_gather(self, rank: int, x: np.ndarray) -> list[np.ndarray]:
        self._slots[rank] = x
        self._meet(rank)  # every rank's bytes are in place
        out = [np.array(s, copy=True) for s in self._slots]  # type: ignore[arg-type]
        self._meet(rank)  # every rank has read them: the slots may be written again
        return out


class HostComm:
    """Rank ``rank`` of a :class:`HostGroup` (the ``comm`` the collectives' semantics take)."""

    def __init__(self, group: HostGroup, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size

    def all_gather(self, x: np.ndarray) -> list[np.ndarray]:
        return self.group.all_gather(self.rank, x)



class ParallelEngine:
    """``tp`` rank engines of one model stepping together in threads of this process (the
    host's simulation; ``runtime.ranks.ProcessEngine`` runs a process per rank).

    It offers the engine's step methods (``prefill``, ``decode``, ``prefill_ids``,
    ``decode_ids``), ``generate`` and ``stream``, and rank 0's ``config``, ``text``, ``slots``,
    ``max_ctx`` and ``lengths`` (every rank's are the same).
    """

    def __init__(self, engines: Sequence[Engine], group: HostGroup) -> None:
        self.engines = tuple(engines)
        self.group = group
        self.tp = len(self.engines)
        self._pool = ThreadPoolExecutor(max_workers=self.tp, thread_name_prefix="metrale-rank")

    @classmethod
    def load(cls, model: str | os.PathLike | ModelConfig, *, tp: int, hardware: str = "host",
             quant: str | None = None, act: str = "bf16", max_ctx: int | None = None,
             seed: int = 0, slots: int = 1, policy: str = "exact", graphs: bool = True,
             blocking: bool = False, progress: bool = True,
             timeout: float = COLLECTIVE_TIMEOUT_S, random: str = "normal") -> ParallelEngine:
        """Load ``model`` as :meth:`Engine.load` does (a checkpoint directory, a built-in name
        or a config, with seeded random weights) and split it over ``tp`` ranks."""
        from metrale.lkb.vendor import Vendor
        from metrale.realize.hardware import load_hardware

        from .ranks import RankSpec

        if load_hardware().get(hardware).vendor != Vendor.HOST:
            raise ConfigError("threads simulate ranks on the host only", key="--hardware",
                              expected="host (GPU ranks: runtime.ranks.ProcessEngine, one "
                              "process per GPU)", found=hardware)
        spec = RankSpec(model, tp, hardware, quant, act, max_ctx, seed, slots, policy, graphs,
                        blocking, progress, random)
        whole = spec.load()
        Sharding(tp).config(whole[0])  # sizes that do not split fail here, first
        group = HostGroup(tp, timeout)
        engines: list[Engine] = []
        try:
            for r in range(tp):
                engines.append(spec.engine(r, group.comm(r), whole))
        except BaseException:
            for eng in engines:
                eng.close()
            raise
        return cls(engines, group)

    # -- the ranks together -----------------------------------------------------------------

    def _all(self, call: Callable[[Engine], Any]) -> Any:
        """``call`` on every rank's engine at once; rank 0's result. The first rank to fail
        aborts the group and its error is the one raised (as a DeviceFault naming the rank)."""
        return self._ranks(lambda r: call(self.engines[r]))

    def _ranks(self, call: Callable[[int], Any]) -> Any:
        """``call(rank)`` for every rank at once, as :meth:`_all`."""
        self.group.check()

        def run(rank: int) -> Any:
            try:
                return call(rank)
            except ConfigError:
                raise  # a bad request, refused alike on every rank before any collective
            except BaseException as e:
                self.group.abort(rank, e)
                raise

        futures = [self._pool.submit(run, r) for r in range(self.tp)]
        results, errors = [], []
        for f in futures:
            try:
                results.append(f.result())
            except BaseException as e:  # noqa: PERF203 - every rank is waited for
                errors.append(e)
        if errors:
            self.group.check()
            raise errors[0]
        return results[0]

    def prefill(self, token_ids: Sequence[int], *, slot: int = 0, last: bool = False
                ) -> np.ndarray:
        return self._all(lambda e: e.prefill(token_ids, slot=slot, last=last))

    def decode(self, token_ids: Sequence[int]) -> np.ndarray:
        return self._all(lambda e: e.decode(token_ids))

    def prefill_ids(self, token_ids: Sequence[int], *, slot: int = 0, params: np.ndarray,
                    keys: np.ndarray) -> int:
        return self._all(lambda e: e.prefill_ids(token_ids, slot=slot, params=params, keys=keys))

    def decode_ids(self, token_ids: Sequence[int], params: np.ndarray, keys: np.ndarray, *,
                   live: Sequence[bool] | None = None) -> np.ndarray:
        return self._all(lambda e: e.decode_ids(token_ids, params, keys, live=live))

    def program(self, mode: str, rows: int, logits: str = "all", sample: bool = False
                ) -> ParallelProgram:
        """Every rank's program of one step, run together (``runtime.bench`` times it)."""
        return ParallelProgram(self, tuple(e.program(mode, rows, logits, sample)
                                           for e in self.engines))

    def prefill_program(self, rows: int, logits: str = "all", sample: bool = False
                        ) -> ParallelProgram:
        return ParallelProgram(self, tuple(e.prefill_program(rows, logits, sample)
                                           for e in self.engines))

    def time_step(self, mode: str, rows: int, steps: int) -> Any:
        """``steps`` steps of every rank together, timed (``runtime.bench``)."""
        from .bench import time_decode, time_prefill

        return (time_decode(self, rows, steps=steps) if mode == "decode"
                else time_prefill(self, rows, steps=steps))

    def generate(self, prompt: Any, max_tokens: int = 16, **kw: Any) -> Any:
        from .generate import generate

        return generate(self, prompt, max_tokens, **kw)

    def stream(self, prompt: Any, max_tokens: int = 16, **kw: Any) -> Any:
        from .generate import stream

        return stream(self, prompt, max_tokens, **kw)

    # -- rank 0's view ------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name in ("config", "quant", "act", "text", "slots", "max_ctx", "lengths", "hardware",
                    "policy", "backend", "_check_ids"):
            return getattr(self.engines[0], name)
        raise AttributeError(name)

    def plan(self, mode: str, rows: int, logits: str = "all", sample: bool = False) -> Any:
        """Rank 0's plan of a step (every rank runs the same one)."""
        return self.engines[0].plan(mode, rows, logits, sample)

    def memory(self) -> dict[str, int]:
        """Bytes held, summed over the ranks."""
        out: dict[str, int] = {}
        for e in self.engines:
            for k, v in e.memory().items():
                out[k] = out.get(k, 0) + v
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        first: BaseException | None = None
        for e in self.engines:
            try:
                e.close()
            except BaseException as err:  # noqa: PERF203 - every rank is closed
                first = first or err
        if first is not None:
            raise first

    def __enter__(self) -> ParallelEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ParallelProgram:
    """The ranks' programs of one step: inputs written to each, run together, rank 0's read."""

    def __init__(self, engine: ParallelEngine, programs: Sequence[Any]) -> None:
        self.engine, self.programs = engine, tuple(programs)

    def write(self, name: str, values: Any) -> None:
        for p in self.programs:
            p.write(name, values)

    def run(self, *, blocking: bool = False, replay: bool = True) -> None:
        self.engine._ranks(lambda r: self.programs[r].run(blocking=blocking, replay=replay))

    def read(self, name: str) -> np.ndarray:
        return self.programs[0].read(name)

    @property
    def launches(self) -> Any:
        return self.programs[0].launches

    @property
    def captured(self) -> bool:
        return self.programs[0].captured

    @property
    def _graph(self) -> Any:
        return self.programs[0]._graph

"""Tensor-parallel ranks as processes: one process per rank (per GPU), stepped together.

:class:`ProcessRanks` starts ``tp`` processes (``spawn``); each loads the model, keeps its
slice of the weights (``plan.shard.Sharding``) and builds the engine of its rank, whose
collectives meet through the group's transport: on the host a :class:`ProcessComm` (shared
memory and a barrier: the loopback simulation of n devices), on an NVIDIA class NCCL, rank r on
GPU r (``runtime.nccl``). A step is sent to every rank and runs in all of them at once; rank 0
answers with the result and the cache lengths.

A rank that fails reports its error; the group is then aborted (the other ranks, waiting at a
collective, are released or, past a grace period, ended) and this step and every later one
raise the same :class:`~metrale.lkb.errors.DeviceFault`, naming the rank and its error. A
request every rank refuses (a ``ConfigError``) is raised as it is, and the ranks keep serving.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from collections.abc import Sequence
from multiprocessing import shared_memory
from typing import Any

import attrs
import numpy as np

from metrale.lkb.errors import ConfigError, DeviceFault

__all__ = ["ProcessComm", "ProcessRanks", "RankSpec"]

REPLY_TIMEOUT_S = 600.0
"""How long the group waits for a rank's answer to a step before calling the rank lost."""


@attrs.frozen
class RankSpec:
    """How every rank loads the model (the keywords of ``Engine.load``) and splits it."""

    model: Any
    tp: int
    hardware: str = "host"
    quant: str | None = None
    act: str = "bf16"
    max_ctx: int | None = None
    seed: int = 0
    slots: int = 1
    policy: str = "exact"
    graphs: bool = True
    blocking: bool = False
    progress: bool = True
    random: str = "normal"

    def describe(self) -> tuple[Any, str, Any]:
        """The model without its weights: ``(config, quant, text)`` (``text`` when the
        checkpoint has a tokenizer), as ``Engine.load`` reads them."""
        from metrale.plan.config import ModelConfig

        from .engine import checkpoint_dir, checkpoint_quant

        path = checkpoint_dir(self.model)
        if path is None:
            return ModelConfig.load(self.model), self.quant or "bf16", None
        config = ModelConfig.load(path)
        quant = self.quant or checkpoint_quant(
            {"quantization_config": config.quantization_config}, file=path / "config.json")
        text = None
        if (path / "tokenizer.json").is_file():
            from .text import Text

            text = Text.load(path)
        return config, quant, text

    def load(self) -> tuple[Any, str, dict[str, Any], Any]:
        """The whole model: ``(config, quant, weights, text)``."""
        from .engine import checkpoint_dir, checkpoint_weights, seeded_weights

        config, quant, text = self.describe()
        path = checkpoint_dir(self.model)
        weights = (seeded_weights(config, quant, seed=self.seed, random=self.random)
                   if path is None else checkpoint_weights(path, config, quant))
        return config, quant, weights, text

    def engine(self, rank: int, comm: Any, whole: tuple | None = None) -> Any:
        """Rank ``rank``'s engine, its collectives through ``comm``, cut from ``whole`` (what
        :meth:`load` gives; loaded here when not given)."""
        from metrale.lkb.vendor import Vendor
        from metrale.plan.shard import Sharding
        from metrale.realize.hardware import load_hardware

        from .engine import Engine

        config, quant, weights, text = whole if whole is not None else self.load()
        sharding = Sharding(self.tp)
        hw = load_hardware().get(self.hardware)
        if hw.vendor == Vendor.HOST:
            from .executor import HostLoader
            from .host_backend import HostBackend

            backend, loader = HostBackend(), HostLoader(comm=comm)
        else:
            from .cuda_loader import CudaPlanLoader
            from .cupy_backend import CupyBackend

            backend = CupyBackend(device=rank)
            loader = CudaPlanLoader(hw.arch, comm=comm, dependent_launch=bool(
                hw.capabilities and hw.capabilities.dependent_launch))
        max_ctx = self.max_ctx or min(1024, config.max_position_embeddings)
        eng = Engine(sharding.config(config), quant, sharding.weights(weights, config, rank),
                     hardware=self.hardware, backend=backend, loader=loader, act=self.act,
                     max_ctx=max_ctx, slots=self.slots, blocking=self.blocking, debug=False,
                     graphs=self.graphs, fuse=True, policy=self.policy,
                     progress=self.progress and rank == 0)
        eng.text = text
        return eng


class ProcessComm:
    """The host transport of ranks in processes: each rank's bytes through shared memory, a
    barrier between the writes and the reads (the ``comm`` of the collectives' semantics)."""

    def __init__(self, rank: int, size: int, names: Sequence[str], barrier: Any,
                 timeout: float) -> None:
        self.rank, self.size, self.timeout, self._barrier = rank, size, timeout, barrier
        self._slots = [shared_memory.SharedMemory(name=n) for n in names]

    def _meet(self) -> None:
        try:
            self._barrier.wait(self.timeout)
        except Exception:  # BrokenBarrierError: the group was aborted, or a rank is lost
            raise GroupAborted("the rank group was aborted at a collective",
                               key=f"rank {self.rank}") from None

    def all_gather(self, x: np.ndarray) -> list[np.ndarray]:
        x = np.ascontiguousarray(x)
        mine = self._slots[self.rank].buf
        if x.nbytes > len(mine):
            raise DeviceFault("a collective larger than the group's buffers",
                              key=f"rank {self.rank}", expected=f"<= {len(mine)} bytes",
                              found=f"{x.nbytes} bytes")
        np.frombuffer(mine, np.uint8, x.nbytes)[:] = x.reshape(-1).view(np.uint8)
        self._meet()
        out = [np.frombuffer(s.buf, x.dtype, x.size).reshape(x.shape).copy()
               for s in self._slots]
        self._meet()
        return out

    def abort(self) -> None:
        self._barrier.abort()

    def close(self) -> None:
        for s in self._slots:
            s.close()


def _group_bytes(spec: RankSpec, config: Any) -> int:
    """The largest collective of a rank's steps: a prefill's rows of logits (f32, a rank's
    part of the vocabulary) or of hidden state, at the context's length."""
    rows = max(spec.max_ctx or min(1024, config.max_position_embeddings), spec.slots)
    return 4 * rows * max(config.hidden_size, config.vocab_size // spec.tp)


class GroupAborted(DeviceFault):
    """A rank released from a collective because another rank failed (not a fault of its own)."""


def _describe(rank: int, e: BaseException) -> tuple[str, str, str]:
    """(kind, what the group raises, the traceback): a ``ConfigError`` is a refusal, kept in
    its own words; a rank released by the group's abort says so; anything else is the rank's
    fault."""
    if isinstance(e, ConfigError):
        return "config", str(e), ""
    if isinstance(e, GroupAborted):
        return "aborted", str(e), ""
    return "fault", f"{type(e).__name__}: {e}", "".join(traceback.format_exception(e))[-4000:]


def _serve(rank: int, spec: RankSpec, conn: Any, transport: tuple) -> None:
    """A rank's process: build the engine, then run each step the group sends."""
    comm = None
    engine = None
    try:
        if transport[0] == "host":
            comm = ProcessComm(rank, spec.tp, transport[1], transport[2], transport[3])
        else:
            import cupy

            from .nccl import NcclTransport

            cupy.cuda.Device(rank).use()
            comm = NcclTransport(spec.tp, rank, transport[1])
        engine = spec.engine(rank, comm)
        conn.send(("ok", None, None))
    except BaseException as e:  # reported to the group, which raises it
        conn.send(("error", *_describe(rank, e)))
        return
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            method, args, kw = msg
            try:
                result = _call(engine, method, args, kw)
                conn.send(("ok", result if rank == 0 else None, list(engine.lengths)))
            except BaseException as e:
                if not isinstance(e, ConfigError | GroupAborted) and hasattr(comm, "abort"):
                    comm.abort()  # the others, waiting at a collective, are released
                conn.send(("error", *_describe(rank, e)))
    finally:
        engine.close()
        if hasattr(comm, "close"):
            comm.close()


def _call(engine: Any, method: str, args: tuple, kw: dict) -> Any:
    if method == "time_step":
        from .bench import time_decode, time_prefill

        mode, rows, steps = args
        timing = (time_decode(engine, rows, steps=steps) if mode == "decode"
                  else time_prefill(engine, rows, steps=steps))
        return attrs.asdict(timing)
    if method == "plan":
        return engine.plan(*args, **kw)
    if method == "memory":
        return engine.memory()
    if method not in ("prefill", "decode", "prefill_ids", "decode_ids"):
        raise ConfigError("not a step of a rank", key="method", found=repr(method))
    return getattr(engine, method)(*args, **kw)


class ProcessRanks:
    """The ``tp`` processes of one model's ranks (see the module docstring)."""

    def __init__(self, spec: RankSpec, config: Any, *, timeout: float = REPLY_TIMEOUT_S
                 ) -> None:
        from metrale.lkb.vendor import Vendor
        from metrale.realize.hardware import load_hardware

        self.spec, self.tp, self.timeout = spec, spec.tp, timeout
        self.failure: DeviceFault | None = None
        ctx = mp.get_context("spawn")
        self._shm: list[shared_memory.SharedMemory] = []
        if load_hardware().get(spec.hardware).vendor == Vendor.HOST:
            size = _group_bytes(spec, config)
            self._shm = [shared_memory.SharedMemory(create=True, size=size)
                         for _ in range(spec.tp)]
            self._barrier = ctx.Barrier(spec.tp)
            transport: tuple = ("host", [s.name for s in self._shm], self._barrier,
                                min(timeout, 120.0))
        else:
            from .nccl import unique_id

            self._barrier = None
            transport = ("nccl", unique_id())
        self._conns, self._procs = [], []
        try:
            for r in range(spec.tp):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_serve, args=(r, spec, child, transport),
                                name=f"metrale-rank-{r}", daemon=True)
                p.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(p)
            self._replies()  # every rank built its engine, or the first error is raised
        except BaseException:
            self.close()
            raise
        self.lengths = [0] * spec.slots

    def _replies(self) -> Any:
        """Every rank's answer to the last message; rank 0's result. The first rank to fail
        (in the order the failures arrive; a rank released from a collective by the abort is
        not one) aborts the group at once, and its error, naming it, is raised now and by
        every later call."""
        from multiprocessing.connection import wait
        from time import monotonic

        pending = set(range(self.tp))
        answers: dict[int, tuple] = {}
        order: list[int] = []
        deadline = monotonic() + self.timeout
        while pending:
            waiting = {self._conns[r]: r for r in pending}
            waiting.update({self._procs[r].sentinel: r for r in pending})
            ready = wait(list(waiting), timeout=max(0.0, deadline - monotonic()))
            if not ready:
                for r in sorted(pending):
                    answers[r] = ("error", "fault", f"TimeoutError: rank {r} did not answer "
                                  f"in {self.timeout:.0f} s", "")
                    order.append(r)
                break
            for obj in ready:
                r = waiting[obj]
                if r not in pending:
                    continue
                conn = self._conns[r]
                try:
                    answers[r] = conn.recv() if conn.poll() else self._ended(r)
                except EOFError:
                    answers[r] = self._ended(r)
                pending.discard(r)
                order.append(r)
                if answers[r][0] == "error" and answers[r][1] == "fault":
                    self._release()  # the others, waiting at a collective, return now
        faults = [r for r in order if answers[r][0] == "error" and answers[r][1] == "fault"]
        if faults:
            r = faults[0]
            self._abort()
            self.failure = DeviceFault(f"rank {r} failed: {answers[r][2]}", key="ranks")
            raise self.failure
        refused = [answers[r] for r in order if answers[r][:2] == ("error", "config")]
        if refused:  # a bad request: every rank refused it alike, before any collective
            raise ConfigError(refused[0][2])
        if answers[0][2] is not None:
            self.lengths = answers[0][2]
        return answers[0][1]

    def _ended(self, r: int) -> tuple:
        self._procs[r].join(1)
        return ("error", "fault", f"its process ended (exit code {self._procs[r].exitcode})",
                "")

    def call(self, method: str, *args: Any, **kw: Any) -> Any:
        if self.failure is not None:
            raise self.failure
        for conn in self._conns:
            try:
                conn.send((method, args, kw))
            except (BrokenPipeError, OSError):
                pass  # the rank's process has ended: its reply is that (``_replies``)
        return self._replies()

    def _release(self) -> None:
        if self._barrier is not None:
            self._barrier.abort()

    def _abort(self) -> None:
        self._release()
        for p in self._procs:
            p.join(5)
            if p.is_alive():
                p.terminate()

    def close(self) -> None:
        for conn, p in zip(self._conns, self._procs):
            if p.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for p in self._procs:
            p.join(30)
            if p.is_alive():
                p.terminate()
        for s in self._shm:
            s.close()
            s.unlink()
        self._shm = []



class ProcessEngine:
    """An engine whose ranks are processes: the step methods of ``Engine`` (``prefill``,
    ``decode``, ``prefill_ids``, ``decode_ids``), ``generate`` and ``stream``, each step run
    by every rank at once; the config, text and sizes are the model's.

    >>> with ProcessEngine.load("tiny-llama", tp=2, max_ctx=16) as tp:
    ...     tp.prefill([3, 1, 4]).shape
    (3, 256)
    """

    def __init__(self, ranks: ProcessRanks, config: Any, quant: str, text: Any) -> None:
        self.ranks, self.config, self.quant, self.text = ranks, config, quant, text
        spec = ranks.spec
        self.tp, self.act, self.slots = spec.tp, spec.act, spec.slots
        self.hardware, self.policy = spec.hardware, spec.policy
        self.max_ctx = spec.max_ctx or min(1024, config.max_position_embeddings)
        self.backend = _Named(f"{spec.hardware} ({spec.tp} processes)")

    @classmethod
    def load(cls, model: Any, *, tp: int, hardware: str = "host", quant: str | None = None,
             act: str = "bf16", max_ctx: int | None = None, seed: int = 0, slots: int = 1,
             policy: str = "exact", graphs: bool = True, blocking: bool = False,
             progress: bool = True, timeout: float = REPLY_TIMEOUT_S, random: str = "normal"
             ) -> ProcessEngine:
        from metrale.plan.shard import Sharding

        from .engine import checkpoint_dir

        path = checkpoint_dir(model)
        spec = RankSpec(str(path) if path is not None else model, tp, hardware, quant, act,
                        max_ctx, seed, slots, policy, graphs, blocking, progress, random)
        config, quant, text = spec.describe()
        Sharding(tp).config(config)  # sizes that do not split fail here, before any process
        return cls(ProcessRanks(spec, config, timeout=timeout), config, quant, text)

    @property
    def lengths(self) -> list[int]:
        return self.ranks.lengths

    def _check_ids(self, token_ids: Sequence[int]) -> np.ndarray:
        from .engine import Engine

        return Engine._check_ids(self, token_ids)  # reads self.config only

    def prefill(self, token_ids: Sequence[int], *, slot: int = 0, last: bool = False
                ) -> np.ndarray:
        return self.ranks.call("prefill", list(token_ids), slot=slot, last=last)

    def decode(self, token_ids: Sequence[int]) -> np.ndarray:
        return self.ranks.call("decode", list(token_ids))

    def prefill_ids(self, token_ids: Sequence[int], *, slot: int = 0, params: np.ndarray,
                    keys: np.ndarray) -> int:
        return self.ranks.call("prefill_ids", list(token_ids), slot=slot, params=params,
                               keys=keys)

    def decode_ids(self, token_ids: Sequence[int], params: np.ndarray, keys: np.ndarray, *,
                   live: Sequence[bool] | None = None) -> np.ndarray:
        return self.ranks.call("decode_ids", list(token_ids), params, keys,
                               live=None if live is None else list(live))

    def time_step(self, mode: str, rows: int, steps: int) -> Any:
        """Rank 0's timing of ``steps`` steps, every rank stepping (``runtime.bench``)."""
        from .bench import StepTiming

        return StepTiming(**self.ranks.call("time_step", mode, rows, steps))

    def plan(self, mode: str, rows: int, logits: str = "all", sample: bool = False) -> Any:
        return self.ranks.call("plan", mode, rows, logits, sample)

    def memory(self) -> dict[str, int]:
        return self.ranks.call("memory")

    def generate(self, prompt: Any, max_tokens: int = 16, **kw: Any) -> Any:
        from .generate import generate

        return generate(self, prompt, max_tokens, **kw)

    def stream(self, prompt: Any, max_tokens: int = 16, **kw: Any) -> Any:
        from .generate import stream

        return stream(self, prompt, max_tokens, **kw)

    def close(self) -> None:
        self.ranks.close()

    def __enter__(self) -> ProcessEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@attrs.frozen
class _Named:
    """What a caller reads of the backends of processes: their name (and as ``limits``)."""

    name: str

    @property
    def limits(self) -> _Named:
        return self

"""Measuring a plan where it runs: the decode step and each kernel, against the memory floor.

``time_decode(engine, rows)`` times the whole decode step (the captured graph replayed where
the backend has graphs) with every row at position ``context``: median of many steps after
warm-up. ``kernel_times(engine, rows)`` times each distinct launch of that step alone, cycling
through copies of its inputs large enough that they cannot all sit in the last-level cache, so
the bytes really come from memory. ``evidence(...)`` turns kernel timings into evidence records
for the class that ran them — only from such real runs, never estimated.

>>> from metrale.runtime.engine import Engine
>>> with Engine.load("tiny-qwen3", max_ctx=40) as eng:
...     t = time_decode(eng, 1, steps=5, warmup=2)
...     ks = kernel_times(eng, 1, repeats=3)
>>> t.step_s > 0 and t.floor_s > 0 and len(ks) > 0 and all(k.seconds > 0 for k in ks)
True
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import numpy as np

from metrale.lkb.errors import DeviceFault
from metrale.runtime.backend import DevicePtr, device_fault

CACHE_BYTES = 64 * 2**20
"""A last-level cache at least this large is assumed (H200 L2: 60 MB); inputs are rotated
across copies totalling four times it."""


@attrs.frozen
class StepTiming:
    """A decode or prefill step: median seconds, the plan's floor on the device that ran it
    (:attr:`~metrale.plan.plan.Plan.cost_floor_s`) and bytes, launches, graph or not."""

    model: str
    quant: str
    hardware: str
    rows: int
    context: int
    step_s: float
    floor_s: float
    bytes_moved: int
    launches: int
    graph: bool

    @property
    def fraction_of_floor(self) -> float:
        return self.floor_s / self.step_s


@attrs.frozen
class KernelTiming:
    """One distinct launch of the step, timed alone: seconds per launch and bytes it moves."""

    label: str
    family: str
    point: str
    count: int  # launches of it per step
    seconds: float
    bytes_moved: int
    kernel: Any  # realize.kernel.Kernel (its source hash goes into evidence)

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_moved / self.seconds


def median_wall(fn: Any, n: int, warmup: int) -> float:
    """Median wall-clock seconds of ``fn()`` over ``n`` calls after ``warmup`` calls.

    >>> median_wall(lambda: None, 3, 1) >= 0
    True
    >>> median_wall(lambda: None, 0, 1)
    Traceback (most recent call last):
    ...
    metrale.lkb.errors.ConfigError: steps: bad step count (expected an int >= 1, found 0)
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:  # a median of nothing
        from metrale.lkb.errors import ConfigError

        raise ConfigError("bad step count", key="steps", expected="an int >= 1", found=repr(n))
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode_program(engine: Any, rows: int) -> Any:
    """The decode program of ``rows`` sequences, each at the engine's last cache position."""
    prog = engine.program("decode", rows)
    context = engine.max_ctx - 1
    prog.write("tokens", np.arange(rows) % engine.config.vocab_size)
    prog.write("positions", np.full(rows, context, np.int32))
    prog.write("slots", np.arange(rows, dtype=np.int32))
    return prog


def time_decode(engine: Any, rows: int, *, steps: int = 100, warmup: int = 10) -> StepTiming:
    """The decode step of ``rows`` sequences at the last cached position, timed."""
    prog = decode_program(engine, rows)
    plan = engine.plan("decode", rows)
    step = median_wall(prog.run, steps, warmup)
    return StepTiming(engine.config.name, engine.quant, engine.hardware, rows, engine.max_ctx - 1,
                      step, plan.cost_floor_s, plan.bytes_moved, len(prog.launches),
                      prog._graph is not None)


def prefill_program(engine: Any, rows: int, logits: str = "all") -> Any:
    """The prefill program of a ``rows``-token prompt into slot 0, from position 0."""
    prog = engine.prefill_program(rows, logits=logits)
    prog.write("tokens", np.arange(rows) % engine.config.vocab_size)
    prog.write("positions", np.arange(rows, dtype=np.int32))
    prog.write("slots", np.zeros(rows, np.int32))
    return prog


def time_prefill(engine: Any, rows: int, *, steps: int = 10, warmup: int = 2,
                 logits: str = "all", replay: bool = True) -> StepTiming:
    """The prefill step of a ``rows``-token prompt into slot 0, timed (its logits left on the
    device: the step, not the copy home); ``logits="last"``: the last row's only; ``replay``
    False: its launches made one by one from the host even where a graph is captured."""
    prog = prefill_program(engine, rows, logits)
    plan = engine.plan("prefill", rows, logits)
    step = median_wall(lambda: prog.run(replay=replay), steps, warmup)
    return StepTiming(engine.config.name, engine.quant, engine.hardware, rows, rows - 1, step,
                      plan.cost_floor_s, plan.bytes_moved, len(prog.launches),
                      prog.captured and replay)


def kernel_times(engine: Any, rows: int, *, mode: str = "decode", repeats: int = 20,
                 logits: str = "all", skip: Callable[[Any], bool] | None = None,
                 resident: bool = False) -> tuple[KernelTiming, ...]:
    """Each distinct launch of the decode step (``mode="prefill"``: of the prefill of a
    ``rows``-token prompt, with ``logits`` as prefill_program takes it) timed alone, its inputs
    rotated across copies; the expert kernels' copies route to other experts instead
    (``expert_ids_arg``). ``skip(kernel)``, given a planned kernel, leaves out those it is true
    of (``met tune``: the kernels an earlier alternative's timing already holds). ``resident``:
    one set of inputs every run instead (the expert kernels' routed once), so that whatever fits
    in the last-level cache is read from it: the time a prefetch of the kernel's bytes into L2
    ahead of it could reach, against the figure from memory."""
    prog = (decode_program(engine, rows) if mode == "decode"
            else prefill_program(engine, rows, logits=logits))
    plan = engine.plan(mode, rows, logits=logits)
    weights = {b.name for b in plan.buffers if b.kind == "weight"}
    presentation = plan.hw_target.presentation
    be = engine.backend
    # a planned kernel's launches (its own, then its `then` launches) are timed together
    chains: dict[int, list[int]] = {}
    for i, ln in enumerate(prog.launches):
        chains.setdefault(ln.kernel.index, []).append(i)
    groups: dict[tuple, list[list[int]]] = {}
    for chain in chains.values():
        k = prog.launches[chain[0]].kernel
        groups.setdefault((str(k.point), k.box.dom, k.box.cod, k.box.params), []).append(chain)
    out = []
    for members in groups.values():
        chain = members[0]
        lns = [prog.launches[i] for i in chain]
        ln, args = lns[0], prog.arguments[chain[0]]
        k = ln.kernel
        if skip is not None and skip(k):
            continue
        # the arguments that carry the kernel's inputs (buffers, weights' scales) get copies
        rotate = [j for j, name in enumerate(ln.arg_names)
                  if (isinstance(name, str) and name in k.inputs)
                  or (isinstance(name, tuple) and name[0] == "part")]
        ids = expert_ids_arg(presentation.family(k.family), k.inputs, ln.arg_names)
        if ids is not None:
            # the expert kernels read only the routed experts' rows: every copy routes to other
            # experts (the weights stay), so that L2 holds none of the rows read one launch ago,
            # and none takes the step's own ids (unwritten where the step has not run)
            fixed = weight_args(ln.arg_names, weights) | {ids}
            rotate = [j for j in rotate if j not in fixed]
        in_bytes = sum(getattr(args[j], "nbytes", 0) for j in rotate)
        copies = (1 if resident else 8 if ids is not None
                  else max(1, min(8, 4 * CACHE_BYTES // max(in_bytes, 1) + 1)))
        rng = np.random.default_rng(0)
        sets, owned = [] if ids is not None else [tuple(args)], []
        for _ in range(copies - len(sets)):
            fresh = list(args)
            for j in rotate:
                a = args[j]
                if getattr(a, "nbytes", 0):
                    ptr = be.alloc(a.nbytes, f"copy for {k.family}")
                    owned.append(ptr)
                    be.copy_h2d(ptr, be.copy_d2h(a, a.nbytes))
                    fresh[j] = ptr
            if ids is not None:
                ptr = be.alloc(args[ids].nbytes, f"expert ids for {k.family}")
                owned.append(ptr)
                be.copy_h2d(ptr, routed_ids(rng, args[ids].nbytes, engine.config))
                fresh[ids] = ptr
            sets.append(tuple(fresh))
        # a `then` launch reads the kernel's buffers: in each set, the set's copies of them
        swaps = [{a: b for a, b in zip(args, s, strict=True) if isinstance(a, DevicePtr)}
                 for s in sets]
        chained = [[tuple(sw.get(a, a) if isinstance(a, DevicePtr) else a
                          for a in prog.arguments[i]) for i in chain] for sw in swaps]
        try:
            seconds = _time_launches(be, lns, chained, repeats)
        except DeviceFault as e:  # a graph replay knows no kernel: name the one being timed
            raise device_fault("kernel_times", f"#{k.index} {k.family} {k.point}",
                               e.found) from e
        finally:
            for ptr in owned:
                be.free(ptr)
        out.append(KernelTiming(f"#{k.index} {k.family}", k.family, str(k.point),
                                len(members), seconds, k.bytes_moved, k.kernel))
    return tuple(out)


def expert_ids_arg(family: Any, inputs: tuple[str, ...], arg_names: tuple) -> int | None:
    """The launch argument holding an expert kernel's routed ids: the input its family ranges
    by the experts (``ranges = { ids = "e" }``), int32 ``[rows, top_k]``; None for a kernel
    without one. Named by the family, not listed: every expert family is routed, whatever
    model brought it (an unrouted copy of a step's ids reads whatever the buffer held)."""
    ranges = dict(family.ranges)
    for port, buffer in zip(family.inputs, inputs):
        if ranges.get(port.name) == "e" and buffer in arg_names:
            return arg_names.index(buffer)
    return None


def weight_args(arg_names: tuple, weights: set[str]) -> set[int]:
    """Positions of a launch's weight arguments: the plan's weight buffers (``weights``) and the
    parts a quantized weight is stored in."""
    return {j for j, name in enumerate(arg_names)
            if (isinstance(name, tuple) and name[0] == "part") or name in weights}


def routed_ids(rng: np.random.Generator, nbytes: int, config: Any) -> bytes:
    """int32 expert ids for ``nbytes / 4 / top_k`` rows: each row's top_k experts distinct,
    drawn uniformly from the config's experts."""
    top_k, experts = config.num_experts_per_tok, config.num_experts
    rows = nbytes // 4 // top_k
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(rows)])
    return ids.astype(np.int32).tobytes()


def _time_launches(be: Any, lns: list[Any], sets: list[list[tuple]], repeats: int) -> float:
    """Seconds per run of the launches ``lns`` (a kernel's own, then its ``then`` launches),
    each set of ``sets`` holding one argument tuple per launch.

    Where the backend has graphs: ``repeats`` runs captured as one graph and ``2 · repeats`` as
    another, each replayed; the figure is their difference over ``repeats``, what one more run
    adds inside a long graph (a step's replay), with the graph's launch and the wait for it
    (about 15 µs on an H100, 3 µs a run at 5 repeats) taken out. A difference lost in noise
    (not positive) gives the longer graph's time per run, an upper bound. Elsewhere each run
    is synchronized."""
    def issue(args: list[tuple], stream: Any = None) -> None:
        for ln, a in zip(lns, args, strict=True):
            be.launch(ln.handle, ln.grid, ln.block, ln.shared_mem, a, stream)

    if be.supports_graphs:
        stream = be.stream()

        def replay_of(runs: int) -> float:
            be.begin_capture(stream)
            try:
                for r in range(runs):
                    issue(sets[r % len(sets)], stream)
            finally:
                graph = be.end_capture(stream)
            try:
                def replay() -> None:
                    be.graph_launch(graph, stream)
                    be.synchronize(stream)

                return median_wall(replay, 5, 1)
            finally:
                be.release_graph(graph)

        once, twice = replay_of(repeats), replay_of(2 * repeats)
        marginal = (twice - once) / repeats
        return marginal if marginal > 0 else twice / (2 * repeats)
    counter = {"i": 0}

    def launch() -> None:
        issue(sets[counter["i"] % len(sets)])
        counter["i"] += 1
        be.synchronize()

    return median_wall(launch, repeats, 2)


def evidence(timings: Iterable[KernelTiming], hw: Any, device: str, toolchain: str
             ) -> list[Any]:
    """Evidence records of measured kernels: achieved bandwidth against the class's floor.

    Kernels without a source (the host's reference semantics) have no source hash to pin a
    record to and are left out.
    """
    from metrale.realize.evidence import EvidenceRecord

    today = datetime.date.today().isoformat()
    floor = hw.device.hbm_bytes_per_s / 1e9
    out = []
    for t in timings:
        if t.kernel is None or t.kernel.source is None:
            continue
        out.append(EvidenceRecord(hw.name, device, t.family, t.point, "bandwidth",
                                  t.bytes_per_s / 1e9, floor, "GB/s", today, toolchain,
                                  t.kernel.source_hash))
    return out

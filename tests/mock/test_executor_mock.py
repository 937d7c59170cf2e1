"""The executor and the Engine on the MockBackend: out of memory, sticky faults, blocking mode.

- OOM at the k-th allocation raises ``AllocationError`` naming the buffer and its bytes; every
  earlier allocation is released and the backend stays usable;
- a sticky fault during a step makes every later engine call raise the same ``DeviceFault``,
  and teardown after it is quiet;
- blocking mode (synchronize after each launch) names the exact kernel that faulted, where a
  non-blocking run can only name the last kernel issued before the synchronize.
"""

from __future__ import annotations

import numpy as np
import pytest

from metrale.lkb.errors import AllocationError, DeviceFault
from metrale.runtime.engine import Engine
from metrale.runtime.executor import kernel_label
from metrale.runtime.mock_backend import MockBackend

MODEL = "tiny-qwen3"


def _allocs_of_a_run() -> list[tuple[int, str]]:
    be = MockBackend()
    with Engine.load(MODEL, backend=be, max_ctx=16) as eng:
        eng.prefill([1, 2, 3])
        eng.decode([4])
    return [c.args for c in be.calls if c.op == "alloc"]


ALLOCS = _allocs_of_a_run()


@pytest.mark.parametrize("k", [1, 2, len(ALLOCS) // 2, len(ALLOCS) - 1, len(ALLOCS)])
def test_out_of_memory_at_the_kth_alloc_names_the_buffer_and_releases_the_rest(k):
    nbytes, label = ALLOCS[k - 1]
    be = MockBackend(oom_at=k)
    with pytest.raises(AllocationError) as info:
        with Engine.load(MODEL, backend=be, max_ctx=16) as eng:
            eng.prefill([1, 2, 3])
            eng.decode([4])
    assert info.value.key == label and f"{nbytes} bytes" in str(info.value)
    assert be.live_bytes() == 0  # everything allocated before it was released
    p = be.alloc(64, "after")  # the backend is still usable
    assert be.live_bytes() == 64
    be.free(p)


def test_a_sticky_fault_makes_every_later_call_raise_the_same_fault():
    be = MockBackend(fault_at_launch=5)
    eng = Engine.load(MODEL, backend=be, max_ctx=16)
    with pytest.raises(DeviceFault) as first:
        eng.prefill([1, 2, 3])
    for call in (lambda: eng.prefill([1]), lambda: eng.decode([2]),
                 lambda: eng.generate([1, 2], 3)):
        with pytest.raises(DeviceFault) as later:
            call()
        assert str(later.value) == str(first.value)
    with pytest.raises(DeviceFault):
        be.alloc(8)  # the backend latched it too
    eng.close()  # teardown after a fault is quiet
    assert be.live_bytes() == 0


@pytest.mark.parametrize("k", [1, 7, 12])
def test_blocking_mode_names_the_exact_kernel(k):
    be = MockBackend(fault_at_sync=k)
    with Engine.load(MODEL, backend=be, max_ctx=16, blocking=True) as eng:
        launches = eng.program("prefill", 3).launches
        with pytest.raises(DeviceFault) as info:
            eng.prefill([1, 2, 3])
    assert f"kernel {kernel_label(launches[k - 1].kernel)!r}" in str(info.value)


def test_without_blocking_the_fault_names_only_the_last_kernel_issued():
    be = MockBackend(fault_at_sync=1)
    with Engine.load(MODEL, backend=be, max_ctx=16) as eng:
        launches = eng.program("prefill", 3).launches
        with pytest.raises(DeviceFault) as info:
            eng.prefill([1, 2, 3])
    assert f"kernel {kernel_label(launches[-1].kernel)!r}" in str(info.value)
    assert len(launches) > 1


def test_teardown_frees_in_reverse_order_of_acquisition():
    be = MockBackend()
    eng = Engine.load(MODEL, backend=be, max_ctx=16)
    eng.prefill([1, 2])
    eng.decode([3])
    allocated = [c.args for c in be.calls if c.op == "alloc"]
    n = len(be.calls)
    eng.close()
    freed = [c.args[0] for c in be.calls[n:] if c.op == "free"]
    assert [p.alloc_id for p in freed] == sorted((p.alloc_id for p in freed), reverse=True)
    assert len(freed) == len(allocated) and be.live_bytes() == 0


class _ScratchLoader:
    """The host launches plus two launches that take the program's workspace (of 100 and 40
    bytes), each recording the bytes it finds there (the host backend passes memory as arrays)."""

    def __init__(self) -> None:
        from metrale.runtime.executor import HostLoader

        self.host = HostLoader()
        self.seen: list[tuple[int, bytes]] = []

    def spec(self, buffer):
        return self.host.spec(buffer)

    def load(self, backend, plan, specs):
        from metrale.realize.kernel import WorkspaceSlice
        from metrale.runtime.executor import Launch

        base = self.host.load(backend, plan, specs)

        def tick(work):
            self.seen.append((work.nbytes, bytes(np.asarray(work).view(np.uint8))))

        k = backend.kernel(backend.module({"tick": (1, tick)}), "tick")
        return base + tuple(Launch(ln.kernel, k, (1, 1, 1), (1, 1, 1), 0,
                                   (("scratch", WorkspaceSlice(0, n)),))
                            for ln, n in zip(base[:2], (100, 40)))


def test_a_program_gives_scratch_launches_one_zeroed_workspace_of_the_largest_size():
    from metrale.plan.plan import plan_for
    from metrale.runtime.engine import random_weights
    from metrale.runtime.executor import Program, bind_externals

    plan = plan_for(MODEL, "bf16", "host", rows=1, context=16)
    be = MockBackend()
    loader = _ScratchLoader()
    bindings = bind_externals(plan, be, random_weights(MODEL, seed=0))
    prog = Program(plan, be, bindings=bindings, loader=loader)
    labels = [c.args[1] for c in be.calls if c.op == "alloc"]
    assert labels.count("workspace") == 1
    sizes = [c.args[0] for c in be.calls if c.op == "alloc" and c.args[1] == "workspace"]
    assert sizes == [100]
    for name, value in (("tokens", 1), ("positions", 0), ("slots", 0)):
        prog.write(name, np.full(prog.specs[name].shape, value))
    prog.run()
    assert loader.seen == [(100, bytes(100)), (40, bytes(40))]  # zeroed, not the mock's poison
    prog.close()


class _DependentLoader:
    """The host launches, each marked as a dependent launch (as an sm_90 loader marks them)."""

    def __init__(self) -> None:
        from metrale.runtime.executor import HostLoader

        self.host = HostLoader()

    def spec(self, buffer):
        return self.host.spec(buffer)

    def load(self, backend, plan, specs):
        import attrs

        return tuple(attrs.evolve(ln, dependent=True)
                     for ln in self.host.load(backend, plan, specs))


@pytest.mark.parametrize("graph", [False, True])
def test_dependent_launches_reach_the_backend_and_compute_what_plain_ones_do(graph):
    """Backend equation 12 through the executor: the flag reaches every launch, and the step's
    bytes are the plain program's (captured as a graph or not)."""
    from metrale.plan.plan import plan_for
    from metrale.runtime.engine import random_weights
    from metrale.runtime.executor import HostLoader, Program, bind_externals

    plan = plan_for(MODEL, "bf16", "host", rows=1, context=16)
    logits, counts = [], []
    for loader in (HostLoader(), _DependentLoader()):
        be = MockBackend()
        prog = Program(plan, be, bindings=bind_externals(plan, be, random_weights(MODEL, seed=0)),
                       loader=loader)
        for name, value in (("tokens", 3), ("positions", 0), ("slots", 0)):
            prog.write(name, np.full(prog.specs[name].shape, value))
        if graph:
            assert prog.capture()
        prog.run()
        logits.append(prog.read("logits").tobytes())
        counts.append((be.dependent_launches, be.launches))
        prog.close()
    assert logits[0] == logits[1]
    (plain_dep, plain_n), (dep, n) = counts
    assert plain_dep == 0 and plain_n == n and dep == n == len(plan.launches)


def test_a_program_releases_the_graphs_it_drops():
    """A program holds at most one graph: rebinding a buffer releases it (the graph would
    replay the old pointer), capturing again replaces it, closing releases it; the new binding's
    graph writes the new memory, and a released graph cannot be launched."""
    from metrale.lkb.errors import LaunchError
    from metrale.plan.plan import plan_for
    from metrale.runtime.engine import random_weights
    from metrale.runtime.executor import Program, bind_externals

    plan = plan_for(MODEL, "bf16", "host", mode="prefill", rows=3, context=16)
    be = MockBackend()
    ext = bind_externals(plan, be, random_weights(MODEL, seed=0))
    cache = next(b.name for b in plan.buffers if b.kind == "cache")
    other = be.alloc(ext[cache].nbytes, "another slot")
    be.memset(other, 0)
    prog = Program(plan, be, bindings=ext)
    for name, value in (("tokens", [3, 1, 4]), ("positions", [0, 1, 2]), ("slots", [0, 0, 0])):
        prog.write(name, np.asarray(value))
    assert prog.capture() and be.graph_count() == 1
    first = prog._graph
    prog.capture()
    assert be.graph_count() == 1  # the new capture replaced the first
    prog.bind(cache, other)
    assert not prog.captured and be.graph_count() == 0
    prog.capture()
    prog.run()
    assert be.graph_count() == 1
    assert be.copy_d2h(other, other.nbytes).any()  # this binding's graph wrote this memory
    prog.close()
    assert be.graph_count() == 0
    with pytest.raises(LaunchError, match="not a graph of this backend"):
        be.graph_launch(first)
    be.release_graph(first)  # a second release does nothing

"""The GpuBackend equations, as one state machine, on MockBackend itself and on HostBackend.

The last tests break a model on purpose and check that the state machine notices: a law
suite that cannot fail proves nothing.
"""

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from metrale.backend_laws import HOST_LAW_KERNELS, backend_state_machine, law_binary
from metrale.lkb.errors import UnavailableError
from metrale.runtime.backend import DevicePtr
from metrale.runtime.host_backend import HostBackend
from metrale.runtime.mock_backend import MockBackend

BOUNDED = settings(max_examples=40, stateful_step_count=20, deadline=None)

TestMockLaws = backend_state_machine(MockBackend).TestCase
TestMockLaws.settings = BOUNDED

TestHostLaws = backend_state_machine(HostBackend).TestCase
TestHostLaws.settings = BOUNDED


def _no_graphs() -> MockBackend:
    return MockBackend(graphs=False)


TestNoGraphLaws = backend_state_machine(_no_graphs, max_bytes=8).TestCase
TestNoGraphLaws.settings = settings(max_examples=10, stateful_step_count=10, deadline=None)


class MemsetIgnoresOffset(HostBackend):
    """A wrong model: memset writes at the start of the buffer whatever the offset."""

    def _memset(self, storage, offset, value, nbytes, stream):
        super()._memset(storage, 0, value, nbytes, stream)


class ReplaysOnce(HostBackend):
    """A wrong model: a graph replays only its first node."""

    def _graph_launch(self, native, stream):
        super()._graph_launch(native[:1], stream)


class ForgetsToFree(HostBackend):
    """A wrong model: free leaves the allocation live (no use-after-free error)."""

    def free(self, ptr):
        self._record("free", (ptr,))


class WrongMessage(HostBackend):
    """A wrong model: its out-of-range copy says something else."""

    def copy_d2h(self, src, nbytes=None, stream=None):
        if isinstance(src, DevicePtr) and nbytes is not None and nbytes > src.nbytes:
            raise IndexError("out of range")
        return super().copy_d2h(src, nbytes, stream)


class DependsOnGrid(HostBackend):
    """A wrong model: a kernel launched on more than one block does nothing."""

    def _launch(self, kernel, native, grid, block, shared_mem, args, stream, dependent=False):
        if grid == (1, 1, 1):
            super()._launch(kernel, native, grid, block, shared_mem, args, stream, dependent)


@pytest.mark.parametrize(
    "broken", [MemsetIgnoresOffset, ReplaysOnce, ForgetsToFree, WrongMessage, DependsOnGrid]
)
def test_the_laws_catch_a_broken_model(broken):
    machine = backend_state_machine(broken)
    with pytest.raises(Exception) as info:
        run_state_machine_as_test(
            machine,
            settings=settings(max_examples=200, stateful_step_count=20, deadline=None,
                              database=None, phases=[Phase.generate]),  # finding is enough
        )
    leaves = _leaves(info.value)
    assert leaves and all(isinstance(e, AssertionError | IndexError) for e in leaves), leaves


def _leaves(err: BaseException) -> list[BaseException]:
    if isinstance(err, BaseExceptionGroup):
        return [leaf for sub in err.exceptions for leaf in _leaves(sub)]
    return [err]


def test_law_binary_refuses_an_unknown_format():
    class Odd(HostBackend):
        binary_format = "spirv"

    assert law_binary(HostBackend()) is HOST_LAW_KERNELS
    with pytest.raises(UnavailableError, match="spirv"):
        law_binary(Odd())

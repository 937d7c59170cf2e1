"""MockBackend and the shared backend machinery: recording, injected faults, sticky faults,
identical refusals across models, and ordered fallible teardown."""

import sys

import numpy as np
import pytest

from metrale.lkb.errors import AllocationError, DeviceFault, LaunchError, UnavailableError
from metrale.runtime.backend import (
    DeviceLimits,
    DevicePtr,
    GpuBackend,
    HostKernel,
    PointerError,
    Stream,
    check_launch,
)
from metrale.runtime.fault import FaultLatch, Teardown
from metrale.runtime.host_backend import HostBackend
from metrale.runtime.mock_backend import POISON, Call, MockBackend


def _fill(p, n, v):
    p[:n] = v


BINARY = {"fill": HostKernel(_fill, 3), "rmsnorm": (0, None), "noop": HostKernel(None, 0)}


def _loaded(be):
    mod = be.module(BINARY, "test.bin")
    return {name: be.kernel(mod, name) for name in BINARY}


# -- recording -------------------------------------------------------------------------------


def test_the_mock_records_every_call_in_order():
    be = MockBackend()
    k = _loaded(be)
    p = be.alloc(16, "x")
    be.copy_h2d(p, b"\x01" * 16)
    be.launch(k["fill"], (1, 1, 1), (32, 1, 1), 0, (p + 4, 4, 9))
    be.synchronize()
    be.free(p)
    assert be.ops() == (
        "module", "kernel", "kernel", "kernel", "alloc", "copy_h2d", "launch", "synchronize",
        "free",
    )
    assert be.calls[4] == Call("alloc", (16, "x"))
    assert be.calls[6].args[0] == k["fill"] and be.calls[6].args[4] == (p + 4, 4, 9)
    assert be.calls[-1] == Call("free", (p,))


def test_a_callable_kernel_runs_on_the_bytes_and_none_only_records():
    be = MockBackend()
    k = _loaded(be)
    p = be.alloc(8, "x")
    be.memset(p, 1)
    be.launch(k["fill"], (1, 1, 1), (1, 1, 1), 0, (p + 2, 3, 7))
    be.launch(k["rmsnorm"], (1, 1, 1), (1, 1, 1), 0, ())
    assert bytes(be.copy_d2h(p)) == bytes([1, 1, 7, 7, 7, 1, 1, 1])
    assert be.ops().count("launch") == 2


def test_fresh_mock_memory_is_poisoned():
    be = MockBackend()
    assert bytes(be.copy_d2h(be.alloc(3))) == bytes([POISON] * 3)


# -- out of memory ---------------------------------------------------------------------------


def test_oom_at_the_kth_alloc_names_buffer_and_bytes_and_teardown_releases_the_rest():
    be = MockBackend(oom_at=3)
    acquired = []
    with pytest.raises(AllocationError) as info:
        with Teardown() as td:
            acquired.append(td.acquire(be.alloc(100, "wq"), be.free))
            acquired.append(td.acquire(be.alloc(200, "wk"), be.free))
            td.acquire(be.alloc(300, "kv_cache"), be.free)
    text = str(info.value)
    assert "kv_cache" in text and "300 bytes" in text and "out of device memory" in text
    assert be.live_bytes() == 0
    frees = [c for c in be.calls if c.op == "free"]
    assert frees == [Call("free", (acquired[1],)), Call("free", (acquired[0],))]
    # not sticky: the backend is usable afterwards
    p = be.alloc(4, "after")
    be.memset(p, 0x3C)
    assert bytes(be.copy_d2h(p)) == b"\x3c" * 4


def test_capacity_refuses_past_the_limit_and_frees_make_room():
    be = MockBackend(capacity=100)
    a = be.alloc(60, "a")
    with pytest.raises(AllocationError, match="40 bytes free"):
        be.alloc(50, "b")
    be.free(a)
    assert be.alloc(50, "b").nbytes == 50


@pytest.mark.parametrize("nbytes", [-1, 2.5, "8"])
def test_alloc_of_a_non_count_is_refused(nbytes):
    with pytest.raises(AllocationError, match="not a byte count"):
        MockBackend().alloc(nbytes, "x")


# -- sticky faults ---------------------------------------------------------------------------


def _every_later_call(be, k, p, s):
    return {
        "alloc": lambda: be.alloc(8),
        "launch": lambda: be.launch(k["noop"], (1, 1, 1), (1, 1, 1), 0, ()),
        "synchronize": lambda: be.synchronize(),
        "synchronize(s)": lambda: be.synchronize(s),
        "copy_h2d": lambda: be.copy_h2d(p, b"\x00"),
        "copy_d2h": lambda: be.copy_d2h(p),
        "memset": lambda: be.memset(p, 0),
        "stream": lambda: be.stream(),
        "module": lambda: be.module(BINARY),
        "kernel": lambda: be.kernel(be.module(BINARY), "fill"),
        "begin_capture": lambda: be.begin_capture(s),
    }


@pytest.mark.parametrize("where", ["launch", "sync"])
def test_a_sticky_fault_raises_the_same_text_on_every_later_call(where):
    be = MockBackend(fault_at_launch=2 if where == "launch" else None,
                     fault_at_sync=1 if where == "sync" else None)
    k = _loaded(be)
    p = be.alloc(8, "x")
    s = be.stream()
    be.launch(k["fill"], (1, 1, 1), (1, 1, 1), 0, (p, 8, 1))
    with pytest.raises(DeviceFault) as first:
        if where == "launch":
            be.launch(k["rmsnorm"], (1, 1, 1), (1, 1, 1), 0, ())
        else:
            be.synchronize()
    text = str(first.value)
    kernel = "rmsnorm" if where == "launch" else "fill"
    assert f"device fault in kernel '{kernel}'" in text and "injected fault" in text
    for name, call in _every_later_call(be, k, p, s).items():
        with pytest.raises(DeviceFault) as later:
            call()
        assert str(later.value) == text, name
    assert be.faulted is not None and str(be.faulted) == text


def test_free_and_close_after_a_fault_record_and_return():
    be = MockBackend(fault_at_sync=1)
    p, q = be.alloc(8, "x"), be.alloc(4, "y")
    with pytest.raises(DeviceFault):
        be.synchronize()
    assert be.free(p) is None
    assert be.free(p) is None  # even a second time: never a second error over the first
    assert be.free(DevicePtr(99, 1)) is None
    assert be.live_bytes() == 4
    assert be.close() is None
    assert be.live_bytes() == 0
    with pytest.raises(DeviceFault, match="injected fault"):
        be.alloc(1)  # the dead device says so even after close
    assert be.ops()[-7:] == ("free", "free", "free", "live_bytes", "close", "live_bytes", "alloc")
    del q


def test_teardown_after_a_fault_surfaces_only_the_fault():
    be = MockBackend(fault_at_sync=1)
    with pytest.raises(DeviceFault) as info:
        with Teardown() as td:
            td.acquire(be.alloc(8, "a"), be.free)
            td.callback(be.close)
            be.synchronize()
    assert not getattr(info.value, "__notes__", None)


def test_a_sync_fault_before_any_launch_says_so():
    be = MockBackend(fault_at_sync=1)
    with pytest.raises(DeviceFault, match="before any kernel ran"):
        be.synchronize()


def test_a_host_kernel_that_throws_is_a_sticky_fault():
    def boom(p):
        raise ValueError("index 9 out of bounds")

    be = HostBackend()
    k = be.kernel(be.module({"boom": HostKernel(boom, 1)}), "boom")
    p = be.alloc(4, "x")
    with pytest.raises(DeviceFault, match="kernel 'boom'.*ValueError: index 9") as info:
        be.launch(k, (1, 1, 1), (1, 1, 1), 0, (p,))
    with pytest.raises(DeviceFault) as later:
        be.copy_d2h(p)
    assert str(later.value) == str(info.value)


def test_the_latch_keeps_the_first_fault():
    latch = FaultLatch()
    first = latch.latch(DeviceFault("one"))
    assert latch.latch(DeviceFault("two")) is first
    for _ in range(3):
        with pytest.raises(DeviceFault, match="^one$") as info:
            latch.check()
        assert info.value is not first and info.value.__cause__ is first


# -- refusals before the device: identical in every model, never sticky -----------------------

INVALID = {
    "zero grid": ((0, 1, 1), (32, 1, 1), 0, ()),
    "grid y over": ((1, 65536, 1), (32, 1, 1), 0, ()),
    "grid of two": ((1, 1), (32, 1, 1), 0, ()),
    "block x over": ((1, 1, 1), (1025, 1, 1), 0, ()),
    "block z over": ((1, 1, 1), (1, 1, 65), 0, ()),
    "zero block": ((1, 1, 1), (0, 1, 1), 0, ()),
    "threads over": ((1, 1, 1), (512, 4, 1), 0, ()),
    "shared over": ((1, 1, 1), (32, 1, 1), 227 * 1024 + 1, ()),
    "shared negative": ((1, 1, 1), (32, 1, 1), -1, ()),
    "arity": ((1, 1, 1), (32, 1, 1), 0, (1,)),
    "args not a tuple": ((1, 1, 1), (32, 1, 1), 0, 5),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_an_invalid_launch_is_refused_identically_and_is_not_sticky(case):
    grid, block, shared, args = INVALID[case]
    texts = []
    for be in (MockBackend(), HostBackend()):
        k = _loaded(be)
        with pytest.raises(LaunchError) as info:
            be.launch(k["noop"], grid, block, shared, args)
        texts.append((type(info.value), str(info.value)))
        p = be.alloc(4, "after")
        be.launch(k["fill"], (1, 1, 1), (1, 1, 1), 0, (p, 4, 5))
        be.synchronize()
        assert bytes(be.copy_d2h(p)) == b"\x05" * 4
    assert texts[0] == texts[1]
    assert texts[0][1].startswith("test.bin: launch.noop.")


def test_check_launch_names_the_field():
    k = _loaded(HostBackend())["fill"]
    with pytest.raises(LaunchError, match=r"launch\.fill\.block\.z: block dimension out of range "
                                          r"\(expected 1\.\.64, found 65\)"):
        check_launch(k, (1, 1, 1), (1, 1, 65), 0, (1, 2, 3), DeviceLimits())


def _misuse_texts(be, label):
    k = _loaded(be)
    p = be.alloc(8, label)
    texts = []
    for op, args in (
        ("copy_d2h", (p, 9)),
        ("copy_h2d", (p + 4, b"12345")),
        ("memset", (p, 256)),
        ("free", (p + 1,)),
        ("copy_d2h", (DevicePtr(7, 1),)),
        ("copy_d2h", (DevicePtr(1, 16),)),
    ):
        with pytest.raises(LaunchError) as info:
            getattr(be, op)(*args)
        texts.append(str(info.value))
    be.free(p)
    for op, args in (
        ("copy_d2h", (p,)),
        ("launch", (k["fill"], (1, 1, 1), (1, 1, 1), 0, (p + 2, 1, 1))),
        ("free", (p,)),
    ):
        with pytest.raises(PointerError) as info:
            getattr(be, op)(*args)
        texts.append(str(info.value))
    be.synchronize()  # none of it was sticky
    return texts


@pytest.mark.parametrize("label, shown", [("kv", "'kv'"), ("", "'#1'")])
def test_pointer_misuse_messages_agree_across_models(label, shown):
    mock, host = _misuse_texts(MockBackend(), label), _misuse_texts(HostBackend(), label)
    assert mock == host
    assert mock[-3] == f"copy_d2h.src: use after free of buffer {shown}"
    assert mock[-2] == f"launch.fill.args[0]: use after free of buffer {shown}"
    assert mock[-1] == f"free.ptr: double free of buffer {shown}"
    assert "pointer to no allocation" in mock[4]
    assert "pointer outside buffer" in mock[5]


def test_pointer_arithmetic_is_bounds_checked():
    p = DevicePtr(1, 8)
    assert (p + 8).nbytes == 0 and (p + 3).take(2) == DevicePtr(1, 2, 3)
    with pytest.raises(PointerError):
        p + 9
    with pytest.raises(PointerError):
        p + (-1)
    with pytest.raises(PointerError):
        p.take(9)


def test_zero_byte_allocations_are_real_and_free():
    be = HostBackend()
    p = be.alloc(0, "empty")
    assert p == DevicePtr(1, 0) and be.live_bytes() == 0
    assert be.copy_d2h(p).size == 0
    be.copy_h2d(p, b"")
    be.memset(p, 1)
    be.free(p)
    with pytest.raises(PointerError, match="use after free of buffer 'empty'"):
        be.copy_d2h(p)


def test_copy_h2d_takes_arrays_and_refuses_other_things():
    be = MockBackend()
    p = be.alloc(8, "x")
    be.copy_h2d(p, np.array([1.5, -2.0], np.float32))
    assert be.copy_d2h(p).view(np.float32).tolist() == [1.5, -2.0]
    with pytest.raises(LaunchError, match="not C-contiguous"):
        be.copy_h2d(p, np.arange(4, dtype=np.int32)[::2])
    with pytest.raises(LaunchError, match="not host bytes"):
        be.copy_h2d(p, [1, 2])


# -- modules and kernels ---------------------------------------------------------------------


def test_kernel_lookup_errors_name_module_and_suggest():
    be = MockBackend()
    mod = be.module(BINARY, "test.bin")
    with pytest.raises(LaunchError, match=r"test\.bin: kernel\.rmsnrm: module has no kernel "
                                          r"'rmsnrm'.*did you mean 'rmsnorm'\?"):
        be.kernel(mod, "rmsnrm")
    with pytest.raises(LaunchError, match="arity differs"):
        be.kernel(mod, "fill", arity=2)
    assert be.kernel(mod, "fill", arity=3).arity == 3
    with pytest.raises(LaunchError, match="not a host binary"):
        be.module(b"\x7fELF")
    with pytest.raises(LaunchError, match="not a host kernel"):
        be.module({"k": lambda: None})


# -- streams and graph capture ---------------------------------------------------------------


def test_streams_are_deterministic_values_and_foreign_ones_are_refused():
    a, b = MockBackend(), HostBackend()
    assert a.stream() == b.stream() == Stream(1)
    with pytest.raises(LaunchError, match="not a stream of this backend"):
        a.synchronize(Stream(5))


def test_captured_work_runs_only_on_replay_and_counts_as_launches():
    be = MockBackend(fault_at_launch=3)
    k = _loaded(be)
    p = be.alloc(4, "x")
    be.memset(p, 0)
    s = be.stream()
    be.begin_capture(s)
    be.memset(p, 1, 2, stream=s)
    be.launch(k["fill"], (1, 1, 1), (1, 1, 1), 0, (p + 2, 2, 9), stream=s)
    be.launch(k["noop"], (1, 1, 1), (1, 1, 1), 0, (), stream=s)
    g = be.end_capture(s)
    assert g.nodes == 3 and g.stream == s
    assert bytes(be.copy_d2h(p)) == b"\x00" * 4  # nothing ran during capture
    be.graph_launch(g, s)
    assert bytes(be.copy_d2h(p)) == bytes([1, 1, 9, 9])
    assert be.launches == 2
    with pytest.raises(DeviceFault, match="kernel 'fill'"):
        be.graph_launch(g, s)  # the replayed fill is the third launch


def test_capture_rules_are_enforced_before_the_device():
    be = MockBackend()
    s, t = be.stream(), be.stream()
    with pytest.raises(LaunchError, match="default stream cannot be captured"):
        be.begin_capture(None)
    be.begin_capture(s)
    for call in (lambda: be.begin_capture(t), lambda: be.alloc(4), lambda: be.synchronize(),
                 lambda: be.copy_d2h(DevicePtr(1, 0)), lambda: be.stream()):
        with pytest.raises(LaunchError, match="not allowed while a graph is being captured"):
            call()
    with pytest.raises(LaunchError, match="stream is not capturing"):
        be.end_capture(t)
    assert be.end_capture(s).nodes == 0


def test_a_graph_over_a_freed_buffer_is_refused():
    be = HostBackend()
    k = _loaded(be)
    p = be.alloc(4, "kv")
    s = be.stream()
    be.begin_capture(s)
    be.launch(k["fill"], (1, 1, 1), (1, 1, 1), 0, (p, 4, 1), stream=s)
    g = be.end_capture(s)
    be.free(p)
    with pytest.raises(PointerError, match="graph_launch.graph: use after free of buffer 'kv'"):
        be.graph_launch(g)


def test_a_model_without_graphs_says_so():
    be = MockBackend(graphs=False)
    with pytest.raises(UnavailableError, match="graph capture is not supported"):
        be.begin_capture(be.stream())


# -- close -----------------------------------------------------------------------------------


def test_close_releases_everything_and_is_final():
    be = MockBackend()
    p = be.alloc(16, "x")
    be.close()
    be.close()
    assert be.live_bytes() == 0
    assert be.free(p) is None
    with pytest.raises(UnavailableError, match="backend is closed"):
        be.alloc(1)


def test_every_model_here_satisfies_the_protocol():
    assert isinstance(MockBackend(), GpuBackend) and isinstance(HostBackend(), GpuBackend)


# -- teardown --------------------------------------------------------------------------------


def test_teardown_releases_in_reverse_order():
    order = []
    with Teardown() as td:
        for name in "abc":
            td.callback(order.append, name)
        assert len(td) == 3
    assert order == ["c", "b", "a"]


def test_teardown_runs_every_release_and_reraises_the_first_error():
    order = []

    def fail(name):
        order.append(name)
        raise RuntimeError(f"release {name} failed")

    td = Teardown()
    td.callback(order.append, "a")
    td.callback(fail, "b")
    td.callback(fail, "c")
    with pytest.raises(RuntimeError, match="release c failed") as info:
        td.close()
    assert order == ["c", "b", "a"]
    assert info.value.__notes__ == ["also during teardown: RuntimeError: release b failed"]
    assert len(td.errors) == 2


def test_teardown_never_puts_a_second_error_over_the_body_error():
    def fail():
        raise RuntimeError("release failed")

    released = []
    with pytest.raises(KeyError) as info:
        with Teardown() as td:
            td.callback(released.append, 1)
            td.callback(fail)
            raise KeyError("body")
    assert released == [1]
    assert info.value.__notes__ == ["also during teardown: RuntimeError: release failed"]


# -- the CUDA model without CUDA -------------------------------------------------------------


def test_the_cuda_model_imports_without_cupy_and_says_why_it_is_unavailable(monkeypatch):
    from metrale.runtime import cupy_backend

    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    ok, why = cupy_backend.CupyBackend.available()
    assert ok is False and "CuPy is not installed" in why
    with pytest.raises(UnavailableError, match="CuPy is not installed"):
        cupy_backend.CupyBackend()


def test_ptx_parameters_are_read_from_entries():
    from metrale.runtime.cupy_backend import ptx_params

    ptx = """
    .visible .entry k(
        .param .u64 k_param_0,
        .param .f32 k_param_1,
        .param .align 8 .b8 k_param_2[16]
    )
    .visible .entry empty()
    """
    assert ptx_params(ptx) == {"k": ("u64", "f32", "b8[16]"), "empty": ()}


def test_a_tensor_map_argument_resolves_to_its_arrays_description_inside_its_allocation():
    """A ``TensorMap`` launch argument reaches a host kernel as the 128 bytes that describe its
    array (the address of its first byte, its rows, columns and row bytes, the box), in the
    mock as on the host; an array past the pointer's allocation is refused before any launch,
    as a pointer's access would be, naming the launch argument."""
    from metrale.runtime.backend import TensorMap
    from metrale.runtime.host_backend import HOST_TENSOR_MAP_MAGIC

    for be in (HostBackend(), MockBackend()):
        seen: list = []
        k = be.kernel(be.module({"copy": HostKernel(seen.append, 1)}), "copy")
        p = be.alloc(2 * 3 * 64, "x")
        be.launch(k, (1, 1, 1), (1, 1, 1), 0, (TensorMap(p + 0, 3, 64, "bf16", (64, 2)),))
        (m,) = seen
        assert m.dtype.itemsize == 128 and int(m["magic"]) == HOST_TENSOR_MAP_MAGIC
        assert (int(m["rows"]), int(m["cols"]), int(m["row_bytes"])) == (3, 64, 128)
        assert (int(m["box_cols"]), int(m["box_rows"]), int(m["item_bytes"])) == (64, 2, 2)
        assert int(m["address"]) == be.host_bytes(p).ctypes.data
        with pytest.raises(PointerError, match=r"launch\.copy\.args\[0\]"):
            be.launch(k, (1, 1, 1), (1, 1, 1), 0, (TensorMap(p, 4, 64, "bf16", (64, 2)),))

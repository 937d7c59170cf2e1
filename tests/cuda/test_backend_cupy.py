"""CupyBackend: the GpuBackend laws on a real device, plus what only CUDA has (argument widths,
opt-in shared memory, out-of-memory, sticky faults in a child process)."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import settings

pytest.importorskip("cupy")

from metrale.backend_laws import backend_state_machine, nvrtc_ptx  # noqa: E402
from metrale.lkb.errors import AllocationError, LaunchError  # noqa: E402
from metrale.runtime.backend import PointerError  # noqa: E402
from metrale.runtime.cupy_backend import CupyBackend  # noqa: E402

OK, WHY = CupyBackend.available()
if not OK:
    pytest.skip(WHY, allow_module_level=True)

pytestmark = pytest.mark.cuda

TestCupyLaws = backend_state_machine(CupyBackend).TestCase
TestCupyLaws.settings = settings(max_examples=30, stateful_step_count=15, deadline=None)

SOURCE = r"""
extern "C" __global__ void axpy(float* y, const float* x, float a, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
extern "C" __global__ void smem_reverse(const int* x, int* out, int n) {
    extern __shared__ int buf[];
    for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = x[i];
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = buf[n - 1 - i];
}
extern "C" __global__ void bump(int* p) { atomicAdd(p, 1); }
"""


@pytest.fixture
def be():
    backend = CupyBackend()
    yield backend
    backend.close()


@pytest.fixture
def kernels(be):
    mod = be.module(nvrtc_ptx(SOURCE, "test.cu"), "test.cu")
    return {name: be.kernel(mod, name) for name in ("axpy", "smem_reverse", "bump")}


def test_limits_come_from_the_device(be):
    lim = be.limits
    assert lim.max_threads_per_block == 1024 and lim.max_block == (1024, 1024, 64)
    assert lim.max_grid == (2**31 - 1, 65535, 65535)
    assert lim.max_shared_mem >= 48 * 1024 and lim.multiprocessors > 0
    assert lim.total_memory > 2**30 and lim.name
    import cupy as cp  # the capability the engine picks machine code or PTX by

    assert lim.compute_capability == divmod(int(cp.cuda.Device().compute_capability), 10)


def test_arities_and_widths_come_from_the_ptx(be, kernels):
    assert kernels["axpy"].arity == 4 and kernels["smem_reverse"].arity == 3
    n = 1000
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    px, py = be.alloc(4 * n, "x"), be.alloc(4 * n, "y")
    be.copy_h2d(px, x)
    be.copy_h2d(py, y)
    # a Python float goes as the .f32 and a Python int as the 64-bit integer the PTX declares
    be.launch(kernels["axpy"], ((n + 255) // 256, 1, 1), (256, 1, 1), 0, (py, px, 1.5, n))
    be.synchronize()
    got = be.copy_d2h(py).view(np.float32)
    np.testing.assert_allclose(got, np.float32(1.5) * x + y, rtol=1.3e-6, atol=1e-5)
    with pytest.raises(LaunchError, match=r"axpy\.args\[2\].*expected \.f32, found int 2"):
        be.launch(kernels["axpy"], (1, 1, 1), (1, 1, 1), 0, (py, px, 2, n))
    with pytest.raises(LaunchError, match=r"args\[2\].*expected \.f32, found float64"):
        be.launch(kernels["axpy"], (1, 1, 1), (1, 1, 1), 0, (py, px, np.float64(1), n))
    # `int n` is a .u32 in PTX: a pointer does not fit it, a negative int does (as int32)
    with pytest.raises(LaunchError, match=r"smem_reverse\.args\[2\].*expected \.u32"):
        be.launch(kernels["smem_reverse"], (1, 1, 1), (1, 1, 1), 0, (px, py, px))
    with pytest.raises(LaunchError, match=r"smem_reverse\.args\[2\].*out of range"):
        be.launch(kernels["smem_reverse"], (1, 1, 1), (1, 1, 1), 0, (px, py, 1 << 32))
    be.launch(kernels["smem_reverse"], (1, 1, 1), (32, 1, 1), 0, (px, py, -1))  # loops run 0 times
    be.synchronize()
    np.testing.assert_array_equal(be.copy_d2h(py).view(np.float32), got)


def test_dynamic_shared_memory_past_48k_is_opted_in(be, kernels):
    n = 40_000  # 160 000 bytes of shared memory
    assert 4 * n > 48 * 1024 and 4 * n <= be.limits.max_shared_mem
    x = np.arange(n, dtype=np.int32) * 3 + 1
    px, pout = be.alloc(4 * n, "x"), be.alloc(4 * n, "out")
    be.copy_h2d(px, x)
    be.memset(pout, 0xFF)  # poison
    be.launch(kernels["smem_reverse"], (1, 1, 1), (1024, 1, 1), 4 * n, (px, pout, n))
    be.synchronize()
    np.testing.assert_array_equal(be.copy_d2h(pout).view(np.int32), x[::-1])


def test_a_captured_graph_replays_on_the_device(be, kernels):
    p = be.alloc(4, "counter")
    be.memset(p, 0)
    s = be.stream()
    be.begin_capture(s)
    be.launch(kernels["bump"], (2, 1, 1), (32, 1, 1), 0, (p,), stream=s)
    g = be.end_capture(s)
    be.synchronize()
    assert be.copy_d2h(p).view(np.int32)[0] == 0
    for _ in range(5):
        be.graph_launch(g, s)
    be.synchronize(s)
    assert be.copy_d2h(p).view(np.int32)[0] == 5 * 64


def test_out_of_memory_names_the_buffer_and_is_not_sticky(be):
    p = be.alloc(1024, "small")
    with pytest.raises(AllocationError, match="huge: out of device memory") as info:
        be.alloc(be.limits.total_memory * 4, "huge")
    assert "bytes free" in str(info.value)
    be.memset(p, 3)
    assert bytes(be.copy_d2h(p)) == b"\x03" * 1024
    be.free(p)
    with pytest.raises(PointerError, match="use after free of buffer 'small'"):
        be.copy_d2h(p)


CHILD = textwrap.dedent(
    r"""
    import sys
    from metrale.backend_laws import nvrtc_ptx
    from metrale.lkb.errors import DeviceFault
    from metrale.runtime.cupy_backend import CupyBackend
    from metrale.runtime.fault import Teardown

    SRC = 'extern "C" __global__ void crash(int* p) { asm("trap;"); }'
    be = CupyBackend()
    k = be.kernel(be.module(nvrtc_ptx(SRC, "crash.cu"), "crash.cu"), "crash")
    texts = []
    try:
        with Teardown() as td:
            td.callback(be.close)
            p = td.acquire(be.alloc(64, "victim"), be.free)
            be.launch(k, (1, 1, 1), (1, 1, 1), 0, (p,))
            be.synchronize()
    except DeviceFault as e:
        texts.append(str(e))
        assert not getattr(e, "__notes__", None), e.__notes__  # no second error over it
    for call in (lambda: be.alloc(8), lambda: be.synchronize()):
        try:
            call()
        except DeviceFault as e:
            texts.append(str(e))
    assert len(texts) == 3 and len(set(texts)) == 1, texts
    assert "kernel 'crash'" in texts[0], texts[0]
    print("STICKY-OK", texts[0])
    """
)


def test_a_device_fault_is_sticky_and_teardown_stays_quiet():
    # a trapped kernel kills the CUDA context for the whole process: run it in a child
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "STICKY-OK" in done.stdout and "synchronize: device fault in kernel 'crash'" in done.stdout


def test_the_nccl_transport_of_one_rank_gathers_its_own_bytes(be):
    """NCCL through CuPy, one rank on this GPU: gather_into copies the rank's bytes into the
    gathered buffer, on a stream, as a collective's transport launch does."""
    from metrale.runtime.nccl import NcclTransport, unique_id

    t = NcclTransport(1, 0, unique_id())
    src, dst = be.alloc(96, "x"), be.alloc(96, "gathered")
    stream = be.stream()
    be.copy_h2d(src, np.arange(96, dtype=np.uint8))
    be.memset(dst, 0xFF)
    t.gather_into(be, src, dst, 96, stream)
    be.synchronize(stream)
    assert be.copy_d2h(dst).tolist() == list(range(96))
    be.free(src)
    be.free(dst)

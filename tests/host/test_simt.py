"""The emulation's own laws (tests/host/simt), on small sources written here: threads meet at
block and warp barriers in any number of rounds, a thread that returns stops counting, threads
that wait at barriers none of them can complete trap instead of hanging, the dependent-launch
guard shows what a kernel touches before its wait, bulk copies land at their barrier's wait, and
a resident grid's blocks meet at a grid-wide barrier."""

from __future__ import annotations

import numpy as np
import pytest

from tests.host import simt

ok, why = simt.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"no host emulation: {why}")

SOURCE = r"""
#include "grid.cuh"

// Each block sums its threads' ids through shared memory, one __syncthreads a round, and lane 0
// of each warp adds its warp's ids with shuffles; threads at or past `live` return first.
extern "C" __global__ void block_sums(int* out, int* warp_out, int live) {
    __shared__ int partial[1024];
    const int t = threadIdx.x;
    if (t >= live) return;
    partial[t] = t;
    __syncthreads();
    for (int stride = 1; stride < live; stride *= 2) {
        const int other = t + stride < live && t % (2 * stride) == 0 ? partial[t + stride] : 0;
        __syncthreads();
        partial[t] += other;
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = partial[0];
    if (live % 32 == 0) {
        int v = t;
        for (int m = 16; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
        if (t % 32 == 0) warp_out[blockIdx.x * 32 + t / 32] = v;
    }
}

// out[i] = __byte_perm(x[i], y[i], s[i]), one thread a case.
extern "C" __global__ void byte_perms(const unsigned* x, const unsigned* y, const unsigned* s,
                                      unsigned* out, int n) {
    if ((int)threadIdx.x < n) out[threadIdx.x] = __byte_perm(x[threadIdx.x], y[threadIdx.x],
                                                             s[threadIdx.x]);
}

// Half of warp 0 waits at its warp's barrier, everyone else at the block's: neither completes.
extern "C" __global__ void split_barrier(int* out) {
    if (threadIdx.x < 16) __syncwarp();
    else __syncthreads();
    out[threadIdx.x] = 1;
}

// y[i] = x[i] + 1 over one warp, x read before the dependent-launch wait (how: 1 a load, 2 a
// cp.async issued before it and landed after it) or after it (0); early_store writes y before
// the wait too.
extern "C" __global__ void guarded_probe(const float* x, float* y, int how, int early_store) {
    extern __shared__ __align__(16) float staged[];
    const int i = threadIdx.x;
    float v = 0.0f;
    if (how == 1) v = x[i];
    if (how == 2 && i % 4 == 0) {
        const unsigned s = (unsigned)__cvta_generic_to_shared(staged + i);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(x + i) : "memory");
    }
    if (early_store) y[i] = 1.0f;
    grid_dependency_sync();
    if (how == 2) {
        asm volatile("cp.async.commit_group;\n\tcp.async.wait_all;" ::: "memory");
        __syncthreads();
        v = staged[i];
    }
    if (how == 0) v = x[i];
    y[i] = v + 1.0f;
}

// out[i] = src[i] over one warp, through shared memory: a bulk copy of 128 bytes counted on a
// transaction barrier armed for `armed` bytes (the copy issued before the arming arrival when
// copy_first), read before the barrier's wait (early) or after.
extern "C" __global__ void bulk_probe(const float* src, float* out, int armed, int early,
                                      int copy_first) {
    extern __shared__ __align__(16) float stage[];  // 32 floats, then the barrier
    const unsigned bar = (unsigned)__cvta_generic_to_shared(stage + 32);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (int step = 0; step < 2; ++step) {
            if (step == (copy_first ? 1 : 0))
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                             ::"r"(bar), "r"(armed) : "memory");
            else
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                             "[%0], [%1], %2, [%3];"
                             ::"r"((unsigned)__cvta_generic_to_shared(stage)), "l"(src),
                             "r"(128), "r"(bar) : "memory");
        }
    }
    __syncthreads();
    float v = early ? stage[threadIdx.x] : 0.0f;
    unsigned done = 0;
    while (!done)
        asm volatile("{\n\t.reg .pred p;\n\t"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}" : "=r"(done) : "r"(bar) : "memory");
    if (!early) v = stage[threadIdx.x];
    out[threadIdx.x] = v;
}

// Thread 0 asks L2 for `bytes` from p (cp.async.bulk.prefetch), then every thread writes 1.
extern "C" __global__ void bulk_prefetch_probe(const float* p, unsigned bytes, int* out) {
    if (threadIdx.x == 0)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
    __syncthreads();
    out[threadIdx.x] = 1;
}

// A ring of two 32-float stages through which thread 0 streams `stages` pieces of src by bulk
// copies: full[s] (one arrival and the copy's bytes) says slot s holds its piece, empty[s] (one
// arrival a warp) that both warps have read it, after which thread 0 refills it. Each thread
// writes out[st 64 + t] = piece st's float t % 32 + its warp. bug 1: the consumers wait for
// parity 0 every time, which passes the second use of a slot before its copy lands; bug 2: thread
// 0 refills a slot without waiting for both warps to have read it.
extern "C" __global__ void ring_probe(const float* src, float* out, int stages, int bug) {
    extern __shared__ __align__(16) float ring[];  // 2 x 32 floats, then 4 barriers
    const unsigned full = (unsigned)__cvta_generic_to_shared(ring + 64), empty = full + 16;
    const int t = threadIdx.x, lane = t % 32, warp = t / 32;
    auto arm = [&](int st) {
        const unsigned bar = full + 8 * (st % 2);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     ::"r"(bar), "r"(128) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], "
                     "[%1], %2, [%3];"
                     ::"r"((unsigned)__cvta_generic_to_shared(ring + 32 * (st % 2))),
                     "l"(src + 32 * st), "r"(128), "r"(bar) : "memory");
    };
    auto wait = [&](unsigned bar, unsigned parity) {
        unsigned done = 0;
        while (!done)
            asm volatile("{\n\t.reg .pred p;\n\t"
                         "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                         "selp.u32 %0, 1, 0, p;\n\t}" : "=r"(done) : "r"(bar), "r"(parity)
                         : "memory");
    };
    if (t == 0) {
        for (int s = 0; s < 2; ++s) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(full + 8 * s), "r"(1));
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(empty + 8 * s), "r"(2));
        }
        for (int st = 0; st < 2 && st < stages; ++st) arm(st);
    }
    __syncthreads();
    for (int st = 0; st < stages; ++st) {
        const unsigned use = bug == 1 ? 0u : (unsigned)(st / 2) & 1u;
        wait(full + 8 * (st % 2), use);
        out[st * 64 + t] = ring[32 * (st % 2) + lane] + (float)warp;
        __syncwarp();
        if (lane == 0)
            asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(empty + 8 * (st % 2))
                         : "memory");
        if (t == 0 && st + 2 < stages) {
            if (bug != 2) wait(empty + 8 * (st % 2), (unsigned)(st / 2) & 1u);
            arm(st + 2);
        }
    }
}

// Every block of the grid meets (an arrival count and a generation word, the spin reading
// %globaltimer; a block that waits past timeout_ns writes -1 and returns), then sums what every
// block wrote before it. Each block keeps its id in a static __shared__ variable and its id
// plus 100 in the file-scope dynamic array below across the meeting, and reads an element of
// another static array never written (unset: 0xFF bytes, so NaN).
extern __shared__ int meet_dynamic[];
extern "C" __global__ void grid_meet_probe(int* ids, int* sums, unsigned* sync, float* unset,
                                           long long timeout_ns) {
    __shared__ int mine;
    __shared__ float never[2];
    if (threadIdx.x == 0) {
        mine = (int)blockIdx.x;
        meet_dynamic[0] = (int)blockIdx.x + 100;
        ids[blockIdx.x] = (int)blockIdx.x + 1;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile unsigned* gen = sync + 1;
        const unsigned g = *gen;
        __threadfence();
        if (atomicAdd(sync, 1u) == gridDim.x - 1) {
            atomicExch(sync, 0u);
            __threadfence();
            atomicAdd(sync + 1, 1u);
        } else {
            unsigned long long t0, t;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
            do {
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
                if ((long long)(t - t0) > timeout_ns) {
                    mine = -1;
                    break;
                }
            } while (*gen == g);
        }
    }
    __syncthreads();
    int total = 0;
    for (unsigned b = 0; b < gridDim.x; ++b) total += ids[b];
    if (threadIdx.x == 0) {
        const bool own = meet_dynamic[0] == (int)blockIdx.x + 100;
        sums[blockIdx.x] = mine < 0 ? -1 : own ? total * 1000 + mine : -2;
        unset[blockIdx.x] = never[1];
    }
}
"""
ENTRIES = {"block_sums": ("ptr", "ptr", "i32"), "split_barrier": ("ptr",),
           "byte_perms": ("ptr", "ptr", "ptr", "ptr", "i32"),
           "guarded_probe": ("ptr", "ptr", "i32", "i32"),
           "bulk_probe": ("ptr", "ptr", "i32", "i32", "i32"),
           "grid_meet_probe": ("ptr", "ptr", "ptr", "ptr", "i64"),
           "bulk_prefetch_probe": ("ptr", "i32", "ptr"),
           "ring_probe": ("ptr", "ptr", "i32", "i32")}


@pytest.fixture(scope="module")
def laws(tmp_path_factory):
    folder = tmp_path_factory.mktemp("simt_laws")
    (folder / "laws.cu").write_text(SOURCE)
    return folder


@pytest.fixture(scope="module")
def lib(laws):
    return simt.build(laws / "build", str(laws / "laws.cu"), (), ENTRIES)


@pytest.fixture(scope="module")
def ways(laws):
    """The laws built each way the emulation can run a block: warps in step or skewed
    (METRALE_SIMT_SKEW), bulk copies landing at the first wait or as issued
    (METRALE_SIMT_BULK_EAGER)."""
    return {(skew, eager): simt.build(laws / "build", str(laws / "laws.cu"),
                                      (f"METRALE_SIMT_SKEW={skew}",
                                       f"METRALE_SIMT_BULK_EAGER={eager}"), ENTRIES)
            for skew in (0, 1) for eager in (0, 1)}


@pytest.mark.parametrize("threads,live", [(32, 32), (256, 256), (256, 100), (1024, 1024)])
def test_threads_meet_at_block_and_warp_barriers(lib, threads, live):
    blocks = 3
    out = np.full(blocks, -1, np.int32)  # poisoned: every block must write its sum
    warp_out = np.full(blocks * 32, -1, np.int32)
    lib.launch("block_sums", (blocks, 1, 1), (threads, 1, 1), 0, [out, warp_out, live])
    assert out.tolist() == [live * (live - 1) // 2] * blocks
    if live % 32 == 0:
        warps = np.arange(live).reshape(-1, 32).sum(axis=1)
        for b in range(blocks):
            assert warp_out[b * 32:b * 32 + live // 32].tolist() == warps.tolist()


def test_threads_waiting_at_barriers_none_can_complete_trap(lib, capfd):
    out = np.zeros(64, np.int32)
    assert lib.run("split_barrier", (1, 1, 1), (64, 1, 1), 0, [out]) == 2
    assert "wait at barriers the others never reach" in capfd.readouterr().err
    assert not out.any()  # no thread went past its barrier


def test_byte_perm_picks_bytes_as_cuda_documents(lib):
    """Byte n of __byte_perm(x, y, s) is byte s[4n + 2 .. 4n] of y:x (x the low four bytes);
    each selector nibble's top bit and the selector's upper half are ignored. Expected values
    worked out by hand from that rule."""
    cases = [(0x5410, 0x55441100),  # gemv_mma's pair of low halves
             (0x7632, 0x77663322),  # and of high halves
             (0x0123, 0x00112233),
             (0xFFFF8C9A, 0x00441122)]  # nibbles A, 9, C, 8 read as 2, 1, 4, 0
    n = len(cases)
    x = np.full(n, 0x33221100, np.uint32)
    y = np.full(n, 0x77665544, np.uint32)
    sel = np.array([c[0] for c in cases], np.uint32)
    out = np.full(n, 0xDEADBEEF, np.uint32)  # poisoned: every case must be written
    lib.launch("byte_perms", (1, 1, 1), (32, 1, 1), 0, [x, y, sel, out, n])
    assert [hex(v) for v in out.tolist()] == [hex(c[1]) for c in cases]


@pytest.mark.parametrize("how", [0, 1, 2])  # x read after the wait, a load before, a cp.async
def test_the_dependent_launch_guard_shows_what_comes_before_the_wait(lib, how, capfd):
    """Guarded bytes read before the wait read as poison (a cp.async issued before it too, though
    it lands after), a store to them before the wait traps, and the bytes are the step's again
    after the launch; unguarded, the same launches run as written."""
    x = np.arange(32, dtype=np.float32)
    y = np.full(32, -7.0, np.float32)
    guard = [(x.ctypes.data, x.nbytes), (y.ctypes.data, y.nbytes)]
    with simt.dependent_launch_guard(guard):
        lib.launch("guarded_probe", (1, 1, 1), (32, 1, 1), 128, [x, y, how, 0])
    assert np.array_equal(x, np.arange(32, dtype=np.float32))
    if how:
        assert np.isnan(y).all()  # x was poison when read
    else:
        assert np.array_equal(y, x + 1.0)
    y[:] = -7.0
    with simt.dependent_launch_guard(guard):
        assert lib.run("guarded_probe", (1, 1, 1), (32, 1, 1), 128, [x, y, how, 1]) == 2
    assert "before its dependent-launch wait" in capfd.readouterr().err
    assert (y == -7.0).all()  # the store's bytes gave way to the step's
    lib.launch("guarded_probe", (1, 1, 1), (32, 1, 1), 128, [x, y, how, 1])
    assert np.array_equal(y, x + 1.0)


def test_a_bulk_copy_lands_at_its_barriers_wait(lib, capfd):
    """cp.async.bulk's bytes are in shared memory after the transaction barrier's wait and not
    before the first thread's wait (the block's last thread to leave __syncthreads goes on first
    and reads poison; the others read after its wait landed the copy, as the GPU may let them);
    a barrier armed for more bytes than its copies bring, a wait the GPU would never end, is a
    deadlock and traps."""
    src = np.arange(32, dtype=np.float32) + 0.5
    out = np.full(32, -1.0, np.float32)
    lib.launch("bulk_probe", (1, 1, 1), (32, 1, 1), 144, [src, out, 128, 0, 0])
    assert np.array_equal(out, src)
    lib.launch("bulk_probe", (1, 1, 1), (32, 1, 1), 144, [src, out, 128, 1, 0])
    assert np.isnan(out[31]) and np.array_equal(out[:31], src[:31])
    assert lib.run("bulk_probe", (1, 1, 1), (32, 1, 1), 144, [src, out, 256, 0, 0]) == 2
    assert "wait at barriers the others never reach" in capfd.readouterr().err


def test_a_bulk_copy_may_land_before_the_arrival_that_arms_it(ways, capfd):
    """The copy issued before its barrier's expect_tx arrival: however the copies land (late, or
    as issued, when its bytes count before they are armed, as the hardware's pending count may
    go below zero), the phase completes with both and the bytes are there. Bytes past the armed
    ones once every arrival is in are a fault."""
    src = np.arange(32, dtype=np.float32) + 0.5
    for way, build in ways.items():
        out = np.full(32, -1.0, np.float32)
        build.launch("bulk_probe", (1, 1, 1), (32, 1, 1), 144, [src, out, 128, 0, 1])
        assert np.array_equal(out, src), way
        assert build.run("bulk_probe", (1, 1, 1), (32, 1, 1), 144, [src, out, 64, 0, 0]) == 2
        assert "bulk copies past the barrier's armed bytes" in capfd.readouterr().err, way


def test_a_ring_of_stages_streams_through_its_barriers_phases(lib):
    """A producer/consumer ring of bulk-copied stages: each slot's full barrier completes once a
    use (one arrival and its bytes), its empty barrier once both warps have read it, and a wait
    names the use by its phase's parity; a consumer that reaches a slot's next use before thread
    0 has armed it spins until it has. Waiting for parity 0 every time passes the second use at
    once and reads the first use's piece (here the waits then fall out of step with the phases
    and the ring deadlocks, which traps)."""
    stages = 7
    src = np.arange(32 * stages, dtype=np.float32) * 0.5
    want = np.stack([src[32 * st:32 * st + 32] + w for st in range(stages) for w in (0, 1)])
    out = np.full(64 * stages, np.nan, np.float32)
    lib.launch("ring_probe", (1, 1, 1), (64, 1, 1), 256 + 32, [src, out, stages, 0])
    assert np.array_equal(out.reshape(-1, 32), want)
    out[:] = np.nan
    rc = lib.run("ring_probe", (1, 1, 1), (64, 1, 1), 256 + 32, [src, out, stages, 1])
    assert rc == 2 or not np.array_equal(out.reshape(-1, 32), want)
    assert not np.array_equal(out[128:160], src[64:96])  # the second use of slot 0 read stale


def test_a_slot_refilled_before_it_is_read_shows_unless_the_warps_run_in_step(ways):
    """A producer that refills a slot without waiting for its empty barrier races the warps still
    reading it. With the warps in step the race never shows, wherever the copies land: every warp
    has read the slot before the producer's thread refills it. With the warps skewed (warp 0, the
    producer's, runs ahead) it does: a lagging warp reads the next piece or misses a phase. The
    correct ring passes every way."""
    stages = 7
    src = np.arange(32 * stages, dtype=np.float32) * 0.5
    want = np.stack([src[32 * st:32 * st + 32] + w for st in range(stages) for w in (0, 1)])
    right = {}
    for way, build in ways.items():
        for bug in (0, 2):
            out = np.full(64 * stages, np.nan, np.float32)
            rc = build.run("ring_probe", (1, 1, 1), (64, 1, 1), 256 + 32, [src, out, stages, bug])
            right[way, bug] = rc == 0 and np.array_equal(out.reshape(-1, 32), want)
    assert all(right[way, 0] for way in ways)
    assert [way for way in ways if right[way, 2]] == [(0, 0), (0, 1)]  # in step


def test_a_bulk_prefetch_is_checked_and_moves_nothing(lib, capfd):
    """cp.async.bulk.prefetch.L2 is a hint: a 16-byte-aligned source and size run (no bytes move
    anywhere a kernel could see); a size that is not a multiple of 16, which the GPU refuses,
    traps."""
    src = np.arange(32, dtype=np.float32)
    out = np.zeros(32, np.int32)
    lib.launch("bulk_prefetch_probe", (1, 1, 1), (32, 1, 1), 0, [src, 128, out])
    assert (out == 1).all() and np.array_equal(src, np.arange(32, dtype=np.float32))
    out[:] = 0
    assert lib.run("bulk_prefetch_probe", (1, 1, 1), (32, 1, 1), 0, [src, 8, out]) == 2
    assert "bulk prefetch not in 16-byte units" in capfd.readouterr().err
    assert not out.any()


@pytest.mark.parametrize("blocks", [1, 5])
def test_a_resident_grid_meets_at_a_grid_barrier(lib, blocks):
    """In a resident launch every block runs at once, so a grid-wide barrier (a spin on an
    arrival count, reading %globaltimer) completes and each block reads what all wrote before
    it; each block's static __shared__ variables and its dynamic shared memory, a file-scope
    array included, are its own (its id survives the other blocks' writes between its barriers),
    and start unset (0xFF bytes). The barrier's count is back to
    zero and its generation moved once. Run block by block, the same launch's waiting blocks
    time out: nothing else could have met them."""
    for resident in (True, False):
        ids = np.full(blocks, -7, np.int32)
        sums = np.full(blocks, -7, np.int32)
        unset = np.zeros(blocks, np.float32)
        sync = np.zeros(2, np.uint32)
        lib.launch("grid_meet_probe", (blocks, 1, 1), (64, 1, 1), 16,
                   [ids, sums, sync, unset, 50_000_000], resident=resident)
        total = blocks * (blocks + 1) // 2
        if resident or blocks == 1:
            assert sums.tolist() == [total * 1000 + b for b in range(blocks)]
        else:  # blocks run last first: each waits alone but block 0, whose arrival completes
            assert sums.tolist() == [total * 1000] + [-1] * (blocks - 1)
        assert np.isnan(unset).all()
        assert sync.tolist() == [0, 1]


def test_a_resident_launch_refuses_what_it_cannot_hold(lib, capfd):
    """A resident launch holds at most 16384 threads (a stack each), and refuses the
    dependent-launch guard, whose bytes are poisoned block by block."""
    ids, sums, unset = (np.zeros(64, t) for t in (np.int32, np.int32, np.float32))
    sync = np.zeros(2, np.uint32)
    args = [ids, sums, sync, unset, 1_000_000]
    assert lib.run("grid_meet_probe", (65, 1, 1), (256, 1, 1), 16, args, resident=True) == 1
    with simt.dependent_launch_guard([(ids.ctypes.data, ids.nbytes)]):
        assert lib.run("grid_meet_probe", (2, 1, 1), (32, 1, 1), 16, args, resident=True) == 1
    assert "resident launch holds at most 16384 threads" in capfd.readouterr().err


def test_the_transform_examples_hold():
    """The source rewrites simt/__init__.py shows in its docstring, as doctests."""
    import doctest

    result = doctest.testmod(simt, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_a_build_is_keyed_by_its_own_headers_only(tmp_path):
    """Editing a header changes the key (so the library is rebuilt) of the sources that include
    it, directly or through another header, and of no other source."""
    common = tmp_path / "cuda" / "common"
    common.mkdir(parents=True)
    (common / "a.cuh").write_text("#pragma once\nconstexpr int A = 1;\n")
    (common / "b.cuh").write_text('#pragma once\n#include "a.cuh"\n')
    (common / "c.cuh").write_text("#pragma once\nconstexpr int C = 3;\n")
    (common / "uses_b.cu").write_text('#include "b.cuh"\n')
    (common / "uses_c.cu").write_text('#include "c.cuh"\n')

    def keys():
        return {s: simt._inputs(f"cuda/common/{s}", ("X=1",), {"e": ("ptr",)}, tmp_path)[1]
                for s in ("uses_b.cu", "uses_c.cu")}

    before = keys()
    files, _ = simt._inputs("cuda/common/uses_b.cu", (), {}, tmp_path)
    assert set(files) == {"uses_b.cu", "a.cuh", "b.cuh"}  # the closure, not the folder
    (common / "a.cuh").write_text("#pragma once\nconstexpr int A = 2;\n")
    after = keys()
    assert after["uses_b.cu"] != before["uses_b.cu"]  # through b.cuh
    assert after["uses_c.cu"] == before["uses_c.cu"]
    assert simt._inputs("cuda/common/uses_c.cu", ("X=2",), {"e": ("ptr",)}, tmp_path)[1] \
        != after["uses_c.cu"]  # the defines are part of the key

// A host emulation of the CUDA execution model, enough for the kernels of kernels/cuda/common to
// run from their own source (tests/host/simt/__init__.py rewrites their shared memory and inline
// PTX into the calls below).
//
// A block's threads are fibers on the launching OS thread, each with its own stack, switched only
// at barriers, each warp run as far as it can before the next (METRALE_SIMT_SKEW); blocks run one
// after another, or, in a resident launch, all of them at once (every block's threads are fibers of
// the one launch, each block with its own shared memory), as the blocks of a persistent kernel must
// be for a grid-wide barrier to complete. There a read of %globaltimer, which a spin loop makes,
// also hands the OS thread on, and each block runs as far as it can before the next (the last block
// first), so a block that reads what another has not yet written, a grid barrier missing, reads it
// unwritten. Barriers: __syncthreads is one of the block's threads, the warp collectives (shuffles,
// votes, ldmatrix, mma.sync) one of the warp's 32, where each lane posts its operand, the warp
// meets, each lane reads what it needs, and the warp meets again before the slots are reused. A
// thread waiting at a barrier hands the OS thread on (to its warp's next thread, else the next
// warp's); the last to arrive goes on at once. A thread that returns drops out of both
// barriers, as an exited thread stops counting on the GPU. Threads that all wait at barriers none
// of them can complete (a __syncthreads some threads never reach) trap, where the GPU would hang.
// Shared memory, dynamic and static (a `__shared__` variable is the block's own), starts each block
// as 0xFF bytes (NaN for f32 and bf16). cp.async copies land only at the wait that completes their
// group, bulk copies (cp.async.bulk) at the first wait on their transaction barrier (TxBarrier),
// and a wait on a phase not yet complete hands the thread on, as a spin would. The MMA sums its 16
// products in double, adds the accumulator and rounds once to f32 (the hardware's order inside an
// MMA is its own). A wgmma (sm_90a) is a thread's own work here: it reads its operands from shared
// memory through their descriptors (the 128-byte swizzle applied; A of the register form from the
// warp's lanes, exchanged at the issue) and writes its accumulator registers only at the
// wgmma.wait_group that completes its group, so a kernel that reads the registers before that
// wait, or stores over a stage before it, sees it (a cp.async refill lands later still, so a
// stage refilled that way one wait early goes unseen). __trap stops the launch, which then
// reports it.
//
// Fibers rather than OS threads: a barrier is then a function call and a context switch, where an
// OS thread per CUDA thread made each one a futex wait and wake across the machine's cores (on two
// cores, more system time than kernel time).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <math.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <utility>
#include <vector>

// the CUDA keywords, as plain C++
#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __forceinline__
#define __forceinline__ inline
#undef __launch_bounds__
#define __launch_bounds__(...)
// how many more cp.async groups a wait leaves in flight than the kernel asks: the test of the
// emulation itself (a pipeline that waits one group short must read poison)
#ifndef METRALE_SIMT_WAIT_SLACK
#define METRALE_SIMT_WAIT_SLACK 0
#endif
// 1: wgmma reads its operands without the 128-byte swizzle (the test of the emulation itself: a
// kernel that stores its tiles swizzled must then fail)
#ifndef METRALE_SIMT_NO_SWIZZLE
#define METRALE_SIMT_NO_SWIZZLE 0
#endif

// 1: a bulk copy (cp.async.bulk) lands as it is issued rather than at the first wait on its
// barrier: the GPU may land it any time in between, and the two ends show different races (a
// read before the wait sees poison only when late; a slot refilled while another warp still reads
// it shows only when early)
#ifndef METRALE_SIMT_BULK_EAGER
#define METRALE_SIMT_BULK_EAGER 0
#endif

// 1 (the default): a block's warps run each as far as it can before the next, so a warp that
// overtakes the others (a producer refilling a stage they still read) shows; 0: all the block's
// threads a barrier at a time, in step
#ifndef METRALE_SIMT_SKEW
#define METRALE_SIMT_SKEW 1
#endif

// __CUDA_ARCH__ in the kernels' own sources (the transform renames it): the class emulated.
#define METRALE_SIMT_ARCH 900

namespace simt {

constexpr int MAX_THREADS = 1024;
constexpr int MAX_RESIDENT = 16384;  // threads of a resident launch: a stack and guard page each
constexpr int SMEM_BYTES = 228 * 1024;

// A barrier of `expected` threads: `arrived` of them wait in generation `gen`.
struct Barrier {
    int expected;
    int arrived = 0;
    unsigned gen = 0;
};

struct Warp {
    Barrier meet{32};
    uint64_t slot[32];
    uint32_t a[32][4], b[32][2];
};

// A transaction barrier (mbarrier) in shared memory and the bulk copies (cp.async.bulk) it
// counts: a copy lands when a thread's try_wait finds it pending (so a read of its bytes before
// the wait sees the poison), and a phase completes when its expected arrivals (init's count;
// arrive, or arrive.expect_tx, which also arms bytes) have come and the bytes landed are the
// bytes armed. A try_wait on a phase not yet complete hands the thread on (its loop spins), so
// a producer thread may arm the phase later; a wait nothing will complete is a deadlock, which
// traps, where the GPU would hang.
struct BulkCopy {
    size_t dst;
    const void* src;
    unsigned bytes;
    std::vector<unsigned char> early;  // issued before a guarded wait: the source then (Copy)
};
struct TxBarrier {
    unsigned expected = 1, arrived = 0, armed = 0, landed = 0, phases = 0;
    std::vector<BulkCopy> pending;
};

// A `__shared__` variable's bytes in one block, found by its declaration's tag (block_shared).
struct Static {
    const void* tag;
    std::unique_ptr<unsigned char[]> bytes;
};

struct Block {
    Barrier sync;
    Barrier dependency;     // griddepcontrol.wait while global bytes are guarded (simt_guard)
    bool released = false;  // the guarded bytes are the step's again
    std::vector<std::pair<size_t, TxBarrier>> tx;  // by shared address
    Warp warps[MAX_THREADS / 32];
    unsigned char* smem = nullptr;  // the dynamic shared memory
    uint3 idx{};                    // blockIdx
    std::vector<Static> statics;
    int vote = 0, voted = 0;  // __syncthreads_or: this round's votes, the last round's result
    explicit Block(int threads) : sync{threads}, dependency{threads} {}
};

// The dependent-launch guard (simt_guard): global bytes that the launches of a step write. A
// dependent launch may start while earlier launches of its step still run, so a kernel must not
// touch those bytes before its griddepcontrol.wait. While a guard is set, each block starts with
// them poisoned (0xFF, saved aside), the wait becomes a barrier of the block's threads (a thread
// that returned stops counting), and its completion checks that the poison is intact (else a
// write came before the wait: a trap) and puts the saved bytes back; a block whose threads all
// return without waiting gets them back as it ends. A read before the wait sees poison, so it
// shows as different output; a cp.async issued before it reads its source as it issues (the
// hardware may read it any time from then on), not at the wait that lands it.
struct Guarded {
    unsigned char* p;
    size_t n;
    std::vector<unsigned char> saved;
};
inline std::vector<Guarded> guarded;

struct Copy {
    size_t dst;  // shared-memory offset
    const void* src;
    int bytes;   // copied; the rest of the 16 is zeroed
    bool taken;  // issued before a guarded wait: the source bytes as they were then, in `early`
    unsigned char early[16];
};

struct Trap {};  // thrown by __trap, caught where the thread started

// A wgmma in flight: its accumulator registers, operand descriptors and whether it adds to them.
struct Wgmma {
    float* d[128];
    int n;          // the instruction's N (its d registers: n / 2)
    uint64_t a, b;  // shared-memory matrix descriptors of A (64 x 16) and B (n x 16)
    bool add;       // scale-d: d = a b + d, else d = a b
    bool b_n_major; // imm-trans-b: B's rows of 128 bytes run along N, not K
    bool a_regs;    // A from the warpgroup's registers: the warp's 16 rows, taken at the issue
    float a_rows[16][16];
};

inline int trapped;  // a thread of the launch trapped or faulted: every thread stops
inline unsigned long progress;  // arrivals at barriers and drops from them, so far
inline uint3 thread_idx, block_idx, block_dim, grid_dim;  // of the thread running now
inline Block* block;
inline std::vector<Copy> open_group;  // the running thread's cp.async groups (swapped per thread)
inline std::vector<std::vector<Copy>> committed;
inline std::vector<Wgmma> wgmma_open;  // the running thread's wgmma groups (swapped per thread)
inline std::vector<std::vector<Wgmma>> wgmma_committed;
inline unsigned dynamic_bytes;
inline bool resident;  // the launch runs all its blocks at once (simt_run)

inline unsigned char* dynamic_smem() { return block->smem; }
void yield();  // hands the OS thread back to the launch, which runs the block's next thread

// A barrier, after which a thread stops if another trapped (its operands may never come); the
// thread that completes it runs `done` first, if given.
inline void meet(Barrier& b, void (*done)() = nullptr) {
    const unsigned gen = b.gen;
    ++progress;
    if (++b.arrived == b.expected) {
        b.arrived = 0;
        ++b.gen;
        if (done) done();
    } else {
        while (b.gen == gen && !trapped) yield();
    }
    if (trapped) throw Trap{};
}
// A thread that returned stops counting: the others may now be complete (then `done` runs).
inline void drop(Barrier& b, void (*done)() = nullptr) {
    ++progress;
    if (--b.expected > 0 && b.arrived == b.expected) {
        b.arrived = 0;
        ++b.gen;
        if (done) done();
    }
}
void release_guarded();  // the guard's bytes checked and put back (simt.cpp)
// Whether the running block's guarded bytes are still poisoned: before its dependent-launch wait.
inline bool guarding() { return !guarded.empty() && !block->released; }
// griddepcontrol.wait under a guard: the block's threads meet, the last releases the bytes; a
// returning thread leaves that barrier as it leaves the others (fiber_main).
inline void dependency_wait() {
    if (guarding()) meet(block->dependency, release_guarded);
}
inline Warp& warp() { return block->warps[thread_idx.x / 32]; }
inline int lane() { return (int)thread_idx.x % 32; }

// A `__shared__` variable of type T (the transform writes each declaration as a call, with a
// tag unique to the declaration): the running block's own, 0xFF bytes until written.
template <class T>
inline T& block_shared(const void* tag) {
    for (Static& s : block->statics)
        if (s.tag == tag) return *reinterpret_cast<T*>(s.bytes.get());
    Static s{tag, std::make_unique<unsigned char[]>(sizeof(T))};
    std::memset(s.bytes.get(), 0xFF, sizeof(T));
    return *reinterpret_cast<T*>(block->statics.emplace_back(std::move(s)).bytes.get());
}

// A pointer argument that converts to any pointer type, as the driver passes it.
struct AnyPtr {
    void* p;
    template <class T>
    operator T*() const { return static_cast<T*>(p); }
};
template <class T>
inline T arg(void** a, int i) {
    T v;
    std::memcpy(&v, a[i], sizeof(T));
    return v;
}

// asm operands: outputs by reference (size and address), inputs as their bits.
struct Out {
    void* p;
    size_t size;
};
template <class T>
inline Out out(T& v) { return {&v, sizeof(T)}; }
template <class T>
inline uint64_t in(T v) {
    static_assert(sizeof(T) <= 8, "asm operands are at most 64 bits");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    return bits;
}
void asm_stmt(const char* tmpl, std::initializer_list<Out> outs,
              std::initializer_list<uint64_t> ins);

// The warp's exchange: every lane posts v, and reads lane src's.
template <class T>
inline T exchange(T v, int src) {
    Warp& w = warp();
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    w.slot[lane()] = bits;
    meet(w.meet);
    T r;
    const uint64_t got = w.slot[src];
    std::memcpy(&r, &got, sizeof(T));
    meet(w.meet);
    return r;
}

// The warp's fold: every lane posts v, and each folds f(acc, lane i's value, i) over the 32
// lanes in order from init (the votes and redux.sync's reductions).
template <class R, class F>
inline R warp_fold(uint64_t v, R init, F f) {
    Warp& w = warp();
    w.slot[lane()] = v;
    meet(w.meet);
    R r = init;
    for (int i = 0; i < 32; ++i) r = f(r, w.slot[i], i);
    meet(w.meet);
    return r;
}

}  // namespace simt

#undef threadIdx
#undef blockIdx
#undef blockDim
#undef gridDim
#define threadIdx (simt::thread_idx)
#define blockIdx (simt::block_idx)
#define blockDim (simt::block_dim)
#define gridDim (simt::grid_dim)

inline void __syncthreads() { simt::meet(simt::block->sync); }
// the block's barrier, returning whether any thread's pred was nonzero: the last thread to arrive
// publishes the round's votes and clears them before any thread goes on
inline int __syncthreads_or(int pred) {
    if (pred) simt::block->vote = 1;
    simt::meet(simt::block->sync, [] {
        simt::block->voted = simt::block->vote;
        simt::block->vote = 0;
    });
    return simt::block->voted;
}
inline void __syncwarp(unsigned = 0xffffffffu) { simt::meet(simt::warp().meet); }
[[noreturn]] inline void __trap() { throw simt::Trap{}; }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

template <class T>
inline T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
    const int l = simt::lane();
    return simt::exchange(v, (l ^ mask) < (l / width + 1) * width ? l ^ mask : l);
}
template <class T>
inline T __shfl_sync(unsigned, T v, int src, int width = 32) {
    return simt::exchange(v, simt::lane() / width * width + src % width);
}
inline int __any_sync(unsigned, int pred) {
    return simt::warp_fold(pred != 0, 0, [](int r, uint64_t x, int) { return r | (int)x; });
}
inline int __all_sync(unsigned, int pred) {
    return simt::warp_fold(pred != 0, 1, [](int r, uint64_t x, int) { return r & (int)x; });
}
inline unsigned __ballot_sync(unsigned, int pred) {
    return simt::warp_fold(pred != 0, 0u,
                           [](unsigned r, uint64_t x, int i) { return r | (unsigned)x << i; });
}
inline int __reduce_min_sync(unsigned, int v) {
    return simt::warp_fold((uint32_t)v, v,
                           [](int r, uint64_t x, int) { return std::min(r, (int)(uint32_t)x); });
}
inline int __reduce_max_sync(unsigned, int v) {
    return simt::warp_fold((uint32_t)v, v,
                           [](int r, uint64_t x, int) { return std::max(r, (int)(uint32_t)x); });
}

template <class T>
inline T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
template <class T>
inline T atomicExch(T* p, T v) { return std::atomic_ref<T>(*p).exchange(v); }
template <class T>
inline T __ldcg(const T* p) { return *p; }  // the L2-only load: one memory here
template <class T>
inline T __ldg(const T* p) { return *p; }  // the read-only path: one memory here

inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline int __popc(uint32_t v) { return __builtin_popcount(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
// byte n of the result is byte s[4n + 2 .. 4n] of the eight bytes y:x (x the low four)
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
    const uint64_t bytes = (uint64_t)y << 32 | x;
    uint32_t r = 0;
    for (int n = 0; n < 4; ++n) {
        const int pick = (s >> (4 * n)) & 7;
        r |= (uint32_t)(bytes >> (8 * pick) & 0xff) << (8 * n);
    }
    return r;
}
inline size_t __cvta_generic_to_shared(const void* p) {
    return (size_t)((const unsigned char*)p - simt::dynamic_smem());
}
using std::max;
using std::min;

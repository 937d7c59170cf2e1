// Metrale CUDA, sm_90a: the warpgroup MMA's (wgmma) shared-memory descriptors and its
// synchronization, shared by every sm_90 source that issues wgmmas (the GEMMs, the prefill
// attention). Each source spells its own m64nNk16 instructions, whose register lists differ.
//
// Operands lie in shared memory as wgmma's 128-byte swizzle wants: rows of 128 bytes, 16-byte
// piece p of row r at piece p ^ (r % 8), 8-row groups of 1024 bytes, 1024-byte aligned.
#pragma once
#include <cstdint>

// The descriptor of a 128-byte-swizzled operand at shared address `at`, its 8-row groups 1024
// bytes apart; `leading` the leading byte offset: unused by a K-major operand (1, by
// convention), for an N-major one the distance between its 64-column chunks.
__device__ __forceinline__ uint64_t swizzled_desc(uint32_t at, uint32_t leading) {
    return (uint64_t)((at & 0x3FFFF) >> 4) | (uint64_t)(leading >> 4) << 16 |
           (uint64_t)(1024 >> 4) << 32 | (uint64_t)1 << 62;
}

// A K-major operand at `at` (1024-byte aligned, plus 32 bytes a k step of 16).
__device__ __forceinline__ uint64_t operand_desc(uint32_t at) { return swizzled_desc(at, 16); }

// The descriptor of the operand `bytes` further on: its address field, in 16-byte units, is the
// low 14 bits, and shared memory (under 256 KiB) never carries out of them.
__host__ __device__ constexpr uint64_t desc_step(uint32_t bytes) { return bytes >> 4; }

// Orders the registers' accesses before the wgmmas that read or write them.
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
// The wgmmas issued since the last commit, one group.
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
// Until at most N committed groups are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Generic-proxy writes to shared memory (cp.async's, the threads' stores) made visible to the
// wgmmas (the async proxy) that read them.
__device__ __forceinline__ void fence_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

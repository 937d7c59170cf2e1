// Metrale CUDA, sm_90a: the Tensor Memory Accelerator and the barriers that count its copies.
//
// A TensorMap is the 128-byte description of a row-major array a launch passes by value
// (KERNELS.toml's `tmap(C,R)` argument: runtime.backend.TensorMap, encoded on the device by
// cuTensorMapEncodeTiled): tma_load copies one box of it, C columns of 128 bytes by R rows, into
// shared memory with the 128-byte swizzle (16-byte piece p of box row r at piece p ^ (r % 8) of
// its 1024-byte aligned destination), rows and columns outside the array as zeros, and counts
// the bytes on a transaction barrier (mbarrier). A barrier's phase completes when its expected
// arrivals have come and the bytes armed on it (bar_expect) have landed; waits name the phase
// by its parity, as its uses alternate 0, 1, 0, ...
#pragma once
#include "mma.cuh"  // smem_addr

struct alignas(64) TensorMap {
    unsigned char bytes[128];
};

// A barrier whose phases complete after `count` arrivals (and the bytes armed on them).
__device__ __forceinline__ void bar_init(uint64_t* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count)
                 : "memory");
}

__device__ __forceinline__ void bar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// One arrival that also arms the phase for `bytes` of copies.
__device__ __forceinline__ void bar_expect(uint64_t* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

// Wait until the phase of `parity` completes.
__device__ __forceinline__ void bar_wait(uint64_t* bar, unsigned parity) {
    unsigned done = 0;
    while (!done)
        asm volatile("{\n\t.reg .pred p;\n\t"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
}

// The box of `map` at column c0, row c1 into `dst` (1024-byte aligned), counted on `bar`.
__device__ __forceinline__ void tma_load(void* dst, const TensorMap& map, int c0, int c1,
                                         uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];"
        ::"r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(&map)), "r"(c0), "r"(c1),
          "r"(smem_addr(bar)) : "memory");
}

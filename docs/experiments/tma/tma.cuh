// Metrale CUDA, experiment: what the TMA kernels of this folder share: bulk copies
// (cp.async.bulk, the Tensor Memory Accelerator) into shared memory, counted on transaction
// barriers (mbarrier) with arrival counts and phase parities.
#pragma once
#include "metrale.cuh"
#include "mma.cuh"  // smem_addr

// A barrier whose phases complete after `count` arrivals (and the bytes armed on it).
__device__ __forceinline__ void tx_init(uint64_t* bar, unsigned count = 1) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count)
                 : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One arrival that also arms the barrier's phase for `bytes` of copies.
__device__ __forceinline__ void tx_expect(uint64_t* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

// One arrival.
__device__ __forceinline__ void tx_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) global -> shared, counted on `bar`.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes,
                                          uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

// Wait until the barrier's phase of `parity` completes (its uses alternate 0, 1, 0, ...).
__device__ __forceinline__ void tx_wait(uint64_t* bar, unsigned parity = 0) {
    unsigned done = 0;
    while (!done)
        asm volatile("{\n\t.reg .pred p;\n\t"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
}

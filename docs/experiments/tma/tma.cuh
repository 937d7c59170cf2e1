// Metrale CUDA, experiment: what the TMA kernels of this folder share. Bulk copies
// (cp.async.bulk, the Tensor Memory Accelerator) into shared memory counted on transaction
// barriers (mbarrier), a grid-wide barrier for blocks that are all resident at once (one per
// multiprocessor: the caller's grid must not exceed them), the split of columns over blocks, and
// the L2 prefetch of the next launch's weights.
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

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Every block of the grid meets here (sense by generation): sync[0] counts arrivals, sync[1] is
// the generation. The last to arrive zeroes the count, then advances the generation; the others
// wait for it to move. The writes before are visible to every block after (fences around). A
// block that waits past a second traps: a block never came, and a hang would be the GPU's.
__device__ __forceinline__ void grid_meet(unsigned* sync) {
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
            const unsigned long long t0 = global_ns();
            while (*gen == g)
                if (global_ns() - t0 > 1000000000ull) __trap();
        }
        __threadfence();
    }
    __syncthreads();
}

// The share of n items (columns, rows) that block b of G takes: [first, first + count).
struct Share {
    int first, count;
    __device__ Share(int n, int b, int G)
        : first((int)((long)b * n / G)), count((int)((long)(b + 1) * n / G) - first) {}
};

// Block b of G asks L2 for its share of `bytes` at p (both multiples of 16), in pieces of 16 KiB
// spread over the block's threads (cp.async.bulk.prefetch: no register, no shared memory, no
// wait): the next launch's weights, which its own bulk copies then find in L2. Nothing if p is
// null.
__device__ __forceinline__ void l2_prefetch_share(const unsigned char* p, long long bytes, int b,
                                                  int G) {
    if (!p || bytes <= 0) return;
    const long long lo = bytes * b / G / 16 * 16, hi = bytes * (b + 1) / G / 16 * 16;
    for (long long at = lo + 16384LL * threadIdx.x; at < hi; at += 16384LL * blockDim.x)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;"
                     ::"l"(p + at), "r"((unsigned)min(16384LL, hi - at)) : "memory");
}

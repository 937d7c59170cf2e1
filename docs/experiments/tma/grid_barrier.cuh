// Metrale CUDA, experiment: a grid-wide barrier for kernels whose blocks are all resident at
// once (the caller's grid must fit the multiprocessors at the kernel's registers and shared
// memory, or the barrier waits for blocks that cannot start), and the split of items over them.
#pragma once
#include "metrale.cuh"

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Every block of the grid (all three dimensions) meets here, sense by generation: sync[0] counts
// arrivals, sync[1] is the generation. The last to arrive zeroes the count, then advances the
// generation; the others wait for it to move. The writes before are visible to every block after
// (fences around). A block that waits past a second traps: a block never came, and a hang would
// be the GPU's.
__device__ __forceinline__ void grid_meet(unsigned* sync) {
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile unsigned* gen = sync + 1;
        const unsigned g = *gen;
        __threadfence();
        if (atomicAdd(sync, 1u) == gridDim.x * gridDim.y * gridDim.z - 1) {
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

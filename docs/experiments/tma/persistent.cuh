// Metrale CUDA, experiment: what the persistent halves of this folder (attn_tma.cu, mlp_tma.cu)
// share beside the grid barrier: the launch's opening (its bulk copies, the dependent-launch
// wait, the row normalized), dots over staged weight rows, reads of other blocks' writes, and the
// L2 prefetch of the next launch's weights. Include after norm.cu.
#pragma once
#include "gemv.cuh"
#include "grid_barrier.cuh"
#include "phase.cuh"
#include "tma.cuh"

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

// Warp w of the block takes rows w, w + warps, ... of `count` staged rows of N weights (tiles[j]:
// weight j's rows, k bf16 columns each, in shared memory) and dots them with x by warp_dots,
// gemv.cu's own code, so gemv.cu's bytes; lane 0 hands (row, the N dots) to store.
template <int N, class Store>
__device__ __forceinline__ void staged_dots(const act_t* x, const __nv_bfloat16* const (&tiles)[N],
                                            int k, int count, Store store) {
    WeightRef base[N];
#pragma unroll
    for (int j = 0; j < N; ++j) base[j] = weight_ref(tiles[j], nullptr, nullptr);
    for (int c = threadIdx.x >> 5; c < count; c += blockDim.x >> 5) {
        WeightRef w[N];
#pragma unroll
        for (int j = 0; j < N; ++j) w[j] = weight_rows(base[j], c, k);
        float dot[N];
        warp_dots<N>(x, w, k, dot);
        if ((threadIdx.x & 31) == 0) store(c, dot);
    }
}

// n activations (a multiple of 8) that other blocks wrote, read from L2 (ld.cg: not this
// multiprocessor's L1) into shared memory by the block's threads.
__device__ __forceinline__ void shared_from_l2(act_t* dst, const act_t* src, int n) {
    for (int i = threadIdx.x * 8; i < n; i += blockDim.x * 8)
        *(uint4*)(dst + i) = __ldcg((const uint4*)(src + i));
}

// A persistent half's opening: thread 0's `stage` (its bulk copies) before the dependent-launch
// wait, or after it with TMA_COPY_LATE (what staging early is worth); then every block normalizes
// the row itself (norm.cu's row_norm: add_rmsnorm's bytes) into y, block 0 storing s = x + r and
// the others their own copy in s_own. Phase marks 1 (copies issued) and 2 (after the wait).
template <class Stage>
__device__ __forceinline__ void stage_wait_norm(Stage stage, const act_t* x, const act_t* r,
                                                const __nv_bfloat16* wn, act_t* s, act_t* s_own,
                                                act_t* y, int hidden, float eps) {
#if !defined(TMA_COPY_LATE)
    stage();
#endif
    phase_mark(1);
    grid_dependency_sync();
    phase_mark(2);
#if defined(TMA_COPY_LATE)
    stage();
#endif
    __syncthreads();  // the barriers are initialized before anyone waits on them
    row_norm<true>(x, r, wn, blockIdx.x == 0 ? s : s_own, y, hidden, eps);
    __syncthreads();  // y is whole
}

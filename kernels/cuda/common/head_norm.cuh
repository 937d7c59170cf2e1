// Metrale CUDA: the per-head RMS norm (qk_norm), shared by norm.cu and decode attention.
//
// One warp normalizes one head: the sum of squares in f32 over head_dim in blocks of H_BLOCK,
// lane l adding elements l, l + 32, ... of a block and the lanes meeting in the butterfly tree,
// the block partials combined sequentially; then inv = 1 / sqrt(ss / d + eps) and
// y = round(round(x * inv) * w), as metrale.lkb.semantics.rms_normalize.
#pragma once
#include "metrale.cuh"

#ifndef H_BLOCK
#error "define H_BLOCK"
#endif

// Sum of squares of n f32 values produced by `get`, in the declared order, over one warp.
template <class Get>
__device__ __forceinline__ float warp_sumsq(Get get, int n) {
    const int lane = threadIdx.x & 31;
    float acc = 0.0f;
    for (int b0 = 0; b0 < n; b0 += H_BLOCK) {
        const int b1 = min(b0 + H_BLOCK, n);
        float s = 0.0f;
        for (int i = b0 + lane; i < b1; i += 32) {
            const float v = get(i);
            s += v * v;
        }
        const float p = warp_sum(s);
        acc = b0 == 0 ? p : acc + p;
    }
    return acc;
}

__device__ __forceinline__ float rms_inv(float ss, int n, float eps) {
    return 1.0f / sqrtf(ss / (float)n + eps);
}

// Normalize one head of d values into f32 `out` (shared memory), rounded to act; a whole warp.
__device__ __forceinline__ void head_norm(const act_t* x, const __nv_bfloat16* w, int d,
                                          float eps, float* out) {
    const float ss = warp_sumsq([&](int i) { return act_load(x[i]); }, d);
    const float inv = rms_inv(ss, d, eps);
    for (int i = threadIdx.x & 31; i < d; i += 32)
        out[i] = act_round(act_round(act_load(x[i]) * inv) * bf16_load(w, i));
}

// Metrale CUDA: the one dot product every matmul-like kernel reduces through.
//
// Order (declared in KERNELS.toml): k in blocks of K_BLOCK, the last possibly shorter; inside a
// block lane l multiplies-and-adds (fma, f32) the 8-wide chunks l, l+32, ... left to right, then
// the 32 lane sums meet in a butterfly tree; the block partials combine as ACROSS_* says. The
// result depends only on the x row and the weight row: row-invariant.
#pragma once
#include "metrale.cuh"

#ifndef METRALE_HAS_WEIGHT
#error "define one of WEIGHT_BF16, WEIGHT_F32, WEIGHT_FP8, WEIGHT_MXFP4, WEIGHT_NVFP4"
#endif
#ifndef K_BLOCK
#error "define K_BLOCK"
#endif
static_assert(K_BLOCK % 8 == 0, "K_BLOCK must be a multiple of 8 (one 16-byte chunk per lane)");


// x · w for one x row (k activations) and one weight row, by one full warp; every lane gets it.
// `vec` is true when k is a multiple of 8 so that rows stay 16-byte aligned for vector loads.
__device__ __forceinline__ float warp_dot(const act_t* x, WeightRef w, int k) {
    const int lane = threadIdx.x & 31;
    const bool vec = (k & 7) == 0;
    Combine acc;
    if (vec && K_BLOCK == 256) {
        // One chunk per lane per block: issue the loads of PREFETCH blocks before any of their
        // arithmetic, so that many bytes are in flight; the sums are the loop's below, in order.
        constexpr int PREFETCH = 4;
        const int nkb = (k + K_BLOCK - 1) / K_BLOCK;
        for (int b = 0; b < nkb; b += PREFETCH) {
            float wv[PREFETCH][8], xv[PREFETCH][8];
#pragma unroll
            for (int u = 0; u < PREFETCH; ++u) {
                const int c = (b + u) * K_BLOCK + lane * 8;
                if (b + u < nkb && c < k) {
                    weight8(w, c, wv[u]);
                    act8(x, c, xv[u]);
                }
            }
#pragma unroll
            for (int u = 0; u < PREFETCH; ++u) {
                if (b + u >= nkb) break;
                const int c = (b + u) * K_BLOCK + lane * 8;
                float s = 0.0f;
                if (c < k) {
#pragma unroll
                    for (int i = 0; i < 8; ++i) s = fmaf(xv[u][i], wv[u][i], s);
                }
                acc.add(warp_sum(s));
            }
        }
        return acc.result();
    }
    for (int b0 = 0; b0 < k; b0 += K_BLOCK) {
        const int b1 = min(b0 + K_BLOCK, k);
        float s = 0.0f;
        for (int c = b0 + lane * 8; c < b1; c += 32 * 8) {
            if (vec) {
                float xv[8], wv[8];
                act8(x, c, xv);
                weight8(w, c, wv);
#pragma unroll
                for (int i = 0; i < 8; ++i) s = fmaf(xv[i], wv[i], s);
            } else {
                for (int i = c; i < min(c + 8, b1); ++i) s = fmaf(act_load(x[i]), weight1(w, i), s);
            }
        }
        acc.add(warp_sum(s));
    }
    return acc.result();
}

__device__ __forceinline__ WeightRef weight_ref(const void* data, const void* scale,
                                                const float* global) {
    WeightRef w;
    w.data = data;
    w.scale = scale;
    w.global = global;
    return w;
}

// silu(g) * u as the reference rounds it: silu output rounded to act, the product rounded.
__device__ __forceinline__ float silu_mul(float g, float u) {
    float s = act_round(g / (1.0f + expf(-g)));
    return act_round(s * u);
}

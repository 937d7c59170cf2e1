// Metrale CUDA: the one dot product every matmul-like kernel reduces through.
//
// Order (declared in KERNELS.toml): k in blocks of K_BLOCK, the last possibly shorter; inside a
// block lane l multiplies-and-adds (fma, f32) the 8-wide chunks l, l+32, ... left to right, then
// the 32 lane sums meet in a butterfly tree; the block partials combine as ACROSS_* says. The
// result depends only on the x row and the weight row: row-invariant. warp_dots_rows serves
// several x rows, each through warp_dots.
#pragma once
#include "metrale.cuh"

#ifndef METRALE_HAS_WEIGHT
#error "define one of WEIGHT_BF16, WEIGHT_F32, WEIGHT_FP8, WEIGHT_MXFP4, WEIGHT_NVFP4"
#endif
#ifndef K_BLOCK
#error "define K_BLOCK"
#endif
static_assert(K_BLOCK % 8 == 0, "K_BLOCK must be a multiple of 8 (one 16-byte chunk per lane)");


// k-blocks whose loads one lane issues before their arithmetic (a define overrides it). With
// bf16 activations four, which fits the eight blocks per SM gemv.cu asks for; more registers per
// warp (8 for bf16 weights, 16 for fp8 and fp4, at three to five blocks per SM) measured slower
// at batch 1 on the H200 (gemv.cu has the figures). f32 activations (tests): 8.
#if defined(DOT_AHEAD)
#elif defined(ACT_BF16)
#define DOT_AHEAD 4
#else
#define DOT_AHEAD 8
#endif

// x · w[j] for one x row (k activations) and N weight rows, by one full warp; every lane gets
// them. Each dot's order is warp_dot's whatever N is (the x chunk is shared, not the sums).
// `vec` is true when k is a multiple of 8 so that rows stay 16-byte aligned for vector loads.
template <int N>
__device__ __forceinline__ void warp_dots(const act_t* x, const WeightRef (&w)[N], int k,
                                          float (&out)[N]) {
    const int lane = threadIdx.x & 31;
    const bool vec = (k & 7) == 0;
    Combine acc[N];
    if (vec && K_BLOCK == 256) {
        // One chunk per lane per block: the loads of AHEAD blocks (raw) before any of their
        // arithmetic, so that many bytes are in flight; the sums are the loop's below, in order.
        constexpr int AHEAD = DOT_AHEAD / N > 2 ? DOT_AHEAD / N : 2;
        const int nkb = (k + K_BLOCK - 1) / K_BLOCK;
        for (int b = 0; b < nkb; b += AHEAD) {
            WeightRaw8 wr[N][AHEAD];
            act8_raw xr[AHEAD];
#pragma unroll
            for (int u = 0; u < AHEAD; ++u) {
                const int c = (b + u) * K_BLOCK + lane * 8;
                if (b + u < nkb && c < k) {
#pragma unroll
                    for (int j = 0; j < N; ++j) wr[j][u] = weight8_load(w[j], c);
                    xr[u] = act8_load(x, c);
                }
            }
#pragma unroll
            for (int u = 0; u < AHEAD; ++u) {
                if (b + u >= nkb) break;
                const int c = (b + u) * K_BLOCK + lane * 8;
                float xv[8];
                if (c < k) act8_unpack(xr[u], xv);
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    float s = 0.0f;
                    if (c < k) {
                        float wv[8];
                        weight8_unpack(w[j], wr[j][u], wv);
#pragma unroll
                        for (int i = 0; i < 8; ++i) s = fmaf(xv[i], wv[i], s);
                    }
                    acc[j].add(warp_sum(s));
                }
            }
        }
    } else {
        for (int b0 = 0; b0 < k; b0 += K_BLOCK) {
            const int b1 = min(b0 + K_BLOCK, k);
#pragma unroll
            for (int j = 0; j < N; ++j) {
                float s = 0.0f;
                for (int c = b0 + lane * 8; c < b1; c += 32 * 8) {
                    if (vec) {
                        float xv[8], wv[8];
                        act8(x, c, xv);
                        weight8(w[j], c, wv);
#pragma unroll
                        for (int i = 0; i < 8; ++i) s = fmaf(xv[i], wv[i], s);
                    } else {
                        for (int i = c; i < min(c + 8, b1); ++i)
                            s = fmaf(act_load(x[i]), weight1(w[j], i), s);
                    }
                }
                acc[j].add(warp_sum(s));
            }
        }
    }
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = acc[j].result();
}

// x · w[j] for nrows (1 to R) consecutive x rows and N weight rows, by one full warp: the rows
// one after another through warp_dots, so each row's bytes are the one-row launch's by
// construction; lane r gets row r's dots in out. Rows after the first re-read the warp's weight
// rows from cache (L1 or L2), so HBM streams each weight once per launch. The rows are a run-time
// loop on purpose: a variant that unrolled them over the shared weight chunks (one load, eight
// rows' FMAs) grew these kernels' machine code 3-4x, and on the H200 a decode step pays for
// kernel code it has to fetch again in every layer.
template <int N, int R>
__device__ __forceinline__ void warp_dots_rows(const act_t* x, int nrows, const WeightRef (&w)[N],
                                               int k, float (&out)[N]) {
    const int lane = threadIdx.x & 31;
#pragma unroll 1
    for (int r = 0; r < min(nrows, R); ++r) {
        float o[N];
        warp_dots<N>(x + (long)r * k, w, k, o);
#pragma unroll
        for (int j = 0; j < N; ++j)
            if (lane == r) out[j] = o[j];
    }
}

__device__ __forceinline__ float warp_dot(const act_t* x, WeightRef w, int k) {
    const WeightRef ws[1] = {w};
    float out[1];
    warp_dots<1>(x, ws, k, out);
    return out[0];
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

// Metrale CUDA: the one dot product every matmul-like kernel reduces through.
//
// Order (declared in KERNELS.toml): k in blocks of K_BLOCK, the last possibly shorter; inside a
// block lane l multiplies-and-adds (fma, f32) the 8-wide chunks l, l+32, ... left to right, then
// the 32 lane sums meet in a butterfly tree; the block partials combine as ACROSS_* says. The
// result depends only on the x row and the weight row: row-invariant. warp_dots_rows serves
// several x rows with one load of each weight chunk and keeps that order for every row.
#pragma once
#include "metrale.cuh"

#ifndef METRALE_HAS_WEIGHT
#error "define one of WEIGHT_BF16, WEIGHT_F32, WEIGHT_FP8, WEIGHT_MXFP4, WEIGHT_NVFP4"
#endif
#ifndef K_BLOCK
#error "define K_BLOCK"
#endif
static_assert(K_BLOCK % 8 == 0, "K_BLOCK must be a multiple of 8 (one 16-byte chunk per lane)");


#if defined(WEIGHT_MXFP4) || defined(WEIGHT_NVFP4) || defined(WEIGHT_FP8)
#define DOT_AHEAD 16  // k-blocks whose loads one lane issues before their arithmetic
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

// The M warp sums of v[0..M) at once (M a power of two, at most 32), each warp_sum's bit for bit:
// the same tree, every add own + partner's as there. At offset o a lane keeps half of its values
// (the upper half where its bit o is set) and hands the other half to lane ^ o, which keeps
// those: M - 1 + 5 - log2(M) shuffles instead of 5 M. Value m ends in lanes m * (32 / M) and up.
template <int M>
__device__ __forceinline__ float warp_sums_spread(float (&v)[M]) {
    static_assert(M >= 1 && M <= 32 && (M & (M - 1)) == 0, "M must be a power of two <= 32");
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int level = 0; level < 5; ++level) {
        const int o = 16 >> level;
        const int h = M >> (level + 1);  // values kept; 0 once one is left
        if (h == 0) {
            v[0] = v[0] + __shfl_xor_sync(0xffffffffu, v[0], o);
            continue;
        }
        const bool upper = lane & o;
#pragma unroll
        for (int i = 0; i < (M > 1 ? M / 2 : 1); ++i) {  // a constant count, so that it unrolls
            if (i >= h) break;
            const float lo = v[i], hi = v[i + h];
            const float keep = upper ? hi : lo, give = upper ? lo : hi;
            v[i] = keep + __shfl_xor_sync(0xffffffffu, give, o);
        }
    }
    return v[0];
}

// x · w[j] for nrows (1 to R) consecutive x rows of k activations and N weight rows, by one full
// warp: lane r gets row r's dots in out, each in warp_dot's order, so a row's bytes do not depend
// on the rows beside it. One row takes warp_dots itself (its x loads AHEAD deep too). More rows
// share the weight loads: each weight chunk is loaded (AHEAD blocks in flight, as warp_dots) and
// dequantized once, then met by every row's x chunk, loaded when needed (the x rows are few and
// stay in cache; the weights stream from memory). A block's R * N lane sums reduce together
// through warp_sums_spread, so a lane keeps one Combine, that of value m = lane / (32 / M):
// row m / N, weight row m % N. Rows past nrows load and add nothing.
template <int N, int R>
__device__ __forceinline__ void warp_dots_rows(const act_t* x, int nrows, const WeightRef (&w)[N],
                                               int k, float (&out)[N]) {
    constexpr int M = R * N;
    static_assert(M <= 32 && (M & (M - 1)) == 0, "R * N must be a power of two <= 32");
    const int lane = threadIdx.x & 31;
    const bool vec = (k & 7) == 0;
    Combine acc;
    if (vec && K_BLOCK == 256) {
        if (nrows == 1) {
            warp_dots<N>(x, w, k, out);
            return;
        }
        constexpr int AHEAD = DOT_AHEAD / N > 2 ? DOT_AHEAD / N : 2;
        const int nkb = (k + K_BLOCK - 1) / K_BLOCK;
        for (int b = 0; b < nkb; b += AHEAD) {
            WeightRaw8 wr[N][AHEAD];
#pragma unroll
            for (int u = 0; u < AHEAD; ++u) {
                const int c = (b + u) * K_BLOCK + lane * 8;
                if (b + u < nkb && c < k) {
#pragma unroll
                    for (int j = 0; j < N; ++j) wr[j][u] = weight8_load(w[j], c);
                }
            }
#pragma unroll
            for (int u = 0; u < AHEAD; ++u) {
                if (b + u >= nkb) break;
                const int c = (b + u) * K_BLOCK + lane * 8;
                float s[M];
#pragma unroll
                for (int m = 0; m < M; ++m) s[m] = 0.0f;
                if (c < k) {
                    float wv[N][8];
#pragma unroll
                    for (int j = 0; j < N; ++j) weight8_unpack(w[j], wr[j][u], wv[j]);
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        if (r >= nrows) break;
                        float xv[8];
                        act8(x + (long)r * k, c, xv);
#pragma unroll
                        for (int j = 0; j < N; ++j)
#pragma unroll
                            for (int i = 0; i < 8; ++i)
                                s[r * N + j] = fmaf(xv[i], wv[j][i], s[r * N + j]);
                    }
                }
                acc.add(warp_sums_spread<M>(s));
            }
        }
    } else {
        // warp_dots' plain order, the weights loaded once for all rows. One row comes here too:
        // a second plain loop in the kernel made ptxas spill in the one-row vector path.
        for (int b0 = 0; b0 < k; b0 += K_BLOCK) {
            const int b1 = min(b0 + K_BLOCK, k);
            float s[M];
#pragma unroll
            for (int m = 0; m < M; ++m) s[m] = 0.0f;
            for (int c = b0 + lane * 8; c < b1; c += 32 * 8) {
                if (vec) {
                    float wv[N][8];
#pragma unroll
                    for (int j = 0; j < N; ++j) weight8(w[j], c, wv[j]);
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        if (r >= nrows) break;
                        float xv[8];
                        act8(x + (long)r * k, c, xv);
#pragma unroll
                        for (int j = 0; j < N; ++j)
#pragma unroll
                            for (int i = 0; i < 8; ++i)
                                s[r * N + j] = fmaf(xv[i], wv[j][i], s[r * N + j]);
                    }
                } else {
                    for (int i = c; i < min(c + 8, b1); ++i) {
                        float wi[N];
#pragma unroll
                        for (int j = 0; j < N; ++j) wi[j] = weight1(w[j], i);
#pragma unroll
                        for (int r = 0; r < R; ++r) {
                            if (r >= nrows) break;
                            const float xi = act_load(x[(long)r * k + i]);
#pragma unroll
                            for (int j = 0; j < N; ++j)
                                s[r * N + j] = fmaf(xi, wi[j], s[r * N + j]);
                        }
                    }
                }
            }
            acc.add(warp_sums_spread<M>(s));
        }
    }
    const float mine = acc.result();
#pragma unroll
    for (int j = 0; j < N; ++j)
        out[j] = __shfl_sync(0xffffffffu, mine, ((lane % R) * N + j) * (32 / M));
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

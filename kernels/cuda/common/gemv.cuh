// Metrale CUDA: the one dot product every matmul-like kernel reduces through.
//
// Order (declared in KERNELS.toml): k in blocks of K_BLOCK, the last possibly shorter; inside a
// block, chunk sum l multiplies-and-adds (fma, f32) the 8-wide chunks l, l+32, ... left to right,
// then the 32 chunk sums meet in a butterfly tree; the block partials combine as ACROSS_* says. The
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


// Weight loads (of DOT_CHUNKS chunks each, metrale.cuh) one lane keeps in flight, over all of a
// warp's N rows (a define overrides it). With bf16 activations four: 2 KiB of weights per warp,
// which fits the eight blocks per SM gemv.cu asks for; deeper settings at fewer blocks per SM
// measured slower at batch 1 on the H200 (gemv.cu has version 8's figures; version 11's sweep:
// fp8 at six loads and six blocks, Llama-3.1-8B down_proj 23.9 -> 33.0 us). fp4 in four-chunk
// loads: three (1.5 KiB), as four measured slower for mxfp4 (down_proj 26.0 -> 26.7 us, qkv
// 14.1 -> 14.7). f32 activations (tests): 8.
// DOT_RING 1: a slot's next load is issued as soon as its arithmetic has read it; 0: a warp
// issues its next AHEAD loads after the arithmetic of all those before. The variant sweep on the
// H200 (batch 1, Llama-3.1-8B) measured the ring faster for bf16 (down_proj 30.8 -> 30.0 us,
// o_proj 11.0 -> 10.7) and fp8 (down_proj 27.5 -> 23.9), and slower for mxfp4, whose arithmetic
// rather than its loads bounds it (gate_up 42.1 -> 44.7; the layer's four GEMVs 92.3 -> 94.1).
// nvfp4 keeps the ring: without it gate_up_swiglu spills past 64 registers.
#if defined(DOT_RING)
#elif defined(WEIGHT_MXFP4) && DOT_CHUNKS == 4
#define DOT_RING 0
#else
#define DOT_RING 1
#endif
#if defined(DOT_AHEAD)
#elif defined(ACT_BF16) && (defined(WEIGHT_MXFP4) || defined(WEIGHT_NVFP4)) && DOT_CHUNKS == 4
#define DOT_AHEAD 3
#elif defined(ACT_BF16)
#define DOT_AHEAD 4
#else
#define DOT_AHEAD 8
#endif

// x · w[j] for one x row (k activations) and N weight rows, by one full warp; every lane gets
// them. Each dot's order is warp_dot's whatever N is (the x chunk is shared, not the sums).
//
// A k-block's 32 chunks meet in one butterfly tree whatever DOT_CHUNKS (C) is: with C chunks
// per load, lane l holds chunks C (l % (32 / C)) + i of block l / (32 / C) in slots i, so the
// tree's first levels (chunk bits 4 and down) are shuffles across the 32 / C lanes of a block
// and its last levels (the chunk's low bits) add slots, pairing the same sums as C = 1 does.
// The bytes are therefore the same for every C, which the dequant_linear relation checks on
// the device (f32 weights take one chunk per load).
//
// warp_dots_part gives the k-block partials themselves: those of the warp's share of the loads,
// loads first, first + step, ... (a load is C k-blocks; the general path's are single blocks),
// each handed to sink(j, block, partial) with every lane holding it, in block order. A block's
// partial does not depend on which warp makes it, so warps that split a row's loads and a
// Combine over all their partials in block order give warp_dots' bytes (gemv.cu's k split).
template <int N, class Sink>
__device__ __forceinline__ void warp_dots_part(const act_t* x, const WeightRef (&w)[N], int k,
                                               int first, int step, Sink sink) {
    constexpr int C = DOT_CHUNKS, LANES = 32 / C;  // chunks per load; lanes per k-block
    const int lane = threadIdx.x & 31;
    const bool vec = (k & 7) == 0;  // rows 16-byte aligned for the vector loads below
    if (K_BLOCK == 256 && k % (8 * C) == 0) {
        // AHEAD loads of C k-blocks (raw) in flight per weight row: each slot's next load is
        // issued as soon as its arithmetic has read it (DOT_RING), so that the bytes in flight
        // never drain while the warp computes; the sums are the loop's below, in order. With one
        // chunk per load the activations ride along (16 bytes); with more, they come from L1
        // when used.
        constexpr int AHEAD = DOT_AHEAD / N > 2 ? DOT_AHEAD / N : 2;
        const int nkb = (k + K_BLOCK - 1) / K_BLOCK;  // blocks
        const int ng = ((nkb + C - 1) / C - first + step - 1) / step;  // this warp's loads
        const int at = lane * 8 * C;  // this lane's first column in a load's C k-blocks
        WeightChunks<C> wr[N][AHEAD];
        act8_raw xr[AHEAD];
        auto load = [&](int u, int g) {  // the warp's load g of every row into slot u
            const int c = (first + g * step) * C * K_BLOCK + at;
            if (g < ng && c < k) {  // c < k implies g < ng; ptxas makes bf16 shorter with both
#pragma unroll
                for (int j = 0; j < N; ++j) wr[j][u] = weight_chunks_load<C>(w[j], c);
                if constexpr (C == 1) xr[u] = act8_load(x, c);
            }
        };
        if (DOT_RING)
#pragma unroll
            for (int u = 0; u < AHEAD; ++u) load(u, u);
        for (int g0 = 0; g0 < ng; g0 += AHEAD) {
            if (!DOT_RING)
#pragma unroll
                for (int u = 0; u < AHEAD; ++u) load(u, g0 + u);
#pragma unroll
            for (int u = 0; u < AHEAD; ++u) {
                const int b0 = (first + (g0 + u) * step) * C;  // the first k-block of this load
                if (b0 >= nkb) break;
                const int c = b0 * K_BLOCK + at;
                float s[N][C];
#pragma unroll
                for (int j = 0; j < N; ++j)
#pragma unroll
                    for (int i = 0; i < C; ++i) s[j][i] = 0.0f;
                // chunk i of every row, dequantized by unpack(j, i, wv), times the activations
                auto dot_load = [&](auto unpack) {
#pragma unroll
                    for (int i = 0; i < C; ++i) {
                        float xv[8];
                        if constexpr (C == 1) act8_unpack(xr[u], xv);
                        else act8(x, c + 8 * i, xv);
#pragma unroll
                        for (int j = 0; j < N; ++j) {
                            float wv[8];
                            unpack(j, i, wv);
#pragma unroll
                            for (int e = 0; e < 8; ++e) s[j][i] = fmaf(xv[e], wv[e], s[j][i]);
                        }
                    }
                };
                auto general = [&](int j, int i, float (&wv)[8]) {
                    weight8_unpack(w[j], wr[j][u].part(i), wv);
                };
#if defined(WEIGHT_MXFP4)
                if constexpr (C == 4) {
                    // a load's 32 columns share one scale byte: its factors are made once, not
                    // per chunk, and one vote per load sends a warp with a scale past one
                    // product (mxfp4_unpack) down the two-product path (the same bytes)
                    bool rare = false;
#pragma unroll
                    for (int j = 0; j < N; ++j)
                        rare |= c < k && !mxfp4_one_product(wr[j][u].s & 0xffu);
                    if (__any_sync(0xffffffffu, rare)) {
                        float g[N];
#pragma unroll
                        for (int j = 0; j < N; ++j) g[j] = e8m0_load(wr[j][u].s & 0xffu);
                        if (c < k) dot_load([&](int j, int i, float (&wv)[8]) {
                            mxfp4_unpack<false>(wr[j][u].word(i), 16384.0f, g[j], wv);
                        });
                    } else if (c < k) {
                        float f[N];
#pragma unroll
                        for (int j = 0; j < N; ++j) f[j] = mxfp4_factor(wr[j][u].s & 0xffu);
                        dot_load([&](int j, int i, float (&wv)[8]) {
                            mxfp4_unpack<true>(wr[j][u].word(i), f[j], 1.0f, wv);
                        });
                    }
                } else if (c < k) {
                    dot_load(general);
                }
#else
                if (c < k) dot_load(general);
#endif
                if (DOT_RING) load(u, g0 + u + AHEAD);
#pragma unroll
                for (int j = 0; j < N; ++j) {
#pragma unroll
                    for (int o = LANES / 2; o > 0; o >>= 1)
#pragma unroll
                        for (int i = 0; i < C; ++i)
                            s[j][i] += __shfl_xor_sync(0xffffffffu, s[j][i], o);
#pragma unroll
                    for (int h = C / 2; h > 0; h >>= 1)
#pragma unroll
                        for (int i = 0; i < h; ++i) s[j][i] = s[j][i] + s[j][i + h];
                    // block b0 + q's sum is in lanes q LANES ..; every lane takes them in order
#pragma unroll
                    for (int q = 0; q < C; ++q)
                        if (b0 + q < nkb)
                            sink(j, b0 + q,
                                 C == 1 ? s[j][0] : __shfl_sync(0xffffffffu, s[j][0], q * LANES));
                }
            }
        }
    } else {
        for (int b0 = first * K_BLOCK; b0 < k; b0 += step * K_BLOCK) {
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
                sink(j, b0 / K_BLOCK, warp_sum(s));
            }
        }
    }
}

template <int N>
__device__ __forceinline__ void warp_dots(const act_t* x, const WeightRef (&w)[N], int k,
                                          float (&out)[N]) {
    Combine acc[N];
    warp_dots_part<N>(x, w, k, 0, 1, [&](int j, int, float p) { acc[j].add(p); });
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

// The output type of the matmul entries: f32 logits for lm_head (OUT_F32), else the activations'.
#if defined(OUT_F32)
typedef float out_t;
__device__ __forceinline__ out_t out_store(float v) { return v; }
#else
typedef act_t out_t;
__device__ __forceinline__ out_t out_store(float v) { return act_store(v); }
#endif

// The f32 factor of a weight row left for after the sum: fp8's row scale, nvfp4's global scale.
__device__ __forceinline__ float row_factor(WeightRef w) {
#if defined(WEIGHT_FP8)
    return *(const float*)w.scale;
#elif defined(WEIGHT_NVFP4)
    return *w.global;
#else
    return 1.0f;
#endif
}

__device__ __forceinline__ float scaled(float d, float f) {
#if defined(WEIGHT_FP8) || defined(WEIGHT_NVFP4)
    return __fmul_rn(d, f);
#else
    return d;
#endif
}

// silu(g) * u as the reference rounds it: silu output rounded to act, the product rounded.
__device__ __forceinline__ float silu_mul(float g, float u) {
    float s = act_round(g / (1.0f + expf(-g)));
    return act_round(s * u);
}

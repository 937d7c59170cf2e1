// Metrale CUDA: the GEMV dot products of several x rows at once (gemv.cu's multi-row entries).
// Kept out of gemv.cuh, which the other matmul sources include, so that they keep their machine
// code and source identity.
#pragma once
#include "gemv.cuh"

// Several x rows at once (the multi-row entries of gemv.cu, launched where a step has 2 rows or
// more; the one-row path above stays as it is): a lane loads and dequantizes its chunk of each of
// the N weight rows once per k-block and runs the FMAs of all R rows over it, R N chains each in
// exactly the one-row order (from 0, fmaf over the chunk's 8 columns left to right). The block's
// R N chunk sums then meet in the same butterfly tree as one row's, done as a reduce-scatter: a
// lane's slot s holds row s ^ m (m = lane >> (5 - log2 R)), so that at the tree's level o = 16,
// 8, ... down to 32 / R a lane keeps slots [0, h) and adds its partner's slots [h, 2h), which hold
// the same rows (the partner's m differs in bit h): every sum is the butterfly's own (own value
// plus partner's, as a lane of the one-row tree adds them), with R - 1 shuffles where R log2 32
// would do it row by row. After those levels slot 0 holds row m's partial, which the tree's last
// levels (o < 32 / R) finish as usual. So each row's bytes are the one-row launch's, whatever R,
// nrows or the other rows. Needs one chunk a lane a k-block (K_BLOCK 256) and 16-byte aligned
// rows (k % 8 == 0); warp_dots_multi_ok says so, else the caller takes warp_dots_rows.
//
// warp_dots_multi_part gives the k-block partials of the warp's blocks first, first + step, ...
// to sink(j, block, partial) in block order, a lane holding row (lane >> (5 - log2 R))'s; rows
// past nrows repeat row nrows - 1 (computed, never meant to be stored).
// MULTI_AHEAD: k-blocks of each weight row in flight per lane (a ring, as DOT_RING). Unset, a
// tile of 8 rows keeps 4 and a tile of 16 keeps 2: its lanes hold twice the rows' x chunks in
// registers, and with 4 ahead Llama-3.1-8B's gate_up and down ran 1.4x and 2.8x slower at 16
// rows (bench_gpu_gemv_rows.py), while 8-row tiles are 3-7 % faster with 4 than with 2.
#ifdef MULTI_AHEAD
#define MULTI_AHEAD_OF(R) MULTI_AHEAD
#else
#define MULTI_AHEAD_OF(R) ((R) >= 16 ? 2 : 4)
#endif

__device__ __forceinline__ bool warp_dots_multi_ok(int k) { return K_BLOCK == 256 && k % 8 == 0; }

template <int R>
__device__ __forceinline__ int multi_row_of_lane(int lane) {
    static_assert(R >= 2 && R <= 32 && (R & (R - 1)) == 0, "R a power of two, 2 to 32");
    return lane >> (5 - __builtin_ctz(R));
}

// Eight bf16 values (16 bytes) as f32, exactly: an element's bits are the f32's top half, so a
// word's low element is the word shifted up 16 and its high one the word with its low half
// cleared, one instruction each (the generic conversion spends two on the high one).
__device__ __forceinline__ void bf16x8_unpack(const uint4& raw, float (&out)[8]) {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = __uint_as_float(words[i] << 16);
        out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
}

// The eight activations of a chunk for the multi-row dots (act8's values), through the
// read-only path (no launch writes x while a GEMV reads it).
__device__ __forceinline__ void multi_act8(const act_t* x, int c, float (&out)[8]) {
#if defined(ACT_BF16)
    bf16x8_unpack(__ldg((const uint4*)(x + c)), out);
#else
    act8(x, c, out);
#endif
}

// A weight chunk for the multi-row dots (weight8_unpack's values).
__device__ __forceinline__ void multi_weight8(WeightRef w, const WeightRaw8& r, float (&out)[8]) {
#if defined(WEIGHT_BF16)
    bf16x8_unpack(r.v, out);
#else
    weight8_unpack(w, r, out);
#endif
}

// The reduce-scatter's level of half size H (the tree's level o = 32 H / R), then the next ones.
template <int H, int R, int N>
__device__ __forceinline__ void multi_scatter(float (&s)[R][N]) {
    if constexpr (H >= 1) {
#pragma unroll
        for (int i = 0; i < H; ++i)
#pragma unroll
            for (int j = 0; j < N; ++j)
                s[i][j] = s[i][j] + __shfl_xor_sync(0xffffffffu, s[i + H][j], 32 * H / R);
        multi_scatter<H / 2, R, N>(s);
    }
}

template <int N, int R, class Sink>
__device__ __forceinline__ void warp_dots_multi_part(const act_t* x, int nrows,
                                                     const WeightRef (&w)[N], int k, int first,
                                                     int step, Sink sink) {
    constexpr int LR = __builtin_ctz(R), AHEAD = MULTI_AHEAD_OF(R);
    const int lane = threadIdx.x & 31, m = multi_row_of_lane<R>(lane);
    const int nkb = (k + K_BLOCK - 1) / K_BLOCK;
    const int ng = (nkb - first + step - 1) / step;  // this warp's k-blocks
    // slot s: x row s ^ m (the last row past nrows), at this lane's chunk of the warp's next
    // AHEAD k-blocks (u step K_BLOCK further for the u-th)
    const act_t* xp[R];
#pragma unroll
    for (int s = 0; s < R; ++s)
        xp[s] = x + (long)min(s ^ m, nrows - 1) * k + first * K_BLOCK + lane * 8;
    WeightRaw8 wr[N][AHEAD];
    auto load = [&](int u, int g) {  // block first + g step of every weight row into slot u
        const int c = (first + g * step) * K_BLOCK + lane * 8;
        if (g < ng && c < k) {
#pragma unroll
            for (int j = 0; j < N; ++j) wr[j][u] = weight8_load(w[j], c);
        }
    };
#pragma unroll
    for (int u = 0; u < AHEAD; ++u) load(u, u);
    for (int g0 = 0; g0 < ng; g0 += AHEAD) {
#pragma unroll
        for (int u = 0; u < AHEAD; ++u) {
            if (g0 + u >= ng) break;
            const int b = first + (g0 + u) * step, c = b * K_BLOCK + lane * 8;
            float s[R][N];
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int j = 0; j < N; ++j) s[r][j] = 0.0f;
            if (c < k) {
                float wv[N][8];
#pragma unroll
                for (int j = 0; j < N; ++j) multi_weight8(w[j], wr[j][u], wv[j]);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    float xv[8];
                    multi_act8(xp[r], u * step * K_BLOCK, xv);
#pragma unroll
                    for (int j = 0; j < N; ++j)
#pragma unroll
                        for (int e = 0; e < 8; ++e) s[r][j] = fmaf(xv[e], wv[j][e], s[r][j]);
                }
            }
            load(u, g0 + u + AHEAD);
            // the tree's levels o = 16 .. 32 / R as the reduce-scatter, then the rest
            multi_scatter<R / 2, R, N>(s);
#pragma unroll
            for (int o = 16 >> LR; o > 0; o >>= 1)
#pragma unroll
                for (int j = 0; j < N; ++j) s[0][j] += __shfl_xor_sync(0xffffffffu, s[0][j], o);
#pragma unroll
            for (int j = 0; j < N; ++j) sink(j, b, s[0][j]);
        }
        // the pointers move on; the empty asm keeps each one a register of its own (without
        // it the compiler rebuilt every row's address from its index at every k-block)
#pragma unroll
        for (int s = 0; s < R; ++s) {
            xp[s] += AHEAD * step * K_BLOCK;
            asm volatile("" : "+l"(xp[s]));
        }
    }
}

// x · w[j] for nrows (1 to R) consecutive x rows and N weight rows, by one full warp, every
// weight chunk loaded once for all rows (warp_dots_multi_part); lane r < R gets row r's dots in
// out, each the one-row warp_dots' bytes.
template <int N, int R>
__device__ __forceinline__ void warp_dots_multi(const act_t* x, int nrows, const WeightRef (&w)[N],
                                                int k, float (&out)[N]) {
    Combine acc[N];
    warp_dots_multi_part<N, R>(x, nrows, w, k, 0, 1, [&](int j, int, float p) { acc[j].add(p); });
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < N; ++j)  // row r's sums are in lane r << (5 - log2 R)
        out[j] = __shfl_sync(0xffffffffu, acc[j].result(), (lane % R) << (5 - __builtin_ctz(R)));
}

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

// ------------------------------------------------------------------ lanes a column (LANE_COLS)
// The multi-row dots above spend most of a lane's instructions on x, not on the FMAs: a lane
// holds one chunk of each k-block for the warp's two weight rows, so each x value it loads is
// unpacked for two columns only (about 300 warp instructions a KiB of weights at 8 rows against
// the 128 FMAs; benchmarks/bench_sass_mix.py). Here eight lanes share a weight row (a unit's
// NC rows) and a warp takes four units: lane (g, s) = (lane >> 3, lane & 7) of unit g runs
// chunks s, s + 8, s + 16, s + 24 of every k-block, and the block's threads stage each k-block
// of the tile's x rows once, widened to f32, in shared memory, which the lanes read as
// broadcasts (the four units of a warp read the same words). Every value is the one-row
// launch's: a chunk sum is the same fma chain from zero; the butterfly tree's first two levels
// (chunk offsets 16 and 8) pair sums a lane holds itself (s with s + 16, s + 8 with s + 24,
// then the two), and its last three (offsets 4, 2, 1) are the eight lanes' reduce-scatter of
// the rows, as warp_dots_multi's (slot i holds row i ^ m, m = s R / 8, and keeps own plus
// partner's); a lane ends with rows m .. m + R / 8 - 1, each combined over the k-blocks in
// block order (Combine). So each row's bytes are the one-row launch's, whatever R, nrows or the
// other rows. x's k-blocks are double-buffered: the next one is loaded into registers while
// the current one is used, and stored after it (one barrier a k-block).
// NC: weight rows a unit (linear: LANE_COLS consecutive columns; gate_up: gate and up).
#ifndef LANE_COLS
#define LANE_COLS 0
#endif
#ifndef LANE_AHEAD
#define LANE_AHEAD 2  // k-blocks of weights in flight per lane (a ring, as MULTI_AHEAD)
#endif

// Stage k-block b of the tile's R x rows (rows past nrows repeat the last; columns past k are
// zeros) as float4 halves: xs[r][h][q] holds columns 4 h .. 4 h + 3 of chunk q.
template <int R, int NW>
struct LaneStage {
    static constexpr int PER = R / NW;  // (row, chunk) items a thread of NW warps stages
    static_assert(PER >= 1 && R % NW == 0, "whole items a thread");
    uint4 raw[PER];
    __device__ __forceinline__ void load(const act_t* x, int nrows, int k, int b) {
#pragma unroll
        for (int p = 0; p < PER; ++p) {
            const int item = threadIdx.x + p * 32 * NW, r = item >> 5, q = item & 31;
            const int c = b * K_BLOCK + q * 8;
            raw[p] = c < k ? __ldg((const uint4*)(x + (long)min(r, nrows - 1) * k + c))
                           : make_uint4(0u, 0u, 0u, 0u);
        }
    }
    __device__ __forceinline__ void store(float4 (*xs)[2][32]) const {
#pragma unroll
        for (int p = 0; p < PER; ++p) {
            const int item = threadIdx.x + p * 32 * NW, r = item >> 5, q = item & 31;
            float v[8];
            bf16x8_unpack(raw[p], v);
            xs[r][0][q] = make_float4(v[0], v[1], v[2], v[3]);
            xs[r][1][q] = make_float4(v[4], v[5], v[6], v[7]);
        }
    }
};

// The eight lanes' reduce-scatter of slots [0, 2H) at lane offset O, then the next levels.
template <int H, int O, int R, int NC>
__device__ __forceinline__ void lane_scatter(float (&v)[R][NC]) {
    if constexpr (H >= R / 8 && O >= 1) {
#pragma unroll
        for (int i = 0; i < H; ++i)
#pragma unroll
            for (int j = 0; j < NC; ++j)
                v[i][j] = v[i][j] + __shfl_xor_sync(0xffffffffu, v[i + H][j], O);
        lane_scatter<H / 2, O / 2, R, NC>(v);
    }
}

// A block of NW warps, its units for rows row0 .. row0 + R: rows_of(unit, w) gives a unit's NC weight rows,
// finish(row, unit, d) takes its dots (d[j] for row j). Units past `units` repeat the last
// (computed, never finished). Needs warp_dots_multi_ok(k); else each warp takes its units
// through warp_dots_rows, one after another.
template <int R, int NC, int NW, class Rows, class Finish>
__device__ __forceinline__ void lane_units(const act_t* x, int rows, int k, int units,
                                           Rows rows_of, Finish finish) {
    static_assert(R == 8 || R == 16, "8 lanes scatter 8 or 16 rows");
    static_assert(K_BLOCK == 256, "a k-block is 32 chunks, four a lane");
    constexpr int M = R / 8, AHEAD = LANE_AHEAD;
    __shared__ float4 lane_xs[2][R][2][32];
    const int lane = threadIdx.x & 31, s = lane & 7;
    const int unit = (blockIdx.x * NW + (threadIdx.x >> 5)) * 4 + (lane >> 3);
    const int row0 = blockIdx.y * R, nr = min(R, rows - row0);
    if (nr <= 0) return;  // the whole block
    const act_t* xt = x + (long)row0 * k;
    if (!warp_dots_multi_ok(k)) {  // one unit after another, a lane a row (as columns_warp_multi)
        const int first = unit - (lane >> 3);
        for (int u = first; u < min(first + 4, units); ++u) {
            WeightRef w[NC];
            rows_of(u, w);
            float d[NC];
            grid_dependency_sync();
            warp_dots_rows<NC, R>(xt, nr, w, k, d);
            if (lane < nr) finish(row0 + lane, u, d);
        }
        return;
    }
    WeightRef w[NC];
    rows_of(min(unit, units - 1), w);
#pragma unroll
    for (int j = 0; j < NC; ++j)  // the first two k-blocks: lane s asks for the row's line s
        if (s * 64 < k) asm volatile("prefetch.global.L2 [%0];" ::"l"(
            (const char*)w[j].data + 128L * s));
    grid_dependency_sync();
    const int nkb = (k + K_BLOCK - 1) / K_BLOCK;
    WeightRaw8 wr[AHEAD][NC][4];
    auto load = [&](int u, int b) {  // k-block b of every weight row into ring slot u (zeros
        if (b < nkb) {               // past k, so that those chunk sums are +0 like the tree's)
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                const int c = b * K_BLOCK + (s + 8 * t) * 8;
#pragma unroll
                for (int j = 0; j < NC; ++j) {
                    WeightRaw8 z = {};
                    wr[u][j][t] = c < k ? weight8_load(w[j], c) : z;
                }
            }
        }
    };
    // slot i reads row i ^ s M: its float4 index in a stage, chunk s (xs[r][0][s])
    int xoff[R];
#pragma unroll
    for (int i = 0; i < R; ++i) xoff[i] = (i ^ (s * M)) * 64 + s;
    LaneStage<R, NW> st;
    st.load(xt, nr, k, 0);
    st.store(lane_xs[0]);
#pragma unroll
    for (int u = 0; u < AHEAD; ++u) load(u, u);
    __syncthreads();
    Combine acc[M][NC];
    for (int g0 = 0; g0 < nkb; g0 += AHEAD) {
#pragma unroll
        for (int u = 0; u < AHEAD; ++u) {
            const int b = g0 + u;
            if (b >= nkb) break;  // the same for the whole block
            if (b + 1 < nkb) st.load(xt, nr, k, b + 1);
            const float4* xs = &lane_xs[b & 1][0][0][0];
            // v[i][j]: slot i's tree value of the lane's chunks: the pairs (s, s + 16) and
            // (s + 8, s + 24), then their sum (a chunk past k: x and w zeros, its sum +0)
            float v[R][NC], pair[R][NC];
#pragma unroll
            for (int o = 0; o < 4; ++o) {
                const int t = (o & 1) * 2 + (o >> 1);  // chunks s, s + 16, s + 8, s + 24
                float wv[NC][8];
#pragma unroll
                for (int j = 0; j < NC; ++j) multi_weight8(w[j], wr[u][j][t], wv[j]);
#pragma unroll
                for (int i = 0; i < R; ++i) {
                    const float4 a = xs[xoff[i] + 8 * t], e = xs[xoff[i] + 8 * t + 32];
                    const float xv[8] = {a.x, a.y, a.z, a.w, e.x, e.y, e.z, e.w};
#pragma unroll
                    for (int j = 0; j < NC; ++j) {
                        float ch = 0.0f;
#pragma unroll
                        for (int h = 0; h < 8; ++h) ch = fmaf(xv[h], wv[j][h], ch);
                        if (o == 0) v[i][j] = ch;
                        else if (o == 1) v[i][j] = v[i][j] + ch;
                        else if (o == 2) pair[i][j] = ch;
                        else v[i][j] = v[i][j] + (pair[i][j] + ch);
                    }
                }
            }
            load(u, b + AHEAD);
            lane_scatter<R / 2, 4, R, NC>(v);
#pragma unroll
            for (int i = 0; i < M; ++i)
#pragma unroll
                for (int j = 0; j < NC; ++j) acc[i][j].add(v[i][j]);
            if (b + 1 < nkb) st.store(lane_xs[(b + 1) & 1]);
            __syncthreads();
        }
    }
    if (unit >= units) return;
#pragma unroll
    for (int i = 0; i < M; ++i) {
        const int r = s * M + i;
        float d[NC];
#pragma unroll
        for (int j = 0; j < NC; ++j) d[j] = acc[i][j].result();
        if (r < nr) finish(row0 + r, unit, d);
    }
}

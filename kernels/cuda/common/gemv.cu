// Metrale CUDA: GEMV-shaped matmul families (linear, linear_add, qkv, gate_up_swiglu, lm_head).
//
// Split-K with a fixed split: a block of GW warps computes COLS output columns for up to RCH
// x rows. Every (column, k-block) pair is one warp's work: lane l multiplies-and-adds its 8
// values of the block left to right (fma, f32) and the 32 lane sums meet in the butterfly
// tree — exactly warp_dot's per-block step (gemv.cuh), so the bytes are the same as one warp
// walking the whole row. The block partials land in shared memory and one thread per
// (column, row) combines them in the declared order (ACROSS_*). Many warps work on one row at
// once and each issues the loads of several pairs before using them, so enough bytes are in
// flight to stream weights near the copy rate; the result still depends only on its own x row
// and weight row (row-invariant). Defines: ACT_*, WEIGHT_*, K_BLOCK, ACROSS_*, OUT_F32.
#include "gemv.cuh"

#define GW 8     // warps per block
#define COLS 4   // output columns per block (per weight)
#define RCH 8    // x rows per block; grid.y covers the rest
#define UNROLL 4 // pairs whose weights one warp loads before it computes

#if defined(OUT_F32)
typedef float out_t;
__device__ __forceinline__ out_t out_store(float v) { return v; }
#else
typedef act_t out_t;
__device__ __forceinline__ out_t out_store(float v) { return act_store(v); }
#endif

// The partial of one k-block [b0, b1) for one x row and one weight row, as warp_dot does it.
__device__ __forceinline__ float block_partial(const act_t* x, WeightRef w, int b0, int b1, int k) {
    const int lane = threadIdx.x & 31;
    const bool vec = (k & 7) == 0;
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
    return warp_sum(s);
}

// Fill part[(v * RCH + r) * nkb + kb] for every virtual column v < NV (valid(v) says whether
// it exists), x row r < nrows and k-block kb. wref(v) is the weight row of column v.
template <int NV, class WRef, class Valid>
__device__ __forceinline__ void gemv_partials(const act_t* x, int nrows, int k, WRef wref,
                                              Valid valid, float* part) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nkb = (k + K_BLOCK - 1) / K_BLOCK;
    const int npairs = NV * nkb;
    if (K_BLOCK == 256 && (k & 7) == 0) {
        // one 8-value chunk per lane per k-block: load UNROLL pairs, then compute them
        for (int p0 = warp; p0 < npairs; p0 += GW * UNROLL) {
            float wv[UNROLL][8];
            bool live[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int p = p0 + u * GW;
                const int v = p / nkb, kb = p - v * nkb;
                const int c = kb * K_BLOCK + lane * 8;
                live[u] = p < npairs && valid(v);
                if (live[u] && c < k) {
                    weight8(wref(v), c, wv[u]);
                } else {
#pragma unroll
                    for (int i = 0; i < 8; ++i) wv[u][i] = 0.0f;
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                if (!live[u]) continue;
                const int p = p0 + u * GW;
                const int v = p / nkb, kb = p - v * nkb;
                const int c = kb * K_BLOCK + lane * 8;
                for (int r = 0; r < nrows; ++r) {
                    float s = 0.0f;
                    if (c < k) {
                        float xv[8];
                        act8(x + (long)r * k, c, xv);
#pragma unroll
                        for (int i = 0; i < 8; ++i) s = fmaf(xv[i], wv[u][i], s);
                    }
                    s = warp_sum(s);
                    if (lane == 0) part[(v * RCH + r) * nkb + kb] = s;
                }
            }
        }
    } else {
        for (int p = warp; p < npairs; p += GW) {
            const int v = p / nkb, kb = p - v * nkb;
            if (!valid(v)) continue;
            const int b0 = kb * K_BLOCK, b1 = min(b0 + K_BLOCK, k);
            for (int r = 0; r < nrows; ++r) {
                const float s = block_partial(x + (long)r * k, wref(v), b0, b1, k);
                if (lane == 0) part[(v * RCH + r) * nkb + kb] = s;
            }
        }
    }
    __syncthreads();
}

// The combined dot of virtual column v and x row r, in the declared order.
__device__ __forceinline__ float combined(const float* part, int v, int r, int nkb) {
    Combine acc;
    for (int kb = 0; kb < nkb; ++kb) acc.add(part[(v * RCH + r) * nkb + kb]);
    return acc.result();
}

// grid (ceil(n / COLS), ceil(rows / RCH)), block 32 * GW, shared 4 * COLS * RCH * nkb bytes.
extern "C" __global__ void __launch_bounds__(32 * GW)
metrale_linear(const act_t* __restrict__ x, const void* __restrict__ w,
               const void* __restrict__ w_scale, const float* __restrict__ w_global,
               out_t* __restrict__ y, int rows, int k, int n) {
    extern __shared__ float part[];
    const int col0 = blockIdx.x * COLS, row0 = blockIdx.y * RCH;
    const int nrows = min(RCH, rows - row0), nkb = (k + K_BLOCK - 1) / K_BLOCK;
    const WeightRef base = weight_ref(w, w_scale, w_global);
    gemv_partials<COLS>(x + (long)row0 * k, nrows, k,
                        [&](int v) { return weight_rows(base, col0 + v, k); },
                        [&](int v) { return col0 + v < n; }, part);
    const int t = threadIdx.x;
    if (t < COLS * nrows) {
        const int v = t % COLS, r = t / COLS;
        if (col0 + v < n) y[(long)(row0 + r) * n + col0 + v] = out_store(combined(part, v, r, nkb));
    }
}

// y = round(round(x · wᵀ) + r): the residual add as the epilogue, rounded as linear; add.
extern "C" __global__ void __launch_bounds__(32 * GW)
metrale_linear_add(const act_t* __restrict__ x, const void* __restrict__ w,
                   const void* __restrict__ w_scale, const float* __restrict__ w_global,
                   const act_t* __restrict__ r, act_t* __restrict__ y, int rows, int k, int n) {
    extern __shared__ float part[];
    const int col0 = blockIdx.x * COLS, row0 = blockIdx.y * RCH;
    const int nrows = min(RCH, rows - row0), nkb = (k + K_BLOCK - 1) / K_BLOCK;
    const WeightRef base = weight_ref(w, w_scale, w_global);
    gemv_partials<COLS>(x + (long)row0 * k, nrows, k,
                        [&](int v) { return weight_rows(base, col0 + v, k); },
                        [&](int v) { return col0 + v < n; }, part);
    const int t = threadIdx.x;
    if (t < COLS * nrows) {
        const int v = t % COLS, rr = t / COLS;
        if (col0 + v < n) {
            const long i = (long)(row0 + rr) * n + col0 + v;
            y[i] = act_store(act_round(combined(part, v, rr, nkb)) + act_load(r[i]));
        }
    }
}

// q, k_, v in one launch: columns [0, nq) of q, then nk of k_, then nv of v.
extern "C" __global__ void __launch_bounds__(32 * GW)
metrale_qkv(const act_t* __restrict__ x,
            const void* __restrict__ wq, const void* __restrict__ wq_scale, const float* __restrict__ wq_global,
            const void* __restrict__ wk, const void* __restrict__ wk_scale, const float* __restrict__ wk_global,
            const void* __restrict__ wv, const void* __restrict__ wv_scale, const float* __restrict__ wv_global,
            act_t* __restrict__ q, act_t* __restrict__ k_, act_t* __restrict__ v,
            int rows, int k, int nq, int nk, int nv) {
    extern __shared__ float part[];
    const int col0 = blockIdx.x * COLS, row0 = blockIdx.y * RCH;
    const int nrows = min(RCH, rows - row0), nkb = (k + K_BLOCK - 1) / K_BLOCK;
    const int total = nq + nk + nv;
    const WeightRef bq = weight_ref(wq, wq_scale, wq_global);
    const WeightRef bk = weight_ref(wk, wk_scale, wk_global);
    const WeightRef bv = weight_ref(wv, wv_scale, wv_global);
    auto wref = [&](int vc) {
        const int c = col0 + vc;
        if (c < nq) return weight_rows(bq, c, k);
        if (c < nq + nk) return weight_rows(bk, c - nq, k);
        return weight_rows(bv, c - nq - nk, k);
    };
    gemv_partials<COLS>(x + (long)row0 * k, nrows, k, wref,
                        [&](int vc) { return col0 + vc < total; }, part);
    const int t = threadIdx.x;
    if (t < COLS * nrows) {
        const int vc = t % COLS, rr = t / COLS, c = col0 + vc;
        if (c < total) {
            const act_t val = act_store(combined(part, vc, rr, nkb));
            const long row = row0 + rr;
            if (c < nq) q[row * nq + c] = val;
            else if (c < nq + nk) k_[row * nk + c - nq] = val;
            else v[row * nv + c - nq - nk] = val;
        }
    }
}

// h = silu(round(x · wgᵀ)) * round(x · wuᵀ), rounded as swiglu rounds. Virtual columns
// [0, COLS) are gate rows, [COLS, 2 COLS) the up rows of the same outputs.
extern "C" __global__ void __launch_bounds__(32 * GW)
metrale_gate_up_swiglu(const act_t* __restrict__ x,
                       const void* __restrict__ wg, const void* __restrict__ wg_scale, const float* __restrict__ wg_global,
                       const void* __restrict__ wu, const void* __restrict__ wu_scale, const float* __restrict__ wu_global,
                       act_t* __restrict__ h, int rows, int k, int n) {
    extern __shared__ float part[];
    const int col0 = blockIdx.x * COLS, row0 = blockIdx.y * RCH;
    const int nrows = min(RCH, rows - row0), nkb = (k + K_BLOCK - 1) / K_BLOCK;
    const WeightRef bg = weight_ref(wg, wg_scale, wg_global);
    const WeightRef bu = weight_ref(wu, wu_scale, wu_global);
    gemv_partials<2 * COLS>(
        x + (long)row0 * k, nrows, k,
        [&](int vc) { return vc < COLS ? weight_rows(bg, col0 + vc, k)
                                       : weight_rows(bu, col0 + vc - COLS, k); },
        [&](int vc) { return col0 + (vc < COLS ? vc : vc - COLS) < n; }, part);
    const int t = threadIdx.x;
    if (t < COLS * nrows) {
        const int vc = t % COLS, rr = t / COLS;
        if (col0 + vc < n) {
            const float g = act_round(combined(part, vc, rr, nkb));
            const float u = act_round(combined(part, vc + COLS, rr, nkb));
            h[(long)(row0 + rr) * n + col0 + vc] = act_store(silu_mul(g, u));
        }
    }
}

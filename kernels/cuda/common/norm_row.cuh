// Metrale CUDA: one row's RMS norm by one block, the residual add first where asked: norm.cu's
// rmsnorm, add_rmsnorm and moe_combine_add_rmsnorm.
//
// Sum of squares in f32: h in blocks of H_BLOCK, the block partials combined sequentially.
// Inside a block: for row norms (H_BLOCK = 256, h a multiple of 8) lane l squares-and-adds
// its 8 consecutive values and the lanes meet in the butterfly tree (row_norm); otherwise
// thread t adds elements t, t + blockDim, ... and the threads meet in warp trees and warp
// order (block_sum). Then inv = 1 / sqrt(ss / h + eps) and y = round(round(x * inv) * w), as
// metrale.lkb.semantics.rms_normalize.
#pragma once
#include "head_norm.cuh"

// The second term of the residual add, as the act values it would be read as. ResidualTerm: a
// tensor r. CombineTerm: moe_combine of the row's experts' outputs y [top_k][h] and their
// weights, recomputed where read, rounding for rounding as moe.cu's metrale_moe_combine (each
// product rounded before its add, slot order, then rounded to act), so the fused launch gives
// the bytes of the two (relation moe_combine_add_rmsnorm).
struct ResidualTerm {
    const act_t* r;
    __device__ void eight(int c, float (&v)[8]) const { act8(r, c, v); }
    __device__ float one(int i) const { return act_load(r[i]); }
};
struct CombineTerm {
    const act_t* y;
    const float* wt;
    int top_k, h;
    __device__ void eight(int c, float (&v)[8]) const {
        float ys[8];
        act8(y, c, ys);
        const float w0 = wt[0];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(w0, ys[i]);
        for (int s = 1; s < top_k; ++s) {
            act8(y + (long)s * h, c, ys);
            const float ws = wt[s];
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = __fadd_rn(v[i], __fmul_rn(ws, ys[i]));
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = act_round(v[i]);
    }
    __device__ float one(int i) const {
        float acc = __fmul_rn(wt[0], act_load(y[i]));
        for (int s = 1; s < top_k; ++s)
            acc = __fadd_rn(acc, __fmul_rn(wt[s], act_load(y[(long)s * h + i])));
        return act_round(acc);
    }
};

// Sum of squares of n f32 values produced by `get`, in the declared order, over the block.
template <class Get>
__device__ __forceinline__ float block_sumsq(Get get, int n, float* scratch) {
    float acc = 0.0f;
    for (int b0 = 0; b0 < n; b0 += H_BLOCK) {
        const int b1 = min(b0 + H_BLOCK, n);
        float s = 0.0f;
        for (int i = b0 + threadIdx.x; i < b1; i += blockDim.x) {
            const float v = get(i);
            s += v * v;
        }
        const float p = block_sum(s, scratch);
        acc = b0 == 0 ? p : acc + p;
    }
    return acc;
}

// Row norms, one pass: warp w owns the H_BLOCK-sized blocks w, w + warps, ...; inside a block
// lane l holds the 8 consecutive values l*8 .. l*8+7 (H_BLOCK = 256 = 32 lanes x 8), adds
// their squares left to right, and the lanes meet in the butterfly tree; thread 0 combines
// the block partials in block order. The values stay in registers between the sum and the
// write (up to ROW_CHUNKS blocks per warp); other shapes take the generic path above.
#define ROW_CHUNKS 4

template <bool ADD, class Second>
__device__ __forceinline__ void row_norm(const act_t* x, const Second& r, const __nv_bfloat16* w,
                                         act_t* s, act_t* y, int h, float eps) {
    __shared__ float part[1024 / 32 * ROW_CHUNKS];
    __shared__ float inv_s;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int nblk = (h + H_BLOCK - 1) / H_BLOCK;
    float v[ROW_CHUNKS][8];
    uint4 wr[ROW_CHUNKS];  // the norm weights (bf16), loaded with x so that no load follows the sum
#pragma unroll
    for (int j = 0; j < ROW_CHUNKS; ++j) {
        const int b = warp + j * nw;
        const int c = b * H_BLOCK + lane * 8;
        float sq = 0.0f;
        if (b < nblk && c < h) {
            wr[j] = *(const uint4*)(w + c);
            act8(x, c, v[j]);
            if (ADD) {
                float rv[8];
                r.eight(c, rv);
#pragma unroll
                for (int i = 0; i < 8; ++i) v[j][i] = act_round(v[j][i] + rv[i]);
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) sq += v[j][i] * v[j][i];
        }
        sq = warp_sum(sq);
        if (lane == 0 && b < nblk) part[b] = sq;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float acc = part[0];
        for (int b = 1; b < nblk; ++b) acc = acc + part[b];
        inv_s = rms_inv(acc, h, eps);
    }
    __syncthreads();
    const float inv = inv_s;
#pragma unroll
    for (int j = 0; j < ROW_CHUNKS; ++j) {
        const int b = warp + j * nw;
        const int c = b * H_BLOCK + lane * 8;
        if (b < nblk && c < h) {
            if (ADD) act8_store(s, c, v[j]);
            const __nv_bfloat16* wv = (const __nv_bfloat16*)&wr[j];
            float out[8];
#pragma unroll
            for (int i = 0; i < 8; ++i)
                out[i] = act_round(v[j][i] * inv) * __bfloat162float(wv[i]);
            act8_store(y, c, out);
        }
    }
}

__device__ __forceinline__ bool row_norm_fits(int h) {
    return H_BLOCK == 256 && (h & 7) == 0 &&
           (h + H_BLOCK - 1) / H_BLOCK <= (int)(blockDim.x >> 5) * ROW_CHUNKS;
}

// y = round(round(x * inv) * w) for one row, the sum of squares in block_sumsq's order (the
// path for shapes row_norm does not take).
__device__ __forceinline__ void norm_row(const act_t* x, const __nv_bfloat16* w, act_t* y, int h,
                                         float eps, float* scratch) {
    const float ss = block_sumsq([&](int i) { return act_load(x[i]); }, h, scratch);
    const float inv = rms_inv(ss, h, eps);
    for (int i = threadIdx.x; i < h; i += blockDim.x)
        y[i] = act_store(act_round(act_load(x[i]) * inv) * bf16_load(w, i));
}

// One row per block: s = round(x + r) first when ADD (r: the row's second term, a ResidualTerm
// or a CombineTerm); then y = rmsnorm(s or x).
template <bool ADD, class Second>
__device__ __forceinline__ void norm_row_of(const act_t* x, const Second& r,
                                            const __nv_bfloat16* w, act_t* s, act_t* y, int h,
                                            float eps) {
    __shared__ float scratch[33];
    if (row_norm_fits(h)) {
        row_norm<ADD>(x, r, w, s, y, h, eps);
        return;
    }
    const act_t* src = x;
    if (ADD) {
        for (int i = threadIdx.x; i < h; i += blockDim.x)
            s[i] = act_store(act_load(x[i]) + r.one(i));
        __syncthreads();  // s is read back below, by other threads
        src = s;
    }
    norm_row(src, w, y, h, eps, scratch);
}

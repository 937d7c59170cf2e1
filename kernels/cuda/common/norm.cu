// Metrale CUDA: RMS norms (rmsnorm, add_rmsnorm, qk_norm, qk_norm_rope).
//
// Sum of squares in f32: h in blocks of H_BLOCK, the block partials combined sequentially.
// Inside a block: for row norms (H_BLOCK = 256, h a multiple of 8) lane l squares-and-adds
// its 8 consecutive values and the lanes meet in the butterfly tree (row_norm); otherwise
// thread t adds elements t, t + blockDim, ... and the threads meet in warp trees and warp
// order (block_sum, or warp_sum for the per-head kernels).
// Then inv = 1 / sqrt(ss / h + eps) and y = round(round(x * inv) * w), as
// metrale.lkb.semantics.rms_normalize. Defines: ACT_*, H_BLOCK, ROPE_NEOX | ROPE_INTERLEAVED.
#include "head_norm.cuh"
#include "warp_head.cuh"

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

template <bool ADD>
__device__ __forceinline__ void norm_block_row(const act_t* x, const act_t* r,
                                               const __nv_bfloat16* w, act_t* s, act_t* y,
                                               int rows, int h, float eps) {
    grid_dependency_sync();
    const int row = blockIdx.x;
    if (row >= rows) return;
    const long o = (long)row * h;
    norm_row_of<ADD>(x + o, ResidualTerm{ADD ? r + o : nullptr}, w, ADD ? s + o : nullptr, y + o,
                     h, eps);
}

// grid (rows), block min(512, 32 * ceil(h / H_BLOCK)).
extern "C" __global__ void __launch_bounds__(512)
metrale_rmsnorm(const act_t* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                act_t* __restrict__ y, int rows, int h, float eps) {
    norm_block_row<false>(x, nullptr, w, nullptr, y, rows, h, eps);
}

// s = round(x + r); y = rmsnorm(s). grid (rows), block as rmsnorm.
extern "C" __global__ void __launch_bounds__(512)
metrale_add_rmsnorm(const act_t* __restrict__ x, const act_t* __restrict__ r,
                    const __nv_bfloat16* __restrict__ w, act_t* __restrict__ s,
                    act_t* __restrict__ y, int rows, int h, float eps) {
    norm_block_row<true>(x, r, w, s, y, rows, h, eps);
}

// m = moe_combine(y, weights); s = round(x + m); n = rmsnorm(s): the experts' combine folded
// into the next residual add and norm. y [rows, top_k, h], weights f32 [rows, top_k]. grid
// (rows), block as rmsnorm.
extern "C" __global__ void __launch_bounds__(512)
metrale_moe_combine_add_rmsnorm(const act_t* __restrict__ x, const act_t* __restrict__ y,
                                const float* __restrict__ weights,
                                const __nv_bfloat16* __restrict__ w, act_t* __restrict__ s,
                                act_t* __restrict__ n, int rows, int top_k, int h, float eps) {
    grid_dependency_sync();
    const int row = blockIdx.x;
    if (row >= rows) return;
    if (top_k < 1) __trap();  // a combine of no experts: a loud fault
    const long o = (long)row * h;
    const CombineTerm m{y + o * top_k, weights + (long)row * top_k, top_k, h};
    norm_row_of<true>(x + o, m, w, s + o, n + o, h, eps);
}

// The per-head norms, a warp a head (warp_head.cuh): the warp's head normalized into its own slice
// of shared memory, buf, after the wait; false when the warp has no head.
__device__ __forceinline__ bool norm_warp_head(const act_t* q, const act_t* k,
                                               const __nv_bfloat16* wq, const __nv_bfloat16* wk,
                                               const WarpHead& hd, int d, float eps, float* buf) {
    grid_dependency_sync();
    if (!hd.valid) return false;
    head_norm((hd.isq ? q : k) + hd.at, hd.isq ? wq : wk, d, eps, buf);
    __syncwarp();
    return true;
}

extern "C" __global__ void __launch_bounds__(32 * HEADS)
metrale_qk_norm(const act_t* __restrict__ q, const act_t* __restrict__ k,
                const __nv_bfloat16* __restrict__ wq, const __nv_bfloat16* __restrict__ wk,
                act_t* __restrict__ qn, act_t* __restrict__ kn, int rows, int hq, int hkv,
                int d, float eps) {
    __shared__ float buf[HEADS][MAX_HEAD_DIM];
    const WarpHead hd(rows, hq, hkv, d);
    float* mine = buf[threadIdx.x >> 5];
    if (!norm_warp_head(q, k, wq, wk, hd, d, eps, mine)) return;
    act_t* out = (hd.isq ? qn : kn) + hd.at;
    for (int i = threadIdx.x & 31; i < d; i += 32) out[i] = act_store(mine[i]);
}

#if defined(ROPE_NEOX) || defined(ROPE_INTERLEAVED)
#include "rope.cuh"

// qk_norm then rope, the normalized head kept in the warp's shared memory between the two.
extern "C" __global__ void __launch_bounds__(32 * HEADS)
metrale_qk_norm_rope(const act_t* __restrict__ q, const act_t* __restrict__ k,
                     const __nv_bfloat16* __restrict__ wq, const __nv_bfloat16* __restrict__ wk,
                     const int* __restrict__ positions, const float* __restrict__ cos_t,
                     const float* __restrict__ sin_t, act_t* __restrict__ qr,
                     act_t* __restrict__ kr, int rows, int hq, int hkv, int d, int max_pos,
                     float eps) {
    __shared__ float buf[HEADS][MAX_HEAD_DIM];
    const WarpHead hd(rows, hq, hkv, d);
    float* mine = buf[threadIdx.x >> 5];
    if (!norm_warp_head(q, k, wq, wk, hd, d, eps, mine)) return;
    rotate_head_at(mine, cos_t, sin_t, positions[hd.row], max_pos, d,
                   (hd.isq ? qr : kr) + hd.at, threadIdx.x & 31, 32);
}
#endif

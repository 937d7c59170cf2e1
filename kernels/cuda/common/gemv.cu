// Metrale CUDA: GEMV-shaped matmul families (linear, linear_add, qkv, gate_up_swiglu, lm_head).
//
// One warp per (row, output column), WARPS warps per block; weights of any storage format are
// dequantized on the fly in f32 (metrale.cuh). Defines: ACT_*, WEIGHT_*, K_BLOCK, ACROSS_*,
// OUT_F32 (lm_head: f32 logits instead of act).
#include "gemv.cuh"

#ifndef WARPS
#define WARPS 4
#endif

#if defined(OUT_F32)
typedef float out_t;
__device__ __forceinline__ out_t out_store(float v) { return v; }
#else
typedef act_t out_t;
__device__ __forceinline__ out_t out_store(float v) { return act_store(v); }
#endif

// grid (ceil(n / WARPS), rows), block 32 * WARPS. y = x · wᵀ.
extern "C" __global__ void __launch_bounds__(32 * WARPS)
metrale_linear(const act_t* __restrict__ x, const void* __restrict__ w,
               const void* __restrict__ w_scale, const float* __restrict__ w_global,
               out_t* __restrict__ y, int rows, int k, int n) {
    grid_dependency_sync();
    const int col = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int row = blockIdx.y;
    if (col >= n || row >= rows) return;
    const float d = warp_dot(x + (long)row * k, weight_rows(weight_ref(w, w_scale, w_global), col, k), k);
    if ((threadIdx.x & 31) == 0) y[(long)row * n + col] = out_store(d);
}

// y = round(round(x · wᵀ) + r): the residual add as the epilogue, rounded as linear; add.
extern "C" __global__ void __launch_bounds__(32 * WARPS)
metrale_linear_add(const act_t* __restrict__ x, const void* __restrict__ w,
                   const void* __restrict__ w_scale, const float* __restrict__ w_global,
                   const act_t* __restrict__ r, act_t* __restrict__ y, int rows, int k, int n) {
    grid_dependency_sync();
    const int col = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int row = blockIdx.y;
    if (col >= n || row >= rows) return;
    const float d = warp_dot(x + (long)row * k, weight_rows(weight_ref(w, w_scale, w_global), col, k), k);
    if ((threadIdx.x & 31) == 0) {
        const long i = (long)row * n + col;
        y[i] = act_store(act_round(d) + act_load(r[i]));
    }
}

// q, k_, v in one launch: columns [0, nq) of q, then nk of k_, then nv of v.
extern "C" __global__ void __launch_bounds__(32 * WARPS)
metrale_qkv(const act_t* __restrict__ x,
            const void* __restrict__ wq, const void* __restrict__ wq_scale, const float* __restrict__ wq_global,
            const void* __restrict__ wk, const void* __restrict__ wk_scale, const float* __restrict__ wk_global,
            const void* __restrict__ wv, const void* __restrict__ wv_scale, const float* __restrict__ wv_global,
            act_t* __restrict__ q, act_t* __restrict__ k_, act_t* __restrict__ v,
            int rows, int k, int nq, int nk, int nv) {
    grid_dependency_sync();
    int col = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int row = blockIdx.y;
    if (row >= rows || col >= nq + nk + nv) return;
    WeightRef w;
    act_t* out;
    int n;
    if (col < nq) {
        w = weight_ref(wq, wq_scale, wq_global); out = q; n = nq;
    } else if (col < nq + nk) {
        col -= nq; w = weight_ref(wk, wk_scale, wk_global); out = k_; n = nk;
    } else {
        col -= nq + nk; w = weight_ref(wv, wv_scale, wv_global); out = v; n = nv;
    }
    const float d = warp_dot(x + (long)row * k, weight_rows(w, col, k), k);
    if ((threadIdx.x & 31) == 0) out[(long)row * n + col] = act_store(d);
}

// h = silu(round(x · wgᵀ)) * round(x · wuᵀ), rounded as swiglu rounds.
extern "C" __global__ void __launch_bounds__(32 * WARPS)
metrale_gate_up_swiglu(const act_t* __restrict__ x,
                       const void* __restrict__ wg, const void* __restrict__ wg_scale, const float* __restrict__ wg_global,
                       const void* __restrict__ wu, const void* __restrict__ wu_scale, const float* __restrict__ wu_global,
                       act_t* __restrict__ h, int rows, int k, int n) {
    grid_dependency_sync();
    const int col = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int row = blockIdx.y;
    if (col >= n || row >= rows) return;
    const WeightRef w[2] = {weight_rows(weight_ref(wg, wg_scale, wg_global), col, k),
                            weight_rows(weight_ref(wu, wu_scale, wu_global), col, k)};
    float gu[2];
    warp_dots<2>(x + (long)row * k, w, k, gu);  // both rows' loads in flight together
    if ((threadIdx.x & 31) == 0)
        h[(long)row * n + col] = act_store(silu_mul(act_round(gu[0]), act_round(gu[1])));
}

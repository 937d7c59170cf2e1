// Metrale CUDA: RMS norms (rmsnorm, add_rmsnorm, moe_combine_add_rmsnorm, qk_norm,
// qk_norm_rope).
//
// The row norms are norm_row.cuh's (its header says their order); the per-head norms sum in
// blocks of H_BLOCK over one warp (warp_sum), as head_norm.cuh says. Defines: ACT_*, H_BLOCK,
// ROPE_NEOX | ROPE_INTERLEAVED.
#include "norm_row.cuh"
#include "warp_head.cuh"

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

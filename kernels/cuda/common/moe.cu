// Metrale CUDA: the MoE router and expert kernels (softmax, topk, softmax_topk,
// moe_gate_up_swiglu, softmax_topk_moe_gate_up_swiglu, moe_down, moe_combine).
//
// Router kernels: one warp per row, e = the number of experts (any size), router.cuh's
// selections. Expert kernels reduce through warp_dot (gemv.cuh), one warp per (row, slot,
// column); softmax_topk_moe_gate_up_swiglu's blocks each make the row's selection first.
// Inputs a kernel cannot serve (top_k > MAX_TOP_K, an expert id outside [0, e)) trap: a device
// fault the runtime raises, never an output silently left unwritten.
// Defines: ACT_*, WEIGHT_*, K_BLOCK, ACROSS_* (expert kernels); RENORMALIZE (top-k).
#if !defined(ACT_BF16) && !defined(ACT_F32)
#define ACT_F32 1  // the router kernels have no activation; f32 lets the header compile
#endif
#if defined(WEIGHT_BF16) || defined(WEIGHT_F32) || defined(WEIGHT_FP8) || \
    defined(WEIGHT_MXFP4) || defined(WEIGHT_NVFP4)
#include "gemv.cuh"
#define MOE_EXPERTS 1
#endif
#include "router.cuh"

#ifndef WARPS
#define WARPS 4
#endif
// grid (rows), block 32.
extern "C" __global__ void __launch_bounds__(32)
metrale_softmax(const float* __restrict__ logits, float* __restrict__ p, int rows, int e) {
    grid_dependency_sync();
    const int row = blockIdx.x;
    if (row >= rows) return;
    warp_softmax(logits + (long)row * e, p + (long)row * e, e);
}

// grid (rows), block 32.
extern "C" __global__ void __launch_bounds__(32)
metrale_topk(const float* __restrict__ p, float* __restrict__ weights, int* __restrict__ ids,
             int rows, int e, int top_k) {
    grid_dependency_sync();
    const int row = blockIdx.x;
    if (row >= rows) return;
    if (top_k > MAX_TOP_K) __trap();  // a shape the kernel cannot serve: a loud fault
    warp_topk(p + (long)row * e, e, top_k, weights + (long)row * top_k, ids + (long)row * top_k);
}

// grid (rows), block 32; the probabilities live in dynamic shared memory (e floats).
extern "C" __global__ void __launch_bounds__(32)
metrale_softmax_topk(const float* __restrict__ logits, float* __restrict__ weights,
                     int* __restrict__ ids, int rows, int e, int top_k) {
    grid_dependency_sync();
    extern __shared__ float probs[];
    const int row = blockIdx.x;
    if (row >= rows) return;
    if (top_k > MAX_TOP_K) __trap();  // a shape the kernel cannot serve: a loud fault
    warp_softmax(logits + (long)row * e, probs, e);
    __syncwarp();
    warp_topk(probs, e, top_k, weights + (long)row * top_k, ids + (long)row * top_k);
}

// out[r] = round(sum over slots, in slot order, of w[r, s] * y[r, s]), products rounded
// before each add (no fma), as the reference. grid (ceil(h / 256), rows), block 256.
extern "C" __global__ void __launch_bounds__(1024)
metrale_moe_combine(const act_t* __restrict__ y, const float* __restrict__ weights,
                    act_t* __restrict__ out, int rows, int top_k, int h) {
    grid_dependency_sync();
    const int row = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows || c >= h) return;
    const float* w = weights + (long)row * top_k;
    const act_t* yr = y + (long)row * top_k * h + c;
    float acc = __fmul_rn(w[0], act_load(yr[0]));
    for (int s = 1; s < top_k; ++s)
        acc = __fadd_rn(acc, __fmul_rn(w[s], act_load(yr[(long)s * h])));
    out[(long)row * h + c] = act_store(acc);
}

#if defined(MOE_EXPERTS)
// h[r, s] = swiglu of expert ex's gate and up projections of x[r] (wg, wu [e, n, k]) for the
// warp's column, rs = r * top_k + s.
__device__ __forceinline__ void gate_up_swiglu_column(const act_t* __restrict__ x, long ex,
                                                      int col, int rs, WeightRef g, WeightRef u,
                                                      act_t* __restrict__ h, int top_k, int n,
                                                      int k) {
    const act_t* xr = x + (long)(rs / top_k) * k;
    const long wrow = ex * n + col;
    const WeightRef w[2] = {weight_rows(g, wrow, k), weight_rows(u, wrow, k)};
    float gu[2];
    warp_dots<2>(xr, w, k, gu);
    const float gd = act_round(gu[0]), ud = act_round(gu[1]);
    if ((threadIdx.x & 31) == 0) h[(long)rs * n + col] = act_store(silu_mul(gd, ud));
}

// h[r, s] for expert ids[r, s]. grid (ceil(n / WARPS), rows * top_k), block 32 * WARPS.
extern "C" __global__ void __launch_bounds__(32 * WARPS)
metrale_moe_gate_up_swiglu(const act_t* __restrict__ x, const int* __restrict__ ids,
                           const void* __restrict__ wg, const void* __restrict__ wg_scale,
                           const float* __restrict__ wg_global,
                           const void* __restrict__ wu, const void* __restrict__ wu_scale,
                           const float* __restrict__ wu_global,
                           act_t* __restrict__ h, int rows, int top_k, int e, int n, int k) {
    grid_dependency_sync();
    const int col = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int rs = blockIdx.y;  // row * top_k + slot
    if (col >= n || rs >= rows * top_k) return;
    const int ex = ids[rs];
    if (ex < 0 || ex >= e) __trap();  // an expert id out of range: a loud fault
    gate_up_swiglu_column(x, ex, col, rs, weight_ref(wg, wg_scale, wg_global),
                          weight_ref(wu, wu_scale, wu_global), h, top_k, n, k);
}

// softmax_topk_moe_gate_up_swiglu: each block makes its row's selection (router.cuh's
// routed_expert, softmax_topk's code), then the columns above for its slot's expert.
// grid (ceil(n / WARPS), rows * top_k), block 32 * WARPS, dynamic shared memory e floats.
extern "C" __global__ void __launch_bounds__(32 * WARPS)
metrale_softmax_topk_moe_gate_up_swiglu(
    const float* __restrict__ logits, const act_t* __restrict__ x, const void* __restrict__ wg,
    const void* __restrict__ wg_scale, const float* __restrict__ wg_global,
    const void* __restrict__ wu, const void* __restrict__ wu_scale,
    const float* __restrict__ wu_global, float* __restrict__ weights, int* __restrict__ ids,
    act_t* __restrict__ h, int rows, int top_k, int e, int n, int k) {
    extern __shared__ float probs[];
    const int col = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int rs = blockIdx.y;
    if (rs >= rows * top_k) return;  // the whole block: no barrier left behind
    if (dynamic_smem_bytes() < (unsigned)(4 * e)) __trap();
    const int ex = routed_expert(weights, ids, rs, e, top_k, [&](int row, float* w, int* id) {
        softmax_topk_row(logits, probs, row, e, top_k, w, id);
    });
    if (col >= n) return;
    gate_up_swiglu_column(x, ex, col, rs, weight_ref(wg, wg_scale, wg_global),
                          weight_ref(wu, wu_scale, wu_global), h, top_k, n, k);
}

// y[r, s] = h[r, s] · wd[ids[r, s]]ᵀ; h [rows, top_k, n], wd [e, k, n], y [rows, top_k, k]:
// the reduction runs over n. grid (ceil(k / WARPS), rows * top_k), block 32 * WARPS.
extern "C" __global__ void __launch_bounds__(32 * WARPS)
metrale_moe_down(const act_t* __restrict__ h, const int* __restrict__ ids,
                 const void* __restrict__ wd, const void* __restrict__ wd_scale,
                 const float* __restrict__ wd_global,
                 act_t* __restrict__ y, int rows, int top_k, int e, int n, int k) {
    grid_dependency_sync();
    const int col = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int rs = blockIdx.y;
    if (col >= k || rs >= rows * top_k) return;
    const int ex = ids[rs];
    if (ex < 0 || ex >= e) __trap();  // an expert id out of range: a loud fault
    const WeightRef wr = weight_rows(weight_ref(wd, wd_scale, wd_global), (long)ex * k + col, n);
    const float d = warp_dot(h + (long)rs * n, wr, n);
    if ((threadIdx.x & 31) == 0) y[(long)rs * k + col] = act_store(d);
}
#endif

// Metrale CUDA: gpt-oss's mixture of experts (topk_softmax, router_topk_softmax,
// moe_gate_up_clamp, moe_down_bias).
//
// topk_softmax: one warp per row; the biased logits l = logits + bias go to dynamic shared
// memory (e floats), top_k rounds of a warp argmax pick them (descending, ties to the lower
// id), and the softmax runs over the chosen: e_j = exp(v_j - v_0), their sum left to right,
// w_j = e_j / sum; router_topk_softmax makes the logits too, a block an expert. The expert
// kernels reduce through warp_dots (gemv.cuh), one warp per (row, slot, column): moe_gate_up_clamp reads expert ids[r, s]'s weight rows 2j (gate) and
// 2j + 1 (up), adds their biases, and applies the clamped SwiGLU of
// metrale.lkb.semantics_moe_clamp; moe_down_bias adds the expert's bias to its down projection.
// Inputs a kernel cannot serve (top_k > MAX_TOP_K, an expert id outside [0, e)) trap.
// Defines: ACT_*, WEIGHT_*, K_BLOCK, ACROSS_* (the router's and expert kernels).
#if !defined(ACT_BF16) && !defined(ACT_F32)
#define ACT_F32 1  // the router has no activation; f32 lets the header compile
#endif
#if defined(WEIGHT_BF16) || defined(WEIGHT_F32) || defined(WEIGHT_FP8) || \
    defined(WEIGHT_MXFP4) || defined(WEIGHT_NVFP4)
#include "gemv.cuh"
#include "moe_clamp.cuh"
#define MOE_EXPERTS 1
#else
#include "metrale.cuh"
#endif

#ifndef WARPS
#define WARPS 4
#endif
#ifndef MAX_TOP_K
#define MAX_TOP_K 32
#endif

// One warp's top_k of the biased logits l (e floats in shared memory) and the softmax over just
// those, into w_row and ids_row: top_k rounds of a warp argmax (descending, ties to the lower
// id), then e_j = exp(v_j - v_0), their sum left to right, w_j = e_j / sum.
__device__ __forceinline__ void topk_softmax_warp(const float* biased, int e, int top_k,
                                                  float* __restrict__ w_row,
                                                  int* __restrict__ ids_row) {
    const int lane = threadIdx.x & 31;
    float chosen[MAX_TOP_K];
    int last_id = -1;
    float last_v = INFINITY;
    for (int j = 0; j < top_k; ++j) {
        // the best entry strictly after (last_v, last_id) in the order (value desc, id asc)
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for (int i = lane; i < e; i += 32) {
            const float v = biased[i];
            const bool after = v < last_v || (v == last_v && i > last_id);
            if (after && (v > bv || (v == bv && i < bi))) { bv = v; bi = i; }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        chosen[j] = bv;
        last_v = bv;
        last_id = bi;
        if (lane == 0) ids_row[j] = bi;
    }
    const float top = chosen[0];
    float total = 0.0f;
    for (int j = 0; j < top_k; ++j) {
        chosen[j] = expf(chosen[j] - top);
        total = j ? __fadd_rn(total, chosen[j]) : chosen[j];
    }
    if (lane == 0)
        for (int j = 0; j < top_k; ++j) w_row[j] = chosen[j] / total;
}

// grid (rows), block 32; the biased logits live in dynamic shared memory (e floats).
extern "C" __global__ void __launch_bounds__(32)
metrale_topk_softmax(const float* __restrict__ logits, const __nv_bfloat16* __restrict__ bias,
                     float* __restrict__ weights, int* __restrict__ ids, int rows, int e,
                     int top_k) {
    grid_dependency_sync();
    extern __shared__ float biased[];
    const int row = blockIdx.x, lane = threadIdx.x & 31;
    if (row >= rows) return;
    if (top_k > MAX_TOP_K || top_k > e) __trap();  // a selection the kernel cannot serve
    for (int i = lane; i < e; i += 32)
        biased[i] = __fadd_rn(logits[(long)row * e + i], __bfloat162float(bias[i]));
    __syncwarp();
    topk_softmax_warp(biased, e, top_k, weights + (long)row * top_k, ids + (long)row * top_k);
}

#if defined(MOE_EXPERTS)
// router_topk_softmax: the router's logits and topk_softmax in one launch, a block a (expert,
// row). The block's WARPS warps take every WARPS-th load of the expert's weight row
// (warp_dots_part, the first two asked of L2 before the wait for the previous launch), their
// k-block partials wait in shared memory, and warp 0 sums them in k-block order (Combine):
// lm_head's dot bit for bit, as gemv.cu's split entry makes it. The biased logit goes to the
// workspace (e floats a row); the row's last block to arrive (router_arrivals) reads the row's
// e logits back from L2 and selects as topk_softmax does, then leaves its counter at zero for
// the next launch (zero when the module loads; a trap ends the context, counters and all).
// grid (e, rows), block 32 * WARPS; shared ceil(k / K_BLOCK) + e floats.
__device__ unsigned router_arrivals[65535];  // one a grid row: gridDim.y's limit

extern "C" __global__ void __launch_bounds__(32 * WARPS)
metrale_router_topk_softmax(const act_t* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                            const __nv_bfloat16* __restrict__ bias, float* __restrict__ weights,
                            int* __restrict__ ids, float* __restrict__ logits, int rows, int k,
                            int e, int top_k) {
    extern __shared__ float router_smem[];  // k-block partials, then the row's biased logits
    __shared__ bool last;
    const int ex = blockIdx.x, row = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int nkb = (k + K_BLOCK - 1) / K_BLOCK;
    if (ex >= e || row >= rows) return;  // the whole block
    if (top_k > MAX_TOP_K || top_k > e) __trap();  // a selection the kernel cannot serve
    if (dynamic_smem_bytes() < (unsigned)(4 * (nkb + e))) __trap();
    const WeightRef ws[1] = {weight_rows(weight_ref(w, nullptr, nullptr), ex, k)};
#pragma unroll
    for (int q = 0; q < 2; ++q)  // this warp's first two loads
        weight_prefetch<DOT_CHUNKS>(ws[0], k, K_BLOCK, (warp + q * WARPS) * DOT_CHUNKS * K_BLOCK);
    grid_dependency_sync();
    warp_dots_part<1>(x + (long)row * k, ws, k, warp, WARPS, [&](int, int b, float d) {
        if (lane == 0) router_smem[b] = d;
    });
    __syncthreads();
    float* row_logits = logits + (long)row * e;
    if (threadIdx.x == 0) {
        Combine acc;
        for (int b = 0; b < nkb; ++b) acc.add(router_smem[b]);
        row_logits[ex] = __fadd_rn(acc.result(), __bfloat162float(bias[ex]));
        __threadfence();  // the logit is visible to every block before this block arrives
        last = atomicAdd(&router_arrivals[row], 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    float* biased = router_smem + nkb;
    for (int i = threadIdx.x; i < e; i += blockDim.x) biased[i] = __ldcg(row_logits + i);
    __syncthreads();
    if (warp == 0)
        topk_softmax_warp(biased, e, top_k, weights + (long)row * top_k, ids + (long)row * top_k);
    if (threadIdx.x == 0) router_arrivals[row] = 0u;
}

// h[r, s, j] from expert ids[r, s]'s rows 2j, 2j + 1 of wgu [e, 2n, k] and bgu [e, 2n].
// grid (ceil(n / WARPS), rows * top_k), block 32 * WARPS.
extern "C" __global__ void __launch_bounds__(32 * WARPS)
metrale_moe_gate_up_clamp(const act_t* __restrict__ x, const int* __restrict__ ids,
                          const void* __restrict__ wgu, const void* __restrict__ wgu_scale,
                          const float* __restrict__ wgu_global,
                          const __nv_bfloat16* __restrict__ bgu, act_t* __restrict__ h,
                          int rows, int top_k, int e, int n, int k, float limit, float alpha) {
    grid_dependency_sync();
    const int col = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int rs = blockIdx.y;  // row * top_k + slot
    if (col >= n || rs >= rows * top_k) return;
    const int ex = ids[rs];
    if (ex < 0 || ex >= e) __trap();  // an expert id out of range: a loud fault
    const act_t* xr = x + (long)(rs / top_k) * k;
    const long wrow = (long)ex * 2 * n + 2 * col;
    const WeightRef ref = weight_ref(wgu, wgu_scale, wgu_global);
    const WeightRef w[2] = {weight_rows(ref, wrow, k), weight_rows(ref, wrow + 1, k)};
    float gu[2];
    warp_dots<2>(xr, w, k, gu);
    const float g = act_round(__fadd_rn(act_round(gu[0]), __bfloat162float(bgu[wrow])));
    const float u = act_round(__fadd_rn(act_round(gu[1]), __bfloat162float(bgu[wrow + 1])));
    if ((threadIdx.x & 31) == 0) h[(long)rs * n + col] = act_store(clamped_swiglu(g, u, limit,
                                                                                 alpha));
}

// y[r, s] = round(round(h[r, s] · wd[e]ᵀ) + bd[e]), e = ids[r, s]; wd [e, k, n], bd [e, k].
// grid (ceil(k / WARPS), rows * top_k), block 32 * WARPS.
extern "C" __global__ void __launch_bounds__(32 * WARPS)
metrale_moe_down_bias(const act_t* __restrict__ h, const int* __restrict__ ids,
                      const void* __restrict__ wd, const void* __restrict__ wd_scale,
                      const float* __restrict__ wd_global, const __nv_bfloat16* __restrict__ bd,
                      act_t* __restrict__ y, int rows, int top_k, int e, int n, int k) {
    grid_dependency_sync();
    const int col = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int rs = blockIdx.y;
    if (col >= k || rs >= rows * top_k) return;
    const int ex = ids[rs];
    if (ex < 0 || ex >= e) __trap();  // an expert id out of range: a loud fault
    const WeightRef wr = weight_rows(weight_ref(wd, wd_scale, wd_global), (long)ex * k + col, n);
    const float d = act_round(warp_dot(h + (long)rs * n, wr, n));
    if ((threadIdx.x & 31) == 0)
        y[(long)rs * k + col] = act_store(__fadd_rn(d, __bfloat162float(bd[(long)ex * k + col])));
}
#endif

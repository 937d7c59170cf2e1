// Metrale CUDA: the MoE routers' selections, one warp a row, shared by the router kernels
// (moe.cu's softmax, topk and softmax_topk; moe_clamp.cu's topk_softmax) and by the experts'
// gate/up launches that make the selection themselves (routed_expert: moe.cu's and
// moe_clamp.cu's CUDA-core entries, moe_mma.cu's tensor-core ones).
//
// Qwen3-MoE's router: the softmax over all e logits (lane partials left to right, then the warp
// tree), then top_k rounds of a warp argmax (descending, ties to the lower id), renormalized
// with RENORMALIZE (the chosen weights summed left to right). gpt-oss's: the top_k of the biased
// logits the same way, then the softmax over just those (metrale.lkb.semantics_moe and
// semantics_moe_clamp give the orders).
#pragma once
#include "metrale.cuh"

#ifndef MAX_TOP_K
#define MAX_TOP_K 32
#endif

// Softmax of one row into p (may alias nothing); every lane takes e / 32 entries.
__device__ __forceinline__ void warp_softmax(const float* l, float* p, int e) {
    const int lane = threadIdx.x & 31;
    float m = -INFINITY;
    for (int i = lane; i < e; i += 32) m = fmaxf(m, l[i]);
    m = warp_max(m);
    float s = 0.0f;
    for (int i = lane; i < e; i += 32) s += expf(l[i] - m);
    s = warp_sum(s);
    for (int i = lane; i < e; i += 32) p[i] = expf(l[i] - m) / s;
}

// The top_k of p (in global memory), descending, ties to the lower id.
__device__ __forceinline__ void warp_topk(const float* p, int e, int top_k, float* w, int* ids) {
    const int lane = threadIdx.x & 31;
    float chosen[MAX_TOP_K];
    int last_id = -1;
    float last_v = INFINITY;
    for (int j = 0; j < top_k && j < MAX_TOP_K; ++j) {
        // the best entry strictly after (last_v, last_id) in the order (value desc, id asc)
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for (int i = lane; i < e; i += 32) {
            const float v = p[i];
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
        if (lane == 0) ids[j] = bi;
    }
#if defined(RENORMALIZE)
    float total = chosen[0];
    for (int j = 1; j < top_k; ++j) total = total + chosen[j];
    for (int j = 0; j < top_k; ++j) chosen[j] = chosen[j] / total;
#endif
    if (lane == 0)
        for (int j = 0; j < top_k; ++j) w[j] = chosen[j];
}

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

// The expert of (row, slot) rs = row * top_k + slot in a launch that makes the router's
// selection itself (topk_moe_gate_up_clamp, softmax_topk_moe_gate_up_swiglu): once the launch
// that wrote the logits has finished, warp 0 runs select(row, w, ids), the router kernel's own
// code, into shared memory, so every block of the row finds the same experts; block (0, rs) of
// slot 0 stores the row's weights and ids for the launches after (the experts' down projection
// and their combine). Every thread of the block calls it; an id outside [0, e) (NaN logits
// select none) traps.
template <class Select>
__device__ __forceinline__ int routed_expert(float* __restrict__ weights, int* __restrict__ ids,
                                             int rs, int e, int top_k, Select select) {
    __shared__ float w_s[MAX_TOP_K];
    __shared__ int ids_s[MAX_TOP_K];
    if (top_k > MAX_TOP_K || top_k > e) __trap();  // a selection the kernel cannot serve
    const int row = rs / top_k, slot = rs % top_k;
    grid_dependency_sync();
    if (threadIdx.x < 32) select(row, w_s, ids_s);
    __syncthreads();
    if (blockIdx.x == 0 && slot == 0 && threadIdx.x < top_k) {
        weights[(long)row * top_k + threadIdx.x] = w_s[threadIdx.x];
        ids[(long)row * top_k + threadIdx.x] = ids_s[threadIdx.x];
    }
    const int ex = ids_s[slot];
    if (ex < 0 || ex >= e) __trap();  // an expert id out of range: a loud fault
    return ex;
}

// gpt-oss's selection of row `row` (topk_softmax's): the bias added to its logits in `biased`
// (shared memory, e floats), then topk_softmax_warp.
__device__ __forceinline__ void biased_topk_softmax(const float* __restrict__ logits,
                                                    const __nv_bfloat16* __restrict__ bias,
                                                    float* biased, int row, int e, int top_k,
                                                    float* w, int* ids) {
    for (int i = threadIdx.x & 31; i < e; i += 32)
        biased[i] = __fadd_rn(logits[(long)row * e + i], __bfloat162float(bias[i]));
    __syncwarp();
    topk_softmax_warp(biased, e, top_k, w, ids);
}

// Qwen3-MoE's selection of row `row` (softmax_topk's): the softmax into `probs` (shared
// memory, e floats), then warp_topk.
__device__ __forceinline__ void softmax_topk_row(const float* __restrict__ logits, float* probs,
                                                 int row, int e, int top_k, float* w, int* ids) {
    warp_softmax(logits + (long)row * e, probs, e);
    __syncwarp();
    warp_topk(probs, e, top_k, w, ids);
}

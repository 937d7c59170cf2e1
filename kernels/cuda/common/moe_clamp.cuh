// Metrale CUDA: the pieces of gpt-oss's mixture of experts that moe_clamp.cu and moe_mma.cu
// share: the router's top-k softmax (topk_softmax_warp; routed_expert, where a gate/up launch
// makes the selection itself) and the clamped SwiGLU, the gate/up entries' epilogue, each as
// the reference (metrale.lkb.semantics_moe_clamp) computes it.
#pragma once
#include "metrale.cuh"

// (clamp(up) + 1) · g · σ(alpha · g), g = min(gate, limit), each step rounded to act.
__device__ __forceinline__ float clamped_swiglu(float gate, float up, float limit,
                                                float alpha) {
    const float g = fminf(gate, limit);
    const float u = fmaxf(fminf(up, limit), -limit);
    // NaN stays NaN, as the reference's clamps (fminf would drop it)
    const float gn = gate != gate ? gate : g, un = up != up ? up : u;
    const float sig = act_round(1.0f / (1.0f + expf(-act_round(__fmul_rn(gn, alpha)))));
    const float glu = act_round(__fmul_rn(gn, sig));
    return act_round(__fmul_rn(act_round(__fadd_rn(un, 1.0f)), glu));
}

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

// The expert of (row, slot) rs = row * top_k + slot in a launch that makes the router's
// selection itself (topk_moe_gate_up_clamp): once the launch that wrote the logits has finished,
// warp 0 adds the bias to the row's e logits in `biased` (shared memory, e floats) and selects
// with topk_softmax_warp, topk_softmax's own code, so every block of the row finds the same
// experts; block (0, rs) of slot 0 stores the row's weights and ids for the launches after (the
// experts' down projection and their combine). Every thread of the block calls it; an id outside
// [0, e) (NaN logits select none) traps.
__device__ __forceinline__ int routed_expert(const float* __restrict__ logits,
                                             const __nv_bfloat16* __restrict__ bias,
                                             float* __restrict__ weights, int* __restrict__ ids,
                                             int rs, int e, int top_k, float* biased) {
    __shared__ float w_s[MAX_TOP_K];
    __shared__ int ids_s[MAX_TOP_K];
    if (top_k > MAX_TOP_K || top_k > e) __trap();  // a selection the kernel cannot serve
    const int row = rs / top_k, slot = rs % top_k;
    grid_dependency_sync();
    if (threadIdx.x < 32) {
        for (int i = threadIdx.x; i < e; i += 32)
            biased[i] = __fadd_rn(logits[(long)row * e + i], __bfloat162float(bias[i]));
        __syncwarp();
        topk_softmax_warp(biased, e, top_k, w_s, ids_s);
    }
    __syncthreads();
    if (blockIdx.x == 0 && slot == 0 && threadIdx.x < top_k) {
        weights[(long)row * top_k + threadIdx.x] = w_s[threadIdx.x];
        ids[(long)row * top_k + threadIdx.x] = ids_s[threadIdx.x];
    }
    const int ex = ids_s[slot];
    if (ex < 0 || ex >= e) __trap();  // an expert id out of range: a loud fault
    return ex;
}

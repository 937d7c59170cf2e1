// Metrale CUDA: the MoE router and expert kernels (softmax, topk, softmax_topk,
// moe_gate_up_swiglu, moe_down, moe_combine).
//
// Router kernels: one warp per row, e = the number of experts (any size). The softmax
// denominator: lane partials left to right, then the warp tree. top-k: k rounds of a warp
// argmax, ties to the lower id; renormalization sums the selected weights left to right.
// Expert kernels reduce through warp_dot (gemv.cuh), one warp per (row, slot, column).
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
#else
#include "metrale.cuh"
#endif

#ifndef WARPS
#define WARPS 4
#endif
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
// h[r, s] = swiglu of expert ids[r, s]'s gate and up projections of x[r]; wg, wu [e, n, k].
// grid (ceil(n / WARPS), rows * top_k), block 32 * WARPS.
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
    const act_t* xr = x + (long)(rs / top_k) * k;
    const long wrow = (long)ex * n + col;
    const WeightRef w[2] = {weight_rows(weight_ref(wg, wg_scale, wg_global), wrow, k),
                            weight_rows(weight_ref(wu, wu_scale, wu_global), wrow, k)};
    float gu[2];
    warp_dots<2>(xr, w, k, gu);
    const float g = act_round(gu[0]), u = act_round(gu[1]);
    if ((threadIdx.x & 31) == 0) h[(long)rs * n + col] = act_store(silu_mul(g, u));
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

// Metrale CUDA: the experts' projections on tensor cores: moe_gate_up_swiglu, moe_down,
// moe_gate_up_clamp and moe_down_bias at their `gemv_mma` points, which only the bounded
// relations mma_gemv_moe_* reach (FUSIONS.toml).
//
// Each (row, slot) is one GEMV of its expert's weight rows, reduced as gemv_mma.cuh reduces the
// dense ones: a block owns 16 output columns of one (row, slot) (T tiles of them: the gate and up
// rows for the gate/up entries), its warps take the k-blocks in turn, and each k-block's partial
// waits in shared memory until the block sums them in order. The block's one activation row is
// the MMA's first n column (the others are zeros, never loaded): the tensor cores are there for
// the weights' dequantization (about two instructions a pair, against gemv.cu's eight or nine a
// weight), not for their products. grid (ceil(outputs / 16), rows * top_k), block 32 WARPS.
//
// The expert id comes from the router's launch, so a block waits for it (grid_dependency_sync)
// before its first weight load; an id outside [0, e) traps. Row-invariant: a (row, slot)'s
// outputs are made of its own activation row and expert by the same instructions whatever the
// other rows hold. Defines: ACT_BF16, WEIGHT_*, K_BLOCK.
//
// Four warps a block, not the dense entries' eight, and for mxfp4 gate/up entries registers for
// six blocks a multiprocessor: an expert's GEMV has few k-blocks (gpt-oss-20b's 2880 columns are
// 12), so a block is short and more of them in flight serve it better. A variant sweep on an
// H100 (benchmarks/bench_gpu_decode.py --kernels-dirs, bounded mxfp4 plans, batch 1; eight warps
// and four blocks first): gpt-oss-20b's moe_gate_up_clamp 21.4 -> 16.8 us and moe_down_bias 14.3
// -> 11.0 us, the step 2.551 -> 2.384 ms; Qwen3-30B-A3B's moe_gate_up_swiglu 10.6 -> 9.2 us and
// moe_down 10.0 -> 6.5 us, the step 2.996 -> 2.682 ms. Twelve warps (a warp a k-block) measured
// slower, and two rounds of loads ahead no faster.
#ifndef WARPS
#define WARPS 4
#endif
#if defined(WEIGHT_MXFP4) && !defined(GEMV_MMA_GATE_UP_BLOCKS)
#define GEMV_MMA_GATE_UP_BLOCKS 6
#endif
#include "gemv_mma.cuh"
#include "moe_clamp.cuh"

// The expert of (row, slot) rs, once the launch that wrote it has finished.
__device__ __forceinline__ long moe_expert(const int* ids, int rs, int e) {
    grid_dependency_sync();
    const int ex = ids[rs];
    if (ex < 0 || ex >= e) __trap();  // an expert id out of range: a loud fault
    return ex;
}

// The thread that finishes output column m of the block's 16 (activation row 0), or -1.
__device__ __forceinline__ int moe_column(int c0, int n) {
    const int m = threadIdx.x / XROWS, r = threadIdx.x % XROWS;  // THREADS >= GROUP XROWS
    return m < GROUP && r == 0 && c0 + m < n ? m : -1;
}

// Tile j's finished dot for column m: the k-blocks summed in order, times the row's factor.
template <int T>
__device__ __forceinline__ float moe_dot(int k, int j, int m, WeightRef w, long row) {
    return scaled(gemv_mma_sum<T>(gemv_mma_part, k, j, m, 0), row_factor(weight_rows(w, row, 0)));
}

// h[r, s] = silu(round(x[r] · wg[e]ᵀ)) · round(x[r] · wu[e]ᵀ), e = ids[r, s]; wg, wu [e, n, k].
extern "C" __global__ void GATE_UP_BOUNDS
metrale_moe_gate_up_swiglu_gemv_mma(const act_t* __restrict__ x, const int* __restrict__ ids,
                                    const void* __restrict__ wg, const void* __restrict__ wg_scale,
                                    const float* __restrict__ wg_global,
                                    const void* __restrict__ wu, const void* __restrict__ wu_scale,
                                    const float* __restrict__ wu_global, act_t* __restrict__ h,
                                    int rows, int top_k, int e, int n, int k) {
    const int rs = blockIdx.y, n0 = blockIdx.x * GROUP;
    if (rs >= rows * top_k) return;
    const long base = moe_expert(ids, rs, e) * n;
    const WeightRef g = weight_ref(wg, wg_scale, wg_global), u = weight_ref(wu, wu_scale, wu_global);
    gemv_mma_partials<2, GEMV_MMA_GATE_UP_AHEAD>(
        x + (long)(rs / top_k) * k, 1, k,
        [&](int j, int m) { return weight_rows(j ? u : g, base + min(n0 + m, n - 1), k); },
        gemv_mma_part);
    const int m = moe_column(n0, n);
    if (m < 0) return;
    const long row = base + n0 + m;
    const float gd = moe_dot<2>(k, 0, m, g, row), ud = moe_dot<2>(k, 1, m, u, row);
    h[(long)rs * n + n0 + m] = act_store(silu_mul(act_round(gd), act_round(ud)));
}

// y[r, s] = h[r, s] · wd[e]ᵀ, e = ids[r, s]; h [rows, top_k, n], wd [e, k, n]: the reduction
// runs over n. With BIAS (moe_down_bias) the rounded dot plus bd[e] [e, k], rounded again.
template <bool BIAS>
__device__ __forceinline__ void moe_down_mma(const act_t* h, const int* ids, WeightRef w,
                                             const __nv_bfloat16* bd, act_t* y, int rows,
                                             int top_k, int e, int n, int k) {
    const int rs = blockIdx.y, c0 = blockIdx.x * GROUP;
    if (rs >= rows * top_k) return;
    const long base = moe_expert(ids, rs, e) * k;
    gemv_mma_partials<1, GEMV_MMA_AHEAD>(
        h + (long)rs * n, 1, n,
        [&](int, int m) { return weight_rows(w, base + min(c0 + m, k - 1), n); }, gemv_mma_part);
    const int m = moe_column(c0, k);
    if (m < 0) return;
    const long row = base + c0 + m;
    const float d = moe_dot<1>(n, 0, m, w, row);
    if constexpr (BIAS)
        y[(long)rs * k + c0 + m] = act_store(__fadd_rn(act_round(d), __bfloat162float(bd[row])));
    else
        y[(long)rs * k + c0 + m] = act_store(d);
}

extern "C" __global__ void __launch_bounds__(THREADS)
metrale_moe_down_gemv_mma(const act_t* __restrict__ h, const int* __restrict__ ids,
                          const void* __restrict__ wd, const void* __restrict__ wd_scale,
                          const float* __restrict__ wd_global, act_t* __restrict__ y, int rows,
                          int top_k, int e, int n, int k) {
    moe_down_mma<false>(h, ids, weight_ref(wd, wd_scale, wd_global), nullptr, y, rows, top_k, e,
                        n, k);
}

extern "C" __global__ void __launch_bounds__(THREADS)
metrale_moe_down_bias_gemv_mma(const act_t* __restrict__ h, const int* __restrict__ ids,
                               const void* __restrict__ wd, const void* __restrict__ wd_scale,
                               const float* __restrict__ wd_global,
                               const __nv_bfloat16* __restrict__ bd, act_t* __restrict__ y,
                               int rows, int top_k, int e, int n, int k) {
    moe_down_mma<true>(h, ids, weight_ref(wd, wd_scale, wd_global), bd, y, rows, top_k, e, n, k);
}

// h[r, s, j] = clamped_swiglu(round(round(gate) + bgu), round(round(up) + bgu)) with gate and up
// expert ids[r, s]'s rows 2j and 2j + 1 of wgu [e, 2n, k] (transformers' interleaving).
extern "C" __global__ void GATE_UP_BOUNDS
metrale_moe_gate_up_clamp_gemv_mma(const act_t* __restrict__ x, const int* __restrict__ ids,
                                   const void* __restrict__ wgu, const void* __restrict__ wgu_scale,
                                   const float* __restrict__ wgu_global,
                                   const __nv_bfloat16* __restrict__ bgu, act_t* __restrict__ h,
                                   int rows, int top_k, int e, int n, int k, float limit,
                                   float alpha) {
    const int rs = blockIdx.y, n0 = blockIdx.x * GROUP;
    if (rs >= rows * top_k) return;
    const long base = moe_expert(ids, rs, e) * 2 * n;
    const WeightRef w = weight_ref(wgu, wgu_scale, wgu_global);
    gemv_mma_partials<2, GEMV_MMA_GATE_UP_AHEAD>(
        x + (long)(rs / top_k) * k, 1, k,
        [&](int j, int m) { return weight_rows(w, base + 2 * min(n0 + m, n - 1) + j, k); },
        gemv_mma_part);
    const int m = moe_column(n0, n);
    if (m < 0) return;
    const long row = base + 2 * (n0 + m);
    const float g = act_round(__fadd_rn(act_round(moe_dot<2>(k, 0, m, w, row)),
                                        __bfloat162float(bgu[row])));
    const float u = act_round(__fadd_rn(act_round(moe_dot<2>(k, 1, m, w, row + 1)),
                                        __bfloat162float(bgu[row + 1])));
    h[(long)rs * n + n0 + m] = act_store(clamped_swiglu(g, u, limit, alpha));
}

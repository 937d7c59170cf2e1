// Metrale CUDA: GEMV-shaped matmul families (linear, linear_add, qkv, gate_up_swiglu, lm_head).
//
// One warp per (output column, ROWS_PER_WARP rows), WARPS warps per block: decode is bound by
// streaming the weights, so a warp takes its rows one after another over the same weight rows
// (warp_dots_rows), which the rows after the first find in cache; each row's result is the
// one-row launch's, bit for bit. Weights of any storage format are dequantized on the fly in
// f32 (metrale.cuh). Defines: ACT_*, WEIGHT_*, K_BLOCK, ACROSS_*, OUT_F32 (lm_head: f32 logits
// instead of act).
#include "gemv.cuh"

#ifndef WARPS
#define WARPS 4
#endif
#ifndef ROWS_PER_WARP
#define ROWS_PER_WARP 8  // KERNELS.toml's grids divide rows by it
#endif

// Occupancy for bf16 activations (decode): eight blocks of four warps per SM (64 registers), with
// DOT_AHEAD (gemv.cuh) at 4 so that the loads in flight fit them. Measured on the H200
// (benchmarks/bench_gpu_variants.py, batch 1): against five to three blocks with 8-16 blocks
// ahead, Llama-3.1-8B's bf16 down_proj 34.6 -> 30.1 us, qkv 17.2 -> 15.9; fp8 gate_up 58 -> 47 us;
// mxfp4 gate_up 81 -> 53 us. More warps hide the dequantizing chains of fp8 and fp4, and one wave
// holds o_proj's and down_proj's 1024 blocks. f32 activations (tests) are left to ptxas.
#if defined(GEMV_MIN_BLOCKS)
#elif !defined(ACT_BF16) || defined(WEIGHT_F32)
#define GEMV_MIN_BLOCKS 0
#else
#define GEMV_MIN_BLOCKS 8
#endif

// gate_up_swiglu with bf16 weights and activations at seven blocks per SM (72 registers): a warp
// there streams two weight rows, and the variant sweep measured it faster at seven than at eight
// on the H200 (Llama-3.1-8B 14336 x 4096: 60.0 -> 58.0 us at batch 1, 422 -> 406 us at batch 8;
// Qwen3-0.6B unchanged), while linear and qkv lose at seven (o_proj 11.4 -> 13.3 us, down_proj
// 30.4 -> 40.3 us). benchmarks/bench_gpu_variants.py keeps the comparison (GATE_UP_MIN_BLOCKS=8).
#if defined(GATE_UP_MIN_BLOCKS)
#elif defined(ACT_BF16) && defined(WEIGHT_BF16) && GEMV_MIN_BLOCKS == 8
#define GATE_UP_MIN_BLOCKS 7
#else
#define GATE_UP_MIN_BLOCKS GEMV_MIN_BLOCKS
#endif

// Output columns a warp computes (linear, linear_add, qkv): GEMV_COLS consecutive weight rows
// streamed together as gate_up_swiglu streams its two (warp_dots over N rows gives each column
// the one-column bytes), so that a grid of ceil(n / (WARPS GEMV_COLS)) blocks fits one wave
// where one column a warp needs more than one. KERNELS.toml's grids divide by it.
#ifndef GEMV_COLS
#define GEMV_COLS 1
#endif
#if GEMV_COLS == 1
#define GEMV_COLS_MIN_BLOCKS GEMV_MIN_BLOCKS
#else
#define GEMV_COLS_MIN_BLOCKS GATE_UP_MIN_BLOCKS
#endif

// Dependent launch: a warp asks L2 for the first KiB of its weight rows (PREFETCH_BLOCKS
// k-blocks) before it waits for the previous launch (grid_dependency_sync), so that those bytes
// arrive while that launch finishes; x and every write come after the wait. A warp with no
// column returns without waiting: its block's other warps, or the grid's, wait.
#if defined(WEIGHT_BF16)
#define PREFETCH_BLOCKS 2
#elif defined(WEIGHT_F32)
#define PREFETCH_BLOCKS 1
#elif defined(WEIGHT_FP8)
#define PREFETCH_BLOCKS 4
#else
#define PREFETCH_BLOCKS 8
#endif

// One warp of linear, linear_add or qkv: its GEMV_COLS consecutive columns (part(col) gives a
// column's weight row; past n the last column again, computed and not stored) and its rows, the
// weight rows' prefetch before the wait, the dots, then store(row, col, d) for this lane's row.
// Each column's dot is the one-column warp's, so GEMV_COLS changes no byte. A warp with no column
// or row returns before the wait (its block's other warps, or the grid's, wait).
template <class Part, class Store>
__device__ __forceinline__ void columns_warp(const act_t* x, int rows, int k, int n, Part part,
                                             Store store) {
    const int col0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * GEMV_COLS;
    const int lane = threadIdx.x & 31, row0 = blockIdx.y * ROWS_PER_WARP;
    const int nr = min(ROWS_PER_WARP, rows - row0);  // rows row0 + [0, nr); lane r stores row0 + r
    if (col0 >= n || nr <= 0) return;
    WeightRef ws[GEMV_COLS];
#pragma unroll
    for (int j = 0; j < GEMV_COLS; ++j) {  // past n: the last column again, not stored
        ws[j] = part(min(col0 + j, n - 1));
        weight_prefetch<PREFETCH_BLOCKS>(ws[j], k, K_BLOCK);
    }
    grid_dependency_sync();
    float d[GEMV_COLS];
    warp_dots_rows<GEMV_COLS, ROWS_PER_WARP>(x + (long)row0 * k, nr, ws, k, d);
#pragma unroll
    for (int j = 0; j < GEMV_COLS; ++j)
        if (lane < nr && col0 + j < n) store(row0 + lane, col0 + j, d[j]);
}

// linear or linear_add: the weight rows of one weight, store(row, col, dot).
template <class Store>
__device__ __forceinline__ void linear_warp(const act_t* x, const void* w, const void* w_scale,
                                            const float* w_global, int rows, int k, int n,
                                            Store store) {
    const WeightRef wr = weight_ref(w, w_scale, w_global);
    columns_warp(x, rows, k, n, [&](int col) { return weight_rows(wr, col, k); },
                 [&](int row, int col, float d) { store((long)row * n + col, d); });
}

// grid (ceil(n / (WARPS GEMV_COLS)), ceil(rows / ROWS_PER_WARP)), block 32 * WARPS. y = x · wᵀ.
extern "C" __global__ void __launch_bounds__(32 * WARPS, GEMV_COLS_MIN_BLOCKS)
metrale_linear(const act_t* __restrict__ x, const void* __restrict__ w,
               const void* __restrict__ w_scale, const float* __restrict__ w_global,
               out_t* __restrict__ y, int rows, int k, int n) {
    linear_warp(x, w, w_scale, w_global, rows, k, n,
                [&](long i, float d) { y[i] = out_store(d); });
}

// y = round(round(x · wᵀ) + r): the residual add as the epilogue, rounded as linear; add.
extern "C" __global__ void __launch_bounds__(32 * WARPS, GEMV_COLS_MIN_BLOCKS)
metrale_linear_add(const act_t* __restrict__ x, const void* __restrict__ w,
                   const void* __restrict__ w_scale, const float* __restrict__ w_global,
                   const act_t* __restrict__ r, act_t* __restrict__ y, int rows, int k, int n) {
    linear_warp(x, w, w_scale, w_global, rows, k, n,
                [&](long i, float d) { y[i] = act_store(act_round(d) + act_load(r[i])); });
}

// q, k_, v in one launch: columns [0, nq) of q, then nk of k_, then nv of v (a warp's columns
// may fall in two of them).
extern "C" __global__ void __launch_bounds__(32 * WARPS, GEMV_COLS_MIN_BLOCKS)
metrale_qkv(const act_t* __restrict__ x,
            const void* __restrict__ wq, const void* __restrict__ wq_scale,
            const float* __restrict__ wq_global,
            const void* __restrict__ wk, const void* __restrict__ wk_scale,
            const float* __restrict__ wk_global,
            const void* __restrict__ wv, const void* __restrict__ wv_scale,
            const float* __restrict__ wv_global,
            act_t* __restrict__ q, act_t* __restrict__ k_, act_t* __restrict__ v,
            int rows, int k, int nq, int nk, int nv) {
    const WeightRef w[3] = {weight_ref(wq, wq_scale, wq_global),
                            weight_ref(wk, wk_scale, wk_global),
                            weight_ref(wv, wv_scale, wv_global)};
    auto part = [&](int col) { return col < nq ? 0 : col < nq + nk ? 1 : 2; };
    auto first = [&](int p) { return p == 0 ? 0 : p == 1 ? nq : nq + nk; };
    columns_warp(
        x, rows, k, nq + nk + nv,
        [&](int col) { return weight_rows(w[part(col)], col - first(part(col)), k); },
        [&](int row, int col, float d) {
            const int p = part(col);
            act_t* out = p == 0 ? q : p == 1 ? k_ : v;
            const int n = p == 0 ? nq : p == 1 ? nk : nv;
            out[(long)row * n + col - first(p)] = act_store(d);
        });
}

// h = silu(round(x · wgᵀ)) * round(x · wuᵀ), rounded as swiglu rounds.
extern "C" __global__ void __launch_bounds__(32 * WARPS, GATE_UP_MIN_BLOCKS)
metrale_gate_up_swiglu(const act_t* __restrict__ x,
                       const void* __restrict__ wg, const void* __restrict__ wg_scale,
                       const float* __restrict__ wg_global,
                       const void* __restrict__ wu, const void* __restrict__ wu_scale,
                       const float* __restrict__ wu_global,
                       act_t* __restrict__ h, int rows, int k, int n) {
    const int col = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31, row0 = blockIdx.y * ROWS_PER_WARP;
    const int nr = min(ROWS_PER_WARP, rows - row0);  // rows row0 + [0, nr); lane r stores row0 + r
    if (col >= n || nr <= 0) return;
    const WeightRef w[2] = {weight_rows(weight_ref(wg, wg_scale, wg_global), col, k),
                            weight_rows(weight_ref(wu, wu_scale, wu_global), col, k)};
    weight_prefetch<PREFETCH_BLOCKS>(w[0], k, K_BLOCK);
    weight_prefetch<PREFETCH_BLOCKS>(w[1], k, K_BLOCK);
    grid_dependency_sync();
    float gu[2];
    // both weight rows' loads in flight together
    warp_dots_rows<2, ROWS_PER_WARP>(x + (long)row0 * k, nr, w, k, gu);
    if (lane < nr)
        h[(long)(row0 + lane) * n + col] = act_store(silu_mul(act_round(gu[0]), act_round(gu[1])));
}

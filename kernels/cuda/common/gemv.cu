// Metrale CUDA: GEMV-shaped matmul families (linear, linear_add, qkv, gate_up_swiglu, lm_head).
//
// One warp per (output column, ROWS_PER_WARP rows), WARPS warps per block: decode is bound by
// streaming the weights, so a warp takes its rows one after another over the same weight rows
// (warp_dots_rows), which the rows after the first find in cache; each row's result is the
// one-row launch's, bit for bit. The plans launch these entries for one row; past it the
// multi-row entries at the end of this file (gemv_rows.cuh), which load each weight chunk once
// for all of a tile's rows, with the same bytes. Weights of any storage format are dequantized on the fly in
// f32 (metrale.cuh). Defines: ACT_*, WEIGHT_*, K_BLOCK, ACROSS_*, OUT_F32 (lm_head: f32 logits
// instead of act).
#include "gemv_rows.cuh"

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

// linear and linear_add with a short output split each column's loads over the block's warps
// (the `_split` entries, the KERNELS.toml tables' second launch, made where n <= 1024 in place
// of the first): one warp a column left a short output's grid thin, Qwen3-0.6B's o_proj and
// down_proj (n = 1024) giving a multiprocessor about 8 of the 32 warps it holds, each streaming
// its whole row 2 KiB at a time. With a block a column, its WARPS warps each take every
// WARPS-th load of the rows (warp_dots_part), so a multiprocessor holds about 32 warps, and
// the prefetch before the dependent-launch wait covers four times the bytes. Each warp writes
// its k-blocks' partials to shared memory (ROWS_PER_WARP ceil(k / K_BLOCK) floats; a launch
// given less traps); after a barrier warp 0 combines them in k-block order (Combine), lane r
// for row r, so every dot is the one-warp dot, bit for bit. A separate entry, so the one-warp
// entries keep their registers (64, all used; with both paths in one entry ptxas spilled).
// Measured alone on the H200 (benchmarks/bench_gpu_variants.py --only gemv, Qwen3-0.6B, one row
// / eight): bf16 o_proj 4.05 -> 3.98 us, down_proj 5.00 -> 4.91 / 19.3 -> 16.9; fp8 down_proj
// 4.57 -> 4.15 / 22.1 -> 15.5. Not for fp4 weights, whose loads span four k-blocks, so at
// these k most of a block's warps get one load or none: mxfp4 o_proj 3.20 -> 3.57 us. So the
// split entries are compiled for the other formats only (KERNELS.toml's fp4 tables have none).
extern __shared__ float gemv_split_part[];

template <class Part, class Store>
__device__ __forceinline__ void split_column(const act_t* x, int rows, int k, int n, Part part,
                                             Store store) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, col = blockIdx.x;
    const int row0 = blockIdx.y * ROWS_PER_WARP, nr = min(ROWS_PER_WARP, rows - row0);
    const int nkb = (k + K_BLOCK - 1) / K_BLOCK;
    if (dynamic_smem_bytes() < (unsigned)(nkb * ROWS_PER_WARP * 4)) __trap();
    if (col >= n || nr <= 0) return;  // the whole block
    const WeightRef ws[1] = {part(col)};
#pragma unroll
    for (int q = 0; q < 2; ++q)  // this warp's first two loads
        weight_prefetch<DOT_CHUNKS>(ws[0], k, K_BLOCK, (warp + q * WARPS) * DOT_CHUNKS * K_BLOCK);
    grid_dependency_sync();
    // (k-block b, row r) at gemv_split_part[b ROWS_PER_WARP + r]
#pragma unroll 1
    for (int r = 0; r < nr; ++r)
        warp_dots_part<1>(x + (long)(row0 + r) * k, ws, k, warp, WARPS,
                          [&](int, int b, float d) {
                              if (lane == 0) gemv_split_part[b * ROWS_PER_WARP + r] = d;
                          });
    __syncthreads();
    if (warp != 0 || lane >= nr) return;
    Combine acc;
    for (int b = 0; b < nkb; ++b) acc.add(gemv_split_part[b * ROWS_PER_WARP + lane]);
    store(row0 + lane, col, acc.result());
}

// linear or linear_add: the weight rows of one weight, store(row, col, dot); `split`: a block a
// column (split_column), else a warp a column (columns_warp).
template <bool SPLIT, class Store>
__device__ __forceinline__ void linear_warp(const act_t* x, const void* w, const void* w_scale,
                                            const float* w_global, int rows, int k, int n,
                                            Store store) {
    const WeightRef wr = weight_ref(w, w_scale, w_global);
    auto part = [&](int col) { return weight_rows(wr, col, k); };
    auto put = [&](int row, int col, float d) { store((long)row * n + col, d); };
    if constexpr (SPLIT)
        split_column(x, rows, k, n, part, put);
    else
        columns_warp(x, rows, k, n, part, put);
}

// grid (ceil(n / (WARPS GEMV_COLS)), ceil(rows / ROWS_PER_WARP)), block 32 * WARPS. y = x · wᵀ.
extern "C" __global__ void __launch_bounds__(32 * WARPS, GEMV_COLS_MIN_BLOCKS)
metrale_linear(const act_t* __restrict__ x, const void* __restrict__ w,
               const void* __restrict__ w_scale, const float* __restrict__ w_global,
               out_t* __restrict__ y, int rows, int k, int n) {
    linear_warp<false>(x, w, w_scale, w_global, rows, k, n,
                       [&](long i, float d) { y[i] = out_store(d); });
}

#if !defined(WEIGHT_MXFP4) && !defined(WEIGHT_NVFP4)
// linear with a block a column (split_column): grid (n, ceil(rows / ROWS_PER_WARP)).
extern "C" __global__ void __launch_bounds__(32 * WARPS, GEMV_MIN_BLOCKS)
metrale_linear_split(const act_t* __restrict__ x, const void* __restrict__ w,
                     const void* __restrict__ w_scale, const float* __restrict__ w_global,
                     out_t* __restrict__ y, int rows, int k, int n) {
    linear_warp<true>(x, w, w_scale, w_global, rows, k, n,
                      [&](long i, float d) { y[i] = out_store(d); });
}
#endif

// y = round(round(x · wᵀ) + r): the residual add as the epilogue, rounded as linear; add.
extern "C" __global__ void __launch_bounds__(32 * WARPS, GEMV_COLS_MIN_BLOCKS)
metrale_linear_add(const act_t* __restrict__ x, const void* __restrict__ w,
                   const void* __restrict__ w_scale, const float* __restrict__ w_global,
                   const act_t* __restrict__ r, act_t* __restrict__ y, int rows, int k, int n) {
    linear_warp<false>(x, w, w_scale, w_global, rows, k, n,
                       [&](long i, float d) { y[i] = act_store(act_round(d) + act_load(r[i])); });
}

#if !defined(WEIGHT_MXFP4) && !defined(WEIGHT_NVFP4)
// linear_add with a block a column (split_column): grid (n, ceil(rows / ROWS_PER_WARP)).
extern "C" __global__ void __launch_bounds__(32 * WARPS, GEMV_MIN_BLOCKS)
metrale_linear_add_split(const act_t* __restrict__ x, const void* __restrict__ w,
                         const void* __restrict__ w_scale, const float* __restrict__ w_global,
                         const act_t* __restrict__ r, act_t* __restrict__ y, int rows, int k,
                         int n) {
    linear_warp<true>(x, w, w_scale, w_global, rows, k, n,
                      [&](long i, float d) { y[i] = act_store(act_round(d) + act_load(r[i])); });
}
#endif

// Output col of the concatenated q | k_ | v columns (a warp's columns may fall in two of them):
// round(d), and with BIAS (qkv_bias) its part's bias added and the sum rounded, as bias_add.
template <bool BIAS>
__device__ __forceinline__ void qkv_put(int row, int col, float d, act_t* q, act_t* k_,
                                        act_t* v, const __nv_bfloat16* bq,
                                        const __nv_bfloat16* bk, const __nv_bfloat16* bv,
                                        int nq, int nk, int nv) {
    const int p = col < nq ? 0 : col < nq + nk ? 1 : 2;
    act_t* out = p == 0 ? q : p == 1 ? k_ : v;
    const int n = p == 0 ? nq : p == 1 ? nk : nv, c = col - (p == 0 ? 0 : p == 1 ? nq : nq + nk);
    if constexpr (BIAS) {
        const __nv_bfloat16* b = p == 0 ? bq : p == 1 ? bk : bv;
        out[(long)row * n + c] = act_store(__fadd_rn(act_round(d), __bfloat162float(b[c])));
    } else {
        out[(long)row * n + c] = act_store(d);
    }
}

// q, k_, v in one launch: columns [0, nq) of q, then nk of k_, then nv of v; BIAS: qkv_bias.
template <bool BIAS>
__device__ __forceinline__ void qkv_warp(const act_t* x, const WeightRef (&w)[3], act_t* q,
                                         act_t* k_, act_t* v, const __nv_bfloat16* bq,
                                         const __nv_bfloat16* bk, const __nv_bfloat16* bv,
                                         int rows, int k, int nq, int nk, int nv) {
    auto part = [&](int col) { return col < nq ? 0 : col < nq + nk ? 1 : 2; };
    auto first = [&](int p) { return p == 0 ? 0 : p == 1 ? nq : nq + nk; };
    columns_warp(
        x, rows, k, nq + nk + nv,
        [&](int col) { return weight_rows(w[part(col)], col - first(part(col)), k); },
        [&](int row, int col, float d) {
            qkv_put<BIAS>(row, col, d, q, k_, v, bq, bk, bv, nq, nk, nv);
        });
}

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
    qkv_warp<false>(x, w, q, k_, v, nullptr, nullptr, nullptr, rows, k, nq, nk, nv);
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

// ------------------------------------------------------------------ several rows at once
// The entries a step of 2 rows or more launches in place of those above (KERNELS.toml's `then`
// launches, their grids empty at one row, the one-row grids empty past it): each weight chunk is
// loaded and dequantized once for all of a launch's R rows (warp_dots_multi, gemv.cuh), each
// row's bytes the one-row entry's. R is 8 (2 to 8 rows, the `_rows8` entries) or 16 (9 rows
// and up, in tiles of 16: `_rows16`); a warp takes MULTI_COLS output columns (gate_up_swiglu
// one: its gate and up rows), so that its x chunks serve that many weight rows. Separate
// entries, so that the one-row entries keep their machine code and registers.
#ifndef MULTI_COLS
#define MULTI_COLS 2
#endif
// Blocks per SM the multi-row entries ask ptxas for: with bf16 activations four at 8 rows (128
// registers, none spilled in any weight format), so that 16 warps per SM keep the loads in
// flight; at 16 rows ptxas's own choice (about 160 registers: four blocks spill).
#if !defined(MULTI_MIN_BLOCKS_8) && defined(ACT_BF16)
#define MULTI_MIN_BLOCKS_8 4
#elif !defined(MULTI_MIN_BLOCKS_8)
#define MULTI_MIN_BLOCKS_8 0
#endif
#ifndef MULTI_MIN_BLOCKS_16
#define MULTI_MIN_BLOCKS_16 0
#endif

// A warp's MULTI_COLS columns for the launch's rows (columns_warp's, several rows at once).
template <int R, class Part, class Store>
__device__ __forceinline__ void columns_warp_multi(const act_t* x, int rows, int k, int n,
                                                   Part part, Store store) {
    const int col0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * MULTI_COLS;
    const int lane = threadIdx.x & 31, row0 = blockIdx.y * R;
    const int nr = min(R, rows - row0);  // rows row0 + [0, nr); lane r stores row0 + r
    if (col0 >= n || nr <= 0) return;
    WeightRef ws[MULTI_COLS];
#pragma unroll
    for (int j = 0; j < MULTI_COLS; ++j) {  // past n: the last column again, not stored
        ws[j] = part(min(col0 + j, n - 1));
        weight_prefetch<PREFETCH_BLOCKS>(ws[j], k, K_BLOCK);
    }
    grid_dependency_sync();
    float d[MULTI_COLS];
    if (warp_dots_multi_ok(k))
        warp_dots_multi<MULTI_COLS, R>(x + (long)row0 * k, nr, ws, k, d);
    else
        warp_dots_rows<MULTI_COLS, R>(x + (long)row0 * k, nr, ws, k, d);
#pragma unroll
    for (int j = 0; j < MULTI_COLS; ++j)
        if (lane < nr && col0 + j < n) store(row0 + lane, col0 + j, d[j]);
}

// A block's MULTI_COLS columns for the launch's rows, its warps splitting the k-blocks
// (split_column's, several rows at once): partial (block b, column j, row r) at
// gemv_split_part[(b MULTI_COLS + j) R + r], ceil(k / K_BLOCK) MULTI_COLS R floats (a launch
// given less traps), then thread j R + r combines column j's row r in block order.
template <int R, class Part, class Store>
__device__ __forceinline__ void split_columns_multi(const act_t* x, int rows, int k, int n,
                                                    Part part, Store store) {
    constexpr int MC = MULTI_COLS;
    static_assert(MC * R <= 32 * WARPS, "a thread for each (column, row) of a block");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, col0 = blockIdx.x * MC;
    const int row0 = blockIdx.y * R, nr = min(R, rows - row0);
    const int nkb = (k + K_BLOCK - 1) / K_BLOCK;
    if (dynamic_smem_bytes() < (unsigned)(nkb * MC * R * 4)) __trap();
    if (col0 >= n || nr <= 0) return;  // the whole block
    WeightRef ws[MC];
#pragma unroll
    for (int j = 0; j < MC; ++j) {
        ws[j] = part(min(col0 + j, n - 1));
#pragma unroll
        for (int q = 0; q < 2; ++q)  // this warp's first two k-blocks
            weight_prefetch<1>(ws[j], k, K_BLOCK, (warp + q * WARPS) * K_BLOCK);
    }
    grid_dependency_sync();
    if (warp_dots_multi_ok(k)) {
        constexpr int SHIFT = 5 - __builtin_ctz(R);
        warp_dots_multi_part<MC, R>(x + (long)row0 * k, nr, ws, k, warp, WARPS,
                                    [&](int j, int b, float d) {
                                        if ((lane & ((1 << SHIFT) - 1)) == 0)
                                            gemv_split_part[(b * MC + j) * R + (lane >> SHIFT)] = d;
                                    });
    } else {
#pragma unroll 1
        for (int r = 0; r < nr; ++r)
            warp_dots_part<MC>(x + (long)(row0 + r) * k, ws, k, warp, WARPS,
                               [&](int j, int b, float d) {
                                   if (lane == 0) gemv_split_part[(b * MC + j) * R + r] = d;
                               });
    }
    __syncthreads();
    const int j = threadIdx.x / R, r = threadIdx.x % R;
    if (j >= MC || r >= nr || col0 + j >= n) return;
    Combine acc;
    for (int b = 0; b < nkb; ++b) acc.add(gemv_split_part[(b * MC + j) * R + r]);
    store(row0 + r, col0 + j, acc.result());
}

template <int R, bool SPLIT, class Store>
__device__ __forceinline__ void linear_multi(const act_t* x, const void* w, const void* w_scale,
                                             const float* w_global, int rows, int k, int n,
                                             Store store) {
    const WeightRef wr = weight_ref(w, w_scale, w_global);
    auto part = [&](int col) { return weight_rows(wr, col, k); };
    auto put = [&](int row, int col, float d) { store((long)row * n + col, d); };
    if constexpr (SPLIT)
        split_columns_multi<R>(x, rows, k, n, part, put);
    else
        columns_warp_multi<R>(x, rows, k, n, part, put);
}

// linear: grid (ceil(n / (WARPS MULTI_COLS)), ceil(rows / R)); the split entries grid
// (ceil(n / MULTI_COLS), ceil(rows / R)) with ceil(k / K_BLOCK) MULTI_COLS R 4 bytes of shared
// memory.
#define LINEAR_PARAMS                                                                            \
    const act_t *__restrict__ x, const void *__restrict__ w, const void *__restrict__ w_scale,  \
        const float *__restrict__ w_global, out_t *__restrict__ y, int rows, int k, int n
#define LINEAR_ADD_PARAMS                                                                        \
    const act_t *__restrict__ x, const void *__restrict__ w, const void *__restrict__ w_scale,  \
        const float *__restrict__ w_global, const act_t *__restrict__ r, act_t *__restrict__ y,  \
        int rows, int k, int n

template <int R, bool SPLIT>
__device__ __forceinline__ void linear_rows(const act_t* x, const void* w, const void* w_scale,
                                            const float* w_global, out_t* y, int rows, int k,
                                            int n) {
    linear_multi<R, SPLIT>(x, w, w_scale, w_global, rows, k, n,
                           [&](long i, float d) { y[i] = out_store(d); });
}

template <int R, bool SPLIT>
__device__ __forceinline__ void linear_add_rows(const act_t* x, const void* w,
                                                const void* w_scale, const float* w_global,
                                                const act_t* r, act_t* y, int rows, int k, int n) {
    linear_multi<R, SPLIT>(x, w, w_scale, w_global, rows, k, n, [&](long i, float d) {
        y[i] = act_store(act_round(d) + act_load(r[i]));
    });
}

extern "C" __global__ void __launch_bounds__(32 * WARPS, MULTI_MIN_BLOCKS_8)
metrale_linear_rows8(LINEAR_PARAMS) {
    linear_rows<8, false>(x, w, w_scale, w_global, y, rows, k, n);
}
extern "C" __global__ void __launch_bounds__(32 * WARPS, MULTI_MIN_BLOCKS_16)
metrale_linear_rows16(LINEAR_PARAMS) {
    linear_rows<16, false>(x, w, w_scale, w_global, y, rows, k, n);
}
extern "C" __global__ void __launch_bounds__(32 * WARPS, MULTI_MIN_BLOCKS_8)
metrale_linear_add_rows8(LINEAR_ADD_PARAMS) {
    linear_add_rows<8, false>(x, w, w_scale, w_global, r, y, rows, k, n);
}
extern "C" __global__ void __launch_bounds__(32 * WARPS, MULTI_MIN_BLOCKS_16)
metrale_linear_add_rows16(LINEAR_ADD_PARAMS) {
    linear_add_rows<16, false>(x, w, w_scale, w_global, r, y, rows, k, n);
}
#if !defined(WEIGHT_MXFP4) && !defined(WEIGHT_NVFP4)
extern "C" __global__ void __launch_bounds__(32 * WARPS, MULTI_MIN_BLOCKS_8)
metrale_linear_split_rows8(LINEAR_PARAMS) {
    linear_rows<8, true>(x, w, w_scale, w_global, y, rows, k, n);
}
extern "C" __global__ void __launch_bounds__(32 * WARPS, MULTI_MIN_BLOCKS_16)
metrale_linear_split_rows16(LINEAR_PARAMS) {
    linear_rows<16, true>(x, w, w_scale, w_global, y, rows, k, n);
}
extern "C" __global__ void __launch_bounds__(32 * WARPS, MULTI_MIN_BLOCKS_8)
metrale_linear_add_split_rows8(LINEAR_ADD_PARAMS) {
    linear_add_rows<8, true>(x, w, w_scale, w_global, r, y, rows, k, n);
}
extern "C" __global__ void __launch_bounds__(32 * WARPS, MULTI_MIN_BLOCKS_16)
metrale_linear_add_split_rows16(LINEAR_ADD_PARAMS) {
    linear_add_rows<16, true>(x, w, w_scale, w_global, r, y, rows, k, n);
}
#endif

// qkv: grid (ceil((nq + nk + nv) / (WARPS MULTI_COLS)), ceil(rows / R)); BIAS: qkv_bias.
template <int R, bool BIAS = false>
__device__ __forceinline__ void qkv_multi(const act_t* x, const WeightRef (&w)[3], act_t* q,
                                          act_t* k_, act_t* v, int rows, int k, int nq, int nk,
                                          int nv, const __nv_bfloat16* bq = nullptr,
                                          const __nv_bfloat16* bk = nullptr,
                                          const __nv_bfloat16* bv = nullptr) {
    auto part = [&](int col) { return col < nq ? 0 : col < nq + nk ? 1 : 2; };
    auto first = [&](int p) { return p == 0 ? 0 : p == 1 ? nq : nq + nk; };
    columns_warp_multi<R>(
        x, rows, k, nq + nk + nv,
        [&](int col) { return weight_rows(w[part(col)], col - first(part(col)), k); },
        [&](int row, int col, float d) {
            qkv_put<BIAS>(row, col, d, q, k_, v, bq, bk, bv, nq, nk, nv);
        });
}

#define QKV_PARAMS                                                                               \
    const act_t *__restrict__ x, const void *__restrict__ wq, const void *__restrict__ wq_scale, \
        const float *__restrict__ wq_global, const void *__restrict__ wk,                        \
        const void *__restrict__ wk_scale, const float *__restrict__ wk_global,                  \
        const void *__restrict__ wv, const void *__restrict__ wv_scale,                          \
        const float *__restrict__ wv_global, act_t *__restrict__ q, act_t *__restrict__ k_,      \
        act_t *__restrict__ v, int rows, int k, int nq, int nk, int nv
#define QKV_WEIGHTS                                                                              \
    {weight_ref(wq, wq_scale, wq_global), weight_ref(wk, wk_scale, wk_global),                  \
     weight_ref(wv, wv_scale, wv_global)}

extern "C" __global__ void __launch_bounds__(32 * WARPS, MULTI_MIN_BLOCKS_8)
metrale_qkv_rows8(QKV_PARAMS) {
    const WeightRef w[3] = QKV_WEIGHTS;
    qkv_multi<8>(x, w, q, k_, v, rows, k, nq, nk, nv);
}
extern "C" __global__ void __launch_bounds__(32 * WARPS, MULTI_MIN_BLOCKS_16)
metrale_qkv_rows16(QKV_PARAMS) {
    const WeightRef w[3] = QKV_WEIGHTS;
    qkv_multi<16>(x, w, q, k_, v, rows, k, nq, nk, nv);
}

// ------------------------------------------------------------------ the projections' biases
// linear_bias and qkv_bias (gpt-oss): the entries above with the bias as the epilogue, the sum
// rounded then the bias added and rounded again, as linear (qkv) then bias_add; each row's
// bytes those of the two launches. The same grids and tables as linear's and qkv's.
#define LINEAR_BIAS_PARAMS                                                                       \
    const act_t *__restrict__ x, const void *__restrict__ w, const void *__restrict__ w_scale,  \
        const float *__restrict__ w_global, const __nv_bfloat16 *__restrict__ b,                \
        act_t *__restrict__ y, int rows, int k, int n
#define BIAS_PUT [&](long i, float d) {                                                         \
    y[i] = act_store(__fadd_rn(act_round(d), __bfloat162float(b[i % n])));                      \
}

extern "C" __global__ void __launch_bounds__(32 * WARPS, GEMV_COLS_MIN_BLOCKS)
metrale_linear_bias(LINEAR_BIAS_PARAMS) {
    linear_warp<false>(x, w, w_scale, w_global, rows, k, n, BIAS_PUT);
}
extern "C" __global__ void __launch_bounds__(32 * WARPS, MULTI_MIN_BLOCKS_8)
metrale_linear_bias_rows8(LINEAR_BIAS_PARAMS) {
    linear_multi<8, false>(x, w, w_scale, w_global, rows, k, n, BIAS_PUT);
}
extern "C" __global__ void __launch_bounds__(32 * WARPS, MULTI_MIN_BLOCKS_16)
metrale_linear_bias_rows16(LINEAR_BIAS_PARAMS) {
    linear_multi<16, false>(x, w, w_scale, w_global, rows, k, n, BIAS_PUT);
}
#if !defined(WEIGHT_MXFP4) && !defined(WEIGHT_NVFP4)
extern "C" __global__ void __launch_bounds__(32 * WARPS, GEMV_MIN_BLOCKS)
metrale_linear_bias_split(LINEAR_BIAS_PARAMS) {
    linear_warp<true>(x, w, w_scale, w_global, rows, k, n, BIAS_PUT);
}
extern "C" __global__ void __launch_bounds__(32 * WARPS, MULTI_MIN_BLOCKS_8)
metrale_linear_bias_split_rows8(LINEAR_BIAS_PARAMS) {
    linear_multi<8, true>(x, w, w_scale, w_global, rows, k, n, BIAS_PUT);
}
extern "C" __global__ void __launch_bounds__(32 * WARPS, MULTI_MIN_BLOCKS_16)
metrale_linear_bias_split_rows16(LINEAR_BIAS_PARAMS) {
    linear_multi<16, true>(x, w, w_scale, w_global, rows, k, n, BIAS_PUT);
}
#endif

#define QKV_BIAS_PARAMS                                                                          \
    const act_t *__restrict__ x, const void *__restrict__ wq, const void *__restrict__ wq_scale, \
        const float *__restrict__ wq_global, const void *__restrict__ wk,                        \
        const void *__restrict__ wk_scale, const float *__restrict__ wk_global,                  \
        const void *__restrict__ wv, const void *__restrict__ wv_scale,                          \
        const float *__restrict__ wv_global, const __nv_bfloat16 *__restrict__ bq,               \
        const __nv_bfloat16 *__restrict__ bk, const __nv_bfloat16 *__restrict__ bv,              \
        act_t *__restrict__ q, act_t *__restrict__ k_, act_t *__restrict__ v, int rows, int k,   \
        int nq, int nk, int nv

extern "C" __global__ void __launch_bounds__(32 * WARPS, GEMV_COLS_MIN_BLOCKS)
metrale_qkv_bias(QKV_BIAS_PARAMS) {
    const WeightRef w[3] = QKV_WEIGHTS;
    qkv_warp<true>(x, w, q, k_, v, bq, bk, bv, rows, k, nq, nk, nv);
}
extern "C" __global__ void __launch_bounds__(32 * WARPS, MULTI_MIN_BLOCKS_8)
metrale_qkv_bias_rows8(QKV_BIAS_PARAMS) {
    const WeightRef w[3] = QKV_WEIGHTS;
    qkv_multi<8, true>(x, w, q, k_, v, rows, k, nq, nk, nv, bq, bk, bv);
}
extern "C" __global__ void __launch_bounds__(32 * WARPS, MULTI_MIN_BLOCKS_16)
metrale_qkv_bias_rows16(QKV_BIAS_PARAMS) {
    const WeightRef w[3] = QKV_WEIGHTS;
    qkv_multi<16, true>(x, w, q, k_, v, rows, k, nq, nk, nv, bq, bk, bv);
}

// gate_up_swiglu: a warp a column (its gate and up rows), grid (ceil(n / WARPS), ceil(rows / R)).
template <int R>
__device__ __forceinline__ void gate_up_multi(const act_t* x, WeightRef g, WeightRef u, act_t* h,
                                              int rows, int k, int n) {
    const int col = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31, row0 = blockIdx.y * R;
    const int nr = min(R, rows - row0);  // rows row0 + [0, nr); lane r stores row0 + r
    if (col >= n || nr <= 0) return;
    const WeightRef w[2] = {weight_rows(g, col, k), weight_rows(u, col, k)};
    weight_prefetch<PREFETCH_BLOCKS>(w[0], k, K_BLOCK);
    weight_prefetch<PREFETCH_BLOCKS>(w[1], k, K_BLOCK);
    grid_dependency_sync();
    float gu[2];
    if (warp_dots_multi_ok(k))
        warp_dots_multi<2, R>(x + (long)row0 * k, nr, w, k, gu);
    else
        warp_dots_rows<2, R>(x + (long)row0 * k, nr, w, k, gu);
    if (lane < nr)
        h[(long)(row0 + lane) * n + col] = act_store(silu_mul(act_round(gu[0]), act_round(gu[1])));
}

#define GATE_UP_PARAMS                                                                           \
    const act_t *__restrict__ x, const void *__restrict__ wg, const void *__restrict__ wg_scale, \
        const float *__restrict__ wg_global, const void *__restrict__ wu,                        \
        const void *__restrict__ wu_scale, const float *__restrict__ wu_global,                  \
        act_t *__restrict__ h, int rows, int k, int n

extern "C" __global__ void __launch_bounds__(32 * WARPS, MULTI_MIN_BLOCKS_8)
metrale_gate_up_swiglu_rows8(GATE_UP_PARAMS) {
    gate_up_multi<8>(x, weight_ref(wg, wg_scale, wg_global), weight_ref(wu, wu_scale, wu_global),
                     h, rows, k, n);
}
extern "C" __global__ void __launch_bounds__(32 * WARPS, MULTI_MIN_BLOCKS_16)
metrale_gate_up_swiglu_rows16(GATE_UP_PARAMS) {
    gate_up_multi<16>(x, weight_ref(wg, wg_scale, wg_global), weight_ref(wu, wu_scale, wu_global),
                      h, rows, k, n);
}

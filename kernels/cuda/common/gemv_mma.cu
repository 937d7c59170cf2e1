// Metrale CUDA: GEMV-shaped matmul families on tensor cores: linear, linear_add, qkv,
// gate_up_swiglu, lm_head, linear_bias and qkv_bias at their `gemv_mma` points, through
// gemv_mma.cuh (which says how a block reduces and why). Defines: ACT_BF16, WEIGHT_*, K_BLOCK, OUT_F32 (lm_head: f32 logits).
#include "gemv_mma.cuh"

// One tile (linear, linear_add, lm_head, qkv): column n0 + m of an n-column weight; store(i, d)
// for output index i (row-major, n columns) and the finished, scaled dot d.
template <int AHEAD, class Store>
__device__ __forceinline__ void gemv_mma_tile(const act_t* x, WeightRef w, int rows, int k,
                                              int n, int n0, Store store) {
    const int row0 = blockIdx.y * XROWS, nr = min(XROWS, rows - row0);
    gemv_mma_partials<1, AHEAD>(
        x + (long)row0 * k, nr, k,
        [&](int, int m) { return weight_rows(w, min(n0 + m, n - 1), k); }, gemv_mma_part);
    const int m = threadIdx.x / XROWS, r = threadIdx.x % XROWS;  // THREADS >= GROUP XROWS
    if (m < GROUP && r < nr && n0 + m < n) {
        const float d = gemv_mma_sum<1>(gemv_mma_part, k, 0, m, r);
        store((long)(row0 + r) * n + n0 + m, scaled(d, row_factor(weight_rows(w, n0 + m, 0))));
    }
}

// grid (ceil(n / 16), ceil(rows / 8)), block 32 WARPS. y = x · wᵀ.
extern "C" __global__ void __launch_bounds__(THREADS)
metrale_linear_gemv_mma(const act_t* __restrict__ x, const void* __restrict__ w,
                        const void* __restrict__ w_scale, const float* __restrict__ w_global,
                        out_t* __restrict__ y, int rows, int k, int n) {
    gemv_mma_tile<GEMV_MMA_AHEAD>(x, weight_ref(w, w_scale, w_global), rows, k, n,
                                  blockIdx.x * GROUP,
                                  [&](long i, float d) { y[i] = out_store(d); });
}

// y = round(round(x · wᵀ) + r), as linear then add.
extern "C" __global__ void __launch_bounds__(THREADS)
metrale_linear_add_gemv_mma(const act_t* __restrict__ x, const void* __restrict__ w,
                            const void* __restrict__ w_scale, const float* __restrict__ w_global,
                            const act_t* __restrict__ r, act_t* __restrict__ y, int rows, int k,
                            int n) {
    gemv_mma_tile<GEMV_MMA_AHEAD>(
        x, weight_ref(w, w_scale, w_global), rows, k, n, blockIdx.x * GROUP,
        [&](long i, float d) { y[i] = act_store(act_round(d) + act_load(r[i])); });
}

// y = round(round(x · wᵀ) + b): the bias as the epilogue, rounded as linear; bias_add.
extern "C" __global__ void __launch_bounds__(THREADS)
metrale_linear_bias_gemv_mma(const act_t* __restrict__ x, const void* __restrict__ w,
                             const void* __restrict__ w_scale, const float* __restrict__ w_global,
                             const __nv_bfloat16* __restrict__ b, act_t* __restrict__ y, int rows,
                             int k, int n) {
    gemv_mma_tile<GEMV_MMA_AHEAD>(x, weight_ref(w, w_scale, w_global), rows, k, n,
                                  blockIdx.x * GROUP, [&](long i, float d) {
        y[i] = act_store(__fadd_rn(act_round(d), __bfloat162float(b[i % n])));
    });
}

// One of three by part (0, 1, 2): selects, not an indexed array, which would live in local memory.
template <class T>
__device__ __forceinline__ T of3(int part, T a, T b, T c) {
    return part == 0 ? a : part == 1 ? b : c;
}

// q, k_, v in one launch: grid x counts q's column groups, then k_'s, then v's; store(part, i,
// d, n) stores output i of part (0 q, 1 k_, 2 v; n its columns).
template <class Store>
__device__ __forceinline__ void qkv_mma(const act_t* x, WeightRef wq, WeightRef wk, WeightRef wv,
                                        int rows, int k, int nq, int nk, int nv, Store store) {
    const int gq = (nq + GROUP - 1) / GROUP, gk = (nk + GROUP - 1) / GROUP, grp = blockIdx.x;
    const int part = grp < gq ? 0 : grp < gq + gk ? 1 : 2;
    const int n0 = (grp - of3(part, 0, gq, gq + gk)) * GROUP, n = of3(part, nq, nk, nv);
    gemv_mma_tile<GEMV_MMA_QKV_AHEAD>(x, of3(part, wq, wk, wv), rows, k, n, n0,
                                      [&](long i, float d) { store(part, i, d, n); });
}

#define QKV_MMA_PARAMS                                                                        \
    const act_t *__restrict__ x, const void *__restrict__ wq, const void *__restrict__ wq_scale, \
        const float *__restrict__ wq_global, const void *__restrict__ wk,                     \
        const void *__restrict__ wk_scale, const float *__restrict__ wk_global,               \
        const void *__restrict__ wv, const void *__restrict__ wv_scale,                       \
        const float *__restrict__ wv_global
#define QKV_MMA_WEIGHTS                                                                       \
    weight_ref(wq, wq_scale, wq_global), weight_ref(wk, wk_scale, wk_global),                  \
        weight_ref(wv, wv_scale, wv_global)

extern "C" __global__ void __launch_bounds__(THREADS)
metrale_qkv_gemv_mma(QKV_MMA_PARAMS, act_t* __restrict__ q, act_t* __restrict__ k_,
                     act_t* __restrict__ v, int rows, int k, int nq, int nk, int nv) {
    qkv_mma(x, QKV_MMA_WEIGHTS, rows, k, nq, nk, nv,
            [&](int part, long i, float d, int) { of3(part, q, k_, v)[i] = act_store(d); });
}

// qkv with each part's bias as the epilogue: round(round(x · wᵀ) + b), as qkv then bias_add.
extern "C" __global__ void __launch_bounds__(THREADS)
metrale_qkv_bias_gemv_mma(QKV_MMA_PARAMS, const __nv_bfloat16* __restrict__ bq,
                          const __nv_bfloat16* __restrict__ bk,
                          const __nv_bfloat16* __restrict__ bv, act_t* __restrict__ q,
                          act_t* __restrict__ k_, act_t* __restrict__ v, int rows, int k, int nq,
                          int nk, int nv) {
    qkv_mma(x, QKV_MMA_WEIGHTS, rows, k, nq, nk, nv, [&](int part, long i, float d, int n) {
        const float b = __bfloat162float(of3(part, bq, bk, bv)[i % n]);
        of3(part, q, k_, v)[i] = act_store(__fadd_rn(act_round(d), b));
    });
}

// h = silu(round(x · wgᵀ)) * round(x · wuᵀ): tile 0 the gate rows, tile 1 the up rows of the
// same 16 outputs. grid (ceil(n / 16), ceil(rows / 8)).
extern "C" __global__ void GATE_UP_BOUNDS
metrale_gate_up_swiglu_gemv_mma(const act_t* __restrict__ x,
                                const void* __restrict__ wg, const void* __restrict__ wg_scale,
                                const float* __restrict__ wg_global,
                                const void* __restrict__ wu, const void* __restrict__ wu_scale,
                                const float* __restrict__ wu_global,
                                act_t* __restrict__ h, int rows, int k, int n) {
    const WeightRef g = weight_ref(wg, wg_scale, wg_global);
    const WeightRef u = weight_ref(wu, wu_scale, wu_global);
    const int n0 = blockIdx.x * GROUP, row0 = blockIdx.y * XROWS, nr = min(XROWS, rows - row0);
    gemv_mma_partials<2, GEMV_MMA_GATE_UP_AHEAD>(
        x + (long)row0 * k, nr, k,
        [&](int j, int m) { return weight_rows(j ? u : g, min(n0 + m, n - 1), k); },
        gemv_mma_part);
    const int m = threadIdx.x / XROWS, r = threadIdx.x % XROWS;
    if (m < GROUP && r < nr && n0 + m < n) {
        const float gd = scaled(gemv_mma_sum<2>(gemv_mma_part, k, 0, m, r),
                                row_factor(weight_rows(g, n0 + m, 0)));
        const float ud = scaled(gemv_mma_sum<2>(gemv_mma_part, k, 1, m, r),
                                row_factor(weight_rows(u, n0 + m, 0)));
        h[(long)(row0 + r) * n + n0 + m] = act_store(silu_mul(act_round(gd), act_round(ud)));
    }
}

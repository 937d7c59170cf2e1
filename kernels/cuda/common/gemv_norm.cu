// Metrale CUDA: the residual add and RMS norm as the prologue of the GEMVs that read the norm
// (add_rmsnorm_qkv, add_rmsnorm_gate_up_swiglu), so a decoder layer launches no norm of its own.
//
// Why: a decode step of Qwen3-0.6B is a chain of short launches, and each add_rmsnorm launch
// holds the chain for about 1.3-1.8 us (version 23 measured the step without them). Version 9
// folded the norm into the next GEMV block by block, through shared memory and two barriers, and
// lost. Here every warp normalizes the row itself, with no barrier: its x, r and norm weights come
// to its own shared memory in asynchronous copies all in flight at once (k <= 1024).
//
// Order: each warp reproduces row_norm (norm.cu) exactly. Lane l adds x + r (rounded to act) for
// the 8 consecutive values l*8 .. l*8 + 7 of each H_BLOCK (256) block, squares and adds them left
// to right, the lanes meet in warp_sum's butterfly (every lane the same value), and the block
// partials combine sequentially; inv = rms_inv; y = round(round(s * inv) * wn). The normalized
// row goes to the warp's slice of shared memory, and the GEMV reads it there as gemv.cu reads x
// (warp_dots, gemv.cuh), so every output has the bytes of add_rmsnorm then qkv or gate_up_swiglu:
// the two bit-identical relations in FUSIONS.toml. One warp of the grid (block x 0, warp 0 of each
// row group) writes s. Defines: ACT_*, WEIGHT_*, K_BLOCK, H_BLOCK, ACROSS_*, GEMV_COLS.
#include "gemv.cuh"
#include "head_norm.cuh"  // rms_inv; H_BLOCK
#include "mma.cuh"        // cp_async16

#ifndef WARPS
#define WARPS 4
#endif
#ifndef ROWS_PER_WARP
#define ROWS_PER_WARP 8  // KERNELS.toml's grids divide rows by it
#endif
#ifndef GEMV_COLS
#define GEMV_COLS 1  // qkv's output columns a warp (KERNELS.toml: 2 for bf16 weights, as gemv.cu)
#endif
static_assert(H_BLOCK == 256, "row_norm's order: 32 lanes x 8 consecutive values a block");

// Blocks a multiprocessor, as gemv.cu's entries that stream two weight rows a warp: seven for
// bf16 weights (72 registers), eight otherwise (64); f32 activations (tests) left to ptxas.
#if defined(NORM_GEMV_MIN_BLOCKS)
#elif !defined(ACT_BF16) || defined(WEIGHT_F32)
#define NORM_GEMV_MIN_BLOCKS 0
#elif defined(WEIGHT_BF16)
#define NORM_GEMV_MIN_BLOCKS 7
#else
#define NORM_GEMV_MIN_BLOCKS 8
#endif

// k-blocks of each weight row a warp asks L2 for before the dependent-launch wait: its first two
// loads (gemv.cu's PREFETCH_BLOCKS for bf16, fp8 and fp4 weights).
#define PREFETCH_LOADS (2 * DOT_CHUNKS)

// The warp's part of the launch's shared memory: its row's x and r (k activations each) and the
// norm weights (k bf16), in that order; x's part ends holding the normalized row. KERNELS.toml's
// launch.shared is WARPS k (2 sizeof(act_t) + 2) bytes; a launch given less traps.
extern __shared__ __align__(16) unsigned char gemv_norm_slices[];

__device__ __forceinline__ act_t* warp_slice(int k) {
    const int per = k * (2 * (int)sizeof(act_t) + 2);
    if (dynamic_smem_bytes() < (unsigned)(WARPS * per)) __trap();
    return (act_t*)(gemv_norm_slices + (long)(threadIdx.x >> 5) * per);
}

// Values c .. c + 7 of src into dst, asynchronously (one or two 16-byte copies).
template <class T>
__device__ __forceinline__ void copy8_async(T* dst, const T* src, int c) {
#pragma unroll
    for (int o = 0; o < 8 * (int)sizeof(T); o += 16)
        cp_async16((char*)(dst + c) + o, (const char*)(src + c) + o, 16);
}

// s = round(x + r) and y = rmsnorm(s, wn) of one row of h values, by one warp, in row_norm's
// order (see the header): y into the warp's slice, s also to `s` unless it is null. The row's x,
// r and norm weights come into the slice by asynchronous copies, all in flight at once, so the
// row costs one round trip to L2 and no registers while it waits (call 1 of version 36 loaded
// block by block, each block's loads after the last one's sum: about 3.5 us a row; holding all
// of them in registers spilled at gemv.cu's register bounds). Each lane copies, and reads,
// exactly its own values: lane l the 8 at l * 8 of each H_BLOCK block.
__device__ __forceinline__ void warp_add_rmsnorm(const act_t* x, const act_t* r,
                                                 const __nv_bfloat16* wn, act_t* s, act_t* slice,
                                                 int h, float eps) {
    const int lane = threadIdx.x & 31;
    act_t* xs = slice;
    act_t* rs = slice + h;
    __nv_bfloat16* ws = (__nv_bfloat16*)(slice + 2 * h);
    for (int c = lane * 8; c < h; c += H_BLOCK) {
        copy8_async(xs, x, c);
        copy8_async(rs, r, c);
        copy8_async(ws, wn, c);
    }
    cp_async_commit();
    cp_async_wait<0>();
    float acc = 0.0f;
    for (int b0 = 0; b0 < h; b0 += H_BLOCK) {
        const int c = b0 + lane * 8;
        float sq = 0.0f;
        if (c < h) {
            float v[8], rv[8];
            act8(xs, c, v);
            act8(rs, c, rv);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = act_round(v[i] + rv[i]);
#pragma unroll
            for (int i = 0; i < 8; ++i) sq += v[i] * v[i];
            act8_store(xs, c, v);
            if (s) act8_store(s, c, v);
        }
        sq = warp_sum(sq);
        acc = b0 == 0 ? sq : acc + sq;
    }
    const float inv = rms_inv(acc, h, eps);
    for (int c = lane * 8; c < h; c += H_BLOCK) {
        float v[8], out[8];
        act8(xs, c, v);
        const uint4 wr = *(const uint4*)(ws + c);
        const __nv_bfloat16* wv = (const __nv_bfloat16*)&wr;
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = act_round(v[i] * inv) * __bfloat162float(wv[i]);
        act8_store(xs, c, out);
    }
    __syncwarp();  // the dots read every lane's part of the slice
}

// One warp: N weight rows (w, prefetched before the wait by the caller) against the normalized
// rows row0 .. row0 + nr - 1 of s = x + r, one after another; lane r gets row r's dots in out.
// The warp that writes s for these rows is the caller's choice (`writes_s`).
template <int N>
__device__ __forceinline__ void norm_dots_rows(const act_t* x, const act_t* r,
                                               const __nv_bfloat16* wn, act_t* s, bool writes_s,
                                               int row0, int nr, const WeightRef (&w)[N], int k,
                                               float eps, float (&out)[N]) {
    const int lane = threadIdx.x & 31;
    act_t* slice = warp_slice(k);
#pragma unroll 1
    for (int j = 0; j < nr; ++j) {
        const long o = (long)(row0 + j) * k;
        warp_add_rmsnorm(x + o, r + o, wn, writes_s ? s + o : nullptr, slice, k, eps);
        float d[N];
        warp_dots<N>(slice, w, k, d);
#pragma unroll
        for (int q = 0; q < N; ++q)
            if (lane == j) out[q] = d[q];
        __syncwarp();  // every lane has read the slice before the next row overwrites it
    }
}

// s = round(x + r); y = rmsnorm(s, wn); q, k_, v = y · wqᵀ, y · wkᵀ, y · wvᵀ. Columns as gemv.cu's
// metrale_qkv: [0, nq) of q, then nk of k_, then nv of v, GEMV_COLS consecutive ones a warp.
// grid (ceil((nq + nk + nv) / (WARPS GEMV_COLS)), ceil(rows / ROWS_PER_WARP)), block 32 WARPS.
extern "C" __global__ void __launch_bounds__(32 * WARPS, NORM_GEMV_MIN_BLOCKS)
metrale_add_rmsnorm_qkv(const act_t* __restrict__ x, const act_t* __restrict__ r,
                        const __nv_bfloat16* __restrict__ wn,
                        const void* __restrict__ wq, const void* __restrict__ wq_scale,
                        const float* __restrict__ wq_global,
                        const void* __restrict__ wk, const void* __restrict__ wk_scale,
                        const float* __restrict__ wk_global,
                        const void* __restrict__ wv, const void* __restrict__ wv_scale,
                        const float* __restrict__ wv_global,
                        act_t* __restrict__ s, act_t* __restrict__ q, act_t* __restrict__ k_,
                        act_t* __restrict__ v, int rows, int k, int nq, int nk, int nv,
                        float eps) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n = nq + nk + nv;
    const int col0 = (blockIdx.x * WARPS + warp) * GEMV_COLS, row0 = blockIdx.y * ROWS_PER_WARP;
    const int nr = min(ROWS_PER_WARP, rows - row0);
    if (col0 >= n || nr <= 0) return;  // warp 0 of block 0 always has a column: s is written
    const WeightRef w3[3] = {weight_ref(wq, wq_scale, wq_global),
                             weight_ref(wk, wk_scale, wk_global),
                             weight_ref(wv, wv_scale, wv_global)};
    auto part = [&](int col) { return col < nq ? 0 : col < nq + nk ? 1 : 2; };
    auto first = [&](int p) { return p == 0 ? 0 : p == 1 ? nq : nq + nk; };
    WeightRef ws[GEMV_COLS];
#pragma unroll
    for (int j = 0; j < GEMV_COLS; ++j) {  // past n: the last column again, not stored
        const int col = min(col0 + j, n - 1), p = part(col);
        ws[j] = weight_rows(w3[p], col - first(p), k);
        weight_prefetch<PREFETCH_LOADS>(ws[j], k, K_BLOCK);
    }
    grid_dependency_sync();
    float d[GEMV_COLS];
    norm_dots_rows<GEMV_COLS>(x, r, wn, s, blockIdx.x == 0 && warp == 0, row0, nr, ws, k, eps, d);
#pragma unroll
    for (int j = 0; j < GEMV_COLS; ++j) {
        const int col = col0 + j, p = part(min(col, n - 1));
        if (lane >= nr || col >= n) continue;
        act_t* out = p == 0 ? q : p == 1 ? k_ : v;
        const int np = p == 0 ? nq : p == 1 ? nk : nv;
        out[(long)(row0 + lane) * np + col - first(p)] = act_store(d[j]);
    }
}

// s = round(x + r); y = rmsnorm(s, wn); h = silu(round(y · wgᵀ)) * round(y · wuᵀ), as gemv.cu's
// metrale_gate_up_swiglu: a warp an output column, both weight rows streamed together.
// grid (ceil(n / WARPS), ceil(rows / ROWS_PER_WARP)), block 32 WARPS.
extern "C" __global__ void __launch_bounds__(32 * WARPS, NORM_GEMV_MIN_BLOCKS)
metrale_add_rmsnorm_gate_up_swiglu(const act_t* __restrict__ x, const act_t* __restrict__ r,
                                   const __nv_bfloat16* __restrict__ wn,
                                   const void* __restrict__ wg, const void* __restrict__ wg_scale,
                                   const float* __restrict__ wg_global,
                                   const void* __restrict__ wu, const void* __restrict__ wu_scale,
                                   const float* __restrict__ wu_global,
                                   act_t* __restrict__ s, act_t* __restrict__ h, int rows, int k,
                                   int n, float eps) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int col = blockIdx.x * WARPS + warp, row0 = blockIdx.y * ROWS_PER_WARP;
    const int nr = min(ROWS_PER_WARP, rows - row0);
    if (col >= n || nr <= 0) return;
    const WeightRef w[2] = {weight_rows(weight_ref(wg, wg_scale, wg_global), col, k),
                            weight_rows(weight_ref(wu, wu_scale, wu_global), col, k)};
    weight_prefetch<PREFETCH_LOADS>(w[0], k, K_BLOCK);
    weight_prefetch<PREFETCH_LOADS>(w[1], k, K_BLOCK);
    grid_dependency_sync();
    float gu[2];
    norm_dots_rows<2>(x, r, wn, s, blockIdx.x == 0 && warp == 0, row0, nr, w, k, eps, gu);
    if (lane < nr)
        h[(long)(row0 + lane) * n + col] = act_store(silu_mul(act_round(gu[0]), act_round(gu[1])));
}

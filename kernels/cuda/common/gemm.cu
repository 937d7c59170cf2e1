// Metrale CUDA: GEMM-shaped matmul families on tensor cores (mma.sync, sm_80 and newer): linear,
// linear_add, qkv, gate_up_swiglu and lm_head at their `gemm` points with bf16 activations.
//
// A block computes a BM x BN (64 x 128) tile of y = x · wᵀ with eight warps (2 along m, 4 along
// n), each a 32 x 32 sub-tile in m16n8k16 bf16 MMAs with f32 accumulators for the k-block's
// partial; the finished k-blocks' sum waits in shared memory (TOT_SHARED), so a thread needs
// 78-111 registers and two blocks share an SM. Tiles of BK (64) columns stream through STAGES
// (2) shared-memory buffers: the activations, and bf16 weights, by cp.async; weights of a
// quantized format or f32 through registers, made bf16 on the way.
//
// Version 15's sweep on the H200 (bench_gpu_prefill.py --variants, 15 launches of Llama-3.1-8B
// and Qwen3-0.6B at 64-2048 rows in bf16, fp8 and mxfp4) against version 14's choice (the sum in
// registers, 150-167 of them, one block an SM, 4 stages of 32 columns), geometric mean of the
// speedups: this choice 1.58x; 64 x 128 with the sum in shared at 4 stages of 32 columns and
// two blocks 1.35x, at 2 stages and three blocks 1.40x; 128 x 128 tiles (64 x 32 a warp) 1.14x
// at 4 stages and one block, 1.37x at 2 stages and two blocks (the best at 2048 rows: Llama
// gate_up bf16 2076 us against this choice's 2410, but 2.3x slower at 64 rows), 1.39x at 2
// stages of 64. cuBLAS stays 3-5x faster (Llama gate_up bf16 at 2048 rows: 867 us).
//
// Order (declared in KERNELS.toml): k in blocks of K_BLOCK; a block's partial sum starts from
// zero in the accumulators and takes the block's MMAs in k order (the order inside one MMA is the
// hardware's); the block partials then combine sequentially in f32. The weights reach the MMA
// exactly: fp8's e4m3 values, mxfp4's e2m1 times its power-of-two scale and nvfp4's e2m1 times
// its e4m3 scale all fit bf16; the f32 factor left (fp8's row scale, nvfp4's global scale)
// multiplies the finished sum, where the reference multiplies each weight (KERNELS.toml declares
// that order apart, so no relation counts it the same as the per-weight product).
//
// f32 weights enter as three bf16 parts that sum to each weight exactly (hi, the weight's top 16
// bits; mid and lo, the rest's), three MMAs a k step, lo and mid before hi: products are exact
// in the MMA, so only the summation order is the hardware's. A weight that is exactly bf16 (the
// dequantized values of bf16 and mxfp4) has zero mid and lo; their MMAs add zero products to an
// accumulator that is never -0 (it starts at +0), which leaves it unchanged, so such weights
// give the bf16 or mxfp4 kernel's bytes: the dequant_linear relation stays bit-identical at the
// gemm points (checked on the device). Infinite or NaN activations are the exception (∞ · 0).
//
// Row-invariant: an output row is made of its own activation row only, by the same instructions
// whatever the rows.
//
// Defines: ACT_BF16, WEIGHT_*, K_BLOCK, OUT_F32 (lm_head: f32 logits).
#include "gemv.cuh"
#include "mma.cuh"
#include "mma_weights.cuh"

#if !defined(ACT_BF16)
#error "the tensor-core kernels take bf16 activations (KERNELS.toml's `when`)"
#endif

// The tile's shape (defines override them, for benchmarks/bench_gpu_prefill.py's variants; the
// launch shapes in KERNELS.toml follow the defaults): WARPS_M x WARPS_N warps, each MI m16 tiles
// by NI n8 tiles (NI stays 4: gate_up_swiglu pairs a warp's 16 gate and 16 up rows), k in tiles
// of BK columns.
#ifndef WARPS_M
#define WARPS_M 2
#endif
#ifndef WARPS_N
#define WARPS_N 4
#endif
#ifndef MI
#define MI 2  // m16 tiles per warp: 32 rows
#endif
#define NI 4  // n8 tiles per warp: 32 columns
#ifndef BK
#define BK (PARTS == 1 ? 64 : 32)
#endif
#define BM (WARPS_M * 16 * MI)
#define BN (WARPS_N * 8 * NI)
#define THREADS (32 * WARPS_M * WARPS_N)
#define LDS (BK + 8)  // row pitch in shared memory (bf16): 80 or 144 bytes, so ldmatrix's 8 rows
                      // of 16 bytes fall in 8 distinct bank groups
#define CPR (BK / 8)  // 16-byte chunks a tile row
#ifndef STAGES
#define STAGES 2
#endif
// TOT_SHARED 1: the finished k-blocks' sum lives in shared memory (BM BN f32 after the stages,
// each thread its own entries), touched once a k-block, which frees its registers. f32 weights
// (three planes a stage, 32 columns) keep it in registers: 71680 bytes of shared memory and 196
// registers, one block an SM, as every class's 99 KiB allows.
#ifndef TOT_SHARED
#define TOT_SHARED (PARTS == 1)
#endif
#ifndef GEMM_MIN_BLOCKS
#define GEMM_MIN_BLOCKS (TOT_SHARED ? 2 : 1)
#endif
static_assert(K_BLOCK % BK == 0, "K_BLOCK must be a multiple of the tile's k");
static_assert(BM * CPR % THREADS == 0 && BN * CPR % THREADS == 0,
              "whole 16-byte chunks of the activation and weight tiles per thread");

// Dynamic shared memory: STAGES x (activation tile of BM rows, PARTS weight planes of BN rows),
// rows of LDS bf16, then with TOT_SHARED the sum: KERNELS.toml's launch.shared is
// STAGES (BM + PARTS BN) LDS 2 bytes (+ 4 BM BN).
constexpr int A_TILE = BM * LDS, B_PLANE = BN * LDS, STAGE = A_TILE + PARTS * B_PLANE;

// ------------------------------------------------------------------ tile loads

// This thread's i-th 8-column chunk of a tile: row threadIdx.x / CPR + (THREADS / CPR) i,
// column 8 (threadIdx.x % CPR).
struct TileChunk {
    int r, c;
    __device__ __forceinline__ TileChunk(int i)
        : r(threadIdx.x / CPR + (THREADS / CPR) * i), c(threadIdx.x % CPR * 8) {}
};

// A bf16 tile of ROWS rows (activations, or bf16 weights) into `dst`: rows given by row(r) (a
// pointer to a row of k values, already clamped to a real row), columns k0 + [0, BK), zeros past k.
template <int ROWS, class Row>
__device__ __forceinline__ void load_bf16_tile(bf16* dst, Row row, int k, int k0) {
    const bool aligned = (k & 7) == 0;
#pragma unroll
    for (int i = 0; i < ROWS * BK / 8 / THREADS; ++i) {
        const TileChunk t(i);
        const bf16* src = row(t.r);
        const int c = k0 + t.c;
        if (aligned) cp_async16(dst + t.r * LDS + t.c, src + (c < k ? c : 0), c < k ? 16 : 0);
        else *(uint4*)(dst + t.r * LDS + t.c) = bf16x8_any(src, c, k);
    }
}

#if !defined(WEIGHT_BF16)
// A quantized or f32 weight tile in flight: this thread's two raw chunks, loaded before the MMAs
// of the tile in use and stored (as bf16, or f32's bf16 parts) after them.
struct QuantTile {
    static constexpr int CHUNKS = BN * BK / 8 / THREADS;
    WeightRaw8 raw[CHUNKS];
    bool live[CHUNKS];
    template <class Row>
    __device__ __forceinline__ void fetch(Row row, int k, int k0) {
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
            const TileChunk t(i);
            const int c = k0 + t.c;
            live[i] = c < k;
            if (live[i]) raw[i] = weight8_fetch(row(t.r), c, k);
        }
    }
    __device__ __forceinline__ void store(bf16* dst) const {
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
            const TileChunk t(i);
            uint4 planes[PARTS];
            weight8_planes(raw[i], planes);
#pragma unroll
            for (int p = 0; p < PARTS; ++p)
                *(uint4*)(dst + p * B_PLANE + t.r * LDS + t.c) =
                    live[i] ? planes[p] : make_uint4(0, 0, 0, 0);
        }
    }
};
#endif

// ------------------------------------------------------------------ the main loop

// The block's tile: tot(mi, ni, e) is the f32 sum for row m0 + 16 MI wm + 16 mi + g + 8 (e / 2)
// and tile column 32 wn + 8 ni + 2 t + (e % 2), where g = lane / 4, t = lane % 4 (the MMA's
// layout).
struct Tile {
#if TOT_SHARED
    float* sum;  // entry (mi, ni, e) of thread i at sum[((mi NI + ni) 4 + e) THREADS + i]
    __device__ __forceinline__ float& tot(int mi, int ni, int e) const {
        return sum[((mi * NI + ni) * 4 + e) * THREADS + threadIdx.x];
    }
#else
    float sum[MI][NI][4];
    __device__ __forceinline__ float& tot(int mi, int ni, int e) { return sum[mi][ni][e]; }
    __device__ __forceinline__ float tot(int mi, int ni, int e) const { return sum[mi][ni][e]; }
#endif
    int wm, wn, g, t;
};

// x rows m0 + [0, BM) (clamped to rows) against weight rows wrow(b) for tile rows b in [0, BN),
// where wrow gives the WeightRef of a row already clamped to a real one.
template <class WRow>
__device__ __forceinline__ void gemm_tile(const act_t* x, int rows, int k, int m0, WRow wrow,
                                          Tile& out) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* smem = reinterpret_cast<bf16*>(smem_raw);
    auto a_tile = [&](int s) { return smem + s * STAGE; };
    auto b_tile = [&](int s) { return smem + s * STAGE + A_TILE; };
#if TOT_SHARED
    out.sum = reinterpret_cast<float*>(smem + STAGES * STAGE);
#endif
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    out.wm = warp / WARPS_N;
    out.wn = warp % WARPS_N;
    out.g = lane >> 2;
    out.t = lane & 3;
    auto xrow = [&](int r) { return x + (long)min(m0 + r, rows - 1) * k; };
#if defined(WEIGHT_BF16)
    auto brow = [&](int b) { return (const bf16*)wrow(b).data; };
    auto load_b = [&](int s, int k0) { load_bf16_tile<BN>(b_tile(s), brow, k, k0); };
#else
    auto load_b = [&](int s, int k0) {
        QuantTile q;
        q.fetch(wrow, k, k0);
        q.store(b_tile(s));
    };
#endif
    const int ktiles = (k + BK - 1) / BK;
    constexpr int TILES_PER_BLOCK = K_BLOCK / BK;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < ktiles) {
            load_bf16_tile<BM>(a_tile(s), xrow, k, s * BK);
            load_b(s, s * BK);
        }
        cp_async_commit();
    }

    float acc[MI][NI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.0f;

    for (int kt = 0; kt < ktiles; ++kt) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile kt is in; every warp is done with the buffer refilled below
        const int next = kt + STAGES - 1, ns = next % STAGES;
#if !defined(WEIGHT_BF16)
        QuantTile q;
#endif
        if (next < ktiles) {
            load_bf16_tile<BM>(a_tile(ns), xrow, k, next * BK);
#if defined(WEIGHT_BF16)
            load_b(ns, next * BK);
#else
            q.fetch(wrow, k, next * BK);
#endif
        }
        cp_async_commit();

        const bf16* as = a_tile(kt % STAGES);
        const bf16* bs = b_tile(kt % STAGES);
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            uint32_t a[MI][4];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
                ldmatrix_x4(a[mi], as + (out.wm * 16 * MI + mi * 16 + (lane & 15)) * LDS + kk +
                                       (lane >> 4) * 8);
#pragma unroll
            for (int p = PARTS - 1; p >= 0; --p) {  // f32: lo, mid, then hi
                uint32_t b[NI][2];
#pragma unroll
                for (int j = 0; j < NI / 2; ++j) {
                    uint32_t r[4];
                    ldmatrix_x4(r, bs + p * B_PLANE +
                                       (out.wn * 32 + j * 16 + (lane & 7) + ((lane >> 4) << 3)) *
                                           LDS +
                                       kk + ((lane >> 3) & 1) * 8);
                    b[2 * j][0] = r[0];
                    b[2 * j][1] = r[1];
                    b[2 * j + 1][0] = r[2];
                    b[2 * j + 1][1] = r[3];
                }
#pragma unroll
                for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                    for (int ni = 0; ni < NI; ++ni)
                        mma_bf16(acc[mi][ni], a[mi], b[ni][0], b[ni][1]);
            }
        }
#if !defined(WEIGHT_BF16)
        if (next < ktiles) q.store(b_tile(ns));
#endif
        // the end of a k-block: its partial joins the sum, sequentially
        if ((kt + 1) % TILES_PER_BLOCK == 0 || kt + 1 == ktiles) {
            const bool first = kt < TILES_PER_BLOCK;
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        out.tot(mi, ni, e) =
                            first ? acc[mi][ni][e] : out.tot(mi, ni, e) + acc[mi][ni][e];
                        acc[mi][ni][e] = 0.0f;
                    }
        }
    }
    cp_async_wait<0>();
}

// Every output of a plain tile (linear, lm_head, linear_add, qkv): store(i, d) for row-major
// index i of an n-column output and the finished, scaled dot d, inside rows x n.
template <class Store>
__device__ __forceinline__ void store_tile(const Tile& tl, int m0, int n0, int rows, int n,
                                           WeightRef w, Store store) {
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
            const int col = n0 + tl.wn * 32 + ni * 8 + 2 * tl.t + e2;
            if (col >= n) continue;
            const float f = row_factor(weight_rows(w, col, 0));
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = m0 + tl.wm * 16 * MI + mi * 16 + tl.g + 8 * h;
                    if (row < rows)
                        store((long)row * n + col, scaled(tl.tot(mi, ni, 2 * h + e2), f));
                }
        }
}

// One plain tile: grid (ceil(rows / BM), ceil(n / BN)).
template <class Store>
__device__ __forceinline__ void linear_tile(const act_t* x, WeightRef w, int rows, int k, int n,
                                            int n0, Store store) {
    grid_dependency_sync();
    const int m0 = blockIdx.x * BM;
    Tile tl;
    gemm_tile(x, rows, k, m0, [&](int b) { return weight_rows(w, min(n0 + b, n - 1), k); }, tl);
    store_tile(tl, m0, n0, rows, n, w, store);
}

// grid (ceil(rows / 64), ceil(n / 128)), block 256. y = x · wᵀ.
extern "C" __global__ void __launch_bounds__(THREADS, GEMM_MIN_BLOCKS)
metrale_linear_mma(const act_t* __restrict__ x, const void* __restrict__ w,
                   const void* __restrict__ w_scale, const float* __restrict__ w_global,
                   out_t* __restrict__ y, int rows, int k, int n) {
    linear_tile(x, weight_ref(w, w_scale, w_global), rows, k, n, blockIdx.y * BN,
                [&](long i, float d) { y[i] = out_store(d); });
}

// y = round(round(x · wᵀ) + r), as linear then add.
extern "C" __global__ void __launch_bounds__(THREADS, GEMM_MIN_BLOCKS)
metrale_linear_add_mma(const act_t* __restrict__ x, const void* __restrict__ w,
                       const void* __restrict__ w_scale, const float* __restrict__ w_global,
                       const act_t* __restrict__ r, act_t* __restrict__ y, int rows, int k,
                       int n) {
    linear_tile(x, weight_ref(w, w_scale, w_global), rows, k, n, blockIdx.y * BN,
                [&](long i, float d) { y[i] = act_store(act_round(d) + act_load(r[i])); });
}

// q, k_, v in one launch: grid y counts q's column tiles, then k_'s, then v's.
extern "C" __global__ void __launch_bounds__(THREADS, GEMM_MIN_BLOCKS)
metrale_qkv_mma(const act_t* __restrict__ x,
                const void* __restrict__ wq, const void* __restrict__ wq_scale,
                const float* __restrict__ wq_global,
                const void* __restrict__ wk, const void* __restrict__ wk_scale,
                const float* __restrict__ wk_global,
                const void* __restrict__ wv, const void* __restrict__ wv_scale,
                const float* __restrict__ wv_global,
                act_t* __restrict__ q, act_t* __restrict__ k_, act_t* __restrict__ v,
                int rows, int k, int nq, int nk, int nv) {
    const int tq = (nq + BN - 1) / BN, tk = (nk + BN - 1) / BN, tile = blockIdx.y;
    const int part = tile < tq ? 0 : tile < tq + tk ? 1 : 2;
    const int n0 = (tile - (part == 0 ? 0 : part == 1 ? tq : tq + tk)) * BN;
    const WeightRef w = part == 0   ? weight_ref(wq, wq_scale, wq_global)
                        : part == 1 ? weight_ref(wk, wk_scale, wk_global)
                                    : weight_ref(wv, wv_scale, wv_global);
    act_t* out = part == 0 ? q : part == 1 ? k_ : v;
    linear_tile(x, w, rows, k, part == 0 ? nq : part == 1 ? nk : nv, n0,
                [&](long i, float d) { out[i] = act_store(d); });
}

// h = silu(round(x · wgᵀ)) * round(x · wuᵀ) for BN / 2 columns a block: a warp's 32 weight
// rows are 16 gate rows and the same 16 columns' up rows, so its n8 tiles 0, 1 (gate) and 2, 3
// (up) hold the two dots of the same outputs. grid (ceil(rows / 64), ceil(n / 64)).
extern "C" __global__ void __launch_bounds__(THREADS, GEMM_MIN_BLOCKS)
metrale_gate_up_swiglu_mma(const act_t* __restrict__ x,
                           const void* __restrict__ wg, const void* __restrict__ wg_scale,
                           const float* __restrict__ wg_global,
                           const void* __restrict__ wu, const void* __restrict__ wu_scale,
                           const float* __restrict__ wu_global,
                           act_t* __restrict__ h, int rows, int k, int n) {
    grid_dependency_sync();
    const WeightRef g = weight_ref(wg, wg_scale, wg_global);
    const WeightRef u = weight_ref(wu, wu_scale, wu_global);
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * (BN / 2);
    auto col_of = [&](int b) { return n0 + (b >> 5) * 16 + (b & 15); };  // tile row b's column
    Tile tl;
    gemm_tile(x, rows, k, m0,
              [&](int b) { return weight_rows(b & 16 ? u : g, min(col_of(b), n - 1), k); }, tl);
#pragma unroll
    for (int ni = 0; ni < 2; ++ni)
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
            const int col = col_of(tl.wn * 32 + ni * 8 + 2 * tl.t + e2);
            if (col >= n) continue;
            const float fg = row_factor(weight_rows(g, col, 0));
            const float fu = row_factor(weight_rows(u, col, 0));
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int row = m0 + tl.wm * 16 * MI + mi * 16 + tl.g + 8 * hh;
                    if (row >= rows) continue;
                    const float gd = scaled(tl.tot(mi, ni, 2 * hh + e2), fg);
                    const float ud = scaled(tl.tot(mi, ni + 2, 2 * hh + e2), fu);
                    h[(long)row * n + col] = act_store(silu_mul(act_round(gd), act_round(ud)));
                }
        }
}

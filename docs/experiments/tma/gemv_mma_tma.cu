// Metrale CUDA, experiment: gemv_mma.cu's tensor-core GEMV with its weights staged by the Tensor
// Memory Accelerator, for the quantized formats whose GEMVs stop short of the copy rate.
//
// Why: at Llama-3.1-8B's shapes the fp4 tensor-core GEMVs move 1.2-2.1 TB/s and fp8's about 3.2
// (docs/gpu-notes.md, versions 32-34). Each lane loads its 16-byte chunks into registers a round
// or two ahead, so the bytes a multiprocessor has in flight are bounded by registers, and every
// load's latency sits in a warp's chain. Version 33 staged them through shared memory with
// cp.async and lost: each lane issued its own copies, which added the copies' addressing and
// waits to a loop already near its issue limit. Here warp 0's lanes issue one large bulk copy
// per row and stage (a row's bytes for eight k-blocks), so the warps' loop loses its global loads'
// latency and gains no instruction but a 16-byte shared load where the global one was.
//
// Work and order are gemv_mma.cu's: a block owns GROUP (16) output columns of T tiles and up to
// 8 activation rows; warp w takes k-blocks w, w + WARPS, ...; a k-block's partial starts from
// zero, goes to shared memory, and the partials are summed in k-block order. Only where a lane's
// weight chunks come from differs, so the outputs are gemv_mma.cu's bytes.
//
// Stages: stage s is columns [s S, (s + 1) S) with S = WARPS K_BLOCK, one k-block for each warp
// (warp w's s-th k-block). A ring of TMA_STAGES slots, each the T x 16 rows' bytes of a stage
// (rows 64 bytes apart beyond their length, so that the two rows of a quarter-warp's 16-byte
// loads fall in different banks) and their scales. full[i] completes when slot i's copies have
// landed (thread 0's arrival and their bytes), empty[i] when every warp has read it (one arrival
// a warp); warp 0 then copies stage s + TMA_STAGES into it, a row's copies a lane. The first
// stages are copied before the dependent-launch wait (no launch writes weights).
//
// Needs k a multiple of 512 (every copy whole 16-byte units, scales included); traps otherwise.
// Defines: as gemv_mma.cu, and TMA_STAGES (slots in the ring, default 3).
#include "gemv_mma.cu"
#include "tma.cuh"

#ifndef TMA_STAGES
#define TMA_STAGES 3
#endif
#define STAGE_COLS (WARPS * K_BLOCK)

// Bytes of `cols` columns of one weight row: its data, and its block scales.
__device__ __forceinline__ int data_bytes(int cols) {
#if defined(WEIGHT_BF16)
    return 2 * cols;
#elif defined(WEIGHT_FP8)
    return cols;
#else
    return cols / 2;
#endif
}
__device__ __forceinline__ int scale_bytes(int cols) {
#if defined(WEIGHT_MXFP4)
    return cols / 32;
#elif defined(WEIGHT_NVFP4)
    return cols / 16;
#else
    (void)cols;
    return 0;
#endif
}

// The ring in shared memory after the k-block partials: the slots, then full[] and empty[].
template <int T>
struct Ring {
    // a slot: T x 16 data rows, then T x 16 scale rows
    int data_stride, scale_stride, slot_bytes;
    unsigned char* base;
    uint64_t* bars;
    __device__ Ring(unsigned char* at) : base(at) {
        data_stride = data_bytes(STAGE_COLS) + 64;  // 64 mod 128: row pairs in other banks
        scale_stride = scale_bytes(STAGE_COLS) ? scale_bytes(STAGE_COLS) + 16 : 0;
        slot_bytes = T * GROUP * (data_stride + scale_stride);
        bars = (uint64_t*)(base + TMA_STAGES * slot_bytes);
    }
    __device__ unsigned char* data(int slot, int j, int m) const {
        return base + slot * slot_bytes + (j * GROUP + m) * data_stride;
    }
    __device__ unsigned char* scale(int slot, int j, int m) const {
        return base + slot * slot_bytes + T * GROUP * data_stride + (j * GROUP + m) * scale_stride;
    }
    __device__ uint64_t* full(int slot) const { return bars + slot; }
    __device__ uint64_t* empty(int slot) const { return bars + TMA_STAGES + slot; }
    __device__ unsigned bytes() const { return TMA_STAGES * slot_bytes + 2 * TMA_STAGES * 8; }
};

// The k-block partials' bytes (gemv_mma.cu's launch.shared), rounded up to 128: where the ring
// starts.
__device__ __forceinline__ int partial_bytes(int k, int T) {
    return ((k + K_BLOCK - 1) / K_BLOCK * T * GROUP * XROWS * 4 + 127) & ~127;
}

// A lane's C chunks of one staged row at local column lc (of the stage), and their scales.
__device__ __forceinline__ WeightChunks<C> chunks_staged(const unsigned char* data,
                                                         const unsigned char* scale, int lc) {
    WeightChunks<C> r;
#if defined(WEIGHT_BF16)
    r.one.v = *(const uint4*)(data + data_bytes(lc));
#else
    r.v = *(const uint4*)(data + data_bytes(lc));
#if defined(WEIGHT_MXFP4)
    r.s = scale[lc / 32];
#elif defined(WEIGHT_NVFP4)
    r.s = *(const uint16_t*)(scale + lc / 16);
#endif
#endif
    (void)scale;
    return r;
}

// gemv_mma_partials with the weights from the ring: every k-block partial of the block's T x 16
// rows (wrow(j, m), clamped to real rows) against activation rows x[0, nr), into `part`.
template <int T, class WRow>
__device__ __forceinline__ void gemv_mma_partials_tma(const act_t* x, int nr, int k, WRow wrow,
                                                      float* part) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int nkb = (k + K_BLOCK - 1) / K_BLOCK, nst = (k + STAGE_COLS - 1) / STAGE_COLS;
    const int mine = warp < nkb ? (nkb - 1 - warp) / WARPS + 1 : 0;  // this warp's stages
    const Ring<T> ring((unsigned char*)part + partial_bytes(k, T));
    if ((k & 511) || dynamic_smem_bytes() < (unsigned)partial_bytes(k, T) + ring.bytes())
        __trap();
    auto issue = [&](int st) {  // warp 0: stage st's rows into its slot, a row's copies a lane
        const int slot = st % TMA_STAGES, c0 = st * STAGE_COLS, cols = min(STAGE_COLS, k - c0);
        const int db = data_bytes(cols), sb = scale_bytes(cols);
        if (lane == 0) tx_expect(ring.full(slot), (unsigned)(T * GROUP * (db + sb)));
        __syncwarp();  // armed before any copy can complete
        for (int i = lane; i < T * GROUP; i += 32) {
            const int j = i / GROUP, m = i % GROUP;
            const WeightRef r = wrow(j, m);
            bulk_copy(ring.data(slot, j, m), (const unsigned char*)r.data + data_bytes(c0),
                      (unsigned)db, ring.full(slot));
            if (sb)
                bulk_copy(ring.scale(slot, j, m), (const unsigned char*)r.scale + scale_bytes(c0),
                          (unsigned)sb, ring.full(slot));
        }
    };
    if (warp == 0) {
        if (lane == 0)
            for (int i = 0; i < TMA_STAGES; ++i) {
                tx_init(ring.full(i));
                tx_init(ring.empty(i), WARPS);
            }
        __syncwarp();  // the barriers are initialized before the lanes' copies count on them
        for (int st = 0; st < min(TMA_STAGES, nst); ++st) issue(st);
    }
    grid_dependency_sync();
    __syncthreads();  // the barriers are initialized
    const act_t* xr = x + (long)min(g, nr - 1) * k;
    float acc[T][4];
    WeightChunks<C> wr[T][2];
    uint4 xa[2][C];
    auto col = [&](int st, int r) {  // the lane's column: stage st, round r of its k-block
        return (warp + WARPS * st) * K_BLOCK + r * ROUND + 8 * C * t;
    };
    if (mine > 0) round_x(xa[0], xr, g < nr, col(0, 0), k);
#pragma unroll 1
    for (int st = 0; st < mine; ++st) {
        const int slot = st % TMA_STAGES;
        tx_wait(ring.full(slot), (unsigned)(st / TMA_STAGES) & 1u);
#pragma unroll
        for (int j = 0; j < T; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
#pragma unroll
        for (int r = 0; r < ROUNDS; ++r) {
            const int c = col(st, r), lc = c - st * STAGE_COLS, u = (st * ROUNDS + r) & 1;
            const bool last = st + 1 == mine && r + 1 == ROUNDS;
            if (!last)  // the next round's activations, while this one multiplies
                round_x(xa[u ^ 1], xr, g < nr,
                        r + 1 < ROUNDS ? col(st, r + 1) : col(st + 1, 0), k);
#pragma unroll
            for (int j = 0; j < T; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    if (c < k) {
                        wr[j][h] = chunks_staged(ring.data(slot, j, g + 8 * h),
                                                 ring.scale(slot, j, g + 8 * h), lc);
                    } else {
                        wr[j][h] = WeightChunks<C>{};
#if defined(WEIGHT_MXFP4)
                        wr[j][h].s = 127u;  // scale 1: the zero chunk stays zero
#endif
                    }
                }
            round_mmas<T>(acc, wr, xa[u]);
        }
        store_partials<T>(part, warp + WARPS * st, acc);
        __syncwarp();
        if (lane == 0) tx_arrive(ring.empty(slot));
        if (warp == 0 && st + TMA_STAGES < nst) {  // refill the slot once every warp has read it
            tx_wait(ring.empty(slot), (unsigned)(st / TMA_STAGES) & 1u);
            issue(st + TMA_STAGES);
        }
    }
    __syncthreads();
}

// grid (ceil(n / 16), ceil(rows / 8)), block 32 WARPS; shared: partial_bytes(k, 1) and the
// ring's. y = x · wᵀ, gemv_mma.cu's bytes.
extern "C" __global__ void __launch_bounds__(THREADS)
metrale_linear_gemv_mma_tma(const act_t* __restrict__ x, const void* __restrict__ w,
                            const void* __restrict__ w_scale, const float* __restrict__ w_global,
                            out_t* __restrict__ y, int rows, int k, int n) {
    const WeightRef wr = weight_ref(w, w_scale, w_global);
    const int n0 = blockIdx.x * GROUP, row0 = blockIdx.y * XROWS, nr = min(XROWS, rows - row0);
    gemv_mma_partials_tma<1>(
        x + (long)row0 * k, nr, k,
        [&](int, int m) { return weight_rows(wr, min(n0 + m, n - 1), k); }, gemv_mma_part);
    const int m = threadIdx.x / XROWS, r = threadIdx.x % XROWS;
    if (m < GROUP && r < nr && n0 + m < n) {
        const float d = gemv_mma_sum<1>(gemv_mma_part, k, 0, m, r);
        y[(long)(row0 + r) * n + n0 + m] = out_store(scaled(d, row_factor(weight_rows(wr, n0 + m,
                                                                                      0))));
    }
}

// h = silu(round(x · wgᵀ)) * round(x · wuᵀ), gemv_mma.cu's bytes; shared: partial_bytes(k, 2)
// and the ring's.
extern "C" __global__ void __launch_bounds__(THREADS)
metrale_gate_up_swiglu_gemv_mma_tma(const act_t* __restrict__ x,
                                    const void* __restrict__ wg, const void* __restrict__ wg_scale,
                                    const float* __restrict__ wg_global,
                                    const void* __restrict__ wu, const void* __restrict__ wu_scale,
                                    const float* __restrict__ wu_global,
                                    act_t* __restrict__ h, int rows, int k, int n) {
    const WeightRef g = weight_ref(wg, wg_scale, wg_global);
    const WeightRef u = weight_ref(wu, wu_scale, wu_global);
    const int n0 = blockIdx.x * GROUP, row0 = blockIdx.y * XROWS, nr = min(XROWS, rows - row0);
    gemv_mma_partials_tma<2>(
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

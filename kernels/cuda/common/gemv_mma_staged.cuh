// Metrale CUDA: gemv_mma.cuh's k-block partials with the loads waiting in shared memory rather
// than in registers, for the experts' GEMVs (moe_mma.cu).
//
// Why: an expert's GEMV is short, a dozen k-blocks of one activation row (gpt-oss-20b's k of
// 2880), so each warp runs a few rounds of loads and its time is the trips to memory it waits out
// one after another. gemv_mma_partials holds the rounds in flight in registers, and registers are
// what decide how many blocks a multiprocessor holds: the mxfp4 gate/up entries kept one round
// ahead (two spill), so each round waited out a whole trip. Here each lane's 16-byte weight
// chunks go by cp.async into a ring of AHEAD rounds in shared memory (a thread's own slots, so no
// barrier sits between its copy and its read), their scales wait in registers (a word a chunk),
// and the block's activation rows are staged in shared memory once; no register holds data in
// flight.
//
// The same MMAs on the same fragments in the same order as gemv_mma_partials: the partials, and
// so every output, are the same bits (the emulation compares the two).
#pragma once
#include "gemv_mma.cuh"

// Where C chunks of one weight row from column c keep their 16 bytes of data (chunks_load's
// address).
__device__ __forceinline__ const void* chunks_data(WeightRef w, int c) {
#if defined(WEIGHT_BF16)
    return (const __nv_bfloat16*)w.data + c;
#elif defined(WEIGHT_FP8)
    return (const uint8_t*)w.data + c;
#else
    return (const uint8_t*)w.data + c / 2;
#endif
}

// The scales those chunks use, as chunks_load reads them (fp4; 0 for the others).
__device__ __forceinline__ uint32_t chunks_scale(WeightRef w, int c) {
#if defined(WEIGHT_MXFP4)
    return ((const uint8_t*)w.scale)[c / 32];
#elif defined(WEIGHT_NVFP4)
    return *(const uint16_t*)((const uint8_t*)w.scale + c / 16);
#else
    (void)w;
    (void)c;
    return 0u;
#endif
}

// The chunks from their 16 bytes of data and their scales.
__device__ __forceinline__ WeightChunks<C> chunks_of(uint4 v, uint32_t s) {
    WeightChunks<C> r;
#if defined(WEIGHT_BF16)
    r.one.v = v;
    (void)s;
#elif defined(WEIGHT_FP8)
    r.v = v;
    (void)s;
#else
    r.v = v;
    r.s = s;
#endif
    return r;
}

// The scale of a chunk past the row's end, whose 16 bytes are zero: mxfp4's 1 (127), so the
// chunk stays zero, as gemv_mma_partials' zero chunk.
#if defined(WEIGHT_MXFP4)
#define ZERO_CHUNK_SCALE 127u
#else
#define ZERO_CHUNK_SCALE 0u
#endif

// Shared memory the staging takes: the activation rows (nr k bf16 values, k % 8 == 0) and the
// ring (AHEAD rounds x T tiles x two rows x 16 bytes a thread).
template <int T, int AHEAD>
__device__ __forceinline__ int staged_bytes(int nr, int k) {
    return 2 * nr * k + AHEAD * T * 2 * THREADS * 16;
}

// gemv_mma_partials (same arguments, same partials) with its loads staged in `stage`, shared
// memory of staged_bytes<T, AHEAD>(nr, k) (16-byte aligned): the activation rows first, then the
// ring. A round's group of copies is committed whether or not it copies anything, so round s's
// group is always the oldest of the AHEAD in flight when round s waits for it.
template <int T, int AHEAD, class WRow>
__device__ __forceinline__ void gemv_mma_partials_staged(const act_t* x, int nr, int k, WRow wrow,
                                                         float* part, act_t* stage) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int nkb = (k + K_BLOCK - 1) / K_BLOCK;
    const int mine = warp < nkb ? (nkb - 1 - warp) / WARPS + 1 : 0;  // k-blocks of this warp
    const int steps = mine * ROUNDS;
    WeightRef w[T][2];
#pragma unroll
    for (int j = 0; j < T; ++j) {
        w[j][0] = wrow(j, g);
        w[j][1] = wrow(j, g + 8);
    }
    auto col = [&](int s) {  // as gemv_mma_partials' step s
        return (warp + WARPS * (s / ROUNDS)) * K_BLOCK + (s % ROUNDS) * ROUND + 8 * C * t;
    };
    uint4* ring = reinterpret_cast<uint4*>(stage + nr * k);
    auto slot = [&](int u, int j, int h) {
        return ring + ((u * T + j) * 2 + h) * THREADS + threadIdx.x;
    };
    uint32_t sc[AHEAD][T][2];
    auto copy = [&](int u, int s) {  // round s into slot u; past the row: zeros, scale 1
        const int c = col(s);
        const bool live = s < steps && c < k;
#pragma unroll
        for (int j = 0; j < T; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                cp_async16(slot(u, j, h), live ? chunks_data(w[j][h], c) : w[j][h].data,
                           live ? 16 : 0);
                sc[u][j][h] = live ? chunks_scale(w[j][h], c) : ZERO_CHUNK_SCALE;
            }
        cp_async_commit();
    };
#pragma unroll
    for (int u = 0; u < AHEAD; ++u) copy(u, u);
    grid_dependency_sync();
    for (int i = threadIdx.x; i < nr * k / 8; i += THREADS)  // the activation rows, once
        reinterpret_cast<uint4*>(stage)[i] = reinterpret_cast<const uint4*>(x)[i];
    __syncthreads();
    const act_t* xr = stage + min(g, nr - 1) * k;

    float acc[T][4];
    WeightChunks<C> wr[T][2];
    uint4 xa[C];
    for (int s0 = 0; s0 < steps; s0 += AHEAD) {
#pragma unroll
        for (int u = 0; u < AHEAD; ++u) {
            const int s = s0 + u;
            if (s >= steps) break;
            if (s % ROUNDS == 0)
#pragma unroll
                for (int j = 0; j < T; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
            cp_async_wait<AHEAD - 1>();
#pragma unroll
            for (int j = 0; j < T; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h) wr[j][h] = chunks_of(*slot(u, j, h), sc[u][j][h]);
            round_x(xa, xr, g < nr, col(s), k);
            round_mmas<T>(acc, wr, xa);
            copy(u, s + AHEAD);
            if (s % ROUNDS == ROUNDS - 1) store_partials<T>(part, warp + WARPS * (s / ROUNDS), acc);
        }
    }
    cp_async_wait<0>();  // no copy outlives the block
    __syncthreads();
}

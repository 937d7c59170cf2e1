// Metrale CUDA, sm_90a: the GEMM-shaped points with bf16 activations on Hopper's warpgroup MMA
// (wgmma): linear, linear_add, qkv, gate_up_swiglu and lm_head at their `gemm` points, in every
// weight format. A residual of the sm_90 class: it shadows gemm.cu (mma.sync) at those points
// because wgmma reads both operands from shared memory itself, where mma.sync brings every
// fragment through the registers with ldmatrix (docs/gpu-notes.md, version 25).
//
// A block of two warpgroups (256 threads) computes a 128 x 128 tile of y = x · wᵀ: warpgroup i
// the 64 rows 64 i + [0, 64), all 128 columns, in m64n128k16 wgmmas with f32 accumulators in
// registers (64 a thread). Tiles of BK = 64 columns (128 bytes a row) come into STAGES
// shared-memory stages laid out as wgmma's 128-byte swizzle wants (16-byte piece p of row r at
// piece p ^ (r % 8), 8-row groups of 1024 bytes, each stage 1024-byte aligned); tile kt + AHEAD
// is in flight while tile kt's wgmmas run and tile kt - 1's may still. The activations, and bf16
// weights, come by cp.async into their stage. fp8 and fp4 weights come by cp.async too, raw,
// into slots after the stages (AHEAD tiles in flight, as bf16's), and each thread makes its own
// pieces of tile kt + 1 bf16 in that tile's stage while tile kt's wgmmas run; f32 weights come
// through registers, one tile in flight. Either way exactly (mma_weights.cuh), f32 as three
// planes.
//
// Up to 64 rows (KERNELS.toml launches 128 threads there) a block is one warpgroup and its tile
// 64 x 128, in SMALL_STAGES stages of 24 KiB: two blocks share an SM where the 128-row tile's
// 32 KiB stages and idle second warpgroup allowed one. The warpgroup issues the same wgmmas on
// the same swizzled rows as either warpgroup of a 256-thread block, so each row's bytes do not
// depend on the block size (the order below, and row invariance, hold across both). Where those
// blocks are too few to keep the GPU busy, the launch splits k (grid z, `splits`): split z takes
// k-blocks [z per, (z + 1) per), per = ceil(nkb / splits), and leaves each k-block's partial
// (from zero, as below) in a workspace (`ws`); the combine launch (the table's `then`) adds
// them up one by one in k order and finishes the outputs: the same additions in the same order,
// so the same bytes, as the unsplit launch.
//
// Order (declared in KERNELS.toml, "wgmma"): k in blocks of K_BLOCK; a block's partial starts
// from zero (its first wgmma does not add the accumulator) and takes the block's wgmmas in k
// order (an f32 weight's lo, mid, then hi plane at each k step; the order inside one wgmma is
// the hardware's); the block partials combine sequentially in f32, in a second set of 64
// registers. fp8's row scale and nvfp4's global scale multiply the finished sum ("wgmma_scaled").
// Row-invariant: an output row is made of its own activation row only, by the same instructions
// whatever the rows.
//
// Defines: ACT_BF16, WEIGHT_*, K_BLOCK, OUT_F32 (lm_head: f32 logits).
#include "mma_weights.cuh"
#include "wgmma.cuh"

#if !defined(ACT_BF16)
#error "gemm_wgmma.cu takes bf16 activations (KERNELS.toml's `when`)"
#endif

#define BN 128
#define BK 64
#ifndef STAGES
#define STAGES (PARTS == 1 ? 4 : 3)
#endif
#ifndef SMALL_STAGES
#define SMALL_STAGES 4
#endif
constexpr int TILE_BYTES = 128 * 128;  // 128 rows of 128 bytes: a weight tile (or plane)
// bits of a weight staged raw (RawWeights below): fp8 and fp4; bf16 goes straight into its
// stage, f32 through registers
#if defined(WEIGHT_FP8)
#define RAW_BITS 8
#elif defined(WEIGHT_MXFP4) || defined(WEIGHT_NVFP4)
#define RAW_BITS 4
#else
#define RAW_BITS 0
#endif
// 1: blocks of one warpgroup (up to 64 rows) stage raw too, as blocks of two do; 0: they take
// the register path. Version 28's variant run measured raw 1.03-1.30x as fast as registers at
// 16-64 rows in fp8, 0.97-1.05x in mxfp4 and 0.79-0.97x in nvfp4, whose scales then came as two
// byte loads (docs/gpu-notes.md). With the register path in one block size and the raw one in
// the other, the qkv entry spilled (mxfp4 and nvfp4); raw in both, nothing spills.
#ifndef RAW_SMALL
#define RAW_SMALL 1
#endif
static_assert(K_BLOCK % BK == 0, "K_BLOCK must be a multiple of the tile's k");

// A block of WGS warpgroups: its tile's rows, its threads and its stages. A stage holds the
// activation tile (bm rows of 128 bytes), then the weight planes. KERNELS.toml's launch.shared
// is stages * stage_bytes + 1024 (the alignment of the first stage).
template <int WGS>
struct Block {
    static constexpr int threads = 128 * WGS, bm = 64 * WGS;
    static constexpr int act_bytes = bm * 128, stage_bytes = act_bytes + PARTS * TILE_BYTES;
    static constexpr int stages = WGS == 2 ? STAGES : SMALL_STAGES;
    // tiles in flight beyond the one in use and the one before it
    static constexpr int ahead = stages - 2;
    static_assert(ahead >= 1, "at least one tile in flight");
    // after the stages, a raw-staged weight's slots (RawWeights), one a tile in flight, each 128
    // rows of BK weights; KERNELS.toml's launch.shared adds them
    static constexpr bool raw = RAW_BITS > 0 && (WGS == 2 || RAW_SMALL);
    static constexpr int raw_row_bytes = raw ? RAW_BITS * BK / 8 : 0;
};

// ------------------------------------------------------------------ wgmma

// Where the 16-byte piece p of tile row r lies in its stage: 128-byte rows, the piece index
// exchanged with the row's place in its 8-row group (the 128-byte swizzle).
__device__ __forceinline__ int swizzled(int r, int p) { return r * 128 + ((p ^ (r & 7)) << 4); }

// d = a · bᵀ (+ d when add) for a 64 x 16 activation slice and a 128 x 16 weight slice.
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t a, uint64_t b, int add) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b), "r"(add)
        : "memory");
}

// ------------------------------------------------------------------ the main loop

// The thread's place in the tile: warpgroup wg (rows 64 wg + [0, 64)), and in the accumulator
// fragment register 4 j + e holds row 64 wg + 16 w + g + 8 (e / 2), column 8 j + 2 t + e % 2
// (w the warp in its warpgroup, g = lane / 4, t = lane % 4).
struct Place {
    int wg, w, g, t;
    __device__ Place()
        : wg(threadIdx.x >> 7), w((threadIdx.x >> 5) & 3), g((threadIdx.x & 31) >> 2),
          t(threadIdx.x & 3) {}
    __device__ int row(int i) const { return 64 * wg + 16 * w + g + 8 * ((i & 3) >> 1); }
    __device__ int col(int i) const { return 8 * (i >> 2) + 2 * t + (i & 1); }
};

// The 16-byte pieces a thread copies of ROWS rows of a bf16 matrix into a swizzled tile, tile
// after tile: piece i is row r0 + i STEP (r0 = thread / 8, STEP = THREADS / 8), piece p = thread
// % 8 of the tile's 128 bytes, so every piece of a thread lies at the same columns and the same
// swizzle. The rows' addresses (row(r): rows already clamped to real ones) are found once; a
// tile adds its columns to them. Zeros past k; rows not 16-byte aligned (k % 8) go through
// registers. An Nsight Compute profile had the GEMM bound by instruction issue, with each
// piece's row, bounds and swizzle worked out again every tile (docs/gpu-notes.md, version 29).
template <int ROWS, int THREADS>
struct TileRows {
    static constexpr int N = ROWS * 8 / THREADS, STEP = THREADS / 8;
    static_assert(N * THREADS == ROWS * 8 && STEP % 8 == 0, "whole pieces, one swizzle");
    const bf16* src[N];
    template <class Row>
    __device__ __forceinline__ explicit TileRows(Row row) {
#pragma unroll
        for (int i = 0; i < N; ++i) src[i] = row((int)(threadIdx.x / 8) + STEP * i);
    }
    __device__ __forceinline__ void issue(unsigned char* tile, int k, int k0) const {
        const int p = threadIdx.x & 7, c = k0 + 8 * p;
        unsigned char* dst = tile + swizzled(threadIdx.x / 8, p);
        if ((k & 7) == 0) {
            const int at = c < k ? c : 0, bytes = c < k ? 16 : 0;
#pragma unroll
            for (int i = 0; i < N; ++i) cp_async16(dst + STEP * 128 * i, src[i] + at, bytes);
        } else {
#pragma unroll
            for (int i = 0; i < N; ++i) *(uint4*)(dst + STEP * 128 * i) = bf16x8_any(src[i], c, k);
        }
    }
};

// ------------------------------------------------------------------ the weight tiles
// Three ways a weight tile reaches its stage, each with the same four steps, which wgmma_tile
// calls at the same places: prologue(kt0 + s, s) for the first AHEAD tiles, ready(kt0, kt1) once
// those are issued, issue(next) before tile kt's wgmmas and after(kt, kt1) once they are issued.

// bf16 weights: by cp.async straight into the stage, as the activations.
template <class B>
struct Bf16Weights {
    unsigned char* base;
    int k;
    TileRows<128, B::threads> rows;
    template <class WRow>
    __device__ __forceinline__ Bf16Weights(unsigned char* base_, int k_, WRow wrow)
        : base(base_), k(k_), rows([&](int r) { return (const bf16*)wrow(r).data; }) {}
    template <class WRow>
    __device__ __forceinline__ void issue(int kt, WRow) {
        rows.issue(base + (kt % B::stages) * B::stage_bytes + B::act_bytes, k, kt * BK);
    }
    template <class WRow>
    __device__ __forceinline__ void prologue(int kt, int, WRow wrow) { issue(kt, wrow); }
    template <class WRow>
    __device__ __forceinline__ void ready(int, int, WRow) {}
    template <class WRow>
    __device__ __forceinline__ void after(int, int, WRow) {}
};

#if !defined(WEIGHT_BF16)
// A quantized or f32 weight through registers: issue loads this thread's raw pieces of tile
// next (piece p of tile row r for r, p = idx / 8, idx % 8), after stores them as bf16 (or
// f32's bf16 planes) once tile kt's wgmmas are issued, so their loads wait there: one tile in
// flight. THREADS is a multiple of 8, so every piece of a thread lies at the same columns,
// k0 + 8 (threadIdx.x % 8), and is live (inside k) or not together.
template <class B>
struct RegisterWeights {
    static constexpr int THREADS = B::threads, PIECES = 128 * 8 / THREADS;
    unsigned char* base;
    int k;
    WeightRaw8 raw[PIECES];
    bool live;
    int next;
    template <class WRow>
    __device__ __forceinline__ RegisterWeights(unsigned char* base_, int k_, WRow)
        : base(base_), k(k_) {}
    template <class WRow>
    __device__ __forceinline__ void issue(int kt, WRow wrow) {
        const int c = kt * BK + 8 * (threadIdx.x & 7);
        live = c < k;
        next = kt;
        // threadIdx.x < THREADS (check_launch), said so: the compiler then knows which rows,
        // gate's or up's, each piece reads
        const int t = threadIdx.x & (THREADS - 1);
        if (live) {
#pragma unroll
            for (int i = 0; i < PIECES; ++i)
                raw[i] = weight8_fetch(wrow((t + THREADS * i) >> 3), c, k);
        }
    }
    __device__ __forceinline__ void store() const {
        unsigned char* planes0 = base + (next % B::stages) * B::stage_bytes + B::act_bytes;
#pragma unroll
        for (int i = 0; i < PIECES; ++i) {
            const int idx = threadIdx.x + THREADS * i;
            uint4 planes[PARTS];
            weight8_planes(raw[i], planes);
#pragma unroll
            for (int p = 0; p < PARTS; ++p)
                *(uint4*)(planes0 + p * TILE_BYTES + swizzled(idx >> 3, idx & 7)) =
                    live ? planes[p] : make_uint4(0, 0, 0, 0);
        }
    }
    template <class WRow>
    __device__ __forceinline__ void prologue(int kt, int, WRow wrow) {
        issue(kt, wrow);
        store();
    }
    template <class WRow>
    __device__ __forceinline__ void ready(int, int, WRow) {}
    template <class WRow>
    __device__ __forceinline__ void after(int kt, int kt1, WRow) {
        if (kt + B::ahead < kt1) store();
    }
};
#endif

#if defined(WEIGHT_FP8) || defined(WEIGHT_MXFP4) || defined(WEIGHT_NVFP4)
// A quantized weight staged raw: issue copies tile next's bytes by cp.async into a slot of their
// own after the stages (AHEAD tiles in flight, as bf16's), in 16-byte units a thread owns (fp8:
// 16 columns of a row, fp4: 32), and loads the units' fp4 block scales into registers, which a
// ring keeps until they are used a tile later; rows not 16-byte aligned come through registers
// (weight8_fetch, zeros past k). after, once the thread's copies of tile kt + 1 have landed
// (tile kt's wgmmas running), reads its units back and stores them into that tile's stage as
// bf16, exactly (mma_weights.cuh), swizzled. Only the thread that copied a unit reads it, so its
// own cp.async wait is all the slot needs; the stage's stores reach the wgmmas through the next
// iteration's fence and barrier. That stage held tile kt + 1 - stages, which every warpgroup
// finished before this iteration's barrier.
template <class B>
struct RawWeights {
#if defined(WEIGHT_FP8)
    static constexpr int UNIT_COLS = 16, SCALE_COLS = 16;  // (SCALE_COLS unused: no scales)
#elif defined(WEIGHT_MXFP4)
    static constexpr int UNIT_COLS = 32, SCALE_COLS = 32;  // columns a scale byte
#else
    static constexpr int UNIT_COLS = 32, SCALE_COLS = 16;
#endif
    static constexpr int PER_ROW = BK / UNIT_COLS, UNITS = 128 * PER_ROW / B::threads;
    static constexpr int PIECES = UNIT_COLS / 8, PIECE_BYTES = 16 / PIECES, AHEAD = B::ahead;
    static_assert(UNITS * B::threads == 128 * PER_ROW, "whole units a thread");
    static_assert(128 * PER_ROW * 16 == 128 * B::raw_row_bytes, "Block sizes the raw slots");
    static_assert(PARTS == 1, "one bf16 plane");
    unsigned char* base;
    int k;
    // ring[j]: the scale bytes of tile kt + 1 + j's units (mxfp4 one, nvfp4 two a unit)
    uint32_t ring[AHEAD][UNITS];
    // the rows of this thread's units, found once (the tiles step along them)
    WeightRef rows[UNITS];
    template <class WRow>
    __device__ __forceinline__ RawWeights(unsigned char* base_, int k_, WRow wrow)
        : base(base_), k(k_) {
#pragma unroll
        for (int u = 0; u < UNITS; ++u) rows[u] = wrow((thread() + B::threads * u) / PER_ROW);
    }

    __device__ __forceinline__ unsigned char* slot(int kt) const {
        return base + B::stages * B::stage_bytes + (kt % AHEAD) * 128 * B::raw_row_bytes;
    }
    // bytes of a row's first c columns
    static __device__ __forceinline__ long bytes_of(long c) { return c * 16 / UNIT_COLS; }
    // threadIdx.x, which is below B::threads (check_launch), said so: the compiler then knows
    // which rows, gate's or up's, each unit reads
    static __device__ __forceinline__ int thread() { return threadIdx.x & (B::threads - 1); }

    // tile kt's copies, and its scales into ring[j]
    __device__ __forceinline__ void fetch(int kt, int j) {
        const bool aligned = bytes_of(k) % 16 == 0;
#pragma unroll
        for (int u = 0; u < UNITS; ++u) {
            const int idx = thread() + B::threads * u;
            const int c = kt * BK + UNIT_COLS * (idx % PER_ROW);
            unsigned char* dst = slot(kt) + idx * 16;
            const WeightRef w = rows[u];
            if (aligned) {
                const long at = bytes_of(c), n = min(16l, max(0l, bytes_of(k) - at));
                cp_async16(dst, n > 0 ? (const unsigned char*)w.data + at : w.data, (int)n);
            } else {
#pragma unroll
                for (int p = 0; p < PIECES; ++p) {
                    const int cp = c + 8 * p;
                    WeightRaw8 raw = {};
                    if (cp < k) raw = weight8_fetch(w, cp, k);
#if defined(WEIGHT_FP8)
                    *(uint2*)(dst + p * PIECE_BYTES) = raw.v;
#else
                    *(uint32_t*)(dst + p * PIECE_BYTES) = raw.v;  // the data, not the scale
#endif
                }
            }
#if defined(WEIGHT_MXFP4)
            ring[j][u] = c < k ? ((const uint8_t*)w.scale)[c / 32] : 0u;
#elif defined(WEIGHT_NVFP4)
            // an aligned row (k a multiple of 32) has its unit's two scales at an even offset
            const uint8_t* sc = (const uint8_t*)w.scale;
            ring[j][u] = c >= k      ? 0u
                         : aligned   ? *(const uint16_t*)(sc + c / 16)
                         : sc[c / 16] | (c + 16 < k ? (uint32_t)sc[c / 16 + 1] << 8 : 0u);
#endif
        }
    }
    // tile kt's units, landed, into its stage with the scales of ring[0]; the ring moves on
    template <class WRow>
    __device__ __forceinline__ void convert(int kt, WRow) {
        cp_async_wait<AHEAD - 1>();  // this thread's groups up to tile kt's
        unsigned char* planes0 = base + (kt % B::stages) * B::stage_bytes + B::act_bytes;
#pragma unroll
        for (int u = 0; u < UNITS; ++u) {
            const int idx = thread() + B::threads * u, r = idx / PER_ROW, s = idx % PER_ROW;
            const int c = kt * BK + UNIT_COLS * s;
            const uint4 v = *(const uint4*)(slot(kt) + idx * 16);
            const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int p = 0; p < PIECES; ++p) {
                const int cp = c + 8 * p;
                WeightRaw8 raw;
#if defined(WEIGHT_FP8)
                raw.v = make_uint2(words[2 * p], words[2 * p + 1]);
#else
                raw.v = words[p];
                raw.s = (uint8_t)(ring[0][u] >> (8 * (p * 8 / SCALE_COLS)));
#endif
                uint4 planes[PARTS];
                weight8_planes(raw, planes);
                *(uint4*)(planes0 + swizzled(r, s * PIECES + p)) =
                    cp < k ? planes[0] : make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int j = 0; j + 1 < AHEAD; ++j)
#pragma unroll
            for (int u = 0; u < UNITS; ++u) ring[j][u] = ring[j + 1][u];
    }
    // the prologue's tile kt0 + s into ring[s]
    template <class WRow>
    __device__ __forceinline__ void prologue(int kt, int s, WRow) { fetch(kt, s); }
    template <class WRow>
    __device__ __forceinline__ void ready(int kt0, int kt1, WRow wrow) {
        if (kt0 < kt1) convert(kt0, wrow);
    }
    template <class WRow>
    __device__ __forceinline__ void issue(int next, WRow) { fetch(next, AHEAD - 1); }
    template <class WRow>
    __device__ __forceinline__ void after(int kt, int kt1, WRow wrow) {
        if (kt + 1 < kt1) convert(kt + 1, wrow);
    }
};
#endif

// Which of the three a block of B takes: bf16 straight; fp8 and fp4 raw (in blocks of one
// warpgroup unless RAW_SMALL is 0); the rest through registers.
template <bool C, class T, class F>
struct Pick {
    using type = T;
};
template <class T, class F>
struct Pick<false, T, F> {
    using type = F;
};
#if defined(WEIGHT_BF16)
template <class B>
using WeightsOf = Bf16Weights<B>;
#elif RAW_BITS
template <class B>
using WeightsOf = typename Pick<B::raw, RawWeights<B>, RegisterWeights<B>>::type;
#else
template <class B>
using WeightsOf = RegisterWeights<B>;
#endif

// x rows m0 + [0, B::bm) (clamped to rows) against weight rows wrow(b), b in [0, BN) (clamped
// to real rows by the caller), over k tiles [kt0, kt1) (kt0 opens a k-block; kt1 closes one, or
// is the last tile): in the fragment layout of Place, the sum of those k-blocks in order into
// `sum`, or (each_block, which a split launch sets) each k-block's partial handed to each(k-block,
// partial) as it closes.
template <class B, class WRow, class Each>
__device__ __forceinline__ void wgmma_tile(const act_t* x, int rows, int k, int m0, WRow wrow,
                                           int kt0, int kt1, float (&sum)[64], bool each_block,
                                           Each each) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const uint32_t raw_at = smem_addr(smem_raw), base_at = (raw_at + 1023) & ~1023u;
    unsigned char* base = smem_raw + (base_at - raw_at);
    const Place pl;
    constexpr int TILES_PER_BLOCK = K_BLOCK / BK, AHEAD = B::ahead;
    const TileRows<B::bm, B::threads> xs(
        [&](int r) { return (const bf16*)(x + (long)min(m0 + r, rows - 1) * k); });
    auto load_x = [&](int kt) { xs.issue(base + (kt % B::stages) * B::stage_bytes, k, kt * BK); };
    WeightsOf<B> w(base, k, wrow);
#pragma unroll
    for (int s = 0; s < AHEAD; ++s) {
        if (kt0 + s < kt1) {
            load_x(kt0 + s);
            w.prologue(kt0 + s, s, wrow);
        }
        cp_async_commit();
    }
    w.ready(kt0, kt1, wrow);
    // -0 + a is a for every a (+0 and -0 included), so the first k-block's partial lands as is
#pragma unroll
    for (int i = 0; i < 64; ++i) sum[i] = -0.0f;
    float acc[64];
    for (int kt = kt0; kt < kt1; ++kt) {
        cp_async_wait<AHEAD - 1>();  // this thread's pieces of tile kt have landed
        fence_async_shared();  // its cp.async pieces (and stored weights) seen by the wgmmas
        // every thread's pieces of tile kt are in; every warpgroup has finished tile kt - 2's
        // wgmmas (its wait after tile kt - 1), so that stage can be filled again
        __syncthreads();
        const int next = kt + AHEAD;
        if (next < kt1) {
            load_x(next);
            w.issue(next, wrow);
        }
        cp_async_commit();
        const bool opens = kt % TILES_PER_BLOCK == 0;
        const bool closes = (kt + 1) % TILES_PER_BLOCK == 0 || kt + 1 == kt1;
        // every warpgroup issues its wgmmas, even one whose rows all lie past `rows` (they are
        // clamped, and not stored): a wgmma under a branch ptxas cannot prove uniform is
        // serialized, each waiting for the one before (ptxas C7518); that build was 3-6 %
        // slower at 2048 rows and up to 15 % faster at 64 (docs/gpu-notes.md, version 25)
        const uint32_t stage_at = base_at + (kt % B::stages) * B::stage_bytes;
        const uint64_t a_desc = operand_desc(stage_at + pl.wg * 64 * 128),
                       b_desc = operand_desc(stage_at + B::act_bytes);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk)
#pragma unroll
            for (int p = PARTS - 1; p >= 0; --p)  // f32: lo, mid, then hi
                wgmma_m64n128k16(acc, a_desc + desc_step(32 * kk),
                                 b_desc + desc_step(p * TILE_BYTES + 32 * kk),
                                 !(opens && kk == 0 && p == PARTS - 1));
        wgmma_commit();
        w.after(kt, kt1, wrow);
        if (closes) {
            wgmma_wait<0>();
            if (each_block) {
                each(kt / TILES_PER_BLOCK, acc);
            } else {
#pragma unroll
                for (int i = 0; i < 64; ++i) sum[i] += acc[i];
            }
        } else {
            wgmma_wait<1>();
        }
    }
    cp_async_wait<0>();
}

// One output of a plain tile (linear, lm_head, linear_add, qkv) from its finished sum s:
// store(i, d) for row-major index i of an n-column output and the scaled dot d, inside rows x n.
template <class Store>
__device__ __forceinline__ void plain_out(float s, int row, int col, int rows, int n, WeightRef w,
                                          Store store) {
    if (row < rows && col < n)
        store((long)row * n + col, scaled(s, row_factor(weight_rows(w, col, 0))));
}

// One output of gate_up_swiglu from the finished gate and up sums of column col.
__device__ __forceinline__ void gate_up_out(float g, float u, int row, int col, int rows, int n,
                                            WeightRef wg, WeightRef wu, act_t* h) {
    if (row < rows && col < n) {
        const float gd = scaled(g, row_factor(weight_rows(wg, col, 0)));
        const float ud = scaled(u, row_factor(weight_rows(wu, col, 0)));
        h[(long)row * n + col] = act_store(silu_mul(act_round(gd), act_round(ud)));
    }
}

// ------------------------------------------------------------------ the split of k

// The workspace of a split launch: slot j (k-block j's partial) of column tile t holds rows x 128
// floats, row-major (KERNELS.toml's ws: nkb tiles rows 512 bytes).
struct SplitWork {
    float* ws;
    int rows, tiles, nkb, per;
    __device__ SplitWork(float* ws_, int rows_, int k, int splits, int tiles_)
        : ws(ws_), rows(rows_), tiles(tiles_), nkb((k + K_BLOCK - 1) / K_BLOCK),
          per((nkb + splits - 1) / splits) {}
    __device__ float* slot(int j, int t) const { return ws + ((long)j * tiles + t) * rows * 128; }
};

// The tile's sums in the fragment layout of Place (rows m0 + [0, B::bm), columns [0, BN) of
// weight rows wrow(b)) handed to finish(sum); or, in a split launch (splits > 1: one warpgroup,
// rows up to 64), the partial of each k-block of this split left in the workspace for the
// combine launch. A one-warpgroup block runs the same k-loop either way (split 0 of one
// covers all of k), so that the source holds that loop once a block size.
template <class B, class WRow, class Finish>
__device__ __forceinline__ void tile_sums(const act_t* x, int rows, int k, int m0, WRow wrow,
                                          float* ws, int splits, Finish finish) {
    constexpr int TILES_PER_BLOCK = K_BLOCK / BK;
    const int ktiles = (k + BK - 1) / BK;
    // partial v into slot j: this thread's rows r0 and r0 + 8, its column pairs 8 q + 2 t; worked
    // out from the arguments where used, so that nothing of it stays live across the loops
    // (128 accumulators a thread, 255 registers)
    auto leave = [&](int j, const float (&v)[64]) {
        const int r0 = Place().row(0);
        float* out = SplitWork(ws, rows, k, splits, gridDim.y).slot(j, blockIdx.y) + r0 * 128 +
                     2 * Place().t;
#pragma unroll
        for (int i = 0; i < 64; i += 2) {
            const int dr = i & 2 ? 8 : 0;
            if (r0 + dr < rows) *(float2*)(out + dr * 128 + 8 * (i >> 2)) = {v[i], v[i + 1]};
        }
    };
    float sum[64];
    if constexpr (B::threads == Block<1>::threads) {
        const int per = SplitWork(ws, rows, k, splits, gridDim.y).per, kb0 = blockIdx.z * per;
        wgmma_tile<B>(x, rows, k, m0, wrow, kb0 * TILES_PER_BLOCK,
                      min((kb0 + per) * TILES_PER_BLOCK, ktiles), sum, splits > 1, leave);
        if (splits == 1) finish(sum);
    } else {  // check_launch: never split
        wgmma_tile<B>(x, rows, k, m0, wrow, 0, ktiles, sum, false, leave);
        finish(sum);
    }
}

// The combine launch (grid (tiles, ceil(rows / 4)), block 256): thread (row, c) adds the
// k-blocks' partials of columns c and c + 64 of its row in column tile blockIdx.x, in k order
// (the first as it is), and hands both sums to finish(tile, row, c, lo, hi). Nothing to do after an
// unsplit launch (it finished its outputs).
template <class Finish>
__device__ __forceinline__ void combine(const float* ws, int rows, int k, int splits,
                                        Finish finish) {
    grid_dependency_sync();
    const int row = blockIdx.y * 4 + (threadIdx.x >> 6), c = threadIdx.x & 63;
    if (splits == 1 || row >= rows) return;
    const SplitWork sw(const_cast<float*>(ws), rows, k, splits, gridDim.x);
    const int t = blockIdx.x, at = row * 128 + c;
    float lo = sw.slot(0, t)[at], hi = sw.slot(0, t)[at + 64];
    for (int j = 1; j < sw.nkb; ++j) {
        lo += sw.slot(j, t)[at];
        hi += sw.slot(j, t)[at + 64];
    }
    finish(t, row, c, lo, hi);
}

// The launch this source serves: 256 threads, or (not for f32's planes) 128, a grid whose first
// dimension covers the rows in tiles of 64 a warpgroup and whose third is the split of k (one
// block of rows, a workspace, every split with k-blocks of its own). Anything else traps (loud).
__device__ __forceinline__ void check_launch(int rows, int k, const float* ws, int splits) {
    const bool small = PARTS == 1 && blockDim.x == Block<1>::threads;
    const SplitWork sw(nullptr, rows, k, max(splits, 1), gridDim.y);
    if (!(small || blockDim.x == Block<2>::threads) ||
        (long)gridDim.x * (small ? Block<1>::bm : Block<2>::bm) < rows || splits < 1 ||
        (int)gridDim.z != splits ||
        splits > 1 &&
            (!small || gridDim.x != 1 || ws == nullptr || (splits - 1) * sw.per >= sw.nkb))
        __trap();
}

// body(B()): the block's work at its size; check_launch has ruled out every other block.
template <class Body>
__device__ __forceinline__ void by_block_size(Body body) {
#if PARTS == 1
    if (blockDim.x == Block<1>::threads) {
        body(Block<1>());
        return;
    }
#endif
    body(Block<2>());
}

// A plain launch's column tile (grid y): weight w's rows n0 + [0, BN) of n.
struct PlainTile {
    WeightRef w;
    int n0, n;
};

// The sums of plain tile pt (rows blockIdx.x B::bm + [0, B::bm)), then out(row, col, sum) for
// each of them, or this split's share of them.
template <class Out>
__device__ __forceinline__ void plain_tiles(const act_t* x, PlainTile pt, int rows, int k,
                                            float* ws, int splits, Out out) {
    grid_dependency_sync();
    check_launch(rows, k, ws, splits);
    by_block_size([&](auto b) {
        using B = decltype(b);
        const int m0 = blockIdx.x * B::bm;
        tile_sums<B>(x, rows, k, m0,
                     [&](int r) { return weight_rows(pt.w, min(pt.n0 + r, pt.n - 1), k); }, ws,
                     splits, [&](const float (&sum)[64]) {
                         const Place pl;
#pragma unroll
                         for (int i = 0; i < 64; ++i)
                             out(m0 + pl.row(i), pt.n0 + pl.col(i), sum[i]);
                     });
    });
}

// grid (ceil(rows / (64 warpgroups)), ceil(n / 128), splits), block 128 warpgroups. y = x · wᵀ.
extern "C" __global__ void __launch_bounds__(256, 1)
metrale_linear_wgmma(const act_t* __restrict__ x, const void* __restrict__ w,
                     const void* __restrict__ w_scale, const float* __restrict__ w_global,
                     out_t* __restrict__ y, int rows, int k, int n, float* ws, int splits) {
    const PlainTile pt{weight_ref(w, w_scale, w_global), (int)blockIdx.y * BN, n};
    plain_tiles(x, pt, rows, k, ws, splits, [&](int row, int col, float s) {
        plain_out(s, row, col, rows, n, pt.w, [&](long i, float d) { y[i] = out_store(d); });
    });
}

// y = round(round(x · wᵀ) + r), as linear then add.
extern "C" __global__ void __launch_bounds__(256, 1)
metrale_linear_add_wgmma(const act_t* __restrict__ x, const void* __restrict__ w,
                         const void* __restrict__ w_scale, const float* __restrict__ w_global,
                         const act_t* __restrict__ r, act_t* __restrict__ y, int rows, int k,
                         int n, float* ws, int splits) {
    const PlainTile pt{weight_ref(w, w_scale, w_global), (int)blockIdx.y * BN, n};
    plain_tiles(x, pt, rows, k, ws, splits, [&](int row, int col, float s) {
        plain_out(s, row, col, rows, n, pt.w, [&](long i, float d) {
            y[i] = act_store(act_round(d) + act_load(r[i]));
        });
    });
}

// q, k_, v in one launch: column tiles count q's, then k_'s, then v's.
struct QkvTiles {
    WeightRef wq, wk, wv;
    act_t *q, *k_, *v;
    int nq, nk, nv;
    // column tile `tile`'s weight, first column and width, and the output it writes
    __device__ PlainTile at(int tile, act_t*& out) const {
        const int tq = (nq + BN - 1) / BN, tk = (nk + BN - 1) / BN;
        const int part = tile < tq ? 0 : tile < tq + tk ? 1 : 2;
        out = part == 0 ? q : part == 1 ? k_ : v;
        const int n0 = (tile - (part == 0 ? 0 : part == 1 ? tq : tq + tk)) * BN;
        return {part == 0 ? wq : part == 1 ? wk : wv, n0, part == 0 ? nq : part == 1 ? nk : nv};
    }
};

extern "C" __global__ void __launch_bounds__(256, 1)
metrale_qkv_wgmma(const act_t* __restrict__ x,
                  const void* __restrict__ wq, const void* __restrict__ wq_scale,
                  const float* __restrict__ wq_global,
                  const void* __restrict__ wk, const void* __restrict__ wk_scale,
                  const float* __restrict__ wk_global,
                  const void* __restrict__ wv, const void* __restrict__ wv_scale,
                  const float* __restrict__ wv_global,
                  act_t* __restrict__ q, act_t* __restrict__ k_, act_t* __restrict__ v,
                  int rows, int k, int nq, int nk, int nv, float* ws, int splits) {
    const QkvTiles qt{weight_ref(wq, wq_scale, wq_global), weight_ref(wk, wk_scale, wk_global),
                      weight_ref(wv, wv_scale, wv_global), q, k_, v, nq, nk, nv};
    act_t* out;
    const PlainTile pt = qt.at(blockIdx.y, out);
    plain_tiles(x, pt, rows, k, ws, splits, [&](int row, int col, float s) {
        plain_out(s, row, col, rows, pt.n, pt.w, [&](long i, float d) { out[i] = act_store(d); });
    });
}

// h = silu(round(x · wgᵀ)) * round(x · wuᵀ) for BN / 2 columns a block: weight tile rows
// [0, 64) are the gate rows of columns n0 + [0, 64), rows [64, 128) the up rows of the same
// columns, so a thread's fragment registers i and i + 32 hold the two dots of one output.
// grid (ceil(rows / (64 warpgroups)), ceil(n / 64), splits), block 128 warpgroups.
extern "C" __global__ void __launch_bounds__(256, 1)
metrale_gate_up_swiglu_wgmma(const act_t* __restrict__ x,
                             const void* __restrict__ wg, const void* __restrict__ wg_scale,
                             const float* __restrict__ wg_global,
                             const void* __restrict__ wu, const void* __restrict__ wu_scale,
                             const float* __restrict__ wu_global,
                             act_t* __restrict__ h, int rows, int k, int n, float* ws,
                             int splits) {
    grid_dependency_sync();
    check_launch(rows, k, ws, splits);
    const WeightRef g = weight_ref(wg, wg_scale, wg_global);
    const WeightRef u = weight_ref(wu, wu_scale, wu_global);
    const int n0 = blockIdx.y * (BN / 2);
    by_block_size([&](auto b) {
        using B = decltype(b);
        const int m0 = blockIdx.x * B::bm;
        tile_sums<B>(x, rows, k, m0,
                     [&](int r) {
                         return weight_rows(r < 64 ? g : u, min(n0 + (r & 63), n - 1), k);
                     },
                     ws, splits, [&](const float (&sum)[64]) {
                         const Place pl;
#pragma unroll
                         for (int i = 0; i < 32; ++i)
                             gate_up_out(sum[i], sum[i + 32], m0 + pl.row(i), n0 + pl.col(i),
                                         rows, n, g, u, h);
                     });
    });
}

// ------------------------------------------------------------------ the combine launches
// grid (tiles, ceil(rows / 4)), block 256, after a launch of the entry above on the same
// workspace (KERNELS.toml's `then`): its outputs where it split k, nothing where it did not.

extern "C" __global__ void __launch_bounds__(256)
metrale_linear_wgmma_combine(const float* __restrict__ ws, const void* __restrict__ w,
                             const void* __restrict__ w_scale, const float* __restrict__ w_global,
                             out_t* __restrict__ y, int rows, int k, int n, int splits) {
    const WeightRef wr = weight_ref(w, w_scale, w_global);
    combine(ws, rows, k, splits, [&](int t, int row, int c, float lo, float hi) {
        auto store = [&](long i, float d) { y[i] = out_store(d); };
        plain_out(lo, row, t * BN + c, rows, n, wr, store);
        plain_out(hi, row, t * BN + c + 64, rows, n, wr, store);
    });
}

extern "C" __global__ void __launch_bounds__(256)
metrale_linear_add_wgmma_combine(const float* __restrict__ ws, const void* __restrict__ w,
                                 const void* __restrict__ w_scale,
                                 const float* __restrict__ w_global, const act_t* __restrict__ r,
                                 act_t* __restrict__ y, int rows, int k, int n, int splits) {
    const WeightRef wr = weight_ref(w, w_scale, w_global);
    combine(ws, rows, k, splits, [&](int t, int row, int c, float lo, float hi) {
        auto store = [&](long i, float d) { y[i] = act_store(act_round(d) + act_load(r[i])); };
        plain_out(lo, row, t * BN + c, rows, n, wr, store);
        plain_out(hi, row, t * BN + c + 64, rows, n, wr, store);
    });
}

extern "C" __global__ void __launch_bounds__(256)
metrale_qkv_wgmma_combine(const float* __restrict__ ws,
                          const void* __restrict__ wq, const void* __restrict__ wq_scale,
                          const float* __restrict__ wq_global,
                          const void* __restrict__ wk, const void* __restrict__ wk_scale,
                          const float* __restrict__ wk_global,
                          const void* __restrict__ wv, const void* __restrict__ wv_scale,
                          const float* __restrict__ wv_global,
                          act_t* __restrict__ q, act_t* __restrict__ k_, act_t* __restrict__ v,
                          int rows, int k, int nq, int nk, int nv, int splits) {
    const QkvTiles qt{weight_ref(wq, wq_scale, wq_global), weight_ref(wk, wk_scale, wk_global),
                      weight_ref(wv, wv_scale, wv_global), q, k_, v, nq, nk, nv};
    combine(ws, rows, k, splits, [&](int t, int row, int c, float lo, float hi) {
        act_t* out;
        const PlainTile pt = qt.at(t, out);
        auto store = [&](long i, float d) { out[i] = act_store(d); };
        plain_out(lo, row, pt.n0 + c, rows, pt.n, pt.w, store);
        plain_out(hi, row, pt.n0 + c + 64, rows, pt.n, pt.w, store);
    });
}

// columns c of a tile are gate rows, c + 64 the up rows of the same output column
extern "C" __global__ void __launch_bounds__(256)
metrale_gate_up_swiglu_wgmma_combine(const float* __restrict__ ws,
                                     const void* __restrict__ wg, const void* __restrict__ wg_scale,
                                     const float* __restrict__ wg_global,
                                     const void* __restrict__ wu, const void* __restrict__ wu_scale,
                                     const float* __restrict__ wu_global, act_t* __restrict__ h,
                                     int rows, int k, int n, int splits) {
    const WeightRef g = weight_ref(wg, wg_scale, wg_global);
    const WeightRef u = weight_ref(wu, wu_scale, wu_global);
    combine(ws, rows, k, splits, [&](int t, int row, int c, float lo, float hi) {
        gate_up_out(lo, hi, row, t * (BN / 2) + c, rows, n, g, u, h);
    });
}

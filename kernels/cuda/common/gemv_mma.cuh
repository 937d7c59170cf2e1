// Metrale CUDA: the GEMV on tensor cores (mma.sync, sm_80 and newer) that the `gemv_mma` points
// reduce through: gemv_mma.cu's dense entries (linear, linear_add, qkv, gate_up_swiglu, lm_head)
// and moe_mma.cu's expert entries, for bf16 activations and up to 8 rows a launch row group. The
// planner reaches these points only through the bounded relations mma_gemv_* (FUSIONS.toml), so
// only a plan under the bounded policy runs them.
//
// Why: gemv.cu dequantizes every weight in f32 and multiplies it on the CUDA cores, the order
// the exact policy needs; for fp8 and fp4 weights that costs 8-9 instructions a weight and lane,
// and the H200 issues them slower than HBM delivers the bytes (docs/gpu-notes.md, version 12).
// Here a weight becomes bf16 exactly (none for bf16, 2 instructions for fp8, about 2 for fp4:
// its bits placed, three instructions a pair, then one bf16x2 product by the scale) and the
// products and sums run in m16n8k16 MMAs, one instruction per 8 weights a lane; the batch rows
// of a launch (up to 8) are the MMA's n columns, so 8 rows cost about what 1 row costs.
//
// Work: a block of WARPS warps owns GROUP (16) consecutive output columns of each of T weight
// tiles (T = 2 for gate_up_swiglu: the gate and up rows of the same 16 outputs, which share the
// activation fragments) and up to 8 activation rows (blockIdx.y). Warp w takes the k-blocks
// w, w + WARPS, ... of K_BLOCK columns; its MMAs for one k-block start from zero, and the
// k-block's partial goes to shared memory. After a barrier each thread sums one output's
// partials in k-block order, sequentially, then scales and stores it.
//
// Inside a k-block the weights are read in rounds of 16-byte loads: lane (g, t) = (lane / 4,
// lane % 4) loads 8 C columns (C = DOT_CHUNKS: bf16 1, fp8 2, fp4 4) of tile rows g and g + 8,
// columns round * 32 C + 8 C t; the activation row g brings the same columns. Chunk i's eight
// columns, as four bf16 pairs, feed two MMAs: pairs (0, 1) the first, (2, 3) the second, pair
// 0 (2) as the MMA's columns 2t, 2t + 1 and pair 1 (3) as 2t + 8, 2t + 9 in both operands, so
// each MMA multiplies matching columns. Which columns an MMA takes is the within-block order,
// the hardware's: KERNELS.toml declares "tensor-core MMA order".
//
// Order (declared in KERNELS.toml): k in blocks of K_BLOCK, the last possibly shorter; a block's
// partial from zero through its MMAs; the partials combined sequentially in f32. Weights reach
// the MMA exactly as bf16: bf16 as stored, fp8's e4m3 values, mxfp4's e2m1 times its power-of-two
// scale, nvfp4's e2m1 times its e4m3 scale and 2^-7 (LoadScale; the finished sum takes 2^7 back,
// exactly). The f32 factor left (fp8's row scale, nvfp4's global scale) multiplies the finished
// sum, where the reference multiplies each weight ("the row's f32 scale times the finished
// sum"). Row-invariant: an output row is made of its own activation row by the same
// instructions whatever the other rows hold (an MMA's n columns do not mix).
//
// Defines: ACT_BF16, WEIGHT_*, K_BLOCK, OUT_F32 (lm_head: f32 logits).
#pragma once
#include "gemv.cuh"
#include "mma.cuh"

#if !defined(ACT_BF16)
#error "the tensor-core GEMV takes bf16 activations (KERNELS.toml's `when`)"
#endif
#if defined(WEIGHT_F32)
#error "f32 weights have no gemv_mma point"
#endif

#ifndef WARPS
#define WARPS 8
#endif
#define THREADS (32 * WARPS)
#define GROUP 16  // output columns a block owns per tile: one MMA's m
#define XROWS 8   // activation rows a block serves: one MMA's n
constexpr int C = DOT_CHUNKS, ROUND = 32 * C, ROUNDS = K_BLOCK / ROUND;
static_assert(K_BLOCK % ROUND == 0, "a k-block is whole rounds of the four lanes' loads");
static_assert(THREADS >= GROUP * XROWS, "a thread per (output, row) sums a block's partials");

// ------------------------------------------------------------------ weights as bf16

// fp4 chunks pair their columns (p, p + 4) in bf16 word p (p < 4), not (2p, 2p + 1): nibbles p
// and p + 4 of a data word sit 16 bits apart, so one shift places both (e2m1x8_bf16), and the
// activations take the same pairs (pair_x); the MMAs then multiply matching columns as for the
// other formats. Which columns an MMA sums is the within-block order, the hardware's anyway.
#if defined(WEIGHT_MXFP4) || defined(WEIGHT_NVFP4)
#define PAIRED 1
#else
#define PAIRED 0
#endif

__device__ __forceinline__ uint32_t bf16_pow2(int e) {  // 2^e as bf16 bits, -126 <= e <= 127
    return (uint32_t)(e + 127) << 7;
}

// The factor the chunks of one load share, as bf16x2 (both halves alike; nvfp4: one per 16
// columns). fp4's values come as bf16 times 2^-126 (e2m1x8_bf16), and one product by f scales them:
// - mxfp4: f = 2^(b - 1) gives the value times 2^(b - 127) for b <= 128. Past that bf16 has no
//   power of two large enough, so b > 128 takes a second product, by 2^(b - 128) (b = 255, e8m0's
//   NaN, by NaN), on the path a warp takes only when one of its loads has such a scale (WIDE):
//   scales past 2 are rare in checkpoints, and the second product, predicated, cost an
//   instruction a weight pair on every path.
// - nvfp4: f = s 2^119 (s the e4m3 scale, at most 448, so f < 2^128) gives the value times
//   s 2^-7, a normal bf16 with at most six significant bits, so exact; the finished sum takes the
//   2^7 back (SUM_FACTOR), a product by a power of two, exact. One product where there were two.
// fp8 and bf16 take none.
struct LoadScale {
    uint32_t f[2], g;  // g: mxfp4's second factor, on the WIDE path only
};

#if defined(WEIGHT_NVFP4)
#define SUM_FACTOR 0x1p7f
#else
#define SUM_FACTOR 1.0f
#endif

__device__ __forceinline__ uint32_t bf16x2_dup(uint32_t h) { return h | (h << 16); }

// mxfp4: whether chunk r's scale needs the second product (b > 128).
__device__ __forceinline__ bool wide_scale(const WeightChunks<C>& r) {
#if defined(WEIGHT_MXFP4)
    return (r.s & 0xffu) > 128u;
#else
    (void)r;
    return false;
#endif
}

template <bool WIDE>
__device__ __forceinline__ LoadScale load_scale(const WeightChunks<C>& r) {
    LoadScale s{{0u, 0u}, 0u};
#if defined(WEIGHT_MXFP4)
    const int b = (int)(r.s & 0xffu);
    s.f[0] = s.f[1] = bf16x2_dup(bf16_pow2(min(b, 128) - 1));
    if (WIDE) s.g = bf16x2_dup(b <= 128 ? 0u : b == 255 ? 0x7fc0u : bf16_pow2(b - 128));
#elif defined(WEIGHT_NVFP4)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const __nv_bfloat16 f = __float2bfloat16_rn(e4m3_load((r.s >> (8 * h)) & 0xffu) * 0x1p119f);
        s.f[h] = bf16x2_dup(*reinterpret_cast<const unsigned short*>(&f));
    }
#endif
    return s;
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
    const __nv_bfloat162 p = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                     *reinterpret_cast<const __nv_bfloat162*>(&b));
    return *reinterpret_cast<const uint32_t*>(&p);
}

// Eight e2m1 nibbles (low nibble first) as four bf16 pairs, nibbles (p, p + 4) in pair p, each
// the value times 2^-126 exactly: the magnitude's bits (e1 e0 m) at bf16 bits 8..6 give exponent
// field e and mantissa m/2, 2^(e - 127)(1 + m/2) for e > 0 and 2^-126 m/2 (a subnormal) for
// e = 0, the e2m1 value times 2^-126 in both cases; the sign goes to bit 15.
// Three instructions a pair: the pair's two nibbles masked out (v), then one integer product
// puts two copies of each, v 2^a (magnitude at bits 6..8) plus v 2^(a + 6) (sign at bit 15);
// the copies do not overlap, so the product is their bitwise or, and a last mask keeps those
// bits. Nibbles 2 and 3 (6 and 7) sit too high for a left shift to reach bit 6, so pairs 2 and 3
// take them from the word shifted down a byte, once for both.
__device__ __forceinline__ void e2m1x8_bf16(uint32_t w, uint32_t (&out)[4]) {
    const uint32_t words[2] = {w, w >> 8};
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const int at = 4 * (p & 1);  // the pair's low nibble at bits at..at + 3 of its word
        const uint32_t v = words[p >> 1] & (0x000F000Fu << at);
        out[p] = (v * ((1u << (6 - at)) + (1u << (12 - at)))) & 0x81C081C0u;
    }
}

// Chunk i (eight columns) of a load as four bf16 pairs, exactly (see the header; fp4 pairs
// columns (p, p + 4), PAIRED).
template <bool WIDE>
__device__ __forceinline__ uint4 chunk_bf16(const WeightChunks<C>& r, const LoadScale& s, int i) {
#if defined(WEIGHT_BF16)
    return r.one.v;
#elif defined(WEIGHT_FP8)
    float v[8];
    const uint32_t words[2] = {r.word(2 * i), r.word(2 * i + 1)};
#pragma unroll
    for (int p = 0; p < 4; ++p) {  // e4m3 pairs to f16x2 in one conversion (sm_89+), exact
        const __nv_fp8x2_storage_t pair = (__nv_fp8x2_storage_t)(words[p / 2] >> (16 * (p & 1)));
        const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
        v[2 * p] = f.x;
        v[2 * p + 1] = f.y;
    }
    return make_uint4(bf16x2(v[0], v[1]), bf16x2(v[2], v[3]), bf16x2(v[4], v[5]),
                      bf16x2(v[6], v[7]));
#else
    uint32_t q[4];
    e2m1x8_bf16(r.word(i), q);
#if defined(WEIGHT_NVFP4)
    const int h = i / 2;  // 16 columns a scale
#else
    const int h = 0;
#endif
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        q[p] = bf16x2_mul(q[p], s.f[h]);  // exact (see LoadScale)
        if (WIDE && s.g) q[p] = bf16x2_mul(q[p], s.g);  // exact where the reference's v * s is
    }
    return make_uint4(q[0], q[1], q[2], q[3]);
#endif
}

// The activations of one chunk (eight bf16 columns, pairs (2p, 2p + 1) in word p) in the pairs
// the weights use: as they are, or (p, p + 4) for fp4.
__device__ __forceinline__ uint4 pair_x(const uint4& x) {
#if PAIRED
    // one byte permute a word (a's and b's low halves, or their high halves)
    auto lo = [](uint32_t a, uint32_t b) { return __byte_perm(a, b, 0x5410); };
    auto hi = [](uint32_t a, uint32_t b) { return __byte_perm(a, b, 0x7632); };
    return make_uint4(lo(x.x, x.z), hi(x.x, x.z), lo(x.y, x.w), hi(x.y, x.w));
#else
    return x;
#endif
}

__device__ __forceinline__ uint32_t word_of(const uint4& q, int i) {
    return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w;
}

// ------------------------------------------------------------------ the weight loads

// A load reads 64 bytes of each of a warp's 16 rows (four lanes' 16), and the warp's next rounds
// read the row's following bytes: GEMV_MMA_L2_FETCH = 128 (or 256) asks L2 to fetch that many
// bytes around each load from DRAM (ld's L2 prefetch size), so the next round's loads of the row
// meet them in L2 (benchmarks/bench_gpu_variants.py --only gemv_mma: Llama-3.1-8B's bf16 and
// fp8 GEMVs 5-14 % faster at 128 than plain loads, less so at 256; docs/gpu-notes.md,
// version 17). 0: plain loads. gemv.cu's warps read 512 contiguous bytes a load and gain nothing.
#ifndef GEMV_MMA_L2_FETCH
#define GEMV_MMA_L2_FETCH 128
#endif

__device__ __forceinline__ uint4 load16(const void* p) {
    uint4 r;
#if GEMV_MMA_L2_FETCH == 128
    asm("ld.global.nc.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
#elif GEMV_MMA_L2_FETCH == 256
    asm("ld.global.nc.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
#elif GEMV_MMA_L2_FETCH == 0
    r = *(const uint4*)p;
#else
#error "GEMV_MMA_L2_FETCH is 0, 128 or 256"
#endif
    return r;
}

// weight_chunks_load (metrale.cuh) with the data's 16 bytes read by load16: C chunks of one
// weight row from column c, and the scales they use.
__device__ __forceinline__ WeightChunks<C> chunks_load(WeightRef w, int c) {
    WeightChunks<C> r;
#if defined(WEIGHT_BF16)
    r.one.v = load16((const __nv_bfloat16*)w.data + c);
#elif defined(WEIGHT_FP8)
    r.v = load16((const uint8_t*)w.data + c);
#else
    r.v = load16((const uint8_t*)w.data + c / 2);
#if defined(WEIGHT_MXFP4)
    r.s = ((const uint8_t*)w.scale)[c / 32];  // the 32 columns share one scale
#else
    r.s = *(const uint16_t*)((const uint8_t*)w.scale + c / 16);
#endif
#endif
    return r;
}

// ------------------------------------------------------------------ the k-block partials

// Rounds of loads a lane keeps in flight (each T tiles x 2 rows x 16 bytes, and the activations),
// per entry: GEMV_MMA_AHEAD for linear, linear_add and lm_head. Rounds in flight cost registers,
// and registers decide how many blocks a multiprocessor holds (three of 256 threads at 80 a
// thread, four at 64), so whether a grid runs in one wave. At Llama-3.1-8B's fp4 qkv shape (384
// blocks) two rounds take 85-86 registers, two blocks a multiprocessor, and one round 59-64; one
// round ran that shape 6-8 % faster at one row and 26 % at eight. fp8's gate_up_swiglu (896
// blocks; 80 registers at two rounds, 58 at one) ran 9-12 % faster at one round. Both timed
// alone, the shape through the linear entry (benchmarks/results/gpu_variants_gemv_mma_ahead_v34
// .json). The linear entries at k = 14336 lose 7-33 % at one round, so they keep theirs.
#ifndef GEMV_MMA_AHEAD
#define GEMV_MMA_AHEAD (DOT_CHUNKS == 4 ? 2 : 4)  // fp4: 128 columns a round
#endif
#ifndef GEMV_MMA_QKV_AHEAD
#define GEMV_MMA_QKV_AHEAD (DOT_CHUNKS == 4 ? 1 : GEMV_MMA_AHEAD)
#endif
#ifndef GEMV_MMA_GATE_UP_AHEAD  // rounds of both tiles' loads
#if defined(WEIGHT_FP8)
#define GEMV_MMA_GATE_UP_AHEAD 1
#else
#define GEMV_MMA_GATE_UP_AHEAD (GEMV_MMA_AHEAD / 2 > 1 ? GEMV_MMA_AHEAD / 2 : 1)
#endif
#endif

// Shared memory: the partial of k-block b, tile j, output column m (of GROUP), activation row r
// at part[((b T + j) GROUP + m) XROWS + r]; KERNELS.toml's launch.shared is
// ceil(k / K_BLOCK) T GROUP XROWS 4 bytes.
template <int T>
__device__ __forceinline__ float& partial(float* part, int b, int j, int m, int r) {
    return part[((b * T + j) * GROUP + m) * XROWS + r];
}

// The MMAs of one round: tile j's rows g and g + 8 (w[j][0], w[j][1], raw) against the activation
// chunks xa (lane group g's row), into acc[j]; chunk i's bf16 pairs (0, 1) feed one MMA and
// (2, 3) the next, as the header says. WIDE: mxfp4 scales past 2 (LoadScale).
template <int T, bool WIDE>
__device__ __forceinline__ void round_mmas_scaled(float (&acc)[T][4],
                                                  const WeightChunks<C> (&w)[T][2],
                                                  const uint4 (&xa)[C]) {
    uint4 xp[C];
#pragma unroll
    for (int i = 0; i < C; ++i) xp[i] = pair_x(xa[i]);
#pragma unroll
    for (int j = 0; j < T; ++j) {
        const LoadScale s0 = load_scale<WIDE>(w[j][0]), s8 = load_scale<WIDE>(w[j][1]);
#pragma unroll
        for (int i = 0; i < C; ++i) {
            const uint4 a0 = chunk_bf16<WIDE>(w[j][0], s0, i);
            const uint4 a8 = chunk_bf16<WIDE>(w[j][1], s8, i);
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const uint32_t a[4] = {word_of(a0, 2 * q), word_of(a8, 2 * q),
                                       word_of(a0, 2 * q + 1), word_of(a8, 2 * q + 1)};
                mma_bf16(acc[j], a, word_of(xp[i], 2 * q), word_of(xp[i], 2 * q + 1));
            }
        }
    }
}

// The round on the path its scales need: the WIDE one only where a lane of the warp loaded an
// mxfp4 scale past 2 (a warp-uniform branch: the warp's lanes run every round together).
template <int T>
__device__ __forceinline__ void round_mmas(float (&acc)[T][4], const WeightChunks<C> (&w)[T][2],
                                           const uint4 (&xa)[C]) {
#if defined(WEIGHT_MXFP4)
    bool wide = false;
#pragma unroll
    for (int j = 0; j < T; ++j) wide = wide || wide_scale(w[j][0]) || wide_scale(w[j][1]);
    if (__any_sync(0xffffffffu, wide)) {
        round_mmas_scaled<T, true>(acc, w, xa);
        return;
    }
#endif
    round_mmas_scaled<T, false>(acc, w, xa);
}

// A k-block's partials (acc, fresh for each k-block) into `part`: acc e is output column
// g + 8 (e / 2), activation row 2t + e % 2.
template <int T>
__device__ __forceinline__ void store_partials(float* part, int b, const float (&acc)[T][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < T; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            partial<T>(part, b, j, g + 8 * (e >> 1), 2 * t + (e & 1)) = acc[j][e];
}

// Lane group g's activations for one round at column c (zeros past k, or for a row past nr).
__device__ __forceinline__ void round_x(uint4 (&xa)[C], const act_t* xr, bool live, int c, int k) {
#pragma unroll
    for (int i = 0; i < C; ++i)
        xa[i] = live && c < k ? *(const uint4*)(xr + c + 8 * i) : make_uint4(0u, 0u, 0u, 0u);
}

// Every k-block partial of this block's T x GROUP weight rows against activation rows
// x[0, nr) (nr <= 8), into `part`. wrow(j, m) is tile j's m-th weight row, already clamped to a
// real row. Each lane loads its fragments' 16-byte chunks straight into registers, AHEAD rounds
// ahead; the first rounds' weights are loaded before grid_dependency_sync (launches write no
// weights); the activations and every write come after it.
template <int T, int AHEAD, class WRow>
__device__ __forceinline__ void gemv_mma_partials(const act_t* x, int nr, int k, WRow wrow,
                                                  float* part) {
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
    const act_t* xr = x + (long)min(g, nr - 1) * k;
    // step s: this warp's k-block warp + WARPS (s / ROUNDS), round s % ROUNDS; lane's columns
    auto col = [&](int s) {
        return (warp + WARPS * (s / ROUNDS)) * K_BLOCK + (s % ROUNDS) * ROUND + 8 * C * t;
    };
    WeightChunks<C> wr[AHEAD][T][2];
    uint4 xa[AHEAD][C];
    auto load_w = [&](int u, int s) {
        const int c = col(s);
#pragma unroll
        for (int j = 0; j < T; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (s < steps && c < k) {
                    wr[u][j][h] = chunks_load(w[j][h], c);
                } else {
                    wr[u][j][h] = WeightChunks<C>{};
#if defined(WEIGHT_MXFP4)
                    wr[u][j][h].s = 127u;  // scale 1: the zero chunk stays zero
#endif
                }
            }
    };
#pragma unroll
    for (int u = 0; u < AHEAD; ++u) load_w(u, u);
    grid_dependency_sync();
#pragma unroll
    for (int u = 0; u < AHEAD; ++u) round_x(xa[u], xr, u < steps && g < nr, col(u), k);

    float acc[T][4];
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
            round_mmas<T>(acc, wr[u], xa[u]);
            load_w(u, s + AHEAD);
            round_x(xa[u], xr, s + AHEAD < steps && g < nr, col(s + AHEAD), k);
            if (s % ROUNDS == ROUNDS - 1) store_partials<T>(part, warp + WARPS * (s / ROUNDS), acc);
        }
    }
    __syncthreads();
}
// Output (j, m, r) of the block's partials: k-blocks summed in order, sequentially.
template <int T>
__device__ __forceinline__ float gemv_mma_sum(float* part, int k, int j, int m, int r) {
    const int nkb = (k + K_BLOCK - 1) / K_BLOCK;
    float s = partial<T>(part, 0, j, m, r);
    for (int b = 1; b < nkb; ++b) s = s + partial<T>(part, b, j, m, r);
    return s * SUM_FACTOR;
}

// The gate/up entries' blocks a multiprocessor (__launch_bounds__'s second argument). mxfp4 fits
// in 64 registers there without a spill, four blocks rather than three, so Llama-3.1-8B's 896
// blocks take 1.7 waves rather than 2.3: 2-3 % faster alone (docs/gpu-notes.md, version 34).
// ptxas spills nvfp4 at 64, bf16 ran 3-5 % slower, and fp8 (one round) is below 64 anyway.
// (A second argument of 1 is not the same as none: ptxas then gave nvfp4's entry 144 registers.)
// GEMV_MMA_GATE_UP_BLOCKS overrides it (0: no second argument).
#ifndef GEMV_MMA_GATE_UP_BLOCKS
#if defined(WEIGHT_MXFP4)
#define GEMV_MMA_GATE_UP_BLOCKS 4
#else
#define GEMV_MMA_GATE_UP_BLOCKS 0
#endif
#endif
#if GEMV_MMA_GATE_UP_BLOCKS
#define GATE_UP_BOUNDS __launch_bounds__(THREADS, GEMV_MMA_GATE_UP_BLOCKS)
#else
#define GATE_UP_BOUNDS __launch_bounds__(THREADS)
#endif

extern __shared__ __align__(16) float gemv_mma_part[];

// Metrale CUDA, sm_90a: the GEMM-shaped points whose k runs as one chain of 16-wide steps
// (k_block = 16, the bounded relations `chain_*` of FUSIONS.toml): linear, lm_head, linear_add,
// qkv and gate_up_swiglu with bf16 activations and bf16 weights, from 128 rows.
//
// Order (declared in KERNELS.toml, "wgmma"): each wgmma adds its 16 products to the running f32
// accumulator, from k's first step to its last: blocks of 16 combined sequentially, no partial
// kept apart. gemm_tma.cu keeps a 256-wide k-block's partial beside the sum, three sets of 64
// registers for a warpgroup's 64 x 128 slice; with the one set, a warpgroup holds a 64 x 256
// slice in 128 registers (m64n256k16 wgmmas) and a block of two consumer warpgroups a 128 x 256
// tile: each activation byte a stage brings feeds twice the MMAs of gemm_tma.cu's 128 x 128
// tile, each stage byte 4/3 as many. Where those wide tiles are fewer than the multiprocessors
// (`wide` 0: Qwen3-0.6B's o_proj at 2048 rows, 64 tiles), the plain entries take 128 x 128
// tiles instead (m64n128k16), twice as many blocks; every output is the same chain of 16-wide
// steps either way.
//
// A block of three warpgroups: warpgroups 0 and 1 consume (rows 64 wg + [0, 64) of the tile,
// all its columns), warpgroup 2 produces: one of its threads copies each stage's activation box
// (64 columns by 128 rows) and weight boxes (128 rows each: one or two, gate_up_swiglu's 128
// gate and 128 up rows) by the Tensor Memory Accelerator (tma.cuh), counted on the stage's full
// barrier, rows and columns past the arrays as zeros. Each consumer warp frees a stage on its
// empty barrier once its wgmmas that read it are done; the producer refills it once all eight
// have. The grid may be smaller than the tiles: a block takes tiles blockIdx.x, + gridDim.x,
// ..., and its producer copies the next tile's stages while the consumers store the last one's
// outputs. Rows past the launch's come as zeros and are not stored; a row's sums are the same
// wgmmas whatever the rows (row-invariant).
// mxfp4 weights (each a bf16 value exactly: a 4-bit float times a power of two) are made bf16,
// whole, by the launch before (weights_bf16.cu, into the tables' `scratch`), and the entries
// copy that copy as they copy bf16 weights: the same operands, so the k_block = 16 point's bytes
// are those of the same weights given in bf16.
// Defines: ACT_BF16, WEIGHT_BF16 or WEIGHT_MXFP4, K_BLOCK (16), OUT_F32 (lm_head).
#include "mma_weights.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

#if !defined(ACT_BF16) || !(defined(WEIGHT_BF16) || defined(WEIGHT_MXFP4))
#error "gemm_chain.cu takes bf16 activations and bf16 or mxfp4 weights (KERNELS.toml's `when`)"
#endif
#include "weights_bf16.cu"  // mxfp4 weights made bf16 first (exactly), the launch before
static_assert(K_BLOCK == 16, "gemm_chain.cu's order is k in blocks of 16, one a wgmma step");

constexpr int CHAIN_BM = 128, CHAIN_BK = 64;  // a tile's rows, and a stage's k
constexpr int CHAIN_ACT_BYTES = CHAIN_BM * 128;  // a stage: 128 activation rows of 128 bytes
constexpr int CHAIN_STAGE_SPACE = 4 * (CHAIN_ACT_BYTES + 256 * 128);  // four wide stages
constexpr int CHAIN_MAX_STAGES = 6;  // of narrow ones (32 KiB) in the same space
// the dynamic shared memory a launch needs: the stages, the first one's alignment, the barriers
constexpr unsigned CHAIN_SHARED = CHAIN_STAGE_SPACE + 1024 + 2 * CHAIN_MAX_STAGES * 8;
constexpr int CHAIN_PRODUCER_REGS = 40, CHAIN_CONSUMER_REGS = 232;  // 128 x 40 + 256 x 232

// A tile BN columns wide: its weight rows a stage, its stages, a consumer thread's accumulators.
template <int BN>
struct ChainTile {
    static constexpr int stage_bytes = CHAIN_ACT_BYTES + BN * 128;
    static constexpr int stages = CHAIN_STAGE_SPACE / stage_bytes;  // 4 wide, 6 narrow
    static constexpr int acc = BN / 2;
    static_assert(stages <= CHAIN_MAX_STAGES, "the barriers CHAIN_SHARED counts");
};

// d = a · bᵀ (+ d when add) for a 64 x 16 activation slice and a 256 x 16 weight slice.
__device__ __forceinline__ void wgmma_chain(float (&d)[128], uint64_t a, uint64_t b, int add) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
        "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
        "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "
        "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, "
        "%72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, "
        "%84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, "
        "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, "
        "%120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
          "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
          "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
          "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
          "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]),
          "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),
          "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
          "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]),
          "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]),
          "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]),
          "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]),
          "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]),
          "+f"(d[126]), "+f"(d[127])
        : "l"(a), "l"(b), "r"(add)
        : "memory");
}

// The same for a 128 x 16 weight slice.
__device__ __forceinline__ void wgmma_chain(float (&d)[64], uint64_t a, uint64_t b, int add) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
        "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
        "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "
        "%60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
          "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
          "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
          "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
          "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b), "r"(add)
        : "memory");
}

// The thread's place in its warpgroup's 64-row slice: accumulator register 4 j + e holds row
// 64 wg + 16 w + g + 8 (e / 2), column 8 j + 2 t + e % 2 (w the warp in its warpgroup, g = lane
// / 4, t = lane % 4).
struct ChainPlace {
    int wg, w, g, t;
    __device__ ChainPlace()
        : wg(threadIdx.x >> 7), w((threadIdx.x >> 5) & 3), g((threadIdx.x & 31) >> 2),
          t(threadIdx.x & 3) {}
    __device__ int row(int i) const { return 64 * wg + 16 * w + g + 8 * ((i & 3) >> 1); }
    __device__ int col(int i) const { return 8 * (i >> 2) + 2 * t + (i & 1); }
};

// Where a tile's weight rows come from: `boxes` boxes of 128 rows, box b at weight row row[b] of
// map[b].
struct ChainBoxes {
    const TensorMap* map[2];
    int row[2];
    int boxes;
};

// The tiles of a launch: 128 activation rows by a column tile, rows fastest (the blocks side by
// side share a weight tile).
struct ChainTiles {
    int row_tiles, count;
    __device__ ChainTiles(int rows, int col_tiles)
        : row_tiles((rows + CHAIN_BM - 1) / CHAIN_BM), count(row_tiles * col_tiles) {}
    __device__ int m0(int t) const { return t % row_tiles * CHAIN_BM; }
    __device__ int col(int t) const { return t / row_tiles; }
};

// The launch these entries serve: 384 threads, one grid dimension, k whole 16-byte rows (a
// tensor map's stride) and the shared memory the stages need. Anything else traps (loud).
__device__ __forceinline__ void check_chain_launch(int k) {
    if (blockDim.x != 384 || (k & 7) || k <= 0 || gridDim.y != 1 || gridDim.z != 1 ||
        dynamic_smem_bytes() < CHAIN_SHARED)
        __trap();
}

// The sums of the BN-wide tiles of `tl` this block takes: at(t, m0) gives tile t's weight boxes
// and sets its first activation row m0; the tile's sums (rows m0 + [0, 128) of xm, all of k, in
// the layout of ChainPlace) go to finish(t, m0, acc) in the consumer threads.
template <int BN, class At, class Finish>
__device__ __forceinline__ void chain_tiles(const TensorMap& xm, const ChainTiles& tl, int k,
                                            At at, Finish finish) {
    using T = ChainTile<BN>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const uint32_t raw_at = smem_addr(smem_raw), base_at = (raw_at + 1023) & ~1023u;
    unsigned char* base = smem_raw + (base_at - raw_at);
    uint64_t* full = (uint64_t*)(base + CHAIN_STAGE_SPACE);
    uint64_t* empty = full + CHAIN_MAX_STAGES;
    if (threadIdx.x == 0) {
        for (int s = 0; s < T::stages; ++s) {
            bar_init(&full[s], 1);   // the producer's arrival, with the stage's bytes
            bar_init(&empty[s], 8);  // every consumer warp, its wgmmas on the stage done
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int ktiles = (k + CHAIN_BK - 1) / CHAIN_BK;
    if (threadIdx.x >= 256) {  // the producer warpgroup: its registers to the consumers
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(CHAIN_PRODUCER_REGS));
        if (threadIdx.x == 256) {
            int it = 0;
            for (int t = blockIdx.x; t < tl.count; t += gridDim.x) {
                int m0;
                const ChainBoxes wb = at(t, m0);
                for (int kt = 0; kt < ktiles; ++kt, ++it) {
                    const int s = it % T::stages;
                    if (it >= T::stages) bar_wait(&empty[s], (it / T::stages - 1) & 1);
                    unsigned char* stage = base + s * T::stage_bytes;
                    bar_expect(&full[s], T::stage_bytes);
                    tma_load(stage, xm, kt * CHAIN_BK, m0, &full[s]);
                    for (int b = 0; b < wb.boxes; ++b)
                        tma_load(stage + CHAIN_ACT_BYTES + b * 128 * 128, *wb.map[b],
                                 kt * CHAIN_BK, wb.row[b], &full[s]);
                }
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CHAIN_CONSUMER_REGS));
    const ChainPlace pl;
    const bool lead = (threadIdx.x & 31) == 0;
    int it = 0;
    for (int t = blockIdx.x; t < tl.count; t += gridDim.x) {
        int m0;
        at(t, m0);
        float acc[T::acc];
        for (int kt = 0; kt < ktiles; ++kt, ++it) {
            const int s = it % T::stages;
            bar_wait(&full[s], (it / T::stages) & 1);
            const uint32_t stage_at = base_at + s * T::stage_bytes;
            const uint64_t a_desc = operand_desc(stage_at + pl.wg * 64 * 128),
                           b_desc = operand_desc(stage_at + CHAIN_ACT_BYTES);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < CHAIN_BK / 16; ++kk)  // the tile's first step starts from zero
                wgmma_chain(acc, a_desc + desc_step(32 * kk), b_desc + desc_step(32 * kk),
                            kt > 0 || kk > 0);
            wgmma_commit();
            wgmma_wait<1>();  // the previous k-tile's wgmmas done: its stage is free
            if (lead && kt > 0) bar_arrive(&empty[(it - 1) % T::stages]);
        }
        wgmma_wait<0>();
        if (lead) bar_arrive(&empty[(it - 1) % T::stages]);
        finish(t, m0, acc);
    }
}

// ------------------------------------------------------------------ 16-byte stores
// A quad (lanes 4 g + t, t = 0..3) holds each 16-byte run of a row's outputs as four words, one
// a lane (accumulator registers 4 j + 2 h and 4 j + 2 h + 1: row half h, columns 8 j + 2 t and
// + 1). For two n8 tiles (j = 2 p, 2 p + 1) and both row halves, four runs: a 4 x 4 transpose
// of the quad's words (two rounds of exchanges) gives lane t run t whole, stored at once where
// the plain entries store a word a lane. Its words in column order, so the bytes are the same.

// w[s] (run s's word of this lane) becomes lane s's word of run t, for s = 0..3: after the round
// of bit b each lane holds, in the slots whose bit b differs from its own, its partner's.
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4]) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int b = 1; b <= 2; b <<= 1) {
        const bool hi = t & b;
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int lo = b == 1 ? 2 * k : k, up = lo | b;  // a slot pair, bit b clear and set
            const uint32_t got = __shfl_xor_sync(0xffffffffu, hi ? w[lo] : w[up], b);
            if (hi) w[lo] = got;
            else w[up] = got;
        }
    }
}

// Two values as one word of bf16 outputs (the first in the low half).
__device__ __forceinline__ uint32_t bf16_word(float a, float b) {
    const act_t pa = act_store(a), pb = act_store(b);
    return (uint32_t)*(const uint16_t*)&pa | (uint32_t)*(const uint16_t*)&pb << 16;
}

// A tile slice's NJ n8 tiles of bf16 outputs (NJ even) as 16-byte runs: word(i) the word of
// registers i and i + 1, put(row, col, run) for each run in the launch's rows (m0 + row; col
// its first column in the tile, a multiple of 8).
template <int NJ, class Word, class Put>
__device__ __forceinline__ void store_runs(const ChainPlace& pl, int m0, int rows, Word word,
                                           Put put) {
    const int t = pl.t;
#pragma unroll
    for (int p = 0; p < NJ / 2; ++p) {
        uint32_t w[4];
#pragma unroll
        for (int s = 0; s < 4; ++s) w[s] = word(4 * (2 * p + (s >> 1)) + 2 * (s & 1));
        quad_transpose(w);
        const int i = 4 * (2 * p + (t >> 1)) + 2 * (t & 1), row = m0 + pl.row(i);
        if (row < rows) put(row, 8 * (2 * p + (t >> 1)), make_uint4(w[0], w[1], w[2], w[3]));
    }
}

// The plain tiles' outputs (linear, lm_head, linear_add, qkv), BN columns wide: tile t's column
// tile c gives its weight map and first column by pick(c, n0, map); where `runs` (every output's
// columns a multiple of 8), put(c, row, col, run) for each 16-byte run of bf16 outputs in the
// launch's rows (store_runs), else out(c, row, col, s0, s1) for each pair of sums (columns col and
// col + 1, col even).
template <int BN, class Pick, class Out, class Put>
__device__ __forceinline__ void chain_plain(const TensorMap& xm, int rows, int k, int col_tiles,
                                            bool runs, Pick pick, Out out, Put put) {
    const ChainTiles tl(rows, col_tiles);
    chain_tiles<BN>(xm, tl, k,
                    [&](int t, int& m0) {
                        m0 = tl.m0(t);
                        int n0;
                        const TensorMap* map;
                        pick(tl.col(t), n0, map);
                        return ChainBoxes{{map, map}, {n0, n0 + 128}, BN / 128};
                    },
                    [&](int t, int m0, const float (&acc)[ChainTile<BN>::acc]) {
                        constexpr int NJ = ChainTile<BN>::acc / 4;  // the slice's n8 tiles
                        const ChainPlace pl;
                        int n0;
                        const TensorMap* map;
                        pick(tl.col(t), n0, map);
                        const int c = tl.col(t);
                        if (runs) {
                            auto at = [&](int row, int col, auto run) {
                                put(c, row, n0 + col, run);
                            };
                            store_runs<NJ>(pl, m0, rows,
                                           [&](int i) { return bf16_word(acc[i], acc[i + 1]); },
                                           at);
                            return;
                        }
#pragma unroll
                        for (int i = 0; i < ChainTile<BN>::acc; i += 2) {
                            const int row = m0 + pl.row(i);
                            if (row < rows)
                                out(tl.col(t), row, n0 + pl.col(i), acc[i], acc[i + 1]);
                        }
                    });
}

// Outputs i and i + 1 of a row-major array of n columns (the columns col and col + 1 of a row,
// col even): one store of the pair where both lie in the row and the pair is aligned (n even),
// else each on its own.
template <class T, class Conv>
__device__ __forceinline__ void store_pair(T* out, long i, int col, int n, float a, float b,
                                           Conv conv) {
    if (col + 1 < n && !(i & 1)) {
        if constexpr (sizeof(T) == 2) {
            const T pa = conv(a), pb = conv(b);
            *(uint32_t*)(out + i) =
                (uint32_t)*(const uint16_t*)&pa | (uint32_t)*(const uint16_t*)&pb << 16;
        } else {
            *(float2*)(out + i) = make_float2(conv(a), conv(b));
        }
    } else {
        if (col < n) out[i] = conv(a);
        if (col + 1 < n) out[i + 1] = conv(b);
    }
}

// body(Width<BN>()) at the launch's tile width: 256 columns where `wide`, else 128.
template <int BN>
struct Width {
    static constexpr int bn = BN;
};
template <class Body>
__device__ __forceinline__ void by_width(int k, int wide, Body body) {
    grid_dependency_sync();
    check_chain_launch(k);
    if (wide)
        body(Width<256>());
    else
        body(Width<128>());
}

// block 384; grid (min(tiles, sms), 1, 1), tiles = ceil(rows / 128) ceil(n / bn), bn = 256
// where `wide`, else 128. y = x · wᵀ (lm_head: f32 logits).
extern "C" __global__ void __launch_bounds__(384, 1)
metrale_linear_chain(const __grid_constant__ TensorMap x, const __grid_constant__ TensorMap w,
                     out_t* __restrict__ y, int rows, int k, int n, int wide) {
    by_width(k, wide, [&](auto width) {
        constexpr int BN = decltype(width)::bn;
        // lm_head's f32 logits in pairs: their 16-byte runs (a float4 of two lanes' pairs) ran
        // Llama-3.1-8B's 2048 rows 5 % slower than pairs on an H100
        chain_plain<BN>(
            x, rows, k, (n + BN - 1) / BN, sizeof(out_t) == 2 && n % 8 == 0,
            [&](int c, int& n0, const TensorMap*& map) { n0 = c * BN, map = &w; },
            [&](int, int row, int col, float a, float b) {
                store_pair(y, (long)row * n + col, col, n, a, b,
                           [](float v) { return out_store(v); });
            },
            [&](int, int row, int col, auto run) {
                if (col < n) *(decltype(run)*)(y + (long)row * n + col) = run;
            });
    });
}

// y = round(round(x · wᵀ) + r), as linear then add.
extern "C" __global__ void __launch_bounds__(384, 1)
metrale_linear_add_chain(const __grid_constant__ TensorMap x,
                         const __grid_constant__ TensorMap w, const act_t* __restrict__ r,
                         act_t* __restrict__ y, int rows, int k, int n, int wide) {
    by_width(k, wide, [&](auto width) {
        constexpr int BN = decltype(width)::bn;
        chain_plain<BN>(
            x, rows, k, (n + BN - 1) / BN, n % 8 == 0,
            [&](int c, int& n0, const TensorMap*& map) { n0 = c * BN, map = &w; },
            [&](int, int row, int col, float a, float b) {
                const long i = (long)row * n + col;
                const float ra = act_load(r[i]), rb = col + 1 < n ? act_load(r[i + 1]) : 0.0f;
                store_pair(y, i, col, n, act_round(a) + ra, act_round(b) + rb,
                           [](float v) { return act_store(v); });
            },
            [&](int, int row, int col, uint4 run) {  // run: the rounded sums, r's run beside
                if (col >= n) return;
                const long i = (long)row * n + col;
                const uint4 rr = *(const uint4*)(r + i);
                const uint32_t sw[4] = {run.x, run.y, run.z, run.w},
                               rw[4] = {rr.x, rr.y, rr.z, rr.w};
                uint32_t yw[4];
#pragma unroll
                for (int e = 0; e < 4; ++e)  // a word's low bf16 and its high one, exactly as f32
                    yw[e] = bf16_word(__uint_as_float(sw[e] << 16) + __uint_as_float(rw[e] << 16),
                                      __uint_as_float(sw[e] & 0xffff0000u) +
                                          __uint_as_float(rw[e] & 0xffff0000u));
                *(uint4*)(y + i) = make_uint4(yw[0], yw[1], yw[2], yw[3]);
            });
    });
}

// q, k_, v in one launch: the column tiles count q's, then k_'s, then v's, each output's own.
extern "C" __global__ void __launch_bounds__(384, 1)
metrale_qkv_chain(const __grid_constant__ TensorMap x, const __grid_constant__ TensorMap wq,
                  const __grid_constant__ TensorMap wk, const __grid_constant__ TensorMap wv,
                  act_t* __restrict__ q, act_t* __restrict__ k_, act_t* __restrict__ v, int rows,
                  int k, int nq, int nk, int nv, int wide) {
    by_width(k, wide, [&](auto width) {
        constexpr int BN = decltype(width)::bn;
        const int tq = (nq + BN - 1) / BN, tk = (nk + BN - 1) / BN, tv = (nv + BN - 1) / BN;
        // column tile c's output part (0 q, 1 k_, 2 v) and its first column in that output
        auto part = [&](int c, int& n0) {
            const int p = c < tq ? 0 : c < tq + tk ? 1 : 2;
            n0 = (c - (p == 0 ? 0 : p == 1 ? tq : tq + tk)) * BN;
            return p;
        };
        // column tile c's output and its columns
        auto output = [&](int c, int& n) {
            int n0;
            const int p = part(c, n0);
            n = p == 0 ? nq : p == 1 ? nk : nv;
            return p == 0 ? q : p == 1 ? k_ : v;
        };
        chain_plain<BN>(
            x, rows, k, tq + tk + tv, nq % 8 == 0 && nk % 8 == 0 && nv % 8 == 0,
            [&](int c, int& n0, const TensorMap*& map) {
                const int p = part(c, n0);
                map = p == 0 ? &wq : p == 1 ? &wk : &wv;
            },
            [&](int c, int row, int col, float a, float b) {
                int n;
                act_t* out = output(c, n);
                store_pair(out, (long)row * n + col, col, n, a, b,
                           [](float v) { return act_store(v); });
            },
            [&](int c, int row, int col, uint4 run) {
                int n;
                act_t* out = output(c, n);
                if (col < n) *(uint4*)(out + (long)row * n + col) = run;
            });
    });
}

// h = silu(round(x · wgᵀ)) * round(x · wuᵀ) for 128 columns a tile: weight tile rows [0, 128)
// are the gate rows of columns n0 + [0, 128), rows [128, 256) the up rows of the same columns,
// so a thread's registers i and i + 64 hold the two dots of one output, stored two adjacent
// outputs at once (store_pair). Always wide: its tiles are as many as a plain launch's of 2n
// columns.
// block 384; grid (min(tiles, sms), 1, 1), tiles = ceil(rows / 128) ceil(n / 128).
extern "C" __global__ void __launch_bounds__(384, 1)
metrale_gate_up_swiglu_chain(const __grid_constant__ TensorMap x,
                             const __grid_constant__ TensorMap wg,
                             const __grid_constant__ TensorMap wu, act_t* __restrict__ h,
                             int rows, int k, int n) {
    constexpr int HALF = 128, ACC = ChainTile<256>::acc;
    grid_dependency_sync();
    check_chain_launch(k);
    const ChainTiles tl(rows, (n + HALF - 1) / HALF);
    chain_tiles<256>(x, tl, k,
                     [&](int t, int& m0) {
                         m0 = tl.m0(t);
                         const int n0 = tl.col(t) * HALF;
                         return ChainBoxes{{&wg, &wu}, {n0, n0}, 2};
                     },
                     [&](int t, int m0, const float (&acc)[ACC]) {
                         const ChainPlace pl;
                         const int n0 = tl.col(t) * HALF;
                         if (n % 8 == 0) {  // 16-byte runs (store_runs)
                             store_runs<HALF / 8>(
                                 pl, m0, rows,
                                 [&](int i) {
                                     return bf16_word(
                                         silu_mul(act_round(acc[i]), act_round(acc[i + ACC / 2])),
                                         silu_mul(act_round(acc[i + 1]),
                                                  act_round(acc[i + 1 + ACC / 2])));
                                 },
                                 [&](int row, int col, uint4 run) {
                                     if (n0 + col < n)
                                         *(uint4*)(h + (long)row * n + n0 + col) = run;
                                 });
                             return;
                         }
#pragma unroll
                         for (int i = 0; i < ACC / 2; i += 2) {
                             const int row = m0 + pl.row(i), col = n0 + pl.col(i);
                             if (row < rows)
                                 store_pair(h, (long)row * n + col, col, n,
                                            silu_mul(act_round(acc[i]),
                                                     act_round(acc[i + ACC / 2])),
                                            silu_mul(act_round(acc[i + 1]),
                                                     act_round(acc[i + 1 + ACC / 2])),
                                            [](float v) { return act_store(v); });
                         }
                     });
}

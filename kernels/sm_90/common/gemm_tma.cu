// Metrale CUDA, sm_90a: the GEMM-shaped points with bf16 activations past 64 rows (quantized
// weights: past the tables' `tma` threshold), their tiles copied by the Tensor Memory Accelerator
// (tma.cuh) and consumed by warpgroups that wait on barriers, not on each other. A residual of
// the sm_90 class beside gemm_wgmma.cu, whose entries serve the launches this one does not (up to
// 64 rows, or the threshold; KERNELS.toml's `then`).
//
// A block of three warpgroups computes a 128 x 128 tile of y = x · wᵀ (gate_up_swiglu: 128 x 64,
// gate and up rows side by side): warpgroups 0 and 1 consume, as gemm_wgmma.cu's two warpgroups
// do (the same m64n128k16 wgmmas on the same 128-byte-swizzled stages, the same order, so the
// same bytes); warpgroup 2 produces, one thread issuing each stage's two tensor copies (the
// activation tile and the weight tile, rows and columns past the arrays as zeros) counted on the
// stage's full barrier. A consumer warp frees a stage on its empty barrier once its wgmmas that
// read it are done; the producer refills a stage once all eight consumer warps have freed it.
// No block-wide barrier in the loop, and no thread of a consumer issues a copy: gemm_wgmma.cu's
// 256 threads copy every tile by cp.async between block-wide barriers, which held its tensor
// pipe about half busy (Nsight Compute, Llama-3.1-8B's 2048-row prefill on an H100).
//
// fp8 and fp4 weights are made bf16 first, whole, into the program's workspace (the tables'
// `scratch` tensors) by the launch before (weights_bf16.cu), exactly as gemm_wgmma.cu
// makes each tile bf16 in shared memory (weight8_planes), and copied from there as bf16 weights
// are: the same operands in the same wgmmas. In gemm_wgmma.cu every consumer thread converts its
// share of each tile between its wgmmas, which held those launches at 1.4-1.7x the bf16 one's
// time at 2048 rows (H100); here a quantized matmul costs the bf16 one plus a pass over its
// weights at the memory's rate.
//
// Order (declared in KERNELS.toml, "wgmma"): gemm_wgmma.cu's: k in blocks of K_BLOCK, a block's
// partial from zero in k order, the partials combined sequentially in f32; fp8's row scale and
// nvfp4's global scale multiply the finished sum.
// Defines: ACT_BF16, WEIGHT_* (not f32), K_BLOCK; TMA_STAGES (5: 160 KiB of stages).
#include "gemm_wgmma.cu"
#include "tma.cuh"

#if defined(WEIGHT_F32)
#error "gemm_tma.cu takes bf16, fp8 and fp4 weights (KERNELS.toml's `when`)"
#endif
#ifndef TMA_STAGES
#define TMA_STAGES 5
#endif
constexpr int TMA_STAGE_BYTES = Block<2>::stage_bytes;  // 128 activation rows, 128 weight rows
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;  // 128 x 40 + 256 x 232 <= 65536

// The boxes a tile's weight rows are copied from: one of 128 rows, or (gate_up_swiglu) two of 64.
struct WeightBoxes {
    const TensorMap* map[2];
    int row[2];
    int boxes;
};

// The launch these entries serve: 384 threads, rows past 64, k whole 16-byte rows (a tensor
// map's stride). Anything else traps (loud). The grid may be any size: its blocks take the
// tiles in turn (tma_tiles).
__device__ __forceinline__ void check_tma_launch(int rows, int k) {
    constexpr unsigned SHARED = TMA_STAGES * TMA_STAGE_BYTES + 1024 + 2 * TMA_STAGES * 8;
    if (blockDim.x != 384 || rows <= 64 || (k & 7) || gridDim.z != 1 ||
        dynamic_smem_bytes() < SHARED)
        __trap();
}

// The k-tiles of k-block b, [first, last), of a tile's `ktiles`.
struct KBlock {
    int first, last;
    __device__ KBlock(int b, int ktiles)
        : first(b * (K_BLOCK / BK)), last(min(ktiles, (b + 1) * (K_BLOCK / BK))) {}
};

// The sums of tiles t = block, block + blocks, ... of `tiles` (block: the block's index in the
// grid, blocks: the grid's size), each in turn: `at(t, m0)` gives tile t's weight boxes and sets
// its first activation row m0; the tile's sums (activation rows m0 + [0, 128) of xm, all of k)
// go, in the fragment layout of Place, to finish(t, m0, sum) in the consumer threads. At the
// table's grid (a block a tile) each block takes one tile; on a smaller grid the producer copies
// the next tile's stages while the consumers finish the last one. The stages and their
// barriers' phases run on across the tiles (`it` counts every k-tile a block takes).
//
// A k-block's partial is summed into its own accumulator set (two sets, by k-block parity), so
// the next k-block's wgmmas issue as soon as its stage lands: the consumer adds a partial into
// the sum once the next k-block's first wgmmas are in flight (and the tile's last at its end),
// never waiting for the tensor pipe to drain in the middle of a tile.
template <class At, class Finish>
__device__ __forceinline__ void tma_tiles(const TensorMap& xm, int tiles, int k, At at,
                                          Finish finish) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const uint32_t raw_at = smem_addr(smem_raw), base_at = (raw_at + 1023) & ~1023u;
    unsigned char* base = smem_raw + (base_at - raw_at);
    uint64_t* full = (uint64_t*)(base + TMA_STAGES * TMA_STAGE_BYTES);
    uint64_t* empty = full + TMA_STAGES;
    if (threadIdx.x == 0) {
        for (int s = 0; s < TMA_STAGES; ++s) {
            bar_init(&full[s], 1);   // the producer's arrival, with the stage's bytes
            bar_init(&empty[s], 8);  // every consumer warp, its wgmmas on the stage done
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int ktiles = (k + BK - 1) / BK, nkb = (k + K_BLOCK - 1) / K_BLOCK;
    const int block = blockIdx.x + gridDim.x * blockIdx.y, blocks = gridDim.x * gridDim.y;
    if (threadIdx.x >= 256) {  // the producer warpgroup: its registers to the consumers
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
        if (threadIdx.x == 256) {
            int it = 0;
            for (int t = block; t < tiles; t += blocks) {
                int m0;
                const WeightBoxes wb = at(t, m0);
                const int box_rows = 128 / wb.boxes;
                for (int kt = 0; kt < ktiles; ++kt, ++it) {
                    const int s = it % TMA_STAGES;
                    if (it >= TMA_STAGES) bar_wait(&empty[s], (it / TMA_STAGES - 1) & 1);
                    unsigned char* stage = base + s * TMA_STAGE_BYTES;
                    bar_expect(&full[s], TMA_STAGE_BYTES);
                    tma_load(stage, xm, kt * BK, m0, &full[s]);
                    for (int b = 0; b < wb.boxes; ++b)
                        tma_load(stage + Block<2>::act_bytes + b * box_rows * 128, *wb.map[b],
                                 kt * BK, wb.row[b], &full[s]);
                }
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));
    const Place pl;
    const bool lead = (threadIdx.x & 31) == 0;
    int it = 0;
    for (int t = block; t < tiles; t += blocks) {
        int m0;
        at(t, m0);
        float sum[64], acc0[64], acc1[64];
        // -0 + a is a for every a (+0 and -0 included), so the first k-block's partial lands as is
#pragma unroll
        for (int i = 0; i < 64; ++i) sum[i] = -0.0f;
        // k-block b's wgmmas into acc, from zero; once its first k-tile's are issued (the
        // previous k-tile's done), the previous k-block's partial `prev` into the sum
        auto k_block = [&](int b, float (&acc)[64], const float (&prev)[64]) {
            const KBlock kb(b, ktiles);
            for (int kt = kb.first; kt < kb.last; ++kt, ++it) {
                const int s = it % TMA_STAGES;
                bar_wait(&full[s], (it / TMA_STAGES) & 1);
                const uint32_t stage_at = base_at + s * TMA_STAGE_BYTES;
                const uint64_t a_desc = operand_desc(stage_at + pl.wg * 64 * 128),
                               b_desc = operand_desc(stage_at + Block<2>::act_bytes);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BK / 16; ++kk)
                    wgmma_m64n128k16(acc, a_desc + desc_step(32 * kk),
                                     b_desc + desc_step(32 * kk), !(kt == kb.first && kk == 0));
                wgmma_commit();
                wgmma_wait<1>();  // the previous k-tile's wgmmas done: its stage is free
                if (lead && kt > 0) bar_arrive(&empty[(it - 1) % TMA_STAGES]);
                if (kt == kb.first && b > 0) {
#pragma unroll
                    for (int i = 0; i < 64; ++i) sum[i] += prev[i];
                }
            }
        };
        // the tile's last k-tile done, and with it the last k-block's partial `last`
        auto close = [&](const float (&last)[64]) {
            wgmma_wait<0>();
            if (lead) bar_arrive(&empty[(it - 1) % TMA_STAGES]);
#pragma unroll
            for (int i = 0; i < 64; ++i) sum[i] += last[i];
        };
        for (int b = 0;; b += 2) {
            k_block(b, acc0, acc1);
            if (b + 1 == nkb) {
                close(acc0);
                break;
            }
            k_block(b + 1, acc1, acc0);
            if (b + 2 == nkb) {
                close(acc1);
                break;
            }
        }
        finish(t, m0, sum);
    }
}

// The tiles of a launch of `rows` rows: 128 rows by a column tile, rows fastest (the blocks
// side by side share a weight tile).
struct Tiles {
    int row_tiles, count;
    __device__ Tiles(int rows, int col_tiles)
        : row_tiles((rows + 127) / 128), count(row_tiles * col_tiles) {}
    __device__ int m0(int t) const { return t % row_tiles * 128; }
    __device__ int col(int t) const { return t / row_tiles; }
};

// The plain tiles' outputs (linear, lm_head, linear_add, qkv): tile t's column tile, first
// column and weight map from pick(col_tile, n0, map), then out(col_tile, row, col, sum).
template <class Pick, class Out>
__device__ __forceinline__ void tma_plain(const TensorMap& xm, int rows, int k, int col_tiles,
                                          Pick pick, Out out) {
    grid_dependency_sync();
    check_tma_launch(rows, k);
    const Tiles tl(rows, col_tiles);
    tma_tiles(xm, tl.count, k,
              [&](int t, int& m0) {
                  m0 = tl.m0(t);
                  int n0;
                  const TensorMap* map;
                  pick(tl.col(t), n0, map);
                  return WeightBoxes{{map, map}, {n0, n0}, 1};
              },
              [&](int t, int m0, const float (&sum)[64]) {
                  const Place pl;
                  int n0;
                  const TensorMap* map;
                  pick(tl.col(t), n0, map);
#pragma unroll
                  for (int i = 0; i < 64; ++i)
                      out(tl.col(t), m0 + pl.row(i), n0 + pl.col(i), sum[i]);
              });
}

// What an epilogue reads of a weight: its row factor (fp8's row scale, nvfp4's global scale; 1
// for bf16 and mxfp4, whose scale and global are null), not its data, which came by tensor map.
__device__ __forceinline__ WeightRef factors(const void* scale, const float* global) {
    return weight_ref(nullptr, scale, global);
}

// block 384; grid (ceil(rows / 128), ceil(n / 128), 1), or fewer blocks (tma_tiles).
// y = x · wᵀ.
extern "C" __global__ void __launch_bounds__(384, 1)
metrale_linear_tma(const __grid_constant__ TensorMap x, const __grid_constant__ TensorMap w,
                   const void* __restrict__ w_scale, const float* __restrict__ w_global,
                   out_t* __restrict__ y, int rows, int k, int n) {
    const WeightRef wf = factors(w_scale, w_global);
    tma_plain(x, rows, k, (n + BN - 1) / BN,
              [&](int c, int& n0, const TensorMap*& map) { n0 = c * BN, map = &w; },
              [&](int, int row, int col, float s) {
        plain_out(s, row, col, rows, n, wf, [&](long i, float d) { y[i] = out_store(d); });
    });
}

// y = round(round(x · wᵀ) + r), as linear then add.
extern "C" __global__ void __launch_bounds__(384, 1)
metrale_linear_add_tma(const __grid_constant__ TensorMap x, const __grid_constant__ TensorMap w,
                       const void* __restrict__ w_scale, const float* __restrict__ w_global,
                       const act_t* __restrict__ r, act_t* __restrict__ y, int rows, int k,
                       int n) {
    const WeightRef wf = factors(w_scale, w_global);
    tma_plain(x, rows, k, (n + BN - 1) / BN,
              [&](int c, int& n0, const TensorMap*& map) { n0 = c * BN, map = &w; },
              [&](int, int row, int col, float s) {
        plain_out(s, row, col, rows, n, wf, [&](long i, float d) {
            y[i] = act_store(act_round(d) + act_load(r[i]));
        });
    });
}

// q, k_, v in one launch: column tiles count q's, then k_'s, then v's (QkvTiles).
extern "C" __global__ void __launch_bounds__(384, 1)
metrale_qkv_tma(const __grid_constant__ TensorMap x, const __grid_constant__ TensorMap wq,
                const __grid_constant__ TensorMap wk, const __grid_constant__ TensorMap wv,
                const void* __restrict__ wq_scale, const float* __restrict__ wq_global,
                const void* __restrict__ wk_scale, const float* __restrict__ wk_global,
                const void* __restrict__ wv_scale, const float* __restrict__ wv_global,
                act_t* __restrict__ q, act_t* __restrict__ k_, act_t* __restrict__ v, int rows,
                int k, int nq, int nk, int nv) {
    const QkvTiles qt{factors(wq_scale, wq_global), factors(wk_scale, wk_global),
                      factors(wv_scale, wv_global), q, k_, v, nq, nk, nv};
    const int tq = (nq + BN - 1) / BN, tk = (nk + BN - 1) / BN, tv = (nv + BN - 1) / BN;
    tma_plain(x, rows, k, tq + tk + tv,
              [&](int c, int& n0, const TensorMap*& map) {
                  act_t* out;
                  n0 = qt.at(c, out).n0;
                  map = c < tq ? &wq : c < tq + tk ? &wk : &wv;
              },
              [&](int c, int row, int col, float s) {
        act_t* out;
        const PlainTile pt = qt.at(c, out);
        plain_out(s, row, col, rows, pt.n, pt.w, [&](long i, float d) { out[i] = act_store(d); });
    });
}

// h = silu(round(x · wgᵀ)) * round(x · wuᵀ) for BN / 2 columns a tile: weight tile rows
// [0, 64) are the gate rows of columns n0 + [0, 64), rows [64, 128) the up rows of the same
// columns, so a thread's fragment registers i and i + 32 hold the two dots of one output.
// block 384; grid (ceil(rows / 128), ceil(n / 64), 1), or fewer blocks (tma_tiles).
extern "C" __global__ void __launch_bounds__(384, 1)
metrale_gate_up_swiglu_tma(const __grid_constant__ TensorMap x,
                           const __grid_constant__ TensorMap wg,
                           const __grid_constant__ TensorMap wu,
                           const void* __restrict__ wg_scale, const float* __restrict__ wg_global,
                           const void* __restrict__ wu_scale, const float* __restrict__ wu_global,
                           act_t* __restrict__ h, int rows, int k, int n) {
    const WeightRef gf = factors(wg_scale, wg_global), uf = factors(wu_scale, wu_global);
    grid_dependency_sync();
    check_tma_launch(rows, k);
    const Tiles tl(rows, (n + BN / 2 - 1) / (BN / 2));
    tma_tiles(x, tl.count, k,
              [&](int t, int& m0) {
                  m0 = tl.m0(t);
                  const int n0 = tl.col(t) * (BN / 2);
                  return WeightBoxes{{&wg, &wu}, {n0, n0}, 2};
              },
              [&](int t, int m0, const float (&sum)[64]) {
                  const Place pl;
                  const int n0 = tl.col(t) * (BN / 2);
#pragma unroll
                  for (int i = 0; i < 32; ++i)
                      gate_up_out(sum[i], sum[i + 32], m0 + pl.row(i), n0 + pl.col(i), rows, n,
                                  gf, uf, h);
              });
}

#if !defined(WEIGHT_BF16)
#include "weights_bf16.cu"  // the quantized weights made bf16 first
#endif

// Metrale CUDA: prefill attention on tensor cores (attention, kv_append_attention at their
// prefill points with bf16 activations; mma.sync, sm_80 and newer). The blocks, rows and tiles
// are attention_prefill.cuh's; grid z cuts head_dim into slices of 128 output columns (one slice
// up to head_dim 128), every slice computing the same scores.
//
// Order (declared in KERNELS.toml), the reference's split-KV: a row's positions are cut at
// absolute multiples of KV_BLOCK, and for each block with positions of the row
//   pass 1: s_j = (q · k_j) * scale by MMAs over head_dim (tensor-core order), m_b = max s_j;
//   pass 2: the same s_j again, e_j = exp(s_j - m_b), l_b = sum e_j (lane partials, then the four
//           lanes of the row), acc_b = sum e_j v_j by MMAs, e_j entering them as three bf16
//           parts whose sum is e_j exactly (8 + 8 + 8 significant bits), so the products are
//           exact and only the order of the sum is the hardware's;
// then the blocks merge left to right by the log-sum-exp rule, o = acc / l rounded to act.
// A tile that every row of a warp attends to in full skips the per-position masks. The bounded
// policy's online softmax (attention_online.cu) computes each score once and weighs the values
// with exp's weights in bf16. Defines: ACT_BF16, KV_BLOCK.
#include "attention_prefill.cuh"

#ifndef KV_BLOCK
#error "define KV_BLOCK"
#endif
static_assert(KV_BLOCK % TILE_POS == 0, "KV_BLOCK must be a multiple of the 64-position tile");

__device__ __forceinline__ void attend_tile(const act_t* q, const act_t* k_cache,
                                            const act_t* v_cache, const int* positions,
                                            const int* slots, const act_t* k_new,
                                            const act_t* v_new, act_t* o, int rows, int hq,
                                            int hkv, int d, int max_ctx, float scale,
                                            int window) {
    const PrefillSmem s(d);
    const int G = hq / hkv;
    const int kvh = blockIdx.x, row0 = block_row0(G), col0 = blockIdx.z * SLICE;
    const int ncols = min(SLICE, d - col0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int head = kvh * G + warp % G, wrow0 = row0 + TILE_ROWS * (warp / G);
    // the head again at the end from shared memory: held in a register across the kernel, it
    // spilled (ptxas, sm_90a)
    __shared__ int heads[MAX_WARPS];
    if (lane == 0) heads[warp] = head;
    __syncwarp();
    const RowInfo rw[2] = {row_info(wrow0 + g, rows, positions, slots, window),
                           row_info(wrow0 + g + 8, rows, positions, slots, window)};
    // the lane's two q rows (clamped to the launch's last): the first, and the second's offset
    const int r0 = min(wrow0 + g, rows - 1), q8 = (min(wrow0 + g + 8, rows - 1) - r0) * hq * d;
    const act_t* qrow = q + ((long)r0 * hq + head) * d;

    // the running state of the lane's two rows and its columns 8 ni + 2 t + {0, 1} of the slice
    float m[2] = {0.0f, 0.0f}, l[2] = {0.0f, 0.0f}, acc[16][4];
#pragma unroll
    for (int ni = 0; ni < 16; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[ni][e] = 0.0f;

    // the block's rows, slot after slot
    for_each_slot(positions, slots, rows, window, G, k_new, [&](int slot, int lo, int hi,
                                                              AppendRun run) {
        for (int b0 = lo / KV_BLOCK * KV_BLOCK; b0 <= hi; b0 += KV_BLOCK) {
            const int t0 = max(b0, lo / TILE_POS * TILE_POS), t1 = min(b0 + KV_BLOCK, hi + 1);
            const Span sp[2] = {Span(rw[0], slot, b0, KV_BLOCK),
                                Span(rw[1], slot, b0, KV_BLOCK)};
            // pass 1: the block's max score of each row
            float mb[2] = {-INFINITY, -INFINITY};
            auto keys_of = [&](const KvTile& tile, int st) {
                issue_kv_tile(tile, k_cache, v_cache, k_new, v_new, positions, slots, rows, slot,
                              run, st, lo, hi, kvh, hkv, d, max_ctx, col0, ncols, false);
            };
            over_tiles(s, t0, t1, keys_of, [&](const KvTile& tile, int st) {
                float sc[8][4];
                tile_scores(tile.k, qrow, qrow + q8, d, scale, sc);
                if (whole_tile(sp, st)) {
#pragma unroll
                    for (int ni = 0; ni < 8; ++ni)
#pragma unroll
                        for (int e = 0; e < 4; ++e) mb[e / 2] = fmaxf(mb[e / 2], sc[ni][e]);
                } else {
#pragma unroll
                    for (int ni = 0; ni < 8; ++ni)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int h = e / 2, pos = st + 8 * ni + 2 * t + e % 2;
                            if (sp[h].has(pos)) mb[h] = fmaxf(mb[h], sc[ni][e]);
                        }
                }
            });
            mb[0] = quad_max(mb[0]);
            mb[1] = quad_max(mb[1]);
            // pass 2: exponentials, their sum and the values they weigh
            float lb[2] = {0.0f, 0.0f}, ab[16][4];
#pragma unroll
            for (int ni = 0; ni < 16; ++ni)
#pragma unroll
                for (int e = 0; e < 4; ++e) ab[ni][e] = 0.0f;
            auto keys_values_of = [&](const KvTile& tile, int st) {
                issue_kv_tile(tile, k_cache, v_cache, k_new, v_new, positions, slots, rows, slot,
                              run, st, lo, hi, kvh, hkv, d, max_ctx, col0, ncols, true);
            };
            over_tiles(s, t0, t1, keys_values_of, [&](const KvTile& tile, int st) {
                float sc[8][4];
                tile_scores(tile.k, qrow, qrow + q8, d, scale, sc);
                const bool whole = whole_tile(sp, st);
#pragma unroll
                for (int ni = 0; ni < 8; ++ni)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int h = e / 2, pos = st + 8 * ni + 2 * t + e % 2;
                        // exp of every score, then the mask: no branch per position (a masked
                        // score's exp, whatever it is, is dropped)
                        const float ex = expf(sc[ni][e] - mb[h]);
                        const float x = whole || sp[h].has(pos) ? ex : 0.0f;
                        sc[ni][e] = x;
                        lb[h] += x;
                    }
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) {  // positions 16 kk .. 16 kk + 15
                    uint32_t a[3][4];  // e's parts as the A operand: n8 tiles 2 kk, 2 kk + 1
                    split3(sc[2 * kk][0], sc[2 * kk][1], a[0][0], a[1][0], a[2][0]);
                    split3(sc[2 * kk][2], sc[2 * kk][3], a[0][1], a[1][1], a[2][1]);
                    split3(sc[2 * kk + 1][0], sc[2 * kk + 1][1], a[0][2], a[1][2], a[2][2]);
                    split3(sc[2 * kk + 1][2], sc[2 * kk + 1][3], a[0][3], a[1][3], a[2][3]);
#pragma unroll
                    for (int nj = 0; nj < SLICE / 16; ++nj) {  // columns 16 nj .. 16 nj + 15
                        if (16 * nj >= ncols) break;
                        uint32_t b[4];
                        const int pos = 16 * kk + (lane & 7) + ((lane >> 3) & 1) * 8;
                        ldmatrix_x4_trans(b, tile.v + pos * VPITCH + 16 * nj + (lane >> 4) * 8);
#pragma unroll
                        for (int part = 0; part < 3; ++part) {
                            mma_bf16(ab[2 * nj], a[part], b[0], b[1]);
                            mma_bf16(ab[2 * nj + 1], a[part], b[2], b[3]);
                        }
                    }
                }
            });
            // the block merges into the running state, left to right, for the rows it has
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float lsum = quad_sum(lb[h]);
                if (mb[h] == -INFINITY) continue;  // no position of this row in the block
                const BlockMerge f = merge_block(mb[h], lsum, m[h], l[h]);
#pragma unroll
                for (int ni = 0; ni < 16; ++ni)
#pragma unroll
                    for (int e = 2 * h; e < 2 * h + 2; ++e)
                        acc[ni][e] = f.first ? ab[ni][e] : acc[ni][e] * f.ar + ab[ni][e] * f.bw;
            }
        }
    });
    store_rows(acc, l, rw, o, wrow0, hq, ((volatile int*)heads)[warp], d, col0);
}

// grid (hkv, ceil(rows / 16 RT), ceil(d / 128)), block 32 G RT (G = hq / hkv; the table's RT is
// max(1, 4 // G)).
extern "C" __global__ void __launch_bounds__(MAX_WARPS * 32)
metrale_attention_prefill(const act_t* __restrict__ q, const act_t* __restrict__ k_cache,
                          const act_t* __restrict__ v_cache, const int* __restrict__ positions,
                          const int* __restrict__ slots, act_t* __restrict__ o, int rows, int hq,
                          int hkv, int d, int max_ctx, float scale, int window) {
    grid_dependency_sync();
    // a launch the kernel cannot serve: loud
    if (!prefill_launch_ok(rows, d, hq, hkv, MAX_HEAD_DIM)) __trap();
    attend_tile(q, k_cache, v_cache, positions, slots, nullptr, nullptr, o, rows, hq, hkv, d,
                max_ctx, scale, window);
}

// kv_append then attention: slice 0's blocks write their rows' k, v of their kv head into the
// cache; every block reads the positions the launch appends from k, v (issue_kv_tile).
extern "C" __global__ void __launch_bounds__(MAX_WARPS * 32)
metrale_kv_append_attention_prefill(const act_t* __restrict__ k, const act_t* __restrict__ v,
                                    const act_t* __restrict__ q, act_t* k_cache, act_t* v_cache,
                                    const int* __restrict__ positions,
                                    const int* __restrict__ slots, act_t* __restrict__ o,
                                    int rows, int hq, int hkv, int d, int max_ctx, float scale,
                                    int window) {
    grid_dependency_sync();
    if (!prefill_launch_ok(rows, d, hq, hkv, MAX_HEAD_DIM)) __trap();
    if (blockIdx.z == 0)
        append_rows(k, v, k_cache, v_cache, positions, slots, rows, hq, hkv, d, max_ctx);
    attend_tile(q, k_cache, v_cache, positions, slots, k, v, o, rows, hq, hkv, d, max_ctx, scale,
                window);
}

// Metrale CUDA: prefill attention with an online softmax (kv_append_attention_online, the
// bounded policy's prefill attention; bf16 activations, head_dim up to 128, mma.sync).
//
// The blocks, rows and tiles are attention_prefill.cuh's; one slice of columns holds the whole
// head. Each warp keeps its q head's 16 rows as MMA fragments in registers for the launch, and
// its rows' running state: the max m (of the scores in log2 units), the lane's part of the sum l
// and the output acc, 16 x head_dim in the MMA's accumulator layout.
//
// Order (declared in KERNELS.toml; the family's semantics, lkb/semantics_attention.py): a row's
// positions cut at absolute multiples of KV_BLOCK (= the 64-position tile), the blocks left to
// right, each once:
//   s_j = (q · k_j) * scale * log2(e) by MMAs over head_dim (tensor-core order);
//   m' = max(m, max_j s_j), a = 2^(m - m');
//   p_j = 2^(s_j - m') rounded to bf16, l = l a + sum p_j (the lane's positions, in order),
//   acc = acc a + sum p_j v_j by MMAs on the rounded p_j;
// then o = acc / l (the four lanes of a row summed), rounded to act; 2^x is the multi-function
// unit's, flushed to zero below 2^-126 (online_block, attention_prefill.cuh). Against the declared
// two-pass order (attention_prefill.cu) this computes each score once and runs a third of the
// p·v MMAs, so the relation online_prefill_attention is bounded: exp's weights lose their bits
// past bf16's eight.
// A tile none of a warp's rows attends to is skipped by that warp: it would leave every row's
// state as it was (a = 1, p = 0), so the bytes do not depend on the block's other rows.
// Defines: ACT_BF16, KV_BLOCK (64).
#include "attention_prefill.cuh"

#ifndef KV_BLOCK
#error "define KV_BLOCK"
#endif
static_assert(KV_BLOCK == TILE_POS, "the online softmax's blocks are the 64-position tiles");
#define ONLINE_HEAD_DIM 128  // one slice: the warp's q fragments and output in registers

// s[4 ni + e] = q · k for the warp's 16 rows and the tile's 64 positions (n8 tile ni, the
// MMA's accumulator layout: row g + 8 (e / 2), position 8 ni + 2 t + e % 2), q's fragments held
// by the warp (qa[kk]: head_dim columns 16 kk .. 16 kk + 15), keys from shared memory.
__device__ __forceinline__ void tile_dots(const bf16* keys, const uint32_t (&qa)[8][4], int d,
                                          float (&sc)[32]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < 32; ++i) sc[i] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < ONLINE_HEAD_DIM / 16; ++kk) {
        if (16 * kk >= d) break;
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // positions 16 j .. 16 j + 15: two n8 tiles
            uint32_t b[4];
            ldmatrix_x4(b, keys + (16 * j + (lane & 7) + ((lane >> 4) << 3)) * KPITCH(d) +
                               16 * kk + ((lane >> 3) & 1) * 8);
            mma_bf16(*reinterpret_cast<float(*)[4]>(sc + 8 * j), qa[kk], b[0], b[1]);
            mma_bf16(*reinterpret_cast<float(*)[4]>(sc + 8 * j + 4), qa[kk], b[2], b[3]);
        }
    }
}

__device__ __forceinline__ void attend_online(const act_t* q, const act_t* k_cache,
                                              const act_t* v_cache, const int* positions,
                                              const int* slots, const act_t* k_new,
                                              const act_t* v_new, act_t* o, int rows, int hq,
                                              int hkv, int d, int max_ctx, float scale,
                                              int window) {
    const PrefillSmem s(d);
    const int G = hq / hkv, kvh = blockIdx.x, row0 = block_row0(G);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int head = kvh * G + warp % G, wrow0 = row0 + TILE_ROWS * (warp / G);
    const RowInfo rw[2] = {row_info(wrow0 + g, rows, positions, slots, window),
                           row_info(wrow0 + g + 8, rows, positions, slots, window)};
    const float c = scale * 1.4426950408889634f;  // scores in log2 units: exp(x) = 2^(x log2 e)

    // q's A fragments: the lane's two rows (clamped to the launch's last), columns 2 t, 2 t + 8
    uint32_t qa[ONLINE_HEAD_DIM / 16][4];
    {
        const act_t* q0 = q + ((long)min(wrow0 + g, rows - 1) * hq + head) * d;
        const act_t* q8 = q + ((long)min(wrow0 + g + 8, rows - 1) * hq + head) * d;
#pragma unroll
        for (int kk = 0; kk < ONLINE_HEAD_DIM / 16; ++kk) {
            if (16 * kk >= d) break;
            qa[kk][0] = *(const uint32_t*)(q0 + 16 * kk + 2 * t);
            qa[kk][1] = *(const uint32_t*)(q8 + 16 * kk + 2 * t);
            qa[kk][2] = *(const uint32_t*)(q0 + 16 * kk + 8 + 2 * t);
            qa[kk][3] = *(const uint32_t*)(q8 + 16 * kk + 8 + 2 * t);
        }
    }
    // the running state of the lane's two rows and its columns 8 ni + 2 t + {0, 1}
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, acc[ONLINE_HEAD_DIM / 8][4];
#pragma unroll
    for (int ni = 0; ni < ONLINE_HEAD_DIM / 8; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[ni][e] = 0.0f;

    for_each_slot(positions, slots, rows, window, G, k_new, [&](int slot, int lo, int hi,
                                                              AppendRun run) {
        const Span sp[2] = {Span(rw[0], slot, 0, max_ctx), Span(rw[1], slot, 0, max_ctx)};
        auto keys_values_of = [&](const KvTile& tile, int st) {
            issue_kv_tile(tile, k_cache, v_cache, k_new, v_new, positions, slots, rows, slot, run,
                          st, lo, hi, kvh, hkv, d, max_ctx, 0, d, true);
        };
        over_tiles(s, lo / TILE_POS * TILE_POS, hi + 1, keys_values_of,
                   [&](const KvTile& tile, int st) {
            // a tile none of the warp's rows attends to leaves their state as it is
            if (__all_sync(0xffffffffu, !(sp[0].from <= st + TILE_POS - 1 && sp[0].to >= st) &&
                                            !(sp[1].from <= st + TILE_POS - 1 && sp[1].to >= st)))
                return;
            float sc[32], a[2];
            uint32_t pa[4][4];  // the weights as A fragments: positions 16 kk .. 16 kk + 15
            tile_dots(tile.k, qa, d, sc);
            online_block(sc, sp, st, c, m, l, a, pa);
            if (!online_keeps(a)) {
#pragma unroll
                for (int ni = 0; ni < ONLINE_HEAD_DIM / 8; ++ni)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[ni][e] *= a[e / 2];
            }
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {  // positions 16 kk .. 16 kk + 15
#pragma unroll
                for (int nj = 0; nj < ONLINE_HEAD_DIM / 16; ++nj) {  // columns 16 nj ..
                    if (16 * nj >= d) break;
                    uint32_t b[4];
                    const int pos = 16 * kk + (lane & 7) + ((lane >> 3) & 1) * 8;
                    ldmatrix_x4_trans(b, tile.v + pos * VPITCH + 16 * nj + (lane >> 4) * 8);
                    mma_bf16(acc[2 * nj], pa[kk], b[0], b[1]);
                    mma_bf16(acc[2 * nj + 1], pa[kk], b[2], b[3]);
                }
            }
        });
    });
    online_store(acc, l, rw, o, wrow0, hq, head, d);
}

// grid (hkv, ceil(rows / 16 RT), 1), block 32 G RT (G = hq / hkv; the table's RT is
// min(4, max(1, 8 // G))): kv_append then attention, as attention_prefill.cu's entry.
extern "C" __global__ void __launch_bounds__(MAX_WARPS * 32)
metrale_kv_append_attention_online_prefill(
    const act_t* __restrict__ k, const act_t* __restrict__ v, const act_t* __restrict__ q,
    act_t* k_cache, act_t* v_cache, const int* __restrict__ positions,
    const int* __restrict__ slots, act_t* __restrict__ o, int rows, int hq, int hkv, int d,
    int max_ctx, float scale, int window) {
    grid_dependency_sync();
    // a launch the kernel cannot serve: loud
    if (!prefill_launch_ok(rows, d, hq, hkv, ONLINE_HEAD_DIM) || gridDim.z != 1) __trap();
    append_rows(k, v, k_cache, v_cache, positions, slots, rows, hq, hkv, d, max_ctx);
    attend_online(q, k_cache, v_cache, positions, slots, k, v, o, rows, hq, hkv, d, max_ctx,
                  scale, window);
}

// Metrale CUDA, experiment: a decode layer's attention half (add_rmsnorm, qkv, qk_norm + rope +
// kv_append + attention, the merge of its chunks, o_proj) as one launch of resident blocks whose
// weights the Tensor Memory Accelerator stages: five launches of the exact plan in one, the
// companion of mlp_tma.cu (which makes the MLP half one), so that a layer is two launches.
//
// A block b of G (one per multiprocessor, all resident: gridDim.x must not exceed them), batch 1:
//   1. before the dependent-launch wait: thread 0 copies the block's share of the qkv weight rows
//      (the q, k and v columns as one list of (hq + 2 hkv) d, a share in up to three pieces;
//      barrier 0) and of o_proj's rows (barrier 1) into shared memory, and the block asks L2 for
//      the cache rows its attention items will read (prefetch.global.L2): those rows are the
//      earlier steps', which no launch of this step writes (the dependent-launch check's rule);
//   2. after it, every block normalizes the row itself (row_norm, norm.cu's code); block 0 stores
//      s = x + r;
//   3. barrier 0; warp w takes the block's qkv columns w, w + 8, ...: warp_dots over the staged
//      rows (gemv.cu's code: the qkv launch's bytes) into q, k, v; then the grid meets;
//   4. the attention launch's blocks, (kv head part, chunk of 64 positions), dealt round the
//      grid: attention_decode.cu's own decode_attend, run with those block coordinates (its
//      blockIdx and gridDim are this file's, below), so its records and the appended cache rows
//      are that launch's bytes; the grid meets;
//   5. the merge launch's blocks (one per q head), dealt the same way: merge_chunks, the merge
//      entry's code; the grid meets;
//   6. the attention output into shared memory; barrier 1; warp w takes the block's o_proj
//      columns w, w + 8, ...: warp_dots over the staged rows (the split linear's bytes).
// As attention starts (step 4), the block also asks L2 for its share of `next_bytes` at `next`
// (when given): the next launch's weights, so that its bulk copies, which cannot start before
// this launch's blocks leave their multiprocessors (neither fits beside the other), read L2.
// So every output (s, q, k, v, the cache rows, o and o_proj's) is the five launches' byte for
// byte, which check_attn_emulated.py and bench_layer_tma.py check.
//
// Shared memory: attention's region first (decode_attend carves it from the dynamic base; the
// merge reuses it), then the staged qkv and o_proj rows, the normalized row, this block's copy of
// s (blocks but 0), the attention output and the two transaction barriers. At Qwen3-0.6B's shapes
// and 132 blocks: 82 + 64 + 32 + 8 KiB.
// Defines: ACT_BF16, WEIGHT_BF16, K_BLOCK=256, ACROSS_SEQUENTIAL, H_BLOCK=256, KV_BLOCK=256,
// CHUNK=64, ROPE_NEOX | ROPE_INTERLEAVED; TMA_COPY_LATE (the bulk copies after the wait) and
// PHASE_TRACE (phase.cuh) for the experiment's variants.
#include "norm.cu"
#include "persistent.cuh"

// attention_decode.cu's code, with the block coordinates its launch would have: the block's own
// for one attention (or merge) item at a time.
__device__ __forceinline__ uint3& item_coords(int which) {
    __shared__ uint3 coords[2];  // blockIdx, gridDim
    return coords[which];
}
// Its phase marks are left out: the marks below are this kernel's.
#pragma push_macro("blockIdx")
#pragma push_macro("gridDim")
#undef blockIdx
#undef gridDim
#define blockIdx item_coords(0)
#define gridDim item_coords(1)
#define phase_mark(i) ((void)(i))
#include "attention_decode.cu"
#undef phase_mark
#pragma pop_macro("gridDim")
#pragma pop_macro("blockIdx")

// The bytes of attention's shared region for a group of Gq q heads per kv head: decode_attend's
// carving (DecodeSmem, for the heads a block takes), rounded to 128.
__device__ __forceinline__ int attention_region(char* base, int Gq, int d) {
    const int HS = max(1, Gq / 4), Gb = (Gq + HS - 1) / HS;
    int lt = 0;
    while ((2 << lt) * Gb * CHUNK <= NT) ++lt;
    return (DecodeSmem(base, Gb, d, 1 << lt).bytes + 127) & ~127;
}

extern "C" __global__ void __launch_bounds__(NT, 1)
metrale_attn_tma(const act_t* __restrict__ x, const act_t* __restrict__ r,
                 const __nv_bfloat16* __restrict__ wn, act_t* __restrict__ s,
                 const __nv_bfloat16* __restrict__ wq, const __nv_bfloat16* __restrict__ wk,
                 const __nv_bfloat16* __restrict__ wv, act_t* q, act_t* k, act_t* v,
                 const __nv_bfloat16* __restrict__ wqn, const __nv_bfloat16* __restrict__ wkn,
                 act_t* k_cache, act_t* v_cache, const int* __restrict__ positions,
                 const int* __restrict__ slots, const float* __restrict__ cos_t,
                 const float* __restrict__ sin_t, act_t* o, void* work,
                 const __nv_bfloat16* __restrict__ wo, act_t* __restrict__ out, unsigned* sync,
                 int hidden, int hq, int hkv, int d, int max_ctx, int max_pos, float eps,
                 float scale, int window, const unsigned char* next, long long next_bytes) {
    extern __shared__ __align__(128) unsigned char attn_smem[];
    const int b = blockIdx.x, G = gridDim.x;
    if (hkv <= 0 || hq % hkv) __trap();
    const int nq = hq * d, nk = hkv * d, n3 = nq + 2 * nk, ho = hq * d;
    const Share cols(n3, b, G), outs(hidden, b, G);
    const int maxq = (n3 + G - 1) / G, maxo = (hidden + G - 1) / G;
    const int region = attention_region((char*)attn_smem, hq / hkv, d);
    __nv_bfloat16* sq = (__nv_bfloat16*)(attn_smem + region);  // qkv rows
    __nv_bfloat16* so = sq + (long)maxq * hidden;                // o_proj rows
    act_t* y = (act_t*)(so + (long)maxo * ho);
    act_t* s_own = y + hidden;
    act_t* os = s_own + hidden;
    uint64_t* bars = (uint64_t*)(((uintptr_t)(os + ho) + 15) & ~(uintptr_t)15);
    const unsigned need = (unsigned)((unsigned char*)(bars + 2) - attn_smem);
    if (blockDim.x != NT || dynamic_smem_bytes() < need || !row_norm_fits(hidden) ||
        (hidden & 7) || (ho & 7))
        __trap();
    // the attention launch's grid: (hkv HS, 1, nch), HS as KERNELS.toml's; items dealt round
    const int HS = max(1, hq / hkv / 4), gx = hkv * HS, nch = (max_ctx + CHUNK - 1) / CHUNK;
    const int items = gx * nch;
    phase_mark(0);
    auto stage = [&] {
        if (threadIdx.x != 0) return;
        tx_init(&bars[0]);
        tx_init(&bars[1]);
        tx_expect(&bars[0], (unsigned)cols.count * hidden * 2);
        const __nv_bfloat16* parts[3] = {wq, wk, wv};
        const int starts[4] = {0, nq, nq + nk, n3};
        for (int p = 0; p < 3; ++p) {  // the share's piece in each of q, k, v
            const int lo = max(cols.first, starts[p]);
            const int hi = min(cols.first + cols.count, starts[p + 1]);
            if (lo < hi)
                bulk_copy(sq + (long)(lo - cols.first) * hidden,
                          parts[p] + (long)(lo - starts[p]) * hidden,
                          (unsigned)(hi - lo) * hidden * 2, &bars[0]);
        }
        tx_expect(&bars[1], (unsigned)outs.count * ho * 2);
        bulk_copy(so, wo + (long)outs.first * ho, (unsigned)outs.count * ho * 2, &bars[1]);
    };
    {  // the cache rows of this block's attention items, into L2 (128 bytes a request)
        const int pos = positions[0], slot = slots[0];
        const int start = window > 0 ? max(0, pos - window + 1) : 0;
        const int lines = d * (int)sizeof(act_t) / 128;
        for (int it = b; it < items; it += G) {
            const int kvh = (it % gx) / HS, c0 = it / gx * CHUNK;
            const int lo = max(c0, start), hi = min(c0 + CHUNK, pos);  // not the new row
            for (int i = threadIdx.x; i < (hi - lo) * lines * 2; i += NT) {
                const int p = lo + i / (2 * lines), line = i % lines;
                const act_t* cache = (i / lines) % 2 ? v_cache : k_cache;
                const act_t* at = cache + (((long)slot * max_ctx + p) * hkv + kvh) * d;
                asm volatile("prefetch.global.L2 [%0];" ::"l"((const char*)at + 128 * line));
            }
        }
    }
    stage_wait_norm(stage, x, r, wn, s, s_own, y, hidden, eps);
    tx_wait(&bars[0]);
    phase_mark(3);
    const __nv_bfloat16* qkv_rows[1] = {sq};
    staged_dots<1>(y, qkv_rows, hidden, cols.count, [&](int c, const float (&dot)[1]) {
        const int col = cols.first + c;
        act_t* dst = col < nq ? q + col : col < nq + nk ? k + (col - nq) : v + (col - nq - nk);
        *dst = act_store(dot[0]);
    });
    phase_mark(4);
    grid_meet(sync);
    phase_mark(5);
    l2_prefetch_share(next, next_bytes, b, G);  // the next launch's weights, while attention runs
    const RopeArgs ra{cos_t, sin_t, wqn, wkn, max_pos, eps};
    for (int it = b; it < items; it += G) {
        __syncthreads();  // the previous item's reads of the region are done
        if (threadIdx.x == 0) {
            item_coords(0) = make_uint3((unsigned)(it % gx), 0u, (unsigned)(it / gx));
            item_coords(1) = make_uint3((unsigned)gx, 1u, (unsigned)nch);
        }
        __syncthreads();
        decode_attend<true, PRE_NORM_ROPE>(k, v, q, k_cache, v_cache, positions, slots, o, work,
                                           1, hq, hkv, d, max_ctx, scale, window, ra);
    }
    phase_mark(6);
    grid_meet(sync);
    phase_mark(7);
    {  // the merge launch's blocks: one per q head (merge entry's code, in this block's region)
        float* st = (float*)attn_smem;
        const int st_bytes = MERGE_W * (d + 4) * 4;
        float* fx = st + MERGE_W * (d + 4);
        float* A = fx + 3 * MERGE_W;
        float* ml = A + d;
        if ((int)((unsigned char*)(ml + 4) - attn_smem) > region) __trap();
        const int pos = positions[0];
        const int start = window > 0 ? max(0, pos - window + 1) : 0;
        for (int h = b; h < hq; h += G) {
            __syncthreads();
            merge_chunks<NT>((const float*)work + (long)h * nch * (d + 4), nch, 1, d,
                             start / CHUNK, pos / CHUNK, st, st_bytes, fx, 3 * MERGE_W, A, ml,
                             o + (long)h * d);
        }
    }
    phase_mark(8);
    grid_meet(sync);
    phase_mark(9);
    shared_from_l2(os, o, ho);
    __syncthreads();
    tx_wait(&bars[1]);
    phase_mark(10);
    const __nv_bfloat16* o_rows[1] = {so};
    staged_dots<1>(os, o_rows, ho, outs.count, [&](int c, const float (&dot)[1]) {
        out[outs.first + c] = act_store(dot[0]);
    });
    __syncthreads();
    phase_mark(11);
}

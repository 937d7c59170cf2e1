// Metrale CUDA, experiment: decode attention and the merge of its chunk records in one launch,
// the blocks meeting at a grid barrier between them, where the plans make two launches.
//
// Why: timed inside a Llama-3.1-8B step, the merge launch costs 2.7 µs a layer (docs/gpu-notes.md,
// version 20), Qwen3-0.6B's attention pair is 31 % of its step, and the merge run by the last
// block of each kv head inside the decode launch lost (versions 10-13: one block merged a whole
// group after a ticket). Here every block of the decode grid waits at a grid barrier once its
// records are written, then the merge's (q head, row) items are dealt over all of them, so the
// merge runs as wide as its own launch did, without the launch.
//
// The decode phase is attention_decode.cu's decode_attend on the launch's own grid, and the merge
// phase its merge_chunks with the merge entry's arguments, so the records, the output and the
// appended cache rows are the two launches' bytes. The grid barrier needs every block resident at
// once: at one row the decode grid is hkv HS ceil(max_ctx / 64) blocks (Qwen3-0.6B and
// Llama-3.1-8B at 1024 positions: 128, two a multiprocessor), so this is a batch-1 kernel; at
// eight rows the grid could not all be resident and the barrier would wait (its trap ends it).
//
// The decode launch's wait releases the next launch (o_proj) as it starts; the plans' merge
// releases it only by ending, which version 21 measured better at Llama-3.1-8B's eight rows. By
// default this kernel does as the merge: decode_attend's wait is made one without the release
// (so o_proj starts as this launch's blocks exit); ATTN_MERGED_RELEASE_EARLY keeps the release.
// Defines: as qk_norm_rope_kv_append_attention_decode's (ACT_*, CHUNK=64, H_BLOCK, KV_BLOCK,
// ROPE_*), and ATTN_MERGED_RELEASE_EARLY.
#include "grid_barrier.cuh"

#if !defined(ATTN_MERGED_RELEASE_EARLY)
#define grid_dependency_sync() grid_dependency_wait()  // inside decode_attend (below)
#endif
#include "attention_decode.cu"
#undef grid_dependency_sync

// grid (hkv HS, rows, ceil(max_ctx / 64)), block 256, shared memory as the decode entry's;
// the decode entry's arguments, then the grid barrier's two words (zero before the first launch,
// left so).
extern "C" __global__ void __launch_bounds__(NT, 2)
metrale_qk_norm_rope_kv_append_attention_merged(
    const act_t* __restrict__ q, const act_t* __restrict__ k, const act_t* __restrict__ v,
    const __nv_bfloat16* __restrict__ wq, const __nv_bfloat16* __restrict__ wk,
    act_t* k_cache, act_t* v_cache, const int* __restrict__ positions,
    const int* __restrict__ slots, const float* __restrict__ cos_t,
    const float* __restrict__ sin_t, act_t* __restrict__ o, void* work, int rows, int hq,
    int hkv, int d, int max_ctx, int max_pos, float eps, float scale, int window,
    unsigned* sync) {
    decode_attend<true, PRE_NORM_ROPE>(k, v, q, k_cache, v_cache, positions, slots, o, work,
                                       rows, hq, hkv, d, max_ctx, scale, window,
                                       RopeArgs{cos_t, sin_t, wq, wk, max_pos, eps});
    grid_meet(sync);  // every block's records are written
    extern __shared__ __align__(16) char merged_smem[];
    const int st_bytes = MERGE_W * (d + 4) * 4, nch = (max_ctx + CHUNK - 1) / CHUNK;
    float* st = (float*)merged_smem;
    float* fx = st + MERGE_W * (d + 4);
    float* A = fx + 3 * MERGE_W;
    float* ml = A + d;
    if (dynamic_smem_bytes() < (unsigned)(st_bytes + (3 * MERGE_W + d + 4) * 4)) __trap();
    const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int G = gridDim.x * gridDim.y * gridDim.z;
    for (int item = b; item < hq * rows; item += G) {  // the merge launch's (q head, row) blocks
        const int h = item % hq, row = item / hq, pos = positions[row];
        const int start = window > 0 ? max(0, pos - window + 1) : 0;
        const long head = (long)row * hq + h;
        __syncthreads();  // the region's previous use is over
        merge_chunks<NT>((const float*)work + head * nch * (d + 4), nch, 1, d, start / CHUNK,
                         pos / CHUNK, st, st_bytes, fx, 3 * MERGE_W, A, ml, o + head * d);
    }
}

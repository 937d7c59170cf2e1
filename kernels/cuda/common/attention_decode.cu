// Metrale CUDA: decode attention, split across q heads and KV blocks.
//
// Decode rows are separate sequences (distinct cache slots). One thread block per (q head, row,
// KV block): block z owns the absolute positions [z KV_BLOCK, (z + 1) KV_BLOCK) of its row for
// one q head, and writes the block's partial state (max m, sum l, unnormalized p·v) to the
// launch's scratch. The last block of a (q head, row) to finish (a ticket counter in the scratch)
// merges the partials left to right with the log-sum-exp rule — the declared order, whichever
// block merges — and writes o. The q heads of a GQA group read the same k and v rows; their
// blocks are neighbours in the grid and run side by side, so HBM serves each row once and L2 the
// repeats. One q head per block rather than a whole group: a block's work is a chain of
// dependent steps (loads, block reductions, the ticket), and at batch 1 the grid has hkv x
// KV-blocks groups (32 at 1024 tokens, one block per multiprocessor): measured on the H200,
// a group of 2 took 12 µs and a group of 4 took 19 µs per call.
// Inside a block:
//   scores: thread t owns position b0 + t; q·k over head_dim left to right (fma, f32), the k
//           row's loads (and an L2 prefetch of the v row) issued before q is read;
//   softmax: block max and sum over the positions (block_max, block_sum);
//   p·v:    thread t owns the 8 columns 8 (t mod d/8) .. and the positions b0 + t / (d/8) + j S
//           (S = threads / (d/8)), its loads issued ahead; the S partials per column meet in
//           order through shared memory.
// Scratch (bytes from KERNELS.toml `values.work`): rows·hq u32 ticket counters, zero between
// launches (the merging block resets its own), then (m, l) and head_dim partials per
// (row, q head, KV block).
// Dependent launch: positions, slots and the cache rows before this step's position are read
// before the wait for the previous launch (grid_dependency_sync): the host writes the first two
// before the step and earlier steps the rows; everything this step's launches write, after it.
// Shapes outside head_dim <= 256 (a multiple of 8), q heads not a multiple of kv heads, or a
// position past max_ctx trap: a loud device fault, never a silently unwritten output.
// kv_append_attention additionally writes the row's new k, v into the cache at its position
// (the first q head of the group, in the block holding that position, does) and reads them from
// its inputs there (no other block reads that entry: slots are distinct).
// rope_kv_append_attention and qk_norm_rope_kv_append_attention first rotate (qk_norm_rope: also
// normalize) the block's q head and, in the block holding the row's position, the new k head,
// with rope.cu's and norm.cu's own functions (rotate_head, head_norm), so the bytes are those of
// the two launches they replace; the rotated k is what the block reads and appends.
// Defines: ACT_*, KV_BLOCK (256); for the rope entries ROPE_NEOX | ROPE_INTERLEAVED, and H_BLOCK
// for the normalizing one.
#include "metrale.cuh"
#if defined(ROPE_NEOX) || defined(ROPE_INTERLEAVED)
#include "rope.cuh"
#if defined(H_BLOCK)
#include "head_norm.cuh"
#endif
#endif

#define AW 8             // warps per block
#define NT (32 * AW)     // threads per block
#define VAHEAD 16        // v chunks one thread loads before using them
#define MAHEAD 8         // KV blocks whose partials the merge loads before combining them

static_assert(KV_BLOCK == NT, "one position per thread in the score phase");

// The scratch layout of one launch (nkv = KV blocks per row = gridDim.z).
struct DecodeScratch {
    unsigned* tickets;  // [rows, hq]
    float* ml;          // [rows, hq, nkv, 2]
    float* acc;         // [rows, hq, nkv, d]
    __device__ DecodeScratch(void* work, int rows, int hq, int nkv) {
        tickets = (unsigned*)work;
        const long counters = ((long)rows * hq * 4 + 255) / 256 * 256;  // bytes, 256-aligned
        ml = (float*)((char*)work + counters);
        acc = ml + (long)rows * hq * nkv * 2;
    }
};

// What happens to q and the new k before they are used: nothing, rope, or qk_norm then rope.
enum Prologue { PRE_NONE, PRE_ROPE, PRE_NORM_ROPE };

// The rope tables and the norm weights of the rope entries (unused by PRE_NONE).
struct RopeArgs {
    const float* cos_t;
    const float* sin_t;
    const __nv_bfloat16* wq;
    const __nv_bfloat16* wk;
    int max_pos;
    float eps;
};

// q's head (and k's new head, when k is given) normalized (PRE_NORM_ROPE: warp 0 takes q,
// warp 1 k, as norm.cu's one warp per head) or read, then rotated into pre_out[0] (and [1]) as
// rope.cu rotates; ends with the block's barrier.
template <int PRE>
__device__ __forceinline__ void stage_rotated(const act_t* q, const act_t* k, int pos, int d,
                                              const RopeArgs& ra, float (*pre_in)[256],
                                              act_t (*pre_out)[256]) {
#if defined(ROPE_NEOX) || defined(ROPE_INTERLEAVED)
    const int tid = threadIdx.x;
    if constexpr (PRE == PRE_NORM_ROPE) {
#if defined(H_BLOCK)
        const int warp = tid >> 5;
        if (warp == 0) head_norm(q, ra.wq, d, ra.eps, pre_in[0]);
        if (warp == 1 && k) head_norm(k, ra.wk, d, ra.eps, pre_in[1]);
#else
        __trap();
#endif
    } else {
        for (int c = tid; c < d; c += NT) {
            pre_in[0][c] = act_load(q[c]);
            if (k) pre_in[1][c] = act_load(k[c]);
        }
    }
    __syncthreads();
    rotate_head_at(pre_in[0], ra.cos_t, ra.sin_t, pos, ra.max_pos, d, pre_out[0], tid, NT);
    if (k) rotate_head_at(pre_in[1], ra.cos_t, ra.sin_t, pos, ra.max_pos, d, pre_out[1], tid, NT);
    __syncthreads();
#else
    __trap();  // the rope entries are compiled with a ROPE_* style
#endif
}

template <bool APPEND, int PRE>
__device__ __forceinline__ void decode_attend(
    const act_t* __restrict__ k_new, const act_t* __restrict__ v_new,
    const act_t* __restrict__ q, act_t* k_cache, act_t* v_cache,
    const int* __restrict__ positions, const int* __restrict__ slots, act_t* __restrict__ o,
    void* work, int rows, int hq, int hkv, int d, int max_ctx, float scale, int window,
    RopeArgs ra) {
    static_assert(PRE == PRE_NONE || APPEND, "the rope entries append");
    __shared__ float qs[256];            // the q head, f32
    __shared__ float probs[KV_BLOCK];    // the block's probabilities
    __shared__ float red[33];            // block_max / block_sum scratch
    __shared__ float part[NT * 8];       // p·v partials: [sub][column]
    __shared__ int merging;
    // q and the new k before the rotation, and after it (read 16 bytes at a time: aligned)
    __shared__ float pre_in[PRE == PRE_NONE ? 1 : 2][256];
    __shared__ __align__(16) act_t pre_out[PRE == PRE_NONE ? 1 : 2][256];

    const int qh = blockIdx.x, row = blockIdx.y, blk = blockIdx.z, nkv = gridDim.z;
    const int tid = threadIdx.x;
    if (row >= rows || qh >= hq) return;
    if (d > 256 || (d & 7) || hkv <= 0 || hq % hkv) __trap();
    const int kvh = qh / (hq / hkv);
    const int pos = positions[row], slot = slots[row];
    const int start = window > 0 ? max(0, pos - window + 1) : 0;
    const int first = start / KV_BLOCK, last = pos / KV_BLOCK;
    if (pos < 0 || pos >= max_ctx || last >= nkv) __trap();
    if (blk < first || blk > last) return;
    const long kv_row = (long)slot * max_ctx;  // position p of this slot: (kv_row + p) * hkv + kvh
    const long new_at = ((long)row * hkv + kvh) * d;

    // this block's new k: the input, or its rotation (computed below, after the wait)
    const act_t* k_new_row = PRE == PRE_NONE ? k_new + new_at : pre_out[PRE == PRE_NONE ? 0 : 1];
    auto k_at = [&](int p) -> const act_t* {
        if (APPEND && p == pos) return k_new_row;
        return k_cache + ((kv_row + p) * hkv + kvh) * d;
    };
    auto v_at = [&](int p) -> const act_t* {
        if (APPEND && p == pos) return v_new + new_at;
        return v_cache + ((kv_row + p) * hkv + kvh) * d;
    };

    const int b0 = blk * KV_BLOCK;
    const int lo = max(b0, start), hi = min(b0 + KV_BLOCK, pos + 1);  // [lo, hi), never empty
    // ---- scores. Thread t's k row (its first 128 columns) is loaded, and its v row asked
    // into L2, before q is read: the loads overlap instead of following one another.
    const int p = b0 + tid;
    const bool live = p >= lo && p < hi;
    act8_raw kv[16];
    if (live && p != pos) {  // rows of earlier steps: written by no launch of this one
        const act_t* kr = k_at(p);
#pragma unroll
        for (int j = 0; j < 16; ++j)
            if (j * 8 < d) kv[j] = act8_load(kr, j * 8);
        const char* vr = (const char*)v_at(p);
        for (int off = 0; off < d * (int)sizeof(act_t); off += 128)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(vr + off));
    }
    grid_dependency_sync();  // this step's row, q and every write: after the previous launch
    const act_t* q_row = q + ((long)row * hq + qh) * d;
    if constexpr (PRE == PRE_NONE) {
        for (int c = tid; c < d; c += NT) qs[c] = act_load(q_row[c]);
    } else {
        stage_rotated<PRE>(q_row, APPEND && blk == last ? k_new + new_at : nullptr, pos, d, ra,
                           pre_in, pre_out);
        for (int c = tid; c < d; c += NT) qs[c] = act_load(pre_out[0][c]);
    }
    __syncthreads();
    if (live && p == pos) {  // this step's k (a rotated one: in shared memory, written above)
        const act_t* kr = k_at(p);
#pragma unroll
        for (int j = 0; j < 16; ++j)
            if (j * 8 < d) kv[j] = act8_load(kr, j * 8);
    }
    float s = 0.0f;
    if (live) {
        const act_t* kr = k_at(p);
        for (int c0 = 0; c0 < d; c0 += 128) {
            if (c0 > 0) {
#pragma unroll
                for (int j = 0; j < 16; ++j)
                    if (c0 + j * 8 < d) kv[j] = act8_load(kr, c0 + j * 8);
            }
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                if (c0 + j * 8 >= d) break;
                float kf[8];
                act8_unpack(kv[j], kf);
#pragma unroll
                for (int i = 0; i < 8; ++i) s = fmaf(qs[c0 + j * 8 + i], kf[i], s);
            }
        }
    }
    // ---- softmax over the block's positions
    s = live ? s * scale : -INFINITY;
    const float m = block_max(s, red);
    const float e = live ? expf(s - m) : 0.0f;
    probs[tid] = e;
    const float l = block_sum(e, red);  // its barriers publish probs too
    // ---- p·v: thread t takes column chunk ch and positions b0 + sub + j nsub
    const int nch = d / 8, nsub = NT / nch;
    const int ch = tid % nch, sub = tid / nch;
    float pv[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) pv[i] = 0.0f;
    if (sub < nsub) {
        for (int p0 = b0 + sub; p0 < hi; p0 += nsub * VAHEAD) {
            act8_raw vv[VAHEAD];
#pragma unroll
            for (int j = 0; j < VAHEAD; ++j) {
                const int pp = p0 + j * nsub;
                if (pp >= lo && pp < hi) vv[j] = act8_load(v_at(pp), ch * 8);
            }
#pragma unroll
            for (int j = 0; j < VAHEAD; ++j) {
                const int pp = p0 + j * nsub;
                if (pp < lo || pp >= hi) continue;
                float vf[8];
                act8_unpack(vv[j], vf);
                const float pr = probs[pp - b0];
#pragma unroll
                for (int i = 0; i < 8; ++i) pv[i] = fmaf(pr, vf[i], pv[i]);
            }
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) part[tid * 8 + i] = pv[i];
    }
    __syncthreads();
    // ---- the block's partial state to the scratch: the nsub partials of each column summed in
    // sub order
    DecodeScratch sc(work, rows, hq, nkv);
    const long at = ((long)row * hq + qh) * nkv + blk;  // (row, q head, block)
    for (int c = tid; c < d; c += NT) {
        float a = 0.0f;
        for (int u = 0; u < nsub; ++u) a += part[u * d + c];
        sc.acc[at * d + c] = a;
    }
    if (tid == 0) {
        sc.ml[at * 2] = m;
        sc.ml[at * 2 + 1] = l;
    }
    // the new entry, for later steps (this step read it from the inputs); stored after every
    // cache load of the block so that those loads need not wait behind it
    if (APPEND && blk == last && qh == kvh * (hq / hkv)) {
        const long dst = ((kv_row + pos) * hkv + kvh) * d;
        for (int i = tid; i < d; i += NT) {
            k_cache[dst + i] = k_new_row[i];
            v_cache[dst + i] = v_new[new_at + i];
        }
    }
    // ---- the last block of this (q head, row) merges every block, left to right
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        unsigned* ticket = sc.tickets + (long)row * hq + qh;
        const unsigned t = atomicAdd(ticket, 1u);
        merging = t == (unsigned)(last - first);
        if (merging) {
            *ticket = 0u;  // every block of this launch has counted: ready for the next one
            __threadfence();
        }
    }
    __syncthreads();
    if (!merging) return;
    const long head = ((long)row * hq + qh) * nkv;  // (row, q head, block 0)
    for (int c = tid; c < d; c += NT) {
        float mm = -INFINITY, ll = 0.0f, a = 0.0f;
        for (int bb = first; bb <= last; bb += MAHEAD) {
            float bm[MAHEAD], bl[MAHEAD], bs[MAHEAD];
#pragma unroll
            for (int u = 0; u < MAHEAD; ++u) {
                if (bb + u > last) break;
                const long e = head + bb + u;
                bm[u] = __ldcg(sc.ml + e * 2);
                bl[u] = __ldcg(sc.ml + e * 2 + 1);
                bs[u] = __ldcg(sc.acc + e * d + c);
            }
#pragma unroll
            for (int u = 0; u < MAHEAD; ++u) {
                if (bb + u > last) break;
                const float mn = fmaxf(mm, bm[u]);
                const float x = mm == -INFINITY ? 0.0f : expf(mm - mn);
                const float y = expf(bm[u] - mn);
                a = a * x + bs[u] * y;
                ll = ll * x + bl[u] * y;
                mm = mn;
            }
        }
        o[((long)row * hq + qh) * d + c] = act_store(a / ll);
    }
}

// grid (hq, rows, ceil(max_ctx / KV_BLOCK)), block 256.
extern "C" __global__ void __launch_bounds__(NT, 2)
metrale_attention_decode(const act_t* __restrict__ q, const act_t* __restrict__ k_cache,
                         const act_t* __restrict__ v_cache, const int* __restrict__ positions,
                         const int* __restrict__ slots, act_t* __restrict__ o, void* work,
                         int rows, int hq, int hkv, int d, int max_ctx, float scale,
                         int window) {
    decode_attend<false, PRE_NONE>(nullptr, nullptr, q, const_cast<act_t*>(k_cache),
                                   const_cast<act_t*>(v_cache), positions, slots, o, work, rows,
                                   hq, hkv, d, max_ctx, scale, window, RopeArgs{});
}

// kv_append then attention in one kernel. grid (hq, rows, ceil(max_ctx / KV_BLOCK)), block 256.
extern "C" __global__ void __launch_bounds__(NT, 2)
metrale_kv_append_attention_decode(const act_t* __restrict__ k, const act_t* __restrict__ v,
                                   const act_t* __restrict__ q, act_t* k_cache, act_t* v_cache,
                                   const int* __restrict__ positions,
                                   const int* __restrict__ slots, act_t* __restrict__ o,
                                   void* work, int rows, int hq, int hkv, int d, int max_ctx,
                                   float scale, int window) {
    decode_attend<true, PRE_NONE>(k, v, q, k_cache, v_cache, positions, slots, o, work, rows, hq,
                                  hkv, d, max_ctx, scale, window, RopeArgs{});
}

#if defined(ROPE_NEOX) || defined(ROPE_INTERLEAVED)
// rope, kv_append and attention in one kernel. grid and block as above.
extern "C" __global__ void __launch_bounds__(NT, 2)
metrale_rope_kv_append_attention_decode(
    const act_t* __restrict__ q, const act_t* __restrict__ k, const act_t* __restrict__ v,
    act_t* k_cache, act_t* v_cache, const int* __restrict__ positions,
    const int* __restrict__ slots, const float* __restrict__ cos_t,
    const float* __restrict__ sin_t, act_t* __restrict__ o, void* work, int rows, int hq,
    int hkv, int d, int max_ctx, int max_pos, float scale, int window) {
    decode_attend<true, PRE_ROPE>(k, v, q, k_cache, v_cache, positions, slots, o, work, rows, hq,
                                  hkv, d, max_ctx, scale, window,
                                  RopeArgs{cos_t, sin_t, nullptr, nullptr, max_pos, 0.0f});
}

#if defined(H_BLOCK)
// qk_norm, rope, kv_append and attention in one kernel. grid and block as above.
extern "C" __global__ void __launch_bounds__(NT, 2)
metrale_qk_norm_rope_kv_append_attention_decode(
    const act_t* __restrict__ q, const act_t* __restrict__ k, const act_t* __restrict__ v,
    const __nv_bfloat16* __restrict__ wq, const __nv_bfloat16* __restrict__ wk,
    act_t* k_cache, act_t* v_cache, const int* __restrict__ positions,
    const int* __restrict__ slots, const float* __restrict__ cos_t,
    const float* __restrict__ sin_t, act_t* __restrict__ o, void* work, int rows, int hq,
    int hkv, int d, int max_ctx, int max_pos, float eps, float scale, int window) {
    decode_attend<true, PRE_NORM_ROPE>(k, v, q, k_cache, v_cache, positions, slots, o, work,
                                       rows, hq, hkv, d, max_ctx, scale, window,
                                       RopeArgs{cos_t, sin_t, wq, wk, max_pos, eps});
}
#endif
#endif

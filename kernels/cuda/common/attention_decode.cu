// Metrale CUDA: decode attention, split across the KV blocks.
//
// Decode rows are separate sequences (distinct cache slots). One thread block per (kv head,
// row, KV block): block z owns the absolute positions [z KV_BLOCK, (z + 1) KV_BLOCK) of its
// row, serves every q head of the GQA group (the k and v rows are read once), and writes the
// block's partial state (max m, sum l, unnormalized p·v) to the launch's scratch. The last
// block of a (kv head, row) to finish (a ticket counter in the scratch) merges the partials
// left to right with the log-sum-exp rule — the declared order, whichever block merges — and
// writes o. So the row's blocks run on as many multiprocessors as there are blocks, and the
// bytes are the reference's.
// Inside a block:
//   scores: thread t owns position b0 + t; q·k over head_dim left to right (fma, f32) for every
//           q head of the group, the k row's loads (and an L2 prefetch of the v row) issued
//           before q is staged;
//   softmax: block max and sum over the positions (warp trees, warps in order);
//   p·v:    thread t owns the 8 columns 8 (t mod d/8) .. and the positions b0 + t / (d/8) + j S
//           (S = threads / (d/8)), its loads issued ahead; the S partials per column meet in
//           order through shared memory.
// Scratch (bytes from KERNELS.toml `values.work`): rows·hkv u32 ticket counters, zero between
// launches (the merging block resets its own), then (m, l) and head_dim partials per
// (row, kv head, KV block, q head).
// Dependent launch: positions, slots and the cache rows before this step's position are read
// before the wait for the previous launch (grid_dependency_sync): the host writes the first two
// before the step and earlier steps the rows; everything this step's launches write, after it.
// Shapes outside head_dim <= 256 (a multiple of 8), more than MAXG q heads per kv head, or a
// position past max_ctx trap: a loud device fault, never a silently unwritten output.
// kv_append_attention additionally writes the row's new k, v into the cache at its position
// (the block holding that position does) and reads them from its inputs there (no other block
// reads that entry: slots are distinct). Defines: ACT_*, KV_BLOCK (256).
#include "metrale.cuh"

#define AW 8             // warps per block
#define NT (32 * AW)     // threads per block
#define MAXG 8           // q heads per kv head
#define VAHEAD 16        // v chunks one thread loads before using them

static_assert(KV_BLOCK == NT, "one position per thread in the score phase");

// The scratch layout of one launch (nkv = KV blocks per row = gridDim.z).
struct DecodeScratch {
    unsigned* tickets;  // [rows, hkv]
    float* ml;          // [rows, hkv, nkv, G, 2]
    float* acc;         // [rows, hkv, nkv, G, d]
    __device__ DecodeScratch(void* work, int rows, int hkv, int nkv, int G) {
        tickets = (unsigned*)work;
        const long counters = ((long)rows * hkv * 4 + 255) / 256 * 256;  // bytes, 256-aligned
        ml = (float*)((char*)work + counters);
        acc = ml + (long)rows * hkv * nkv * G * 2;
    }
};

template <bool APPEND, int GFIX>
__device__ __forceinline__ void decode_attend(
    const act_t* __restrict__ k_new, const act_t* __restrict__ v_new,
    const act_t* __restrict__ q, act_t* k_cache, act_t* v_cache,
    const int* __restrict__ positions, const int* __restrict__ slots, act_t* __restrict__ o,
    void* work, int rows, int hq, int hkv, int d, int max_ctx, float scale, int window) {
    __shared__ float qs[MAXG * 256];     // the group's q heads, f32
    __shared__ float S[MAXG * KV_BLOCK]; // scores, then probabilities
    __shared__ float red[AW * MAXG];     // per-warp maxima / sums
    __shared__ float blk_m[MAXG], blk_l[MAXG];
    __shared__ float part[NT * 8];       // p·v partials of one q head: [sub][column]
    __shared__ int merging;

    const int kvh = blockIdx.x, row = blockIdx.y, blk = blockIdx.z, nkv = gridDim.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int G = GFIX ? GFIX : hq / hkv;
    if (row >= rows || kvh >= hkv) return;
    if (d > 256 || (d & 7) || G > MAXG || G * hkv != hq) __trap();
    constexpr int GL = GFIX ? GFIX : MAXG;  // the q-head loops' bound, exact when GFIX is
    const int pos = positions[row], slot = slots[row];
    const int start = window > 0 ? max(0, pos - window + 1) : 0;
    const int first = start / KV_BLOCK, last = pos / KV_BLOCK;
    if (pos < 0 || pos >= max_ctx || last >= nkv) __trap();
    if (blk < first || blk > last) return;
    const long kv_row = (long)slot * max_ctx;  // position p of this slot: (kv_row + p) * hkv + kvh
    const long new_at = ((long)row * hkv + kvh) * d;

    auto k_at = [&](int p) -> const act_t* {
        if (APPEND && p == pos) return k_new + new_at;
        return k_cache + ((kv_row + p) * hkv + kvh) * d;
    };
    auto v_at = [&](int p) -> const act_t* {
        if (APPEND && p == pos) return v_new + new_at;
        return v_cache + ((kv_row + p) * hkv + kvh) * d;
    };

    const int b0 = blk * KV_BLOCK;
    const int lo = max(b0, start), hi = min(b0 + KV_BLOCK, pos + 1);  // [lo, hi), never empty
    // ---- scores. Thread t's k row (its first 128 columns) is loaded, and its v row asked
    // into L2, before q is staged: the loads overlap instead of following one another.
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
    if (live && p == pos) {
        const act_t* kr = k_at(p);
#pragma unroll
        for (int j = 0; j < 16; ++j)
            if (j * 8 < d) kv[j] = act8_load(kr, j * 8);
    }
    for (int i = tid; i < G * d; i += NT) {
        const int g = i / d, c = i - g * d;
        qs[g * 256 + c] = act_load(q[((long)row * hq + kvh * G + g) * d + c]);
    }
    __syncthreads();
    float acc[GL];
#pragma unroll
    for (int g = 0; g < GL; ++g) acc[g] = 0.0f;
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
                for (int g = 0; g < GL; ++g) {
                    if (g < G) {
#pragma unroll
                        for (int i = 0; i < 8; ++i)
                            acc[g] = fmaf(qs[g * 256 + c0 + j * 8 + i], kf[i], acc[g]);
                    }
                }
            }
        }
    }
    // ---- block max per q head
#pragma unroll
    for (int g = 0; g < GL; ++g) {
        if (g < G) {
            const float s = live ? acc[g] * scale : -INFINITY;
            S[g * KV_BLOCK + tid] = s;
            const float m = warp_max(s);
            if (lane == 0) red[warp * MAXG + g] = m;
        }
    }
    __syncthreads();
    if (tid < G) {
        float m = red[tid];
        for (int w = 1; w < AW; ++w) m = fmaxf(m, red[w * MAXG + tid]);
        blk_m[tid] = m;
    }
    __syncthreads();
    // ---- probabilities and their sum
#pragma unroll
    for (int g = 0; g < GL; ++g) {
        if (g < G) {
            const float e = live ? expf(S[g * KV_BLOCK + tid] - blk_m[g]) : 0.0f;
            S[g * KV_BLOCK + tid] = e;
            const float l = warp_sum(e);
            if (lane == 0) red[warp * MAXG + g] = l;
        }
    }
    __syncthreads();
    if (tid < G) {
        float l = red[tid];
        for (int w = 1; w < AW; ++w) l += red[w * MAXG + tid];
        blk_l[tid] = l;
    }
    // ---- p·v: thread t takes column chunk ch and positions b0 + sub + j nsub
    const int nch = d / 8, nsub = NT / nch;
    const int ch = tid % nch, sub = tid / nch;
    float pv[GL][8];
#pragma unroll
    for (int g = 0; g < GL; ++g)
#pragma unroll
        for (int i = 0; i < 8; ++i) pv[g][i] = 0.0f;
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
#pragma unroll
                for (int g = 0; g < GL; ++g) {
                    if (g < G) {
                        const float pr = S[g * KV_BLOCK + (pp - b0)];
#pragma unroll
                        for (int i = 0; i < 8; ++i) pv[g][i] = fmaf(pr, vf[i], pv[g][i]);
                    }
                }
            }
        }
    }
    // ---- the block's partial state to the scratch: per q head, the nsub partials of each
    // column summed in sub order
    DecodeScratch sc(work, rows, hkv, nkv, G);
    const long at = (((long)row * hkv + kvh) * nkv + blk) * G;  // (row, kvh, blk, g = 0)
#pragma unroll
    for (int g = 0; g < GL; ++g) {
        if (g >= G) break;
        __syncthreads();
        if (sub < nsub) {
#pragma unroll
            for (int i = 0; i < 8; ++i) part[tid * 8 + i] = pv[g][i];
        }
        __syncthreads();
        for (int c = tid; c < d; c += NT) {
            float s = 0.0f;
            for (int u = 0; u < nsub; ++u) s += part[u * d + c];
            sc.acc[(at + g) * d + c] = s;
        }
    }
    if (tid < G) {
        sc.ml[(at + tid) * 2] = blk_m[tid];
        sc.ml[(at + tid) * 2 + 1] = blk_l[tid];
    }
    // the new entry, for later steps (this step read it from the inputs); stored after every
    // cache load of the block so that those loads need not wait behind it
    if (APPEND && blk == last) {
        const long dst = ((kv_row + pos) * hkv + kvh) * d;
        for (int i = tid; i < d; i += NT) {
            k_cache[dst + i] = k_new[new_at + i];
            v_cache[dst + i] = v_new[new_at + i];
        }
    }
    // ---- the last block of this (kv head, row) merges every block, left to right
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        unsigned* ticket = sc.tickets + (long)row * hkv + kvh;
        const unsigned t = atomicAdd(ticket, 1u);
        merging = t == (unsigned)(last - first);
        if (merging) {
            *ticket = 0u;  // every block of this launch has counted: ready for the next one
            __threadfence();
        }
    }
    __syncthreads();
    if (!merging) return;
    for (int i = tid; i < G * d; i += NT) {
        const int g = i / d, c = i - g * d;
        float m = -INFINITY, l = 0.0f, a = 0.0f;
        constexpr int MAHEAD = 8;  // blocks whose partials are loaded before they are merged
        for (int b0 = first; b0 <= last; b0 += MAHEAD) {
            float bm[MAHEAD], bl[MAHEAD], bs[MAHEAD];
#pragma unroll
            for (int u = 0; u < MAHEAD; ++u) {
                if (b0 + u > last) break;
                const long e = (((long)row * hkv + kvh) * nkv + b0 + u) * G + g;
                bm[u] = __ldcg(sc.ml + e * 2);
                bl[u] = __ldcg(sc.ml + e * 2 + 1);
                bs[u] = __ldcg(sc.acc + e * d + c);
            }
#pragma unroll
            for (int u = 0; u < MAHEAD; ++u) {
                if (b0 + u > last) break;
                const float mn = fmaxf(m, bm[u]);
                const float x = m == -INFINITY ? 0.0f : expf(m - mn);
                const float y = expf(bm[u] - mn);
                a = a * x + bs[u] * y;
                l = l * x + bl[u] * y;
                m = mn;
            }
        }
        o[((long)row * hq + kvh * G + g) * d + c] = act_store(a / l);
    }
}

// One instantiation per common group size (q heads per kv head), so that the q-head loops are
// exact and the code a CTA runs stays small (the generic instantiation, loops to MAXG with run-time
// guards, compiles to 130 KB of machine code); other sizes take the generic one.
#define DECODE_BY_GROUP(APPEND, ...)                                     \
    switch (hkv > 0 ? hq / hkv : 0) {                                    \
        case 1: decode_attend<APPEND, 1>(__VA_ARGS__); break;            \
        case 2: decode_attend<APPEND, 2>(__VA_ARGS__); break;            \
        case 4: decode_attend<APPEND, 4>(__VA_ARGS__); break;            \
        case 8: decode_attend<APPEND, 8>(__VA_ARGS__); break;            \
        default: decode_attend<APPEND, 0>(__VA_ARGS__); break;           \
    }

// grid (hkv, rows, ceil(max_ctx / KV_BLOCK)), block 256.
extern "C" __global__ void __launch_bounds__(NT)
metrale_attention_decode(const act_t* __restrict__ q, const act_t* __restrict__ k_cache,
                         const act_t* __restrict__ v_cache, const int* __restrict__ positions,
                         const int* __restrict__ slots, act_t* __restrict__ o, void* work,
                         int rows, int hq, int hkv, int d, int max_ctx, float scale,
                         int window) {
    DECODE_BY_GROUP(false, nullptr, nullptr, q, const_cast<act_t*>(k_cache),
                    const_cast<act_t*>(v_cache), positions, slots, o, work, rows, hq, hkv, d,
                    max_ctx, scale, window);
}

// kv_append then attention in one kernel. grid (hkv, rows, ceil(max_ctx / KV_BLOCK)), block 256.
extern "C" __global__ void __launch_bounds__(NT)
metrale_kv_append_attention_decode(const act_t* __restrict__ k, const act_t* __restrict__ v,
                                   const act_t* __restrict__ q, act_t* k_cache, act_t* v_cache,
                                   const int* __restrict__ positions,
                                   const int* __restrict__ slots, act_t* __restrict__ o,
                                   void* work, int rows, int hq, int hkv, int d, int max_ctx,
                                   float scale, int window) {
    DECODE_BY_GROUP(true, k, v, q, k_cache, v_cache, positions, slots, o, work, rows, hq, hkv,
                    d, max_ctx, scale, window);
}

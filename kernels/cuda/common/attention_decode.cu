// Metrale CUDA: decode attention, split across the KV positions.
//
// Decode rows are separate sequences (distinct cache slots). One thread block (CTA) per (kv head,
// row, span of SPAN = 64 positions): CTA z owns the absolute positions [64 z, 64 z + 64) of its
// row, serves every q head of the GQA group (the k and v rows are read once), and writes its
// partial state (max m, sum l, unnormalized p·v) to the launch's scratch. The last CTA of a (kv
// head, row) to finish (a ticket counter in the scratch) merges: first the spans of each
// declared KV block (KV_BLOCK = 256 positions, 4 spans) left to right, then the blocks left to
// right with the same log-sum-exp rule: the declared order (blocks of KV_BLOCK, combined
// sequentially), whichever CTA merges. Spans rather than whole blocks per CTA: a 1024-token row
// of one kv head is 17 CTAs, not 5, each with a quarter of the dependent chain (loads, scores,
// softmax, p·v) that bounds a decode step's attention.
// Inside a CTA (4 warps):
//   scores: a half-warp per position, each lane 8 columns (a 16-byte load, coalesced over the
//           row), every position's k loads and an L2 prefetch of its v row issued before q is
//           staged; per q head a lane sums its columns left to right (fma, f32), then the 16
//           lanes meet in a butterfly;
//   softmax: a warp per q head: span max and sum;
//   p·v:    thread t owns the 8 columns 8 (t mod d/8) .. and the positions b0 + t / (d/8) + j S
//           (S = threads / (d/8)), every load issued first; the S partials per column meet in
//           order through shared memory.
// Scratch (bytes from KERNELS.toml `values.work`): rows·hkv u32 ticket counters, zero between
// launches (the merging CTA resets its own), then (m, l) and head_dim partials per (row, kv
// head, span, q head).
// Dependent launch: positions, slots and the cache rows before this step's position are read
// before the wait for the previous launch (grid_dependency_sync): the host writes the first two
// before the step and earlier steps the rows; everything this step's launches write, after it.
// Shapes outside head_dim <= 256 (a multiple of 8), more than MAXG q heads per kv head, or a
// position past max_ctx trap: a loud device fault, never a silently unwritten output.
// kv_append_attention additionally writes the row's new k, v into the cache at its position
// (the CTA holding that position does) and reads them from its inputs there (no other CTA reads
// that entry: slots are distinct). Defines: ACT_*, KV_BLOCK (256).
#include "metrale.cuh"

#define AW 4             // warps per CTA
#define NT (32 * AW)     // threads per CTA
#define SPAN 64          // positions per CTA: KERNELS.toml's grid z is ceil(max_ctx / 64)
#define MAXG 8           // q heads per kv head
#define MAXD 256         // head_dim
#if defined(ACT_BF16)
#define PAHEAD 8         // positions whose k a lane loads before using them (16 per warp)
#else
#define PAHEAD 4
#endif

static_assert(KV_BLOCK % SPAN == 0, "a declared KV block is a whole number of spans");
static_assert(SPAN == AW * 2 * 8, "a warp scores 16 positions, two at a time");
constexpr int SUBS = KV_BLOCK / SPAN;  // spans per declared KV block

// The scratch layout of one launch (nspan = spans per row = gridDim.z).
struct DecodeScratch {
    unsigned* tickets;  // [rows, hkv]
    float* ml;          // [rows, hkv, nspan, G, 2]
    float* acc;         // [rows, hkv, nspan, G, d]
    __device__ DecodeScratch(void* work, int rows, int hkv, int nspan, int G) {
        tickets = (unsigned*)work;
        const long counters = ((long)rows * hkv * 4 + 255) / 256 * 256;  // bytes, 256-aligned
        ml = (float*)((char*)work + counters);
        acc = ml + (long)rows * hkv * nspan * G * 2;
    }
};

// (m, l, a) <- (m, l, a) merged with a later partial (bm, bl, ba): the log-sum-exp rule.
__device__ __forceinline__ void lse_merge(float& m, float& l, float& a, float bm, float bl,
                                          float ba) {
    const float mn = fmaxf(m, bm);
    const float x = m == -INFINITY ? 0.0f : expf(m - mn);
    const float y = expf(bm - mn);
    a = a * x + ba * y;
    l = l * x + bl * y;
    m = mn;
}

template <bool APPEND>
__device__ __forceinline__ void decode_attend(
    const act_t* __restrict__ k_new, const act_t* __restrict__ v_new,
    const act_t* __restrict__ q, act_t* k_cache, act_t* v_cache,
    const int* __restrict__ positions, const int* __restrict__ slots, act_t* __restrict__ o,
    void* work, int rows, int hq, int hkv, int d, int max_ctx, float scale, int window) {
    __shared__ __align__(16) float qs[MAXG * MAXD];    // the group's q heads, f32
    __shared__ float S[MAXG][SPAN];                     // scores, then probabilities
    __shared__ float span_m[MAXG], span_l[MAXG];
    __shared__ __align__(16) float part[MAXG * NT * 8]; // p·v partials: [g][thread][8]
    __shared__ int merging;

    const int kvh = blockIdx.x, row = blockIdx.y, z = blockIdx.z, nspan = gridDim.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int G = hq / hkv;
    if (row >= rows || kvh >= hkv) return;
    if (d > MAXD || (d & 7) || G > MAXG || G * hkv != hq) __trap();
    const int pos = positions[row], slot = slots[row];
    const int start = window > 0 ? max(0, pos - window + 1) : 0;
    const int zfirst = start / SPAN, zlast = pos / SPAN;
    if (pos < 0 || pos >= max_ctx || zlast >= nspan) __trap();
    if (z < zfirst || z > zlast) return;
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

    const int b0 = z * SPAN;
    const int lo = max(b0, start), hi = min(b0 + SPAN, pos + 1);  // [lo, hi), never empty
    // ---- scores. Warp w scores positions b0 + 16 w + 2 i + half (i < 8); lane l16 of a half
    // holds columns 8 l16 .. and 128 + 8 l16 .. (d > 128).
    const int half = lane >> 4, l16 = lane & 15;
    const int nj = (d + 127) / 128;
    float s[8][MAXG];
#pragma unroll
    for (int i0 = 0; i0 < 8; i0 += PAHEAD) {
        act8_raw kr[PAHEAD][2];
        // Before the wait for the previous launch, only cache rows older than this step's
        // (p < pos: written by earlier steps, never by a launch of this one); the row at pos
        // (this step's, from the previous launch or the inputs) after it.
#pragma unroll
        for (int i = 0; i < PAHEAD; ++i) {
            const int p = b0 + warp * 16 + 2 * (i0 + i) + half;
            if (p >= lo && p < hi && (i0 > 0 || p != pos)) {
                const act_t* row_k = k_at(p);
#pragma unroll
                for (int j = 0; j < 2; ++j)
                    if (j < nj && j * 128 + l16 * 8 < d) kr[i][j] = act8_load(row_k, j * 128 + l16 * 8);
                if (i0 == 0 && (l16 & 7) == 0) {  // this lane's 128-byte line of the v row
                    const char* vr = (const char*)v_at(p) + l16 * 8 * sizeof(act_t);
                    for (int off = 0; off < d * (int)sizeof(act_t); off += 256)
                        if (l16 * 8 * (int)sizeof(act_t) + off < d * (int)sizeof(act_t))
                            asm volatile("prefetch.global.L2 [%0];" ::"l"(vr + off));
                }
            }
        }
        if (i0 == 0) {
            grid_dependency_sync();
#pragma unroll
            for (int i = 0; i < PAHEAD; ++i) {
                const int p = b0 + warp * 16 + 2 * i + half;
                if (p == pos && p >= lo) {
#pragma unroll
                    for (int j = 0; j < 2; ++j)
                        if (j < nj && j * 128 + l16 * 8 < d)
                            kr[i][j] = act8_load(k_at(p), j * 128 + l16 * 8);
                }
            }
            for (int i = tid; i < G * d; i += NT) {
                const int g = i / d, c = i - g * d;
                qs[g * MAXD + c] = act_load(q[((long)row * hq + kvh * G + g) * d + c]);
            }
            __syncthreads();
        }
#pragma unroll
        for (int g = 0; g < MAXG; ++g) {
            if (g >= G) break;
            float qv[2][8];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int c = j * 128 + l16 * 8;
                if (j < nj && c < d) {
                    const float4 a = *(const float4*)&qs[g * MAXD + c];
                    const float4 b = *(const float4*)&qs[g * MAXD + c + 4];
                    qv[j][0] = a.x; qv[j][1] = a.y; qv[j][2] = a.z; qv[j][3] = a.w;
                    qv[j][4] = b.x; qv[j][5] = b.y; qv[j][6] = b.z; qv[j][7] = b.w;
                }
            }
#pragma unroll
            for (int i = 0; i < PAHEAD; ++i) {
                const int p = b0 + warp * 16 + 2 * (i0 + i) + half;
                float acc = 0.0f;
                if (p >= lo && p < hi) {
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        if (j < nj && j * 128 + l16 * 8 < d) {
                            float kf[8];
                            act8_unpack(kr[i][j], kf);
#pragma unroll
                            for (int e = 0; e < 8; ++e) acc = fmaf(qv[j][e], kf[e], acc);
                        }
                    }
                }
                s[i0 + i][g] = acc;
            }
        }
    }
    // the 16 lanes of each half meet (butterfly), all positions and heads interleaved
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) {
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int g = 0; g < MAXG; ++g)
                if (g < G) s[i][g] += __shfl_xor_sync(0xffffffffu, s[i][g], o);
    }
    if (l16 == 0) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int p = b0 + warp * 16 + 2 * i + half;
            const bool live = p >= lo && p < hi;
#pragma unroll
            for (int g = 0; g < MAXG; ++g)
                if (g < G) S[g][p - b0] = live ? s[i][g] * scale : -INFINITY;
        }
    }
    __syncthreads();
    // ---- softmax over the span: warp w takes q heads w, w + AW
    for (int g = warp; g < G; g += AW) {
        const float x0 = S[g][lane], x1 = S[g][lane + 32];
        const float m = warp_max(fmaxf(x0, x1));  // finite: the span holds a live position
        const float e0 = expf(x0 - m), e1 = expf(x1 - m);
        S[g][lane] = e0;
        S[g][lane + 32] = e1;
        const float l = warp_sum(e0 + e1);
        if (lane == 0) {
            span_m[g] = m;
            span_l[g] = l;
        }
    }
    __syncthreads();
    // ---- p·v: thread t takes column chunk ch and positions b0 + sub + j nsub
    const int nch = d / 8, nsub = NT / nch;
    const int ch = tid % nch, sub = tid / nch;
    float pv[MAXG][8];
#pragma unroll
    for (int g = 0; g < MAXG; ++g)
#pragma unroll
        for (int e = 0; e < 8; ++e) pv[g][e] = 0.0f;
    if (sub < nsub) {
        constexpr int VAHEAD = SPAN / 4;  // nsub >= 4 (d <= 256)
        act8_raw vv[VAHEAD];
#pragma unroll
        for (int j = 0; j < VAHEAD; ++j) {
            const int pp = b0 + sub + j * nsub;
            if (sub + j * nsub < SPAN && pp >= lo && pp < hi) vv[j] = act8_load(v_at(pp), ch * 8);
        }
#pragma unroll
        for (int j = 0; j < VAHEAD; ++j) {
            const int pp = b0 + sub + j * nsub;
            if (sub + j * nsub >= SPAN || pp < lo || pp >= hi) continue;
            float vf[8];
            act8_unpack(vv[j], vf);
#pragma unroll
            for (int g = 0; g < MAXG; ++g) {
                if (g < G) {
                    const float pr = S[g][pp - b0];
#pragma unroll
                    for (int e = 0; e < 8; ++e) pv[g][e] = fmaf(pr, vf[e], pv[g][e]);
                }
            }
        }
#pragma unroll
        for (int g = 0; g < MAXG; ++g) {
            if (g < G) {
                float4* dst = (float4*)&part[(g * NT + tid) * 8];
                dst[0] = make_float4(pv[g][0], pv[g][1], pv[g][2], pv[g][3]);
                dst[1] = make_float4(pv[g][4], pv[g][5], pv[g][6], pv[g][7]);
            }
        }
    }
    __syncthreads();
    // ---- the span's partial state to the scratch: per q head, the nsub partials of each
    // column summed in sub order
    DecodeScratch sc(work, rows, hkv, nspan, G);
    const long at = (((long)row * hkv + kvh) * nspan + z) * G;  // (row, kvh, z, g = 0)
    for (int i = tid; i < G * d; i += NT) {
        const int g = i / d, c = i - g * d;
        float sum = 0.0f;
        for (int u = 0; u < nsub; ++u) sum += part[(g * NT + u * nch + c / 8) * 8 + (c & 7)];
        sc.acc[(at + g) * d + c] = sum;
    }
    if (tid < G) {
        sc.ml[(at + tid) * 2] = span_m[tid];
        sc.ml[(at + tid) * 2 + 1] = span_l[tid];
    }
    // the new entry, for later steps (this step read it from the inputs); stored after every
    // cache load of the CTA so that those loads need not wait behind it
    if (APPEND && z == zlast) {
        const long dst = ((kv_row + pos) * hkv + kvh) * d;
        for (int i = tid; i < d; i += NT) {
            k_cache[dst + i] = k_new[new_at + i];
            v_cache[dst + i] = v_new[new_at + i];
        }
    }
    // ---- the last CTA of this (kv head, row) merges every span
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        unsigned* ticket = sc.tickets + (long)row * hkv + kvh;
        const unsigned t = atomicAdd(ticket, 1u);
        merging = t == (unsigned)(zlast - zfirst);
        if (merging) {
            *ticket = 0u;  // every CTA of this launch has counted: ready for the next one
            __threadfence();
        }
    }
    __syncthreads();
    if (!merging) return;
    // Every load of a pass is issued before its arithmetic: the (m, l) of up to CHUNK spans
    // are staged in shared memory (the p·v buffer, free now), then each thread loads the
    // partial columns of its OUTS outputs for GROUP declared blocks at once and runs the
    // chain. At 1024 positions: one staging and two groups of loads, whatever the head count.
    constexpr int CHUNK = 64, GROUP = 4, OUTS = 4;
    static_assert(CHUNK % SUBS == 0 && CHUNK * MAXG * 2 <= MAXG * NT * 8, "staging fits");
    float* mls = part;  // [span - chunk start][g][m, l]
    const long base = ((long)row * hkv + kvh) * nspan;
    for (int i0 = 0; i0 < G * d; i0 += NT * OUTS) {  // uniform trip count: barriers inside
        float m[OUTS], l[OUTS], a[OUTS];
#pragma unroll
        for (int j = 0; j < OUTS; ++j) {
            m[j] = -INFINITY;
            l[j] = 0.0f;
            a[j] = 0.0f;
        }
        for (int c0 = zfirst / CHUNK * CHUNK; c0 <= zlast; c0 += CHUNK) {
            const int za = max(zfirst, c0), zb = min(zlast, c0 + CHUNK - 1);
            __syncthreads();  // the previous chunk's (m, l) are read
            for (int e = tid; e < (zb - za + 1) * G * 2; e += NT)
                mls[(za - c0) * G * 2 + e] = __ldcg(sc.ml + (base + za) * G * 2 + e);
            __syncthreads();
            for (int b0 = za / SUBS; b0 <= zb / SUBS; b0 += GROUP) {
                float sa[OUTS][GROUP][SUBS];
#pragma unroll
                for (int j = 0; j < OUTS; ++j) {
                    const int i = i0 + j * NT + tid, g = i / d, c = i - g * d;
                    if (i >= G * d) break;
#pragma unroll
                    for (int u = 0; u < GROUP; ++u)
#pragma unroll
                        for (int v = 0; v < SUBS; ++v) {
                            const int z = (b0 + u) * SUBS + v;
                            if (z >= za && z <= zb)
                                sa[j][u][v] = __ldcg(sc.acc + ((base + z) * G + g) * d + c);
                        }
                }
#pragma unroll
                for (int j = 0; j < OUTS; ++j) {
                    const int i = i0 + j * NT + tid, g = i / d;
                    if (i >= G * d) break;
#pragma unroll
                    for (int u = 0; u < GROUP; ++u) {
                        float bm = 0.0f, bl = 0.0f, ba = 0.0f;
                        bool any = false;
#pragma unroll
                        for (int v = 0; v < SUBS; ++v) {  // the block's spans, left to right
                            const int z = (b0 + u) * SUBS + v;
                            if (z < za || z > zb) continue;
                            const float* ml = mls + ((z - c0) * G + g) * 2;
                            if (any) {
                                lse_merge(bm, bl, ba, ml[0], ml[1], sa[j][u][v]);
                            } else {
                                bm = ml[0];
                                bl = ml[1];
                                ba = sa[j][u][v];
                                any = true;
                            }
                        }
                        if (any) lse_merge(m[j], l[j], a[j], bm, bl, ba);  // then the blocks
                    }
                }
            }
        }
#pragma unroll
        for (int j = 0; j < OUTS; ++j) {
            const int i = i0 + j * NT + tid, g = i / d, c = i - g * d;
            if (i < G * d) o[((long)row * hq + kvh * G + g) * d + c] = act_store(a[j] / l[j]);
        }
    }
}

// grid (hkv, rows, ceil(max_ctx / SPAN)), block NT.
extern "C" __global__ void __launch_bounds__(NT, 1)
metrale_attention_decode(const act_t* __restrict__ q, const act_t* __restrict__ k_cache,
                         const act_t* __restrict__ v_cache, const int* __restrict__ positions,
                         const int* __restrict__ slots, act_t* __restrict__ o, void* work,
                         int rows, int hq, int hkv, int d, int max_ctx, float scale,
                         int window) {
    decode_attend<false>(nullptr, nullptr, q, const_cast<act_t*>(k_cache),
                         const_cast<act_t*>(v_cache), positions, slots, o, work, rows, hq, hkv,
                         d, max_ctx, scale, window);
}

// kv_append then attention in one kernel. grid (hkv, rows, ceil(max_ctx / SPAN)), block NT.
extern "C" __global__ void __launch_bounds__(NT, 1)
metrale_kv_append_attention_decode(const act_t* __restrict__ k, const act_t* __restrict__ v,
                                   const act_t* __restrict__ q, act_t* k_cache, act_t* v_cache,
                                   const int* __restrict__ positions,
                                   const int* __restrict__ slots, act_t* __restrict__ o,
                                   void* work, int rows, int hq, int hkv, int d, int max_ctx,
                                   float scale, int window) {
    decode_attend<true>(k, v, q, k_cache, v_cache, positions, slots, o, work, rows, hq, hkv, d,
                        max_ctx, scale, window);
}

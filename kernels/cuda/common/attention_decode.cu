// Metrale CUDA: decode attention, one block per (kv head, row) serving the whole GQA group.
//
// Decode rows are separate sequences (distinct cache slots). The block walks the row's
// positions in the fixed KV_BLOCK blocks the reference cuts (absolute multiples of KV_BLOCK),
// left to right, and merges each block's (max, sum, acc) into the running state with the
// log-sum-exp rule, as the declared order says. Inside a block:
//   scores: lane l of warp w owns position b0 + 32 w + l; q·k over head_dim left to right
//           (fma, f32) for every q head of the group, the k row read once;
//   softmax: block max and sum over the positions (fixed warp trees, warps in order);
//   p·v:    warp w owns positions b0 + w, b0 + w + 8, ...; lane l owns head_dim columns
//           l, l + 32, ...; the 8 warp sums meet in warp order.
// Loads are issued ahead of their arithmetic (a k row of up to 128 values per thread; eight
// positions of v per warp), so that a block keeps many bytes in flight.
// Shapes outside head_dim <= 256 (a multiple of 8) or more than MAXG q heads per kv head trap:
// a loud device fault, never a silently unwritten output.
// kv_append_attention additionally writes the row's new k, v into the cache at its position
// and reads them from its inputs there (no other block reads that entry: slots are distinct).
// Defines: ACT_*, KV_BLOCK (256).
#include "metrale.cuh"

#define AW 8        // warps per block
#define MAXG 8      // q heads per kv head handled at once
#define MAXE 8      // head_dim / 32 at most (head_dim <= 256)
#define PART 512    // (q head, column) pairs reduced across warps at a time

static_assert(KV_BLOCK == 32 * AW, "one position per thread in the score phase");

template <bool APPEND>
__device__ __forceinline__ void decode_attend(
    const act_t* __restrict__ k_new, const act_t* __restrict__ v_new,
    const act_t* __restrict__ q, act_t* k_cache, act_t* v_cache,
    const int* __restrict__ positions, const int* __restrict__ slots, act_t* __restrict__ o,
    int rows, int hq, int hkv, int d, int max_ctx, float scale, int window) {
    __shared__ float qs[MAXG * 256];        // the group's q heads, f32
    __shared__ float S[MAXG * KV_BLOCK];    // scores, then probabilities
    __shared__ float red[AW * MAXG];        // per-warp maxima / sums
    __shared__ float part[AW * PART];       // per-warp p·v partials [warp][g][d]
    __shared__ float run_acc[MAXG * 256];   // running acc [g][d]
    __shared__ float run_m[MAXG], run_l[MAXG], blk_m[MAXG], blk_l[MAXG];

    const int kvh = blockIdx.x, row = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int G = hq / hkv;
    if (row >= rows || kvh >= hkv) return;
    if (d > 256 || (d & 7) || G > MAXG || G * d > MAXG * 256) __trap();
    const int E = (d + 31) / 32;  // columns per lane in p·v
    const int pos = positions[row], slot = slots[row];
    const int start = window > 0 ? max(0, pos - window + 1) : 0;
    const long kv_row = (long)slot * max_ctx;  // position p of this slot: (kv_row + p) * hkv + kvh

    if (APPEND) {  // the new entry, for later steps (this step reads it from the inputs)
        const long src = ((long)row * hkv + kvh) * d, dst = ((kv_row + pos) * hkv + kvh) * d;
        for (int i = tid; i < d; i += blockDim.x) {
            k_cache[dst + i] = k_new[src + i];
            v_cache[dst + i] = v_new[src + i];
        }
    }
    for (int i = tid; i < G * d; i += blockDim.x) {
        const int g = i / d, c = i - g * d;
        qs[g * 256 + c] = act_load(q[((long)row * hq + kvh * G + g) * d + c]);
        run_acc[g * 256 + c] = 0.0f;
    }
    if (tid < MAXG) { run_m[tid] = -INFINITY; run_l[tid] = 0.0f; }
    __syncthreads();

    auto k_at = [&](int p) -> const act_t* {
        if (APPEND && p == pos) return k_new + ((long)row * hkv + kvh) * d;
        return k_cache + ((kv_row + p) * hkv + kvh) * d;
    };
    auto v_at = [&](int p) -> const act_t* {
        if (APPEND && p == pos) return v_new + ((long)row * hkv + kvh) * d;
        return v_cache + ((kv_row + p) * hkv + kvh) * d;
    };

    for (int b0 = (start / KV_BLOCK) * KV_BLOCK; b0 <= pos; b0 += KV_BLOCK) {
        const int lo = max(b0, start), hi = min(b0 + KV_BLOCK, pos + 1);  // [lo, hi)
        // ---- scores
        const int p = b0 + tid;
        float acc[MAXG];
#pragma unroll
        for (int g = 0; g < MAXG; ++g) acc[g] = 0.0f;
        const bool live = p >= lo && p < hi;
        if (live) {
            const act_t* kr = k_at(p);
            if (d <= 128) {  // the whole row's loads first (16 chunks of 8 at most)
                float kv[16][8];
#pragma unroll
                for (int j = 0; j < 16; ++j)
                    if (j * 8 < d) act8(kr, j * 8, kv[j]);
#pragma unroll
                for (int j = 0; j < 16; ++j) {
                    if (j * 8 >= d) break;
#pragma unroll
                    for (int g = 0; g < MAXG; ++g) {
                        if (g < G) {
#pragma unroll
                            for (int i = 0; i < 8; ++i)
                                acc[g] = fmaf(qs[g * 256 + j * 8 + i], kv[j][i], acc[g]);
                        }
                    }
                }
            } else {
                for (int c = 0; c < d; c += 8) {
                    float kv[8];
                    act8(kr, c, kv);
#pragma unroll
                    for (int g = 0; g < MAXG; ++g) {
                        if (g < G) {
#pragma unroll
                            for (int i = 0; i < 8; ++i)
                                acc[g] = fmaf(qs[g * 256 + c + i], kv[i], acc[g]);
                        }
                    }
                }
            }
        }
        // ---- block max per q head
#pragma unroll
        for (int g = 0; g < MAXG; ++g) {
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
        for (int g = 0; g < MAXG; ++g) {
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
        // ---- p·v: warp w takes positions lo' = b0 + w + 8 j, lane its E columns
        float pv[MAXG][MAXE];
#pragma unroll
        for (int g = 0; g < MAXG; ++g)
#pragma unroll
            for (int e = 0; e < MAXE; ++e) pv[g][e] = 0.0f;
        constexpr int VAHEAD = 8;  // positions whose v rows one warp loads before using them
        for (int p0 = b0 + warp; p0 < hi; p0 += AW * VAHEAD) {
            float vv[VAHEAD][MAXE];
#pragma unroll
            for (int j = 0; j < VAHEAD; ++j) {
                const int pp = p0 + j * AW;
                const bool use = pp >= lo && pp < hi;
                const act_t* vr = use ? v_at(pp) : nullptr;
#pragma unroll
                for (int e = 0; e < MAXE; ++e) {
                    const int c = lane + 32 * e;
                    vv[j][e] = (use && e < E && c < d) ? act_load(vr[c]) : 0.0f;
                }
            }
#pragma unroll
            for (int j = 0; j < VAHEAD; ++j) {
                const int pp = p0 + j * AW;
                if (pp < lo || pp >= hi) continue;
#pragma unroll
                for (int g = 0; g < MAXG; ++g) {
                    if (g < G) {
                        const float pr = S[g * KV_BLOCK + (pp - b0)];
#pragma unroll
                        for (int e = 0; e < MAXE; ++e) pv[g][e] = fmaf(pr, vv[j][e], pv[g][e]);
                    }
                }
            }
        }
        // the 8 warp partials meet in warp order, at most PART (g, column) pairs at a time
        for (int g0 = 0; g0 < G; g0 += max(1, PART / d)) {
            const int gn = min(G - g0, max(1, PART / d));
            __syncthreads();
#pragma unroll
            for (int g = 0; g < MAXG; ++g) {
                if (g >= g0 && g < g0 + gn) {
#pragma unroll
                    for (int e = 0; e < MAXE; ++e) {
                        const int c = lane + 32 * e;
                        if (e < E && c < d) part[warp * PART + (g - g0) * d + c] = pv[g][e];
                    }
                }
            }
            __syncthreads();
            for (int i = tid; i < gn * d; i += blockDim.x) {
                float s = part[i];
                for (int w = 1; w < AW; ++w) s += part[w * PART + i];
                const int g = g0 + i / d, c = i - (i / d) * d;
                // merge this block into the running state (log-sum-exp, left to right)
                const float m_old = run_m[g], m_new = fmaxf(m_old, blk_m[g]);
                const float a = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
                const float b = expf(blk_m[g] - m_new);
                run_acc[g * 256 + c] = run_acc[g * 256 + c] * a + s * b;
            }
        }
        __syncthreads();
        if (tid < G) {
            const float m_old = run_m[tid], m_new = fmaxf(m_old, blk_m[tid]);
            const float a = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
            const float b = expf(blk_m[tid] - m_new);
            run_l[tid] = run_l[tid] * a + blk_l[tid] * b;
            run_m[tid] = m_new;
        }
        __syncthreads();
    }
    for (int i = tid; i < G * d; i += blockDim.x) {
        const int g = i / d, c = i - g * d;
        o[((long)row * hq + kvh * G + g) * d + c] = act_store(run_acc[g * 256 + c] / run_l[g]);
    }
}

// grid (hkv, rows), block 256.
extern "C" __global__ void __launch_bounds__(32 * AW)
metrale_attention_decode(const act_t* __restrict__ q, const act_t* __restrict__ k_cache,
                         const act_t* __restrict__ v_cache, const int* __restrict__ positions,
                         const int* __restrict__ slots, act_t* __restrict__ o, int rows, int hq,
                         int hkv, int d, int max_ctx, float scale, int window) {
    decode_attend<false>(nullptr, nullptr, q, const_cast<act_t*>(k_cache),
                         const_cast<act_t*>(v_cache), positions, slots, o, rows, hq, hkv, d,
                         max_ctx, scale, window);
}

// kv_append then attention in one kernel. grid (hkv, rows), block 256.
extern "C" __global__ void __launch_bounds__(32 * AW)
metrale_kv_append_attention_decode(const act_t* __restrict__ k, const act_t* __restrict__ v,
                                   const act_t* __restrict__ q, act_t* k_cache, act_t* v_cache,
                                   const int* __restrict__ positions,
                                   const int* __restrict__ slots, act_t* __restrict__ o,
                                   int rows, int hq, int hkv, int d, int max_ctx, float scale,
                                   int window) {
    decode_attend<true>(k, v, q, k_cache, v_cache, positions, slots, o, rows, hq, hkv, d,
                        max_ctx, scale, window);
}

// Metrale CUDA: attention with learned sinks (attention_sink, kv_append_attention_sink; gpt-oss),
// decode and prefill.
//
// One block of SINK_THREADS threads per (q head, row), as attention.cu's attend: the positions a
// row attends to (its window, if any) are cut at absolute multiples of KV_BLOCK; per block the
// scores s_j = (q · k_j) * scale (the dot left to right over head_dim, f32), m_b = max,
// e_j = exp(s_j - m_b), l_b = sum e_j (thread partials, warp trees, warp order),
// acc_b[c] = sum_j e_j v_j[c] (left to right over j). The sink is the merge's first state:
// m = sink[head], l = 1, acc = 0, and each block merges into it left to right by the
// log-sum-exp rule of metrale.lkb.semantics_sink, m' = max(m, m_b), a = exp(m - m'),
// b = exp(m_b - m'), l' = l a + l_b b, acc' = acc a + acc_b b; o = acc / l rounded to act.
// GQA: q head h reads kv head h / (hq / hkv). rope_kv_append_attention_sink (defines ROPE_*)
// rotates q, and each appended k, where they are read, as metrale.lkb.semantics_attention.rope
// does (rope.cuh). Defines: ACT_*, KV_BLOCK, ROPE_NEOX or ROPE_INTERLEAVED.
#include "metrale.cuh"
#if defined(ROPE_NEOX) || defined(ROPE_INTERLEAVED)
#include "rope.cuh"
#define SINK_ROPE 1
#else
#define SINK_ROPE 0
#endif

#ifndef KV_BLOCK
#error "define KV_BLOCK"
#endif
#ifndef MAX_HEAD_DIM
#define MAX_HEAD_DIM 256
#endif
#define SINK_THREADS 128

#if SINK_ROPE
// Element c of head x (act, d values) rotated at table row pos: rope.cuh's rotate_head, one
// element.
__device__ __forceinline__ float rotated(const act_t* x, int c, const float* cos_t,
                                         const float* sin_t, int pos, int max_pos, int d) {
    const int half = d / 2;
    const long row = (long)min(max(pos, 0), max_pos - 1) * half;
#if defined(ROPE_NEOX)
    const int i = c < half ? c : c - half, a = i, b = i + half;
#else
    const int i = c / 2, a = 2 * i, b = 2 * i + 1;
#endif
    const float cs = act_round(cos_t[row + i]), sn = act_round(sin_t[row + i]);
    const float xa = act_load(x[a]), xb = act_load(x[b]);
    return c == a ? act_round(__fadd_rn(act_round(__fmul_rn(xa, cs)), act_round(__fmul_rn(-xb, sn))))
                  : act_round(__fadd_rn(act_round(__fmul_rn(xb, cs)), act_round(__fmul_rn(xa, sn))));
}
#endif

// The attention of one (row, q head). When `k_new` is not null (kv_append_attention_sink),
// entries that some row of this launch appends are read from k_new / v_new instead of the
// cache, so no block reads an entry another block is writing: `src[j]` names the row that
// appends position start + j of this slot, or -1 (attention.cu's scheme).
__device__ __forceinline__ void attend_sink(const act_t* q, const act_t* k_cache,
                                            const act_t* v_cache, const int* positions,
                                            const int* slots, const __nv_bfloat16* sinks,
                                            const act_t* k_new, const act_t* v_new, act_t* o,
                                            int rows, int hq, int hkv, int d, int max_ctx,
                                            float scale, int window, const float* cos_t,
                                            const float* sin_t, int max_pos) {
    __shared__ float sq[MAX_HEAD_DIM];
    __shared__ float sp[KV_BLOCK];
    __shared__ int src[KV_BLOCK];
    __shared__ float scratch[33];
    const int head = blockIdx.x, row = blockIdx.y;
    const int kvh = head / (hq / hkv);
    const int slot = slots[row], p = positions[row];
    const int lo = window > 0 ? max(0, p - window + 1) : 0;
    const act_t* qr = q + ((long)row * hq + head) * d;
#if SINK_ROPE
    if (cos_t) {  // q rotated at its position, each element as rope rounds it
        for (int c = threadIdx.x; c < d; c += blockDim.x)
            sq[c] = rotated(qr, c, cos_t, sin_t, p, max_pos, d);
    } else
#endif
    for (int c = threadIdx.x; c < d; c += blockDim.x) sq[c] = act_load(qr[c]);
    constexpr int PER = (MAX_HEAD_DIM + SINK_THREADS - 1) / SINK_THREADS;
    float acc[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) acc[i] = 0.0f;
    float m = __bfloat162float(sinks[head]), l = 1.0f;
    __syncthreads();
    for (int start = lo; start <= p;) {
        const int end = min(p + 1, (start / KV_BLOCK + 1) * KV_BLOCK);
        const int nb = end - start;
        if (k_new) {
            for (int j = threadIdx.x; j < nb; j += blockDim.x) src[j] = -1;
            __syncthreads();
            for (int r = threadIdx.x; r < rows; r += blockDim.x)
                if (slots[r] == slot && positions[r] >= start && positions[r] < end)
                    src[positions[r] - start] = r;
            __syncthreads();
        }
        float mloc = -INFINITY;
        for (int j = threadIdx.x; j < nb; j += blockDim.x) {
            const int r = k_new ? src[j] : -1;
            const long at = ((long)slot * max_ctx + start + j) * hkv + kvh;
            const act_t* kj = r >= 0 ? k_new + ((long)r * hkv + kvh) * d : k_cache + at * d;
            float s = 0.0f;
#if SINK_ROPE
            if (cos_t && r >= 0) {  // an appended k: rotated at its row's position
                for (int c = 0; c < d; ++c)
                    s = fmaf(sq[c], rotated(kj, c, cos_t, sin_t, positions[r], max_pos, d), s);
            } else
#endif
            for (int c = 0; c < d; ++c) s = fmaf(sq[c], act_load(kj[c]), s);
            s *= scale;
            sp[j] = s;
            mloc = fmaxf(mloc, s);
        }
        const float mb = block_max(mloc, scratch);
        float lloc = 0.0f;
        for (int j = threadIdx.x; j < nb; j += blockDim.x) {
            const float e = expf(sp[j] - mb);
            sp[j] = e;
            lloc += e;
        }
        const float lb = block_sum(lloc, scratch);  // its barriers publish sp[] too
        const float mn = fmaxf(m, mb);
        const float a = m == mn ? 1.0f : expf(m - mn);  // exp(0) even where both are -inf
        const float b = expf(mb - mn);
        l = l * a + lb * b;
        m = mn;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int c = threadIdx.x + i * SINK_THREADS;
            if (c >= d) break;
            float ab = 0.0f;
            for (int j = 0; j < nb; ++j) {
                const int r = k_new ? src[j] : -1;
                const long at = ((long)slot * max_ctx + start + j) * hkv + kvh;
                const act_t* vj = r >= 0 ? v_new + ((long)r * hkv + kvh) * d : v_cache + at * d;
                ab = fmaf(sp[j], act_load(vj[c]), ab);
            }
            acc[i] = acc[i] * a + ab * b;
        }
        start = end;
        __syncthreads();  // sp and src are rewritten by the next block
    }
    act_t* orow = o + ((long)row * hq + head) * d;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int c = threadIdx.x + i * SINK_THREADS;
        if (c < d) orow[c] = act_store(acc[i] / l);
    }
}

// grid (hq, rows), block 128.
extern "C" __global__ void __launch_bounds__(SINK_THREADS)
metrale_attention_sink(const act_t* __restrict__ q, const act_t* __restrict__ k_cache,
                       const act_t* __restrict__ v_cache, const int* __restrict__ positions,
                       const int* __restrict__ slots, const __nv_bfloat16* __restrict__ sinks,
                       act_t* __restrict__ o, int rows, int hq, int hkv, int d, int max_ctx,
                       float scale, int window) {
    grid_dependency_sync();
    if (blockIdx.y >= rows || blockIdx.x >= hq) return;
    if (d > MAX_HEAD_DIM || hq % hkv) __trap();  // a shape the kernel cannot serve: loud
    attend_sink(q, k_cache, v_cache, positions, slots, sinks, nullptr, nullptr, o, rows, hq, hkv,
                d, max_ctx, scale, window, nullptr, nullptr, 0);
}

// kv_append then attention_sink in one launch, grid (hq, rows), block 128: the first q head of
// each kv group writes its row's k, v into the cache; the attention reads the appended entries
// from k, v themselves (see attend_sink), so the order of blocks does not matter.
__device__ __forceinline__ void append_attend_sink(
        const act_t* k, const act_t* v, const act_t* q, act_t* k_cache, act_t* v_cache,
        const int* positions, const int* slots, const __nv_bfloat16* sinks, act_t* o, int rows,
        int hq, int hkv, int d, int max_ctx, float scale, int window, const float* cos_t,
        const float* sin_t, int max_pos) {
    const int head = blockIdx.x, row = blockIdx.y;
    if (row >= rows || head >= hq) return;
    if (d > MAX_HEAD_DIM || hq % hkv) __trap();  // a shape the kernel cannot serve: loud
    const int group = hq / hkv;
    if (head % group == 0) {
        const int kvh = head / group;
        const long s = ((long)row * hkv + kvh) * d;
        const long t = (((long)slots[row] * max_ctx + positions[row]) * hkv + kvh) * d;
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
#if SINK_ROPE
            k_cache[t + c] = cos_t ? act_store(rotated(k + s, c, cos_t, sin_t, positions[row],
                                                       max_pos, d))
                                   : k[s + c];
#else
            k_cache[t + c] = k[s + c];
#endif
            v_cache[t + c] = v[s + c];
        }
    }
    attend_sink(q, k_cache, v_cache, positions, slots, sinks, k, v, o, rows, hq, hkv, d, max_ctx,
                scale, window, cos_t, sin_t, max_pos);
}

extern "C" __global__ void __launch_bounds__(SINK_THREADS)
metrale_kv_append_attention_sink(const act_t* __restrict__ k, const act_t* __restrict__ v,
                                 const act_t* __restrict__ q, act_t* k_cache, act_t* v_cache,
                                 const int* __restrict__ positions,
                                 const int* __restrict__ slots,
                                 const __nv_bfloat16* __restrict__ sinks, act_t* __restrict__ o,
                                 int rows, int hq, int hkv, int d, int max_ctx, float scale,
                                 int window) {
    grid_dependency_sync();
    append_attend_sink(k, v, q, k_cache, v_cache, positions, slots, sinks, o, rows, hq, hkv, d,
                       max_ctx, scale, window, nullptr, nullptr, 0);
}

#if SINK_ROPE
// rope then kv_append_attention_sink in one launch, grid (hq, rows), block 128: q and the new
// k are rotated where they are read, and the rotated k is appended.
extern "C" __global__ void __launch_bounds__(SINK_THREADS)
metrale_rope_kv_append_attention_sink(const act_t* __restrict__ q, const act_t* __restrict__ k,
                                      const act_t* __restrict__ v, act_t* k_cache,
                                      act_t* v_cache, const int* __restrict__ positions,
                                      const int* __restrict__ slots,
                                      const float* __restrict__ cos_t,
                                      const float* __restrict__ sin_t,
                                      const __nv_bfloat16* __restrict__ sinks,
                                      act_t* __restrict__ o, int rows, int hq, int hkv, int d,
                                      int max_ctx, int max_pos, float scale, int window) {
    grid_dependency_sync();
    append_attend_sink(k, v, q, k_cache, v_cache, positions, slots, sinks, o, rows, hq, hkv, d,
                       max_ctx, scale, window, cos_t, sin_t, max_pos);
}
#endif

// Metrale CUDA: the KV cache append and split-KV attention (kv_append, attention,
// kv_append_attention, kv_append_attention_online).
//
// Attention: one block of ATT_THREADS threads per (q head, row). The positions a row attends
// to are cut at absolute multiples of KV_BLOCK; per block: scores s_j = (q · k_j) * scale (the
// dot left to right over head_dim, f32), m_b = max, e_j = exp(s_j - m_b), l_b = sum e_j (thread
// partials, warp trees, warp order), acc_b[c] = sum_j e_j v_j[c] (left to right over j); the
// blocks merge left to right by the log-sum-exp rule of metrale.lkb.semantics_attention, and
// o = acc / l rounded to act. The online softmax (kv_append_attention_online, for classes
// without tensor cores) takes each block's weights against the running max instead,
// m' = max(m, m_b), e_j = exp(s_j - m') rounded to act, and scales what came before by
// exp(m - m'). GQA: q head h reads kv head h / (hq / hkv). Defines: ACT_*, KV_BLOCK.
#include "metrale.cuh"

#ifndef KV_BLOCK
#error "define KV_BLOCK"
#endif
#ifndef MAX_HEAD_DIM
#define MAX_HEAD_DIM 256
#endif
#define ATT_THREADS 128

// grid (rows, hkv), block 128: cache[slot, pos, head] = k[row, head] (and v).
extern "C" __global__ void __launch_bounds__(1024)
metrale_kv_append(const act_t* __restrict__ k, const act_t* __restrict__ v,
                  act_t* __restrict__ k_cache, act_t* __restrict__ v_cache,
                  const int* __restrict__ positions, const int* __restrict__ slots, int rows,
                  int hkv, int d, int max_ctx) {
    grid_dependency_sync();
    const int row = blockIdx.x, head = blockIdx.y;
    if (row >= rows || head >= hkv) return;
    const long src = ((long)row * hkv + head) * d;
    const long dst = (((long)slots[row] * max_ctx + positions[row]) * hkv + head) * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        k_cache[dst + i] = k[src + i];
        v_cache[dst + i] = v[src + i];
    }
}

// The attention of one (row, q head). When `k_new` is not null (kv_append_attention), entries
// that some row of this launch appends are read from k_new / v_new instead of the cache, so no
// block reads an entry another block is writing: `src[j]` names the row that appends position
// start + j of this slot, or -1.
template <bool ONLINE>
__device__ __forceinline__ void attend(const act_t* q, const act_t* k_cache,
                                       const act_t* v_cache, const int* positions,
                                       const int* slots, const act_t* k_new,
                                       const act_t* v_new, act_t* o, int rows, int hq,
                                       int hkv, int d, int max_ctx, float scale, int window) {
    __shared__ float sq[MAX_HEAD_DIM];
    __shared__ float sp[KV_BLOCK];
    __shared__ int src[KV_BLOCK];
    __shared__ float scratch[33];
    const int head = blockIdx.x, row = blockIdx.y;
    const int kvh = head / (hq / hkv);
    const int slot = slots[row], p = positions[row];
    const int lo = window > 0 ? max(0, p - window + 1) : 0;
    const act_t* qr = q + ((long)row * hq + head) * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) sq[c] = act_load(qr[c]);
    // each thread owns output columns c = threadIdx.x + i * blockDim.x
    constexpr int PER = (MAX_HEAD_DIM + ATT_THREADS - 1) / ATT_THREADS;
    float acc[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) acc[i] = 0.0f;
    float m = 0.0f, l = 0.0f;
    bool first = true;
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
            for (int c = 0; c < d; ++c) s = fmaf(sq[c], act_load(kj[c]), s);
            s *= scale;
            sp[j] = s;
            mloc = fmaxf(mloc, s);
        }
        float mb = block_max(mloc, scratch);
        float a = 1.0f, b = 1.0f;
        if (ONLINE && !first) {  // the weights against the running max: b stays 1
            mb = fmaxf(m, mb);
            a = expf(m - mb);
        }
        float lloc = 0.0f;
        for (int j = threadIdx.x; j < nb; j += blockDim.x) {
            const float x = expf(sp[j] - mb);
            const float e = ONLINE ? act_load(act_store(x)) : x;  // online: rounded to act
            sp[j] = e;
            lloc += e;
        }
        const float lb = block_sum(lloc, scratch);  // its barriers publish sp[] too
        if (ONLINE && !first) {
            l = l * a + lb;
            m = mb;
        } else if (!first) {
            const float mn = fmaxf(m, mb);
            a = expf(m - mn);
            b = expf(mb - mn);
            l = l * a + lb * b;
            m = mn;
        } else {
            m = mb;
            l = lb;
        }
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int c = threadIdx.x + i * ATT_THREADS;
            if (c >= d) break;
            float ab = 0.0f;
            for (int j = 0; j < nb; ++j) {
                const int r = k_new ? src[j] : -1;
                const long at = ((long)slot * max_ctx + start + j) * hkv + kvh;
                const act_t* vj = r >= 0 ? v_new + ((long)r * hkv + kvh) * d : v_cache + at * d;
                ab = fmaf(sp[j], act_load(vj[c]), ab);
            }
            acc[i] = first ? ab : acc[i] * a + ab * b;
        }
        first = false;
        start = end;
        __syncthreads();  // sp and src are rewritten by the next block
    }
    act_t* orow = o + ((long)row * hq + head) * d;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int c = threadIdx.x + i * ATT_THREADS;
        if (c < d) orow[c] = act_store(acc[i] / l);
    }
}

// grid (hq, rows), block 128.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
metrale_attention(const act_t* __restrict__ q, const act_t* __restrict__ k_cache,
                  const act_t* __restrict__ v_cache, const int* __restrict__ positions,
                  const int* __restrict__ slots, act_t* __restrict__ o, int rows, int hq,
                  int hkv, int d, int max_ctx, float scale, int window) {
    grid_dependency_sync();
    if (blockIdx.y >= rows || blockIdx.x >= hq) return;
    if (d > MAX_HEAD_DIM) __trap();  // a head_dim the kernel cannot serve: a loud fault
    attend<false>(q, k_cache, v_cache, positions, slots, nullptr, nullptr, o, rows, hq, hkv, d,
                  max_ctx, scale, window);
}

// kv_append then attention in one launch, grid (hq, rows), block 128: the first q head of
// each kv group writes its row's k, v into the cache; attention reads the appended entries
// from k, v themselves (see attend), so the order of blocks does not matter.
template <bool ONLINE>
__device__ __forceinline__ void append_attend(const act_t* k, const act_t* v, const act_t* q,
                                              act_t* k_cache, act_t* v_cache,
                                              const int* positions, const int* slots, act_t* o,
                                              int rows, int hq, int hkv, int d, int max_ctx,
                                              float scale, int window) {
    const int head = blockIdx.x, row = blockIdx.y;
    if (row >= rows || head >= hq) return;
    if (d > MAX_HEAD_DIM) __trap();
    const int group = hq / hkv;
    if (head % group == 0) {
        const int kvh = head / group;
        const long s = ((long)row * hkv + kvh) * d;
        const long t = (((long)slots[row] * max_ctx + positions[row]) * hkv + kvh) * d;
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
            k_cache[t + c] = k[s + c];
            v_cache[t + c] = v[s + c];
        }
    }
    attend<ONLINE>(q, k_cache, v_cache, positions, slots, k, v, o, rows, hq, hkv, d, max_ctx,
                   scale, window);
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS)
metrale_kv_append_attention(const act_t* __restrict__ k, const act_t* __restrict__ v,
                            const act_t* __restrict__ q, act_t* k_cache, act_t* v_cache,
                            const int* __restrict__ positions, const int* __restrict__ slots,
                            act_t* __restrict__ o, int rows, int hq, int hkv, int d,
                            int max_ctx, float scale, int window) {
    grid_dependency_sync();
    append_attend<false>(k, v, q, k_cache, v_cache, positions, slots, o, rows, hq, hkv, d,
                         max_ctx, scale, window);
}

// The same with the online softmax (kv_append_attention_online), grid (hq, rows), block 128.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
metrale_kv_append_attention_online(const act_t* __restrict__ k, const act_t* __restrict__ v,
                                   const act_t* __restrict__ q, act_t* k_cache, act_t* v_cache,
                                   const int* __restrict__ positions,
                                   const int* __restrict__ slots, act_t* __restrict__ o,
                                   int rows, int hq, int hkv, int d, int max_ctx, float scale,
                                   int window) {
    grid_dependency_sync();
    append_attend<true>(k, v, q, k_cache, v_cache, positions, slots, o, rows, hq, hkv, d,
                        max_ctx, scale, window);
}

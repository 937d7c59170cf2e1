// Metrale CUDA: the sample family (metrale.lkb.semantics_sample): temperature, top-k, top-p,
// min-p, and a Philox-4x32-10 draw keyed by (seed, request, position); temperature 0 is greedy.
// One block a row (grid (rows), block 256), so a row's id depends on its own inputs alone: the
// kernel is row-invariant. Masses are summed in f64 in a fixed order (each thread's strided or
// contiguous terms left to right, then the warps' and threads' partials in order), so a row's
// draw is reproducible on a device; the reference sums the same terms left to right.
#include <cuda_bf16.h>

#include "grid.cuh"

#define SAMPLE_THREADS 256
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)

namespace {

// Philox-4x32-10 (Salmon et al. 2011), the counter (position, request, 0, 0) and key
// (seed_lo, seed_hi): the first output word.
__device__ unsigned philox_first(unsigned c0, unsigned c1, unsigned k0, unsigned k1) {
    unsigned c2 = 0, c3 = 0;
    for (int r = 0; r < 10; ++r) {
        if (r) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        const unsigned long long p0 = 0xD2511F53ull * c0, p1 = 0xCD9E8D57ull * c2;
        const unsigned hi0 = (unsigned)(p0 >> 32), lo0 = (unsigned)p0;
        const unsigned hi1 = (unsigned)(p1 >> 32), lo1 = (unsigned)p1;
        const unsigned n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    }
    return c0;
}

// NumPy's argmax order: a NaN beats everything (the first NaN wins), else larger, else earlier.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    if (isnan(v)) return !isnan(bv) || i < bi;
    if (isnan(bv)) return false;
    return v > bv || (v == bv && i < bi);
}

// The block's argmax of f(i) over i < n (every thread gets it).
template <typename F>
__device__ int block_argmax(F f, int n, float* sv, int* si) {
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = f(i);
        if (better(v, i, bv, bi)) { bv = v; bi = i; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    bv = sv[0]; bi = si[0];
    for (int w = 1; w < SAMPLE_WARPS; ++w)
        if (better(sv[w], si[w], bv, bi)) { bv = sv[w]; bi = si[w]; }
    return bi == 0x7fffffff ? 0 : bi;
}

// The block's f64 sum of terms a thread gives for its strided indices, in a fixed order.
__device__ double block_sum(double mine, double* sd) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, o);  // lane 0's
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sd[warp] = mine;
    __syncthreads();
    double total = 0.0;
    for (int w = 0; w < SAMPLE_WARPS; ++w) total += sd[w];
    return total;
}

// An order-preserving unsigned key of a float (no NaN here).
__device__ __forceinline__ unsigned order_key(float v) {
    const unsigned b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}


}  // namespace

// ids[r] = the id row r draws (see the header and metrale.lkb.semantics_sample).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
metrale_sample(const float* __restrict__ logits, const float* __restrict__ params,
               const int* __restrict__ keys, int* __restrict__ ids, int rows, int n) {
    grid_dependency_sync();
    __shared__ float sv[SAMPLE_WARPS];
    __shared__ int si[SAMPLE_WARPS];
    __shared__ double sd[SAMPLE_THREADS];
    __shared__ unsigned hist[256];
    __shared__ int pick;
    const int row = blockIdx.x;
    if (row >= rows || blockDim.x != SAMPLE_THREADS) return;
    const float* l = logits + (long)row * n;
    const float t = params[row * 4 + 0], top_k = params[row * 4 + 1];
    const float top_p = params[row * 4 + 2], min_p = params[row * 4 + 3];
    if (!(t > 0.0f)) {  // greedy
        const int bi = block_argmax([&](int i) { return l[i]; }, n, sv, si);
        if (threadIdx.x == 0) ids[row] = bi;
        return;
    }
    auto z = [&](int i) { return l[i] / t; };  // IEEE division (no fast math)
    const int zi = block_argmax(z, n, sv, si);
    const float zmax = z(zi);
    if (!isfinite(zmax)) {  // an inf or NaN logit: the argmax of z
        if (threadIdx.x == 0) ids[row] = zi;
        return;
    }
    auto w = [&](int i) { return expf(z(i) - zmax); };

    // top-k: the k-th largest z by radix select on order keys, 8 bits a pass from the top
    bool use_k = top_k >= 1.0f && top_k < (float)n;
    unsigned kth = 0;  // order key of the k-th largest z; every z with a key >= it is kept
    if (use_k) {
        unsigned prefix = 0, mask = 0;
        int want = (int)top_k;  // rank still to find among the keys matching prefix
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
            __syncthreads();
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const unsigned k = order_key(z(i));
                if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1u);
            }
            __syncthreads();
            int digit = 255;
            for (; digit > 0; --digit) {  // from the top: the digit holding rank `want`
                const int c = (int)hist[digit];
                if (c >= want) break;
                want -= c;
            }
            prefix |= (unsigned)digit << shift;
            mask |= 255u << shift;
            __syncthreads();
        }
        kth = prefix;
    }
    auto kept_k = [&](int i) { return !use_k || order_key(z(i)) >= kth; };

    // top-p: the smallest weight bits b with mass(w > float(b)) < p * S (S the top-k mass);
    // keep w >= float(b). Binary search over the bits of weights in [0, 1].
    unsigned p_bits = 0;
    const bool use_p = top_p > 0.0f && top_p < 1.0f;
    if (use_p) {
        double mine = 0.0;
        for (int i = threadIdx.x; i < n; i += blockDim.x)
            if (kept_k(i)) mine += (double)w(i);
        const double target = (double)top_p * block_sum(mine, sd);
        unsigned lo = 0, hi = 0x3f800000u;  // g(float(hi)) = 0 < target: hi always qualifies
        while (lo < hi) {
            const unsigned mid = lo + (hi - lo) / 2;
            const float x = __uint_as_float(mid);
            double part = 0.0;
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const float wi = w(i);
                if (kept_k(i) && wi > x) part += (double)wi;
            }
            if (block_sum(part, sd) < target) hi = mid; else lo = mid + 1;
        }
        p_bits = lo;
    }
    const float p_floor = __uint_as_float(p_bits);
    const float m_floor = min_p > 0.0f ? fminf(min_p, 1.0f) : 0.0f;
    auto kept = [&](int i, float wi) {
        return kept_k(i) && (!use_p || wi >= p_floor) && (!(min_p > 0.0f) || wi >= m_floor);
    };

    // the draw: the first kept i, in index order, whose running mass exceeds u * S'
    const unsigned* key = (const unsigned*)keys + row * 4;
    const float u = (float)(philox_first(key[3], key[2], key[0], key[1]) >> 8) * 0x1p-24f;
    const int chunk = (n + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int begin = min(n, (int)threadIdx.x * chunk), end = min(n, begin + chunk);
    double mine = 0.0;
    for (int i = begin; i < end; ++i) {
        const float wi = w(i);
        if (kept(i, wi)) mine += (double)wi;
    }
    __syncthreads();
    sd[threadIdx.x] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (int j = 0; j < SAMPLE_THREADS; ++j) total += sd[j];
        const double target = (double)u * total;
        double prefix = 0.0;
        int owner = -1;
        for (int j = 0; j < SAMPLE_THREADS && owner < 0; ++j) {
            if (prefix + sd[j] > target) owner = j; else prefix += sd[j];
        }
        pick = -1;
        if (owner >= 0) {
            const int b = min(n, owner * chunk), e = min(n, b + chunk);
            double acc = 0.0;
            for (int i = b; i < e; ++i) {
                const float wi = w(i);
                if (!kept(i, wi)) continue;
                acc += (double)wi;
                if (prefix + acc > target) { pick = i; break; }
            }
        }
        ids[row] = pick >= 0 ? pick : zi;
    }
}

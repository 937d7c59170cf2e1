// Metrale CUDA: elementwise and gather families (embedding, add, swiglu, argmax, dequant).
// Defines: ACT_* (all but argmax and dequant), WEIGHT_* (dequant).
#if defined(WEIGHT_BF16) || defined(WEIGHT_F32) || defined(WEIGHT_FP8) || \
    defined(WEIGHT_MXFP4) || defined(WEIGHT_NVFP4)
#ifndef ACT_F32
#define ACT_F32 1  // dequant has no activation; f32 stands in so the header compiles
#endif
#endif
#if defined(ACT_BF16) || defined(ACT_F32)
#include "metrale.cuh"
#else
#include <cuda_bf16.h>

#include "grid.cuh"
#endif

#if defined(ACT_BF16) || defined(ACT_F32)
// x[r] = table[ids[r]] (bf16 table, exact in either act). grid (ceil(h / 256), rows), block 256.
extern "C" __global__ void __launch_bounds__(1024)
metrale_embedding(const int* __restrict__ ids, const __nv_bfloat16* __restrict__ table,
                  act_t* __restrict__ x, int rows, int vocab, int h) {
    grid_dependency_sync();
    const int row = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows || c >= h) return;
    const int id = ids[row];
    // an id out of range leaves x unwritten, so a poisoned output shows the fault instead
    // of plausible numbers
    if (id < 0 || id >= vocab) return;
    x[(long)row * h + c] = act_store(__bfloat162float(table[(long)id * h + c]));
}

// s = round(a + b), elementwise over count = rows * h. grid (ceil(count / 256)), block 256.
extern "C" __global__ void __launch_bounds__(1024)
metrale_add(const act_t* __restrict__ a, const act_t* __restrict__ b, act_t* __restrict__ s,
            long count) {
    grid_dependency_sync();
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) s[i] = act_store(act_load(a[i]) + act_load(b[i]));
}

// h = round(round(silu(g)) * u) over count = rows * n. grid (ceil(count / 256)), block 256.
extern "C" __global__ void __launch_bounds__(1024)
metrale_swiglu(const act_t* __restrict__ g, const act_t* __restrict__ u, act_t* __restrict__ h,
               long count) {
    grid_dependency_sync();
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    const float gf = act_load(g[i]);
    const float s = act_round(gf / (1.0f + expf(-gf)));
    h[i] = act_store(__fmul_rn(s, act_load(u[i])));
}
#endif

// ids[r] = the first index of row r's largest f32 logit (NaN counts as largest, as NumPy's
// argmax). grid (rows), block 256.
extern "C" __global__ void __launch_bounds__(1024)
metrale_argmax(const float* __restrict__ logits, int* __restrict__ ids, int rows, int n) {
    grid_dependency_sync();
    __shared__ float sv[32];
    __shared__ int si[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const float* l = logits + (long)row * n;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    auto better = [](float v, int i, float bv, int bi) {
        if (isnan(v)) return !isnan(bv) || i < bi;
        if (isnan(bv)) return false;
        return v > bv || (v == bv && i < bi);
    };
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (better(l[i], i, bv, bi)) { bv = l[i]; bi = i; }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
            if (better(sv[w], si[w], bv, bi)) { bv = sv[w]; bi = si[w]; }
        ids[row] = bi == 0x7fffffff ? 0 : bi;
    }
}

#if defined(METRALE_HAS_WEIGHT)
// w[r, c] = the f32 value weight (r, c) stands for. grid (ceil(k / 256), n), block 256.
extern "C" __global__ void __launch_bounds__(1024)
metrale_dequant(const void* __restrict__ wq, const void* __restrict__ wq_scale,
                const float* __restrict__ wq_global, float* __restrict__ w, int n, int k) {
    grid_dependency_sync();
    const int r = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= n || c >= k) return;
    WeightRef ref;
    ref.data = wq;
    ref.scale = wq_scale;
    ref.global = wq_global;
    w[(long)r * k + c] = weight1(weight_rows(ref, r, k), c);
}
#endif

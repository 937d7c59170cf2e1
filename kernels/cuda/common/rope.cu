// Metrale CUDA: rotary position embedding of q and k (rope). Defines: ACT_*, ROPE_NEOX |
// ROPE_INTERLEAVED. grid (hq + hkv, rows), block 64; q heads first, then k heads.
#include "rope.cuh"

#ifndef MAX_HEAD_DIM
#define MAX_HEAD_DIM 512
#endif

extern "C" __global__ void __launch_bounds__(1024)
metrale_rope(const act_t* __restrict__ q, const act_t* __restrict__ k,
             const int* __restrict__ positions, const float* __restrict__ cos_t,
             const float* __restrict__ sin_t, act_t* qr, act_t* kr, int rows, int hq, int hkv,
             int d, int max_pos) {
    grid_dependency_sync();
    __shared__ float buf[MAX_HEAD_DIM];
    const int head = blockIdx.x, row = blockIdx.y;
    if (row >= rows || head >= hq + hkv || d > MAX_HEAD_DIM) return;
    const bool isq = head < hq;
    const long o = isq ? ((long)row * hq + head) * d : ((long)row * hkv + head - hq) * d;
    const act_t* x = (isq ? q : k) + o;
    // staged through shared memory so the output may alias the input (in-place rope)
    for (int i = threadIdx.x; i < d; i += blockDim.x) buf[i] = act_load(x[i]);
    __syncthreads();
    const int pos = min(max(positions[row], 0), max_pos - 1);
    rotate_head(buf, cos_t + (long)pos * (d / 2), sin_t + (long)pos * (d / 2), d,
                (isq ? qr : kr) + o, threadIdx.x, blockDim.x);
}

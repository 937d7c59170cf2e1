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
    const QkHead hd(rows, hq, hkv, d, MAX_HEAD_DIM);
    if (!hd.valid) return;
    const act_t* x = (hd.isq ? q : k) + hd.at;
    // staged through shared memory so the output may alias the input (in-place rope)
    for (int i = threadIdx.x; i < d; i += blockDim.x) buf[i] = act_load(x[i]);
    __syncthreads();
    rotate_head_at(buf, cos_t, sin_t, positions[hd.row], max_pos, d, (hd.isq ? qr : kr) + hd.at,
                   threadIdx.x, blockDim.x);
}

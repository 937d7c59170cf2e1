// Metrale CUDA: rotary position embedding of q and k (rope). Defines: ACT_*, ROPE_NEOX |
// ROPE_INTERLEAVED. A warp a head (warp_head.cuh).
#include "rope.cuh"
#include "warp_head.cuh"

extern "C" __global__ void __launch_bounds__(32 * HEADS)
metrale_rope(const act_t* __restrict__ q, const act_t* __restrict__ k,
             const int* __restrict__ positions, const float* __restrict__ cos_t,
             const float* __restrict__ sin_t, act_t* qr, act_t* kr, int rows, int hq, int hkv,
             int d, int max_pos) {
    grid_dependency_sync();
    __shared__ float buf[HEADS][MAX_HEAD_DIM];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const WarpHead hd(rows, hq, hkv, d);
    if (!hd.valid) return;
    const act_t* x = (hd.isq ? q : k) + hd.at;
    // staged through the warp's own slice of shared memory, so the output may alias the input
    // (in-place rope): every lane's loads are in before any lane stores
#pragma unroll 4
    for (int i = lane; i < d; i += 32) buf[warp][i] = act_load(x[i]);
    __syncwarp();
    rotate_head_at(buf[warp], cos_t, sin_t, positions[hd.row], max_pos, d,
                   (hd.isq ? qr : kr) + hd.at, lane, 32);
}

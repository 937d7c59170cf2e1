// Metrale CUDA: rotary position embedding of q and k (rope). Defines: ACT_*, ROPE_NEOX |
// ROPE_INTERLEAVED. A warp a head, HEADS heads a block: grid (ceil((hq + hkv) / HEADS), rows),
// block 32 * HEADS; q heads first, then k heads.
//
// A block a head (version 28 and before) moved a prefill's bytes at 0.42 TB/s: 81920 blocks of
// two warps for Llama-3.1-8B's 2048 rows, each waiting on its loads, its barrier, then its table
// loads (docs/gpu-notes.md, version 29). Here each warp stages its own head and syncs alone.
#include "rope.cuh"

#ifndef MAX_HEAD_DIM
#define MAX_HEAD_DIM 512
#endif
constexpr int HEADS = 8;

extern "C" __global__ void __launch_bounds__(32 * HEADS)
metrale_rope(const act_t* __restrict__ q, const act_t* __restrict__ k,
             const int* __restrict__ positions, const float* __restrict__ cos_t,
             const float* __restrict__ sin_t, act_t* qr, act_t* kr, int rows, int hq, int hkv,
             int d, int max_pos) {
    grid_dependency_sync();
    __shared__ float buf[HEADS][MAX_HEAD_DIM];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int head = blockIdx.x * HEADS + warp, row = blockIdx.y;
    if (row >= rows || head >= hq + hkv || d > MAX_HEAD_DIM) return;
    const bool isq = head < hq;
    const long at = isq ? ((long)row * hq + head) * d : ((long)row * hkv + head - hq) * d;
    const act_t* x = (isq ? q : k) + at;
    // staged through the warp's own slice of shared memory, so the output may alias the input
    // (in-place rope): every lane's loads are in before any lane stores
#pragma unroll 4
    for (int i = lane; i < d; i += 32) buf[warp][i] = act_load(x[i]);
    __syncwarp();
    rotate_head_at(buf[warp], cos_t, sin_t, positions[row], max_pos, d, (isq ? qr : kr) + at,
                   lane, 32);
}

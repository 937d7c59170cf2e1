// Metrale CUDA: the per-head kernels' split of work (rope.cu; norm.cu's qk_norm and
// qk_norm_rope). A warp a head, HEADS heads a block: grid (ceil((hq + hkv) / HEADS), rows), block
// 32 * HEADS; q heads first, then k heads. Each warp stages its head in its own slice of shared
// memory, buf[HEADS][MAX_HEAD_DIM], and syncs alone.
//
// A block a head (rope, version 28 and before) or a warp a block (the norms, version 29 and
// before) moved a prefill's bytes at 0.41-0.42 TB/s: Qwen3-0.6B's 2048 tokens made 49152 one-warp
// blocks, at most 32 resident an SM, each waiting on its loads alone (docs/gpu-notes.md,
// versions 29 and 30).
#pragma once
#include "metrale.cuh"

#ifndef MAX_HEAD_DIM
#define MAX_HEAD_DIM 512
#endif
constexpr int HEADS = 8;

// The head of this warp: its row, which of q and k, and where it starts in either. A block of
// other than 32 HEADS threads traps: the grid counts HEADS heads a block, so its heads would
// go unwritten or be written twice.
struct WarpHead {
    int row;
    bool isq, valid;
    long at;
    __device__ __forceinline__ WarpHead(int rows, int hq, int hkv, int d) : row(blockIdx.y) {
        if (blockDim.x != 32 * HEADS) __trap();
        const int head = (int)blockIdx.x * HEADS + (int)(threadIdx.x >> 5);
        isq = head < hq;
        valid = row < rows && head < hq + hkv && d <= MAX_HEAD_DIM;
        at = isq ? ((long)row * hq + head) * d : ((long)row * hkv + head - hq) * d;
    }
};

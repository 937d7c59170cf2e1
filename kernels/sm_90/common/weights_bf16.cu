// Metrale CUDA, sm_90a: fp8 and fp4 weights made bf16, whole, into the program's workspace (the
// tables' `scratch` tensors), the launch before a matmul that copies them by tensor map as it
// copies bf16 weights: gemm_tma.cu's (k in blocks of K_BLOCK) and gemm_chain.cu's (k one chain
// of 16-wide steps). Each piece is made as gemm_wgmma.cu's tiles make it in shared memory
// (weight8_fetch, weight8_planes), so a matmul on the copy has the same operands.
#pragma once
#include "mma_weights.cuh"

#if !defined(WEIGHT_BF16) && !defined(WEIGHT_F32)
// One to three weights of n rows (qkv: nq, nk, nv) and k columns (k a multiple of 8: the tables
// launch these only where the tensor maps can copy the result) made bf16, row-major, each into
// its scratch tensor: blockIdx.y picks the weight, and a block makes DEQUANT_PIECES x 256 pieces
// of 8 columns, thread t the pieces t, t + 256, ... of the block's (so each load and store of a
// warp is one run of bytes), each as gemm_wgmma.cu's tiles make it (weight8_fetch,
// weight8_planes). Weights are written by no launch, so a thread loads its raw pieces before it
// waits for the previous launch; it stores after, since that launch may still read the
// workspace (the previous matmul's copies).
// block 256; grid (ceil(n k / (8 DEQUANT_PIECES 256)) for the longest weight, weights, 1).
constexpr int DEQUANT_PIECES = 2;

// weight w's n rows into out (the grid's x blocks; y picked the weight)
__device__ __forceinline__ void weight_bf16(WeightRef w, bf16* out, int n, int k) {
    const int per_row = k / 8;
    const long first = (long)blockIdx.x * blockDim.x * DEQUANT_PIECES + threadIdx.x;
    const long pieces = (long)n * per_row;
    WeightRaw8 raw[DEQUANT_PIECES];
#pragma unroll
    for (int j = 0; j < DEQUANT_PIECES; ++j) {
        const long p = first + (long)j * blockDim.x;
        if (p < pieces)
            raw[j] = weight8_fetch(weight_rows(w, p / per_row, k), int(p % per_row) * 8, k);
    }
    grid_dependency_sync();
#pragma unroll
    for (int j = 0; j < DEQUANT_PIECES; ++j) {
        const long p = first + (long)j * blockDim.x;
        if (p >= pieces) break;
        uint4 planes[PARTS];
        weight8_planes(raw[j], planes);
        *(uint4*)(out + p * 8) = planes[0];  // row p / per_row, column 8 (p % per_row)
    }
}

extern "C" __global__ void __launch_bounds__(256)
metrale_weight_bf16(const void* __restrict__ w, const void* __restrict__ w_scale,
                    const float* __restrict__ w_global, bf16* __restrict__ wb, int n, int k) {
    weight_bf16(weight_ref(w, w_scale, w_global), wb, n, k);
}

extern "C" __global__ void __launch_bounds__(256)
metrale_weights2_bf16(const void* __restrict__ wg, const void* __restrict__ wg_scale,
                      const float* __restrict__ wg_global, const void* __restrict__ wu,
                      const void* __restrict__ wu_scale, const float* __restrict__ wu_global,
                      bf16* __restrict__ wgb, bf16* __restrict__ wub, int n, int k) {
    const bool up = blockIdx.y == 1;
    weight_bf16(up ? weight_ref(wu, wu_scale, wu_global) : weight_ref(wg, wg_scale, wg_global),
                up ? wub : wgb, n, k);
}

extern "C" __global__ void __launch_bounds__(256)
metrale_weights3_bf16(const void* __restrict__ wq, const void* __restrict__ wq_scale,
                      const float* __restrict__ wq_global, const void* __restrict__ wk,
                      const void* __restrict__ wk_scale, const float* __restrict__ wk_global,
                      const void* __restrict__ wv, const void* __restrict__ wv_scale,
                      const float* __restrict__ wv_global, bf16* __restrict__ wqb,
                      bf16* __restrict__ wkb, bf16* __restrict__ wvb, int k, int nq, int nk,
                      int nv) {
    const int i = blockIdx.y;
    weight_bf16(i == 0   ? weight_ref(wq, wq_scale, wq_global)
                : i == 1 ? weight_ref(wk, wk_scale, wk_global)
                         : weight_ref(wv, wv_scale, wv_global),
                i == 0 ? wqb : i == 1 ? wkb : wvb, i == 0 ? nq : i == 1 ? nk : nv, k);
}
#endif

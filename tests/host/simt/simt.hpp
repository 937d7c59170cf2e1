// A host emulation of the CUDA execution model for the tensor-core GEMM (kernels/cuda/common/
// gemm.cu), so that the kernel's own source runs in CI, where there is no GPU.
//
// Every thread of a block is an OS thread; __syncthreads is a barrier of the block's threads.
// The warp-wide instructions gemm.cu issues through its PTX wrappers (ldmatrix, mma.sync) are
// emulated as the PTX ISA defines them: each lane posts its operands, the warp meets at a
// barrier, each lane computes its own results from all the lanes' operands, and the warp meets
// again before the buffers are reused. cp.async copies are held back until the
// cp.async.wait_group that completes their group, so a read that the kernel does not wait for
// sees the poison the block's shared memory starts with. The MMA sums its products in double,
// then adds the accumulator and rounds once to f32: the tests compare with the reference's
// tolerance, or exactly where every sum is exact in any order.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <barrier>
#include <math.h>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

// the CUDA keywords, as plain C++
#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __forceinline__
#define __forceinline__ inline
#undef __shared__
#define __shared__
#undef __launch_bounds__
#define __launch_bounds__(...)
#define METRALE_PTX_EMULATED 1

namespace simt {

constexpr int MAX_THREADS = 256;
constexpr int SMEM_BYTES = 128 * 1024;

struct Warp {
    std::barrier<> meet{32};
    const void* addr[32];
    uint32_t a[32][4], b[32][2];
};

struct Block {
    std::barrier<> sync;
    Warp warps[MAX_THREADS / 32];
    explicit Block(int threads) : sync(threads) {}
};

struct Copy {
    void* dst;
    const void* src;
    int bytes;  // 16, or 0: sixteen zero bytes
};

inline thread_local uint3 thread_idx, block_idx, block_dim;
inline thread_local Block* block;
inline thread_local std::vector<Copy> open_group;
inline thread_local std::vector<std::vector<Copy>> committed;

inline Warp& warp() { return block->warps[thread_idx.x / 32]; }
inline int lane() { return (int)thread_idx.x % 32; }

// Run kernel() for every thread of a (gx, gy, gz) grid of `threads`-thread blocks, one block after
// another; shared memory starts every block as 0xFF bytes (NaN for floats and bf16).
void launch(dim3 grid, int threads, int shared, const std::function<void()>& kernel);

inline float bf16_at(uint32_t word, int half) {
    const uint16_t bits = (uint16_t)(word >> (16 * half));
    __nv_bfloat16 v;
    std::memcpy(&v, &bits, 2);
    return __bfloat162float(v);
}

}  // namespace simt

extern "C" unsigned char smem_raw[];

#undef threadIdx
#undef blockIdx
#undef blockDim
#define threadIdx (simt::thread_idx)
#define blockIdx (simt::block_idx)
#define blockDim (simt::block_dim)

inline void __syncthreads() { simt::block->sync.arrive_and_wait(); }

// device intrinsics the included headers name (only some of them are used by gemm.cu)
inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline int __popc(uint32_t v) { return __builtin_popcount(v); }
// warp shuffles: named by the decode kernels the headers also hold, not used by gemm.cu
template <class T>
inline T __shfl_xor_sync(unsigned, T, int) { std::abort(); }
template <class T>
inline T __shfl_sync(unsigned, T, int) { std::abort(); }
inline int __any_sync(unsigned, int) { std::abort(); }
using std::max;
using std::min;

// ------------------------------------------------------------------ gemm.cu's PTX, emulated

inline void cp_async16(__nv_bfloat16* dst, const void* src, int bytes) {
    simt::open_group.push_back({dst, src, bytes});
}
inline void cp_async_commit() {
    simt::committed.push_back(std::move(simt::open_group));
    simt::open_group.clear();
}
// METRALE_SIMT_WAIT_SLACK leaves that many more groups in flight than the kernel asks: the test
// of the emulation itself (a pipeline that waited one group short must read poison).
#ifndef METRALE_SIMT_WAIT_SLACK
#define METRALE_SIMT_WAIT_SLACK 0
#endif
template <int N>
inline void cp_async_wait() {
    auto& groups = simt::committed;
    while ((int)groups.size() > N + METRALE_SIMT_WAIT_SLACK) {
        for (const simt::Copy& c : groups.front()) {
            if (c.bytes) std::memcpy(c.dst, c.src, 16);
            else std::memset(c.dst, 0, 16);
        }
        groups.erase(groups.begin());
    }
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16: lane i gives the address of row i % 8 of matrix i / 8;
// lane l receives, from each matrix j, the two 16-bit values of row l / 4 at columns 2 (l % 4).
inline void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* p) {
    simt::Warp& w = simt::warp();
    const int l = simt::lane();
    w.addr[l] = p;
    w.meet.arrive_and_wait();
    for (int j = 0; j < 4; ++j)
        std::memcpy(&r[j], (const uint16_t*)w.addr[8 * j + l / 4] + 2 * (l % 4), 4);
    w.meet.arrive_and_wait();
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, d += a b, with the fragment layouts of
// the PTX ISA (groupID g = lane / 4, threadID_in_group t = lane % 4): A's register i holds row
// g + 8 (i % 2), columns 2 t + 8 (i / 2) + {0, 1}; B's register i holds k rows 2 t + 8 i + {0, 1}
// of column g; C and D hold row g + 8 (e / 2), column 2 t + e % 2 in element e.
inline void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    simt::Warp& w = simt::warp();
    const int l = simt::lane();
    std::memcpy(w.a[l], a, sizeof a);
    w.b[l][0] = b0;
    w.b[l][1] = b1;
    w.meet.arrive_and_wait();
    auto A = [&](int row, int k) {
        const int g = row % 8, i = row / 8 + 2 * (k / 8), t = (k % 8) / 2;
        return simt::bf16_at(w.a[4 * g + t][i], k % 2);
    };
    auto B = [&](int k, int col) {
        const int i = k / 8, t = (k % 8) / 2;
        return simt::bf16_at(w.b[4 * col + t][i], k % 2);
    };
    const int g = l / 4, t = l % 4;
    float out[4];
    for (int e = 0; e < 4; ++e) {
        const int row = g + 8 * (e / 2), col = 2 * t + e % 2;
        double s = 0.0;
        for (int k = 0; k < 16; ++k) s += (double)A(row, k) * (double)B(k, col);
        out[e] = (float)(s + (double)d[e]);
    }
    w.meet.arrive_and_wait();
    std::memcpy(d, out, sizeof out);
}

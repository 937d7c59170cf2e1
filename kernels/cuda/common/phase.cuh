// Metrale CUDA: phase marks, for profiling the inside of a kernel.
//
// Off unless PHASE_TRACE (the number of blocks to record) is defined, so the kernels the build
// compiles carry none. With it, thread 0 of each block writes the SM clock and the global timer
// at mark i into metrale_phase_trace[block][i] (block = x + X (y + Y z)), which
// benchmarks/trace_gpu_attention.py reads back.
#pragma once

#if defined(PHASE_TRACE)
#define PHASE_MARKS 16
__device__ unsigned long long metrale_phase_trace[PHASE_TRACE * PHASE_MARKS * 2];
__device__ __forceinline__ void phase_mark(int i) {
    if (threadIdx.x != 0) return;
    const long b = blockIdx.x + (long)gridDim.x * (blockIdx.y + (long)gridDim.y * blockIdx.z);
    if (b >= PHASE_TRACE) return;
    unsigned long long g;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
    metrale_phase_trace[(b * PHASE_MARKS + i) * 2] = clock64();
    metrale_phase_trace[(b * PHASE_MARKS + i) * 2 + 1] = g;
}
#else
__device__ __forceinline__ void phase_mark(int) {}
#endif

// Metrale CUDA: how a kernel meets the launch before it on its stream.
#pragma once

// Programmatic dependent launch (sm_90 and later): a kernel launched with it may start while the
// previous launch on its stream is still running. Every kernel here calls this first: it waits
// until that launch has finished and its writes are visible (so nothing here reads or writes
// memory the earlier work touches before it), then lets the next launch start its own blocks,
// which wait in turn. Launched plainly, or below sm_90, both instructions do nothing.
__device__ __forceinline__ void grid_dependency_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The dynamic shared memory this launch was given, in bytes: kernels that size their use from
// their arguments check it against what they need and trap, rather than write past it.
__device__ __forceinline__ unsigned dynamic_smem_bytes() {
    unsigned r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

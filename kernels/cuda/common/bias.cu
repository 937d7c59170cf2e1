// Metrale CUDA: bias_add, a projection's bias added to every row (gpt-oss's q, k, v and o).
// y[r, c] = round(x[r, c] + b[c]) with the bf16 bias widened exactly, as the reference.
// Defines: ACT_*.
#include "metrale.cuh"

// grid (ceil(n / 256), rows), block 256.
extern "C" __global__ void __launch_bounds__(1024)
metrale_bias_add(const act_t* __restrict__ x, const __nv_bfloat16* __restrict__ b,
                 act_t* __restrict__ y, int rows, int n) {
    grid_dependency_sync();
    const int row = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows || c >= n) return;
    const long i = (long)row * n + c;
    y[i] = act_store(__fadd_rn(act_load(x[i]), __bfloat162float(b[c])));
}

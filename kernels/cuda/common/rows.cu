// Metrale CUDA: row selection (last_row: a prefill's last row, all that its logits need).
#include "metrale.cuh"

// grid ceil(h / 256), block 256: y[0, c] = x[rows - 1, c].
extern "C" __global__ void __launch_bounds__(256)
metrale_last_row(const act_t* __restrict__ x, act_t* __restrict__ y, int rows, int h) {
    grid_dependency_sync();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < h) y[c] = x[(long)(rows - 1) * h + c];
}

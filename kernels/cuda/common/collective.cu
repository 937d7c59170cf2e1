// Metrale CUDA: rank_sum, the reduction of an all-reduce (tensor parallelism). The transport
// only gathers the ranks' partial sums, parts [rows, ranks, n]; this kernel adds them in rank
// order, y = round(((p0 + p1) + p2) + ...), in f32 and rounded once, as the reference does,
// so every class and every run give the same bytes however the gather was carried.
// Defines: ACT_*.
#include "metrale.cuh"

// grid (ceil(n / 256), rows), block 256.
extern "C" __global__ void __launch_bounds__(1024)
metrale_rank_sum(const act_t* __restrict__ parts, act_t* __restrict__ y, int rows, int ranks,
                 int n) {
    grid_dependency_sync();
    const int row = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows || c >= n) return;
    const act_t* p = parts + (long)row * ranks * n + c;
    float acc = act_load(p[0]);
    for (int r = 1; r < ranks; ++r) acc = __fadd_rn(acc, act_load(p[(long)r * n]));
    y[(long)row * n + c] = act_store(acc);
}

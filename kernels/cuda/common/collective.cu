// Metrale CUDA: the kernels of tensor parallelism's collectives.
//
// rank_sum, the reduction of an all-reduce. The transport
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

// embedding_part: one rank's rows of a vocabulary-split embedding, table[id - first] for the
// ids in its part and -0.0 for the others (-0.0 + x is x, bit for bit: the ranks' rows summed
// by rank_sum are each id's row of the whole table). grid (ceil(h / 256), rows), block 256.
extern "C" __global__ void __launch_bounds__(1024)
metrale_embedding_part(const int* __restrict__ ids, const __nv_bfloat16* __restrict__ table,
                       const int* __restrict__ first, act_t* __restrict__ x, int rows, int part,
                       int h) {
    grid_dependency_sync();
    const int row = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows || c >= h) return;
    const long local = (long)ids[row] - first[0];
    const float v = (local >= 0 && local < part) ? __bfloat162float(table[local * h + c]) : -0.0f;
    x[(long)row * h + c] = act_store(v);
}

// all_gather's layout: the transport (NCCL's all-gather on NVIDIA classes) gathers every
// rank's x [rows, n], rank-major, into `gathered` [ranks, rows, n], a scratch of the program's
// workspace; this kernel lays it out rows-leading, y[row, r, c] = gathered[r, row, c], and
// leaves the scratch zero again (the workspace's contract with the kernels after it).
// grid (ceil(n / 256), rows, ranks), block 256.
extern "C" __global__ void __launch_bounds__(1024)
metrale_ranks_to_rows(act_t* __restrict__ gathered, act_t* __restrict__ y, int rows, int ranks,
                      int n) {
    grid_dependency_sync();
    const int row = blockIdx.y, r = blockIdx.z, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows || r >= ranks || c >= n) return;
    const long from = ((long)r * rows + row) * n + c;
    y[((long)row * ranks + r) * n + c] = gathered[from];
    gathered[from] = act_store(0.0f);
}

// all_reduce: the transport gathers every rank's x [rows, n], rank-major, into `gathered`
// [ranks, rows, n] (the workspace); this kernel adds the ranks in rank order as rank_sum does,
// y = round(((g0 + g1) + g2) + ...) in f32, and leaves the workspace zero again.
// grid (ceil(n / 256), rows), block 256.
extern "C" __global__ void __launch_bounds__(1024)
metrale_rank_sum_gathered(act_t* __restrict__ gathered, act_t* __restrict__ y, int rows,
                          int ranks, int n) {
    grid_dependency_sync();
    const int row = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows || c >= n) return;
    const long stride = (long)rows * n, at = (long)row * n + c;
    float acc = act_load(gathered[at]);
    gathered[at] = act_store(0.0f);
    for (int r = 1; r < ranks; ++r) {
        acc = __fadd_rn(acc, act_load(gathered[r * stride + at]));
        gathered[r * stride + at] = act_store(0.0f);
    }
    y[at] = act_store(acc);
}

// Metrale CUDA, experiment: a decode layer's MLP half (add_rmsnorm, gate_up_swiglu, the down
// linear) as one launch of resident blocks whose weights the Tensor Memory Accelerator stages.
//
// Version 19 built this half as one persistent launch and lost at batch 1: gemv.cu's dots hold
// their bytes in flight in registers, and two GEMV stages in one kernel spilled at the 64
// registers that 32 warps an SM need, or ran at half the warps. Here the bytes in flight need no
// registers: each block's weights come into shared memory by bulk copies (cp.async.bulk, one
// thread issuing a few large copies) that it issues before its dependent-launch wait, so they
// stream while the launch before it finishes. At Qwen3-0.6B's shapes a block's whole share fits:
// 132 blocks, each about 23 gate/up pairs (94 KiB) and 8 down columns (48 KiB).
//
// A block b of G (one per multiprocessor, all resident: gridDim.x must not exceed them):
//   1. thread 0 initializes two transaction barriers and copies the block's gate rows, up rows
//      (barrier 0) and down rows (barrier 1) into shared memory; then the dependent-launch wait;
//   2. every block normalizes the row itself (row_norm, norm.cu's code: add_rmsnorm's bytes)
//      into shared memory; block 0 also stores s = x + r;
//   3. barrier 0; warp w takes the block's pairs w, w + 8, ...: warp_dots over the staged rows
//      (gemv.cu's code, so gate_up_swiglu's bytes), h to global;
//   4. a grid barrier (one counter and a generation word; a block that waits past about a second
//      traps, never a hang), then h into shared memory;
//   5. barrier 1; warp w takes the block's columns w, w + 8, ...: warp_dots over the staged rows
//      and h (the linear's bytes: warp_dots is the split entry's order too).
// So the output equals the three launches' byte for byte, which bench_layer_tma.py checks.
// Before the grid barrier the block also asks L2 for its share of `next_bytes` at `next` (when
// given): the next launch's weights (attn_tma.cu says why).
// One row (batch 1); bf16 weights and activations. Defines: ACT_BF16, WEIGHT_BF16,
// K_BLOCK=256, ACROSS_SEQUENTIAL, H_BLOCK=256; for the experiment's variants TMA_COPY_LATE
// (the bulk copies issued after the wait, not before) and PHASE_TRACE (phase.cuh's marks).
#include "norm.cu"
#include "persistent.cuh"

#define MLP_NT 256  // threads a block: eight warps

// s = x + r, y = rmsnorm(s) w, h = swiglu(y wgᵀ, y wuᵀ), out = h wdᵀ; one row. hbuf (inter
// values) and sync (two words, zero before the first launch, left so) are the launch's scratch.
extern "C" __global__ void __launch_bounds__(MLP_NT, 1)
metrale_mlp_tma(const act_t* __restrict__ x, const act_t* __restrict__ r,
                const __nv_bfloat16* __restrict__ wn, act_t* __restrict__ s,
                const __nv_bfloat16* __restrict__ wg, const __nv_bfloat16* __restrict__ wu,
                const __nv_bfloat16* __restrict__ wd, act_t* __restrict__ out, act_t* hbuf,
                unsigned* sync, int hidden, int inter, float eps, const unsigned char* next,
                long long next_bytes) {
    extern __shared__ __align__(128) unsigned char mlp_smem[];
    const int b = blockIdx.x, G = gridDim.x;
    const Share pairs(inter, b, G), cols(hidden, b, G);
    const int p0 = pairs.first, np = pairs.count, c0 = cols.first, nc = cols.count;
    const int maxp = (inter + G - 1) / G, maxc = (hidden + G - 1) / G;
    // shared memory: gate rows, up rows, down rows (each at its largest share), y, h, s (blocks
    // other than 0 store their copy of s here), two barriers
    __nv_bfloat16* sg = (__nv_bfloat16*)mlp_smem;
    __nv_bfloat16* su = sg + (long)maxp * hidden;
    __nv_bfloat16* sd = su + (long)maxp * hidden;
    act_t* y = (act_t*)(sd + (long)maxc * inter);
    act_t* h = y + hidden;
    act_t* s_own = h + inter;
    uint64_t* bars = (uint64_t*)(s_own + hidden);
    const unsigned need = (unsigned)((char*)(bars + 2) - (char*)mlp_smem);
    if (blockDim.x != MLP_NT || dynamic_smem_bytes() < need || !row_norm_fits(hidden) ||
        (inter & 7))
        __trap();
    phase_mark(0);
    auto stage = [&] {
        if (threadIdx.x != 0) return;
        tx_init(&bars[0]);
        tx_init(&bars[1]);
        const unsigned gu = (unsigned)np * hidden * 2, dn = (unsigned)nc * inter * 2;
        tx_expect(&bars[0], 2 * gu);
        bulk_copy(sg, wg + (long)p0 * hidden, gu, &bars[0]);
        bulk_copy(su, wu + (long)p0 * hidden, gu, &bars[0]);
        tx_expect(&bars[1], dn);
        bulk_copy(sd, wd + (long)c0 * inter, dn, &bars[1]);
    };
    stage_wait_norm(stage, x, r, wn, s, s_own, y, hidden, eps);
    phase_mark(3);
    tx_wait(&bars[0]);
    phase_mark(4);
    const __nv_bfloat16* gate_up_rows[2] = {sg, su};
    staged_dots<2>(y, gate_up_rows, hidden, np, [&](int p, const float (&gu)[2]) {
        hbuf[p0 + p] = act_store(silu_mul(act_round(gu[0]), act_round(gu[1])));
    });
    phase_mark(5);
    l2_prefetch_share(next, next_bytes, b, G);  // the next launch's weights, while down runs
    grid_meet(sync);
    phase_mark(6);
    shared_from_l2(h, hbuf, inter);
    __syncthreads();
    tx_wait(&bars[1]);
    phase_mark(7);
    const __nv_bfloat16* down_rows[1] = {sd};
    staged_dots<1>(h, down_rows, inter, nc, [&](int c, const float (&d)[1]) {
        out[c0 + c] = act_store(d[0]);
    });
    __syncthreads();
    phase_mark(8);
}

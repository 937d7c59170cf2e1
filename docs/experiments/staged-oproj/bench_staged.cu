// Microbenchmark: o_proj with its weights staged into shared memory while attention runs.
// A layer's attention tail in the step is: decode attention (spin stand-in) -> merge (spin
// stand-in) -> o_proj -> add_rmsnorm (spin stand-in), all dependent launches in one CUDA graph,
// LAYERS layers on distinct weights. o_proj is gemv.cu's metrale_linear_add (the real kernel)
// or staged_linear_add below, which copies whole weight rows into per-warp shared slots with
// cp.async before its dependent-launch wait. Outputs are compared byte for byte (poisoned first).
// Build: nvcc -O3 -arch=sm_90a -std=c++17 -I kernels/cuda/common -DACT_BF16 -DWEIGHT_BF16
//        -DK_BLOCK=256 -DACROSS_SEQUENTIAL bench_staged.cu -o bench_staged
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include "gemv.cu"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1); } } while (0)

__device__ __forceinline__ unsigned long long gtimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void spin_ns(long ns) {
    const unsigned long long t0 = gtimer();
    while ((long)(gtimer() - t0) < ns) {}
}

// decode attention stand-in: its resources (256 threads, SMEM_ATT bytes, 2 a SM), release after
// its wait, then SPIN ns of work
extern "C" __global__ void __launch_bounds__(256, 2) attn_standin(int* sink, long ns) {
    extern __shared__ __align__(16) char sm_a[];
    grid_dependency_sync();
    spin_ns(ns);
    if (threadIdx.x == 0) { sm_a[0] = 1; __syncwarp(); sink[blockIdx.x] = sm_a[0]; }
}
// merge stand-in: 128 threads; release first (early) or only by ending
template <bool EARLY>
__global__ void __launch_bounds__(128) merge_standin(int* sink, long ns) {
    extern __shared__ __align__(16) char sm_m[];
#if __CUDA_ARCH__ >= 900
    if (EARLY) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    spin_ns(ns);
    if (threadIdx.x == 0) { sm_m[0] = 2; __syncwarp(); sink[blockIdx.x] = sm_m[0]; }
}
// norm stand-in: one block
extern "C" __global__ void __launch_bounds__(256) norm_standin(int* sink, long ns) {
    grid_dependency_sync();
    spin_ns(ns);
    if (threadIdx.x == 0) sink[0] = 3;
}

__device__ __forceinline__ void cpa16(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cpa_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cpa_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// y = round(round(x · wᵀ) + r), bf16 weights; warp gw of the grid takes columns gw, gw + nw, ...;
// each warp owns SLOTS shared slots of one weight row (k bf16); its first SLOTS rows are copied
// before the wait. The dot is gemv.cu's warp_dots over a WeightRef into shared memory.
template <int SW, int SLOTS>
__global__ void __launch_bounds__(32 * SW, 1)
staged_linear_add(const act_t* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                  const act_t* __restrict__ r, act_t* __restrict__ y, int rows, int k, int n) {
    extern __shared__ __align__(16) char sm_s[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gw = blockIdx.x * SW + warp, nw = gridDim.x * SW;
    const int row0 = blockIdx.y * ROWS_PER_WARP, nr = min(ROWS_PER_WARP, rows - row0);
    const int rb = k * 2;
    char* slots = sm_s + (long)warp * SLOTS * rb;
    auto issue = [&](int i) {
        const int col = gw + i * nw;
        if (col < n) {
            const char* src = (const char*)(w + (long)col * k);
            char* dst = slots + (i % SLOTS) * rb;
            for (int at = lane * 16; at < rb; at += 512) cpa16(dst + at, src + at);
        }
        cpa_commit();
    };
#pragma unroll
    for (int i = 0; i < SLOTS; ++i) issue(i);
    grid_dependency_sync();
    for (int i = 0; gw + i * nw < n; ++i) {
        cpa_wait<SLOTS - 1>();
        __syncwarp();
        const WeightRef ws[1] = {weight_ref(slots + (i % SLOTS) * rb, nullptr, nullptr)};
        float d[1];
        warp_dots_rows<1, ROWS_PER_WARP>(x + (long)row0 * k, nr, ws, k, d);
        __syncwarp();
        issue(i + SLOTS);
        const int col = gw + i * nw;
        if (lane < nr) {
            const long o = (long)(row0 + lane) * n + col;
            y[o] = act_store(act_round(d[0]) + act_load(r[o]));
        }
    }
}

struct Shape { const char* name; int k, n, attn_blocks, merge_blocks, attn_smem, merge_smem, layers; long attn_ns, merge_ns; bool chain; };

static void launch(cudaStream_t s, const void* fn, dim3 g, dim3 b, size_t smem, void** args, bool pdl) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = g; cfg.blockDim = b; cfg.dynamicSmemBytes = smem; cfg.stream = s;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at; cfg.numAttrs = pdl ? 1 : 0;
    CK(cudaLaunchKernelExC(&cfg, fn, args));
}

int main(int argc, char** argv) {
    const int reps = 30;
    Shape shapes[] = {
        {"llama-3.1-8b", 4096, 4096, 128, 32, 87 * 1024, 18 * 1024, 32, 5000, 2000, true},
        {"qwen3-0.6b", 2048, 1024, 128, 16, 87 * 1024, 18 * 1024, 28, 5000, 2000, true},
        {"llama-3.1-8b-qkv", 4096, 6144, 0, 0, 0, 0, 32, 0, 0, false},
        {"llama-3.1-8b-down", 14336, 4096, 0, 0, 0, 0, 16, 0, 0, false},
        {"qwen3-0.6b-down", 3072, 1024, 0, 0, 0, 0, 28, 0, 0, false},
    };
    int* sink; CK(cudaMalloc(&sink, 1 << 16));
    CK(cudaFuncSetAttribute((const void*)attn_standin, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024));
    CK(cudaFuncSetAttribute((const void*)merge_standin<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 48 * 1024));
    CK(cudaFuncSetAttribute((const void*)merge_standin<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 48 * 1024));
    struct Var { const char* name; const void* fn; int sw, slots; };
    Var vars[] = {
        {"w8s1", (const void*)staged_linear_add<8, 1>, 8, 1},
        {"w8s2", (const void*)staged_linear_add<8, 2>, 8, 2},
        {"w12s1", (const void*)staged_linear_add<12, 1>, 12, 1},
        {"w16s1", (const void*)staged_linear_add<16, 1>, 16, 1},
        {"w4s3", (const void*)staged_linear_add<4, 3>, 4, 3},
        {"w4s1", (const void*)staged_linear_add<4, 1>, 4, 1},
        {"w6s1", (const void*)staged_linear_add<6, 1>, 6, 1},
    };
    for (auto& v : vars) CK(cudaFuncSetAttribute(v.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
    printf("{\"results\": [\n");
    bool first_line = true;
    for (const Shape& S : shapes) {
        for (int rows : {1, 8}) {
        const long wel = (long)S.k * S.n;
        __nv_bfloat16 *w, *x, *r, *y, *y2;
        CK(cudaMalloc(&w, wel * 2 * S.layers));
        CK(cudaMalloc(&x, (long)S.k * 2 * rows)); CK(cudaMalloc(&r, (long)S.n * 2 * rows));
        CK(cudaMalloc(&y, (long)S.n * 2 * rows)); CK(cudaMalloc(&y2, (long)S.n * 2 * rows));
        {   // random bf16 values in [-1, 1)
            std::vector<__nv_bfloat16> h(std::max(wel, (long)S.k * rows));
            unsigned s = 12345u;
            for (auto& e : h) { s = s * 1664525u + 1013904223u; e = __float2bfloat16(((s >> 8) & 0xffff) / 32768.0f - 1.0f); }
            for (int l = 0; l < S.layers; ++l) CK(cudaMemcpy(w + l * wel, h.data(), wel * 2, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(x, h.data() + 7, (long)S.k * 2 * rows, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(r, h.data() + 99, (long)S.n * 2 * rows, cudaMemcpyHostToDevice));
        }
        cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        // o_proj: 0 none, 1 gemv.cu, 2+ staged variant vars[o - 2]
        auto build = [&](int o, bool early, bool with_attn, size_t stage_smem, int grid_o) {
            cudaGraph_t g; cudaGraphExec_t ge;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            int rws = rows;
            int k = S.k, n = S.n;
            for (int l = 0; l < S.layers; ++l) {
                if (with_attn) {
                    long ans = S.attn_ns, mns = S.merge_ns;
                    void* aa[] = {&sink, &ans};
                    launch(st, (const void*)attn_standin, dim3(S.attn_blocks, rows), dim3(256), S.attn_smem, aa, true);
                    void* ma[] = {&sink, &mns};
                    launch(st, early ? (const void*)merge_standin<true> : (const void*)merge_standin<false>,
                           dim3(S.merge_blocks, rows), dim3(128), S.merge_smem, ma, true);
                }
                __nv_bfloat16* wl = w + l * wel;
                if (o == 1) {
                    const void* nul = nullptr;
                    void* la[] = {&x, &wl, &nul, &nul, &r, &y, &rws, &k, &n};
                    launch(st, (const void*)metrale_linear_add, dim3((n + 3) / 4, (rows + 7) / 8), dim3(128), 0, la, true);
                } else if (o >= 2) {
                    const Var& v = vars[o - 2];
                    void* la[] = {&x, &wl, &r, &y, &rws, &k, &n};
                    launch(st, v.fn, dim3(grid_o, (rows + 7) / 8), dim3(32 * v.sw), stage_smem, la, true);
                }
                if (with_attn) {
                    long nns = 700;
                    void* na[] = {&sink, &nns};
                    launch(st, (const void*)norm_standin, dim3(1), dim3(256), 0, na, true);
                }
            }
            CK(cudaStreamEndCapture(st, &g));
            CK(cudaGraphInstantiate(&ge, g, 0));
            CK(cudaGraphDestroy(g));
            return ge;
        };
        auto time_graph = [&](cudaGraphExec_t ge) {
            cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
            for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, st));
            std::vector<float> ms;
            for (int i = 0; i < reps; ++i) {
                CK(cudaEventRecord(a, st)); CK(cudaGraphLaunch(ge, st)); CK(cudaEventRecord(b, st));
                CK(cudaEventSynchronize(b));
                float t; CK(cudaEventElapsedTime(&t, a, b)); ms.push_back(t);
            }
            std::sort(ms.begin(), ms.end());
            return ms[ms.size() / 2] * 1000.0 / S.layers;  // us a layer
        };
        auto emit = [&](const char* var, bool early, bool attn, double us, int same) {
            printf("%s  {\"shape\": \"%s\", \"rows\": %d, \"variant\": \"%s\", \"merge_release\": \"%s\", \"with_attention\": %s, \"us_per_layer\": %.3f, \"same_bytes\": %d}",
                   first_line ? "" : ",\n", S.name, rows, var, early ? "first" : "end", attn ? "true" : "false", us, same);
            first_line = false;
            fflush(stdout);
        };
        // reference output: gemv.cu alone
        CK(cudaMemset(y, 0xff, (long)S.n * 2 * rows));
        cudaGraphExec_t ref = build(1, false, false, 0, 0);
        CK(cudaGraphLaunch(ref, st)); CK(cudaStreamSynchronize(st));
        std::vector<char> hy((long)S.n * 2 * rows), hy2(hy.size());
        CK(cudaMemcpy(hy.data(), y, hy.size(), cudaMemcpyDeviceToHost));
        emit("gemv", false, false, time_graph(ref), 1);
        CK(cudaGraphExecDestroy(ref));
        for (bool early : {false, true}) {
            if (!S.chain) break;
            cudaGraphExec_t g0 = build(0, early, true, 0, 0);
            emit("none", early, true, time_graph(g0), 1); CK(cudaGraphExecDestroy(g0));
            cudaGraphExec_t g1 = build(1, early, true, 0, 0);
            emit("gemv", early, true, time_graph(g1), 1); CK(cudaGraphExecDestroy(g1));
        }
        for (int vi = 0; vi < (int)(sizeof(vars) / sizeof(vars[0])); ++vi) {
            const Var& v = vars[vi];
            const size_t smem = (size_t)v.sw * v.slots * S.k * 2;
            if (smem > 227 * 1024) continue;
            const int grid_o = std::min((S.n + v.sw - 1) / v.sw, 128);
            for (int mode = 0; mode < (S.chain ? 3 : 1); ++mode) {  // alone, merge ends, merge first
                const bool attn = mode > 0, early = mode == 2;
                CK(cudaMemset(y, 0xff, (long)S.n * 2 * rows));
                cudaGraphExec_t g = build(vi + 2, early, attn, smem, grid_o);
                CK(cudaGraphLaunch(g, st)); CK(cudaStreamSynchronize(st));
                CK(cudaMemcpy(hy2.data(), y, hy2.size(), cudaMemcpyDeviceToHost));
                const int same = memcmp(hy.data(), hy2.data(), hy.size()) == 0;
                char name[64]; snprintf(name, sizeof name, "%s_grid%d_smem%zuK", v.name, grid_o, smem / 1024);
                emit(name, early, attn, time_graph(g), same);
                CK(cudaGraphExecDestroy(g));
            }
        }
        CK(cudaFree(w)); CK(cudaFree(x)); CK(cudaFree(r)); CK(cudaFree(y)); CK(cudaFree(y2));
        CK(cudaStreamDestroy(st));
        }
    }
    printf("\n]}\n");
    return 0;
}

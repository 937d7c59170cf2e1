// gemm.cu's entries on the host, through simt.hpp: simt_launch runs one of them over a grid with
// its arguments as the driver would pass them (an array of pointers to the argument values).
#include "simt.hpp"

#include "gemm.cu"

#include <cstring>
#include <string>

alignas(16) unsigned char smem_raw[simt::SMEM_BYTES];

void simt::launch(dim3 grid, int threads, int shared, const std::function<void()>& kernel) {
    if (threads > MAX_THREADS || threads % 32 || shared > SMEM_BYTES) std::abort();
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                std::memset(smem_raw, 0xFF, SMEM_BYTES);
                Block blk(threads);
                std::vector<std::thread> pool;
                for (int t = 0; t < threads; ++t)
                    pool.emplace_back([&, t] {
                        thread_idx = {(unsigned)t, 0, 0};
                        block_idx = {x, y, z};
                        block_dim = {(unsigned)threads, 1, 1};
                        block = &blk;
                        committed.clear();
                        open_group.clear();
                        kernel();
                    });
                for (auto& th : pool) th.join();
            }
}

template <class T>
static T arg(void** args, int i) {
    T v;
    std::memcpy(&v, args[i], sizeof v);
    return v;
}
#define P(i) arg<void*>(args, i)
#define I(i) arg<int>(args, i)

// 0 when `entry` ran, 1 when this build has no such entry.
extern "C" int simt_launch(const char* entry, int gx, int gy, int gz, int threads, int shared,
                           void** args) {
    const std::string e(entry);
    std::function<void()> k;
    if (e == "metrale_linear_mma")
        k = [&] {
            metrale_linear_mma((const act_t*)P(0), P(1), P(2), (const float*)P(3), (out_t*)P(4),
                               I(5), I(6), I(7));
        };
    else if (e == "metrale_linear_add_mma")
        k = [&] {
            metrale_linear_add_mma((const act_t*)P(0), P(1), P(2), (const float*)P(3),
                                   (const act_t*)P(4), (act_t*)P(5), I(6), I(7), I(8));
        };
    else if (e == "metrale_qkv_mma")
        k = [&] {
            metrale_qkv_mma((const act_t*)P(0), P(1), P(2), (const float*)P(3), P(4), P(5),
                            (const float*)P(6), P(7), P(8), (const float*)P(9), (act_t*)P(10),
                            (act_t*)P(11), (act_t*)P(12), I(13), I(14), I(15), I(16), I(17));
        };
    else if (e == "metrale_gate_up_swiglu_mma")
        k = [&] {
            metrale_gate_up_swiglu_mma((const act_t*)P(0), P(1), P(2), (const float*)P(3), P(4),
                                       P(5), (const float*)P(6), (act_t*)P(7), I(8), I(9), I(10));
        };
    else
        return 1;
    simt::launch(dim3(gx, gy, gz), threads, shared, k);
    return 0;
}

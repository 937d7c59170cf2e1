// The emulation's launch and its inline PTX (simt.hpp says what is emulated and how).
#include "simt.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace simt {

alignas(16) static unsigned char arena[SMEM_BYTES];

unsigned char* dynamic_smem() { return arena; }

static float bf16_at(uint32_t word, int half) {
    const uint16_t bits = (uint16_t)(word >> (16 * half));
    __nv_bfloat16 v;
    std::memcpy(&v, &bits, 2);
    return __bfloat162float(v);
}

static void land(const std::vector<Copy>& group) {
    for (const Copy& c : group) {
        std::memset(arena + c.dst, 0, 16);
        if (c.bytes) std::memcpy(arena + c.dst, c.src, c.bytes);
    }
}

static void wait_groups(size_t pending) {
    while (committed.size() > pending) {
        land(committed.front());
        committed.erase(committed.begin());
    }
}

static void commit() {
    committed.push_back(std::move(open_group));
    open_group.clear();
}

template <class T>
static T as(uint64_t bits) {
    T v;
    std::memcpy(&v, &bits, sizeof(T));
    return v;
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16: lane i gives the address of row i % 8 of matrix i / 8;
// lane l receives, from each matrix j, the two 16-bit values of row l / 4 at columns 2 (l % 4).
static void ldmatrix_x4(const std::initializer_list<Out>& outs, size_t addr) {
    Warp& w = warp();
    const int l = lane();
    w.slot[l] = addr;
    meet(w.meet);
    for (int j = 0; j < 4; ++j)
        std::memcpy(outs.begin()[j].p, arena + w.slot[8 * j + l / 4] + 4 * (l % 4), 4);
    meet(w.meet);
}

// The same with .trans: lane l receives, from each matrix j, the 16-bit values at rows 2 (l % 4)
// and 2 (l % 4) + 1 of column l / 4.
static void ldmatrix_x4_trans(const std::initializer_list<Out>& outs, size_t addr) {
    Warp& w = warp();
    const int l = lane();
    w.slot[l] = addr;
    meet(w.meet);
    for (int j = 0; j < 4; ++j) {
        uint16_t half[2];
        for (int h = 0; h < 2; ++h)
            std::memcpy(&half[h], arena + w.slot[8 * j + 2 * (l % 4) + h] + 2 * (l / 4), 2);
        std::memcpy(outs.begin()[j].p, half, 4);
    }
    meet(w.meet);
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, d = a b + c, with the PTX ISA's fragment
// layouts (groupID g = lane / 4, threadID_in_group t = lane % 4): A's register i holds row
// g + 8 (i % 2), columns 2 t + 8 (i / 2) + {0, 1}; B's register i holds k rows 2 t + 8 i + {0, 1}
// of column g; C and D hold row g + 8 (e / 2), column 2 t + e % 2 in element e.
static void mma_bf16(const std::initializer_list<Out>& outs, const uint64_t* in) {
    Warp& w = warp();
    const int l = lane();
    for (int i = 0; i < 4; ++i) w.a[l][i] = (uint32_t)in[i];
    w.b[l][0] = (uint32_t)in[4];
    w.b[l][1] = (uint32_t)in[5];
    meet(w.meet);
    auto A = [&](int row, int k) {
        return bf16_at(w.a[4 * (row % 8) + (k % 8) / 2][row / 8 + 2 * (k / 8)], k % 2);
    };
    auto B = [&](int k, int col) { return bf16_at(w.b[4 * col + (k % 8) / 2][k / 8], k % 2); };
    const int g = l / 4, t = l % 4;
    float d[4];
    for (int e = 0; e < 4; ++e) {
        const int row = g + 8 * (e / 2), col = 2 * t + e % 2;
        double s = 0.0;
        for (int k = 0; k < 16; ++k) s += (double)A(row, k) * (double)B(k, col);
        float c;
        std::memcpy(&c, outs.begin()[e].p, 4);  // "+f": the accumulator in, the result out
        d[e] = (float)(s + (double)c);
    }
    meet(w.meet);
    for (int e = 0; e < 4; ++e) std::memcpy(outs.begin()[e].p, &d[e], 4);
}

// What the hardware faults on, checked: a cp.async or ldmatrix address that is not 16-byte
// aligned (global source or shared row), or shared bytes past the launch's dynamic size.
static void fault(const char* what, const char* tmpl) {
    std::fprintf(stderr, "simt: %s in \"%s\" (thread %u of block %u,%u,%u)\n", what, tmpl,
                 thread_idx.x, block_idx.x, block_idx.y, block_idx.z);
    throw Trap{};
}
static void shared_row(size_t at, const char* tmpl) {
    if (at % 16) fault("shared address not 16-byte aligned", tmpl);
    if (at + 16 > dynamic_bytes) fault("shared address past the launch's dynamic size", tmpl);
}
static void global_row(const void* p, const char* tmpl) {
    if ((uintptr_t)p % 16) fault("global address not 16-byte aligned", tmpl);
}

}  // namespace simt

void simt::asm_stmt(const char* tmpl, std::initializer_list<Out> outs,
                    std::initializer_list<uint64_t> ins) {
    const std::string t(tmpl);
    const uint64_t* in = ins.begin();
    if (t == "prefetch.global.L2 [%0];" || t.rfind("griddepcontrol.", 0) == 0) return;
    if (t == "mov.u32 %0, %%dynamic_smem_size;") {
        std::memcpy(outs.begin()[0].p, &dynamic_bytes, 4);
    } else if (t == "cp.async.cg.shared.global [%0], [%1], 16;" ||
               t == "cp.async.cg.shared.global [%0], [%1], 16, %2;") {
        const size_t dst = (uint32_t)in[0];
        const int bytes = ins.size() > 2 ? (int)in[2] : 16;
        shared_row(dst, tmpl);
        if (bytes) global_row(as<const void*>(in[1]), tmpl);
        open_group.push_back({dst, as<const void*>(in[1]), bytes});
    } else if (t == "cp.async.commit_group;") {
        commit();
    } else if (t == "cp.async.wait_group %0;") {
        wait_groups((size_t)in[0] + METRALE_SIMT_WAIT_SLACK);
    } else if (t == "cp.async.commit_group;\n\tcp.async.wait_all;") {
        commit();
        wait_groups(0);
    } else if (t == "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];") {
        shared_row((uint32_t)in[0], tmpl);
        ldmatrix_x4(outs, (size_t)(uint32_t)in[0]);
    } else if (t == "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];") {
        shared_row((uint32_t)in[0], tmpl);
        ldmatrix_x4_trans(outs, (size_t)(uint32_t)in[0]);
    } else if (t == "ld.global.nc.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];" ||
               t == "ld.global.nc.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];") {
        global_row(as<const void*>(in[0]), tmpl);  // the L2 fetch size is only a hint
        for (int e = 0; e < 4; ++e)
            std::memcpy(outs.begin()[e].p, as<const char*>(in[0]) + 4 * e, 4);
    } else if (t.rfind("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 ", 0) == 0) {
        mma_bf16(outs, in);
    } else {
        std::fprintf(stderr, "simt: no emulation of the PTX \"%s\"\n", tmpl);
        throw Trap{};
    }
}

// Whether a block wrote shared memory past the launch's dynamic size (plain stores are not
// checked as they happen; the bytes past it stay 0xFF from the poison unless one did). Compared
// a page at a time against a page of 0xFF, so the check costs what poisoning those bytes did.
static bool wrote_past(unsigned shared) {
    static const std::vector<unsigned char> poison(4096, 0xFF);
    const size_t end = simt::SMEM_BYTES;
    for (size_t at = shared; at < end; at += poison.size()) {
        const size_t n = std::min(poison.size(), end - at);
        if (std::memcmp(simt::arena + at, poison.data(), n) == 0) continue;
        for (size_t i = at; i < at + n; ++i)
            if (simt::arena[i] != 0xFF) {
                std::fprintf(stderr, "simt: block wrote shared byte %zu, past the launch's "
                             "dynamic size %u\n", i, shared);
                break;
            }
        return true;
    }
    return false;
}

// Run fn(args) over a (gx, gy, gz) grid of (bx, by, bz) blocks with `shared` bytes of dynamic
// shared memory: one OS thread per thread of a block, the same threads for every block, which
// meet between blocks while thread 0 checks that the last block wrote nothing past the dynamic
// size, poisons shared memory and sets up the next block's barriers. Blocks run one at a time,
// the last first: a GPU gives no order, and the hardware's tends to be the grid's, so a kernel
// that reads what a later block writes (a race on the device) sees it unwritten here. 0: done;
// 1: a launch the GPU would refuse; 2: a thread trapped or a block wrote past its shared memory.
extern "C" int simt_run(void (*fn)(void**), void** args, int gx, int gy, int gz, int bx, int by,
                        int bz, int shared) {
    const int threads = bx * by * bz;
    if (by != 1 || bz != 1 || threads > simt::MAX_THREADS || threads % 32 ||
        shared > simt::SMEM_BYTES || gx < 1 || gy < 1 || gz < 1)
        return 1;
    simt::trapped = 0;
    std::barrier<> between(threads);
    std::unique_ptr<simt::Block> current;
    const long blocks = (long)gx * gy * gz;
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (int t = 0; t < threads; ++t)
        pool.emplace_back([&, t] {
            simt::thread_idx = {(unsigned)t, 0, 0};
            simt::block_dim = {(unsigned)threads, 1, 1};
            simt::grid_dim = {(unsigned)gx, (unsigned)gy, (unsigned)gz};
            simt::dynamic_bytes = (unsigned)shared;
            for (long b = 0; b < blocks; ++b) {
                between.arrive_and_wait();  // every thread is done with the previous block
                if (t == 0) {
                    if (b > 0 && wrote_past((unsigned)shared))
                        __atomic_store_n(&simt::trapped, 1, __ATOMIC_SEQ_CST);
                    // the launch's bytes poisoned again; those past it were checked unchanged
                    std::memset(simt::arena, 0xFF, b > 0 ? (size_t)shared : simt::SMEM_BYTES);
                    current = std::make_unique<simt::Block>(threads);
                }
                between.arrive_and_wait();
                if (__atomic_load_n(&simt::trapped, __ATOMIC_SEQ_CST)) return;
                const long id = blocks - 1 - b;  // last block first (see above)
                simt::block_idx = {(unsigned)(id % gx), (unsigned)(id / gx % gy),
                                   (unsigned)(id / ((long)gx * gy))};
                simt::block = current.get();
                simt::committed.clear();
                simt::open_group.clear();
                try {
                    fn(args);
                } catch (const simt::Trap&) {
                    __atomic_store_n(&simt::trapped, 1, __ATOMIC_SEQ_CST);
                }
                current->warps[t / 32].meet.arrive_and_drop();
                current->sync.arrive_and_drop();
            }
        });
    for (auto& th : pool) th.join();
    if (!simt::trapped && wrote_past((unsigned)shared)) simt::trapped = 1;
    return simt::trapped ? 2 : 0;
}

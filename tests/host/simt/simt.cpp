// The emulation's launch and its inline PTX (simt.hpp says what is emulated and how).
#include "simt.hpp"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace simt {

// the dynamic shared memory of blocks run one after another (a resident launch gives each its own)
alignas(16) static unsigned char arena[SMEM_BYTES];

static unsigned char* smem() { return block->smem; }

static float bf16_at(uint32_t word, int half) {
    const uint16_t bits = (uint16_t)(word >> (16 * half));
    __nv_bfloat16 v;
    std::memcpy(&v, &bits, 2);
    return __bfloat162float(v);
}

static void land(const std::vector<Copy>& group) {
    for (const Copy& c : group) {
        std::memset(smem() + c.dst, 0, 16);
        if (c.bytes) std::memcpy(smem() + c.dst, c.taken ? c.early : c.src, c.bytes);
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
        std::memcpy(outs.begin()[j].p, smem() + w.slot[8 * j + l / 4] + 4 * (l % 4), 4);
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
            std::memcpy(&half[h], smem() + w.slot[8 * j + 2 * (l % 4) + h] + 2 * (l / 4), 2);
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

// A shared-memory matrix descriptor of wgmma (K-major operands): bits 0-13 the start address
// / 16, bits 32-45 the stride between 8-row groups / 16, bits 62-63 the swizzle (1: 128 bytes,
// rows 128 bytes apart). The 128-byte swizzle exchanges address bits 4-6 (the 16-byte piece of a
// row) with bits 7-9 (the row within its 1024-byte group) by exclusive or, on the address
// itself: so a group must start 1024-byte aligned, which the base-offset bits (49-51, here 0)
// assume. Other layouts are refused.
static void fault(const char* what, const char* tmpl);

//
// An N-major operand (imm-trans-b 1) has its 128-byte rows along N: element (n, k) lies in the
// 1024-byte group of k / 8, SBO apart, at row k % 8 and byte 2 (n % 64) of it, and each 64
// further n in another such column of groups, LBO (bits 16-29, / 16) apart.
static float desc_bf16(uint64_t desc, int row, int k, const char* tmpl, bool n_major = false) {
    const size_t start = (desc & 0x3FFF) << 4, sbo = ((desc >> 32) & 0x3FFF) << 4,
                 lbo = ((desc >> 16) & 0x3FFF) << 4;
    if (desc >> 62 != 1 || ((desc >> 49) & 7))
        fault("a wgmma descriptor other than 128-byte swizzle", tmpl);
    size_t at = n_major ? start + (size_t)(k / 8) * sbo + (size_t)(k % 8) * 128 +
                              (size_t)(row / 64) * lbo + 2 * (size_t)(row % 64)
                        : start + (size_t)(row / 8) * sbo + (size_t)(row % 8) * 128 + 2 * (size_t)k;
#if !METRALE_SIMT_NO_SWIZZLE
    at ^= ((at >> 7) & 7) << 4;
#endif
    if (at + 2 > dynamic_bytes) fault("wgmma operand past the launch's dynamic size", tmpl);
    uint16_t bits;
    std::memcpy(&bits, smem() + at, 2);
    __nv_bfloat16 v;
    std::memcpy(&v, &bits, 2);
    return __bfloat162float(v);
}

// wgmma.mma_async m64nNk16 f32 += bf16 bf16, A K-major (from shared memory or the registers),
// B K-major or N-major, as the thread's accumulator fragment: warp w of the warpgroup holds rows
// 16 w + g + 8 (e / 2) of n8 tile j, columns 8 j + 2 t + e % 2, in register 4 j + e (g = lane / 4,
// t = lane % 4): mma.sync's C layout, repeated. Products summed in double, the accumulator
// added, one rounding to f32.
static void wgmma_complete(const Wgmma& m) {
    const int w = (int)(thread_idx.x % 128) / 32, g = lane() / 4, t = lane() % 4;
    const char* tmpl = "wgmma.mma_async";
    for (int i = 0; i < m.n / 2; ++i) {
        const int j = i / 4, e = i % 4;
        const int row = 16 * w + g + 8 * (e / 2), col = 8 * j + 2 * t + e % 2;
        double s = 0.0;
        for (int k = 0; k < 16; ++k)
            s += (double)(m.a_regs ? m.a_rows[row % 16][k] : desc_bf16(m.a, row, k, tmpl)) *
                 (double)desc_bf16(m.b, col, k, tmpl, m.b_n_major);
        const float d = m.add ? (float)(s + (double)*m.d[i]) : (float)s;
        *m.d[i] = d;
    }
}

// The immediates closing a wgmma's template (after its last %operand and the scale-d
// predicate): "..., p, 1, 1, 0, 1;" gives {1, 1, 0, 1}.
static std::vector<int> wgmma_immediates(const std::string& t, const char* tmpl) {
    const size_t p = t.find(", p, ");
    if (p == std::string::npos) fault("a wgmma without its scale-d predicate p", tmpl);
    std::vector<int> out;
    for (size_t at = p + 5; at < t.size() && std::isdigit((unsigned char)t[at]);) {
        out.push_back(t[at] - '0');
        at += t[at + 1] == ',' ? 3 : 1;
    }
    return out;
}

// A register-form wgmma's A, as each warp holds it (mma.sync's A fragment: register i of lane
// l holds row l / 4 + 8 (i % 2), columns 2 (l % 4) + 8 (i / 2) + {0, 1}), taken at the issue:
// the warp's lanes post their registers, meet, and each keeps all 16 rows of its warp.
static void wgmma_take_rows(Wgmma& m, const uint64_t* in) {
    Warp& w = warp();
    const int l = lane();
    for (int i = 0; i < 4; ++i) w.a[l][i] = (uint32_t)in[i];
    meet(w.meet);
    for (int row = 0; row < 16; ++row)
        for (int k = 0; k < 16; ++k)
            m.a_rows[row][k] =
                bf16_at(w.a[4 * (row % 8) + (k % 8) / 2][row / 8 + 2 * (k / 8)], k % 2);
    meet(w.meet);
}

static void wgmma_wait(size_t pending) {
    while (wgmma_committed.size() > pending) {
        for (const Wgmma& m : wgmma_committed.front()) wgmma_complete(m);
        wgmma_committed.erase(wgmma_committed.begin());
    }
}

// The block's transaction barrier at shared address `at` (made on first use: its init).
static TxBarrier& tx_barrier(size_t at) {
    for (auto& [a, b] : block->tx)
        if (a == at) return b;
    block->tx.emplace_back(at, TxBarrier{});
    return block->tx.back().second;
}

// A phase of the barrier completes once its expected arrivals have come and its armed bytes
// have landed; the next phase starts empty. Bytes may land before the arrival that arms them (the
// hardware's count of pending bytes goes below zero), but not past them once all have arrived.
static void tx_complete(TxBarrier& b, const char* tmpl) {
    if (b.arrived == b.expected && b.landed > b.armed)
        fault("bulk copies past the barrier's armed bytes", tmpl);
    if (b.arrived > b.expected) fault("more arrivals at a barrier than its count", tmpl);
    if (b.arrived == b.expected && b.landed == b.armed) {
        ++b.phases;
        b.arrived = b.armed = b.landed = 0;
    }
}

// A try_wait on the barrier at `at` for the phase of `parity`: its pending copies land, and the
// wait is over once the current phase's parity is no longer `parity` (as the hardware has it:
// phases alternate 0, 1, 0, ..., and a wait for parity 1 before any phase completed passes at
// once). Otherwise the thread is handed on, as its spin would be, and the wait answers false.
static bool tx_try_wait(size_t at, unsigned parity, const char* tmpl) {
    TxBarrier& b = tx_barrier(at);
    for (const BulkCopy& c : b.pending) {
        std::memcpy(smem() + c.dst, c.early.empty() ? c.src : c.early.data(), c.bytes);
        b.landed += c.bytes;
    }
    b.pending.clear();
    tx_complete(b, tmpl);
    if ((b.phases & 1) != (parity & 1)) return true;
    yield();  // the thread that arrives, or issues the copies, runs; this one spins
    if (trapped) throw Trap{};
    return false;
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
    if (t.empty()) return;  // an optimization barrier: its "+" operands keep their values
    if (t == "griddepcontrol.wait;") return dependency_wait();
    if (t == "prefetch.global.L2 [%0];" || t == "griddepcontrol.launch_dependents;") return;
    // a warpgroup's register budget: the emulation's threads have what their code declares
    if (t == "setmaxnreg.dec.sync.aligned.u32 %0;" || t == "setmaxnreg.inc.sync.aligned.u32 %0;")
        return;
    if (t == "cp.async.bulk.prefetch.L2.global [%0], %1;") {  // a hint: checked, nothing moves
        global_row(as<const void*>(in[0]), tmpl);
        if (in[1] % 16 || !in[1]) fault("bulk prefetch not in 16-byte units", tmpl);
        return;
    }
    if (t == "mov.u32 %0, %%dynamic_smem_size;") {
        std::memcpy(outs.begin()[0].p, &dynamic_bytes, 4);
    } else if (t == "ex2.approx.ftz.f32 %0, %1;") {
        // 2^x, subnormal inputs and results flushed to (signed) zero; the hardware's
        // approximation (2 ulp) is its own, as an MMA's order is
        float x, y;
        std::memcpy(&x, &in[0], 4);
        if (std::fpclassify(x) == FP_SUBNORMAL) x = std::copysign(0.0f, x);
        y = std::exp2(x);
        if (std::fpclassify(y) == FP_SUBNORMAL) y = 0.0f;
        std::memcpy(outs.begin()[0].p, &y, 4);
    } else if (t == "mov.u64 %0, %%globaltimer;") {
        if (resident) {  // a spin loop reads the clock: let the other blocks run
            yield();
            if (trapped) throw Trap{};
        }
        const uint64_t ns = (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(
            std::chrono::steady_clock::now().time_since_epoch()).count();
        std::memcpy(outs.begin()[0].p, &ns, 8);
    } else if (t == "mbarrier.init.shared::cta.b64 [%0], 1;" ||
               t == "mbarrier.init.shared::cta.b64 [%0], %1;") {
        TxBarrier& b = tx_barrier((uint32_t)in[0]);
        b = TxBarrier{};
        b.expected = ins.size() > 1 ? (unsigned)in[1] : 1u;
        if (!b.expected) fault("a barrier of no arrivals", tmpl);
    } else if (t == "mbarrier.arrive.shared::cta.b64 _, [%0];") {
        TxBarrier& b = tx_barrier((uint32_t)in[0]);
        ++b.arrived;
        ++progress;
        tx_complete(b, tmpl);
    } else if (t == "fence.mbarrier_init.release.cluster;") {
        return;  // the emulation's barriers are plain memory of the launch
    } else if (t == "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;") {
        TxBarrier& b = tx_barrier((uint32_t)in[0]);
        b.armed += (unsigned)in[1];
        ++b.arrived;
        ++progress;
        tx_complete(b, tmpl);
    } else if (t == "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], "
                    "[%1], %2, [%3];") {
        const size_t dst = (uint32_t)in[0];
        const unsigned bytes = (unsigned)in[2];
        if (dst % 16 || bytes % 16) fault("bulk copy not in 16-byte units", tmpl);
        if (dst + bytes > dynamic_bytes) fault("bulk copy past the launch's dynamic size", tmpl);
        global_row(as<const void*>(in[1]), tmpl);
        BulkCopy c{dst, as<const void*>(in[1]), bytes, {}};
        if (guarding())
            c.early.assign((const unsigned char*)c.src, (const unsigned char*)c.src + bytes);
        TxBarrier& b = tx_barrier((uint32_t)in[3]);
        if (METRALE_SIMT_BULK_EAGER) {  // lands now: a slot refilled while read shows
            std::memcpy(smem() + c.dst, c.early.empty() ? c.src : c.early.data(), c.bytes);
            b.landed += c.bytes;
            tx_complete(b, tmpl);
        } else {
            b.pending.push_back(std::move(c));
        }
    } else if (t == "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                    " [%0], [%1, {%2, %3}], [%4];") {
        // a tensor copy: the box at (column c0, row c1) of the map's array (the host's
        // encoding, runtime.host_backend.host_tensor_map), 128 bytes a box row, each 16-byte
        // piece placed by the 128-byte swizzle of its shared address (bits 4-6 ^ bits 7-9),
        // pieces outside the array zeros; it lands as a bulk copy does, piece by piece
        struct Map {
            uint64_t address, rows, cols, row_bytes;
            uint32_t box_cols, box_rows, item_bytes, magic;
        };
        Map m;
        std::memcpy(&m, as<const void*>(in[1]), sizeof m);
        if (m.magic != 0x4D455441u) fault("not a tensor map of the host's encoding", tmpl);
        const size_t dst = (uint32_t)in[0];
        const long c0 = (int)in[2], c1 = (int)in[3];
        const unsigned row_bytes = m.box_cols * m.item_bytes, bytes = row_bytes * m.box_rows;
        if (row_bytes != 128) fault("a tensor copy's box rows are not 128 bytes", tmpl);
        if (dst % 1024) fault("a swizzled tensor copy's destination is not 1024-byte aligned", tmpl);
        if (dst + bytes > dynamic_bytes) fault("tensor copy past the launch's dynamic size", tmpl);
        static const unsigned char zeros[16] = {};
        TxBarrier& b = tx_barrier((uint32_t)in[4]);
        for (unsigned r = 0; r < m.box_rows; ++r) {
            for (unsigned p = 0; p < 8; ++p) {
                const long row = c1 + r, col = c0 + (long)p * 16 / m.item_bytes;
                size_t at = dst + r * 128 + p * 16;
                at ^= ((at >> 7) & 7) << 4;
                const bool inside = row >= 0 && row < (long)m.rows && col >= 0 &&
                                    col + 16 / m.item_bytes <= (long)m.cols;
                if (!inside && row >= 0 && row < (long)m.rows && col < (long)m.cols)
                    fault("a tensor copy's piece straddles the array's last column", tmpl);
                const void* src = inside ? (const void*)(m.address + row * m.row_bytes +
                                                         col * m.item_bytes) : zeros;
                BulkCopy c{at, src, 16, {}};
                if (guarding() && inside)
                    c.early.assign((const unsigned char*)src, (const unsigned char*)src + 16);
                if (METRALE_SIMT_BULK_EAGER) {
                    std::memcpy(smem() + c.dst, c.early.empty() ? c.src : c.early.data(), 16);
                    b.landed += 16;
                } else {
                    b.pending.push_back(std::move(c));
                }
            }
        }
        if (METRALE_SIMT_BULK_EAGER) tx_complete(b, tmpl);
    } else if (t.find("mbarrier.try_wait.parity.shared::cta.b64 p, [%1], ") != std::string::npos) {
        const size_t at = t.find("[%1], ") + 6;
        const unsigned parity = t[at] == '%' ? (unsigned)in[1] : (unsigned)(t[at] - '0');
        const uint32_t done = tx_try_wait((uint32_t)in[0], parity, tmpl);
        std::memcpy(outs.begin()[0].p, &done, 4);
    } else if (t == "cp.async.cg.shared.global [%0], [%1], 16;" ||
               t == "cp.async.cg.shared.global [%0], [%1], 16, %2;") {
        const size_t dst = (uint32_t)in[0];
        const int bytes = ins.size() > 2 ? (int)in[2] : 16;
        shared_row(dst, tmpl);
        if (bytes) global_row(as<const void*>(in[1]), tmpl);
        Copy c{dst, as<const void*>(in[1]), bytes, guarding(), {}};
        if (c.taken && bytes) std::memcpy(c.early, c.src, bytes);
        open_group.push_back(c);
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
    } else if (t.find("wgmma.mma_async.sync.aligned.m64n") != std::string::npos &&
               t.find("k16.f32.bf16.bf16 ") != std::string::npos) {
        Wgmma m;
        m.n = std::atoi(t.c_str() + t.find("m64n") + 4);
        // the operands after the accumulators: A's descriptor, or its four registers (the
        // register form), B's descriptor, scale-d; then the immediates imm-scale-a, imm-scale-b,
        // (imm-trans-a, shared A only) and imm-trans-b
        m.a_regs = ins.size() == 6;
        const std::vector<int> imm = wgmma_immediates(t, tmpl);
        if (m.n % 8 || m.n < 8 || m.n > 256 || (int)outs.size() != m.n / 2 ||
            (ins.size() != 3 && !m.a_regs) || imm.size() != (m.a_regs ? 3u : 4u) ||
            imm[0] != 1 || imm[1] != 1 || (!m.a_regs && imm[2] != 0))
            fault("a wgmma shape, operand list or transpose the emulation does not know", tmpl);
        m.b_n_major = imm.back() == 1;
        int i = 0;
        for (const Out& o : outs) m.d[i++] = (float*)o.p;
        const size_t b_at = m.a_regs ? 4 : 1;
        m.a = m.a_regs ? 0 : in[0];
        m.b = in[b_at];
        m.add = in[b_at + 1] != 0;
        if (m.a_regs) wgmma_take_rows(m, in);
        wgmma_open.push_back(m);
    } else if (t == "wgmma.fence.sync.aligned;" || t == "fence.proxy.async.shared::cta;") {
        return;  // the emulation's wgmmas read shared memory as it stands at their wait
    } else if (t == "wgmma.commit_group.sync.aligned;") {
        wgmma_committed.push_back(std::move(wgmma_open));
        wgmma_open.clear();
    } else if (t == "wgmma.wait_group.sync.aligned %0;") {
        wgmma_wait((size_t)in[0]);
    } else {
        std::fprintf(stderr, "simt: no emulation of the PTX \"%s\"\n", tmpl);
        throw Trap{};
    }
}

// Whether a block wrote shared memory past the launch's dynamic size (plain stores are not
// checked as they happen; the bytes past it stay 0xFF from the poison unless one did). Compared
// a page at a time against a page of 0xFF, so the check costs what poisoning those bytes did.
static bool wrote_past(const unsigned char* arena, unsigned shared) {
    static const std::vector<unsigned char> poison(4096, 0xFF);
    const size_t end = simt::SMEM_BYTES;
    for (size_t at = shared; at < end; at += poison.size()) {
        const size_t n = std::min(poison.size(), end - at);
        if (std::memcmp(arena + at, poison.data(), n) == 0) continue;
        for (size_t i = at; i < at + n; ++i)
            if (arena[i] != 0xFF) {
                std::fprintf(stderr, "simt: block wrote shared byte %zu, past the launch's "
                             "dynamic size %u\n", i, shared);
                break;
            }
        return true;
    }
    return false;
}

// The guard's bytes as the block's wait completes: still poison (else a thread wrote them before
// its wait, and the launch traps), then the step's bytes again.
void simt::release_guarded() {
    static const std::vector<unsigned char> poison(4096, 0xFF);
    block->released = true;
    for (Guarded& g : guarded) {
        for (size_t at = 0; at < g.n && !trapped; at += poison.size()) {
            const size_t n = std::min(poison.size(), g.n - at);
            if (std::memcmp(g.p + at, poison.data(), n) == 0) continue;
            size_t i = at;
            while (g.p[i] == 0xFF) ++i;
            std::fprintf(stderr, "simt: block %u,%u,%u wrote guarded global byte %p before its "
                         "dependent-launch wait\n", block_idx.x, block_idx.y, block_idx.z,
                         (void*)(g.p + i));
            trapped = 1;
        }
        std::memcpy(g.p, g.saved.data(), g.n);
    }
}

// Guard n ranges of global bytes (ptrs[i], lens[i]) in the launches that follow; n = 0 clears.
extern "C" void simt_guard(unsigned char* const* ptrs, const size_t* lens, int n) {
    simt::guarded.clear();
    for (int i = 0; i < n; ++i) simt::guarded.push_back({ptrs[i], lens[i], {}});
}

namespace {

// A thread's saved context and the switch between two. On x86-64 the switch saves what the
// calling convention keeps across a call (rbx, rbp, r12-r15, the SSE and x87 control words) and
// swaps stacks: no system call, where swapcontext makes one to save the signal mask each time.
#if defined(__x86_64__)
extern "C" void simt_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .globl simt_switch
    .type simt_switch, @function
simt_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size simt_switch, .-simt_switch
)");

struct Context {
    void* sp = nullptr;
};

inline void jump(Context& from, Context& to) { simt_switch(&from.sp, to.sp); }

// A stack whose first switch "returns" into entry, as if entry had been called.
void prepare(Context& c, char* stack, size_t bytes, void (*entry)()) {
    auto* top = (uint64_t*)(((uintptr_t)stack + bytes) & ~(uintptr_t)15);
    uint64_t* sp = top - 9;
    std::memset(sp, 0, 9 * 8);
    top[-2] = (uint64_t)entry;  // popped by the switch's ret; top[-1] is entry's return address
    uint32_t csr = 0;
    uint16_t cw = 0;
    asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(csr), "=m"(cw));
    std::memcpy((char*)sp, &csr, 4);
    std::memcpy((char*)sp + 4, &cw, 2);
    c.sp = sp;
}
#else
struct Context {
    ucontext_t uc;
};

inline void jump(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }

void prepare(Context& c, char* stack, size_t bytes, void (*entry)()) {
    getcontext(&c.uc);
    c.uc.uc_stack = {stack, 0, bytes};
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, entry, 0);
}
#endif

// One CUDA thread: its context, and its cp.async groups while another thread runs.
struct Fiber {
    Context context;
    simt::Block* block = nullptr;
    std::vector<simt::Copy> open_group;
    std::vector<std::vector<simt::Copy>> committed;
    std::vector<simt::Wgmma> wgmma_open;
    std::vector<std::vector<simt::Wgmma>> wgmma_committed;
    bool done = false;
};

constexpr size_t STACK_BYTES = 256 * 1024;  // a thread's stack, below it one guard page
Context launcher;                           // the launch's own context, between threads
Fiber* running;
void (*kernel)(void**);
void** kernel_args;

// Each fiber runs the kernel once a block, then parks here until the next block resumes it.
void fiber_main() {
    for (;;) {
        try {
            kernel(kernel_args);
        } catch (const simt::Trap&) {
            simt::trapped = 1;
        }
        simt::drop(simt::warp().meet);
        simt::drop(simt::block->sync);
        simt::drop(simt::block->dependency, simt::guarding() ? simt::release_guarded : nullptr);
        running->done = true;
        jump(running->context, launcher);
    }
}

// Resume thread t of its block until it waits, returns or traps.
void resume(Fiber& f, int t) {
    simt::thread_idx = {(unsigned)t, 0, 0};
    simt::block = f.block;
    simt::block_idx = f.block->idx;
    running = &f;
    std::swap(simt::open_group, f.open_group);
    std::swap(simt::committed, f.committed);
    std::swap(simt::wgmma_open, f.wgmma_open);
    std::swap(simt::wgmma_committed, f.wgmma_committed);
    jump(launcher, f.context);
    std::swap(simt::open_group, f.open_group);
    std::swap(simt::committed, f.committed);
    std::swap(simt::wgmma_open, f.wgmma_open);
    std::swap(simt::wgmma_committed, f.wgmma_committed);
}

// The block's threads' stacks, each above a page that faults when a stack overflows.
struct Stacks {
    size_t each, bytes;
    char* base;
    explicit Stacks(long threads) : each(STACK_BYTES + (size_t)sysconf(_SC_PAGESIZE)) {
        bytes = each * threads;
        void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        base = p == MAP_FAILED ? nullptr : (char*)p;
        for (long t = 0; base && t < threads; ++t)
            mprotect(base + t * each, each - STACK_BYTES, PROT_NONE);
    }
    ~Stacks() {
        if (base) munmap(base, bytes);
    }
    char* stack(long t) const { return base + t * each + (each - STACK_BYTES); }
};

// Run fibers in groups of `group` (a warp, a block), each group as far as it can go before the
// next: its threads resumed in order, each until it waits, returns or traps, round after round
// until a round in which none of them arrives at a barrier or returns (all wait on other groups,
// or spin). Then the next group, and round the groups again until every thread has returned. A
// whole round of the groups with nothing done is a deadlock, which traps, or, with `patience`,
// may be a spin on the clock (a kernel's own timeout ends it): it traps once that long has
// passed with nothing done.
void run_groups(std::vector<Fiber>& fibers, int threads, int group, double patience) {
    const long groups = (long)fibers.size() / group;
    std::vector<long> alive(groups, group);
    long left = (long)fibers.size();
    auto idle_since = std::chrono::steady_clock::now();
    bool idle = false;
    while (left > 0) {
        const unsigned long cycle = simt::progress;
        for (long gi = 0; gi < groups; ++gi) {
            while (alive[gi] > 0) {
                const unsigned long before = simt::progress;
                long returned = 0;
                for (long i = gi * group; i < (gi + 1) * group; ++i) {
                    if (fibers[i].done) continue;
                    resume(fibers[i], (int)(i % threads));
                    returned += fibers[i].done;
                }
                alive[gi] -= returned;
                left -= returned;
                if (!returned && simt::progress == before) break;
            }
        }
        const auto now = std::chrono::steady_clock::now();
        if (simt::progress != cycle || simt::trapped || left == 0) {
            idle = false;
        } else if (!idle && patience > 0) {
            idle = true;
            idle_since = now;
        } else if (std::chrono::duration<double>(now - idle_since).count() >= patience) {
            std::fprintf(stderr, "simt: %ld threads %s wait at barriers the others never "
                         "reach\n", left, simt::resident ? "of the resident grid" : "of the block");
            simt::trapped = 1;  // the next round lets each waiting thread stop
        }
    }
}

// Every block at once: one fiber per thread of the grid, each block with its own shared memory.
int run_resident(long blocks, int threads, int gx, int gy, int shared) {
    const Stacks stacks(blocks * threads);
    if (!stacks.base) {
        std::fprintf(stderr, "simt: no memory for %ld thread stacks\n", blocks * threads);
        return 2;
    }
    std::vector<std::unique_ptr<simt::Block>> grid;
    std::vector<std::vector<unsigned char>> arenas;
    std::vector<Fiber> fibers(blocks * threads);
    for (long b = 0; b < blocks; ++b) {
        const long id = blocks - 1 - b;  // the last block's threads first, as below
        arenas.emplace_back(simt::SMEM_BYTES, 0xFF);
        grid.push_back(std::make_unique<simt::Block>(threads));
        grid.back()->smem = arenas.back().data();
        grid.back()->idx = {(unsigned)(id % gx), (unsigned)(id / gx % gy),
                            (unsigned)(id / ((long)gx * gy))};
        for (int t = 0; t < threads; ++t) {
            Fiber& f = fibers[b * threads + t];
            f.block = grid.back().get();
            prepare(f.context, stacks.stack(b * threads + t), STACK_BYTES, fiber_main);
        }
    }
    // each block as far as it goes before the next, the last block first: blocks drift apart
    // as far as the kernel lets them, so one that reads what another has not yet written (a
    // grid barrier missing) reads it unwritten
    run_groups(fibers, threads, threads, 2.0);
    for (long b = 0; b < blocks && !simt::trapped; ++b)
        if (wrote_past(arenas[b].data(), (unsigned)shared)) simt::trapped = 1;
    return simt::trapped ? 2 : 0;
}

}  // namespace

void simt::yield() { jump(running->context, launcher); }

// Run fn(args) over a (gx, gy, gz) grid of (bx, by, bz) blocks with `shared` bytes of dynamic
// shared memory. Blocks run one at a time, the last first: a GPU gives no order, and the
// hardware's tends to be the grid's, so a kernel that reads what a later block writes (a race on
// the device) sees it unwritten here. One fiber per thread of a block, the same fibers for every
// block; between blocks the launch checks that the last block wrote nothing past the dynamic size
// and poisons shared memory again. With `resident` every block runs at once instead (at most
// MAX_RESIDENT threads in all, and no dependent-launch guard, whose bytes are poisoned block by
// block), as a persistent kernel's blocks must. 0: done; 1: a launch the GPU would refuse (or a
// resident one the emulation cannot hold); 2: a thread trapped or a block wrote past its shared
// memory.
extern "C" int simt_run(void (*fn)(void**), void** args, int gx, int gy, int gz, int bx, int by,
                        int bz, int shared, int resident) {
    const int threads = bx * by * bz;
    if (by != 1 || bz != 1 || threads > simt::MAX_THREADS || threads % 32 ||
        shared > simt::SMEM_BYTES || gx < 1 || gy < 1 || gz < 1)
        return 1;
    const long blocks = (long)gx * gy * gz;
    if (resident && (blocks * threads > simt::MAX_RESIDENT || !simt::guarded.empty())) {
        std::fprintf(stderr, "simt: a resident launch holds at most %d threads and runs without "
                     "the dependent-launch guard\n", simt::MAX_RESIDENT);
        return 1;
    }
    kernel = fn;
    kernel_args = args;
    simt::trapped = 0;
    simt::resident = resident != 0;
    simt::block_dim = {(unsigned)threads, 1, 1};
    simt::grid_dim = {(unsigned)gx, (unsigned)gy, (unsigned)gz};
    simt::dynamic_bytes = (unsigned)shared;
    if (resident) return run_resident(blocks, threads, gx, gy, shared);
    const Stacks stacks(threads);
    if (!stacks.base) {
        std::fprintf(stderr, "simt: no memory for %d thread stacks\n", threads);
        return 2;
    }
    std::vector<Fiber> fibers(threads);
    for (int t = 0; t < threads; ++t)
        prepare(fibers[t].context, stacks.stack(t), STACK_BYTES, fiber_main);
    std::unique_ptr<simt::Block> current;
    for (long b = 0; b < blocks && !simt::trapped; ++b) {
        if (b > 0 && wrote_past(simt::arena, (unsigned)shared)) {
            simt::trapped = 1;
            break;
        }
        // the launch's bytes poisoned again; those past it were checked unchanged
        std::memset(simt::arena, 0xFF, b > 0 ? (size_t)shared : simt::SMEM_BYTES);
        current = std::make_unique<simt::Block>(threads);
        current->smem = simt::arena;
        for (simt::Guarded& g : simt::guarded) {  // the step's bytes aside, poison in their place
            g.saved.assign(g.p, g.p + g.n);
            std::memset(g.p, 0xFF, g.n);
        }
        const long id = blocks - 1 - b;  // last block first (see above)
        current->idx = {(unsigned)(id % gx), (unsigned)(id / gx % gy),
                        (unsigned)(id / ((long)gx * gy))};
        simt::block = current.get();
        simt::block_idx = current->idx;
        for (Fiber& f : fibers) {
            f.block = current.get();
            f.done = false;
            f.open_group.clear();
            f.committed.clear();
            f.wgmma_open.clear();
            f.wgmma_committed.clear();
        }
        run_groups(fibers, threads, METRALE_SIMT_SKEW ? 32 : threads, 0.0);
        if (simt::guarding()) simt::release_guarded();
    }
    if (!simt::trapped && wrote_past(simt::arena, (unsigned)shared)) simt::trapped = 1;
    return simt::trapped ? 2 : 0;
}

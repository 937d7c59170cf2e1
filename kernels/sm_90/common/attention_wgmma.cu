// Metrale CUDA, sm_90a: the bounded policy's prefill attention (kv_append_attention_online) on
// Hopper's warpgroup MMA. A residual of the sm_90 class: it shadows attention_online.cu, whose
// warps each bring every key and value of a tile through their registers by ldmatrix for 16
// query rows; here a warpgroup's wgmmas read them from shared memory themselves for 64.
//
// A block takes one kv head, 64 rows of the launch (from its end, as attention_prefill.cuh's
// blocks do) and WGS = min(2, G) of the head's G q heads, a warpgroup each (grid x: kv head
// times ceil(G / WGS) head groups; a warpgroup past the group's last head only loads). Keys and
// values come through shared memory in tiles of 64 positions, two buffers, by cp.async, as
// 128-byte-swizzled rows of 64 head-dim columns (a head of 128: two such column chunks), which
// both wgmmas read: the scores s = q · kᵀ take the keys K-major (q's 64 rows, copied once, the
// A operand), the weighted values acc += p · v take the values N-major (imm-trans-b) and the
// weights p from the registers the scores left them in (mma.sync's A fragment is the accumulator
// fragment of two n8 tiles side by side). Rows of the block in different slots are served slot
// after slot; the positions a launch row appends are read from k, v, not from the cache, and
// the blocks of the first head group write the block's rows into the cache.
//
// Order (declared in KERNELS.toml; the family's semantics, lkb/semantics_attention.py): that of
// attention_online.cu, the scores' and the values' sums inside one wgmma the hardware's: a row's
// positions cut at absolute multiples of KV_BLOCK (= the 64-position tile), the blocks left to
// right, each once; s_j = (q · k_j) * scale * log2(e); m' = max(m, max_j s_j), a = 2^(m - m');
// p_j = 2^(s_j - m') rounded to bf16, l = l a + sum p_j (the lane's positions, in order),
// acc = acc a + sum p_j v_j; then o = acc / l (the four lanes of a row summed), rounded to act.
// 2^x is the multi-function unit's, its results below 2^-126 flushed to zero (exp2_ftz).
// A position no row of the tile attends to weighs 0 (its score -inf), and a row with none in
// the tile keeps its state (a = 1, p = 0).
// Defines: ACT_BF16, KV_BLOCK (64).
#include "attention_prefill.cuh"

#ifndef KV_BLOCK
#error "define KV_BLOCK"
#endif
static_assert(KV_BLOCK == TILE_POS, "the online softmax's blocks are the 64-position tiles");

#define WG_ROWS 64        // rows of a block: one m64 tile of every warpgroup
#ifndef WG_MAX
#define WG_MAX 2  // warpgroups of a block (q heads it takes)
#endif
#ifndef WG_BLOCKS
#define WG_BLOCKS 1  // blocks an SM (__launch_bounds__)
#endif
#define CHUNK_BYTES 8192  // 64 rows (or positions) x 64 head-dim columns of bf16, swizzled
#define WG_HEAD_DIM 128   // two column chunks

// The block's shared memory, 1024-byte aligned: q's rows (WG_MAX x 2 chunks), then two buffers
// of a key tile (2 chunks), a value tile (2 chunks) and, per position, the global rows its key
// and value come from (null: zeros) and the launch row appending it (-1: none). KERNELS.toml's
// launch.shared is 1024 + 8192 (2 WG_MAX + 2 4) + 2 (128 8 + 64 4).
struct WgSmem {
    unsigned char* base;
    uint32_t at;  // base's shared address
    __device__ __forceinline__ WgSmem() {
        extern __shared__ __align__(16) unsigned char smem_raw[];
        const uint32_t raw = smem_addr(smem_raw);
        at = (raw + 1023) & ~1023u;
        base = smem_raw + (at - raw);
    }
    static constexpr int q_bytes = WG_MAX * 2 * CHUNK_BYTES, tile_bytes = 4 * CHUNK_BYTES;
    static constexpr int bytes = q_bytes + 2 * tile_bytes + 2 * (128 * 8 + 64 * 4);
    __device__ __forceinline__ int q(int wg) const { return wg * 2 * CHUNK_BYTES; }
    __device__ __forceinline__ int k(int b) const { return q_bytes + b * tile_bytes; }
    __device__ __forceinline__ int v(int b) const { return k(b) + 2 * CHUNK_BYTES; }
    __device__ __forceinline__ const act_t** rows(int b) const {
        return (const act_t**)(base + q_bytes + 2 * tile_bytes + b * (128 * 8 + 64 * 4));
    }
};

// Where the 16-byte piece p of a head row r lies in its tile: chunk p / 8, then the 128-byte
// swizzle within it (piece p % 8 of row r at piece (p % 8) ^ (r % 8)).
__device__ __forceinline__ int wg_piece(int r, int p) {
    return (p >> 3) * CHUNK_BYTES + r * 128 + (((p & 7) ^ (r & 7)) << 4);
}

// ------------------------------------------------------------------ wgmma

// Descriptors of a 128-byte-swizzled operand at shared address `at` (1024-byte aligned, plus 32
// bytes a k step of a K-major one): 8-row groups 1024 bytes apart; an N-major one's 64-column
// chunks CHUNK_BYTES apart (its leading offset).
__device__ __forceinline__ uint64_t k_major(uint32_t at) {
    return (uint64_t)((at & 0x3FFFF) >> 4) | (uint64_t)1 << 16 | (uint64_t)(1024 >> 4) << 32 |
           (uint64_t)1 << 62;
}
__device__ __forceinline__ uint64_t n_major(uint32_t at) {
    return (uint64_t)((at & 0x3FFFF) >> 4) | (uint64_t)(CHUNK_BYTES >> 4) << 16 |
           (uint64_t)(1024 >> 4) << 32 | (uint64_t)1 << 62;
}

__device__ __forceinline__ void wg_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wg_wait_all() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(0) : "memory");
}

// d = a · bᵀ (+ d when add): a 64 x 16 K-major slice of q, a 64 x 16 K-major slice of keys.
__device__ __forceinline__ void wgmma_scores(float (&d)[32], uint64_t a, uint64_t b, int add) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
                 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(a), "l"(b), "r"(add)
                 : "memory");
}

// d += p · v: p's 64 x 16 slice from the registers (a[4]: the warp's A fragment), v's 16 x 64
// slice N-major.
__device__ __forceinline__ void wgmma_values(float (&d)[32], const uint32_t (&a)[4],
                                             uint64_t b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1)
                 : "memory");
}

// cp.async's writes made visible to the wgmmas (the async proxy) that read them.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ------------------------------------------------------------------ the tiles

// The global rows of positions [start, start + 64) of `slot` (issue_kv_tile's rule: from k_new
// / v_new where a launch row appends the position, else the cache; null outside [lo, hi]), then
// their keys and values into buffer b, one cp.async group, every thread of the block together:
// CHUNKS whole chunks of each, zeros past d (the scores' k steps run over whole chunks; the
// values' columns past d make outputs never stored).
template <int CHUNKS>
__device__ __forceinline__ void wg_issue_tile(const WgSmem& s, int b, const act_t* k_cache,
                                              const act_t* v_cache, const act_t* k_new,
                                              const act_t* v_new, const int* positions,
                                              const int* slots, int rows, int slot,
                                              AppendRun run, int start, int lo, int hi, int kvh,
                                              int hkv, int d, int max_ctx) {
    constexpr int KP = 8 * CHUNKS;  // 16-byte pieces of a row in whole chunks
    const int n16 = d / 8, nt = blockDim.x;
    // A tile whose positions all lie in [lo, hi] and come from one array in order (a prompt's
    // rows of k, v, or the cache's) needs no table of rows: position start + j is row j from
    // kb, vb, stride apart. A thread copies piece p = thread % KP of every (nt / KP)-th row.
    const long stride = (long)hkv * d;
    const act_t *kb = nullptr, *vb = nullptr;
    const int c0 = start - run.base;  // with run.direct and run.alone: the row appending start
    if (start >= lo && start + TILE_POS - 1 <= hi && k_new && run.direct && run.alone) {
        if (c0 >= 0 && c0 + TILE_POS <= rows) {
            kb = k_new + c0 * stride + (long)kvh * d;
            vb = v_new + c0 * stride + (long)kvh * d;
        } else if (c0 + TILE_POS <= 0 || c0 >= rows) {
            const long at = ((long)slot * max_ctx + start) * stride + (long)kvh * d;
            kb = k_cache + at;
            vb = v_cache + at;
        }
    }
    if (kb) {
        // the rows a thread copies are a multiple of 8 apart (nt / KP: 8, 16 or 32), so its
        // piece's place in the swizzle is the same in each: pointers stepped, nothing recomputed
        const int p = threadIdx.x % KP, j0 = threadIdx.x / KP, step = nt / KP;
        const int bytes = p < n16 ? 16 : 0;
        unsigned char* kd = s.base + s.k(b) + wg_piece(j0, p);
        const act_t* ks = kb + j0 * stride + 8 * min(p, n16 - 1);
        const long vd = s.v(b) - s.k(b), vs = vb - kb;
        for (int j = j0; j < TILE_POS; j += step, kd += step * 128, ks += step * stride) {
            cp_async16(kd, ks, bytes);
            cp_async16(kd + vd, ks + vs, bytes);
        }
        cp_async_commit();
        return;
    }
    const act_t** krow = s.rows(b);
    const act_t** vrow = krow + TILE_POS;
    int* src = (int*)(vrow + TILE_POS);
    if (k_new && !run.direct) {  // which rows append the tile's positions: every row scanned
        for (int j = threadIdx.x; j < TILE_POS; j += nt) src[j] = -1;
        __syncthreads();
        for (int r = threadIdx.x; r < rows; r += nt)
            if (slots[r] == slot && positions[r] >= start && positions[r] < start + TILE_POS)
                src[positions[r] - start] = r;
        __syncthreads();
    }
    for (int j = threadIdx.x; j < TILE_POS; j += nt) {
        const int pos = start + j;
        int r = -1;
        if (k_new && run.direct) {
            const int c = pos - run.base;
            r = c >= 0 && c < rows && (run.alone || (slots[c] == slot && positions[c] == pos))
                    ? c : -1;
        } else if (k_new) {
            r = src[j];
        }
        const bool live = pos >= lo && pos <= hi;
        const long off = r >= 0 ? ((long)r * hkv + kvh) * d
                                : (((long)slot * max_ctx + pos) * hkv + kvh) * d;
        krow[j] = live ? (r >= 0 ? k_new : k_cache) + off : nullptr;
        vrow[j] = live ? (r >= 0 ? v_new : v_cache) + off : nullptr;
    }
    __syncthreads();  // the rows are found, for every thread
    for (int i = threadIdx.x; i < 2 * TILE_POS * KP; i += nt) {
        const bool kv = i >= TILE_POS * KP;
        const int at = kv ? i - TILE_POS * KP : i, j = at / KP, p = at % KP;
        const act_t* row = (kv ? vrow : krow)[j];
        const bool in = row && p < n16;
        cp_async16(s.base + (kv ? s.v(b) : s.k(b)) + wg_piece(j, p), in ? row + 8 * p : k_cache,
                   in ? 16 : 0);
    }
    cp_async_commit();
}

// The rows [row0, row0 + WG_ROWS) of the block, clamped to the launch's last, of q head `head`
// into warpgroup wg's CHUNKS q chunks, zeros past d (one cp.async group with the first tile's).
template <int CHUNKS>
__device__ __forceinline__ void wg_issue_q(const WgSmem& s, const act_t* q, int row0, int rows,
                                           int head, int hq, int d, int wg) {
    constexpr int KP = 8 * CHUNKS;
    const int n16 = d / 8, t = threadIdx.x & 127;
    for (int i = t; i < WG_ROWS * KP; i += 128) {
        const int r = i / KP, p = i % KP;
        cp_async16(s.base + s.q(wg) + wg_piece(r, p),
                   q + ((long)min(row0 + r, rows - 1) * hq + head) * d + 8 * min(p, n16 - 1),
                   p < n16 ? 16 : 0);
    }
}

// kv_append of the block's rows (its kv head), 16 bytes a copy, every thread of the block.
__device__ __forceinline__ void wg_append_rows(const act_t* k, const act_t* v, act_t* k_cache,
                                               act_t* v_cache, const int* positions,
                                               const int* slots, int row0, int rows, int kvh,
                                               int hkv, int d, int max_ctx) {
    const int n8 = d / 8, nrows = min(WG_ROWS, rows - row0);
    for (int i = threadIdx.x; i < nrows * n8; i += blockDim.x) {
        const int row = row0 + i / n8, c = i % n8;
        const long src = ((long)row * hkv + kvh) * d + 8 * c;
        const long dst = (((long)slots[row] * max_ctx + positions[row]) * hkv + kvh) * d + 8 * c;
        *(uint4*)(k_cache + dst) = *(const uint4*)(k + src);
        *(uint4*)(v_cache + dst) = *(const uint4*)(v + src);
    }
}

// ------------------------------------------------------------------ the kernel

// The attention of the block's rows, its head dim in CHUNKS chunks of 64 columns (a constant, so
// that every wgmma's registers are known where it is issued).
template <int CHUNKS>
__device__ __forceinline__ void wg_attend(const act_t* k, const act_t* v, const act_t* q,
                                          const act_t* k_cache, const act_t* v_cache,
                                          const int* positions, const int* slots, act_t* o,
                                          int rows, int hq, int hkv, int d, int max_ctx,
                                          float scale, int window, int kvh, int hg, int wgs,
                                          int row0) {
    const int G = hq / hkv;
    const WgSmem s;
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int g = lane >> 2, head_in_group = hg * wgs + wg;
    const bool active = head_in_group < G;  // warpgroup-uniform
    const int head = kvh * G + min(head_in_group, G - 1);
    const int wrow0 = row0 + 16 * warp;
    const RowInfo rw[2] = {row_info(wrow0 + g, rows, positions, slots, window),
                           row_info(wrow0 + g + 8, rows, positions, slots, window)};
    const float c = scale * 1.4426950408889634f;  // scores in log2 units

    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, acc[CHUNKS][32];
#pragma unroll
    for (int ch = 0; ch < CHUNKS; ++ch)
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[ch][i] = 0.0f;

    wg_issue_q<CHUNKS>(s, q, row0, rows, head, hq, d, wg);  // lands with the first tile's group
    for_each_slot_of(row0, WG_ROWS, positions, slots, rows, window, k, [&](int slot, int lo,
                                                                         int hi, AppendRun run) {
        const Span sp[2] = {Span(rw[0], slot, 0, max_ctx), Span(rw[1], slot, 0, max_ctx)};
        const int t0 = lo / TILE_POS * TILE_POS;
        auto issue = [&](int b, int st) {
            wg_issue_tile<CHUNKS>(s, b, k_cache, v_cache, k, v, positions, slots, rows, slot,
                                  run, st, lo, hi, kvh, hkv, d, max_ctx);
        };
        issue(0, t0);
        for (int st = t0, it = 0; st <= hi; st += TILE_POS, ++it) {
            const int b = it & 1;
            if (st + TILE_POS <= hi) {
                issue(b ^ 1, st + TILE_POS);
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            fence_proxy_async();  // this thread's copies seen by the wgmmas
            __syncthreads();      // every thread's, and q's
            if (active) {
                // the scores of the warpgroup's 64 rows and the tile's 64 positions
                float sc[32];
                wg_fence();
#pragma unroll
                for (int kk = 0; kk < 4 * CHUNKS; ++kk) {
                    const int off = (kk >> 2) * CHUNK_BYTES + 32 * (kk & 3);
                    wgmma_scores(sc, k_major(s.at + s.q(wg) + off), k_major(s.at + s.k(b) + off),
                                 kk > 0);
                }
                wg_commit();
                wg_wait_all();
                float a[2];
                uint32_t pa[4][4];  // the weights as A fragments: positions 16 kk .. 16 kk + 15
                online_block(sc, sp, st, c, m, l, a, pa);
                if (!online_keeps(a)) {
#pragma unroll
                    for (int ch = 0; ch < CHUNKS; ++ch)
#pragma unroll
                        for (int i = 0; i < 32; ++i) acc[ch][i] *= a[(i & 3) >> 1];
                }
                wg_fence();
#pragma unroll
                for (int kk = 0; kk < 4; ++kk)
#pragma unroll
                    for (int ch = 0; ch < CHUNKS; ++ch)
                        wgmma_values(acc[ch], pa[kk],
                                     n_major(s.at + s.v(b) + ch * CHUNK_BYTES + kk * 16 * 128));
                wg_commit();
                wg_wait_all();
            }
            __syncthreads();  // every warpgroup is done with the buffer before it is refilled
        }
    });
    // chunk ch's register 4 j + e is n8 tile 8 ch + j's element e: the head's n8 tiles in order
    if (active)
        online_store(reinterpret_cast<const float(&)[8 * CHUNKS][4]>(acc), l, rw, o, wrow0, hq,
                     head, d);
}

// grid (hkv ceil(G / WGS), ceil(rows / 64), 1), block 128 WGS (WGS = min(2, G), G = hq / hkv, or
// 1): kv_append, then attention. A launch it cannot serve traps (loud).
extern "C" __global__ void __launch_bounds__(128 * WG_MAX, WG_BLOCKS)
metrale_kv_append_attention_wgmma_online_prefill(
    const act_t* __restrict__ k, const act_t* __restrict__ v, const act_t* __restrict__ q,
    act_t* k_cache, act_t* v_cache, const int* __restrict__ positions,
    const int* __restrict__ slots, act_t* __restrict__ o, int rows, int hq, int hkv, int d,
    int max_ctx, float scale, int window) {
    grid_dependency_sync();
    // WGS is the table's min(2, G); one warpgroup a block, or two, gives the same bytes
    const int G = hq / hkv, wgs = blockDim.x / 128, groups = (G + wgs - 1) / wgs;
    if (d % 16 || d > WG_HEAD_DIM || hq % hkv || blockDim.x % 128 || wgs < 1 ||
        wgs > min(WG_MAX, G) ||
        (int)gridDim.x != hkv * groups || (long)gridDim.y * WG_ROWS < rows || gridDim.z != 1 ||
        dynamic_smem_bytes() < WgSmem::bytes + 1024)
        __trap();
    const int kvh = blockIdx.x / groups, hg = blockIdx.x % groups;
    const int row0 = (int)(gridDim.y - 1 - blockIdx.y) * WG_ROWS;
    if (hg == 0)
        wg_append_rows(k, v, k_cache, v_cache, positions, slots, row0, rows, kvh, hkv, d,
                       max_ctx);
    if (d > 64)
        wg_attend<2>(k, v, q, k_cache, v_cache, positions, slots, o, rows, hq, hkv, d, max_ctx,
                     scale, window, kvh, hg, wgs, row0);
    else
        wg_attend<1>(k, v, q, k_cache, v_cache, positions, slots, o, rows, hq, hkv, d, max_ctx,
                     scale, window, kvh, hg, wgs, row0);
}

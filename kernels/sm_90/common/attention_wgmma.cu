// Metrale CUDA, sm_90a: the prefill attention on Hopper's warpgroup MMA, in both policies'
// orders: the declared two-pass order (attention and kv_append_attention at their prefill points,
// attention_prefill.cu's) and the bounded policy's online softmax (kv_append_attention_online,
// attention_online.cu's). A residual of the sm_90 class: it shadows those two sources, whose
// warps each bring every key and value of a tile through their registers by ldmatrix for 16
// query rows; here a warpgroup's wgmmas read them from shared memory themselves for 64.
//
// A block takes one kv head, 64 rows of the launch (from its end, as attention_prefill.cuh's
// blocks do), WGS = min(2, G) of the head's G q heads, a warpgroup each (grid x: kv head times
// ceil(G / WGS) head groups; a warpgroup past the group's last head only keeps count), and, in
// the two-pass order, 128 of the head's output columns (grid z); one more warpgroup, the
// producer, only copies (the ring, below). Keys and values come through shared memory in tiles
// of 64 positions, a ring of buffers filled by the producer's cp.async, as 128-byte-swizzled
// rows of 64 head-dim columns (chunks: a head of 128 has two), which the wgmmas read: the scores
// s = q · kᵀ take q's 64 rows (copied once, the A operand) and the keys K-major, the weighted
// values acc += p · v the values N-major (imm-trans-b) and the weights p from the registers the
// scores left them in (mma.sync's A fragment is the accumulator fragment of two n8 tiles side by
// side).
// A tile whose positions all come from one array in order (a prompt's own k, v, or the cache's)
// is copied from a base and a stride; others through a table of rows. Rows of the block in
// different slots are served slot after slot; the positions a launch row appends are read from
// k, v, not from the cache, and the blocks of the first head group (and slice) write the block's
// rows into the cache.
//
// Orders (declared in KERNELS.toml; the families' semantics, lkb/semantics_attention.py), the
// sums inside one wgmma the hardware's:
// - two-pass (exact_consume): attention_prefill.cu's. A row's positions cut at absolute
//   multiples of KV_BLOCK; for each block, pass 1: s_j = (q · k_j) * scale, m_b = max s_j;
//   pass 2: the same s_j again, e_j = exp(s_j - m_b), l_b = sum e_j (lane partials, then the
//   four lanes of the row), acc_b = sum e_j v_j, e_j entering the wgmmas as three bf16 parts
//   whose sum is e_j exactly; the blocks merge left to right by the log-sum-exp rule, o = acc / l.
// - online (online_consume): attention_online.cu's, online_block's (attention_prefill.cuh):
//   KV blocks of 64 (= the tile), each once; 2^x the multi-function unit's, flushed to zero
//   below 2^-126.
// Defines: ACT_BF16, KV_BLOCK (64: the online entry; 256: the two-pass ones).
#include <climits>
#include <type_traits>

#include "attention_prefill.cuh"
#include "tma.cuh"  // the barriers
#include "wgmma.cuh"

#ifndef KV_BLOCK
#error "define KV_BLOCK"
#endif
static_assert(KV_BLOCK % TILE_POS == 0, "KV_BLOCK must be a multiple of the 64-position tile");
constexpr bool EXACT_ORDER = KV_BLOCK > TILE_POS;  // the two-pass entries (else the online one)

#define WG_ROWS 64  // rows of a block: one m64 tile of every warpgroup
#ifndef WG_MAX
#define WG_MAX 2  // warpgroups of a block (q heads it takes)
#endif
#define CHUNK_BYTES 8192  // 64 rows (or positions) x 64 head-dim columns of bf16, swizzled
#define WG_SLICE 128      // output columns of a two-pass block (grid z): two value chunks

// The block's shared memory, 1024-byte aligned, for a head of kch = 1, 2 or 4 chunks (d up to
// 64, 128, 256: the scores' k steps, constants, run over them), vch = min(2, kch) value chunks a
// block, wgs warpgroups that compute and `stages` buffers: q's rows (wgs x kch chunks), each
// buffer's key tile (kch chunks) and value tile (vch), the two-pass order's running outputs
// (`exact`: 64 rows x 128 f32 a warpgroup, each thread's 64 a column of 128-float rows, read and
// written once a KV block), then, per buffer and position, the global rows its key and value
// come from (null: zeros) and the launch row appending it (-1: none), then the ring's barriers
// (`barriers`: a full and an empty one a buffer). KERNELS.toml's launch.shared is
// bytes(d, wgs, exact, stages, barriers): 1024 + 8192 (wgs kch + stages (kch + vch)) + exact wgs
// 32768 + stages 1280 + 8 barriers.
struct WgSmem {
    unsigned char* base;
    uint32_t at;  // base's shared address
    int kch, vch, wgs, stages;
    static __device__ __forceinline__ int chunks(int d) { return d <= 64 ? 1 : d <= 128 ? 2 : 4; }
    __device__ __forceinline__ WgSmem(int d, int wgs_, int stages_)
        : kch(chunks(d)), vch(min(2, kch)), wgs(wgs_), stages(stages_) {
        extern __shared__ __align__(16) unsigned char smem_raw[];
        const uint32_t raw = smem_addr(smem_raw);
        at = (raw + 1023) & ~1023u;
        base = smem_raw + (at - raw);
    }
    static __device__ __forceinline__ int bytes(int d, int wgs, bool exact, int stages,
                                                int barriers) {
        const int kc = chunks(d);
        return 1024 + CHUNK_BYTES * (wgs * kc + stages * (kc + min(2, kc))) +
               exact * wgs * 32768 + stages * 1280 + 8 * barriers;
    }
    __device__ __forceinline__ int q(int wg) const { return wg * kch * CHUNK_BYTES; }
    __device__ __forceinline__ int k(int b) const {
        return (wgs * kch + b * (kch + vch)) * CHUNK_BYTES;
    }
    __device__ __forceinline__ int v(int b) const { return k(b) + kch * CHUNK_BYTES; }
    // warpgroup wg's running outputs (the two-pass entries' alone)
    __device__ __forceinline__ float* outputs(int wg) const {
        return (float*)(base + (wgs * kch + stages * (kch + vch)) * CHUNK_BYTES + wg * 32768);
    }
    __device__ __forceinline__ const act_t** rows(int b) const {
        return (const act_t**)(base + (wgs * kch + stages * (kch + vch)) * CHUNK_BYTES +
                               EXACT_ORDER * wgs * 32768 + b * 1280);
    }
    // the barriers: full(b) then empty(b) of each buffer, past the tables
    __device__ __forceinline__ uint64_t* full(int b) const {
        return (uint64_t*)rows(stages) + 2 * b;
    }
    __device__ __forceinline__ uint64_t* empty(int b) const { return full(b) + 1; }
    // the online entry's, past them: every computing thread is done with q's rows
    __device__ __forceinline__ uint64_t* qfree() const { return full(stages); }
};

// Where the 16-byte piece p of a head row r lies in its tile: chunk p / 8, then the 128-byte
// swizzle within it (piece p % 8 of row r at piece (p % 8) ^ (r % 8)).
__device__ __forceinline__ int wg_piece(int r, int p) {
    return (p >> 3) * CHUNK_BYTES + r * 128 + (((p & 7) ^ (r & 7)) << 4);
}

// ------------------------------------------------------------------ wgmma

// The descriptor of an N-major operand (the values) at shared address `at`: its 64-column
// chunks CHUNK_BYTES apart.
__device__ __forceinline__ uint64_t n_major(uint32_t at) { return swizzled_desc(at, CHUNK_BYTES); }

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

// ------------------------------------------------------------------ the tiles

// The threads that copy a tile together and the tile's positions they take: lane t of one
// producer warp, positions [j0, j0 + nj), a quarter of the tile, met by sync() (__syncwarp).
struct TileCrew {
    int t, nt, j0, nj;
    static __device__ __forceinline__ TileCrew quarter(int w, int lane) {
        return {lane, 32, w * (TILE_POS / 4), TILE_POS / 4};
    }
    __device__ __forceinline__ void sync() const { __syncwarp(); }
};

// KP 16-byte pieces of each of the crew's rows kb + j stride into the tile at dst, those at or
// past d - col0 columns as zeros (of the keys: the scores' k steps run over whole chunks; of the
// values: their columns past d make outputs never stored): piece t % KP of every (nt / KP)-th
// row, the source pointer stepped.
template <int KP>
__device__ __forceinline__ void copy_strided(unsigned char* dst, const act_t* kb, long stride,
                                             int n16, const TileCrew& c) {
    const int p = c.t % KP, step = c.nt / KP, j0 = c.j0 + c.t / KP;
    const int bytes = p < n16 ? 16 : 0;
    const act_t* src = kb + j0 * stride + 8 * min(p, max(n16 - 1, 0));
    for (int j = j0; j < c.j0 + c.nj; j += step, src += step * stride)
        cp_async16(dst + wg_piece(j, p), src, bytes);
}

// The global rows of positions [start, start + 64) of `slot` (issue_kv_tile's rule: from k_new
// / v_new where a launch row appends the position, else the cache; null outside [lo, hi]), then
// their keys (KCH chunks) and, with `with_v`, their values at columns col0 + [0, 64 VCH) into
// buffer b, the crew's positions of them, one cp.async group of each of its threads. A tile
// whose positions all lie in [lo, hi] and come from one array in order needs no table: position
// start + j is row j.
template <int KCH, int VCH>
__device__ __forceinline__ void wg_issue_tile(const WgSmem& s, int b, const act_t* k_cache,
                                              const act_t* v_cache, const act_t* k_new,
                                              const act_t* v_new, const int* positions,
                                              const int* slots, int rows, int slot,
                                              AppendRun run, int start, int lo, int hi, int kvh,
                                              int hkv, int d, int max_ctx, bool with_v,
                                              int col0, const TileCrew& c) {
    constexpr int KP = 8 * KCH, VP = 8 * VCH;  // 16-byte pieces of a key row, a value row
    const long stride = (long)hkv * d;
    const act_t *kb = nullptr, *vb = nullptr;
    if (start >= lo && start + TILE_POS - 1 <= hi) {
        const int c0 = start - run.base;  // with run.direct and run.alone: the row appending start
        if (k_new && run.direct && run.alone && c0 >= 0 && c0 + TILE_POS <= rows) {
            kb = k_new + c0 * stride + (long)kvh * d;
            vb = v_new + c0 * stride + (long)kvh * d;
        } else if (!k_new || (run.direct && run.alone && (c0 + TILE_POS <= 0 || c0 >= rows))) {
            const long at = ((long)slot * max_ctx + start) * stride + (long)kvh * d;
            kb = k_cache + at;
            vb = v_cache + at;
        }
    }
    if (kb) {
        copy_strided<KP>(s.base + s.k(b), kb, stride, d / 8, c);
        if (with_v) copy_strided<VP>(s.base + s.v(b), vb + col0, stride, (d - col0) / 8, c);
        cp_async_commit();
        return;
    }
    const act_t** krow = s.rows(b);
    const act_t** vrow = krow + TILE_POS;
    int* src = (int*)(vrow + TILE_POS);
    const int j1 = c.j0 + c.nj;
    if (k_new && !run.direct) {  // which rows append the crew's positions: every row scanned
        for (int j = c.j0 + c.t; j < j1; j += c.nt) src[j] = -1;
        c.sync();
        for (int r = c.t; r < rows; r += c.nt)
            if (slots[r] == slot && positions[r] >= start + c.j0 && positions[r] < start + j1)
                src[positions[r] - start] = r;
        c.sync();
    }
    for (int j = c.j0 + c.t; j < j1; j += c.nt) {
        const int pos = start + j;
        int r = -1;
        if (k_new && run.direct) {
            const int cr = pos - run.base;
            r = cr >= 0 && cr < rows && (run.alone || (slots[cr] == slot && positions[cr] == pos))
                    ? cr : -1;
        } else if (k_new) {
            r = src[j];
        }
        const bool live = pos >= lo && pos <= hi;
        const long off = r >= 0 ? ((long)r * hkv + kvh) * d
                                : (((long)slot * max_ctx + pos) * hkv + kvh) * d;
        krow[j] = live ? (r >= 0 ? k_new : k_cache) + off : nullptr;
        vrow[j] = live ? (r >= 0 ? v_new : v_cache) + off + col0 : nullptr;
    }
    c.sync();  // the rows are found, for every thread of the crew
    const int n16 = d / 8, v16 = (d - col0) / 8;
    for (int i = c.t; i < c.nj * (KP + (with_v ? VP : 0)); i += c.nt) {
        const bool kv = i >= c.nj * KP;
        const int at = kv ? i - c.nj * KP : i;
        const int j = c.j0 + (kv ? at / VP : at / KP), p = kv ? at % VP : at % KP;
        const act_t* row = (kv ? vrow : krow)[j];
        const bool in = row && p < (kv ? v16 : n16);
        cp_async16(s.base + (kv ? s.v(b) : s.k(b)) + wg_piece(j, p), in ? row + 8 * p : k_cache,
                   in ? 16 : 0);
    }
    cp_async_commit();
}

// The rows [row0, row0 + WG_ROWS) of the block, clamped to the launch's last, of q head `head`
// into warpgroup wg's KCH q chunks, zeros past d (one cp.async group with the first tile's).
template <int KCH>
__device__ __forceinline__ void wg_issue_q(const WgSmem& s, const act_t* q, int row0, int rows,
                                           int head, int hq, int d, int wg) {
    constexpr int KP = 8 * KCH;
    const int n16 = d / 8, t = threadIdx.x & 127;
    for (int i = t; i < WG_ROWS * KP; i += 128) {
        const int r = i / KP, p = i % KP;
        cp_async16(s.base + s.q(wg) + wg_piece(r, p),
                   q + ((long)min(row0 + r, rows - 1) * hq + head) * d + 8 * min(p, n16 - 1),
                   p < n16 ? 16 : 0);
    }
}

// The scores of the warpgroup's 64 rows and buffer b's 64 positions over KCH chunks of the head,
// into sc (register 4 ni + e: n8 tile ni, element e): their wgmmas issued as one group and waited
// for.
template <int KCH>
__device__ __forceinline__ void wg_scores(const WgSmem& s, int wg, int b, float (&sc)[32]) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4 * KCH; ++kk) {
        const int off = (kk >> 2) * CHUNK_BYTES + 32 * (kk & 3);
        wgmma_scores(sc, operand_desc(s.at + s.q(wg) + off), operand_desc(s.at + s.k(b) + off),
                     kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
}

// kv_append of the block's rows (its kv head), 16 bytes a copy, by the producer's 128 threads.
__device__ __forceinline__ void wg_append_rows(const act_t* k, const act_t* v, act_t* k_cache,
                                               act_t* v_cache, const int* positions,
                                               const int* slots, int row0, int rows, int kvh,
                                               int hkv, int d, int max_ctx) {
    const int n8 = d / 8, nrows = min(WG_ROWS, rows - row0);
    for (int i = threadIdx.x & 127; i < nrows * n8; i += 128) {
        const int row = row0 + i / n8, c = i % n8;
        const long src = ((long)row * hkv + kvh) * d + 8 * c;
        const long dst = (((long)slots[row] * max_ctx + positions[row]) * hkv + kvh) * d + 8 * c;
        *(uint4*)(k_cache + dst) = *(const uint4*)(k + src);
        *(uint4*)(v_cache + dst) = *(const uint4*)(v + src);
    }
}

// A work item's place (item y X + x: x the kv head times the head groups, y the row block
// counted from the launch's last): its kv head, head group, first row; the warpgroup's q head
// and whether it has one (warpgroup-uniform), the warp's first row and the lane's two rows.
struct WgPlace {
    int kvh, hg, row0, wg, head, wrow0;
    bool active;
    bool one_slot = false, direct = false;  // the launch's rows (launch_rows), where k is given
    RowInfo rw[2];
    __device__ __forceinline__ WgPlace(int item, int X, int Y, int G, int wgs,
                                       const int* positions, const int* slots, int rows,
                                       int window) {
        const int groups = (G + wgs - 1) / wgs, lane = threadIdx.x & 31, x = item % X;
        kvh = x / groups;
        hg = x % groups;
        row0 = (Y - 1 - item / X) * WG_ROWS;
        wg = threadIdx.x >> 7;
        const int in_group = hg * wgs + wg;
        active = in_group < G;
        head = kvh * G + min(in_group, G - 1);
        wrow0 = row0 + 16 * ((threadIdx.x >> 5) & 3);
        rw[0] = row_info(wrow0 + (lane >> 2), rows, positions, slots, window);
        rw[1] = row_info(wrow0 + (lane >> 2) + 8, rows, positions, slots, window);
    }
};

// A launch these entries cannot serve: a head past max_d or not whole k steps, a block that is
// not 1 to min(WG_MAX, G) warpgroups that compute (the two-pass entries: one past a head of 128)
// and `producers` that copy, a grid short of the heads, rows or slices, or less dynamic shared
// memory than `stages` buffers take. WGS is the table's; one warpgroup a block, or two, gives
// the same bytes.
__device__ __forceinline__ bool wg_launch_ok(int rows, int hq, int hkv, int d, int max_d,
                                             int slices, bool exact, int producers, int stages) {
    if (d % 16 || d > max_d || hq % hkv || blockDim.x % 128) return false;
    const int G = hq / hkv, wgs = blockDim.x / 128 - producers;
    const bool grid = exact ? (int)gridDim.x == hkv * ((G + wgs - 1) / wgs) &&
                                  (long)gridDim.y * WG_ROWS >= rows
                            : gridDim.y == 1;  // the online entry's blocks take items in turn
    return wgs >= 1 && wgs <= min(WG_MAX, G) && (!exact || wgs == 1 || d <= 128) && grid &&
           (int)gridDim.z == slices &&
           dynamic_smem_bytes() >= (unsigned)WgSmem::bytes(d, wgs, exact, stages,
                                                           2 * stages * producers + !exact);
}

// ------------------------------------------------------------------ the block's slots

// Whether the launch's rows all belong to one slot, and whether each appends base + r (base =
// positions[0]): every thread of the block, once. Of one slot, run_of's AppendRun of any first
// row is {direct, alone = true, positions[first] - first} (its scan finds another slot nowhere,
// and an irregular row exactly where the launch has one), so no slot meets the whole block.
__device__ __forceinline__ void launch_rows(const int* positions, const int* slots, int rows,
                                            bool& one_slot, bool& direct) {
    const int s0 = slots[0], b0 = positions[0];
    bool other = false, irregular = false;
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
        other |= slots[r] != s0;
        irregular |= positions[r] - r != b0;
    }
    one_slot = !__syncthreads_or(other);
    direct = !__syncthreads_or(irregular);
}

// for_each_slot_of (attention_prefill.cuh) for the block's 64 rows: the same slots in the same
// order, each with the same [lo, hi] and AppendRun (run_of, every thread of the block, where k_new
// is given), each warp finding them on its own: lane l holds rows row0 + l and row0 + 32 + l, a
// slot's rows are one ballot and its span one warp-wide min and max, where for_each_slot_of has
// every thread walk the 64 rows once for each slot (64 row_info loads: about a tenth of the
// online block's stall samples at Qwen3-0.6B's 2048 tokens).
template <class Body>
__device__ __forceinline__ void wg_for_each_slot(const WgPlace& at, const int* positions,
                                                 const int* slots, int rows, int window,
                                                 const act_t* k_new, Body body) {
    const int lane = threadIdx.x & 31, row0 = at.row0;
    unsigned done0 = 0, done1 = 0;  // rows row0 + l, row0 + 32 + l given to a slot: bit l
    while (~done0 | ~done1) {
        // loaded again for each slot (L1 hits), so that nothing but done lives through body
        const RowInfo r0 = row_info(row0 + lane, rows, positions, slots, window),
                      r1 = row_info(row0 + 32 + lane, rows, positions, slots, window);
        const bool high = !~done0;  // the first row not done: row0 + 32 high + i
        const int i = __ffs(high ? ~done1 : ~done0) - 1;
        const int slot = __shfl_sync(0xffffffffu, high ? r1.slot : r0.slot, i);
        if (!__shfl_sync(0xffffffffu, high ? r1.live : r0.live, i)) break;
        const bool in0 = r0.live && r0.slot == slot && !(done0 >> lane & 1),
                   in1 = r1.live && r1.slot == slot && !(done1 >> lane & 1);
        done0 |= __ballot_sync(0xffffffffu, in0);
        done1 |= __ballot_sync(0xffffffffu, in1);
        const int lo = __reduce_min_sync(0xffffffffu, min(in0 ? r0.lo : INT_MAX,
                                                          in1 ? r1.lo : INT_MAX));
        const int hi = __reduce_max_sync(0xffffffffu, max(in0 ? r0.p : INT_MIN,
                                                          in1 ? r1.p : INT_MIN));
        const int first = row0 + 32 * high + i;
        AppendRun run{false, false, 0};
        if (k_new && !EXACT_ORDER && at.one_slot)  // the two-pass consumers spill with it (ptxas)
            run = AppendRun{at.direct, true, positions[first] - first};
        else if (k_new)
            run = run_of(positions, slots, rows, slot, first);
        body(slot, lo, hi, run);
    }
}

// ------------------------------------------------------------------ the ring

// each(item, n) for the block's work items, n counting them: the two-pass entries' one (grid x
// the X places of a row block, grid y the Y row blocks); the online entry's blocks take the X Y
// items in turns of gridDim.x, block b the b-th of an even turn and the b-th from the end of an
// odd one: the items ascend from the launch's last rows, which see the most positions, so that
// the turns even out the blocks' work (persistent blocks, whose producer copies an item's tiles
// while the computing warpgroups store the one before).
template <class Each>
__device__ __forceinline__ void for_each_item(int X, int Y, Each each) {
    if constexpr (EXACT_ORDER) {
        each((int)blockIdx.y * X + (int)blockIdx.x, 0);
    } else {
        const int n = X * Y, g = gridDim.x, b = blockIdx.x;
        for (int turn = 0, i = 0; turn * g < n; ++turn) {
            const int item = turn * g + (turn & 1 ? g - 1 - b : b);
            if (item < n) each(item, i++);
        }
    }
}

// Both orders' blocks: WGS warpgroups that compute (a q head each) and one more, the producer,
// that only copies. The producer finds and copies every tile into a ring of `stages` buffers
// (its four warps a quarter of each, TileCrew::quarter), and q's rows of every computing
// warpgroup with the first; each buffer has a full barrier (the producer's 128 threads arrive
// once their copies have landed) and an empty one (the computing threads arrive once their
// wgmmas have read it). The computing warpgroups take the tiles in the order the producer
// copies them (slot_tiles) and wait for a tile, never for each other: no block-wide barrier
// between two tiles, where two buffers copied by every thread met the whole block twice a tile
// and held the warpgroups in step.
#define RING_LAG 2  // tiles a producer thread keeps in flight before it says one landed
#define ONLINE_STAGES 4  // the online entry's buffers (32 KiB each at a head of 128)
#define EXACT_STAGES 3   // the two-pass entries' (their running outputs take 32 KiB a warpgroup)
// the producer's registers given to the warpgroups that compute: 128 x 88 + 256 x 208
// (the online entry's persistent producer: 128 x 104 + 256 x 200)
constexpr int PRODUCER_REGS = EXACT_ORDER ? 88 : 104, CONSUMER_REGS = EXACT_ORDER ? 208 : 200;

// Whether the phase of `parity` has completed, without waiting for it.
__device__ __forceinline__ bool bar_done(uint64_t* bar, unsigned parity) {
    unsigned done;
    asm volatile("{\n\t.reg .pred p;\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                 "selp.u32 %0, 1, 0, p;\n\t}"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    return done;
}

// visit(st, with_v) for the tiles of positions [lo, hi] in the order the warpgroups take them:
// the online order's each once with its values; the two-pass order's by KV block, each block's
// tiles twice, the keys alone (pass 1), then with the values (pass 2).
template <class Visit>
__device__ __forceinline__ void slot_tiles(int lo, int hi, Visit visit) {
    const int t0 = lo / TILE_POS * TILE_POS;
    if constexpr (!EXACT_ORDER) {
        for (int st = t0; st <= hi; st += TILE_POS) visit(st, true);
    } else {
        for (int b0 = lo / KV_BLOCK * KV_BLOCK; b0 <= hi; b0 += KV_BLOCK) {
            const int t1 = min(b0 + KV_BLOCK, hi + 1);
            for (int pass = 0; pass < 2; ++pass)
                for (int st = max(b0, t0); st < t1; st += TILE_POS) visit(st, pass == 1);
        }
    }
}

// The producer: tile `it` goes into buffer it % stages once the tile before it there has been
// released (empty, parity of that use); a thread waits for its copies RING_LAG tiles later and
// arrives on the buffer's full barrier. Before it waits for a buffer, and at the end of a slot,
// it arrives for every tile it holds, so the computing warpgroups, which wait for a tile before
// they release an earlier one, never wait for a tile the producer holds back (and the block
// meets at the next slot's run_of). Then kv_append of the block's rows (where k is given, by the
// blocks of the first head group and slice), while the computing warpgroups take the tiles still
// in the ring. An item after the block's first
// (n > 0) copies q's rows once the computing warpgroups are done with the last item's.
template <int KCH, int VCH>
__device__ __forceinline__ void ring_produce(const WgSmem& s, const act_t* k, const act_t* v,
                                             const act_t* q, act_t* k_cache, act_t* v_cache,
                                             const int* positions, const int* slots, int rows,
                                             int hq, int hkv, int d, int max_ctx, int window,
                                             const WgPlace& at, int col0, int n, int& it,
                                             int& landed) {
    // it, landed: the block's tiles issued; those whose full barrier this thread arrived on
    const TileCrew crew = TileCrew::quarter((threadIdx.x >> 5) & 3, threadIdx.x & 31);
    const int G = hq / hkv;
    bool with_q = true;
    auto arrive = [&](int upto) {  // this thread's copies of tiles [landed, upto) have landed
        fence_async_shared();
        for (; landed < upto; ++landed) bar_arrive(s.full(landed % s.stages));
    };
    wg_for_each_slot(at, positions, slots, rows, window, k,
                     [&](int slot, int lo, int hi, AppendRun run) {
        slot_tiles(lo, hi, [&](int st, bool with_v) {
            const int b = it % s.stages, use = it / s.stages - 1;
            if (it >= s.stages && !bar_done(s.empty(b), use & 1)) {
                cp_async_wait<0>();  // never wait for a buffer holding tiles not yet announced
                arrive(it);
                bar_wait(s.empty(b), use & 1);
            }
            if (with_q && n > 0) bar_wait(s.qfree(), (n - 1) & 1);
            if (with_q)
                for (int wg = 0; wg < s.wgs; ++wg)
                    wg_issue_q<KCH>(s, q, at.row0, rows,
                                    at.kvh * G + min(at.hg * s.wgs + wg, G - 1), hq, d, wg);
            with_q = false;
            wg_issue_tile<KCH, VCH>(s, b, k_cache, v_cache, k, v, positions, slots, rows, slot,
                                    run, st, lo, hi, at.kvh, hkv, d, max_ctx, with_v, col0, crew);
            if (++it - landed > RING_LAG) {
                cp_async_wait<RING_LAG>();
                arrive(it - RING_LAG);
            }
        });
        cp_async_wait<0>();
        arrive(it);
    });
    if (k && at.hg == 0 && blockIdx.z == 0)
        wg_append_rows(k, v, k_cache, v_cache, positions, slots, at.row0, rows, at.kvh, hkv, d,
                       max_ctx);
}

// A computing warpgroup's place in the ring: take() waits for the next tile and gives its buffer,
// give() releases it once the warpgroup's wgmmas that read it are done.
struct Ring {
    const WgSmem& s;
    int it = 0;
    __device__ __forceinline__ explicit Ring(const WgSmem& s_) : s(s_) {}
    __device__ __forceinline__ int take() const {
        bar_wait(s.full(it % s.stages), (it / s.stages) & 1);
        return it % s.stages;
    }
    __device__ __forceinline__ void give() { bar_arrive(s.empty(it++ % s.stages)); }
};

// One block of either order: its barriers set up, then the producer's copies (and kv_append)
// and `compute` in the other warpgroups, each with the producer's registers.
template <int KCH, int VCH, class Compute>
__device__ __forceinline__ void wg_ring_block(const act_t* k, const act_t* v, const act_t* q,
                                              act_t* k_cache, act_t* v_cache,
                                              const int* positions, const int* slots, int rows,
                                              int hq, int hkv, int d, int max_ctx, int window,
                                              int stages, int col0, Compute compute) {
    const int wgs = blockDim.x / 128 - 1, G = hq / hkv, X = hkv * ((G + wgs - 1) / wgs);
    const int Y = EXACT_ORDER ? (int)gridDim.y : (rows + WG_ROWS - 1) / WG_ROWS;
    bool one_slot = false, direct = false;
    if (k && !EXACT_ORDER) launch_rows(positions, slots, rows, one_slot, direct);
    auto place = [&](int item) {
        WgPlace at(item, X, Y, G, wgs, positions, slots, rows, window);
        at.one_slot = one_slot;
        at.direct = direct;
        return at;
    };
    const WgSmem s(d, wgs, stages);
    if (threadIdx.x == 0) {
        for (int b = 0; b < stages; ++b) {
            bar_init(s.full(b), 128);
            bar_init(s.empty(b), 128 * wgs);
        }
        if (!EXACT_ORDER) bar_init(s.qfree(), 128 * wgs);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();  // the barriers are set up for every thread
    if ((int)(threadIdx.x >> 7) == wgs) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
        int it = 0, landed = 0;
        for_each_item(X, Y, [&](int item, int n) {
            ring_produce<KCH, VCH>(s, k, v, q, k_cache, v_cache, positions, slots, rows, hq, hkv,
                                   d, max_ctx, window, place(item), col0, n, it, landed);
        });
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));
    Ring ring(s);
    for_each_item(X, Y, [&](int item, int) { compute(s, place(item), ring); });
}

// ------------------------------------------------------------------ online

// A warpgroup's online softmax state for its 64 rows, the head in CH chunks (a constant, so
// that every wgmma's registers are known where it is issued): the lane's two rows' running max
// and sum, and its part of their outputs.
template <int CH>
struct OnlineRows {
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, acc[CH][32];
    __device__ __forceinline__ OnlineRows() {
#pragma unroll
        for (int ch = 0; ch < CH; ++ch)
#pragma unroll
            for (int i = 0; i < 32; ++i) acc[ch][i] = 0.0f;
    }
    // The outputs rescaled by a (online_block's factor), then p · v of buffer b's values issued
    // (one wgmma group, not waited for).
    __device__ __forceinline__ void add(const float (&a)[2], const uint32_t (&pa)[4][4],
                                        const WgSmem& s, int b) {
        if (!online_keeps(a)) {
#pragma unroll
            for (int ch = 0; ch < CH; ++ch)
#pragma unroll
                for (int i = 0; i < 32; ++i) acc[ch][i] *= a[(i & 3) >> 1];
        }
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int ch = 0; ch < CH; ++ch)
                wgmma_values(acc[ch], pa[kk],
                             n_major(s.at + s.v(b) + ch * CHUNK_BYTES + kk * 16 * 128));
        wgmma_commit();
    }
    // chunk ch's register 4 j + e is n8 tile 8 ch + j's element e: the head's n8 tiles in order
    __device__ __forceinline__ void store(const WgPlace& at, act_t* o, int hq, int d) const {
        online_store(reinterpret_cast<const float(&)[8 * CH][4]>(acc), l, at.rw, o, at.wrow0, hq,
                     at.head, d);
    }
};

// The online softmax of the warpgroup's 64 rows, each tile as the ring gives it. A warpgroup
// past its group's last head only keeps the count.
template <int CH>
__device__ __forceinline__ void online_consume(const WgSmem& s, const act_t* k,
                                               const int* positions, const int* slots, act_t* o,
                                               int rows, int hq, int d, int max_ctx, float scale,
                                               int window, const WgPlace& at, Ring& ring) {
    const float c = scale * 1.4426950408889634f;  // scores in log2 units
    OnlineRows<CH> rs;
    wg_for_each_slot(at, positions, slots, rows, window, k,
                     [&](int slot, int lo, int hi, AppendRun) {
        const Span sp[2] = {Span(at.rw[0], slot, 0, max_ctx), Span(at.rw[1], slot, 0, max_ctx)};
        slot_tiles(lo, hi, [&](int st, bool) {
            const int b = ring.take();
            if (at.active) {
                float sc[32], a[2];
                uint32_t pa[4][4];  // the weights as A fragments: positions 16 kk .. 16 kk + 15
                wg_scores<CH>(s, at.wg, b, sc);
                online_block(sc, sp, st, c, rs.m, rs.l, a, pa);
                rs.add(a, pa, s, b);
                wgmma_wait<0>();
            }
            ring.give();
        });
    });
    bar_arrive(s.qfree());  // every wgmma that read q's rows is done: the next item's may come
    if (at.active) rs.store(at, o, hq, d);
}

// grid (hkv ceil(G / WGS), ceil(rows / 64), 1), block 128 (WGS + 1) (WGS = min(2, G), G = hq /
// hkv: the warpgroups that compute, then the producer): kv_append, then attention. A launch it
// cannot serve traps (loud).
extern "C" __global__ void __launch_bounds__(128 * (WG_MAX + 1), 1)
metrale_kv_append_attention_wgmma_online_prefill(
    const act_t* __restrict__ k, const act_t* __restrict__ v, const act_t* __restrict__ q,
    act_t* k_cache, act_t* v_cache, const int* __restrict__ positions,
    const int* __restrict__ slots, act_t* __restrict__ o, int rows, int hq, int hkv, int d,
    int max_ctx, float scale, int window) {
    grid_dependency_sync();
    if (KV_BLOCK != TILE_POS ||
        !wg_launch_ok(rows, hq, hkv, d, 2 * 64, 1, false, 1, ONLINE_STAGES))
        __trap();
    auto run = [&](auto ch) {
        constexpr int CH = decltype(ch)::value;
        wg_ring_block<CH, CH>(k, v, q, k_cache, v_cache, positions, slots, rows, hq, hkv, d,
                              max_ctx, window, ONLINE_STAGES, 0,
                              [&](const WgSmem& s, const WgPlace& at, Ring& ring) {
            online_consume<CH>(s, k, positions, slots, o, rows, hq, d, max_ctx, scale, window,
                               at, ring);
        });
    };
    if (d > 64) run(std::integral_constant<int, 2>());
    else run(std::integral_constant<int, 1>());
}

// ------------------------------------------------------------------ two-pass

// The two-pass attention of the warpgroup's 64 rows at output columns col0 + [0, 64 VCH), the
// head's scores over KCH chunks (constants, as online_consume's), each tile as the ring gives
// it: a KV block's tiles for its max (pass 1), then again for its exponentials and the values
// they weigh (pass 2).
template <int KCH, int VCH>
__device__ __forceinline__ void exact_consume(const WgSmem& s, const act_t* k,
                                              const int* positions, const int* slots, act_t* o,
                                              int rows, int hq, int d, float scale, int window,
                                              const WgPlace& at, int col0, Ring& ring) {
    const int t = threadIdx.x & 3;
    float m[2] = {0.0f, 0.0f}, l[2] = {0.0f, 0.0f};
    // the running outputs in shared memory, register 32 ch + i of the fragment at acc[128 (32 ch
    // + i)]: in registers beside the block's own sums they spilled (ptxas, sm_90a)
    float* acc = s.outputs(at.wg) + (threadIdx.x & 127);
#pragma unroll
    for (int i = 0; i < 32 * VCH; ++i) acc[128 * i] = 0.0f;
    wg_for_each_slot(at, positions, slots, rows, window, k,
                     [&](int slot, int lo, int hi, AppendRun) {
        for (int b0 = lo / KV_BLOCK * KV_BLOCK; b0 <= hi; b0 += KV_BLOCK) {
            const int t0 = max(b0, lo / TILE_POS * TILE_POS), t1 = min(b0 + KV_BLOCK, hi + 1);
            const Span sp[2] = {Span(at.rw[0], slot, b0, KV_BLOCK),
                                Span(at.rw[1], slot, b0, KV_BLOCK)};
            // pass 1: the block's max score of each row
            float mb[2] = {-INFINITY, -INFINITY};
            for (int st = t0; st < t1; st += TILE_POS) {
                const int b = ring.take();
                if (at.active) {
                    float sc[32];
                    wg_scores<KCH>(s, at.wg, b, sc);
                    const bool whole = whole_tile(sp, st);
#pragma unroll
                    for (int i = 0; i < 32; ++i) {  // register 4 ni + e: n8 tile ni, element e
                        const int h = (i & 3) >> 1, pos = st + 8 * (i >> 2) + 2 * t + (i & 1);
                        if (whole || sp[h].has(pos)) mb[h] = fmaxf(mb[h], sc[i] * scale);
                    }
                }
                ring.give();
            }
            mb[0] = quad_max(mb[0]);
            mb[1] = quad_max(mb[1]);
            // pass 2: exponentials, their sum and the values they weigh
            float lb[2] = {0.0f, 0.0f}, ab[VCH][32];
#pragma unroll
            for (int ch = 0; ch < VCH; ++ch)
#pragma unroll
                for (int i = 0; i < 32; ++i) ab[ch][i] = 0.0f;
            for (int st = t0; st < t1; st += TILE_POS) {
                const int b = ring.take();
                if (at.active) {
                    float sc[32];
                    wg_scores<KCH>(s, at.wg, b, sc);
                    const bool whole = whole_tile(sp, st);
#pragma unroll
                    for (int i = 0; i < 32; ++i) {
                        const int h = (i & 3) >> 1, pos = st + 8 * (i >> 2) + 2 * t + (i & 1);
                        // exp of every score, then the mask (a masked score's exp is dropped)
                        const float ex = expf(sc[i] * scale - mb[h]);
                        sc[i] = whole || sp[h].has(pos) ? ex : 0.0f;
                        lb[h] += sc[i];
                    }
                    // positions 16 kk .. 16 kk + 15 at a time: their parts (12 registers, not
                    // 48) live until their wgmmas are done
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk) {
                        uint32_t a[3][4];  // e's parts as A fragments
#pragma unroll
                        for (int r = 0; r < 4; ++r)  // word r: n8 tile 2 kk + r / 2, row half r % 2
                            split3(sc[8 * kk + 4 * (r / 2) + 2 * (r % 2)],
                                   sc[8 * kk + 4 * (r / 2) + 2 * (r % 2) + 1], a[0][r], a[1][r],
                                   a[2][r]);
                        wgmma_fence();
#pragma unroll
                        for (int ch = 0; ch < VCH; ++ch)
#pragma unroll
                            for (int part = 0; part < 3; ++part)
                                wgmma_values(ab[ch], a[part],
                                             n_major(s.at + s.v(b) + ch * CHUNK_BYTES + kk * 2048));
                        wgmma_commit();
                        wgmma_wait<0>();
                    }
                }
                ring.give();
            }
            if (!at.active) continue;
            // the block merges into the running state, left to right, for the rows it has
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float lsum = quad_sum(lb[h]);
                if (mb[h] == -INFINITY) continue;  // no position of this row in the block
                const BlockMerge f = merge_block(mb[h], lsum, m[h], l[h]);
#pragma unroll
                for (int ch = 0; ch < VCH; ++ch)
#pragma unroll
                    for (int i = 0; i < 32; ++i)
                        if ((i & 3) >> 1 == h) {
                            float& x = acc[128 * (32 * ch + i)];
                            x = f.first ? ab[ch][i] : x * f.ar + ab[ch][i] * f.bw;
                        }
            }
        }
    });
    if (!at.active) return;
    float out[8 * VCH][4];
#pragma unroll
    for (int i = 0; i < 32 * VCH; ++i) out[i / 4][i % 4] = acc[128 * i];
    store_rows(out, l, at.rw, o, at.wrow0, hq, at.head, d, col0);
}

// The two-pass attention's launch, kv_append first where k is given.
__device__ __forceinline__ void wg_two_pass(const act_t* k, const act_t* v, const act_t* q,
                                            act_t* k_cache, act_t* v_cache, const int* positions,
                                            const int* slots, act_t* o, int rows, int hq, int hkv,
                                            int d, int max_ctx, float scale, int window) {
    if (KV_BLOCK == TILE_POS ||
        !wg_launch_ok(rows, hq, hkv, d, 4 * 64, (d + WG_SLICE - 1) / WG_SLICE, true, 1,
                      EXACT_STAGES))
        __trap();
    const int col0 = blockIdx.z * WG_SLICE;
    auto run = [&](auto kch, auto vch) {
        constexpr int KCH = decltype(kch)::value, VCH = decltype(vch)::value;
        wg_ring_block<KCH, VCH>(k, v, q, k_cache, v_cache, positions, slots, rows, hq, hkv, d,
                                max_ctx, window, EXACT_STAGES, col0,
                                [&](const WgSmem& s, const WgPlace& at, Ring& ring) {
            exact_consume<KCH, VCH>(s, k, positions, slots, o, rows, hq, d, scale, window, at,
                                    col0, ring);
        });
    };
    if (d <= 64) run(std::integral_constant<int, 1>(), std::integral_constant<int, 1>());
    else if (d <= 128) run(std::integral_constant<int, 2>(), std::integral_constant<int, 2>());
    else run(std::integral_constant<int, 4>(), std::integral_constant<int, 2>());
}

// grid (hkv ceil(G / WGS), ceil(rows / 64), ceil(d / 128)), block 128 (WGS + 1) (as the online
// entry's). attention at its prefill point: the cache holds every position.
extern "C" __global__ void __launch_bounds__(128 * (WG_MAX + 1), 1)
metrale_wgmma_attention_prefill(const act_t* __restrict__ q, const act_t* __restrict__ k_cache,
                                const act_t* __restrict__ v_cache,
                                const int* __restrict__ positions, const int* __restrict__ slots,
                                act_t* __restrict__ o, int rows, int hq, int hkv, int d,
                                int max_ctx, float scale, int window) {
    grid_dependency_sync();
    wg_two_pass(nullptr, nullptr, q, const_cast<act_t*>(k_cache), const_cast<act_t*>(v_cache),
                positions, slots, o, rows, hq, hkv, d, max_ctx, scale, window);
}

// kv_append then attention (the same grid): every block reads the positions the launch appends
// from k, v.
extern "C" __global__ void __launch_bounds__(128 * (WG_MAX + 1), 1)
metrale_kv_append_wgmma_attention_prefill(
    const act_t* __restrict__ k, const act_t* __restrict__ v, const act_t* __restrict__ q,
    act_t* k_cache, act_t* v_cache, const int* __restrict__ positions,
    const int* __restrict__ slots, act_t* __restrict__ o, int rows, int hq, int hkv, int d,
    int max_ctx, float scale, int window) {
    grid_dependency_sync();
    wg_two_pass(k, v, q, k_cache, v_cache, positions, slots, o, rows, hq, hkv, d, max_ctx, scale,
                window);
}

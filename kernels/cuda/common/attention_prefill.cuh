// Metrale CUDA: what the prefill attention kernels share (attention_prefill.cu, the declared
// two-pass order; attention_online.cu and sm_90's attention_wgmma.cu, the online softmax): the
// rows a block takes, the key and value tiles through shared memory, the kv_append of a block's
// rows, the online softmax's step, the launch checks.
//
// A block takes one kv head and RT tiles of 16 rows of the launch (RT = blockDim.x / 32 G, with
// G = hq / hkv): warp w computes q head kv_head * G + w % G for the rows of tile w / G, so the
// block's warps share every key and value tile they load. Blocks take their rows from the end of
// the launch (the rows of a prompt that attend to the most positions start first, and the short
// ones fill the last wave). Keys and values come through shared memory in tiles of 64
// positions, the next tile's loads in flight during this one's MMAs where two buffers fit (head
// dim up to 128); each tile first finds the global row of each of its positions once, so its
// copies are a pointer and an offset each (an Nsight Compute profile had the index arithmetic
// of the copies at over half of the kernel's instructions, docs/gpu-notes.md, version 26).
// Rows of a block in different slots are served slot after slot (for_each_slot). The
// kv_append entries write the block's rows into the cache (append_rows) and read every
// position some row of the launch appends from k, v instead of the cache, so no block reads
// what another writes.
#pragma once
#include "metrale.cuh"
#include "mma.cuh"

#if !defined(ACT_BF16)
#error "the tensor-core attention takes bf16 activations (KERNELS.toml's `when`)"
#endif

#define TILE_ROWS 16    // rows of one m16 tile: a warp's
#define MAX_ROW_TILES 4 // row tiles of a block (its rows: at most 64)
#define TILE_POS 64     // positions of a key / value tile
#define SLICE 128       // output columns a block computes (grid z)
#define MAX_HEAD_DIM 256
#define MAX_GROUP 8   // q heads per kv head: a warp each, and registers for 8 warps a block
#define MAX_WARPS 8   // a block's warps, G of each row tile (__launch_bounds__)
#define KPITCH(d) ((d) + 8)   // bf16 per key row in shared memory: ldmatrix's rows in 8 banks
#define VPITCH (SLICE + 8)

// One buffer of key and value tiles: keys [TILE_POS][KPITCH(d)], the slice's values
// [TILE_POS][VPITCH]; per position the global rows its key and its values come from (null:
// no row of the slot attends to it, zero-filled), and the launch row appending it (or -1; only
// where the rows are scanned).
struct KvTile {
    bf16* k;
    bf16* v;
    const act_t** krow;
    const act_t** vrow;
    int* src;
};

// Two buffers up to head_dim 128 (the next tile's loads in flight during this one's MMAs), one
// above it: KERNELS.toml's launch.shared is (2 - d // 129) buffers of 128 (d + 8) + 128 136 +
// 1280 bytes, within the 99 KiB every class allows.
struct PrefillSmem {
    unsigned char* base;
    int d, bufs, bytes;
    __device__ __forceinline__ PrefillSmem(int d_)
        : d(d_), bufs(2 - d_ / 129),
          bytes(128 * KPITCH(d_) + 2 * TILE_POS * VPITCH + 20 * TILE_POS) {
        extern __shared__ __align__(16) unsigned char smem_base[];
        base = smem_base;
    }
    __device__ __forceinline__ KvTile tile(int b) const {  // b in [0, bufs)
        KvTile t;
        t.k = (bf16*)(base + b * bytes);
        t.v = t.k + TILE_POS * KPITCH(d);
        t.krow = (const act_t**)(t.v + TILE_POS * VPITCH);
        t.vrow = t.krow + TILE_POS;
        t.src = (int*)(t.vrow + TILE_POS);
        return t;
    }
};

// The rows of the launch a block takes: RT tiles of 16 from block_row0, the blocks in reverse
// order of blockIdx.y (the last rows first).
__device__ __forceinline__ int block_row_count(int G) {
    return TILE_ROWS * (int)(blockDim.x / (32 * G));
}
__device__ __forceinline__ int block_row0(int G) {
    return (int)(gridDim.y - 1 - blockIdx.y) * block_row_count(G);
}

// One row of the tile as a lane sees it: its slot and the positions it attends to, [lo, p];
// live is false past the launch's rows.
struct RowInfo {
    int slot, lo, p;
    bool live;
};

__device__ __forceinline__ RowInfo row_info(int row, int rows, const int* positions,
                                            const int* slots, int window) {
    RowInfo r;
    r.live = row < rows;
    r.slot = r.live ? slots[row] : -1;
    r.p = r.live ? positions[row] : -1;
    r.lo = window > 0 ? max(0, r.p - window + 1) : 0;
    return r;
}

// Which row of the launch appends a position of one slot (kv_append_attention): with `direct`,
// every row r of the slot appends position base + r (a prompt in launch order: what prefill
// launches), so position p can only come from row p - base, checked in O(1); otherwise a tile
// scans every row of the launch. run_of decides it once per slot, every thread together.
struct AppendRun {
    bool direct;
    bool alone;  // every row of the launch is of this slot: with direct, row c appends base + c
    int base;
};

__device__ __forceinline__ AppendRun run_of(const int* positions, const int* slots, int rows,
                                            int slot, int first_row) {
    __shared__ int irregular, others;
    AppendRun run;
    run.base = positions[first_row] - first_row;
    if (threadIdx.x == 0) irregular = others = 0;
    __syncthreads();
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
        if (slots[r] != slot) atomicAdd(&others, 1);
        else if (positions[r] - r != run.base) atomicAdd(&irregular, 1);
    }
    __syncthreads();
    run.direct = !irregular;
    run.alone = !others;
    __syncthreads();  // every thread has read them before the next slot's run_of resets them
    return run;
}

// n16 16-byte pieces of each of the TILE_POS rows row[j] into dst + j * pitch, every thread of
// the block in turn (piece i: row i / n16, piece i % n16, stepped without divisions; n16 is at
// most 32, never more than the block's threads); a null row is zero-filled (cp.async reading 0
// bytes of `any`, a valid address).
__device__ __forceinline__ void copy_rows(bf16* dst, int pitch, const act_t* const* row, int n16,
                                          const act_t* any) {
    const int nt = blockDim.x, dj = nt / n16, dc = nt - dj * n16;
    int j = threadIdx.x / n16, c = threadIdx.x - j * n16;
    if (dc == 0) {  // the block's threads cover whole rows: each thread keeps its column
        for (const int off = 8 * c; j < TILE_POS; j += dj) {
            const act_t* src = row[j];
            cp_async16(dst + j * pitch + off, src ? src + off : any, src ? 16 : 0);
        }
        return;
    }
    while (j < TILE_POS) {
        const act_t* src = row[j];
        cp_async16(dst + j * pitch + 8 * c, src ? src + 8 * c : any, src ? 16 : 0);
        c += dc;
        j += dj;
        if (c >= n16) {
            c -= n16;
            ++j;
        }
    }
}

// Keys (and, with `with_v`, the slice's values) of positions [start, start + 64) of `slot` into
// the buffer `s`, asynchronously (one cp.async group; the caller waits): from k_new / v_new where
// a row of the launch appends the position, else from the cache; zeros outside [lo, hi], the
// positions some row of the slot attends to, so that no entry the cache never had written (NaN
// bits, say) meets the MMAs, even with a weight of 0.
__device__ __forceinline__ void issue_kv_tile(const KvTile& s, const act_t* k_cache,
                                              const act_t* v_cache, const act_t* k_new,
                                              const act_t* v_new, const int* positions,
                                              const int* slots, int rows, int slot,
                                              AppendRun run, int start, int lo, int hi, int kvh,
                                              int hkv, int d, int max_ctx, int col0, int ncols,
                                              bool with_v) {
    const int nt = blockDim.x;
    if (k_new && !run.direct) {  // which rows append the tile's positions: every row scanned
        for (int j = threadIdx.x; j < TILE_POS; j += nt) s.src[j] = -1;
        __syncthreads();
        for (int r = threadIdx.x; r < rows; r += nt)
            if (slots[r] == slot && positions[r] >= start && positions[r] < start + TILE_POS)
                s.src[positions[r] - start] = r;
        __syncthreads();
    }
    for (int j = threadIdx.x; j < TILE_POS; j += nt) {
        const int pos = start + j;
        int r = -1;
        if (k_new && run.direct) {  // a prompt in launch order: only row pos - base can append
            const int c = pos - run.base;  // (a launch of one slot: it does, with no loads)
            r = c >= 0 && c < rows && (run.alone || (slots[c] == slot && positions[c] == pos))
                    ? c : -1;
        } else if (k_new) {
            r = s.src[j];
        }
        const bool live = pos >= lo && pos <= hi;
        const long off = r >= 0 ? ((long)r * hkv + kvh) * d
                                : (((long)slot * max_ctx + pos) * hkv + kvh) * d;
        s.krow[j] = live ? (r >= 0 ? k_new : k_cache) + off : nullptr;
        s.vrow[j] = live ? (r >= 0 ? v_new : v_cache) + off + col0 : nullptr;
    }
    __syncthreads();  // the rows are found, for every thread
    copy_rows(s.k, KPITCH(d), s.krow, d / 8, k_cache);
    if (with_v) copy_rows(s.v, VPITCH, s.vrow, ncols / 8, v_cache);
    cp_async_commit();
}

// body(tile, start) for the tiles of positions [t0, t1) in steps of 64, every thread of the
// block together: with two buffers the next tile's loads are issued before this one's body
// runs, and the block meets before a buffer is refilled.
template <class Issue, class Body>
__device__ __forceinline__ void over_tiles(const PrefillSmem& s, int t0, int t1, Issue issue,
                                           Body body) {
    issue(s.tile(0), t0);
    for (int st = t0, i = 0; st < t1; st += TILE_POS, ++i) {
        const bool more = st + TILE_POS < t1;
        if (more && s.bufs == 2) {
            issue(s.tile((i + 1) & 1), st + TILE_POS);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // this tile is in, for every warp
        body(s.tile(s.bufs == 2 ? i & 1 : 0), st);
        __syncthreads();  // every warp is done with it before its buffer is refilled
        if (more && s.bufs == 1) issue(s.tile(0), st + TILE_POS);
    }
}

// s[ni][e] = (q · k) * scale for the warp's 16 rows and the tile's 64 positions (n8 tile ni,
// the MMA's accumulator layout: row g + 8 (e / 2), position 8 ni + 2 t + e % 2), q's fragments
// read from global memory (each lane its own two rows), keys from shared memory.
__device__ __forceinline__ void tile_scores(const bf16* keys, const act_t* q0,
                                            const act_t* q8, int d, float scale,
                                            float (&sc)[8][4]) {
    const int lane = threadIdx.x & 31, t = lane & 3;
#pragma unroll
    for (int ni = 0; ni < 8; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[ni][e] = 0.0f;
    for (int kk = 0; kk < d; kk += 16) {
        uint32_t a[4];
        a[0] = *(const uint32_t*)(q0 + kk + 2 * t);
        a[1] = *(const uint32_t*)(q8 + kk + 2 * t);
        a[2] = *(const uint32_t*)(q0 + kk + 8 + 2 * t);
        a[3] = *(const uint32_t*)(q8 + kk + 8 + 2 * t);
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // positions 16 j .. 16 j + 15: two n8 tiles
            uint32_t b[4];
            ldmatrix_x4(b, keys + (16 * j + (lane & 7) + ((lane >> 4) << 3)) * KPITCH(d) + kk +
                               ((lane >> 3) & 1) * 8);
            mma_bf16(sc[2 * j], a, b[0], b[1]);
            mma_bf16(sc[2 * j + 1], a, b[2], b[3]);
        }
    }
#pragma unroll
    for (int ni = 0; ni < 8; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[ni][e] *= scale;
}

// The positions [from, to] a row attends to within the block of n positions from b0 of `slot`
// (none where from > to).
struct Span {
    int from, to;
    __device__ __forceinline__ Span(const RowInfo& r, int slot, int b0, int n)
        : from(r.live && r.slot == slot ? max(r.lo, b0) : 0x7fffffff),
          to(min(r.p, b0 + n - 1)) {}
    __device__ __forceinline__ bool has(int pos) const { return pos >= from && pos <= to; }
    __device__ __forceinline__ bool covers(int st) const {  // all of tile [st, st + 64)
        return from <= st && st + TILE_POS - 1 <= to;
    }
};

// Whether the warp's rows (two a lane) each attend to every position of the tile at st: then
// the tile needs no per-position masks (a warp-uniform answer).
__device__ __forceinline__ bool whole_tile(const Span (&sp)[2], int st) {
    return __all_sync(0xffffffffu, sp[0].covers(st) && sp[1].covers(st));
}

// The max over the four lanes of a row (lanes 4 g .. 4 g + 3), the same in each.
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// body(slot, lo, hi, run) for each slot the rows [row0, row0 + block_rows) of the launch hold
// (at most 64), in the order of their first rows (every thread walks the same sequence): [lo,
// hi] the positions some row of the slot attends to, run its AppendRun (kv_append entries,
// k_new given) for issue_kv_tile.
template <class Body>
__device__ __forceinline__ void for_each_slot_of(int row0, int block_rows, const int* positions,
                                                 const int* slots, int rows, int window,
                                                 const act_t* k_new, Body body) {
    unsigned long long done = 0;
    for (int i = 0; i < block_rows; ++i) {
        if (done >> i & 1ull) continue;
        const RowInfo ri = row_info(row0 + i, rows, positions, slots, window);
        if (!ri.live) break;
        const int slot = ri.slot;
        int lo = ri.lo, hi = ri.p;
        for (int j = i; j < block_rows; ++j) {
            const RowInfo rj = row_info(row0 + j, rows, positions, slots, window);
            if (rj.live && rj.slot == slot) {
                done |= 1ull << j;
                lo = min(lo, rj.lo);
                hi = max(hi, rj.p);
            }
        }
        const AppendRun run = k_new ? run_of(positions, slots, rows, slot, row0 + i)
                                    : AppendRun{false, false, 0};
        body(slot, lo, hi, run);
    }
}

// for_each_slot_of the block's rows (block_row0, block_row_count).
template <class Body>
__device__ __forceinline__ void for_each_slot(const int* positions, const int* slots, int rows,
                                              int window, int G, const act_t* k_new,
                                              Body body) {
    for_each_slot_of(block_row0(G), block_row_count(G), positions, slots, rows, window, k_new,
                     body);
}

// ------------------------------------------------------------------ the online softmax

// 2^x by the multi-function unit, a result below 2^-126 flushed to zero: exp2f's handling of
// subnormal results (a compare and two multiplies a value) measured a seventh of sm_90's online
// kernel's instructions a tile. A weight below 2^-126 of its row's largest weighs at most that
// much of a value, inside online_prefill_attention's bound.
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Two f32 values rounded to bf16, as one A operand word; r0, r1 the rounded values.
__device__ __forceinline__ uint32_t pack_bf16(float x0, float x1, float& r0, float& r1) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
    r0 = __low2float(h);
    r1 = __high2float(h);
    return *reinterpret_cast<const uint32_t*>(&h);
}

// One KV block of the online softmax (attention_online.cu's order) for a warp's 16 rows, the
// lane's two: its scores sc (register 4 ni + e: n8 tile ni, element e, as an MMA accumulates
// them) taken to log2 units by c and masked where a row does not attend (a warp whose rows all
// attend to the whole block skips the masks); the rows' running max m; the factor a their
// earlier sums and outputs take; the weights p = 2^(s - m) rounded to bf16 as A fragments
// (pa[kk]: positions 16 kk .. 16 kk + 15), summed into l in the lane's order. A row with no
// position yet keeps its state (a = 1, p = 2^(-inf) = 0).
__device__ __forceinline__ void online_block(float (&sc)[32], const Span (&sp)[2], int st,
                                             float c, float (&m)[2], float (&l)[2],
                                             float (&a)[2], uint32_t (&pa)[4][4]) {
    const int t = threadIdx.x & 3;
    float mt[2] = {-INFINITY, -INFINITY};
    if (whole_tile(sp, st)) {
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            sc[i] *= c;
            mt[(i & 3) >> 1] = fmaxf(mt[(i & 3) >> 1], sc[i]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const int h = (i & 3) >> 1, pos = st + 8 * (i >> 2) + 2 * t + (i & 1);
            sc[i] = sp[h].has(pos) ? sc[i] * c : -INFINITY;
            mt[h] = fmaxf(mt[h], sc[i]);
        }
    }
    float mc[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float mn = fmaxf(m[h], quad_max(mt[h]));
        a[h] = mn == -INFINITY ? 1.0f : exp2_ftz(m[h] - mn);
        mc[h] = mn == -INFINITY ? 0.0f : mn;
        m[h] = mn;
    }
    float ls[2] = {0.0f, 0.0f};
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) {  // word r: n8 tile 2 kk + r / 2, row half r % 2
            const int ni = 2 * kk + r / 2, h = r % 2;
            float p0, p1;
            pa[kk][r] = pack_bf16(exp2_ftz(sc[4 * ni + 2 * h] - mc[h]),
                                  exp2_ftz(sc[4 * ni + 2 * h + 1] - mc[h]), p0, p1);
            ls[h] += p0;
            ls[h] += p1;
        }
    l[0] = l[0] * a[0] + ls[0];
    l[1] = l[1] * a[1] + ls[1];
}

// o = acc / l for the lane's two rows (rw; the warp's rows from row0), l each row's whole sum,
// rounded to act: acc in NT n8 tiles of the MMA's accumulator layout (tile ni: columns col0 +
// 8 ni + 2 t + {0, 1} of rows g, g + 8), those of the head's d columns.
template <int NT>
__device__ __forceinline__ void store_rows(const float (&acc)[NT][4], const float (&l)[2],
                                           const RowInfo (&rw)[2], act_t* o, int row0, int hq,
                                           int head, int d, int col0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (!rw[h].live) continue;
        act_t* orow = o + ((long)(row0 + g + 8 * h) * hq + head) * d + col0;
#pragma unroll
        for (int ni = 0; ni < NT; ++ni) {
            if (col0 + 8 * ni >= d) break;
            orow[8 * ni + 2 * t] = act_store(acc[ni][2 * h] / l[h]);
            orow[8 * ni + 2 * t + 1] = act_store(acc[ni][2 * h + 1] / l[h]);
        }
    }
}

// The online softmax's rows stored: l the lane's part of each row's sum, the four lanes' summed.
template <int NT>
__device__ __forceinline__ void online_store(const float (&acc)[NT][4], const float (&l)[2],
                                             const RowInfo (&rw)[2], act_t* o, int row0, int hq,
                                             int head, int d) {
    const float lsum[2] = {quad_sum(l[0]), quad_sum(l[1])};
    store_rows(acc, lsum, rw, o, row0, hq, head, d, 0);
}

// Three bf16 parts of x whose sum is x (f32 has 24 significant bits; each part takes the next 8,
// rounded, so the remainders fit), as the hi, mid and lo halves of the A operand words.
__device__ __forceinline__ void split3(float x0, float x1, uint32_t& hi, uint32_t& mid,
                                       uint32_t& lo) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
    const float r0 = x0 - __low2float(h), r1 = x1 - __high2float(h);
    const __nv_bfloat162 m = __floats2bfloat162_rn(r0, r1);
    const __nv_bfloat162 l = __floats2bfloat162_rn(r0 - __low2float(m), r1 - __high2float(m));
    hi = *reinterpret_cast<const uint32_t*>(&h);
    mid = *reinterpret_cast<const uint32_t*>(&m);
    lo = *reinterpret_cast<const uint32_t*>(&l);
}

// The two-pass order's merge of a KV block into a row's running max m and sum l (the
// log-sum-exp rule, left to right), given the block's max mb and the four lanes' summed lsum of
// its exponentials: whether it is the row's first block (l is 0 until then, and at least 1
// after: exp(0) counts), where the block's outputs become the running ones as they are, else
// the factors ar of the running outputs and bw of the block's.
struct BlockMerge {
    bool first;
    float ar, bw;
};
__device__ __forceinline__ BlockMerge merge_block(float mb, float lsum, float& m, float& l) {
    BlockMerge f{l == 0.0f, 1.0f, 1.0f};
    if (f.first) {
        m = mb;
        l = lsum;
    } else {
        const float mn = fmaxf(m, mb);
        f.ar = expf(m - mn);
        f.bw = expf(mb - mn);
        l = l * f.ar + lsum * f.bw;
        m = mn;
    }
    return f;
}

// Whether the warp's rows all keep their earlier sums as they are (a = 1): acc times 1 is acc,
// every bit, so the warp skips the multiplies.
__device__ __forceinline__ bool online_keeps(const float (&a)[2]) {
    return __all_sync(0xffffffffu, a[0] == 1.0f && a[1] == 1.0f);
}

// kv_append for the block's rows: their k, v of its kv head into the cache, 16 bytes a copy
// (d % 8 == 0 keeps rows 16-byte aligned): thread i takes piece i % n8 of row i / n8, stepped as
// copy_rows steps. The caller lets one block of each (kv head, rows) do it.
__device__ __forceinline__ void append_rows(const act_t* k, const act_t* v, act_t* k_cache,
                                            act_t* v_cache, const int* positions,
                                            const int* slots, int rows, int hq, int hkv, int d,
                                            int max_ctx) {
    const int kvh = blockIdx.x, row0 = block_row0(hq / hkv);
    const int n8 = d / 8, nrows = min(block_row_count(hq / hkv), rows - row0);
    const int dj = blockDim.x / n8, dc = blockDim.x - dj * n8;
    for (int j = threadIdx.x / n8, c = threadIdx.x - j * n8; j < nrows;) {
        const int row = row0 + j;
        const long src = ((long)row * hkv + kvh) * d + 8 * c;
        const long dst = (((long)slots[row] * max_ctx + positions[row]) * hkv + kvh) * d + 8 * c;
        *(uint4*)(k_cache + dst) = *(const uint4*)(k + src);
        *(uint4*)(v_cache + dst) = *(const uint4*)(v + src);
        c += dc;
        j += dj;
        if (c >= n8) {
            c -= n8;
            ++j;
        }
    }
}

// A launch the kernel cannot serve: a shape past its limits, a block that is not whole row tiles
// of G warps, a grid short of the rows, or less dynamic shared memory than its tiles take.
__device__ __forceinline__ bool prefill_launch_ok(int rows, int d, int hq, int hkv,
                                                  int max_head_dim) {
    if (d % 16 || d > max_head_dim || hq % hkv || hq / hkv > MAX_GROUP) return false;
    const int G = hq / hkv, rt = blockDim.x / (32 * G);
    const PrefillSmem s(d);
    return (int)blockDim.x == 32 * G * rt && rt >= 1 && rt <= MAX_ROW_TILES &&
           (long)gridDim.y * TILE_ROWS * rt >= rows && dynamic_smem_bytes() >= s.bufs * s.bytes;
}


// Metrale CUDA: decode attention, split across kv heads and chunks of positions.
//
// Decode rows are separate sequences (distinct cache slots). One thread block per (kv head, row,
// chunk of CHUNK positions) computes every q head of that kv head's GQA group over its chunk, so
// each k and v row is read once per launch, by one multiprocessor. (A block per q head, the
// previous design, read a group's rows G times; its phase marks showed a block waiting about
// 6 of its 11 µs for its 128 KB of rows.) Groups of more than four q heads are split over HS =
// gridDim.x / hkv blocks (KERNELS.toml: G / 4 of them), each taking a contiguous part of the
// heads (G = 8: two blocks of four): at 4 kv heads one block per kv head and chunk filled half
// of the H200's SMs. Those blocks each read the chunk's rows. A block copies its 2 CHUNK rows
// (32 KB at head_dim 128, bf16) into shared memory asynchronously, before the dependent-launch
// wait. Below, G is the block's q heads.
// Inside a block, for its live positions (the row's window inside the chunk):
//   scores: T lanes per (q head, position) pair (T a power of two, the most that fits 256
//           threads; 1 from G = 4 up) dot q with the k row in f32, each lane over the 8-column
//           chunks li, li + T, ... in four chains, then the T lanes meet in a butterfly tree;
//   softmax: one warp per q head: the chunk's max, exp(s - max), and their warp-tree sum;
//   p·v:    thread t takes 8 output columns of one q head (unit t mod U, U = G d / 8) and the
//           positions lo + sub, lo + sub + S, ... (sub = t / U, S = 256 / U); the S partials
//           of each column are summed in sub order.
// Each chunk's record per q head (max m, sum l, unnormalized p·v) goes to the launch's scratch
// (bytes from KERNELS.toml `values.work`), and a second launch, metrale_attention_decode_merge
// (KERNELS.toml's `then`), merges them with a block per (q head, row): a window of records
// copied into shared memory at once; within a KV_BLOCK of absolute positions the chunks in
// closed form (block max, factors exp(m - max), sums in chunk order), then the blocks left to
// right by the log-sum-exp rule (the declared order: blocks of KV_BLOCK, combined
// sequentially); o = acc / l. The merge was the decode kernel's last block's (a ticket per kv
// head, then one block merging G d columns: 8 blocks for Llama-3.1-8B's row); its phase marks
// had it at 4.6 of that kernel's 10.9 µs (docs/gpu-notes.md, version 10).
// Dependent launch: positions, slots, the cache rows before this step's position and the rope
// table rows are read (copied) before the wait for the previous launch (grid_dependency_sync):
// the host writes the first two before the step, earlier steps the rows, and nothing the
// tables; q, the new k and v, and every write come after it.
// Shapes outside head_dim <= 256 (a multiple of 8), q heads not a multiple of kv heads, more
// than MAX_G q heads per kv head or G·head_dim > MAX_GD, a grid or a dynamic shared memory
// that is not the one KERNELS.toml gives, or a position past max_ctx trap: a loud device
// fault, never a silently unwritten output.
// kv_append_attention additionally writes the row's new k, v into the cache at its position
// (the block holding that position does, after its reads) and takes them from its inputs.
// rope_kv_append_attention and qk_norm_rope_kv_append_attention first rotate (qk_norm_rope: also
// normalize) the group's q heads and, in the block holding the row's position, the new k head,
// with rope.cu's and norm.cu's own functions (rotate_head, head_norm), so the bytes are those of
// the two launches they replace; the rotated k is what the block reads and appends.
// Loops step without run-time divisions (HeadCol): on the H200 each one was a dependent chain
// that, in loops, cost microseconds (benchmarks/trace_gpu_attention.py).
// Defines: ACT_*, KV_BLOCK (256), CHUNK (64); for the rope entries ROPE_NEOX |
// ROPE_INTERLEAVED, and H_BLOCK for the normalizing one; PHASE_TRACE (phase.cuh) for profiling.
#include "metrale.cuh"
#include "mma.cuh"  // cp_async16, cp_async_commit, cp_async_wait
#include "phase.cuh"
#if defined(ROPE_NEOX) || defined(ROPE_INTERLEAVED)
#include "rope.cuh"
#if defined(H_BLOCK)
#include "head_norm.cuh"
#endif
#endif

#ifndef CHUNK
#error "define CHUNK (positions per thread block; KERNELS.toml's grid divides max_ctx by it)"
#endif
// grid_dependency_sync's wait without its release: the launch after this one starts its blocks
// only as this launch's blocks exit. The merge launch uses it.
// With o_proj released at the merge's start, or after its wait, Llama-3.1-8B's batch-8 step
// measured about 75 µs a layer slower (docs/gpu-notes.md, version 21).
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

#define NT 256       // threads per block
#define MAX_G 16     // q heads per kv head
#define MAX_GD 2048  // q heads per kv head times head_dim: at most one p·v unit per thread

static_assert(KV_BLOCK % CHUNK == 0 && CHUNK % 32 == 0 && CHUNK <= NT,
              "a chunk is whole warps of positions inside one KV block");

// The scratch of one launch (nch = chunks per row = gridDim.z): one record per (row, q head,
// chunk), [rows, hq, nch, d + 4] floats: the chunk's max m, sum l, two unused floats (16-byte
// alignment), and its d p·v partials, so that the merge copies a window of them in one sweep.
// The merge reads only the records of the chunks its row's window covers, which the decode
// launch before it wrote, so nothing relies on the scratch's zero bytes.

// The block's shared memory, carved from the dynamic allocation in this order (each piece
// 16-byte aligned), as KERNELS.toml's `launch.shared` sizes it; the kernel traps if it got
// less. The tiles' regions are sized for 4-byte activations and the widest padding whatever
// the act.
struct DecodeSmem {
    char* ktile;     // CHUNK k rows, ks bytes apart (16 T bytes of padding: no bank conflicts)
    char* vtile;     // CHUNK v rows, vs bytes apart
    int tiles;       // bytes of the two tiles' regions, from ktile
    float* qs;       // [G][d] the q heads, f32
    float* probs;    // [G][CHUNK] scores, then exp(s - m)
    float* part;     // [NT][8] p·v partials: [sub][unit][8]
    float* pre_in;   // [G + 1][d] q heads and the new k before the rotation
    act_t* pre_out;  // [G][d] q heads after it
    float* cs;       // [d/2] the rope table rows at the position
    float* sn;
    float* ml;       // [G][2] the chunk's max and sum per q head
    int ks, vs, bytes;
    __device__ DecodeSmem(char* base, int G, int d, int T) {
        int at = 0;
        auto take = [&](int n) {
            char* p = base + at;
            at += (n + 15) & ~15;
            return p;
        };
        ks = d * (int)sizeof(act_t) + 16 * T;
        vs = d * (int)sizeof(act_t) + 16;
        ktile = take(CHUNK * (4 * d + 16 * (NT / CHUNK)));
        vtile = take(CHUNK * (4 * d + 16));
        tiles = at;
        qs = (float*)take(G * d * 4);
        probs = (float*)take(G * CHUNK * 4);
        part = (float*)take(NT * 8 * 4);
        pre_in = (float*)take((G + 1) * d * 4);
        pre_out = (act_t*)take(G * d * (int)sizeof(act_t));
        cs = (float*)take(d * 2);
        sn = (float*)take(d * 2);
        ml = (float*)take(G * 8);
        bytes = at;
    }
};

// A row of n bytes (a multiple of 16) copied by the block's threads, 16 at a time.
__device__ __forceinline__ void copy_row(char* dst, const char* src, int n) {
    for (int i = threadIdx.x * 16; i < n; i += NT * 16)
        *(uint4*)(dst + i) = *(const uint4*)(src + i);
}

// acc + q[0..8) · the eight activations of raw, fma by fma in f32 (q in shared memory, 16-byte
// aligned).
__device__ __forceinline__ float dot8(const float* q, const act8_raw& raw, float acc) {
    float kf[8];
    act8_unpack(raw, kf);
    const float4 a = *(const float4*)q, b = *(const float4*)(q + 4);
    const float qf[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) acc = fmaf(qf[i], kf[i], acc);
    return acc;
}

// acc[i] += e * (the eight activations of raw)[i], in f32.
__device__ __forceinline__ void axpy8(float e, const act8_raw& raw, float acc[8]) {
    float vf[8];
    act8_unpack(raw, vf);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = fmaf(e, vf[i], acc[i]);
}

// Output column oi = g d + c of the group's heads, walked by a thread in steps of NT: one
// division when it starts, none per step (a run-time division is a long dependent chain).
template <int STEP = NT>
struct HeadCol {
    int oi, g, c;
    __device__ HeadCol(int start, int d) : oi(start), g(start / d), c(start - start / d * d) {}
    __device__ void next(int d) {
        oi += STEP;
        c += STEP;
        while (c >= d) c -= d, ++g;
    }
};

// What happens to q and the new k before they are used: nothing, rope, or qk_norm then rope.
enum Prologue { PRE_NONE, PRE_ROPE, PRE_NORM_ROPE };

// The rope tables and the norm weights of the rope entries (unused by PRE_NONE).
struct RopeArgs {
    const float* cos_t;
    const float* sin_t;
    const __nv_bfloat16* wq;
    const __nv_bfloat16* wk;
    int max_pos;
    float eps;
};

// The group's G q heads (and the new k head when k_row is given) normalized (PRE_NORM_ROPE: one
// warp per head, as norm.cu) or read into s.pre_in, then rotated as rope.cu rotates: q into
// s.pre_out, k into k_out, with the table rows the block's asynchronous copies bring to s.cs /
// s.sn (waited for here, after the q loads are issued). Ends with the block's barrier.
template <int PRE>
__device__ __forceinline__ void stage_rotated(const act_t* q_rows, const act_t* k_row, int G,
                                              int d, const RopeArgs& ra, const DecodeSmem& s,
                                              act_t* k_out) {
#if defined(ROPE_NEOX) || defined(ROPE_INTERLEAVED)
    const int tid = threadIdx.x, items = G + (k_row ? 1 : 0);
    if constexpr (PRE == PRE_NORM_ROPE) {
#if defined(H_BLOCK)
        for (int j = tid >> 5; j < items; j += NT / 32) {
            if (j < G) head_norm(q_rows + j * d, ra.wq, d, ra.eps, s.pre_in + j * d);
            else head_norm(k_row, ra.wk, d, ra.eps, s.pre_in + j * d);
        }
#else
        __trap();
#endif
    } else {
        for (int i = tid; i < items * d; i += NT)
            s.pre_in[i] = act_load(i < G * d ? q_rows[i] : k_row[i - G * d]);
    }
    cp_async_commit();
    cp_async_wait<0>();  // the table rows (and the block's cache rows) have arrived
    __syncthreads();
    const int half = d / 2, per = NT / half;  // heads rotated side by side
    if (tid < per * half)
        for (int j = tid / half; j < items; j += per)
            rotate_head(s.pre_in + j * d, s.cs, s.sn, d, j < G ? s.pre_out + j * d : k_out,
                        tid % half, half);
    __syncthreads();
#else
    __trap();  // the rope entries are compiled with a ROPE_* style
#endif
}

// The merge of Gb q heads' chunk records [first, last] (rec: the first head's, nch records a
// head, d + 4 floats each) into their outputs o ([Gb][d], contiguous), by the NTH threads of a
// block. Within a KV block the chunks combine in closed form (block max bm, factors
// f = exp(m - bm) per chunk, l and p·v summed in chunk order); across blocks the log-sum-exp
// rule runs left to right. A window of W chunks' records (whole blocks, at most 32 of them)
// comes into shared memory st (st_bytes) by asynchronous copies, one round trip to L2; the
// factors and each block's (x, y) of the rule depend on (q head, chunk) only, so one warp per q
// head computes them once, into fx (fx_floats), and each output column is then a few fmas. A
// ([Gb][d]) holds the outputs merged so far, ml ([Gb][2]) the running max and sum. from_sink:
// the merge starts from the state the caller put in ml (a sink: m = sink, l = 1, A = 0) and
// the first block merges into it by the rule, as every later one does.
template <int NTH>
__device__ __forceinline__ void merge_chunks(const float* rec, int nch, int Gb, int d, int first,
                                             int last, float* st, int st_bytes, float* fx,
                                             int fx_floats, float* A, float* ml, act_t* o,
                                             bool from_sink = false) {
    constexpr int PER_BLOCK = KV_BLOCK / CHUNK;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, rl = d + 4;
    const int W = max(PER_BLOCK, min(min(st_bytes / (4 * Gb * rl), fx_floats / (3 * Gb)),
                                     32 * PER_BLOCK) / PER_BLOCK * PER_BLOCK);
    if (4 * Gb * rl * W > st_bytes || 3 * Gb * W > fx_floats || W > 32 * PER_BLOCK) __trap();
    float* f = fx;                    // [G][W]
    float* xy = fx + Gb * W;          // [G][W][2]: per block (its first chunk's slot)
    const int fb = first / PER_BLOCK * PER_BLOCK;  // the first block's first chunk
    for (int w0 = fb; w0 <= last; w0 += W) {
        const int nw = min(W, last + 1 - w0), skip = max(0, first - w0);  // chunks < first
        __syncthreads();  // the previous window is used
        const int floats = (nw - skip) * rl;  // per q head, contiguous
        for (int g = 0; g < Gb; ++g)
            for (int at = tid * 4; at < floats; at += NTH * 4)
                cp_async16(st + (g * W + skip) * rl + at,
                           rec + ((long)g * nch + w0 + skip) * rl + at, 16);
        phase_mark(10);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        phase_mark(11);
        // warp g, for q head g: lane j takes block j of the window (its chunks' factors f and
        // its max and sum), then lane 0 runs the blocks left to right into their (x, y)
        for (int g = warp; g < Gb; g += NTH / 32) {
            const float* sg = st + g * W * rl;
            const int b0 = lane * PER_BLOCK;
            float bm = -INFINITY, bl = 0.0f;
            if (b0 < nw) {
                float m[PER_BLOCK], l[PER_BLOCK];
#pragma unroll
                for (int u = 0; u < PER_BLOCK; ++u) {
                    const bool live = b0 + u < nw && b0 + u >= skip;
                    m[u] = live ? sg[(b0 + u) * rl] : -INFINITY;
                    l[u] = live ? sg[(b0 + u) * rl + 1] : 0.0f;
                    bm = fmaxf(bm, m[u]);
                }
#pragma unroll
                for (int u = 0; u < PER_BLOCK; ++u) {
                    if (b0 + u >= nw) break;
                    const float e = b0 + u >= skip ? expf(m[u] - bm) : 0.0f;
                    f[g * W + b0 + u] = e;
                    bl += l[u] * e;
                }
            }
            float M = ml[2 * g], L = ml[2 * g + 1];  // the blocks merged so far
            for (int b = 0; b * PER_BLOCK < nw; ++b) {
                const float m_b = __shfl_sync(0xffffffffu, bm, b);
                const float l_b = __shfl_sync(0xffffffffu, bl, b);
                float x = 0.0f, y = 1.0f;  // the first block: A becomes its p·v exactly
                if (w0 + b * PER_BLOCK == fb && !from_sink) {
                    M = m_b, L = l_b;
                } else {
                    const float mn = fmaxf(M, m_b);
                    // from a sink, exp(0) even where M = mn = -inf (a sink of -inf, no keys)
                    x = from_sink && M == mn ? 1.0f : expf(M - mn), y = expf(m_b - mn);
                    L = L * x + l_b * y;
                    M = mn;
                }
                if (lane == 0) {
                    xy[(g * W + b * PER_BLOCK) * 2] = x;
                    xy[(g * W + b * PER_BLOCK) * 2 + 1] = y;
                }
            }
            if (lane == 0) ml[2 * g] = M, ml[2 * g + 1] = L;
        }
        __syncthreads();
        phase_mark(12);
        for (HeadCol<NTH> hc(tid, d); hc.oi < Gb * d; hc.next(d)) {
            const int g = hc.g;
            const float* sg = st + g * W * rl + 4 + hc.c;
            const float* fg = f + g * W;
            float a = w0 == fb ? 0.0f : A[hc.oi];
#pragma unroll 4
            for (int b = 0; b < nw; b += PER_BLOCK) {  // a block's loads together, then fmas
                float sv[PER_BLOCK], fv[PER_BLOCK];
#pragma unroll
                for (int u = 0; u < PER_BLOCK; ++u) {
                    const bool live = b + u < nw && b + u >= skip;
                    sv[u] = live ? sg[(b + u) * rl] : 0.0f;
                    fv[u] = live ? fg[b + u] : 0.0f;
                }
                float ba = 0.0f;
#pragma unroll
                for (int u = 0; u < PER_BLOCK; ++u)
                    if (b + u < nw && b + u >= skip) ba = fmaf(sv[u], fv[u], ba);
                const float* xyb = xy + (g * W + b) * 2;
                a = a * xyb[0] + ba * xyb[1];
            }
            A[hc.oi] = a;
        }
    }
    __syncthreads();  // every column's A and every head's L are written
    for (HeadCol<NTH> hc(tid, d); hc.oi < Gb * d; hc.next(d))
        o[hc.oi] = act_store(A[hc.oi] / ml[2 * hc.g + 1]);
}

template <bool APPEND, int PRE>
__device__ __forceinline__ void decode_attend(
    const act_t* __restrict__ k_new, const act_t* __restrict__ v_new,
    const act_t* __restrict__ q, act_t* k_cache, act_t* v_cache,
    const int* __restrict__ positions, const int* __restrict__ slots, act_t* __restrict__ o,
    void* work, int rows, int hq, int hkv, int d, int max_ctx, float scale, int window,
    RopeArgs ra) {
    static_assert(PRE == PRE_NONE || APPEND, "the rope entries append");
    extern __shared__ __align__(16) char smem_base[];
    phase_mark(0);
    const int row = blockIdx.y, chunk = blockIdx.z, nch = gridDim.z, tid = threadIdx.x;
    if (hkv <= 0) __trap();
    const int G = hq / hkv, HS = (int)gridDim.x / hkv;  // HS blocks per kv head
    if (d > 256 || d <= 0 || (d & 7) || hq % hkv || G > MAX_G || G * d > MAX_GD ||
        nch != (max_ctx + CHUNK - 1) / CHUNK || HS < 1 || HS > G || (int)gridDim.x != hkv * HS)
        __trap();
    // this block's part of the group: q heads g0 + [0, Gb) of kv head kvh
    const int kvh = blockIdx.x / HS, hs = blockIdx.x - kvh * HS;
    const int g0 = hs * G / HS, Gb = (hs + 1) * G / HS - g0;
    if (row >= rows) return;
    int lt = 0;  // log2 of T, the lanes per (q head, position) pair in the scores
    while ((2 << lt) * Gb * CHUNK <= NT) ++lt;
    const int T = 1 << lt;
    const DecodeSmem s(smem_base, Gb, d, T);
    if (dynamic_smem_bytes() < (unsigned)s.bytes) __trap();
    const int pos = positions[row], slot = slots[row];
    if (pos < 0 || pos >= max_ctx) __trap();
    const int start = window > 0 ? max(0, pos - window + 1) : 0;
    const int first = start / CHUNK, last = pos / CHUNK;
    if (chunk < first || chunk > last) return;
    const int c0 = chunk * CHUNK;
    const int lo = max(c0, start) - c0, hi = min(c0 + CHUNK, pos + 1) - c0;  // live [lo, hi)
    const long kv_row = (long)slot * max_ctx;  // position p of this slot: (kv_row + p) * hkv + kvh
    const long new_at = ((long)row * hkv + kvh) * d;
    const int row_bytes = d * (int)sizeof(act_t), pieces = row_bytes / 16;
    const int pl_pos = chunk == last ? pos - c0 : -1;  // this step's row in the chunk, if any
    auto cache_at = [&](const act_t* cache, int pl) {
        return (const char*)(cache + ((kv_row + c0 + pl) * hkv + kvh) * d);
    };
    // ---- before the wait: the cache rows of earlier steps, and the rope table rows
    // (thread t: piece t mod pieces of rows lo + t / pieces, + step, ...: no division per row)
    const int step = NT / pieces, r0 = tid / pieces, at0 = (tid - r0 * pieces) * 16;
    if (r0 < step)
        for (int pl = lo + r0; pl < hi; pl += step) {
            if (pl == pl_pos) continue;
            cp_async16(s.ktile + pl * s.ks + at0, cache_at(k_cache, pl) + at0, 16);
            cp_async16(s.vtile + pl * s.vs + at0, cache_at(v_cache, pl) + at0, 16);
        }
    if constexpr (PRE != PRE_NONE) {
        const long trow = (long)min(pos, ra.max_pos - 1) * (d / 2);
        for (int i = tid; i < d / 8; i += NT) {  // d/2 floats: d/8 pieces of 16 bytes
            cp_async16(s.cs + 4 * i, ra.cos_t + trow + 4 * i, 16);
            cp_async16(s.sn + 4 * i, ra.sin_t + trow + 4 * i, 16);
        }
    }
    phase_mark(1);
    grid_dependency_sync();  // q, this step's k and v, and every write: after the previous launch
    phase_mark(2);
    const act_t* q_rows = q + ((long)row * hq + (long)kvh * G + g0) * d;  // the block's q heads
    char* k_pos = pl_pos >= 0 ? s.ktile + pl_pos * s.ks : nullptr;
    char* v_pos = pl_pos >= 0 ? s.vtile + pl_pos * s.vs : nullptr;
    if (pl_pos >= 0) {  // this step's row: from the inputs (appending) or the cache
        if (APPEND) {
            copy_row(v_pos, (const char*)(v_new + new_at), row_bytes);
            if (PRE == PRE_NONE) copy_row(k_pos, (const char*)(k_new + new_at), row_bytes);
        } else {
            for (int at = tid * 16; at < row_bytes; at += NT * 16) {
                cp_async16(k_pos + at, cache_at(k_cache, pl_pos) + at, 16);
                cp_async16(v_pos + at, cache_at(v_cache, pl_pos) + at, 16);
            }
        }
    }
    if constexpr (PRE == PRE_NONE) {
        for (int i = tid; i < Gb * d; i += NT) s.qs[i] = act_load(q_rows[i]);
        cp_async_commit();
        cp_async_wait<0>();
    } else {
        stage_rotated<PRE>(q_rows, pl_pos >= 0 ? k_new + new_at : nullptr, Gb, d, ra, s,
                           (act_t*)k_pos);
        for (int i = tid; i < Gb * d; i += NT) s.qs[i] = act_load(s.pre_out[i]);
    }
    __syncthreads();
    phase_mark(3);
    // ---- scores: T lanes per (q head g, position pl)
    const int pairs = Gb * CHUNK, li = tid & (T - 1);
    for (int pr = tid >> lt; pr < pairs; pr += NT >> lt) {
        const int g = pr / CHUNK, pl = pr % CHUNK;
        const bool live = pl >= lo && pl < hi;
        float dot = 0.0f;
        if (live) {  // four chains over the lane's chunks, their loads issued together
            const act_t* kr = (const act_t*)(s.ktile + pl * s.ks);
            const float* qg = s.qs + g * d;
            float chain[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            int ch = li;
            for (; ch + 3 * T < d / 8; ch += 4 * T) {
                act8_raw kv[4];
#pragma unroll
                for (int u = 0; u < 4; ++u) kv[u] = act8_load(kr, (ch + u * T) * 8);
#pragma unroll
                for (int u = 0; u < 4; ++u)
                    chain[u] = dot8(qg + (ch + u * T) * 8, kv[u], chain[u]);
            }
            for (; ch < d / 8; ch += T)
                chain[0] = dot8(qg + ch * 8, act8_load(kr, ch * 8), chain[0]);
            dot = (chain[0] + chain[1]) + (chain[2] + chain[3]);
        }
        for (int off = 1; off < T; off <<= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
        if (li == 0) s.probs[pr] = live ? dot * scale : -INFINITY;
    }
    __syncthreads();
    phase_mark(4);
    // ---- softmax over the chunk's positions: one warp per q head
    const int warp = tid >> 5, lane = tid & 31;
    for (int g = warp; g < Gb; g += NT / 32) {
        float* pg = s.probs + g * CHUNK;
        float m = -INFINITY;
        for (int p = lane; p < CHUNK; p += 32) m = fmaxf(m, pg[p]);
        m = warp_max(m);
        float l = 0.0f;
        for (int p = lane; p < CHUNK; p += 32) {
            const float e = p >= lo && p < hi ? expf(pg[p] - m) : 0.0f;
            pg[p] = e;
            l += e;
        }
        l = warp_sum(l);
        if (lane == 0) {
            s.ml[2 * g] = m;
            s.ml[2 * g + 1] = l;
        }
    }
    __syncthreads();
    phase_mark(5);
    // ---- p·v: unit (q head, 8 columns) = tid mod U, positions lo + sub + j S
    const int nc = d / 8, U = Gb * nc, S = NT / U;
    const int unit = tid % U, sub = tid / U;
    if (sub < S) {
        const int g = unit / nc, ch = unit % nc;
        const float* pg = s.probs + g * CHUNK;
        float pv[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) pv[i] = 0.0f;
        auto v_at = [&](int p) { return act8_load((const act_t*)(s.vtile + p * s.vs), ch * 8); };
        int p = lo + sub;
        for (; p + 3 * S < hi; p += 4 * S) {  // four positions' loads, then their fmas in order
            act8_raw vv[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) vv[u] = v_at(p + u * S);
#pragma unroll
            for (int u = 0; u < 4; ++u) axpy8(pg[p + u * S], vv[u], pv);
        }
        for (; p < hi; p += S) axpy8(pg[p], v_at(p), pv);
        float4* dst = (float4*)(s.part + (sub * U + unit) * 8);
        dst[0] = make_float4(pv[0], pv[1], pv[2], pv[3]);
        dst[1] = make_float4(pv[4], pv[5], pv[6], pv[7]);
    }
    __syncthreads();
    phase_mark(6);
    // ---- the chunk's partial state to the scratch, the S partials of each column in sub order
    float* rec = (float*)work;
    const long head0 = (long)row * hq + (long)kvh * G + g0;  // the block's first q head
    const int rl = d + 4;                                    // floats per record
    for (HeadCol<> hc(tid, d); hc.oi < Gb * d; hc.next(d)) {
        float a = s.part[hc.oi];
        for (int u = 1; u < S; ++u) a += s.part[u * U * 8 + hc.oi];
        rec[((head0 + hc.g) * nch + chunk) * rl + 4 + hc.c] = a;
    }
    if (tid < Gb) {
        float* r = rec + ((head0 + tid) * nch + chunk) * rl;
        r[0] = s.ml[2 * tid];
        r[1] = s.ml[2 * tid + 1];
    }
    // the new entry, for later steps (this step read it from the inputs), after the block's
    // reads of the tile; one block of the kv head writes it
    if (APPEND && pl_pos >= 0 && hs == 0) {
        const long dst = ((kv_row + pos) * hkv + kvh) * d;
        copy_row((char*)(k_cache + dst), k_pos, row_bytes);
        copy_row((char*)(v_cache + dst), v_pos, row_bytes);
    }
    phase_mark(7);
}

// grid (hkv HS, rows, ceil(max_ctx / CHUNK)), block 256, dynamic shared memory as KERNELS.toml.
extern "C" __global__ void __launch_bounds__(NT, 2)
metrale_attention_decode(const act_t* __restrict__ q, const act_t* __restrict__ k_cache,
                         const act_t* __restrict__ v_cache, const int* __restrict__ positions,
                         const int* __restrict__ slots, act_t* __restrict__ o, void* work,
                         int rows, int hq, int hkv, int d, int max_ctx, float scale,
                         int window) {
    decode_attend<false, PRE_NONE>(nullptr, nullptr, q, const_cast<act_t*>(k_cache),
                                   const_cast<act_t*>(v_cache), positions, slots, o, work, rows,
                                   hq, hkv, d, max_ctx, scale, window, RopeArgs{});
}

// kv_append then attention in one kernel. grid, block and shared memory as above.
extern "C" __global__ void __launch_bounds__(NT, 2)
metrale_kv_append_attention_decode(const act_t* __restrict__ k, const act_t* __restrict__ v,
                                   const act_t* __restrict__ q, act_t* k_cache, act_t* v_cache,
                                   const int* __restrict__ positions,
                                   const int* __restrict__ slots, act_t* __restrict__ o,
                                   void* work, int rows, int hq, int hkv, int d, int max_ctx,
                                   float scale, int window) {
    decode_attend<true, PRE_NONE>(k, v, q, k_cache, v_cache, positions, slots, o, work, rows, hq,
                                  hkv, d, max_ctx, scale, window, RopeArgs{});
}

#if defined(ROPE_NEOX) || defined(ROPE_INTERLEAVED)
// rope, kv_append and attention in one kernel. grid and block as above.
extern "C" __global__ void __launch_bounds__(NT, 2)
metrale_rope_kv_append_attention_decode(
    const act_t* __restrict__ q, const act_t* __restrict__ k, const act_t* __restrict__ v,
    act_t* k_cache, act_t* v_cache, const int* __restrict__ positions,
    const int* __restrict__ slots, const float* __restrict__ cos_t,
    const float* __restrict__ sin_t, act_t* __restrict__ o, void* work, int rows, int hq,
    int hkv, int d, int max_ctx, int max_pos, float scale, int window) {
    decode_attend<true, PRE_ROPE>(k, v, q, k_cache, v_cache, positions, slots, o, work, rows, hq,
                                  hkv, d, max_ctx, scale, window,
                                  RopeArgs{cos_t, sin_t, nullptr, nullptr, max_pos, 0.0f});
}

#if defined(H_BLOCK)
// qk_norm, rope, kv_append and attention in one kernel. grid and block as above.
extern "C" __global__ void __launch_bounds__(NT, 2)
metrale_qk_norm_rope_kv_append_attention_decode(
    const act_t* __restrict__ q, const act_t* __restrict__ k, const act_t* __restrict__ v,
    const __nv_bfloat16* __restrict__ wq, const __nv_bfloat16* __restrict__ wk,
    act_t* k_cache, act_t* v_cache, const int* __restrict__ positions,
    const int* __restrict__ slots, const float* __restrict__ cos_t,
    const float* __restrict__ sin_t, act_t* __restrict__ o, void* work, int rows, int hq,
    int hkv, int d, int max_ctx, int max_pos, float eps, float scale, int window) {
    decode_attend<true, PRE_NORM_ROPE>(k, v, q, k_cache, v_cache, positions, slots, o, work,
                                       rows, hq, hkv, d, max_ctx, scale, window,
                                       RopeArgs{cos_t, sin_t, wq, wk, max_pos, eps});
}
#endif
#endif

// The merge of a decode launch's chunk records, launched right after it (KERNELS.toml's `then`):
// one block of MERGE_NT threads per (q head, row), grid (hq, rows, 1), the chunk count from
// max_ctx as the decode grid's; dynamic shared memory MERGE_W (d + 4) + 3 MERGE_W + d + 4 floats
// (a window of MERGE_W chunks' records, their factors and blocks' (x, y), the outputs merged so
// far, the running max and sum). It waits for the decode launch (grid_dependency_wait) before it
// reads anything that launch wrote, and releases o_proj only by ending.
#define MERGE_NT 128
#define MERGE_W (8 * (KV_BLOCK / CHUNK))  // chunks a window

// The merge of one (q head, row); sinks, when not null, are the merge's first state.
__device__ __forceinline__ void merge_head(const int* positions, const __nv_bfloat16* sinks,
                                           act_t* o, void* work, int rows, int hq, int d,
                                           int max_ctx, int window) {
    extern __shared__ __align__(16) char merge_smem[];
    const int st_bytes = MERGE_W * (d + 4) * 4;
    float* st = (float*)merge_smem;
    float* fx = st + MERGE_W * (d + 4);
    float* A = fx + 3 * MERGE_W;
    float* ml = A + d;
    if (d > 256 || d <= 0 || (d & 7) || (int)gridDim.x != hq || (int)gridDim.y != rows ||
        blockDim.x != MERGE_NT ||
        dynamic_smem_bytes() < (unsigned)(st_bytes + (3 * MERGE_W + d + 4) * 4))
        __trap();
    grid_dependency_wait();  // the decode launch's records; o_proj starts as this launch ends
    const int h = blockIdx.x, row = blockIdx.y, nch = (max_ctx + CHUNK - 1) / CHUNK;
    const int pos = positions[row];
    if (pos < 0 || pos >= max_ctx) __trap();
    const int start = window > 0 ? max(0, pos - window + 1) : 0;
    const long head = (long)row * hq + h;
    if (sinks && threadIdx.x == 0) ml[0] = __bfloat162float(sinks[h]), ml[1] = 1.0f;
    merge_chunks<MERGE_NT>((const float*)work + head * nch * (d + 4), nch, 1, d, start / CHUNK,
                           pos / CHUNK, st, st_bytes, fx, 3 * MERGE_W, A, ml, o + head * d,
                           sinks != nullptr);
}

extern "C" __global__ void __launch_bounds__(MERGE_NT)
metrale_attention_decode_merge(const int* __restrict__ positions, act_t* __restrict__ o,
                               void* work, int rows, int hq, int d, int max_ctx, int window) {
    merge_head(positions, nullptr, o, work, rows, hq, d, max_ctx, window);
}

// The merge of an attention_sink decode (gpt-oss): the chunk records are the plain decode
// launch's, and the merge starts from the head's sink (m = sink, l = 1, acc = 0), as
// metrale.lkb.semantics_sink's reference does.
extern "C" __global__ void __launch_bounds__(MERGE_NT)
metrale_attention_sink_decode_merge(const int* __restrict__ positions,
                                    const __nv_bfloat16* __restrict__ sinks,
                                    act_t* __restrict__ o, void* work, int rows, int hq, int d,
                                    int max_ctx, int window) {
    merge_head(positions, sinks, o, work, rows, hq, d, max_ctx, window);
}

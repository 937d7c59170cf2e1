// Metrale CUDA common layer: activation and weight types chosen by compile-time defines.
//
// Defines (from KERNELS.toml `defines`, one per point parameter):
//   ACT_BF16 | ACT_F32                     activation dtype (act_t); math is always f32
//   WEIGHT_BF16 | WEIGHT_F32 | WEIGHT_FP8 | WEIGHT_MXFP4 | WEIGHT_NVFP4   weight storage
//   K_BLOCK, H_BLOCK, KV_BLOCK             reduction block sizes (the declared orders)
//   ACROSS_SEQUENTIAL | ACROSS_PAIRWISE    how block partial sums combine
//
// Weight layouts (row-major, one output row of k weights after another):
//   bf16  data bf16[n, k]
//   f32   data f32[n, k]
//   fp8   data e4m3[n, k], scale f32[n] (one per output row: fp8_e4m3_channel); w = v * s
//   mxfp4 data u8[n, k/2] (e2m1, LOW nibble first), scale e8m0 u8[n, k/32]; w = v * 2^(s-127)
//   nvfp4 data u8[n, k/2] (e2m1, LOW nibble first), scale e4m3[n, k/16], global f32[1];
//         w = (v * s) * g
// every dequantization is done in f32 with the products rounded in that order, as
// metrale.lkb.quant dequantizes, so a fused kernel sees the bytes the host sees.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "grid.cuh"

#if defined(ACT_BF16)
typedef __nv_bfloat16 act_t;
__device__ __forceinline__ float act_load(act_t v) { return __bfloat162float(v); }
__device__ __forceinline__ act_t act_store(float v) { return __float2bfloat16_rn(v); }
#elif defined(ACT_F32)
typedef float act_t;
__device__ __forceinline__ float act_load(act_t v) { return v; }
__device__ __forceinline__ act_t act_store(float v) { return v; }
#else
#error "define ACT_BF16 or ACT_F32"
#endif

// Round an f32 value to the activation dtype and back (identity for f32): where the
// reference semantics round an intermediate to act, so does the kernel.
__device__ __forceinline__ float act_round(float v) { return act_load(act_store(v)); }

// Eight consecutive activations from column c (c a multiple of 8): one 16-byte load for bf16.
__device__ __forceinline__ void act8(const act_t* x, int c, float out[8]) {
#if defined(ACT_BF16)
    uint4 raw = *(const uint4*)(x + c);
    const __nv_bfloat16* h = (const __nv_bfloat16*)&raw;
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = __bfloat162float(h[i]);
#else
    const float4* p = (const float4*)(x + c);
    float4 a = p[0], b = p[1];
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
#endif
}

// The same eight activations kept raw (16 bytes for bf16, 32 for f32), so that many loads can be
// in flight in few registers; act8_unpack converts them when they are used.
#if defined(ACT_BF16)
typedef uint4 act8_raw;
__device__ __forceinline__ act8_raw act8_load(const act_t* x, int c) {
    return *(const uint4*)(x + c);
}
__device__ __forceinline__ void act8_unpack(const act8_raw& raw, float out[8]) {
    const __nv_bfloat16* h = (const __nv_bfloat16*)&raw;
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = __bfloat162float(h[i]);
}
#else
struct act8_raw { float4 a, b; };
__device__ __forceinline__ act8_raw act8_load(const act_t* x, int c) {
    const float4* p = (const float4*)(x + c);
    return act8_raw{p[0], p[1]};
}
__device__ __forceinline__ void act8_unpack(const act8_raw& raw, float out[8]) {
    out[0] = raw.a.x; out[1] = raw.a.y; out[2] = raw.a.z; out[3] = raw.a.w;
    out[4] = raw.b.x; out[5] = raw.b.y; out[6] = raw.b.z; out[7] = raw.b.w;
}
#endif

// Eight activations stored from f32 at column c (c a multiple of 8): one 16-byte store for bf16.
__device__ __forceinline__ void act8_store(act_t* y, int c, const float v[8]) {
#if defined(ACT_BF16)
    uint4 raw;
    __nv_bfloat16* h = (__nv_bfloat16*)&raw;
#pragma unroll
    for (int i = 0; i < 8; ++i) h[i] = __float2bfloat16_rn(v[i]);
    *(uint4*)(y + c) = raw;
#else
    float4* p = (float4*)(y + c);
    p[0] = make_float4(v[0], v[1], v[2], v[3]);
    p[1] = make_float4(v[4], v[5], v[6], v[7]);
#endif
}

__device__ __forceinline__ float bf16_load(const __nv_bfloat16* p, long i) {
    return __bfloat162float(p[i]);
}

// Warp butterfly sum: every lane ends with the same value, combined in a fixed tree, so the
// result does not depend on scheduling.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a whole thread block (blockDim.x a multiple of 32, at most 1024): warp trees, then
// warp 0 adds the warp partials in warp order. Every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch /* >= 33 floats */) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = scratch[0];
        for (int i = 1; i < nw; ++i) s += scratch[i];
        scratch[32] = s;
    }
    __syncthreads();
    return scratch[32];
}

__device__ __forceinline__ float block_max(float v, float* scratch /* >= 33 floats */) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = scratch[0];
        for (int i = 1; i < nw; ++i) s = fmaxf(s, scratch[i]);
        scratch[32] = s;
    }
    __syncthreads();
    return scratch[32];
}

// Partial sums of blocks combined as the declared order says. `sequential` is
// ((p0 + p1) + p2) + ...; `pairwise` adds adjacent pairs level by level, an odd last partial
// carried up: a binary counter whose pending sums are folded right to left at the end gives
// exactly that tree.
struct Combine {
#if defined(ACROSS_PAIRWISE)
    float part[32];
    int count;
    __device__ __forceinline__ Combine() : count(0) {}
    __device__ __forceinline__ void add(float p) {
        int c = count++;
        int top = __popc(c);  // pending sums on the stack before this partial
        part[top] = p;
        // merge while the lowest bits of the count say two equal-sized sums are pending
        while (c & 1) {
            part[top - 1] = part[top - 1] + part[top];
            --top;
            c >>= 1;
        }
    }
    __device__ __forceinline__ float result() const {
        int top = __popc(count) - 1;
        float s = part[top];
        for (int i = top - 1; i >= 0; --i) s = part[i] + s;
        return s;
    }
#else
    float acc;
    bool any;
    __device__ __forceinline__ Combine() : acc(0.0f), any(false) {}
    __device__ __forceinline__ void add(float p) { acc = any ? acc + p : p; any = true; }
    __device__ __forceinline__ float result() const { return acc; }
#endif
};

// ------------------------------------------------------------------ weights
// Only kernels of a weight-taking family are compiled with a WEIGHT_* define.
#if defined(WEIGHT_BF16) || defined(WEIGHT_F32) || defined(WEIGHT_FP8) || \
    defined(WEIGHT_MXFP4) || defined(WEIGHT_NVFP4)
#define METRALE_HAS_WEIGHT 1

// e2m1 nibble -> f32, exactly (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, -0 included),
// by arithmetic rather than a table: a table in constant memory serializes the lanes of a
// warp that read different entries. For exponent bits e > 0 the f32 with exponent field
// e + 126 and mantissa bit m is 2^(e-1) (1 + m/2); for e = 0 the value is m / 2.
__device__ __forceinline__ float e2m1_load(uint32_t nib) {
    const uint32_t x = nib & 7u;
    const float v = x < 2u ? 0.5f * float(x) : __uint_as_float((x << 22) + (126u << 23));
    return __uint_as_float(__float_as_uint(v) | ((nib & 8u) << 28));
}

// Eight e2m1 nibbles of w (low nibble first) times 2^-14, exactly, as f32: nibble i and i + 4 make
// the two halves of one f16x2 word, the magnitude's 3 bits (e1 e0 m) placed at f16 bits 11..9
// and the sign at bit 15: an f16 with exponent field e and mantissa m/2 is 2^(e-15)(1 + m/2)
// for e > 0 and 2^-14 m/2 for e = 0, which is the e2m1 value times 2^-14 in both cases. Four
// shifts and masks per pair instead of a select, a conversion and a multiply per nibble; the
// caller folds the 2^14 into the scale.
__device__ __forceinline__ void e2m1x8_scaled(uint32_t w, float out[8]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int up = 9 - 4 * i, sign_up = 12 - 4 * i;  // nibble i's bits to f16 bits 9 and 15
        const uint32_t mag = up >= 0 ? w << up : w >> -up;
        const uint32_t h = (mag & 0x0E000E00u) | ((w << sign_up) & 0x80008000u);
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
        out[i] = f.x;
        out[i + 4] = f.y;
    }
}

__device__ __forceinline__ float e4m3_load(uint8_t b) {
    __nv_fp8_e4m3 v;
    v.__x = b;
    return float(v);
}

// e8m0: 2^(byte - 127), built as bits (0 is the subnormal 2^-127); 255 is NaN.
__device__ __forceinline__ float e8m0_load(uint32_t b) {
    return __uint_as_float(b == 255u ? 0x7fffffffu : b == 0u ? 0x00400000u : b << 23);
}

#if defined(WEIGHT_MXFP4)
// e2m1x8_scaled's values (v 2^-14) times mxfp4_factor(b) = 2^(b - 127 + 14) is v * 2^(b - 127) in
// one exact product, the v * s of the reference (a value of two significant bits times a power
// of two), for every scale byte b with mxfp4_one_product(b); a larger b overflows the factor
// and takes mxfp4_unpack's two products.
__device__ __forceinline__ bool mxfp4_one_product(uint32_t b) { return b <= 240u; }
__device__ __forceinline__ float mxfp4_factor(uint32_t b) {
    return __uint_as_float((b + 14) << 23);
}

// Eight e2m1 weights (one data word) dequantized with factors the caller computed once for
// every chunk its scale covers: v 2^-14 times f, then times g unless g is 1 (ONE_PRODUCT).
// (f, g) = (mxfp4_factor(b), 1) for b <= 240 and (2^14, e8m0_load(b)) for every b give the same
// bytes, the reference's v * s: both round the same exact v * 2^(b - 127) once (the first
// product is exact).
template <bool ONE_PRODUCT>
__device__ __forceinline__ void mxfp4_scale(const float v[8], float f, float g, float out[8]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = ONE_PRODUCT ? __fmul_rn(v[i], f) : __fmul_rn(v[i] * f, g);
}
template <bool ONE_PRODUCT>
__device__ __forceinline__ void mxfp4_unpack(uint32_t word, float f, float g, float out[8]) {
    float v[8];
    e2m1x8_scaled(word, v);
    mxfp4_scale<ONE_PRODUCT>(v, f, g, out);
}
#endif

// A weight port as the kernel receives it: data, scale (null where the format has none) and
// the global scale (nvfp4 only, else null).
struct WeightRef {
    const void* data;
    const void* scale;
    const float* global;
};

// Byte offset of output row `row` (counted across experts too) in a weight of k columns.
__device__ __forceinline__ WeightRef weight_rows(WeightRef w, long row, int k) {
    WeightRef r = w;
#if defined(WEIGHT_BF16)
    r.data = (const __nv_bfloat16*)w.data + row * k;
#elif defined(WEIGHT_F32)
    r.data = (const float*)w.data + row * k;
#elif defined(WEIGHT_FP8)
    r.data = (const uint8_t*)w.data + row * k;
    r.scale = (const float*)w.scale + row;
#elif defined(WEIGHT_MXFP4)
    r.data = (const uint8_t*)w.data + row * (k / 2);
    r.scale = (const uint8_t*)w.scale + row * (k / 32);
#elif defined(WEIGHT_NVFP4)
    r.data = (const uint8_t*)w.data + row * (k / 2);
    r.scale = (const uint8_t*)w.scale + row * (k / 16);
#endif
    return r;
}

// Eight consecutive weights of one row starting at column c (c a multiple of 8, c + 8 <= k),
// kept raw until used so that many loads can be in flight in few registers: 16 bytes for
// bf16, 32 for f32, 8 for fp8, 4 for fp4 (with the chunk's scale byte).
struct WeightRaw8 {
#if defined(WEIGHT_BF16)
    uint4 v;
#elif defined(WEIGHT_F32)
    float4 a, b;
#elif defined(WEIGHT_FP8)
    uint2 v;
#else
    uint32_t v;
    uint8_t s;
#endif
};

__device__ __forceinline__ WeightRaw8 weight8_load(WeightRef w, int c) {
    WeightRaw8 r;
#if defined(WEIGHT_BF16)
    r.v = *(const uint4*)((const __nv_bfloat16*)w.data + c);
#elif defined(WEIGHT_F32)
    const float4* p = (const float4*)((const float*)w.data + c);
    r.a = p[0];
    r.b = p[1];
#elif defined(WEIGHT_FP8)
    r.v = *(const uint2*)((const uint8_t*)w.data + c);
#else
    r.v = *(const uint32_t*)((const uint8_t*)w.data + c / 2);
#if defined(WEIGHT_MXFP4)
    r.s = ((const uint8_t*)w.scale)[c / 32];
#else
    r.s = ((const uint8_t*)w.scale)[c / 16];
#endif
#endif
    return r;
}

// The raw chunk dequantized to f32, the products rounded as metrale.lkb.quant rounds them.
__device__ __forceinline__ void weight8_unpack(WeightRef w, const WeightRaw8& r, float out[8]) {
#if defined(WEIGHT_BF16)
    const __nv_bfloat16* h = (const __nv_bfloat16*)&r.v;
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = __bfloat162float(h[i]);
#elif defined(WEIGHT_F32)
    out[0] = r.a.x; out[1] = r.a.y; out[2] = r.a.z; out[3] = r.a.w;
    out[4] = r.b.x; out[5] = r.b.y; out[6] = r.b.z; out[7] = r.b.w;
#elif defined(WEIGHT_FP8)
    // pairs of e4m3 codes to f16x2 in one conversion (sm_89+), exact, then f32
    const float s = *(const float*)w.scale;
    const uint32_t words[2] = {r.v.x, r.v.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __nv_fp8x2_storage_t pair = (__nv_fp8x2_storage_t)(words[i / 2] >> (16 * (i & 1)));
        const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
        out[2 * i] = __fmul_rn(f.x, s);
        out[2 * i + 1] = __fmul_rn(f.y, s);
    }
#else
    float v[8];  // the e2m1 values times 2^-14
    e2m1x8_scaled(r.v, v);
#if defined(WEIGHT_MXFP4)
    if (mxfp4_one_product(r.s)) mxfp4_scale<true>(v, mxfp4_factor(r.s), 1.0f, out);
    else mxfp4_scale<false>(v, 16384.0f, e8m0_load(r.s), out);
#else
    // (v 2^-14)(s 2^14) is v * s exactly (at most 6 significant bits), then times g as the
    // reference rounds it
    const float s14 = e4m3_load(r.s) * 16384.0f;
    const float g = *w.global;
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = __fmul_rn(__fmul_rn(v[i], s14), g);
#endif
#endif
}

// DOT_CHUNKS: the 8-wide chunks a lane takes from one weight row per load, so that every format
// loads 16 bytes at a time: bf16 1, fp8 2, fp4 4 (f32, 32 bytes a chunk, 1). A define of 1
// overrides it (one chunk per load: 8 bytes for fp8, 4 for fp4, the layout before version 11).
#if !defined(DOT_CHUNKS)
#if defined(WEIGHT_FP8)
#define DOT_CHUNKS 2
#elif defined(WEIGHT_MXFP4) || defined(WEIGHT_NVFP4)
#define DOT_CHUNKS 4
#else
#define DOT_CHUNKS 1
#endif
#endif

// C consecutive chunks of one weight row, raw: 16 bytes of data and the scale bytes those
// columns use (fp4: mxfp4 one, nvfp4 two); part(i) is chunk i. One chunk is WeightRaw8 itself.
template <int C>
struct WeightChunks {
    uint4 v;
    uint32_t s;
    __device__ __forceinline__ uint32_t word(int i) const {
        return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
    }
    __device__ __forceinline__ WeightRaw8 part(int i) const {
        WeightRaw8 r;
#if defined(WEIGHT_FP8)
        r.v = make_uint2(word(2 * i), word(2 * i + 1));
#elif defined(WEIGHT_MXFP4)
        r.v = word(i);
        r.s = (uint8_t)s;
#elif defined(WEIGHT_NVFP4)
        r.v = word(i);
        r.s = (uint8_t)(s >> (8 * (i / 2)));  // 16 columns a scale: two chunks each
#endif
        return r;
    }
};

template <>
struct WeightChunks<1> {
    WeightRaw8 one;
    __device__ __forceinline__ WeightRaw8 part(int) const { return one; }
};

// C consecutive chunks of one weight row from column c (c a multiple of 8 C, the row's bytes
// 16-byte aligned): one 16-byte load of data where C > 1, and the scales those columns use.
template <int C>
__device__ __forceinline__ WeightChunks<C> weight_chunks_load(WeightRef w, int c) {
    WeightChunks<C> r;
    if constexpr (C == 1) {
        r.one = weight8_load(w, c);
    } else {
#if defined(WEIGHT_FP8)
        static_assert(C == 2, "fp8 weights: one or two chunks per load");
        r.v = *(const uint4*)((const uint8_t*)w.data + c);
#elif defined(WEIGHT_MXFP4) || defined(WEIGHT_NVFP4)
        static_assert(C == 4, "fp4 weights: one or four chunks per load");
        r.v = *(const uint4*)((const uint8_t*)w.data + c / 2);
#if defined(WEIGHT_MXFP4)
        r.s = ((const uint8_t*)w.scale)[c / 32];  // the 32 columns share one scale
#else
        r.s = *(const uint16_t*)((const uint8_t*)w.scale + c / 16);
#endif
#else
        static_assert(C == 1, "bf16 and f32 weights: one chunk per load");
#endif
    }
    return r;
}

__device__ __forceinline__ void weight8(WeightRef w, int c, float out[8]) {
    weight8_unpack(w, weight8_load(w, c), out);
}

// Ask L2 for the bytes of a weight row that this lane's chunks read first (columns first +
// lane * 8 + j stride for j < CHUNKS): no register is taken and nothing waits for it. Weights
// are written by no launch, so a kernel may issue this before it waits for the previous launch
// (grid_dependency_sync): the row's first bytes then arrive while that launch finishes.
template <int CHUNKS>
__device__ __forceinline__ void weight_prefetch(WeightRef w, int k, int stride, int first = 0) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
        const int c = first + j * stride + lane * 8;
        if (c >= k) break;
#if defined(WEIGHT_BF16)
        const char* at = (const char*)w.data + 2L * c;
#elif defined(WEIGHT_F32)
        const char* at = (const char*)w.data + 4L * c;
#elif defined(WEIGHT_FP8)
        const char* at = (const char*)w.data + c;
#else
        const char* at = (const char*)w.data + c / 2;
#endif
        asm volatile("prefetch.global.L2 [%0];" ::"l"(at));
    }
}

// One weight at column c (for a ragged tail of k that is not a multiple of 8).
__device__ __forceinline__ float weight1(WeightRef w, int c) {
#if defined(WEIGHT_BF16)
    return __bfloat162float(((const __nv_bfloat16*)w.data)[c]);
#elif defined(WEIGHT_F32)
    return ((const float*)w.data)[c];
#elif defined(WEIGHT_FP8)
    return __fmul_rn(e4m3_load(((const uint8_t*)w.data)[c]), *(const float*)w.scale);
#else
    uint8_t b = ((const uint8_t*)w.data)[c / 2];
    float v = e2m1_load((c & 1) ? (b >> 4) : (b & 0xf));
#if defined(WEIGHT_MXFP4)
    return __fmul_rn(v, e8m0_load(((const uint8_t*)w.scale)[c / 32]));
#else
    return __fmul_rn(__fmul_rn(v, e4m3_load(((const uint8_t*)w.scale)[c / 16])), *w.global);
#endif
#endif
}
#endif  // a WEIGHT_* define

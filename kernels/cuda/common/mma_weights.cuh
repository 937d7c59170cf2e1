// Metrale CUDA: the weights of the tensor-core GEMMs (gemm.cu, mma.sync; sm_90's gemm_wgmma.cu)
// on their way to bf16 MMA operands (the factor left for the finished sum, row_factor and scaled,
// and the entries' out_t are gemv.cuh's, which the GEMVs share).
//
// A quantized weight reaches the MMA exactly: fp8's e4m3 values, mxfp4's e2m1 times its
// power-of-two scale and nvfp4's e2m1 times its e4m3 scale all fit bf16; the f32 factor left
// (fp8's row scale, nvfp4's global scale) multiplies the finished sum (row_factor, scaled). An
// f32 weight enters as PARTS = 3 bf16 parts that sum to it exactly, each a plane of the tile.
#pragma once
#include "gemv.cuh"
#include "mma.cuh"

#if defined(WEIGHT_F32)
#define PARTS 3  // bf16 parts of an f32 weight, each a plane of the weight tile
#else
#define PARTS 1
#endif

// Eight activations or bf16 weights of one row from column c, through registers: the path for
// rows that are not 16-byte aligned (k % 8 != 0); columns at or past k read as zero.
__device__ __forceinline__ uint4 bf16x8_any(const bf16* row, int c, int k) {
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = c + i < k ? __bfloat162float(row[c + i]) : 0.0f;
    return make_uint4(bf16x2(v[0], v[1]), bf16x2(v[2], v[3]), bf16x2(v[4], v[5]),
                      bf16x2(v[6], v[7]));
}

#if !defined(WEIGHT_BF16)
// Eight raw weights of a quantized or f32 row from column c (< k): 16-byte loads where the row
// allows, else element by element with zeros past k.
__device__ __forceinline__ WeightRaw8 weight8_fetch(WeightRef row, int c, int k) {
#if defined(WEIGHT_F32)
    if ((k & 3) || c + 8 > k) {  // rows not 16-byte aligned, or the row's last columns
        const float* p = (const float*)row.data;
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = c + j < k ? p[c + j] : 0.0f;
        WeightRaw8 raw;
        raw.a = make_float4(v[0], v[1], v[2], v[3]);
        raw.b = make_float4(v[4], v[5], v[6], v[7]);
        return raw;
    }
#endif
#if defined(WEIGHT_FP8)
    if (k & 7) {  // rows not 8-byte aligned: byte by byte, zeros past k
        const uint8_t* p = (const uint8_t*)row.data;
        uint32_t word[2] = {0u, 0u};
#pragma unroll
        for (int j = 0; j < 8; ++j)
            if (c + j < k) word[j / 4] |= (uint32_t)p[c + j] << (8 * (j % 4));
        WeightRaw8 raw;
        raw.v = make_uint2(word[0], word[1]);
        return raw;
    }
#endif
    return weight8_load(row, c);  // fp4 formats have k a multiple of 16
}

#if defined(WEIGHT_F32)
// Eight f32 weights as their three bf16 parts: planes[0] the top 16 bits of each (hi), planes[1]
// and planes[2] the top 16 bits of the remainder and the rest (mid, lo). Both subtractions are
// exact and lo keeps at most 8 significant bits, so hi + mid + lo is the weight; a weight that
// is not finite keeps only hi.
__device__ __forceinline__ void weight8_bf16_parts(const WeightRaw8& r, uint4 (&planes)[PARTS]) {
    const float w[8] = {r.a.x, r.a.y, r.a.z, r.a.w, r.b.x, r.b.y, r.b.z, r.b.w};
    uint32_t part[PARTS][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const uint32_t bits = __float_as_uint(w[i]);
        const float rest = isfinite(w[i]) ? w[i] - __uint_as_float(bits & 0xFFFF0000u) : 0.0f;
        const uint32_t mid = __float_as_uint(rest) & 0xFFFF0000u;
        const uint32_t lo = __float_as_uint(rest - __uint_as_float(mid));
        const uint32_t halves[PARTS] = {bits >> 16, mid >> 16, lo >> 16};
#pragma unroll
        for (int p = 0; p < PARTS; ++p)
            part[p][i / 2] = i % 2 ? part[p][i / 2] | (halves[p] << 16) : halves[p];
    }
#pragma unroll
    for (int p = 0; p < PARTS; ++p) planes[p] = make_uint4(part[p][0], part[p][1], part[p][2], part[p][3]);
}
#elif !defined(WEIGHT_BF16)
// Eight weights of a quantized row as bf16, exactly: the format's value times its block scale
// (fp8 has none here; nvfp4's global scale and fp8's row scale come in the epilogue).
__device__ __forceinline__ uint4 weight8_exact_bf16(const WeightRaw8& r) {
    float v[8];
#if defined(WEIGHT_FP8)
    const uint32_t words[2] = {r.v.x, r.v.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __nv_fp8x2_storage_t pair = (__nv_fp8x2_storage_t)(words[i / 2] >> (16 * (i & 1)));
        const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
    }
#else
    e2m1x8_scaled(r.v, v);  // the values times 2^-14
#if defined(WEIGHT_MXFP4)
    const float s = e8m0_load(r.s);  // (v 2^-14) 2^14 is exact; times 2^(b - 127) exact in range
#else
    const float s = e4m3_load(r.s);  // v * s has at most 6 significant bits
#endif
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(v[i] * 16384.0f, s);
#endif
    return make_uint4(bf16x2(v[0], v[1]), bf16x2(v[2], v[3]), bf16x2(v[4], v[5]),
                      bf16x2(v[6], v[7]));
}
#endif

// Eight raw weights as the PARTS bf16 planes the MMAs take.
__device__ __forceinline__ void weight8_planes(const WeightRaw8& r, uint4 (&planes)[PARTS]) {
#if defined(WEIGHT_F32)
    weight8_bf16_parts(r, planes);
#else
    planes[0] = weight8_exact_bf16(r);
#endif
}
#endif


// Metrale CUDA: the rotation of one head by RoPE, shared by rope.cu and norm.cu.
//
// ROPE_NEOX rotates halves (x[i], x[i + d/2]); ROPE_INTERLEAVED rotates pairs (x[2i], x[2i+1]).
// The table values are rounded to act first, and each product and their sum is rounded to
// act, as metrale.lkb.semantics_attention.rope does.
#pragma once
#include "metrale.cuh"

// `x` is the head in f32 (any memory); threads t, t + stride, ... take pairs i of d/2.
__device__ __forceinline__ void rotate_head(const float* x, const float* c_row,
                                            const float* s_row, int d, act_t* out, int t,
                                            int stride) {
    const int half = d / 2;
    for (int i = t; i < half; i += stride) {
        const float c = act_round(c_row[i]), s = act_round(s_row[i]);
#if defined(ROPE_NEOX)
        const int a = i, b = i + half;
#else
        const int a = 2 * i, b = 2 * i + 1;
#endif
        const float xa = x[a], xb = x[b];
        // __fmul_rn/__fadd_rn: never contracted into an fma, so f32 matches the reference
        const float ya =
            act_round(__fadd_rn(act_round(__fmul_rn(xa, c)), act_round(__fmul_rn(-xb, s))));
        const float yb =
            act_round(__fadd_rn(act_round(__fmul_rn(xb, c)), act_round(__fmul_rn(xa, s))));
        out[a] = act_store(ya);
        out[b] = act_store(yb);
    }
}

// The head rotated at `pos` (clamped to the table, max_pos rows of d/2).
__device__ __forceinline__ void rotate_head_at(const float* x, const float* cos_t,
                                               const float* sin_t, int pos, int max_pos, int d,
                                               act_t* out, int t, int stride) {
    const long row = min(max(pos, 0), max_pos - 1);
    rotate_head(x, cos_t + row * (d / 2), sin_t + row * (d / 2), d, out, t, stride);
}

// Metrale CUDA: gpt-oss's clamped SwiGLU, the epilogue of moe_clamp.cu's and moe_mma.cu's
// gate/up entries, rounded as the reference (metrale.lkb.semantics_moe_clamp) rounds it.
#pragma once
#include "metrale.cuh"

// (clamp(up) + 1) · g · σ(alpha · g), g = min(gate, limit), each step rounded to act.
__device__ __forceinline__ float clamped_swiglu(float gate, float up, float limit,
                                                float alpha) {
    const float g = fminf(gate, limit);
    const float u = fmaxf(fminf(up, limit), -limit);
    // NaN stays NaN, as the reference's clamps (fminf would drop it)
    const float gn = gate != gate ? gate : g, un = up != up ? up : u;
    const float sig = act_round(1.0f / (1.0f + expf(-act_round(__fmul_rn(gn, alpha)))));
    const float glu = act_round(__fmul_rn(gn, sig));
    return act_round(__fmul_rn(act_round(__fadd_rn(un, 1.0f)), glu));
}

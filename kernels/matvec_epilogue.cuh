// matvec_epilogue.cuh: the output step the matrix-vector kernels share
// (matvec.cu's FMA kernels and matvec_mma.cu's tensor-core ones): d0 (and
// d1, the up row of SwiGLU) are a row's f32 dot products.
#pragma once

#include "kernels.h"

namespace mg {

template <int EPI>
__device__ __forceinline__ void gemv_epilogue(float d0, float d1, const bf16 *__restrict__ bias, int r, size_t o,
                                              bf16 *out, float *__restrict__ out_f32) {
    if (EPI == kStore) {
        // nn.Linear with bias: f32 accumulate plus bias, one rounding.
        if (bias) d0 += bf(bias[r]);
        out[o] = __float2bfloat16(d0);
    } else if (EPI == kResidual) {
        // HF: the projection is stored in bf16, then added to the residual.
        out[o] = __float2bfloat16(bf(out[o]) + round_bf16(d0));
    } else if (EPI == kSwiGLU) {
        // HF: act_fn(gate_proj(x)) * up_proj(x), each stored in bf16.
        const float g = round_bf16(d0), u = round_bf16(d1);
        const float s = round_bf16(g / (1.f + __expf(-g)));
        out[o] = __float2bfloat16(s * u);
    } else {
        // Logits: HF bf16 computes them in bf16 (argmax ties included).
        out_f32[o] = round_bf16(d0);
    }
}

} // namespace mg

// dispatch.h: the kernel-choice rule, stated once. Which launcher runs an
// op depends on its rows and the backend's settings; the backend's forward
// and logits (backend_forward.cu) and the op test table (ops.cu) both ask
// choose_kernel, so the op table runs what production runs. The settings
// come from the caller through backend_open (mg_backend_options in
// native/meshgpu.h; the Go side's --cuda-* flags, docs/cuda-settings.md):
// the library reads no environment.
#pragma once

#include <stddef.h>

#include "../native/meshgpu.h"
#include "kernels.h"

namespace mg {

struct KernelSettings {
    bool f32_softmax = false;   // MG_ATTENTION_F32: flash-style f32 scores and softmax
    bool prefill_tiled = false; // MG_PREFILL_ATTENTION_TILED: never cuBLAS for prefill attention
    bool graphs = true;         // capture decode CUDA graphs (no_graphs == 0)
    bool batch_mma = false;     // decode matrix-vectors on tensor-core tiles (matvec_mma.cu)
    bool fused_decode = false; // RoPE + KV append inside decode attention, the ends inside the decode graph
};

// Reads the attention settings; false when one is out of range.
inline bool attention_settings(int32_t attention, int32_t prefill_attention, KernelSettings *ks) {
    if (attention != MG_ATTENTION_HF_BF16 && attention != MG_ATTENTION_F32) return false;
    if (prefill_attention != MG_PREFILL_ATTENTION_AUTO && prefill_attention != MG_PREFILL_ATTENTION_TILED) return false;
    ks->f32_softmax = attention == MG_ATTENTION_F32;
    ks->prefill_tiled = prefill_attention == MG_PREFILL_ATTENTION_TILED;
    return true;
}

// Reads opts (NULL: every default) into *ks; false when a value is out of
// range. device is checked by backend_open against the GPUs present.
inline bool kernel_settings(const mg_backend_options *opts, KernelSettings *ks) {
    *ks = KernelSettings{};
    if (!opts) return true;
    if (opts->no_graphs != 0 && opts->no_graphs != 1) return false;
    if (opts->batch_mma != 0 && opts->batch_mma != 1) return false;
    if (opts->fused_decode != 0 && opts->fused_decode != 1) return false;
    ks->graphs = opts->no_graphs == 0;
    ks->batch_mma = opts->batch_mma == 1;
    ks->fused_decode = opts->fused_decode == 1;
    return attention_settings(opts->attention, opts->prefill_attention, ks);
}

constexpr int kPrefillMin = 16;                     // a step with this many tokens uses a prefill kernel
constexpr size_t kPrefillGemmMax = (size_t)1 << 30; // scratch cap for cuBLAS prefill attention

enum class Op {
    Matmul,     // a projection, the MLP or the LM head over a chunk of rows
    NormMatmul, // an RMSNorm and the projection that reads it (qkv, gate/up, LM head)
    Attention, // attention of one step (one sequence's tokens)
    QuantMatmul, // a projection on block-quantized weights (quant.cu), RMSNorm included
};

enum class Kernel {
    Gemv,             // matvec.cu: the matrix-vector kernels, epilogues fused
    GemvNorm,         // matvec.cu: gemv_norm, the RMSNorm folded into the matrix-vector kernel
    GemvMma,          // matvec_mma.cu: the matrix-vector products on tensor-core tiles (after rmsnorm for NormMatmul)
    Cublas,           // gemm.cu: cuBLAS GEMMs
    AttnDecode,       // attention.cu: split-sequence decode attention (after rope.cu's rope_append)
    AttnDecodeRope,   // attention_fused.cu: the same with the RoPE and the KV append inside
    AttnPrefillGemm,  // attention_gemm.cu: prefill attention through cuBLAS (bf16 numerics)
    AttnPrefillTiled, // attention.cu: the tiled prefill kernel
    GemvQuant,        // quant.cu: int8 activation blocks and dp4a over the weight blocks
    DequantCublas,    // quant.cu + gemm.cu: row chunks dequantized to bf16, then cuBLAS
};

// choose_kernel: for Op::Matmul, rows is the chunk's rows; for
// Op::Attention, the step's tokens, and gemm_scratch the bytes
// attn_prefill_gemm_bytes() asks for that step (ignored for Matmul).
//   Matmul:    up to kGemvMaxRows rows: Gemv (GemvMma under batch_mma,
//              batch 1 included, so a batched row keeps a single row's
//              bits); more: Cublas.
//   NormMatmul: up to kGemvMaxRows rows: GemvNorm (one kernel, the same
//              bits as rmsnorm + Gemv; under batch_mma rmsnorm + GemvMma);
//              more: Cublas after rmsnorm.
//   QuantMatmul: up to kGemvMaxRows rows: GemvQuant (batch_mma has no
//              quantized tiles); more: DequantCublas.
//   Attention: one token under fused_decode: AttnDecodeRope (a step
//              of several tokens would read its own new keys, which the
//              fused kernel appends in the same launch); fewer than
//              kPrefillMin tokens: AttnDecode; else
//              AttnPrefillGemm in the default numerics and prefill kernel
//              while the scratch fits in kPrefillGemmMax (cuBLAS: 62% of
//              the GEMM rate on 8B at 512 tokens against 40% for the tiled
//              kernel, H200, docs/performance.md); else AttnPrefillTiled.
inline Kernel choose_kernel(Op op, int rows, size_t gemm_scratch, const KernelSettings &ks) {
    if (op == Op::Matmul) return rows > kGemvMaxRows ? Kernel::Cublas : ks.batch_mma ? Kernel::GemvMma : Kernel::Gemv;
    if (op == Op::NormMatmul)
        return rows > kGemvMaxRows ? Kernel::Cublas : ks.batch_mma ? Kernel::GemvMma : Kernel::GemvNorm;
    if (op == Op::QuantMatmul) return rows > kGemvMaxRows ? Kernel::DequantCublas : Kernel::GemvQuant;
    if (rows == 1 && ks.fused_decode) return Kernel::AttnDecodeRope;
    if (rows < kPrefillMin) return Kernel::AttnDecode;
    if (!ks.f32_softmax && !ks.prefill_tiled && gemm_scratch <= kPrefillGemmMax) return Kernel::AttnPrefillGemm;
    return Kernel::AttnPrefillTiled;
}

} // namespace mg

// dispatch_test.cu: the kernel-choice rule (dispatch.h) against its table,
// written out here by hand. Host code only: scripts/cuda-compile-check.sh
// builds and runs it without a GPU.
#include <cstdio>

#include "dispatch.h"

using namespace mg;

static int failures = 0;

static void want(const char *what, Kernel got, Kernel expect) {
    if (got != expect) {
        fprintf(stderr, "dispatch_test: %s: kernel %d, want %d\n", what, (int)got, (int)expect);
        failures++;
    }
}

static void want_ok(const char *what, bool got, bool expect) {
    if (got != expect) {
        fprintf(stderr, "dispatch_test: %s: %d, want %d\n", what, got, expect);
        failures++;
    }
}

int main() {
    const KernelSettings def{}, f32{true, false, true}, tiled{false, true, true};
    const size_t small = 1 << 20, big = kPrefillGemmMax + 1;

    want("matmul 1 row", choose_kernel(Op::Matmul, 1, 0, def), Kernel::Gemv);
    want("matmul 16 rows", choose_kernel(Op::Matmul, 16, 0, def), Kernel::Gemv);
    want("matmul 17 rows", choose_kernel(Op::Matmul, 17, 0, def), Kernel::Cublas);
    want("matmul 17 rows, f32 attention", choose_kernel(Op::Matmul, 17, 0, f32), Kernel::Cublas);
    want("norm+matmul 1 row", choose_kernel(Op::NormMatmul, 1, 0, def), Kernel::GemvNorm);
    want("norm+matmul 16 rows", choose_kernel(Op::NormMatmul, 16, 0, def), Kernel::GemvNorm);
    want("norm+matmul 17 rows", choose_kernel(Op::NormMatmul, 17, 0, def), Kernel::Cublas);
    KernelSettings mma;
    mma.batch_mma = true;
    want("matmul 1 row, batch_mma", choose_kernel(Op::Matmul, 1, 0, mma), Kernel::GemvMma);
    want("matmul 16 rows, batch_mma", choose_kernel(Op::Matmul, 16, 0, mma), Kernel::GemvMma);
    want("matmul 17 rows, batch_mma", choose_kernel(Op::Matmul, 17, 0, mma), Kernel::Cublas);
    want("norm+matmul 8 rows, batch_mma", choose_kernel(Op::NormMatmul, 8, 0, mma), Kernel::GemvMma);

    want("quantized matmul 1 row", choose_kernel(Op::QuantMatmul, 1, 0, def), Kernel::GemvQuant);
    want("quantized matmul 16 rows, batch_mma", choose_kernel(Op::QuantMatmul, 16, 0, mma), Kernel::GemvQuant);
    want("quantized matmul 17 rows", choose_kernel(Op::QuantMatmul, 17, 0, def), Kernel::DequantCublas);
    want("attention 1 token", choose_kernel(Op::Attention, 1, small, def), Kernel::AttnDecode);
    want("attention 15 tokens", choose_kernel(Op::Attention, 15, small, def), Kernel::AttnDecode);
    want("attention 15 tokens, tiled", choose_kernel(Op::Attention, 15, small, tiled), Kernel::AttnDecode);
    want("attention 16 tokens", choose_kernel(Op::Attention, 16, small, def), Kernel::AttnPrefillGemm);
    want("attention 16 tokens, scratch at the cap", choose_kernel(Op::Attention, 16, kPrefillGemmMax, def),
         Kernel::AttnPrefillGemm);
    want("attention 16 tokens, scratch past the cap", choose_kernel(Op::Attention, 16, big, def), Kernel::AttnPrefillTiled);
    want("attention 512 tokens, f32", choose_kernel(Op::Attention, 512, small, f32), Kernel::AttnPrefillTiled);
    want("attention 512 tokens, tiled", choose_kernel(Op::Attention, 512, small, tiled), Kernel::AttnPrefillTiled);
    KernelSettings fused;
    fused.fused_decode = true;
    want("attention 1 token, fused", choose_kernel(Op::Attention, 1, small, fused), Kernel::AttnDecodeRope);
    want("attention 2 tokens, fused", choose_kernel(Op::Attention, 2, small, fused), Kernel::AttnDecode);
    want("attention 16 tokens, fused", choose_kernel(Op::Attention, 16, small, fused), Kernel::AttnPrefillGemm);
    fused.f32_softmax = true;
    want("attention 1 token, fused, f32", choose_kernel(Op::Attention, 1, small, fused), Kernel::AttnDecodeRope);
    want("matmul 1 row, fused attention", choose_kernel(Op::Matmul, 1, 0, fused), Kernel::Gemv);

    KernelSettings ks;
    mg_backend_options o{};
    want_ok("all-zero options", kernel_settings(&o, &ks) && !ks.f32_softmax && !ks.prefill_tiled && ks.graphs, true);
    want_ok("NULL options", kernel_settings(nullptr, &ks) && ks.graphs, true);
    o.attention = MG_ATTENTION_F32;
    o.prefill_attention = MG_PREFILL_ATTENTION_TILED;
    o.no_graphs = 1;
    o.fused_decode = 1;
    want_ok("every option set", kernel_settings(&o, &ks) && ks.f32_softmax && ks.prefill_tiled && !ks.graphs && ks.fused_decode,
            true);
    for (int bad : {-1, 2}) {
        mg_backend_options b{};
        b.attention = bad;
        want_ok("attention out of range", kernel_settings(&b, &ks), false);
        b = mg_backend_options{};
        b.prefill_attention = bad;
        want_ok("prefill_attention out of range", kernel_settings(&b, &ks), false);
        b = mg_backend_options{};
        b.no_graphs = bad;
        want_ok("no_graphs out of range", kernel_settings(&b, &ks), false);
        b = mg_backend_options{};
        b.fused_decode = bad;
        want_ok("fused_decode out of range", kernel_settings(&b, &ks), false);
    }
    if (failures) return 1;
    printf("dispatch_test: OK\n");
    return 0;
}

// backend_quant.cu: the CUDA backend's projections on block-quantized
// weights (quant.cu). Decode rows are rounded to int8 blocks (with the
// RMSNorm before them folded in) and multiplied by the blocks directly, one
// launch per run of same-type matrices (Q4_K_M files mix Q4_K and Q6_K
// within q/k/v); prefill dequantizes row chunks of each matrix to bf16 and
// runs cuBLAS. Which of the two runs is choose_kernel's Op::QuantMatmul.
#include "backend_impl.h"

namespace mgcuda {

void qmat_free(QMat &q) {
    cudaFree(q.data);
    q = QMat{};
}

mg_status qmv(mg_stack *s, int epi, const QMat *const *mats, int nm, const QMat *up, const bf16 *x, const bf16 *norm_w,
              int rows, const bf16 *bias, bf16 *out, float *out_f32, int ldo) {
    const int k = mats[0]->cols;
    cudaStream_t st = s->st;
    CU(quantize_rows(x, norm_w, s->cfg.rms_eps, rows, k, s->xq, s->xd, st), "quantize activations");
    int col = 0;
    for (int i = 0; i < nm;) {
        // one launch for consecutive matrices of one type
        QSegs sg{};
        const int dt = mats[i]->dtype;
        int m = 0;
        while (i < nm && sg.n < 3 && mats[i]->dtype == dt) {
            sg.w[sg.n] = mats[i]->data;
            m += mats[i]->rows;
            sg.end[sg.n] = m;
            sg.out0[sg.n] = col;
            col += mats[i]->rows;
            sg.n++;
            i++;
        }
        // bias and out are indexed by output column: segments keep theirs
        CU(qgemv(epi, dt, sg, up ? up->data : nullptr, rows, m, k, s->xq, s->xd, bias, out, out_f32, ldo, st),
           "quantized matrix-vector");
    }
    return MG_OK;
}

mg_status qmm(mg_stack *s, const QMat *const *mats, int nm, const bf16 *X, int rows, void *Y, int ldy, bool y_f32,
              float beta) {
    int col = 0;
    for (int i = 0; i < nm; i++) {
        const QMat &q = *mats[i];
        const size_t rb = quant_row_bytes(q.dtype, q.cols);
        int chunk = (int)(s->deq_elems / (size_t)q.cols);
        if (chunk > q.rows) chunk = q.rows;
        if (chunk <= 0) return failf(MG_ERR_BACKEND, "cuda: prefill scratch too small for rows of %d", q.cols);
        for (int r0 = 0; r0 < q.rows; r0 += chunk) {
            const int mc = q.rows - r0 < chunk ? q.rows - r0 : chunk;
            CU(dequant_rows(q.dtype, static_cast<const char *>(q.data) + (size_t)r0 * rb, mc, q.cols, s->deq, s->st),
               "dequantize");
            char *y = static_cast<char *>(Y) + (size_t)(col + r0) * (y_f32 ? 4 : 2);
            BLAS(gemm_ld(s->blas, s->deq, X, rows, mc, q.cols, y, ldy, y_f32, beta), "quantized gemm");
        }
        col += q.rows;
    }
    return MG_OK;
}

mg_status qhead_logits(mg_stack *s, const bf16 *x, int m) {
    const mg_stack_config &c = s->cfg;
    const QMat *head = &s->qhead;
    if (choose_kernel(Op::QuantMatmul, m, 0, s->ks) == Kernel::GemvQuant)
        return qmv(s, kF32, &head, 1, nullptr, x, s->final_norm, m, nullptr, nullptr, s->logits, c.vocab);
    CU(rmsnorm(x, s->final_norm, c.rms_eps, m, c.hidden, s->h, s->st), "final norm");
    mg_status r = qmm(s, &head, 1, s->h, m, s->logits, c.vocab, true, 0.f);
    if (r != MG_OK) return r;
    CU(round_to_bf16(s->logits, (size_t)m * c.vocab, s->st), "logits");
    return MG_OK;
}

cudaError_t embed_rows(mg_stack *s, const int32_t *tokens, int n, bf16 *out) {
    if (s->qembed.data) return embed_quant(s->qembed.dtype, s->qembed.data, tokens, n, s->cfg.hidden, out, s->st);
    return mg::embed(s->embed, tokens, n, s->cfg.hidden, out, s->st);
}

} // namespace mgcuda

/*
 * cpu_ops.c: the op-level test table (meshgpu_ops.h) on the CPU backend's
 * reference kernels (cpu_kernels.h). The CUDA library exports the same table;
 * ops_test.go compares the two op by op, and this one against plain Go.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_sample.h"
#include "meshgpu_ops.h"

static _Thread_local char ops_err[512];

static mg_status ops_fail(mg_status s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ops_err, sizeof ops_err, fmt, ap);
    va_end(ap);
    return s;
}

static const char *ops_last_error(void) { return ops_err; }

static int ops_weight_ok(const mg_ops_weight *w) {
    return w && w->data && w->rows > 0 && w->cols > 0 &&
           (w->dtype == MG_F32 || w->dtype == MG_F16 || w->dtype == MG_BF16 ||
            (mg_cpu_is_quant(w->dtype) && mg_cpu_quant_row_bytes(w->dtype, w->cols) > 0));
}

static mg_cpu_weight ops_cw(const mg_ops_weight *w) {
    mg_cpu_weight c = {w->dtype, w->data, w->rows, w->cols};
    return c;
}

static mg_status ops_embed(const mg_ops_weight *table, const int32_t *tokens, int32_t n, float *out) {
    if (!ops_weight_ok(table) || !tokens || !out || n <= 0)
        return ops_fail(MG_ERR_INVALID_ARGUMENT, "embed: bad arguments");
    for (int32_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= table->rows)
            return ops_fail(MG_ERR_INVALID_ARGUMENT, "embed: token %d outside 0..%d", tokens[i], table->rows - 1);
    mg_cpu_weight t = ops_cw(table);
    mg_cpu_embed(&t, tokens, n, out);
    return MG_OK;
}

static mg_status ops_rmsnorm(const float *x, const mg_ops_weight *w, float eps, int32_t n, float *out) {
    if (!ops_weight_ok(w) || w->cols != 1 || !x || !out || n <= 0)
        return ops_fail(MG_ERR_INVALID_ARGUMENT, "rmsnorm: bad arguments");
    mg_cpu_weight cw = ops_cw(w);
    mg_cpu_rmsnorm(x, &cw, eps, n, w->rows, out);
    return MG_OK;
}

static mg_status ops_matmul(const float *x, const mg_ops_weight *w, const mg_ops_weight *bias,
                            const float *residual, int32_t n, float *out) {
    if (!ops_weight_ok(w) || !x || !out || n <= 0)
        return ops_fail(MG_ERR_INVALID_ARGUMENT, "matmul: bad arguments");
    if (bias && (!ops_weight_ok(bias) || bias->rows != w->rows || bias->cols != 1))
        return ops_fail(MG_ERR_INVALID_ARGUMENT, "matmul: bias shape");
    mg_cpu_weight cw = ops_cw(w), cb;
    if (bias) cb = ops_cw(bias);
    mg_cpu_matmul(x, &cw, bias ? &cb : NULL, n, out);
    if (residual)
        for (size_t i = 0; i < (size_t)n * w->rows; i++) out[i] += residual[i];
    return MG_OK;
}

static mg_status ops_swiglu(const float *x, const mg_ops_weight *gate, const mg_ops_weight *up, int32_t n,
                            float *out) {
    if (!ops_weight_ok(gate) || !ops_weight_ok(up) || up->rows != gate->rows || up->cols != gate->cols || !x ||
        !out || n <= 0)
        return ops_fail(MG_ERR_INVALID_ARGUMENT, "swiglu: bad arguments");
    const size_t m = (size_t)n * gate->rows;
    float *u = malloc(m * sizeof(float));
    if (!u) return ops_fail(MG_ERR_OUT_OF_MEMORY, "swiglu: out of memory");
    mg_cpu_weight g = ops_cw(gate), uw = ops_cw(up);
    mg_cpu_matmul(x, &g, NULL, n, out);
    mg_cpu_matmul(x, &uw, NULL, n, u);
    mg_cpu_swiglu(out, u, (int32_t)m, out);
    free(u);
    return MG_OK;
}

static mg_status ops_rope(float *x, int32_t n, int32_t n_heads, const int32_t *positions, const mg_ops_rope *p) {
    if (!x || !positions || !p || n <= 0 || n_heads <= 0 || p->head_dim <= 0 || p->head_dim % 2 ||
        p->head_dim > 1024)
        return ops_fail(MG_ERR_INVALID_ARGUMENT, "rope: bad arguments");
    for (int32_t i = 0; i < n; i++)
        if (positions[i] < 0) return ops_fail(MG_ERR_INVALID_ARGUMENT, "rope: position %d", positions[i]);
    mg_rope_params rp = {p->type, p->theta, p->factor, p->low_freq_factor, p->high_freq_factor,
                         p->original_max_pos, p->head_dim};
    mg_cpu_rope(x, n, n_heads, positions, &rp);
    return MG_OK;
}

static mg_status ops_attention(const float *q, const float *k, const float *v, int32_t n, int32_t pos0,
                               int32_t n_heads, int32_t n_kv, int32_t hd, int32_t attention,
                               int32_t prefill_attention, float *out) {
    /* The settings are checked as the CUDA side checks them; the reference
     * is f32 math whatever they say. */
    if (attention != MG_ATTENTION_HF_BF16 && attention != MG_ATTENTION_F32)
        return ops_fail(MG_ERR_INVALID_ARGUMENT, "attention: unknown numerics %d", attention);
    if (prefill_attention != MG_PREFILL_ATTENTION_AUTO && prefill_attention != MG_PREFILL_ATTENTION_TILED)
        return ops_fail(MG_ERR_INVALID_ARGUMENT, "attention: unknown prefill kernel %d", prefill_attention);
    if (!q || !k || !v || !out || n <= 0 || pos0 < 0 || n_heads <= 0 || n_kv <= 0 || n_heads % n_kv || hd <= 0)
        return ops_fail(MG_ERR_INVALID_ARGUMENT, "attention: bad arguments");
    mg_cpu_attention(q, k, v, n, pos0, n_heads, n_kv, hd, out);
    return MG_OK;
}

static mg_status ops_attention_tree(const float *q, const float *k, const float *v, int32_t n, int32_t pos0,
                                    const int32_t *parents, int32_t n_heads, int32_t n_kv, int32_t hd, float *out) {
    if (!q || !k || !v || !out || !parents || n <= 0 || n > MG_MAX_TREE_ROWS || pos0 < 0 || n_heads <= 0 || n_kv <= 0 ||
        n_heads % n_kv || hd <= 0)
        return ops_fail(MG_ERR_INVALID_ARGUMENT, "attention_tree: bad arguments");
    uint8_t *mask = calloc((size_t)n * (size_t)n, 1);
    float *scratch = malloc((size_t)(pos0 + n) * sizeof(float));
    mg_status st = mask && scratch ? MG_OK : ops_fail(MG_ERR_OUT_OF_MEMORY, "attention_tree: out of memory");
    for (int32_t i = 0; st == MG_OK && i < n; i++) {
        int32_t p = parents[i];
        if (p < -1 || p >= i) {
            st = ops_fail(MG_ERR_INVALID_ARGUMENT, "attention_tree: row %d has parent %d", i, p);
            break;
        }
        if (p >= 0) memcpy(mask + (size_t)i * n, mask + (size_t)p * n, (size_t)p + 1);
        mask[(size_t)i * n + i] = 1;
    }
    if (st == MG_OK) mg_cpu_attention_tree_par(NULL, q, k, v, n, pos0, mask, n_heads, n_kv, hd, out, scratch);
    free(mask);
    free(scratch);
    return st;
}

static mg_status ops_logits(const float *x, const mg_ops_weight *norm, const mg_ops_weight *head, float eps,
                            int32_t n, float *out) {
    if (!ops_weight_ok(norm) || !ops_weight_ok(head) || norm->rows != head->cols || norm->cols != 1 || !x ||
        !out || n <= 0)
        return ops_fail(MG_ERR_INVALID_ARGUMENT, "logits: bad arguments");
    float *h = malloc((size_t)n * head->cols * sizeof(float));
    if (!h) return ops_fail(MG_ERR_OUT_OF_MEMORY, "logits: out of memory");
    mg_cpu_weight nw = ops_cw(norm), hw = ops_cw(head);
    mg_cpu_rmsnorm(x, &nw, eps, n, head->cols, h);
    mg_cpu_matmul(h, &hw, NULL, n, out);
    free(h);
    return MG_OK;
}

static mg_status ops_copy_gbps(uint64_t bytes, int32_t iters, double *gbps) {
    (void)bytes, (void)iters, (void)gbps;
    return ops_fail(MG_ERR_UNSUPPORTED, "copy_gbps: cuda only (the cpu backend has MemReadBandwidth)");
}

static mg_status ops_gemm_tflops(int32_t m, int32_t n, int32_t k, int32_t iters, double *tflops) {
    (void)m, (void)n, (void)k, (void)iters, (void)tflops;
    return ops_fail(MG_ERR_UNSUPPORTED, "gemm_tflops: cuda only");
}

static mg_status ops_matvec_gbps(int32_t m, int32_t k, int32_t n, int32_t iters, double *gbps) {
    (void)m, (void)k, (void)n, (void)iters, (void)gbps;
    return ops_fail(MG_ERR_UNSUPPORTED, "matvec_gbps: cuda only");
}

static mg_status ops_hop_host_ns(uint64_t *ns) {
    (void)ns;
    return ops_fail(MG_ERR_UNSUPPORTED, "hop_host_ns: cuda only");
}

static mg_status ops_sample(const float *logits, int32_t vocab, const mg_sample_params *p, const int32_t *history,
                            int32_t n_history, int32_t generated_from, int64_t draw, mg_sample_result *out) {
    if (!logits || vocab <= 0) return ops_fail(MG_ERR_INVALID_ARGUMENT, "sample: bad arguments");
    float *work = malloc(sizeof(float) * (size_t)vocab);
    if (!work) return ops_fail(MG_ERR_OUT_OF_MEMORY, "sample: out of memory");
    for (int32_t i = 0; i < vocab; i++) work[i] = logits[i];
    mg_status st = mg_cpu_sample(work, vocab, p, history, n_history, generated_from, draw, out, ops_err, sizeof ops_err);
    free(work);
    return st;
}

static mg_status ops_norm_matmul(const float *x, const mg_ops_weight *norm, float eps, const mg_ops_weight *w, int32_t n,
                                 float *out) {
    if (!ops_weight_ok(norm) || norm->cols != 1 || !ops_weight_ok(w) || w->cols != norm->rows || !x || !out || n <= 0)
        return ops_fail(MG_ERR_INVALID_ARGUMENT, "norm_matmul: bad arguments");
    float *h = malloc(sizeof(float) * (size_t)n * (size_t)w->cols);
    if (!h) return ops_fail(MG_ERR_OUT_OF_MEMORY, "norm_matmul: out of memory");
    mg_cpu_weight cn = ops_cw(norm), cw = ops_cw(w);
    mg_cpu_rmsnorm(x, &cn, eps, n, norm->rows, h);
    mg_cpu_matmul(h, &cw, NULL, n, out);
    free(h);
    return MG_OK;
}

static mg_status ops_matmul_mma(const float *x, const mg_ops_weight *w, int32_t n, float *out) {
    return ops_matmul(x, w, NULL, NULL, n, out);
}

static mg_status ops_mma_gbps(int32_t m, int32_t k, int32_t n, int32_t iters, double *gbps) {
    (void)m, (void)k, (void)n, (void)iters, (void)gbps;
    return ops_fail(MG_ERR_UNSUPPORTED, "mma_gbps: cuda only");
}

static mg_status ops_rope_attention(const float *q, const float *kn, const float *vn, float *k, float *v, int32_t n,
                                    int32_t pos, int32_t n_heads, int32_t n_kv, const mg_ops_rope *p,
                                    int32_t attention, float *out) {
    if (attention != MG_ATTENTION_HF_BF16 && attention != MG_ATTENTION_F32)
        return ops_fail(MG_ERR_INVALID_ARGUMENT, "rope_attention: unknown numerics %d", attention);
    if (!q || !kn || !vn || !k || !v || !p || !out || n <= 0 || pos < 0 || pos > (1 << 20) || n_heads <= 0 ||
        n_kv <= 0 || n_heads % n_kv || p->head_dim <= 0 || p->head_dim % 2 || p->head_dim > 1024)
        return ops_fail(MG_ERR_INVALID_ARGUMENT, "rope_attention: bad arguments");
    const int32_t hd = p->head_dim, qn = n_heads * hd, kvn = n_kv * hd;
    float *qr = malloc((size_t)qn * sizeof(float));
    if (!qr) return ops_fail(MG_ERR_OUT_OF_MEMORY, "rope_attention: out of memory");
    mg_rope_params rp = {p->type, p->theta, p->factor, p->low_freq_factor, p->high_freq_factor,
                         p->original_max_pos, hd};
    for (int32_t i = 0; i < n; i++) {
        float *kc = k + (size_t)i * (pos + 1) * kvn, *vc = v + (size_t)i * (pos + 1) * kvn;
        memcpy(qr, q + (size_t)i * qn, (size_t)qn * sizeof(float));
        memcpy(kc + (size_t)pos * kvn, kn + (size_t)i * kvn, (size_t)kvn * sizeof(float));
        memcpy(vc + (size_t)pos * kvn, vn + (size_t)i * kvn, (size_t)kvn * sizeof(float));
        mg_cpu_rope(qr, 1, n_heads, &pos, &rp);
        mg_cpu_rope(kc + (size_t)pos * kvn, 1, n_kv, &pos, &rp);
        mg_cpu_attention(qr, kc, vc, 1, pos, n_heads, n_kv, hd, out + (size_t)i * qn);
    }
    free(qr);
    return MG_OK;
}

static const mg_ops_api cpu_ops = {
    MG_OPS_ABI_VERSION, "cpu",         ops_last_error, ops_embed,     ops_rmsnorm,     ops_matmul,      ops_swiglu,
    ops_rope,           ops_attention, ops_logits,     ops_copy_gbps, ops_gemm_tflops, ops_matvec_gbps, ops_hop_host_ns, ops_sample,
    ops_norm_matmul, ops_matmul_mma, ops_mma_gbps, ops_rope_attention, ops_attention_tree,
};

const mg_ops_api *mg_cpu_ops(void) { return &cpu_ops; }

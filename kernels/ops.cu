// ops.cu: the op-level test table (native/meshgpu_ops.h), exported as
// mg_cuda_ops. Each op copies f32 host inputs to the device in bf16 (the
// backend's activation type), runs the launcher the backend's own rule picks
// for its shape (choose_kernel, dispatch.h), and copies the result back as
// f32. Slow by design (allocations per call); it exists so every kernel is
// compared with the CPU reference on its own.
#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "../native/meshgpu_ops.h"
#include "backend.h"
#include "dispatch.h"
#include "kernels.h"

using namespace mg;

namespace {

thread_local char g_err[512];

mg_status failf(mg_status s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof g_err, fmt, ap);
    va_end(ap);
    return s;
}

#define CU(call, what)                                                                             \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            return failf(e_ == cudaErrorMemoryAllocation ? MG_ERR_OUT_OF_MEMORY : MG_ERR_BACKEND,  \
                         "cuda: %s: %s", what, cudaGetErrorString(e_));                            \
    } while (0)

// Device buffers freed at scope exit.
struct Scratch {
    std::vector<void *> ptrs;
    ~Scratch() {
        for (void *p : ptrs) cudaFree(p);
    }
    template <class T> mg_status alloc(T **p, size_t n) {
        *p = nullptr;
        cudaError_t e = cudaMalloc((void **)p, (n ? n : 1) * sizeof(T));
        if (e != cudaSuccess) return failf(MG_ERR_OUT_OF_MEMORY, "cuda: allocating %zu bytes: %s", n * sizeof(T), cudaGetErrorString(e));
        ptrs.push_back(*p);
        return MG_OK;
    }
};

std::mutex g_blas_mu;
cublasHandle_t g_blas = nullptr;

mg_status blas(cublasHandle_t *out) {
    std::lock_guard<std::mutex> lock(g_blas_mu);
    if (!g_blas && cublasCreate(&g_blas) != CUBLAS_STATUS_SUCCESS) {
        g_blas = nullptr;
        return failf(MG_ERR_BACKEND, "cublas: cannot create a handle");
    }
    cublasSetStream(g_blas, 0);
    *out = g_blas;
    return MG_OK;
}

size_t dsize(int32_t d) { return d == MG_F32 ? 4 : (d == MG_F16 || d == MG_BF16) ? 2 : 0; }

mg_status check_weight(const mg_ops_weight *w, const char *name) {
    if (!w || !w->data) return failf(MG_ERR_INVALID_ARGUMENT, "%s: weight is NULL", name);
    if (!dsize(w->dtype)) return failf(MG_ERR_INVALID_ARGUMENT, "%s: unknown dtype %d", name, w->dtype);
    if (w->rows <= 0 || w->cols <= 0) return failf(MG_ERR_INVALID_ARGUMENT, "%s: shape %dx%d", name, w->rows, w->cols);
    return MG_OK;
}

mg_status weight_to_dev(Scratch &sc, const mg_ops_weight *w, bf16 **out) {
    const size_t n = (size_t)w->rows * w->cols;
    void *raw = nullptr;
    mg_status r = sc.alloc((char **)&raw, n * dsize(w->dtype));
    if (r == MG_OK) r = sc.alloc(out, n);
    if (r != MG_OK) return r;
    CU(cudaMemcpy(raw, w->data, n * dsize(w->dtype), cudaMemcpyHostToDevice), "weight copy");
    CU(convert_to_bf16(raw, w->dtype, n, *out, 0), "weight convert");
    return MG_OK;
}

mg_status act_to_dev(Scratch &sc, const float *h, size_t n, bf16 **out) {
    float *tmp = nullptr;
    mg_status r = sc.alloc(&tmp, n);
    if (r == MG_OK) r = sc.alloc(out, n);
    if (r != MG_OK) return r;
    CU(cudaMemcpy(tmp, h, n * 4, cudaMemcpyHostToDevice), "input copy");
    CU(f32_to_bf16(tmp, n, *out, 0), "input convert");
    return MG_OK;
}

mg_status act_to_host(Scratch &sc, const bf16 *d, size_t n, float *h) {
    float *tmp = nullptr;
    mg_status r = sc.alloc(&tmp, n);
    if (r != MG_OK) return r;
    CU(bf16_to_f32(d, n, tmp, 0), "output convert");
    CU(cudaMemcpy(h, tmp, n * 4, cudaMemcpyDeviceToHost), "output copy");
    CU(cudaDeviceSynchronize(), "sync");
    return MG_OK;
}

const char *op_last_error(void) { return g_err; }

// The embedding gather of a block-quantized table (backend embed_rows).
mg_status op_embed_quant(const mg_ops_weight *table, const int32_t *tokens, int32_t n, float *out) {
    const size_t rb = quant_row_bytes(table->dtype, table->cols);
    if (!rb || table->rows <= 0 || !table->data || n <= 0 || !tokens || !out)
        return failf(MG_ERR_INVALID_ARGUMENT, "embed: bad arguments");
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= table->rows)
            return failf(MG_ERR_INVALID_ARGUMENT, "embed: token %d outside 0..%d", tokens[i], table->rows - 1);
    Scratch sc;
    char *t;
    bf16 *o;
    int32_t *tok;
    mg_status r;
    if ((r = sc.alloc(&t, (size_t)table->rows * rb)) != MG_OK || (r = sc.alloc(&tok, n)) != MG_OK ||
        (r = sc.alloc(&o, (size_t)n * table->cols)) != MG_OK)
        return r;
    CU(cudaMemcpy(t, table->data, (size_t)table->rows * rb, cudaMemcpyHostToDevice), "table copy");
    CU(cudaMemcpy(tok, tokens, n * 4, cudaMemcpyHostToDevice), "tokens");
    CU(embed_quant(table->dtype, t, tok, n, table->cols, o, 0), "embed");
    return act_to_host(sc, o, (size_t)n * table->cols, out);
}

mg_status op_embed(const mg_ops_weight *table, const int32_t *tokens, int32_t n, float *out) {
    if (table && quant_block(table->dtype, nullptr, nullptr)) return op_embed_quant(table, tokens, n, out);
    mg_status r = check_weight(table, "embed");
    if (r != MG_OK) return r;
    if (n <= 0 || !tokens || !out) return failf(MG_ERR_INVALID_ARGUMENT, "embed: need n > 0 tokens and an output");
    if (table->cols % 8) return failf(MG_ERR_UNSUPPORTED, "embed: hidden %d not a multiple of 8", table->cols);
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= table->rows)
            return failf(MG_ERR_INVALID_ARGUMENT, "embed: token %d outside 0..%d", tokens[i], table->rows - 1);
    Scratch sc;
    bf16 *t = nullptr, *o = nullptr;
    int32_t *tok = nullptr;
    if ((r = weight_to_dev(sc, table, &t)) != MG_OK) return r;
    if ((r = sc.alloc(&tok, n)) != MG_OK || (r = sc.alloc(&o, (size_t)n * table->cols)) != MG_OK) return r;
    CU(cudaMemcpy(tok, tokens, n * 4, cudaMemcpyHostToDevice), "tokens");
    CU(embed(t, tok, n, table->cols, o, 0), "embed");
    return act_to_host(sc, o, (size_t)n * table->cols, out);
}

mg_status op_rmsnorm(const float *x, const mg_ops_weight *w, float eps, int32_t n, float *out) {
    mg_status r = check_weight(w, "rmsnorm");
    if (r != MG_OK) return r;
    const int dim = w->rows;
    if (n <= 0 || !x || !out || w->cols != 1) return failf(MG_ERR_INVALID_ARGUMENT, "rmsnorm: bad arguments");
    if (dim % 8) return failf(MG_ERR_UNSUPPORTED, "rmsnorm: dim %d not a multiple of 8", dim);
    Scratch sc;
    bf16 *wd, *xd, *o;
    if ((r = weight_to_dev(sc, w, &wd)) != MG_OK || (r = act_to_dev(sc, x, (size_t)n * dim, &xd)) != MG_OK ||
        (r = sc.alloc(&o, (size_t)n * dim)) != MG_OK)
        return r;
    CU(rmsnorm(xd, wd, eps, n, dim, o, 0), "rmsnorm");
    return act_to_host(sc, o, (size_t)n * dim, out);
}

// matmul on a block-quantized weight: what a quantized layer's projection
// runs (choose_kernel's Op::QuantMatmul): int8 activation blocks and
// qgemv up to 16 rows, row chunks dequantized to bf16 + cuBLAS above.
mg_status op_matmul_quant(const float *x, const mg_ops_weight *w, const mg_ops_weight *bias, const float *residual,
                          int32_t n, float *out) {
    const int m = w->rows, k = w->cols;
    const size_t rb = quant_row_bytes(w->dtype, k);
    if (!rb || m <= 0 || !w->data || n <= 0 || !x || !out)
        return failf(MG_ERR_INVALID_ARGUMENT, "matmul: %dx%d of dtype %d is not whole blocks", m, k, w->dtype);
    if (bias && (check_weight(bias, "matmul bias") != MG_OK || bias->rows != m || bias->cols != 1))
        return failf(MG_ERR_INVALID_ARGUMENT, "matmul: bias shape");
    if (bias && residual) return failf(MG_ERR_UNSUPPORTED, "matmul: bias and residual together");
    Scratch sc;
    char *wq;
    bf16 *xd, *bd = nullptr, *o;
    mg_status r;
    if ((r = sc.alloc(&wq, (size_t)m * rb)) != MG_OK || (r = act_to_dev(sc, x, (size_t)n * k, &xd)) != MG_OK) return r;
    CU(cudaMemcpy(wq, w->data, (size_t)m * rb, cudaMemcpyHostToDevice), "weight copy");
    if (bias && (r = weight_to_dev(sc, bias, &bd)) != MG_OK) return r;
    if (residual) {
        if ((r = act_to_dev(sc, residual, (size_t)n * m, &o)) != MG_OK) return r;
    } else if ((r = sc.alloc(&o, (size_t)n * m)) != MG_OK) {
        return r;
    }
    if (choose_kernel(Op::QuantMatmul, n, 0, KernelSettings{}) == Kernel::GemvQuant) {
        int8_t *xq;
        float *xs;
        if ((r = sc.alloc(&xq, (size_t)n * k)) != MG_OK || (r = sc.alloc(&xs, (size_t)n * (k / 32))) != MG_OK) return r;
        QSegs sg{};
        sg.w[0] = wq;
        sg.end[0] = m;
        sg.n = 1;
        CU(quantize_rows(xd, nullptr, 0.f, n, k, xq, xs, 0), "quantize activations");
        CU(qgemv(residual ? kResidual : kStore, w->dtype, sg, nullptr, n, m, k, xq, xs, bd, o, nullptr, m, 0), "qgemv");
    } else {
        cublasHandle_t h;
        bf16 *wd, *y = o;
        if ((r = blas(&h)) != MG_OK || (r = sc.alloc(&wd, (size_t)m * k)) != MG_OK) return r;
        CU(dequant_rows(w->dtype, wq, m, k, wd, 0), "dequantize");
        if (bd) CU(fill_rows(bd, n, m, o, 0), "bias rows");
        if (residual && (r = sc.alloc(&y, (size_t)n * m)) != MG_OK) return r;
        if (gemm(h, wd, xd, n, m, k, y, false, bd ? 1.f : 0.f) != CUBLAS_STATUS_SUCCESS)
            return failf(MG_ERR_BACKEND, "cublas: gemm failed");
        if (residual) CU(add_inplace(o, y, (size_t)n * m, 0), "residual add");
    }
    return act_to_host(sc, o, (size_t)n * m, out);
}

mg_status op_matmul(const float *x, const mg_ops_weight *w, const mg_ops_weight *bias, const float *residual,
                    int32_t n, float *out) {
    if (w && quant_block(w->dtype, nullptr, nullptr)) return op_matmul_quant(x, w, bias, residual, n, out);
    mg_status r = check_weight(w, "matmul");
    if (r != MG_OK) return r;
    const int m = w->rows, k = w->cols;
    if (n <= 0 || !x || !out) return failf(MG_ERR_INVALID_ARGUMENT, "matmul: bad arguments");
    if (k % 8) return failf(MG_ERR_UNSUPPORTED, "matmul: k %d not a multiple of 8", k);
    if (bias && ((r = check_weight(bias, "matmul bias")) != MG_OK)) return r;
    if (bias && (bias->rows != m || bias->cols != 1)) return failf(MG_ERR_INVALID_ARGUMENT, "matmul: bias shape");
    if (bias && residual) return failf(MG_ERR_UNSUPPORTED, "matmul: bias and residual together");
    Scratch sc;
    bf16 *wd, *xd, *bd = nullptr, *o;
    if ((r = weight_to_dev(sc, w, &wd)) != MG_OK || (r = act_to_dev(sc, x, (size_t)n * k, &xd)) != MG_OK) return r;
    if (bias && (r = weight_to_dev(sc, bias, &bd)) != MG_OK) return r;
    if (residual) {
        if ((r = act_to_dev(sc, residual, (size_t)n * m, &o)) != MG_OK) return r;
    } else if ((r = sc.alloc(&o, (size_t)n * m)) != MG_OK) {
        return r;
    }
    if (choose_kernel(Op::Matmul, n, 0, KernelSettings{}) == Kernel::Gemv) {
        CU(gemv(residual ? kResidual : kStore, wd, xd, n, m, k, bd, o, nullptr, 0), "gemv");
    } else {
        cublasHandle_t h;
        if ((r = blas(&h)) != MG_OK) return r;
        if (bd) CU(fill_rows(bd, n, m, o, 0), "bias rows");
        bf16 *y = o;
        if (residual && (r = sc.alloc(&y, (size_t)n * m)) != MG_OK) return r;
        if (gemm(h, wd, xd, n, m, k, y, false, bd ? 1.f : 0.f) != CUBLAS_STATUS_SUCCESS)
            return failf(MG_ERR_BACKEND, "cublas: gemm failed");
        if (residual) CU(add_inplace(o, y, (size_t)n * m, 0), "residual add");
    }
    return act_to_host(sc, o, (size_t)n * m, out);
}

mg_status op_swiglu(const float *x, const mg_ops_weight *gate, const mg_ops_weight *up, int32_t n, float *out) {
    mg_status r = check_weight(gate, "swiglu gate");
    if (r == MG_OK) r = check_weight(up, "swiglu up");
    if (r != MG_OK) return r;
    const int m = gate->rows, k = gate->cols;
    if (n <= 0 || !x || !out || up->rows != m || up->cols != k || up->dtype != gate->dtype)
        return failf(MG_ERR_INVALID_ARGUMENT, "swiglu: bad arguments");
    if (k % 8 || m % 8) return failf(MG_ERR_UNSUPPORTED, "swiglu: dims not multiples of 8");
    Scratch sc;
    // Gate and up rows fused into one [2m, k] matrix, as the backend stores them.
    const size_t wn = (size_t)m * k, es = dsize(gate->dtype);
    char *raw;
    bf16 *wgu, *xd, *o;
    if ((r = sc.alloc(&raw, 2 * wn * es)) != MG_OK || (r = sc.alloc(&wgu, 2 * wn)) != MG_OK) return r;
    CU(cudaMemcpy(raw, gate->data, wn * es, cudaMemcpyHostToDevice), "gate copy");
    CU(cudaMemcpy(raw + wn * es, up->data, wn * es, cudaMemcpyHostToDevice), "up copy");
    CU(convert_to_bf16(raw, gate->dtype, 2 * wn, wgu, 0), "weight convert");
    if ((r = act_to_dev(sc, x, (size_t)n * k, &xd)) != MG_OK || (r = sc.alloc(&o, (size_t)n * m)) != MG_OK) return r;
    if (choose_kernel(Op::Matmul, n, 0, KernelSettings{}) == Kernel::Gemv) {
        CU(gemv(kSwiGLU, wgu, xd, n, m, k, nullptr, o, nullptr, 0), "gemv");
    } else {
        cublasHandle_t h;
        bf16 *gu;
        if ((r = blas(&h)) != MG_OK || (r = sc.alloc(&gu, (size_t)n * 2 * m)) != MG_OK) return r;
        if (gemm(h, wgu, xd, n, 2 * m, k, gu, false, 0.f) != CUBLAS_STATUS_SUCCESS)
            return failf(MG_ERR_BACKEND, "cublas: gemm failed");
        CU(swiglu(gu, n, m, o, 0), "swiglu");
    }
    return act_to_host(sc, o, (size_t)n * m, out);
}

mg_status op_rope(float *x, int32_t n, int32_t n_heads, const int32_t *positions, const mg_ops_rope *p) {
    if (!x || !positions || !p || n <= 0 || n_heads <= 0 || p->head_dim <= 0 || p->head_dim % 2)
        return failf(MG_ERR_INVALID_ARGUMENT, "rope: bad arguments");
    int maxp = 0;
    for (int i = 0; i < n; i++) {
        if (positions[i] < 0 || positions[i] > (1 << 20)) return failf(MG_ERR_INVALID_ARGUMENT, "rope: position %d", positions[i]);
        maxp = positions[i] > maxp ? positions[i] : maxp;
    }
    const int hd = p->head_dim;
    std::vector<float> inv(hd / 2);
    rope_inv_freq(p->type, p->theta, p->factor, p->low_freq_factor, p->high_freq_factor, p->original_max_pos, hd, inv.data());
    std::vector<float2> tab((size_t)(maxp + 1) * (hd / 2));
    rope_table(inv.data(), hd, maxp + 1, tab.data());
    std::vector<mg_row_meta> meta(n);
    for (int i = 0; i < n; i++) meta[i] = mg_row_meta{nullptr, nullptr, 0, positions[i], 0};
    Scratch sc;
    float2 *cs;
    mg_row_meta *md;
    bf16 *xd;
    mg_status r;
    if ((r = sc.alloc(&cs, tab.size())) != MG_OK || (r = sc.alloc(&md, n)) != MG_OK ||
        (r = act_to_dev(sc, x, (size_t)n * n_heads * hd, &xd)) != MG_OK)
        return r;
    CU(cudaMemcpy(cs, tab.data(), tab.size() * sizeof(float2), cudaMemcpyHostToDevice), "rope table");
    CU(cudaMemcpy(md, meta.data(), n * sizeof(mg_row_meta), cudaMemcpyHostToDevice), "meta");
    CU(rope_append(xd, n, n_heads, 0, hd, cs, md, 0, 0), "rope");
    return act_to_host(sc, xd, (size_t)n * n_heads * hd, x);
}

mg_status op_attention(const float *q, const float *k, const float *v, int32_t n, int32_t pos0, int32_t H,
                       int32_t KVH, int32_t hd, int32_t attention, int32_t prefill_attention, float *out) {
    KernelSettings ks;
    if (!attention_settings(attention, prefill_attention, &ks))
        return failf(MG_ERR_INVALID_ARGUMENT, "attention: numerics %d, prefill kernel %d out of range", attention, prefill_attention);
    const bool f32_softmax = ks.f32_softmax;
    if (!q || !k || !v || !out || n <= 0 || pos0 < 0 || H <= 0 || KVH <= 0 || H % KVH)
        return failf(MG_ERR_INVALID_ARGUMENT, "attention: bad arguments");
    if (hd != 32 && hd != 64 && hd != 128) return failf(MG_ERR_UNSUPPORTED, "attention: head_dim %d", hd);
    if (H / KVH > 8) return failf(MG_ERR_UNSUPPORTED, "attention: more than 8 query heads per kv head");
    const int len = pos0 + n;
    Scratch sc;
    bf16 *qd, *kd, *vd, *o;
    mg_status r;
    if ((r = act_to_dev(sc, q, (size_t)n * H * hd, &qd)) != MG_OK ||
        (r = act_to_dev(sc, k, (size_t)len * KVH * hd, &kd)) != MG_OK ||
        (r = act_to_dev(sc, v, (size_t)len * KVH * hd, &vd)) != MG_OK || (r = sc.alloc(&o, (size_t)n * H * hd)) != MG_OK)
        return r;
    const size_t gemm_bytes = attn_prefill_gemm_bytes(n, pos0, H, KVH, hd);
    const Kernel kernel = choose_kernel(Op::Attention, n, gemm_bytes, ks);
    if (kernel == Kernel::AttnDecode) {
        std::vector<mg_row_meta> meta(n);
        for (int i = 0; i < n; i++) meta[i] = mg_row_meta{kd, vd, 0, pos0 + i, 0};
        mg_row_meta *md;
        AttnScratch scr;
        scr.f32_softmax = f32_softmax;
        scr.scores_stride = len;
        if ((r = sc.alloc(&md, n)) != MG_OK || (r = sc.alloc(&scr.partial, attn_partial_floats(n, H, hd, len))) != MG_OK ||
            (r = sc.alloc(&scr.scores, (size_t)n * H * len)) != MG_OK ||
            (r = sc.alloc(&scr.stats, (size_t)n * H * attn_chunks(len) * 2)) != MG_OK)
            return r;
        CU(cudaMemcpy(md, meta.data(), n * sizeof(mg_row_meta), cudaMemcpyHostToDevice), "meta");
        CU(attn_decode(qd, H * hd, md, n, 0, H, KVH, hd, len, scr, o, 0), "decode attention");
    } else if (kernel == Kernel::AttnPrefillGemm) {
        cublasHandle_t bh;
        void *scratch;
        if ((r = blas(&bh)) != MG_OK || (r = sc.alloc((char **)&scratch, gemm_bytes)) != MG_OK)
            return r;
        cublasStatus_t bs;
        CU(attn_prefill_gemm(bh, qd, H * hd, n, pos0, kd, vd, H, KVH, hd, scratch, o, 0, &bs), "prefill attention (cublas)");
        if (bs != CUBLAS_STATUS_SUCCESS) return failf(MG_ERR_BACKEND, "cublas: prefill attention: status %d", (int)bs);
    } else {
        CU(attn_prefill(qd, H * hd, n, pos0, kd, vd, H, KVH, hd, f32_softmax, o, 0), "prefill attention");
    }
    return act_to_host(sc, o, (size_t)n * H * hd, out);
}

mg_status op_rope_attention(const float *q, const float *kn, const float *vn, float *k, float *v, int32_t n, int32_t pos,
                            int32_t H, int32_t KVH, const mg_ops_rope *p, int32_t attention, float *out) {
    KernelSettings ks;
    if (!attention_settings(attention, MG_PREFILL_ATTENTION_AUTO, &ks))
        return failf(MG_ERR_INVALID_ARGUMENT, "rope_attention: numerics %d out of range", attention);
    if (!q || !kn || !vn || !k || !v || !p || !out || n <= 0 || pos < 0 || pos > (1 << 20) || H <= 0 || KVH <= 0 ||
        H % KVH)
        return failf(MG_ERR_INVALID_ARGUMENT, "rope_attention: bad arguments");
    const int hd = p->head_dim;
    if (hd != 32 && hd != 64 && hd != 128) return failf(MG_ERR_UNSUPPORTED, "rope_attention: head_dim %d", hd);
    if (H / KVH > 8) return failf(MG_ERR_UNSUPPORTED, "rope_attention: more than 8 query heads per kv head");
    if (n > kGemvMaxRows) return failf(MG_ERR_UNSUPPORTED, "rope_attention: more than %d rows", kGemvMaxRows);
    // What the backend runs for single-token steps under fused_decode.
    ks.fused_decode = true;
    if (choose_kernel(Op::Attention, 1, 0, ks) != Kernel::AttnDecodeRope)
        return failf(MG_ERR_BACKEND, "rope_attention: choose_kernel does not pick the fused kernel");
    const int len = pos + 1, qn = H * hd, kvn = KVH * hd, stride = qn + 2 * kvn;
    std::vector<float> inv(hd / 2);
    rope_inv_freq(p->type, p->theta, p->factor, p->low_freq_factor, p->high_freq_factor, p->original_max_pos, hd, inv.data());
    std::vector<float2> tab((size_t)len * (hd / 2));
    rope_table(inv.data(), hd, len, tab.data());
    std::vector<float> rows_h((size_t)n * stride);
    for (int i = 0; i < n; i++) {
        std::copy(q + (size_t)i * qn, q + (size_t)(i + 1) * qn, rows_h.begin() + (size_t)i * stride);
        std::copy(kn + (size_t)i * kvn, kn + (size_t)(i + 1) * kvn, rows_h.begin() + (size_t)i * stride + qn);
        std::copy(vn + (size_t)i * kvn, vn + (size_t)(i + 1) * kvn, rows_h.begin() + (size_t)i * stride + qn + kvn);
    }
    const size_t cache = (size_t)n * len * kvn;
    Scratch sc;
    float2 *cs;
    bf16 *qkv, *kd, *vd, *o;
    mg_row_meta *md;
    AttnScratch scr;
    scr.f32_softmax = ks.f32_softmax;
    scr.scores_stride = len;
    mg_status r;
    if ((r = sc.alloc(&cs, tab.size())) != MG_OK || (r = act_to_dev(sc, rows_h.data(), rows_h.size(), &qkv)) != MG_OK ||
        (r = act_to_dev(sc, k, cache, &kd)) != MG_OK || (r = act_to_dev(sc, v, cache, &vd)) != MG_OK ||
        (r = sc.alloc(&o, (size_t)n * qn)) != MG_OK || (r = sc.alloc(&md, n)) != MG_OK ||
        (r = sc.alloc(&scr.partial, attn_partial_floats(n, H, hd, len))) != MG_OK ||
        (r = sc.alloc(&scr.scores, (size_t)n * H * len)) != MG_OK ||
        (r = sc.alloc(&scr.stats, (size_t)n * H * attn_chunks(len) * 2)) != MG_OK ||
        (r = sc.alloc(&scr.arrivals, (size_t)kGemvMaxRows * KVH)) != MG_OK)
        return r;
    std::vector<mg_row_meta> meta(n);
    for (int i = 0; i < n; i++) meta[i] = mg_row_meta{kd + (size_t)i * len * kvn, vd + (size_t)i * len * kvn, 0, pos, 0};
    CU(cudaMemcpy(cs, tab.data(), tab.size() * sizeof(float2), cudaMemcpyHostToDevice), "rope table");
    CU(cudaMemcpy(md, meta.data(), n * sizeof(mg_row_meta), cudaMemcpyHostToDevice), "meta");
    CU(cudaMemset(scr.arrivals, 0, (size_t)kGemvMaxRows * KVH * sizeof(unsigned)), "arrivals");
    CU(attn_decode_rope(qkv, stride, md, n, 0, H, KVH, hd, len, cs, scr, o, 0), "decode attention (rope inside)");
    if ((r = act_to_host(sc, kd, cache, k)) != MG_OK || (r = act_to_host(sc, vd, cache, v)) != MG_OK) return r;
    return act_to_host(sc, o, (size_t)n * qn, out);
}

mg_status op_logits(const float *x, const mg_ops_weight *norm, const mg_ops_weight *head, float eps, int32_t n,
                    float *out) {
    mg_status r = check_weight(norm, "logits norm");
    if (r == MG_OK) r = check_weight(head, "logits head");
    if (r != MG_OK) return r;
    const int D = head->cols, V = head->rows;
    if (n <= 0 || !x || !out || norm->rows != D || norm->cols != 1) return failf(MG_ERR_INVALID_ARGUMENT, "logits: bad arguments");
    if (D % 8) return failf(MG_ERR_UNSUPPORTED, "logits: hidden %d not a multiple of 8", D);
    Scratch sc;
    bf16 *nd, *hw, *xd, *h;
    float *o;
    if ((r = weight_to_dev(sc, norm, &nd)) != MG_OK || (r = weight_to_dev(sc, head, &hw)) != MG_OK ||
        (r = act_to_dev(sc, x, (size_t)n * D, &xd)) != MG_OK || (r = sc.alloc(&h, (size_t)n * D)) != MG_OK ||
        (r = sc.alloc(&o, (size_t)n * V)) != MG_OK)
        return r;
    CU(rmsnorm(xd, nd, eps, n, D, h, 0), "final norm");
    if (choose_kernel(Op::Matmul, n, 0, KernelSettings{}) == Kernel::Gemv) {
        CU(gemv(kF32, hw, h, n, V, D, nullptr, nullptr, o, 0), "lm head");
    } else {
        cublasHandle_t bh;
        if ((r = blas(&bh)) != MG_OK) return r;
        if (gemm(bh, hw, h, n, V, D, o, true, 0.f) != CUBLAS_STATUS_SUCCESS) return failf(MG_ERR_BACKEND, "cublas: gemm failed");
        CU(round_to_bf16(o, (size_t)n * V, 0), "logits");
    }
    CU(cudaMemcpy(out, o, (size_t)n * V * 4, cudaMemcpyDeviceToHost), "logits copy");
    return MG_OK;
}

mg_status op_copy_gbps(uint64_t bytes, int32_t iters, double *gbps) {
    if (!gbps || bytes < 1024 || iters <= 0) return failf(MG_ERR_INVALID_ARGUMENT, "copy_gbps: bad arguments");
    CU(probe_copy_gbps((size_t)bytes, iters, gbps), "copy probe");
    return MG_OK;
}

mg_status op_gemm_tflops(int32_t m, int32_t n, int32_t k, int32_t iters, double *tflops) {
    if (!tflops || m <= 0 || n <= 0 || k <= 0 || k % 8 || iters <= 0) return failf(MG_ERR_INVALID_ARGUMENT, "gemm_tflops: bad arguments");
    const char *err = nullptr;
    CU(probe_gemm_tflops(m, n, k, iters, tflops, &err), "gemm probe");
    if (err) return failf(MG_ERR_BACKEND, "gemm probe: %s", err);
    return MG_OK;
}

mg_status op_matvec_gbps(int32_t m, int32_t k, int32_t n, int32_t iters, double *gbps) {
    if (!gbps || m <= 0 || k <= 0 || k % 8 || n <= 0 || n > kGemvMaxRows || iters <= 0)
        return failf(MG_ERR_INVALID_ARGUMENT, "matvec_gbps: bad arguments");
    CU(probe_gemv_gbps(m, k, n, iters, gbps), "matvec probe");
    return MG_OK;
}

mg_status op_hop_host_ns(uint64_t *ns) {
    if (!ns) return failf(MG_ERR_INVALID_ARGUMENT, "hop_host_ns: NULL");
    *ns = last_forward_host_ns();
    return MG_OK;
}

// The device sampler on one row: the kernels tail_forward runs, on a device
// copy of the logits and history.
mg_status op_sample(const float *logits, int32_t vocab, const mg_sample_params *p, const int32_t *history,
                    int32_t n_history, int32_t generated_from, int64_t draw, mg_sample_result *out) {
    if (!logits || vocab <= 0 || !p || !out || n_history < 0 || (n_history > 0 && !history) || generated_from < 0 || draw < 0)
        return failf(MG_ERR_INVALID_ARGUMENT, "sample: bad arguments");
    if (!sample_params_ok(*p)) return failf(MG_ERR_INVALID_ARGUMENT, "sample: parameters out of range");
    Scratch sc;
    float *ld;
    int32_t *hd;
    unsigned char *mem;
    mg_sample_result *rd;
    mg_status r;
    if ((r = sc.alloc(&ld, vocab)) != MG_OK || (r = sc.alloc(&hd, (size_t)n_history + 1)) != MG_OK ||
        (r = sc.alloc(&mem, sample_scratch_bytes(vocab))) != MG_OK || (r = sc.alloc(&rd, 1)) != MG_OK)
        return r;
    CU(cudaMemset(mem, 0, sample_scratch_bytes(vocab)), "sampler scratch");
    CU(cudaMemcpy(ld, logits, (size_t)vocab * 4, cudaMemcpyHostToDevice), "logits");
    if (n_history > 0) CU(cudaMemcpy(hd, history, (size_t)n_history * 4, cudaMemcpyHostToDevice), "history");
    const SampleScratch ss = sample_scratch(mem, vocab);
    CU(sample_row(ld, vocab, *p, hd, n_history, generated_from, draw, hd + n_history, ss, rd, 0), "sample");
    CU(cudaMemcpy(out, rd, sizeof *out, cudaMemcpyDeviceToHost), "result");
    int32_t echoed = -1;
    CU(cudaMemcpy(&echoed, hd + n_history, 4, cudaMemcpyDeviceToHost), "history");
    if (echoed != out->id) return failf(MG_ERR_BACKEND, "sample: history got %d, result %d", echoed, out->id);
    return MG_OK;
}

mg_status op_norm_matmul(const float *x, const mg_ops_weight *norm, float eps, const mg_ops_weight *w, int32_t n,
                         float *out) {
    mg_status r = check_weight(w, "norm_matmul");
    if (r == MG_OK) r = check_weight(norm, "norm_matmul norm");
    if (r != MG_OK) return r;
    const int m = w->rows, k = w->cols;
    if (n <= 0 || !x || !out || norm->rows != k || norm->cols != 1) return failf(MG_ERR_INVALID_ARGUMENT, "norm_matmul: bad arguments");
    if (k % 8) return failf(MG_ERR_UNSUPPORTED, "norm_matmul: k %d not a multiple of 8", k);
    Scratch sc;
    bf16 *wd, *nd, *xd, *o;
    if ((r = weight_to_dev(sc, w, &wd)) != MG_OK || (r = weight_to_dev(sc, norm, &nd)) != MG_OK ||
        (r = act_to_dev(sc, x, (size_t)n * k, &xd)) != MG_OK || (r = sc.alloc(&o, (size_t)n * m)) != MG_OK)
        return r;
    if (choose_kernel(Op::NormMatmul, n, 0, KernelSettings{}) == Kernel::GemvNorm) {
        CU(gemv_norm(kStore, wd, xd, nd, eps, n, m, k, nullptr, o, nullptr, 0), "norm + gemv");
    } else {
        bf16 *h;
        if ((r = sc.alloc(&h, (size_t)n * k)) != MG_OK) return r;
        CU(rmsnorm(xd, nd, eps, n, k, h, 0), "rmsnorm");
        cublasHandle_t bh;
        if ((r = blas(&bh)) != MG_OK) return r;
        if (gemm(bh, wd, h, n, m, k, o, false, 0.f) != CUBLAS_STATUS_SUCCESS) return failf(MG_ERR_BACKEND, "cublas: gemm failed");
    }
    return act_to_host(sc, o, (size_t)n * m, out);
}

// matmul under batch_mma: the tensor-core matrix-vector kernel (1-16 rows).
mg_status op_matmul_mma(const float *x, const mg_ops_weight *w, int32_t n, float *out) {
    mg_status r = check_weight(w, "matmul_mma");
    if (r != MG_OK) return r;
    const int m = w->rows, k = w->cols;
    if (n <= 0 || !x || !out) return failf(MG_ERR_INVALID_ARGUMENT, "matmul_mma: bad arguments");
    if (k % 8) return failf(MG_ERR_UNSUPPORTED, "matmul_mma: k %d not a multiple of 8", k);
    Scratch sc;
    bf16 *wd, *xd, *o;
    if ((r = weight_to_dev(sc, w, &wd)) != MG_OK || (r = act_to_dev(sc, x, (size_t)n * k, &xd)) != MG_OK ||
        (r = sc.alloc(&o, (size_t)n * m)) != MG_OK)
        return r;
    KernelSettings ks;
    ks.batch_mma = true;
    if (choose_kernel(Op::Matmul, n, 0, ks) == Kernel::GemvMma) {
        CU(gemv_mma(kStore, wd, xd, n, m, k, nullptr, o, nullptr, 0), "gemv mma");
    } else {
        cublasHandle_t h;
        if ((r = blas(&h)) != MG_OK) return r;
        if (gemm(h, wd, xd, n, m, k, o, false, 0.f) != CUBLAS_STATUS_SUCCESS) return failf(MG_ERR_BACKEND, "cublas: gemm failed");
    }
    return act_to_host(sc, o, (size_t)n * m, out);
}

mg_status op_mma_gbps(int32_t m, int32_t k, int32_t n, int32_t iters, double *gbps) {
    if (!gbps || m <= 0 || k <= 0 || k % 32 || n <= 0 || n > kGemvMaxRows || iters <= 0)
        return failf(MG_ERR_INVALID_ARGUMENT, "mma_gbps: bad arguments");
    CU(probe_gemv_gbps(m, k, n, iters, gbps, true), "mma probe");
    return MG_OK;
}

mg_status op_attention_tree(const float *q, const float *k, const float *v, int32_t n, int32_t pos0,
                            const int32_t *parents, int32_t H, int32_t KVH, int32_t hd, float *out) {
    if (!q || !k || !v || !out || !parents || n <= 0 || n > MG_MAX_TREE_ROWS || pos0 < 0 || H <= 0 || KVH <= 0 || H % KVH)
        return failf(MG_ERR_INVALID_ARGUMENT, "attention_tree: bad arguments");
    if (hd != 32 && hd != 64 && hd != 128) return failf(MG_ERR_UNSUPPORTED, "attention_tree: head_dim %d", hd);
    std::vector<uint8_t> mask((size_t)n * n, 0);
    for (int i = 0; i < n; i++) {
        const int p = parents[i];
        if (p < -1 || p >= i) return failf(MG_ERR_INVALID_ARGUMENT, "attention_tree: row %d has parent %d", i, p);
        if (p >= 0) memcpy(&mask[(size_t)i * n], &mask[(size_t)p * n], (size_t)p + 1);
        mask[(size_t)i * n + i] = 1;
    }
    const int len = pos0 + n;
    Scratch sc;
    bf16 *qd, *kd, *vd, *o;
    uint8_t *md;
    mg_status r;
    if ((r = act_to_dev(sc, q, (size_t)n * H * hd, &qd)) != MG_OK ||
        (r = act_to_dev(sc, k, (size_t)len * KVH * hd, &kd)) != MG_OK ||
        (r = act_to_dev(sc, v, (size_t)len * KVH * hd, &vd)) != MG_OK || (r = sc.alloc(&o, (size_t)n * H * hd)) != MG_OK ||
        (r = sc.alloc(&md, mask.size())) != MG_OK)
        return r;
    CU(cudaMemcpy(md, mask.data(), mask.size(), cudaMemcpyHostToDevice), "tree mask");
    CU(attn_tree(qd, H * hd, n, pos0, md, kd, vd, H, KVH, hd, o, 0), "tree attention");
    return act_to_host(sc, o, (size_t)n * H * hd, out);
}

const mg_ops_api kOps = {
    MG_OPS_ABI_VERSION, "cuda",       op_last_error, op_embed,     op_rmsnorm,     op_matmul,      op_swiglu,
    op_rope,            op_attention, op_logits,     op_copy_gbps, op_gemm_tflops, op_matvec_gbps, op_hop_host_ns,
    op_sample,          op_norm_matmul, op_matmul_mma, op_mma_gbps,    op_rope_attention, op_attention_tree,
};

} // namespace

extern "C" MG_EXPORT const mg_ops_api *mg_cuda_ops(int32_t abi_version) {
    if (abi_version != MG_OPS_ABI_VERSION) {
        snprintf(g_err, sizeof g_err, "libmeshgpu_cuda: ops ABI version %d requested, library has %d", abi_version,
                 MG_OPS_ABI_VERSION);
        return nullptr;
    }
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        snprintf(g_err, sizeof g_err, "libmeshgpu_cuda: no usable GPU");
        return nullptr;
    }
    return &kOps;
}

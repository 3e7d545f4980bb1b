// backend_stack.cu: the CUDA backend's stacks, weights and sessions: config
// validation, set_tensor's uploads into bf16 (Q/K/V rows fused into one
// matrix, gate/up into another; an LM head equal to the embedding shares its
// copy) or, for block-quantized matrices, of the file's blocks as they are,
// the scratch stack_ready allocates, and the per-session KV caches.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "backend_impl.h"

namespace mgcuda {

namespace {

const char *kind_name(int k) {
    static const char *names[] = {"tok_embed", "final_norm", "lm_head", "attn_norm", "wq",
                                  "wk",        "wv",         "bq",      "bk",        "bv",
                                  "wo",        "mlp_norm",   "w_gate",  "w_up",      "w_down"};
    return k >= 0 && k < MG_TENSOR_KIND_COUNT ? names[k] : "?";
}

size_t dtype_size(int32_t d) { return d == MG_F32 ? 4 : (d == MG_F16 || d == MG_BF16) ? 2 : 0; }

// ---------- validation helpers ----------

bool has_rope_factors(const mg_stack_config &c) {
    for (int i = 0; i < c.head_dim / 2 && i < MG_MAX_ROPE_FACTORS; i++)
        if (c.rope_freq_factors[i] != 0.f) return true;
    return false;
}

mg_status check_config(const mg_stack_config *c) {
    if (!c) return failf(MG_ERR_INVALID_ARGUMENT, "stack_create: config is NULL");
    if (c->hidden <= 0 || c->intermediate <= 0 || c->n_heads <= 0 || c->n_kv_heads <= 0 ||
        c->head_dim <= 0 || c->vocab <= 0 || c->n_layers <= 0 || c->max_context <= 0)
        return failf(MG_ERR_INVALID_ARGUMENT,
                     "stack_create: hidden, intermediate, heads, kv heads, head_dim, vocab, "
                     "n_layers and max_context must be positive");
    // The CPU backend's bounds: every size below stays far from int overflow,
    // and max_context keeps the decode attention grid within its limits.
    if (c->hidden > (1 << 20) || c->intermediate > (1 << 20) || (long long)c->n_heads * c->head_dim > (1 << 20) ||
        c->vocab > (1 << 24) || c->max_context > (1 << 24) || c->n_layers > 100000)
        return failf(MG_ERR_INVALID_ARGUMENT,
                     "stack_create: hidden, intermediate and n_heads*head_dim must be <= 2^20, vocab and "
                     "max_context <= 2^24, n_layers <= 100000");
    if (c->n_heads % c->n_kv_heads != 0)
        return failf(MG_ERR_INVALID_ARGUMENT, "stack_create: n_heads %d is not a multiple of n_kv_heads %d",
                     c->n_heads, c->n_kv_heads);
    if (c->first_layer <= c->last_layer &&
        (c->first_layer < 0 || c->last_layer >= c->n_layers))
        return failf(MG_ERR_INVALID_ARGUMENT, "stack_create: layers %d..%d outside 0..%d", c->first_layer,
                     c->last_layer, c->n_layers - 1);
    if (!(c->rms_eps > 0.f) || !std::isfinite(c->rms_eps))
        return failf(MG_ERR_INVALID_ARGUMENT, "stack_create: rms_eps must be positive");
    if (c->rope_type != MG_ROPE_DEFAULT && c->rope_type != MG_ROPE_LLAMA3)
        return failf(MG_ERR_UNSUPPORTED, "stack_create: rope type %d not supported", c->rope_type);
    if (!(c->rope_theta > 0.f) || !std::isfinite(c->rope_theta))
        return failf(MG_ERR_INVALID_ARGUMENT, "stack_create: rope_theta must be positive");
    if (c->rope_type == MG_ROPE_LLAMA3 &&
        (!(c->rope_factor > 0.f) || !(c->rope_low_freq_factor > 0.f) ||
         !(c->rope_high_freq_factor > c->rope_low_freq_factor) || c->rope_original_max_pos <= 0))
        return failf(MG_ERR_INVALID_ARGUMENT,
                     "stack_create: llama3 rope needs factor > 0, 0 < low_freq_factor < "
                     "high_freq_factor and original_max_pos > 0");
    if (c->head_dim / 2 > MG_MAX_ROPE_FACTORS)
        return failf(MG_ERR_INVALID_ARGUMENT, "stack_create: head_dim %d out of range", c->head_dim);
    if (has_rope_factors(*c))
        for (int i = 0; i < c->head_dim / 2; i++)
            if (!(c->rope_freq_factors[i] > 0.f) || !std::isfinite(c->rope_freq_factors[i]))
                return failf(MG_ERR_INVALID_ARGUMENT,
                             "stack_create: rope frequency factor %d is %g; each must be positive", i,
                             (double)c->rope_freq_factors[i]);
    // What the kernels support (the CPU backend is general).
    if (c->head_dim != 32 && c->head_dim != 64 && c->head_dim != 128)
        return failf(MG_ERR_UNSUPPORTED, "stack_create: cuda supports head_dim 32, 64 or 128, not %d",
                     c->head_dim);
    if (c->n_heads / c->n_kv_heads > 8)
        return failf(MG_ERR_UNSUPPORTED, "stack_create: cuda supports up to 8 query heads per kv head, not %d",
                     c->n_heads / c->n_kv_heads);
    if (c->hidden % 8 != 0 || c->intermediate % 8 != 0)
        return failf(MG_ERR_UNSUPPORTED, "stack_create: cuda needs hidden and intermediate multiples of 8");
    return MG_OK;
}

bool per_layer(int kind) { return kind >= MG_ATTN_NORM && kind <= MG_W_DOWN; }

// Expected shape of a tensor kind; returns the element count.
int expected_shape(const mg_stack_config &c, int kind, int64_t dims[2], int *ndim) {
    const int64_t q = (int64_t)c.n_heads * c.head_dim, kv = (int64_t)c.n_kv_heads * c.head_dim;
    *ndim = 2;
    switch (kind) {
    case MG_TOK_EMBED:
    case MG_LM_HEAD: dims[0] = c.vocab; dims[1] = c.hidden; break;
    case MG_FINAL_NORM:
    case MG_ATTN_NORM:
    case MG_MLP_NORM: *ndim = 1; dims[0] = c.hidden; break;
    case MG_WQ: dims[0] = q; dims[1] = c.hidden; break;
    case MG_WK:
    case MG_WV: dims[0] = kv; dims[1] = c.hidden; break;
    case MG_BQ: *ndim = 1; dims[0] = q; break;
    case MG_BK:
    case MG_BV: *ndim = 1; dims[0] = kv; break;
    case MG_WO: dims[0] = c.hidden; dims[1] = q; break;
    case MG_W_GATE:
    case MG_W_UP: dims[0] = c.intermediate; dims[1] = c.hidden; break;
    case MG_W_DOWN: dims[0] = c.hidden; dims[1] = c.intermediate; break;
    default: return -1;
    }
    return 0;
}

bool kind_needed(const mg_stack_config &c, int kind) {
    switch (kind) {
    case MG_TOK_EMBED: return c.has_embed;
    case MG_FINAL_NORM:
    case MG_LM_HEAD: return c.has_head;
    case MG_BQ:
    case MG_BK:
    case MG_BV: return c.qkv_bias && c.first_layer <= c.last_layer;
    default: return c.first_layer <= c.last_layer;
    }
}

// Copies a host tensor of dtype into device bf16 at dst (n elements).
mg_status upload(mg_stack *s, bf16 *dst, int32_t dtype, const void *data, size_t n) {
    if (dtype == MG_BF16) {
        CU(cudaMemcpyAsync(dst, data, n * 2, cudaMemcpyHostToDevice, s->st), "upload");
        CU(cudaStreamSynchronize(s->st), "upload");
        return MG_OK;
    }
    const size_t es = dtype_size(dtype);
    const size_t chunk = (size_t)16 << 20; // elements per staging pass
    void *tmp = nullptr;
    const size_t tn = n < chunk ? n : chunk;
    CU(cudaMalloc(&tmp, tn * es), "upload staging");
    mg_status st = MG_OK;
    for (size_t off = 0; off < n && st == MG_OK; off += chunk) {
        const size_t m = (n - off) < chunk ? (n - off) : chunk;
        cudaError_t e = cudaMemcpyAsync(tmp, (const char *)data + off * es, m * es, cudaMemcpyHostToDevice, s->st);
        if (e == cudaSuccess) e = convert_to_bf16(tmp, dtype, m, dst + off, s->st);
        if (e == cudaSuccess) e = cudaStreamSynchronize(s->st);
        if (e != cudaSuccess) st = cuda_fail(e, "upload convert");
    }
    cudaFree(tmp);
    return st;
}

// *same = whether the device bf16 copy dev (n elements) is what host data
// of dtype uploads to. Compares bytes, not host pointers: a caller may free
// a tensor after set_tensor and pass different weights at the same address.
// f16 is never reported equal (the tie only saves memory).
mg_status device_holds(mg_stack *s, const bf16 *dev, int32_t dtype, const void *data, size_t n, bool *same) {
    *same = false;
    if (dtype != MG_BF16 && dtype != MG_F32) return MG_OK;
    const size_t chunk = (size_t)4 << 20; // elements per comparison pass
    const size_t cn = n < chunk ? n : chunk;
    uint16_t *got = static_cast<uint16_t *>(malloc(cn * 2 * (dtype == MG_F32 ? 2 : 1)));
    if (!got) return failf(MG_ERR_OUT_OF_MEMORY, "set_tensor: out of host memory");
    uint16_t *want = got + cn; // f32 only: data converted as convert_to_bf16 does
    mg_status st = MG_OK;
    bool equal = true;
    for (size_t off = 0; off < n && equal; off += chunk) {
        const size_t m = (n - off) < chunk ? (n - off) : chunk;
        cudaError_t e = cudaMemcpyAsync(got, dev + off, m * 2, cudaMemcpyDeviceToHost, s->st);
        if (e == cudaSuccess) e = cudaStreamSynchronize(s->st);
        if (e != cudaSuccess) {
            st = cuda_fail(e, "set_tensor: comparing with the embedding");
            break;
        }
        const uint16_t *w = static_cast<const uint16_t *>(data) + off;
        if (dtype == MG_F32) {
            const uint32_t *f = static_cast<const uint32_t *>(data) + off;
            for (size_t i = 0; i < m; i++) {
                uint32_t u = f[i];
                want[i] = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fff // NaN
                                                          : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
            }
            w = want;
        }
        equal = memcmp(got, w, m * 2) == 0;
    }
    free(got);
    *same = st == MG_OK && equal;
    return st;
}

} // namespace

mg_status dalloc(void **p, size_t bytes, const char *what) {
    if (*p) return MG_OK;
    cudaError_t e = cudaMalloc(p, bytes);
    if (e != cudaSuccess) {
        *p = nullptr;
        return failf(MG_ERR_OUT_OF_MEMORY, "cuda: allocating %s (%zu bytes): %s", what, bytes,
                     cudaGetErrorString(e));
    }
    return MG_OK;
}

void free_stack(mg_stack *s) {
    if (!s) return;
    cudaSetDevice(s->b->device);
    if (s->st) cudaStreamSynchronize(s->st);
    clear_graphs(s);
    for (Layer &L : s->layers) {
        for (QMat &q : L.qm) qmat_free(q);
        cudaFree(L.attn_norm);
        cudaFree(L.wqkv);
        cudaFree(L.bqkv);
        cudaFree(L.wo);
        cudaFree(L.mlp_norm);
        cudaFree(L.wgu);
        cudaFree(L.wdown);
    }
    cudaFree(s->embed);
    cudaFree(s->final_norm);
    if (!s->head_tied) cudaFree(s->lm_head);
    if (!s->qhead_tied) qmat_free(s->qhead);
    qmat_free(s->qembed);
    cudaFree(s->xq);
    cudaFree(s->xd);
    cudaFree(s->deq);
    cudaFree(s->rope_cs);
    cudaFree(s->x);
    cudaFree(s->h);
    cudaFree(s->qkv);
    cudaFree(s->att);
    cudaFree(s->gu);
    cudaFree(s->act);
    cudaFree(s->partial);
    cudaFree(s->attn_scores);
    cudaFree(s->pf_buf);
    cudaFree(s->tree_mask);
    cudaFree(s->attn_stats);
    cudaFree(s->attn_arrivals);
    cudaFree(s->io_f32);
    cudaFree(s->logits);
    cudaFree(s->meta_d);
    cudaFree(s->tok_d);
    cudaFree(s->samp_mem);
    cudaFree(s->last_rows);
    cudaFree(s->res_d);
    if (s->res_h) cudaFreeHost(s->res_h);
    cudaFree(s->bad_d);
    if (s->bad_h) cudaFreeHost(s->bad_h);
    if (s->tok_h) cudaFreeHost(s->tok_h);
    cudaFree(s->blas_ws);
    if (s->meta_h) cudaFreeHost(s->meta_h);
    if (s->blas) cublasDestroy(s->blas);
    if (s->st) cudaStreamDestroy(s->st);
    delete s;
}

mg_status api_stack_create(mg_backend *b, const mg_stack_config *cfg, mg_stack **out) {
    if (!b || !out) return failf(MG_ERR_INVALID_ARGUMENT, "stack_create: NULL argument");
    *out = nullptr;
    mg_status r = check_config(cfg);
    if (r != MG_OK) return r;
    CU(cudaSetDevice(b->device), "set device");
    mg_stack *s = new (std::nothrow) mg_stack;
    if (!s) return failf(MG_ERR_OUT_OF_MEMORY, "stack_create: out of host memory");
    s->b = b;
    s->cfg = *cfg;
    s->n_local = cfg->last_layer >= cfg->first_layer ? cfg->last_layer - cfg->first_layer + 1 : 0;
    s->q_dim = cfg->n_heads * cfg->head_dim;
    s->kv_dim = cfg->n_kv_heads * cfg->head_dim;
    s->qkv_dim = s->q_dim + 2 * s->kv_dim;
    s->layers.resize(s->n_local);
    s->ks = b->ks;
    s->graphs_on = s->ks.graphs;
    cudaError_t e = cudaStreamCreateWithFlags(&s->st, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        free_stack(s);
        return cuda_fail(e, "stream");
    }
    if (cublasCreate(&s->blas) != CUBLAS_STATUS_SUCCESS || cublasSetStream(s->blas, s->st) != CUBLAS_STATUS_SUCCESS) {
        free_stack(s);
        return failf(MG_ERR_BACKEND, "cublas: cannot create a handle");
    }
    const size_t ws = (size_t)32 << 20;
    if (cudaMalloc(&s->blas_ws, ws) != cudaSuccess || cublasSetWorkspace(s->blas, s->blas_ws, ws) != CUBLAS_STATUS_SUCCESS) {
        free_stack(s);
        return failf(MG_ERR_OUT_OF_MEMORY, "cublas: cannot allocate its workspace");
    }
    *out = s;
    return MG_OK;
}

namespace {

bool matrix_kind(int kind) {
    return kind == MG_TOK_EMBED || kind == MG_LM_HEAD || kind == MG_WQ || kind == MG_WK || kind == MG_WV ||
           kind == MG_WO || kind == MG_W_GATE || kind == MG_W_UP || kind == MG_W_DOWN;
}

const char *qname(int32_t dtype) {
    switch (dtype) {
    case MG_Q8_0: return "Q8_0";
    case MG_Q4_K: return "Q4_K";
    case MG_Q5_K: return "Q5_K";
    case MG_Q6_K: return "Q6_K";
    }
    return "?";
}

// A block-quantized matrix, kept as its blocks: the shape the kind expects,
// rows of whole blocks, exactly rows x row_bytes bytes (the bytes are read
// from the caller's buffer by that count, so this check is what keeps the
// copy inside it). s->mu is held.
mg_status set_quant(mg_stack *s, int32_t kind, int32_t layer, int32_t dtype, const int64_t *shape, int32_t ndim,
                    const void *data, size_t nbytes) {
    const mg_stack_config &c = s->cfg;
    const char *kn = kind_name(kind);
    if (!matrix_kind(kind))
        return failf(MG_ERR_INVALID_ARGUMENT, "set_tensor: %s cannot be %s: only matrices may be quantized", kn, qname(dtype));
    int64_t want[2];
    int wn = 0;
    expected_shape(c, kind, want, &wn);
    if (!shape || ndim != 2) return failf(MG_ERR_INVALID_ARGUMENT, "set_tensor: %s wants 2 dims, got %d", kn, ndim);
    for (int i = 0; i < 2; i++)
        if (shape[i] != want[i])
            return failf(MG_ERR_INVALID_ARGUMENT, "set_tensor: %s dim %d is %lld, want %lld", kn, i, (long long)shape[i],
                         (long long)want[i]);
    int be = 0, bb = 0;
    quant_block(dtype, &be, &bb);
    const size_t rb = quant_row_bytes(dtype, want[1]);
    if (!rb)
        return failf(MG_ERR_INVALID_ARGUMENT, "set_tensor: %s: rows of %lld elements are not whole %s blocks of %d", kn,
                     (long long)want[1], qname(dtype), be);
    const size_t total = (size_t)want[0] * rb;
    if (nbytes != total)
        return failf(MG_ERR_INVALID_ARGUMENT, "set_tensor: %s: %zu bytes of %s, want %zu (%lld rows of %zu bytes)", kn,
                     nbytes, qname(dtype), total, (long long)want[0], rb);
    if (!data) return failf(MG_ERR_INVALID_ARGUMENT, "set_tensor: %s data is NULL", kn);
    CU(cudaSetDevice(s->b->device), "set device");
    if (s->ready) clear_graphs(s);

    QMat *q = nullptr;
    if (kind == MG_TOK_EMBED) {
        if (s->qhead_tied) { // the head shared these blocks: it must be set again
            s->qhead = QMat{};
            s->qhead_tied = false;
            s->global_set &= ~(1u << MG_LM_HEAD);
        }
        q = &s->qembed;
    } else if (kind == MG_LM_HEAD) {
        // share the embedding's blocks when they are the same bytes
        const QMat &e = s->qembed;
        if ((s->global_set >> MG_TOK_EMBED & 1) && e.data && e.dtype == dtype && e.bytes == nbytes) {
            std::vector<unsigned char> got;
            try {
                got.resize(nbytes);
            } catch (const std::bad_alloc &) {
                return failf(MG_ERR_OUT_OF_MEMORY, "set_tensor: out of host memory");
            }
            CU(cudaMemcpy(got.data(), e.data, nbytes, cudaMemcpyDeviceToHost), "set_tensor: comparing with the embedding");
            if (memcmp(got.data(), data, nbytes) == 0) {
                if (!s->qhead_tied) qmat_free(s->qhead);
                s->qhead = e;
                s->qhead_tied = true;
                s->global_set |= 1u << kind;
                return MG_OK;
            }
        }
        if (s->qhead_tied) {
            s->qhead = QMat{};
            s->qhead_tied = false;
        }
        q = &s->qhead;
    } else {
        q = &s->layers[layer - c.first_layer].qm[kind];
    }
    if (q->data && q->bytes != nbytes) qmat_free(*q);
    mg_status r = dalloc(&q->data, nbytes, kn);
    if (r != MG_OK) return r;
    q->dtype = dtype;
    q->rows = (int)want[0];
    q->cols = (int)want[1];
    q->bytes = nbytes;
    CU(cudaMemcpy(q->data, data, nbytes, cudaMemcpyHostToDevice), "upload");
    if (per_layer(kind)) {
        s->layers[layer - c.first_layer].set |= 1u << kind;
    } else {
        s->global_set |= 1u << kind;
    }
    return MG_OK;
}

// A float tensor replaces the blocks a kind held before (else they would
// still be what runs). s->mu is held.
void drop_quant(mg_stack *s, int32_t kind, int32_t layer) {
    if (kind == MG_TOK_EMBED) {
        if (s->qhead_tied) { // the head aliased these blocks: it must be set again
            s->qhead = QMat{};
            s->qhead_tied = false;
            s->global_set &= ~(1u << MG_LM_HEAD);
        }
        qmat_free(s->qembed);
    } else if (kind == MG_LM_HEAD) {
        if (s->qhead_tied) {
            s->qhead = QMat{};
            s->qhead_tied = false;
        } else {
            qmat_free(s->qhead);
        }
    } else if (per_layer(kind)) {
        qmat_free(s->layers[layer - s->cfg.first_layer].qm[kind]);
    }
}

} // namespace

mg_status api_stack_set_tensor(mg_stack *s, int32_t kind, int32_t layer, int32_t dtype, const int64_t *shape,
                               int32_t ndim, const void *data, size_t nbytes) {
    if (!s) return failf(MG_ERR_INVALID_ARGUMENT, "set_tensor: stack is NULL");
    std::lock_guard<std::mutex> lock(s->mu);
    const mg_stack_config &c = s->cfg;
    if (kind < 0 || kind >= MG_TENSOR_KIND_COUNT) return failf(MG_ERR_INVALID_ARGUMENT, "set_tensor: unknown kind %d", kind);
    const char *kn = kind_name(kind);
    if (!kind_needed(c, kind)) return failf(MG_ERR_INVALID_ARGUMENT, "set_tensor: this stack holds no %s", kn);
    if (per_layer(kind)) {
        if (layer < c.first_layer || layer > c.last_layer)
            return failf(MG_ERR_INVALID_ARGUMENT, "set_tensor: %s layer %d outside this stack's %d..%d", kn, layer,
                         c.first_layer, c.last_layer);
    } else if (layer != -1) {
        return failf(MG_ERR_INVALID_ARGUMENT, "set_tensor: %s is a whole-model tensor; layer must be -1, not %d", kn, layer);
    }
    if (quant_block(dtype, nullptr, nullptr)) return set_quant(s, kind, layer, dtype, shape, ndim, data, nbytes);
    if (dtype != MG_F32 && dtype != MG_F16 && dtype != MG_BF16)
        return failf(MG_ERR_INVALID_ARGUMENT, "set_tensor: %s: unknown dtype %d", kn, dtype);
    int64_t want[2];
    int wn = 0;
    expected_shape(c, kind, want, &wn);
    if (!shape || ndim != wn) return failf(MG_ERR_INVALID_ARGUMENT, "set_tensor: %s wants %d dims, got %d", kn, wn, ndim);
    for (int i = 0; i < wn; i++)
        if (shape[i] != want[i])
            return failf(MG_ERR_INVALID_ARGUMENT, "set_tensor: %s dim %d is %lld, want %lld", kn, i, (long long)shape[i],
                         (long long)want[i]);
    const size_t n = (size_t)want[0] * (wn == 2 ? (size_t)want[1] : 1);
    if (nbytes != n * dtype_size(dtype))
        return failf(MG_ERR_INVALID_ARGUMENT, "set_tensor: %s has %zu bytes, want %zu", kn, nbytes, n * dtype_size(dtype));
    if (!data) return failf(MG_ERR_INVALID_ARGUMENT, "set_tensor: %s data is NULL", kn);
    CU(cudaSetDevice(s->b->device), "set device");
    if (s->ready) clear_graphs(s);
    drop_quant(s, kind, layer);

    bf16 *dst = nullptr;
    mg_status r = MG_OK;
    const size_t D = c.hidden, I = c.intermediate;
    if (!per_layer(kind)) {
        if (kind == MG_TOK_EMBED) {
            if (s->head_tied) { // the head shared this copy: it must be set again
                s->lm_head = nullptr;
                s->head_tied = false;
                s->global_set &= ~(1u << MG_LM_HEAD);
            }
            r = dalloc_n(&s->embed, n, kn);
            dst = s->embed;
        } else if (kind == MG_FINAL_NORM) {
            r = dalloc_n(&s->final_norm, n, kn);
            dst = s->final_norm;
        } else { // MG_LM_HEAD: share the embedding's copy when it holds the same bytes
            bool same = false;
            if ((s->global_set >> MG_TOK_EMBED & 1) && dtype == s->embed_dtype && nbytes == s->embed_bytes) {
                r = device_holds(s, s->embed, dtype, data, n, &same);
                if (r != MG_OK) return r;
            }
            if (same) {
                if (s->lm_head && !s->head_tied) cudaFree(s->lm_head);
                s->lm_head = s->embed;
                s->head_tied = true;
                s->global_set |= 1u << kind;
                return MG_OK;
            }
            if (s->head_tied) {
                s->lm_head = nullptr;
                s->head_tied = false;
            }
            r = dalloc_n(&s->lm_head, n, kn);
            dst = s->lm_head;
        }
        if (r != MG_OK) return r;
        r = upload(s, dst, dtype, data, n);
        if (r != MG_OK) return r;
        if (kind == MG_TOK_EMBED) {
            s->embed_dtype = dtype;
            s->embed_bytes = nbytes;
        }
        s->global_set |= 1u << kind;
        return MG_OK;
    }
    Layer &L = s->layers[layer - c.first_layer];
    const size_t q = s->q_dim, kv = s->kv_dim;
    switch (kind) {
    case MG_ATTN_NORM: r = dalloc_n(&L.attn_norm, D, kn); dst = L.attn_norm; break;
    case MG_MLP_NORM: r = dalloc_n(&L.mlp_norm, D, kn); dst = L.mlp_norm; break;
    case MG_WQ: r = dalloc_n(&L.wqkv, (q + 2 * kv) * D, "wqkv"); dst = L.wqkv; break;
    case MG_WK: r = dalloc_n(&L.wqkv, (q + 2 * kv) * D, "wqkv"); dst = L.wqkv + q * D; break;
    case MG_WV: r = dalloc_n(&L.wqkv, (q + 2 * kv) * D, "wqkv"); dst = L.wqkv + (q + kv) * D; break;
    case MG_BQ: r = dalloc_n(&L.bqkv, q + 2 * kv, "bqkv"); dst = L.bqkv; break;
    case MG_BK: r = dalloc_n(&L.bqkv, q + 2 * kv, "bqkv"); dst = L.bqkv + q; break;
    case MG_BV: r = dalloc_n(&L.bqkv, q + 2 * kv, "bqkv"); dst = L.bqkv + q + kv; break;
    case MG_WO: r = dalloc_n(&L.wo, D * q, kn); dst = L.wo; break;
    case MG_W_GATE: r = dalloc_n(&L.wgu, 2 * I * D, "w_gate_up"); dst = L.wgu; break;
    case MG_W_UP: r = dalloc_n(&L.wgu, 2 * I * D, "w_gate_up"); dst = L.wgu + I * D; break;
    case MG_W_DOWN: r = dalloc_n(&L.wdown, D * I, kn); dst = L.wdown; break;
    }
    if (r != MG_OK) return r;
    r = upload(s, dst, dtype, data, n);
    if (r != MG_OK) return r;
    L.set |= 1u << kind;
    return MG_OK;
}

mg_status api_stack_ready(mg_stack *s) {
    if (!s) return failf(MG_ERR_INVALID_ARGUMENT, "stack_ready: stack is NULL");
    std::lock_guard<std::mutex> lock(s->mu);
    const mg_stack_config &c = s->cfg;
    for (int k = MG_TOK_EMBED; k <= MG_LM_HEAD; k++)
        if (kind_needed(c, k) && !(s->global_set >> k & 1))
            return failf(MG_ERR_INVALID_ARGUMENT, "stack_ready: %s was not set", kind_name(k));
    for (int li = 0; li < s->n_local; li++)
        for (int k = MG_ATTN_NORM; k <= MG_W_DOWN; k++)
            if (kind_needed(c, k) && !(s->layers[li].set >> k & 1))
                return failf(MG_ERR_INVALID_ARGUMENT, "stack_ready: layer %d %s was not set", c.first_layer + li,
                             kind_name(k));
    // A layer runs either on bf16 copies or on blocks, all seven matrices
    // alike (the projections fuse q/k/v and gate/up one way or the other).
    static const int mats[] = {MG_WQ, MG_WK, MG_WV, MG_WO, MG_W_GATE, MG_W_UP, MG_W_DOWN};
    size_t deq = 0; // the largest quantized matrix, in elements
    for (int li = 0; li < s->n_local; li++) {
        Layer &L = s->layers[li];
        int nq = 0;
        for (int k : mats)
            if (L.qm[k].data) {
                nq++;
                const size_t e = (size_t)L.qm[k].rows * L.qm[k].cols;
                deq = e > deq ? e : deq;
            }
        if (nq != 0 && nq != 7)
            return failf(MG_ERR_UNSUPPORTED,
                         "stack_ready: layer %d has %d quantized and %d float matrices; the CUDA backend runs a layer's "
                         "matrices all quantized or all float",
                         c.first_layer + li, nq, 7 - nq);
        L.quant = nq == 7;
    }
    if (s->qhead.data) {
        const size_t e = (size_t)s->qhead.rows * s->qhead.cols;
        deq = e > deq ? e : deq;
    }
    CU(cudaSetDevice(s->b->device), "set device");
    const size_t R = kChunkRows, D = c.hidden, I = c.intermediate;
    mg_status r = MG_OK;
    if (deq > 0 && !s->deq) {
        // Sized for any matrix of this config (tensors may be set again
        // after stack_ready): 32M bf16 (64 MiB) per prefill chunk, 8192
        // rows of an 8B gate/up; activations as wide as the widest input.
        const size_t cap = (size_t)32 << 20;
        const size_t kmax = D > I ? (D > (size_t)s->q_dim ? D : s->q_dim) : (I > (size_t)s->q_dim ? I : s->q_dim);
        s->deq_elems = cap;
        r = dalloc_n(&s->deq, cap, "dequantized weight chunk");
        if (r == MG_OK) r = dalloc_n(&s->xq, (size_t)kGemvMaxRows * kmax, "quantized activations");
        if (r == MG_OK) r = dalloc_n(&s->xd, (size_t)kGemvMaxRows * (kmax / 32), "quantized activation scales");
        if (r != MG_OK) return r;
    }
    if (s->ready) return MG_OK;
    const size_t io = R * D > (size_t)kLogitRows * D ? R * D : (size_t)kLogitRows * D;
    if (r == MG_OK) r = dalloc_n(&s->x, R * D, "activations");
    if (r == MG_OK) r = dalloc_n(&s->h, R * D, "activations");
    if (r == MG_OK) r = dalloc_n(&s->io_f32, io, "io staging");
    if (r == MG_OK) r = dalloc_n(&s->tok_d, R, "tokens");
    if (r == MG_OK) r = dalloc_n(&s->meta_d, R, "row metadata");
    if (r == MG_OK && !s->meta_h) {
        cudaError_t e = cudaHostAlloc((void **)&s->meta_h, R * sizeof(mg_row_meta), cudaHostAllocPortable);
        if (e != cudaSuccess) {
            s->meta_h = nullptr;
            r = cuda_fail(e, "pinned row metadata");
        }
    }
    if (r == MG_OK && s->n_local > 0) {
        s->max_chunks = attn_chunks(c.max_context) > 32 ? attn_chunks(c.max_context) : 32;
        r = dalloc_n(&s->qkv, R * s->qkv_dim, "qkv");
        if (r == MG_OK) r = dalloc_n(&s->att, R * s->q_dim, "attention output");
        if (r == MG_OK) r = dalloc_n(&s->gu, R * 2 * I, "gate/up");
        if (r == MG_OK) r = dalloc_n(&s->act, R * I, "mlp activation");
        if (r == MG_OK)
            r = dalloc_n(&s->partial, (size_t)kGemvMaxRows * c.n_heads * s->max_chunks * (c.head_dim + 2),
                         "attention partials");
        s->attn.f32_softmax = s->ks.f32_softmax;
        if (r == MG_OK && !s->attn.f32_softmax) {
            r = dalloc_n(&s->attn_scores, (size_t)kGemvMaxRows * c.n_heads * c.max_context, "attention scores");
            if (r == MG_OK)
                r = dalloc_n(&s->attn_stats, (size_t)kGemvMaxRows * c.n_heads * s->max_chunks * 2, "attention stats");
        }
        if (r == MG_OK && s->ks.fused_decode) {
            r = dalloc_n(&s->attn_arrivals, (size_t)kGemvMaxRows * c.n_kv_heads, "attention arrivals");
            if (r == MG_OK && cudaMemset(s->attn_arrivals, 0, (size_t)kGemvMaxRows * c.n_kv_heads * sizeof(unsigned)) != cudaSuccess)
                r = failf(MG_ERR_BACKEND, "attention arrivals: cudaMemset failed");
        }
        s->attn.arrivals = s->attn_arrivals;
        s->attn.partial = s->partial;
        s->attn.scores = s->attn_scores;
        s->attn.scores_stride = c.max_context;
        s->attn.stats = s->attn_stats;
        if (r == MG_OK) {
            std::vector<float> inv(c.head_dim / 2);
            rope_inv_freq(c.rope_type, c.rope_theta, c.rope_factor, c.rope_low_freq_factor,
                          c.rope_high_freq_factor, c.rope_original_max_pos, c.head_dim, inv.data());
            if (has_rope_factors(c))
                for (int i = 0; i < c.head_dim / 2; i++) inv[i] /= c.rope_freq_factors[i];
            std::vector<float2> tab;
            try { // an exception must not cross the C ABI
                tab.resize((size_t)c.max_context * (c.head_dim / 2));
            } catch (const std::bad_alloc &) {
                r = failf(MG_ERR_OUT_OF_MEMORY, "stack_ready: rope table for %d positions: out of host memory",
                          c.max_context);
            }
            if (r == MG_OK) {
                rope_table(inv.data(), c.head_dim, c.max_context, tab.data());
                r = dalloc_n(&s->rope_cs, tab.size(), "rope table");
            }
            if (r == MG_OK) {
                cudaError_t e = cudaMemcpy(s->rope_cs, tab.data(), tab.size() * sizeof(float2), cudaMemcpyHostToDevice);
                if (e != cudaSuccess) r = cuda_fail(e, "rope table");
            }
        }
    }
    if (r == MG_OK && c.has_head) r = dalloc_n(&s->logits, (size_t)kLogitRows * c.vocab, "logits");
    if (r == MG_OK && c.has_head) {
        const size_t sb = sample_scratch_bytes(c.vocab);
        r = dalloc(&s->samp_mem, sb, "sampler scratch");
        if (r == MG_OK) {
            cudaError_t e = cudaMemset(s->samp_mem, 0, sb);
            if (e != cudaSuccess) r = cuda_fail(e, "sampler scratch");
            s->samp = sample_scratch(s->samp_mem, c.vocab);
        }
        if (r == MG_OK) r = dalloc_n(&s->res_d, kLogitRows, "sample results");
        if (r == MG_OK && !s->res_h) {
            cudaError_t e = cudaHostAlloc((void **)&s->res_h, kLogitRows * sizeof(mg_sample_result), cudaHostAllocPortable);
            if (e != cudaSuccess) {
                s->res_h = nullptr;
                r = cuda_fail(e, "pinned sample results");
            }
        }
        if (r == MG_OK) r = dalloc_n(&s->bad_d, kLogitRows, "non-finite flags");
        if (r == MG_OK && !s->bad_h) {
            cudaError_t e = cudaHostAlloc((void **)&s->bad_h, kLogitRows * sizeof(int32_t), cudaHostAllocPortable);
            if (e != cudaSuccess) {
                s->bad_h = nullptr;
                r = cuda_fail(e, "pinned non-finite flags");
            }
        }
    }
    if (r != MG_OK) return r;
    s->ready = true;
    return MG_OK;
}

void api_stack_free(mg_stack *s) { free_stack(s); }

mg_status api_session_create(mg_stack *s, int32_t max_tokens, mg_session **out) {
    if (!s || !out) return failf(MG_ERR_INVALID_ARGUMENT, "session_create: NULL argument");
    *out = nullptr;
    std::lock_guard<std::mutex> lock(s->mu);
    if (!s->ready) return failf(MG_ERR_INVALID_ARGUMENT, "session_create: stack is not ready");
    if (max_tokens <= 0 || max_tokens > s->cfg.max_context)
        return failf(MG_ERR_INVALID_ARGUMENT, "session_create: max_tokens %d outside 1..%d", max_tokens,
                     s->cfg.max_context);
    CU(cudaSetDevice(s->b->device), "set device");
    mg_session *ss = new (std::nothrow) mg_session;
    if (!ss) return failf(MG_ERR_OUT_OF_MEMORY, "session_create: out of host memory");
    ss->s = s;
    ss->max_tokens = max_tokens;
    ss->layer_len.assign(s->n_local, 0);
    ss->layer_stride = (long long)max_tokens * s->kv_dim;
    if (dalloc_n(&ss->hist, (size_t)max_tokens + 1, "token history") != MG_OK) {
        delete ss;
        return MG_ERR_OUT_OF_MEMORY;
    }
    if (s->n_local > 0) {
        const size_t n = (size_t)s->n_local * ss->layer_stride;
        mg_status r = dalloc_n(&ss->k, n, "K cache");
        if (r == MG_OK) r = dalloc_n(&ss->v, n, "V cache");
        if (r != MG_OK) {
            cudaFree(ss->k);
            cudaFree(ss->hist);
            delete ss;
            std::string why = g_err;
            return failf(MG_ERR_OUT_OF_MEMORY, "session_create: KV cache for %d tokens does not fit: %s", max_tokens,
                         why.c_str());
        }
    }
    *out = ss;
    return MG_OK;
}

void api_session_free(mg_session *ss) {
    if (!ss) return;
    mg_stack *s = ss->s;
    std::lock_guard<std::mutex> lock(s->mu);
    cudaSetDevice(s->b->device);
    cudaStreamSynchronize(s->st);
    cudaFree(ss->k);
    cudaFree(ss->v);
    cudaFree(ss->hist);
    delete ss;
}

int32_t api_session_len(mg_session *ss) { return ss ? ss->len() : -1; }

} // namespace mgcuda

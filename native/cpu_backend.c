/*
 * cpu_backend.c: the CPU implementation of mg_api (meshgpu.h).
 *
 * Weights are copied in as stored (bf16 stays bf16, half the bytes to stream
 * per decoded token; ggml's quantized blocks stay blocks (cpu_quant.c);
 * f16 becomes f32; norms and biases become f32). The
 * residual stream, the KV cache and all arithmetic are f32, following HF
 * transformers' Llama so that golden f32 outputs match.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cpu_ends.h"
#include "cpu_kernels.h"
#include "cpu_pool.h"
#include "meshgpu.h"

/* Bounds that keep every size computation far from overflow. */
#define MAX_DIM (1 << 20)
#define MAX_HEAD_DIM 1024
#define MAX_VOCAB (1 << 24)

static __thread char last_err[512];

static mg_status fail(mg_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_err, sizeof last_err, fmt, ap);
    va_end(ap);
    return st;
}

static const char *cpu_last_error(void) { return last_err; }

mg_status mg_cpu_fail(mg_status st, const char *msg) {
    snprintf(last_err, sizeof last_err, "%s", msg);
    return st;
}

struct mg_backend {
    mg_pool *pool;
    char desc[384];
};

typedef struct weight {
    mg_cpu_weight w; /* w.data == NULL: not set */
    void *own;       /* allocation to free; NULL when shared */
} weight;

enum { G_EMBED, G_NORM, G_HEAD, G_COUNT };

struct mg_stack {
    mg_backend *b;
    mg_stack_config cfg;
    int32_t n_held;
    weight glob[G_COUNT];
    weight (*layers)[MG_TENSOR_KIND_COUNT];
    float *inv_freq;
    int32_t q_dim, kv_dim;
};

struct mg_session {
    mg_stack *s;
    int32_t max_tokens;
    /* Positions each held layer's cache holds. They differ only when calls
     * run part of the stack (overlapping shards entering mid-range); a layer
     * is never run at a position past what it holds, so it never attends to
     * keys it did not compute. */
    int32_t *layer_len;
    float *k, *v; /* [n_held][max_tokens][kv_dim] */
    /* The token history (meshgpu.h mg_token_step): ids at 0..hist_len-1,
     * room for max_tokens + 1 (the sample after the last position). */
    int32_t *hist;
    int32_t hist_len;
};

const mg_stack_config *mg_cpu_stack_config(const mg_stack *s) { return &s->cfg; }
int32_t mg_cpu_stack_held(const mg_stack *s) { return s->n_held; }
mg_stack *mg_cpu_session_stack(const mg_session *se) { return se->s; }
int32_t *mg_cpu_session_history(mg_session *se, int32_t **len, int32_t *cap) {
    *len = &se->hist_len;
    *cap = se->max_tokens + 1;
    return se->hist;
}

/* ---- backend ---- */

/* The CPU backend accepts every mg_backend_options field and uses only
 * threads: its attention is f32 math and it has no graphs. Values out of
 * range are refused as the CUDA backend refuses them. */
static mg_status cpu_backend_open(const mg_backend_options *opts, mg_backend **out) {
    static const mg_backend_options defaults;
    const mg_backend_options *o = opts ? opts : &defaults;
    if (!out) return fail(MG_ERR_INVALID_ARGUMENT, "backend_open: out is NULL");
    if (o->threads < 0) return fail(MG_ERR_INVALID_ARGUMENT, "backend_open: threads %d < 0", o->threads);
    if (o->device < 0 || (o->attention != MG_ATTENTION_HF_BF16 && o->attention != MG_ATTENTION_F32) ||
        (o->prefill_attention != MG_PREFILL_ATTENTION_AUTO && o->prefill_attention != MG_PREFILL_ATTENTION_TILED) ||
        (o->no_graphs != 0 && o->no_graphs != 1) || (o->batch_mma != 0 && o->batch_mma != 1) ||
        (o->fused_decode != 0 && o->fused_decode != 1))
        return fail(MG_ERR_INVALID_ARGUMENT,
                    "backend_open: device %d, attention %d, prefill_attention %d, no_graphs %d, batch_mma %d, fused_decode %d: out of range",
                    o->device, o->attention, o->prefill_attention, o->no_graphs, o->batch_mma, o->fused_decode);
    const int32_t threads = o->threads;
    mg_backend *b = calloc(1, sizeof *b);
    if (!b) return fail(MG_ERR_OUT_OF_MEMORY, "backend_open: out of memory");
    b->pool = mg_pool_create(threads);
    if (!b->pool) {
        free(b);
        return fail(MG_ERR_OUT_OF_MEMORY, "backend_open: cannot create the thread pool");
    }
    /* What runs: on avx512bf16 bf16 weights take bf16 products at every
     * step; on AVX-512 prompts' quantized weights (bf16 ones too on
     * avx512f) take a prompt kernel (step_path): for quantized weights the
     * 16-bit one where it measured clearly faster (mg_cpu_prompt_q16,
     * mg_cpu_faster_measured). */
    int isa = mg_cpu_isa();
    char prompt[160] = "";
    if (isa >= MG_ISA_AVX512F && mg_cpu_prompt_q16())
        snprintf(prompt, sizeof prompt,
                 "; prompts of %d+ tokens: 16-bit products on avx512vnni tiles for quantized weights (%.2fx the f32 tile "
                 "here)%s",
                 MG_PROMPT_STEP_MIN, mg_cpu_prompt_q16_speedup(),
                 isa == MG_ISA_AVX512F ? ", f32 products on widened rows for bf16 weights" : "");
    else if (isa >= MG_ISA_AVX512F)
        snprintf(prompt, sizeof prompt, "; prompts of %d+ tokens: f32 products on dequantized rows%s", MG_PROMPT_STEP_MIN,
                 isa == MG_ISA_AVX512F ? ", bf16 weights too" : "");
    if (isa == MG_ISA_AVX512BF16)
        snprintf(b->desc, sizeof b->desc,
                 "cpu x%d (avx512bf16: bf16 products for bf16 weights at every step (%.2fx avx512f's tile here), %d-bit "
                 "activations for quantized weights on %s kernels%s)",
                 mg_pool_threads(b->pool), mg_cpu_bf16_speedup(), mg_cpu_quant_act(), mg_cpu_quant_kernels(isa), prompt);
    else
        snprintf(b->desc, sizeof b->desc, "cpu x%d (%s, %d-bit activations for quantized weights on %s kernels%s)",
                 mg_pool_threads(b->pool), mg_cpu_isa_name(isa), mg_cpu_quant_act(), mg_cpu_quant_kernels(isa), prompt);
    *out = b;
    return MG_OK;
}

static void cpu_backend_close(mg_backend *b) {
    if (!b) return;
    mg_pool_free(b->pool);
    free(b);
}

static mg_status cpu_backend_memory(mg_backend *b, uint64_t *free_bytes, uint64_t *total_bytes) {
    (void)b;
    long page = sysconf(_SC_PAGESIZE), av = sysconf(_SC_AVPHYS_PAGES), tot = sysconf(_SC_PHYS_PAGES);
    if (page <= 0 || av < 0 || tot <= 0) return fail(MG_ERR_BACKEND, "backend_memory: sysconf failed");
    /* MemAvailable counts reclaimable page cache; prefer it when readable. */
    uint64_t avail = (uint64_t)av * (uint64_t)page;
    FILE *f = fopen("/proc/meminfo", "r");
    if (f) {
        char line[256];
        unsigned long long kb;
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
                avail = (uint64_t)kb * 1024;
                break;
            }
        fclose(f);
    }
    if (free_bytes) *free_bytes = avail;
    if (total_bytes) *total_bytes = (uint64_t)tot * (uint64_t)page;
    return MG_OK;
}

static const char *cpu_backend_describe(mg_backend *b) { return b ? b->desc : "cpu"; }

static mg_status cpu_host_alloc(mg_backend *b, size_t nbytes, void **out) {
    (void)b;
    if (!out) return fail(MG_ERR_INVALID_ARGUMENT, "host_alloc: out is NULL");
    if (nbytes == 0) return fail(MG_ERR_INVALID_ARGUMENT, "host_alloc: zero bytes");
    void *p = NULL;
    if (posix_memalign(&p, 64, nbytes) != 0) return fail(MG_ERR_OUT_OF_MEMORY, "host_alloc: %zu bytes: out of memory", nbytes);
    *out = p;
    return MG_OK;
}

static void cpu_host_free(mg_backend *b, void *p) {
    (void)b;
    free(p);
}

/* ---- stack ---- */

static mg_status check_config(const mg_stack_config *c) {
    if (c->hidden <= 0 || c->hidden > MAX_DIM) return fail(MG_ERR_INVALID_ARGUMENT, "stack_create: hidden %d out of range", c->hidden);
    if (c->intermediate <= 0 || c->intermediate > MAX_DIM)
        return fail(MG_ERR_INVALID_ARGUMENT, "stack_create: intermediate %d out of range", c->intermediate);
    if (c->n_heads <= 0 || c->n_kv_heads <= 0 || c->n_heads % c->n_kv_heads != 0)
        return fail(MG_ERR_INVALID_ARGUMENT, "stack_create: n_heads %d must be a positive multiple of n_kv_heads %d",
                    c->n_heads, c->n_kv_heads);
    if (c->head_dim <= 0 || c->head_dim > MAX_HEAD_DIM || c->head_dim % 2 != 0)
        return fail(MG_ERR_INVALID_ARGUMENT, "stack_create: head_dim %d must be even and in 2..%d", c->head_dim, MAX_HEAD_DIM);
    if ((int64_t)c->n_heads * c->head_dim > MAX_DIM)
        return fail(MG_ERR_INVALID_ARGUMENT, "stack_create: n_heads*head_dim too large");
    if (c->n_layers <= 0 || c->n_layers > 100000) return fail(MG_ERR_INVALID_ARGUMENT, "stack_create: n_layers %d out of range", c->n_layers);
    if (c->last_layer >= c->first_layer && (c->first_layer < 0 || c->last_layer >= c->n_layers))
        return fail(MG_ERR_INVALID_ARGUMENT, "stack_create: layers %d..%d outside the model's 0..%d", c->first_layer,
                    c->last_layer, c->n_layers - 1);
    if ((c->has_embed || c->has_head) && (c->vocab <= 0 || c->vocab > MAX_VOCAB))
        return fail(MG_ERR_INVALID_ARGUMENT, "stack_create: vocab %d out of range", c->vocab);
    if (c->max_context <= 0 || c->max_context > (1 << 24))
        return fail(MG_ERR_INVALID_ARGUMENT, "stack_create: max_context %d out of range", c->max_context);
    if (!(c->rms_eps > 0) || !isfinite(c->rms_eps)) return fail(MG_ERR_INVALID_ARGUMENT, "stack_create: rms_eps must be > 0");
    if (c->rope_type != MG_ROPE_DEFAULT && c->rope_type != MG_ROPE_LLAMA3)
        return fail(MG_ERR_UNSUPPORTED, "stack_create: rope type %d not supported", c->rope_type);
    if (!(c->rope_theta > 0) || !isfinite(c->rope_theta)) return fail(MG_ERR_INVALID_ARGUMENT, "stack_create: rope_theta must be > 0");
    if (c->rope_type == MG_ROPE_LLAMA3 &&
        (!(c->rope_factor > 0) || !(c->rope_low_freq_factor > 0) || !(c->rope_high_freq_factor > c->rope_low_freq_factor) ||
         c->rope_original_max_pos <= 0))
        return fail(MG_ERR_INVALID_ARGUMENT,
                    "stack_create: llama3 rope needs factor > 0, 0 < low_freq_factor < high_freq_factor, original_max_pos > 0");
    if (c->head_dim / 2 > MG_MAX_ROPE_FACTORS)
        return fail(MG_ERR_INVALID_ARGUMENT, "stack_create: head_dim %d out of range", c->head_dim);
    if (mg_cpu_has_rope_factors(c->rope_freq_factors, c->head_dim))
        for (int32_t i = 0; i < c->head_dim / 2; i++)
            if (!(c->rope_freq_factors[i] > 0) || !isfinite(c->rope_freq_factors[i]))
                return fail(MG_ERR_INVALID_ARGUMENT, "stack_create: rope frequency factor %d is %g; each must be positive",
                            i, (double)c->rope_freq_factors[i]);
    return MG_OK;
}

static mg_status cpu_stack_create(mg_backend *b, const mg_stack_config *cfg, mg_stack **out) {
    if (!b || !cfg || !out) return fail(MG_ERR_INVALID_ARGUMENT, "stack_create: NULL argument");
    mg_status st = check_config(cfg);
    if (st) return st;
    mg_stack *s = calloc(1, sizeof *s);
    if (!s) return fail(MG_ERR_OUT_OF_MEMORY, "stack_create: out of memory");
    s->b = b;
    s->cfg = *cfg;
    s->n_held = cfg->last_layer >= cfg->first_layer ? cfg->last_layer - cfg->first_layer + 1 : 0;
    s->q_dim = cfg->n_heads * cfg->head_dim;
    s->kv_dim = cfg->n_kv_heads * cfg->head_dim;
    s->inv_freq = malloc(sizeof(float) * (size_t)(cfg->head_dim / 2));
    if (s->n_held) s->layers = calloc((size_t)s->n_held, sizeof *s->layers);
    if (!s->inv_freq || (s->n_held && !s->layers)) {
        free(s->inv_freq);
        free(s->layers);
        free(s);
        return fail(MG_ERR_OUT_OF_MEMORY, "stack_create: out of memory");
    }
    mg_rope_params rp = {cfg->rope_type, cfg->rope_theta, cfg->rope_factor, cfg->rope_low_freq_factor,
                         cfg->rope_high_freq_factor, cfg->rope_original_max_pos, cfg->head_dim};
    mg_cpu_rope_inv_freq(&rp, s->inv_freq);
    if (mg_cpu_has_rope_factors(cfg->rope_freq_factors, cfg->head_dim))
        for (int32_t i = 0; i < cfg->head_dim / 2; i++) s->inv_freq[i] /= cfg->rope_freq_factors[i];
    *out = s;
    return MG_OK;
}

static const char *kind_name(int32_t k) {
    static const char *names[] = {"tok_embed", "final_norm", "lm_head", "attn_norm", "wq", "wk", "wv", "bq",
                                  "bk",        "bv",         "wo",      "mlp_norm",  "w_gate", "w_up", "w_down"};
    return k >= 0 && k < MG_TENSOR_KIND_COUNT ? names[k] : "?";
}

/* Expected shape of a kind: rows, cols (cols 0 = a vector). */
static void expected_shape(const mg_stack *s, int32_t kind, int64_t *rows, int64_t *cols) {
    const mg_stack_config *c = &s->cfg;
    *cols = 0;
    switch (kind) {
    case MG_TOK_EMBED:
    case MG_LM_HEAD: *rows = c->vocab; *cols = c->hidden; break;
    case MG_FINAL_NORM:
    case MG_ATTN_NORM:
    case MG_MLP_NORM: *rows = c->hidden; break;
    case MG_WQ: *rows = s->q_dim; *cols = c->hidden; break;
    case MG_WK:
    case MG_WV: *rows = s->kv_dim; *cols = c->hidden; break;
    case MG_BQ: *rows = s->q_dim; break;
    case MG_BK:
    case MG_BV: *rows = s->kv_dim; break;
    case MG_WO: *rows = c->hidden; *cols = s->q_dim; break;
    case MG_W_GATE:
    case MG_W_UP: *rows = c->intermediate; *cols = c->hidden; break;
    case MG_W_DOWN: *rows = c->hidden; *cols = c->intermediate; break;
    default: *rows = 0;
    }
}

static int is_vector_kind(int32_t k) {
    return k == MG_FINAL_NORM || k == MG_ATTN_NORM || k == MG_MLP_NORM || k == MG_BQ || k == MG_BK || k == MG_BV;
}

/* Weights of 2 MB and more go in transparent huge pages where the kernel
 * allows it (madvise mode): decode streams every weight once per token, and
 * fewer TLB misses measurably raise the bytes per second. */
static void *weight_alloc(size_t n) {
    void *p = NULL;
    size_t huge = 2u << 20;
    if (n >= huge) {
        if (posix_memalign(&p, huge, n) != 0) return NULL;
#ifdef MADV_HUGEPAGE
        /* whole huge pages only: the tail stays in small pages, nothing is wasted */
        madvise(p, n / huge * huge, MADV_HUGEPAGE); /* advisory: failure is fine */
#endif
        return p;
    }
    return posix_memalign(&p, 64, n ? n : 1) == 0 ? p : NULL;
}

static void weight_free(weight *w) {
    free(w->own);
    memset(w, 0, sizeof *w);
}

static weight *slot_of(mg_stack *s, int32_t kind, int32_t layer) {
    switch (kind) {
    case MG_TOK_EMBED: return &s->glob[G_EMBED];
    case MG_FINAL_NORM: return &s->glob[G_NORM];
    case MG_LM_HEAD: return &s->glob[G_HEAD];
    }
    return &s->layers[layer - s->cfg.first_layer][kind];
}

/* The embedding and a tied LM head are the same bytes: keep one copy. */
static int same_bytes(const weight *other, int32_t dtype, const void *data, size_t nbytes) {
    size_t have = mg_cpu_is_quant(dtype) ? (size_t)other->w.rows * mg_cpu_quant_row_bytes(dtype, other->w.cols)
                                         : (size_t)other->w.rows * (size_t)other->w.cols * (dtype == MG_F32 ? 4 : 2);
    return other->w.data && other->own && !other->w.tiled && other->w.dtype == dtype && dtype != MG_F16 && have == nbytes &&
           memcmp(other->w.data, data, nbytes) == 0;
}

static mg_status cpu_stack_set_tensor(mg_stack *s, int32_t kind, int32_t layer, int32_t dtype, const int64_t *shape,
                                      int32_t ndim, const void *data, size_t nbytes) {
    if (!s) return fail(MG_ERR_INVALID_ARGUMENT, "set_tensor: stack is NULL");
    if (kind < 0 || kind >= MG_TENSOR_KIND_COUNT) return fail(MG_ERR_INVALID_ARGUMENT, "set_tensor: unknown tensor kind %d", kind);
    const char *kn = kind_name(kind);
    const mg_stack_config *c = &s->cfg;
    int global = kind == MG_TOK_EMBED || kind == MG_FINAL_NORM || kind == MG_LM_HEAD;
    if (global && layer != -1) return fail(MG_ERR_INVALID_ARGUMENT, "set_tensor %s: layer must be -1, not %d", kn, layer);
    if (!global && (s->n_held == 0 || layer < c->first_layer || layer > c->last_layer))
        return fail(MG_ERR_INVALID_ARGUMENT, "set_tensor %s: layer %d is not held by this stack (layers %d..%d)", kn, layer,
                    c->first_layer, c->last_layer);
    if (kind == MG_TOK_EMBED && !c->has_embed) return fail(MG_ERR_INVALID_ARGUMENT, "set_tensor %s: stack has no embeddings", kn);
    if ((kind == MG_FINAL_NORM || kind == MG_LM_HEAD) && !c->has_head)
        return fail(MG_ERR_INVALID_ARGUMENT, "set_tensor %s: stack has no head", kn);
    if ((kind == MG_BQ || kind == MG_BK || kind == MG_BV) && !c->qkv_bias)
        return fail(MG_ERR_INVALID_ARGUMENT, "set_tensor %s: config has no q/k/v bias", kn);
    int quant = mg_cpu_is_quant(dtype);
    if (dtype != MG_F32 && dtype != MG_F16 && dtype != MG_BF16 && !quant)
        return fail(MG_ERR_INVALID_ARGUMENT, "set_tensor %s: unknown dtype %d", kn, dtype);
    if (quant && is_vector_kind(kind))
        return fail(MG_ERR_INVALID_ARGUMENT, "set_tensor %s: a norm or bias must be f32, f16 or bf16, not quantized type %d", kn,
                    dtype);
    int64_t rows, cols;
    expected_shape(s, kind, &rows, &cols);
    int want_ndim = cols ? 2 : 1;
    if (!shape || ndim != want_ndim || shape[0] != rows || (cols && shape[1] != cols)) {
        char got[64] = "?";
        if (shape && ndim == 1) snprintf(got, sizeof got, "[%lld]", (long long)shape[0]);
        else if (shape && ndim == 2) snprintf(got, sizeof got, "[%lld, %lld]", (long long)shape[0], (long long)shape[1]);
        else if (shape) snprintf(got, sizeof got, "%d dims", ndim);
        if (cols) return fail(MG_ERR_INVALID_ARGUMENT, "set_tensor %s: shape %s, want [%lld, %lld]", kn, got, (long long)rows, (long long)cols);
        return fail(MG_ERR_INVALID_ARGUMENT, "set_tensor %s: shape %s, want [%lld]", kn, got, (long long)rows);
    }
    if (!cols) cols = 1;
    size_t count = (size_t)rows * (size_t)cols, es = dtype == MG_F32 ? 4 : 2;
    if (quant) {
        int32_t be, bb;
        mg_cpu_quant_block(dtype, &be, &bb);
        size_t rb = mg_cpu_quant_row_bytes(dtype, cols);
        if (!rb)
            return fail(MG_ERR_INVALID_ARGUMENT, "set_tensor %s: rows of %lld elements are not a whole number of %d-element blocks of type %d",
                        kn, (long long)cols, be, dtype);
        if (nbytes != (size_t)rows * rb)
            return fail(MG_ERR_INVALID_ARGUMENT, "set_tensor %s: %zu bytes, want %zu (%lld rows of %zu bytes of type %d blocks)", kn,
                        nbytes, (size_t)rows * rb, (long long)rows, rb, dtype);
    } else if (nbytes != count * es)
        return fail(MG_ERR_INVALID_ARGUMENT, "set_tensor %s: %zu bytes, want %zu for the shape and dtype", kn, nbytes, count * es);
    if (!data) return fail(MG_ERR_INVALID_ARGUMENT, "set_tensor %s: data is NULL", kn);

    weight *slot = slot_of(s, kind, layer);
    weight nw = {{dtype, NULL, (int32_t)rows, (int32_t)cols, 0}, NULL};

    weight *twin = kind == MG_LM_HEAD ? &s->glob[G_EMBED] : kind == MG_TOK_EMBED ? &s->glob[G_HEAD] : NULL;
    if (twin && same_bytes(twin, dtype, data, nbytes)) {
        weight_free(slot);
        slot->w = twin->w; /* shared; twin owns it */
        return MG_OK;
    }

    /* Norms and biases and f16 matrices become f32; bf16/f32 matrices stay. */
    int to_f32 = is_vector_kind(kind) || dtype == MG_F16;
    size_t out_bytes = to_f32 ? count * 4 : nbytes;
    void *buf = weight_alloc(out_bytes);
    if (!buf) return fail(MG_ERR_OUT_OF_MEMORY, "set_tensor %s: %zu bytes: out of memory", kn, out_bytes);
    /* bf16 layer matrices and an LM head of its own are tiled (see
     * mg_cpu_weight.tiled); the embedding table stays row-major for lookups. */
    int tile = !to_f32 && dtype == MG_BF16 && kind != MG_TOK_EMBED && mg_cpu_tileable((int32_t)rows, (int32_t)cols);
    if (tile) {
        mg_cpu_tile_bf16(data, (int32_t)rows, (int32_t)cols, buf);
        nw.w.tiled = 1;
    } else if (to_f32 && dtype != MG_F32) {
        float *f = buf;
        const uint16_t *h = data;
        for (size_t i = 0; i < count; i++) f[i] = dtype == MG_BF16 ? mg_bf16_to_f32(h[i]) : mg_f16_to_f32(h[i]);
        nw.w.dtype = MG_F32;
    } else {
        memcpy(buf, data, nbytes);
    }
    nw.w.data = buf;
    nw.own = buf;

    /* Replacing a tensor the twin shares: the twin takes its own copy of the old one first. */
    if (twin && twin->w.data && !twin->own && slot->own == twin->w.data) {
        twin->own = slot->own;
        slot->own = NULL;
    }
    weight_free(slot);
    *slot = nw;
    return MG_OK;
}

static mg_status cpu_stack_ready(mg_stack *s) {
    if (!s) return fail(MG_ERR_INVALID_ARGUMENT, "stack_ready: stack is NULL");
    const mg_stack_config *c = &s->cfg;
    if (c->has_embed && !s->glob[G_EMBED].w.data) return fail(MG_ERR_INVALID_ARGUMENT, "stack_ready: tok_embed not set");
    if (c->has_head && !s->glob[G_NORM].w.data) return fail(MG_ERR_INVALID_ARGUMENT, "stack_ready: final_norm not set");
    if (c->has_head && !s->glob[G_HEAD].w.data) return fail(MG_ERR_INVALID_ARGUMENT, "stack_ready: lm_head not set");
    for (int32_t l = 0; l < s->n_held; l++)
        for (int32_t k = MG_ATTN_NORM; k < MG_TENSOR_KIND_COUNT; k++) {
            if (!c->qkv_bias && (k == MG_BQ || k == MG_BK || k == MG_BV)) continue;
            if (!s->layers[l][k].w.data)
                return fail(MG_ERR_INVALID_ARGUMENT, "stack_ready: layer %d %s not set", c->first_layer + l, kind_name(k));
        }
    return MG_OK;
}

static void cpu_stack_free(mg_stack *s) {
    if (!s) return;
    for (int g = 0; g < G_COUNT; g++) weight_free(&s->glob[g]);
    for (int32_t l = 0; l < s->n_held; l++)
        for (int k = 0; k < MG_TENSOR_KIND_COUNT; k++) weight_free(&s->layers[l][k]);
    free(s->layers);
    free(s->inv_freq);
    free(s);
}

/* ---- session ---- */

static mg_status cpu_session_create(mg_stack *s, int32_t max_tokens, mg_session **out) {
    if (!s || !out) return fail(MG_ERR_INVALID_ARGUMENT, "session_create: NULL argument");
    if (max_tokens <= 0 || max_tokens > s->cfg.max_context)
        return fail(MG_ERR_INVALID_ARGUMENT, "session_create: max_tokens %d must be in 1..%d", max_tokens, s->cfg.max_context);
    mg_session *se = calloc(1, sizeof *se);
    if (!se) return fail(MG_ERR_OUT_OF_MEMORY, "session_create: out of memory");
    se->s = s;
    se->max_tokens = max_tokens;
    se->layer_len = calloc((size_t)(s->n_held ? s->n_held : 1), sizeof(int32_t));
    se->hist = malloc(sizeof(int32_t) * ((size_t)max_tokens + 1));
    if (!se->layer_len || !se->hist) {
        free(se->layer_len);
        free(se->hist);
        free(se);
        return fail(MG_ERR_OUT_OF_MEMORY, "session_create: out of memory");
    }
    size_t n = (size_t)s->n_held * (size_t)max_tokens * (size_t)s->kv_dim;
    if (n) {
        /* Large mallocs are mmapped: pages are committed as the cache fills. */
        se->k = malloc(n * sizeof(float));
        se->v = malloc(n * sizeof(float));
        if (!se->k || !se->v) {
            free(se->k);
            free(se->v);
            free(se->layer_len);
            free(se->hist);
            free(se);
            return fail(MG_ERR_OUT_OF_MEMORY, "session_create: KV cache of %zu bytes: out of memory", 2 * n * sizeof(float));
        }
    }
    *out = se;
    return MG_OK;
}

static void cpu_session_free(mg_session *se) {
    if (!se) return;
    free(se->k);
    free(se->v);
    free(se->layer_len);
    free(se->hist);
    free(se);
}

/* The furthest position any held layer holds (all equal when calls run the
 * whole stack). */
static int32_t cpu_session_len(mg_session *se) {
    if (!se) return -1;
    int32_t n = 0;
    for (int32_t l = 0; l < se->s->n_held; l++)
        if (se->layer_len[l] > n) n = se->layer_len[l];
    return n;
}

/* ---- compute ---- */

static void rows_to_f32(int32_t dtype, const void *in, size_t count, float *out) {
    if (dtype == MG_F32) {
        memmove(out, in, count * 4);
        return;
    }
    const uint16_t *h = in;
    for (size_t i = 0; i < count; i++) out[i] = mg_bf16_to_f32(h[i]);
}

static void rows_from_f32(int32_t dtype, const float *in, size_t count, void *out) {
    if (dtype == MG_F32) {
        memmove(out, in, count * 4);
        return;
    }
    uint16_t *h = out;
    for (size_t i = 0; i < count; i++) h[i] = mg_f32_to_bf16(in[i]);
}

static mg_status check_act_dtype(const char *op, int32_t dtype) {
    if (dtype != MG_F32 && dtype != MG_BF16)
        return fail(MG_ERR_INVALID_ARGUMENT, "%s: activation dtype %d must be f32 (0) or bf16 (2)", op, dtype);
    return MG_OK;
}

static mg_status cpu_embed(mg_stack *s, const int32_t *tokens, int32_t n, int32_t dtype, void *out) {
    if (!s || !tokens || !out) return fail(MG_ERR_INVALID_ARGUMENT, "embed: NULL argument");
    if (!s->cfg.has_embed) return fail(MG_ERR_INVALID_ARGUMENT, "embed: stack has no embeddings (layer 0 not held)");
    if (!s->glob[G_EMBED].w.data) return fail(MG_ERR_INVALID_ARGUMENT, "embed: tok_embed not set");
    if (n <= 0) return fail(MG_ERR_INVALID_ARGUMENT, "embed: %d tokens", n);
    mg_status st = check_act_dtype("embed", dtype);
    if (st) return st;
    for (int32_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= s->cfg.vocab)
            return fail(MG_ERR_INVALID_ARGUMENT, "embed: token %d at index %d outside the vocabulary 0..%d", tokens[i], i,
                        s->cfg.vocab - 1);
    size_t count = (size_t)n * (size_t)s->cfg.hidden;
    if (dtype == MG_F32) {
        mg_cpu_embed(&s->glob[G_EMBED].w, tokens, n, out);
        return MG_OK;
    }
    float *tmp = malloc(count * sizeof(float));
    if (!tmp) return fail(MG_ERR_OUT_OF_MEMORY, "embed: out of memory");
    mg_cpu_embed(&s->glob[G_EMBED].w, tokens, n, tmp);
    rows_from_f32(dtype, tmp, count, out);
    free(tmp);
    return MG_OK;
}

/* A forward step's path: the chosen one (mg_cpu_isa), and for prompts
 * (steps of MG_PROMPT_STEP_MIN tokens or more that are not draft trees)
 * MG_PATH_PROMPT: on AVX-512 their quantized weights, and bf16 ones on
 * avx512f, take a prompt kernel (tokens in the lanes: cpu_matmul_avx512.c's
 * f32 products, as on Intel cores, where 16-bit integer products share one
 * port and f32 FMAs have two; or for quantized weights
 * cpu_matmul_q16prompt.c's 16-bit VNNI products where they measured
 * faster, as on Zen 4). On avx512bf16 bf16 weights take bf16 products at
 * every step (the register tiles and the one-token kernel, in the same
 * order), as llama.cpp's bf16 products do. Decode steps, short prompts and
 * draft trees (speculative verify passes, which check decode's tokens)
 * keep decode's products. Chosen per step, so a session's result never
 * depends on what it is batched with. */
static int step_path(int32_t n_tokens, int tree) {
    int isa = mg_cpu_isa();
    if (n_tokens < MG_PROMPT_STEP_MIN || tree) return isa;
    return isa | MG_PATH_PROMPT;
}

/* Consecutive rows of a forward call whose steps take the same path. */
typedef struct {
    int32_t row0, n, path; /* step_path */
} row_run;

/* mg_cpu_matmul_multi_isa over each run of rows with its own path; x and
 * outs are token-major, as the whole call's. */
static void matmul_runs(mg_pool *pool, const row_run *runs, int32_t n_runs, const float *x, int32_t count,
                        const mg_cpu_weight *const *ws, const mg_cpu_weight *const *bs, float *const *outs) {
    for (int32_t i = 0; i < n_runs; i++) {
        float *o[MG_MATMUL_MAX];
        for (int32_t m = 0; m < count; m++) o[m] = outs[m] + (size_t)runs[i].row0 * (size_t)ws[m]->rows;
        mg_cpu_matmul_multi_isa(pool, runs[i].path, x + (size_t)runs[i].row0 * (size_t)ws[0]->cols, runs[i].n, count, ws, bs,
                                o);
    }
}

static void add_into(float *x, const float *y, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] += y[i];
}

/* Checks a step's tree (meshgpu.h mg_tree_step). */
static mg_status check_tree(int32_t step, const int32_t *parents, int32_t n) {
    if (n > MG_MAX_TREE_ROWS)
        return fail(MG_ERR_INVALID_ARGUMENT, "forward_tree: step %d: %d rows in a tree (at most %d)", step, n, MG_MAX_TREE_ROWS);
    for (int32_t i = 0; i < n; i++) {
        int32_t p = parents[i];
        if (p < -1 || p >= i)
            return fail(MG_ERR_INVALID_ARGUMENT, "forward_tree: step %d: row %d has parent %d (want -1..%d)", step, i, p, i - 1);
    }
    return MG_OK;
}

/* forward and forward_tree: parents[i] is step i's tree or NULL (a chain);
 * parents itself may be NULL (all chains). */
static mg_status forward_rows(mg_stack *s, const mg_step *steps, const int32_t *const *parents, int32_t n_steps,
                              int32_t first, int32_t last, int32_t dtype, const void *in, void *out) {
    if (!s || !steps || !in || !out) return fail(MG_ERR_INVALID_ARGUMENT, "forward: NULL argument");
    const mg_stack_config *c = &s->cfg;
    if (s->n_held == 0) return fail(MG_ERR_INVALID_ARGUMENT, "forward: stack holds no layers");
    if (first > last || first < c->first_layer || last > c->last_layer)
        return fail(MG_ERR_INVALID_ARGUMENT, "forward: layers %d..%d not within this stack's %d..%d", first, last,
                    c->first_layer, c->last_layer);
    mg_status st = check_act_dtype("forward", dtype);
    if (st) return st;
    if (n_steps <= 0 || n_steps > 65536) return fail(MG_ERR_INVALID_ARGUMENT, "forward: %d steps", n_steps);
    int64_t rows64 = 0;
    for (int32_t i = 0; i < n_steps; i++) {
        const mg_step *sp = &steps[i];
        if (!sp->session) return fail(MG_ERR_INVALID_ARGUMENT, "forward: step %d: session is NULL", i);
        if (sp->session->s != s) return fail(MG_ERR_INVALID_ARGUMENT, "forward: step %d: session belongs to another stack", i);
        for (int32_t j = 0; j < i; j++)
            if (steps[j].session == sp->session)
                return fail(MG_ERR_INVALID_ARGUMENT, "forward: steps %d and %d use the same session", j, i);
        if (sp->n_tokens <= 0) return fail(MG_ERR_INVALID_ARGUMENT, "forward: step %d: %d tokens", i, sp->n_tokens);
        if (sp->pos < 0) return fail(MG_ERR_INVALID_ARGUMENT, "forward: step %d: negative position %d", i, sp->pos);
        for (int32_t l = first; l <= last; l++) {
            int32_t have = sp->session->layer_len[l - c->first_layer];
            if (sp->pos > have && have < cpu_session_len(sp->session))
                return fail(MG_ERR_INVALID_ARGUMENT,
                            "forward: step %d: position %d, but layer %d holds only %d positions (earlier calls skipped it)", i,
                            sp->pos, l, have);
            if (sp->pos > have)
                return fail(MG_ERR_INVALID_ARGUMENT, "forward: step %d: position %d beyond the session length %d", i, sp->pos,
                            have);
        }
        if ((int64_t)sp->pos + sp->n_tokens > sp->session->max_tokens)
            return fail(MG_ERR_CAPACITY, "forward: step %d: positions %d..%d exceed the session's %d tokens", i, sp->pos,
                        sp->pos + sp->n_tokens - 1, sp->session->max_tokens);
        rows64 += sp->n_tokens;
    }
    if (rows64 > (1 << 24)) return fail(MG_ERR_INVALID_ARGUMENT, "forward: %lld rows is too many", (long long)rows64);
    size_t R = (size_t)rows64, H = (size_t)c->hidden, I = (size_t)c->intermediate;
    size_t Q = (size_t)s->q_dim, KV = (size_t)s->kv_dim;
    int32_t max_len = 0;
    for (int32_t i = 0; i < n_steps; i++)
        if (steps[i].pos + steps[i].n_tokens > max_len) max_len = steps[i].pos + steps[i].n_tokens;
    int nth = mg_pool_threads(s->b->pool);

    /* x | xn | q | k | v | att | gate | up | tmp | attention scratch | positions | tree masks */
    size_t floats = R * H * 3 + R * Q * 2 + R * KV * 2 + R * I * 2 + (size_t)nth * (size_t)max_len;
    size_t masks = 0;
    for (int32_t i = 0; parents && i < n_steps; i++)
        if (parents[i]) masks += (size_t)steps[i].n_tokens * (size_t)steps[i].n_tokens;
    float *mem = malloc(floats * sizeof(float) + R * sizeof(int32_t) + masks);
    row_run *runs = malloc((size_t)n_steps * sizeof *runs);
    if (!mem || !runs) {
        free(mem), free(runs);
        return fail(MG_ERR_OUT_OF_MEMORY, "forward: %zu bytes of scratch: out of memory", floats * sizeof(float));
    }
    int32_t n_runs = 0;
    for (int32_t i = 0, row = 0; i < n_steps; row += steps[i].n_tokens, i++) {
        int path = step_path(steps[i].n_tokens, parents && parents[i]);
        if (n_runs > 0 && runs[n_runs - 1].path == path)
            runs[n_runs - 1].n += steps[i].n_tokens;
        else
            runs[n_runs++] = (row_run){row, steps[i].n_tokens, path};
    }
    float *x = mem, *xn = x + R * H, *tmp = xn + R * H, *q = tmp + R * H, *att = q + R * Q, *k = att + R * Q,
          *v = k + R * KV, *gate = v + R * KV, *up = gate + R * I, *scratch = up + R * I;
    int32_t *positions = (int32_t *)(scratch + (size_t)nth * (size_t)max_len);
    uint8_t *mask_mem = (uint8_t *)(positions + R);

    rows_to_f32(dtype, in, R * H, x);
    size_t r = 0;
    for (int32_t i = 0; i < n_steps; i++) {
        const int32_t *par = parents ? parents[i] : NULL;
        int32_t n = steps[i].n_tokens;
        if (!par) {
            for (int32_t t = 0; t < n; t++) positions[r++] = steps[i].pos + t;
            continue;
        }
        /* a row's position is its parent's + 1 (parents checked by the
         * caller); its mask row marks its ancestors and itself */
        uint8_t *m = mask_mem;
        memset(m, 0, (size_t)n * (size_t)n);
        for (int32_t t = 0; t < n; t++) {
            int32_t p = par[t];
            positions[r + t] = p < 0 ? steps[i].pos : positions[r + p] + 1;
            if (p >= 0) memcpy(m + (size_t)t * n, m + (size_t)p * n, (size_t)p + 1);
            m[(size_t)t * n + t] = 1;
        }
        mask_mem += (size_t)n * (size_t)n;
        r += (size_t)n;
    }

    mg_pool *pool = s->b->pool;
    for (int32_t l = first; l <= last; l++) {
        int32_t li = l - c->first_layer;
        weight *w = s->layers[li];
        mg_cpu_rmsnorm(x, &w[MG_ATTN_NORM].w, c->rms_eps, (int32_t)R, c->hidden, xn);
        {
            const mg_cpu_weight *ws[3] = {&w[MG_WQ].w, &w[MG_WK].w, &w[MG_WV].w};
            const mg_cpu_weight *bs[3] = {NULL, NULL, NULL};
            if (c->qkv_bias) bs[0] = &w[MG_BQ].w, bs[1] = &w[MG_BK].w, bs[2] = &w[MG_BV].w;
            float *outs[3] = {q, k, v};
            matmul_runs(pool, runs, n_runs, xn, 3, ws, bs, outs);
        }
        mg_cpu_rope_freq(q, (int32_t)R, c->n_heads, positions, c->head_dim, s->inv_freq);
        mg_cpu_rope_freq(k, (int32_t)R, c->n_kv_heads, positions, c->head_dim, s->inv_freq);
        r = 0;
        const uint8_t *mask = (const uint8_t *)(positions + R);
        for (int32_t i = 0; i < n_steps; i++) {
            mg_session *se = steps[i].session;
            size_t base = (size_t)li * (size_t)se->max_tokens * KV;
            float *kc = se->k + base, *vc = se->v + base;
            int32_t n = steps[i].n_tokens, pos = steps[i].pos;
            memcpy(kc + (size_t)pos * KV, k + r * KV, (size_t)n * KV * sizeof(float));
            memcpy(vc + (size_t)pos * KV, v + r * KV, (size_t)n * KV * sizeof(float));
            const uint8_t *tree = parents && parents[i] ? mask : NULL;
            mg_cpu_attention_tree_par(pool, q + r * Q, kc, vc, n, pos, tree, c->n_heads, c->n_kv_heads, c->head_dim,
                                      att + r * Q, scratch);
            if (tree) mask += (size_t)n * (size_t)n;
            r += (size_t)n;
        }
        {
            const mg_cpu_weight *wo = &w[MG_WO].w;
            matmul_runs(pool, runs, n_runs, att, 1, &wo, NULL, &tmp);
        }
        add_into(x, tmp, R * H);
        mg_cpu_rmsnorm(x, &w[MG_MLP_NORM].w, c->rms_eps, (int32_t)R, c->hidden, xn);
        {
            const mg_cpu_weight *ws[2] = {&w[MG_W_GATE].w, &w[MG_W_UP].w};
            float *outs[2] = {gate, up};
            matmul_runs(pool, runs, n_runs, xn, 2, ws, NULL, outs);
        }
        mg_cpu_swiglu(gate, up, (int32_t)(R * I), gate);
        {
            const mg_cpu_weight *wd = &w[MG_W_DOWN].w;
            matmul_runs(pool, runs, n_runs, gate, 1, &wd, NULL, &tmp);
        }
        add_into(x, tmp, R * H);
    }
    /* pos < the old length truncated: positions past pos+n are gone */
    for (int32_t i = 0; i < n_steps; i++)
        for (int32_t l = first; l <= last; l++) steps[i].session->layer_len[l - c->first_layer] = steps[i].pos + steps[i].n_tokens;
    rows_from_f32(dtype, x, R * H, out);
    free(mem);
    free(runs);
    return MG_OK;
}

static mg_status cpu_forward(mg_stack *s, const mg_step *steps, int32_t n_steps, int32_t first, int32_t last,
                             int32_t dtype, const void *in, void *out) {
    return forward_rows(s, steps, NULL, n_steps, first, last, dtype, in, out);
}

static mg_status cpu_forward_tree(mg_stack *s, const mg_tree_step *steps, int32_t n_steps, int32_t first,
                                  int32_t last, int32_t dtype, const void *in, void *out) {
    if (!steps) return fail(MG_ERR_INVALID_ARGUMENT, "forward_tree: NULL argument");
    if (n_steps <= 0 || n_steps > 65536) return fail(MG_ERR_INVALID_ARGUMENT, "forward_tree: %d steps", n_steps);
    mg_step *plain = malloc((size_t)n_steps * sizeof *plain);
    const int32_t **parents = malloc((size_t)n_steps * sizeof *parents);
    mg_status st = MG_OK;
    if (!plain || !parents) st = fail(MG_ERR_OUT_OF_MEMORY, "forward_tree: out of memory");
    for (int32_t i = 0; st == MG_OK && i < n_steps; i++) {
        plain[i] = (mg_step){steps[i].session, steps[i].pos, steps[i].n_tokens};
        parents[i] = steps[i].parents;
        if (parents[i] && steps[i].n_tokens > 0) st = check_tree(i, parents[i], steps[i].n_tokens);
    }
    if (st == MG_OK) st = forward_rows(s, plain, parents, n_steps, first, last, dtype, in, out);
    free(plain);
    free(parents);
    return st;
}

static mg_status cpu_session_compact(mg_session *se, int32_t dst, const int32_t *src, int32_t n) {
    if (!se || (n > 0 && !src)) return fail(MG_ERR_INVALID_ARGUMENT, "session_compact: NULL argument");
    if (dst < 0 || n < 0 || (int64_t)dst + n > se->max_tokens)
        return fail(MG_ERR_INVALID_ARGUMENT, "session_compact: %d slots to %d in a session of %d", n, dst, se->max_tokens);
    mg_stack *s = se->s;
    for (int32_t j = 0; j < n; j++) {
        if (src[j] < dst + j || (j > 0 && src[j] <= src[j - 1]))
            return fail(MG_ERR_INVALID_ARGUMENT, "session_compact: slot %d from %d: want increasing sources at or after their destinations",
                        dst + j, src[j]);
        for (int32_t l = 0; l < s->n_held; l++)
            if (src[j] >= se->layer_len[l])
                return fail(MG_ERR_INVALID_ARGUMENT, "session_compact: slot %d beyond layer %d's %d positions", src[j],
                            s->cfg.first_layer + l, se->layer_len[l]);
    }
    for (int32_t l = 0; l < s->n_held; l++) {
        if (se->layer_len[l] < dst) continue; /* holds less: nothing to move or cut */
        size_t KV = (size_t)s->kv_dim, base = (size_t)l * (size_t)se->max_tokens * KV;
        for (int32_t j = 0; j < n; j++) {
            if (src[j] == dst + j) continue;
            memcpy(se->k + base + (size_t)(dst + j) * KV, se->k + base + (size_t)src[j] * KV, KV * sizeof(float));
            memcpy(se->v + base + (size_t)(dst + j) * KV, se->v + base + (size_t)src[j] * KV, KV * sizeof(float));
        }
        se->layer_len[l] = dst + n;
    }
    if (se->hist_len > dst) {
        int32_t kept = 0;
        while (kept < n && src[kept] < se->hist_len) {
            se->hist[dst + kept] = se->hist[src[kept]];
            kept++;
        }
        se->hist_len = dst + kept;
    }
    return MG_OK;
}

static mg_status cpu_logits(mg_stack *s, int32_t n_rows, int32_t dtype, const void *in, float *out) {
    if (!s || !in || !out) return fail(MG_ERR_INVALID_ARGUMENT, "logits: NULL argument");
    if (!s->cfg.has_head) return fail(MG_ERR_INVALID_ARGUMENT, "logits: stack has no head (last layer not held)");
    if (!s->glob[G_NORM].w.data || !s->glob[G_HEAD].w.data) return fail(MG_ERR_INVALID_ARGUMENT, "logits: head tensors not set");
    if (n_rows <= 0 || n_rows > (1 << 20)) return fail(MG_ERR_INVALID_ARGUMENT, "logits: %d rows", n_rows);
    mg_status st = check_act_dtype("logits", dtype);
    if (st) return st;
    size_t count = (size_t)n_rows * (size_t)s->cfg.hidden;
    float *x = malloc(2 * count * sizeof(float));
    if (!x) return fail(MG_ERR_OUT_OF_MEMORY, "logits: out of memory");
    rows_to_f32(dtype, in, count, x);
    mg_cpu_rmsnorm(x, &s->glob[G_NORM].w, s->cfg.rms_eps, n_rows, s->cfg.hidden, x + count);
    mg_cpu_matmul_par_isa(s->b->pool, mg_cpu_isa(), x + count, &s->glob[G_HEAD].w, NULL, n_rows, out);
    free(x);
    return MG_OK;
}

static const mg_api cpu_api = {
    .abi_version = MG_ABI_VERSION,
    .name = "cpu",
    .table_size = sizeof(mg_api),
    .last_error = cpu_last_error,
    .backend_open = cpu_backend_open,
    .backend_close = cpu_backend_close,
    .backend_memory = cpu_backend_memory,
    .backend_describe = cpu_backend_describe,
    .host_alloc = cpu_host_alloc,
    .host_free = cpu_host_free,
    .stack_create = cpu_stack_create,
    .stack_set_tensor = cpu_stack_set_tensor,
    .stack_ready = cpu_stack_ready,
    .stack_free = cpu_stack_free,
    .session_create = cpu_session_create,
    .session_free = cpu_session_free,
    .session_len = cpu_session_len,
    .embed = cpu_embed,
    .forward = cpu_forward,
    .logits = cpu_logits,
    .head_forward = mg_cpu_head_forward,
    .tail_forward = mg_cpu_tail_forward,
    .decode = mg_cpu_decode,
    .forward_tree = cpu_forward_tree,
    .session_compact = cpu_session_compact,
};

const mg_api *mg_cpu_api(void) { return &cpu_api; }

// backend.cu: the CUDA implementation of the C ABI in native/meshgpu.h,
// exported as mg_cuda_api. Semantics follow the CPU backend (validation,
// statuses, thread-local last error, truncation when pos < len, capacity).
//
// Per stack: one stream, one cuBLAS handle, bf16 weights (Q/K/V rows fused
// into one matrix, gate/up into another), a (cos, sin) RoPE table, and
// scratch for up to kChunkRows rows. forward() runs rows in chunks of at most
// kChunkRows through the requested layers; decode rows (<= 16) use the
// hand-written matrix-vector kernels and, when every step has one token,
// a CUDA graph captured per (rows, layer range, KV-length bucket) whose
// kernels read positions and cache pointers from device memory.
#include <cublas_v2.h>

#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <tuple>
#include <vector>

#include "../native/meshgpu.h"
#include "backend.h"
#include "dispatch.h"
#include "kernels.h"

using namespace mg;

namespace {

thread_local char g_err[512];
thread_local uint64_t g_fwd_host_ns;

uint64_t now_ns() {
    return (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

mg_status failf(mg_status s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof g_err, fmt, ap);
    va_end(ap);
    return s;
}

mg_status cuda_fail(cudaError_t e, const char *what) {
    return failf(e == cudaErrorMemoryAllocation ? MG_ERR_OUT_OF_MEMORY : MG_ERR_BACKEND, "cuda: %s: %s",
                 what, cudaGetErrorString(e));
}

#define CU(call, what)                                                                             \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) return cuda_fail(e_, what);                                         \
    } while (0)

#define BLAS(call, what)                                                                           \
    do {                                                                                           \
        cublasStatus_t b_ = (call);                                                                \
        if (b_ != CUBLAS_STATUS_SUCCESS) return failf(MG_ERR_BACKEND, "cublas: %s: status %d", what, (int)b_); \
    } while (0)

constexpr int kChunkRows = 512;     // rows per forward chunk (prefill split)
constexpr int kLogitRows = 64;      // rows per logits chunk
constexpr int kPrefillMin = 16;     // a step with this many tokens uses the prefill kernel
constexpr size_t kMaxGraphs = 64;   // captured decode graphs kept per stack
constexpr size_t kPrefillGemmMax = (size_t)1 << 30; // scratch cap for cuBLAS prefill attention

const char *kind_name(int k) {
    static const char *names[] = {"tok_embed", "final_norm", "lm_head", "attn_norm", "wq",
                                  "wk",        "wv",         "bq",      "bk",        "bv",
                                  "wo",        "mlp_norm",   "w_gate",  "w_up",      "w_down"};
    return k >= 0 && k < MG_TENSOR_KIND_COUNT ? names[k] : "?";
}

size_t dtype_size(int32_t d) { return d == MG_F32 ? 4 : (d == MG_F16 || d == MG_BF16) ? 2 : 0; }

struct Layer {
    bf16 *attn_norm = nullptr, *wqkv = nullptr, *bqkv = nullptr, *wo = nullptr;
    bf16 *mlp_norm = nullptr, *wgu = nullptr, *wdown = nullptr;
    uint32_t set = 0; // bit per tensor kind
};

} // namespace

struct mg_backend {
    int device = 0;
    char desc[256] = {0};
    KernelSettings ks; // from backend_open's options; each stack copies them
};

struct mg_session {
    mg_stack *s = nullptr;
    int32_t max_tokens = 0;
    // Positions each held layer holds: a call may run part of the stack's
    // range (a hop entering mid-range), as on the CPU backend.
    std::vector<int32_t> layer_len;
    int32_t len() const {
        int32_t n = 0;
        for (int32_t v : layer_len) n = v > n ? v : n;
        return n;
    }
    bf16 *k = nullptr, *v = nullptr; // [local layer][pos][kv head][hd]
    long long layer_stride = 0;
};

struct mg_stack {
    mg_backend *b = nullptr;
    mg_stack_config cfg{};
    std::mutex mu;
    cudaStream_t st = nullptr;
    cublasHandle_t blas = nullptr;
    void *blas_ws = nullptr;
    int n_local = 0;
    int q_dim = 0, kv_dim = 0, qkv_dim = 0;
    std::vector<Layer> layers;
    bf16 *embed = nullptr, *final_norm = nullptr, *lm_head = nullptr;
    bool head_tied = false;               // lm_head aliases embed
    int32_t embed_dtype = -1;             // dtype and size the embedding was set with
    size_t embed_bytes = 0;
    uint32_t global_set = 0;
    bool ready = false;
    // device scratch, allocated by stack_ready
    float2 *rope_cs = nullptr;
    bf16 *x = nullptr, *h = nullptr, *qkv = nullptr, *att = nullptr, *gu = nullptr, *act = nullptr;
    float *partial = nullptr, *io_f32 = nullptr, *logits = nullptr, *attn_stats = nullptr;
    bf16 *attn_scores = nullptr;
    AttnScratch attn;
    void *pf_buf = nullptr; // cuBLAS prefill attention scratch (grown on demand)
    size_t pf_cap = 0;
    mg_row_meta *meta_d = nullptr, *meta_h = nullptr; // meta_h pinned
    int32_t *tok_d = nullptr;
    int max_chunks = 0;
    // decode graphs: (rows, first, last, bucket) -> exec
    std::map<std::tuple<int, int, int, int>, cudaGraphExec_t> graphs;
    KernelSettings ks;     // the backend's, copied at stack_create
    bool graphs_on = true; // ks.graphs, until a capture the driver refuses turns them off
};

namespace {

// ---------- validation helpers ----------

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

template <class T> mg_status dalloc_n(T **p, size_t n, const char *what) {
    return dalloc(reinterpret_cast<void **>(p), n * sizeof(T), what);
}

void clear_graphs(mg_stack *s) {
    for (auto &kv : s->graphs) cudaGraphExecDestroy(kv.second);
    s->graphs.clear();
}

// ---------- the layer pipeline ----------

// One contiguous run of rows of one step inside a chunk.
struct Piece {
    mg_session *sess;
    int row;   // first row within the chunk
    int n;     // rows
    int pos;   // position of the first row
};

mg_status blas_gemm(mg_stack *s, const bf16 *W, const bf16 *X, int n, int m, int k, void *Y, bool f32,
                    float beta) {
    BLAS(gemm(s->blas, W, X, n, m, k, Y, f32, beta), "gemm");
    return MG_OK;
}

// Runs local layer li over rows rows held in s->x. Decode rows read their
// metadata from s->meta_d; prefill pieces pass their cache pointers here.
// max_len bounds every decode row's key count (the attention grid).
mg_status run_layer(mg_stack *s, int li, int rows, const std::vector<Piece> &pieces, int max_len) {
    const mg_stack_config &c = s->cfg;
    const Layer &L = s->layers[li];
    const int H = c.n_heads, KVH = c.n_kv_heads, hd = c.head_dim, D = c.hidden, I = c.intermediate;
    const bool small = rows <= kGemvMaxRows;
    cudaStream_t st = s->st;

    CU(rmsnorm(s->x, L.attn_norm, c.rms_eps, rows, D, s->h, st), "rmsnorm");
    if (small) {
        CU(gemv(kStore, L.wqkv, s->h, rows, s->qkv_dim, D, L.bqkv, s->qkv, nullptr, st), "qkv gemv");
    } else {
        if (L.bqkv) CU(fill_rows(L.bqkv, rows, s->qkv_dim, s->qkv, st), "qkv bias");
        mg_status r = blas_gemm(s, L.wqkv, s->h, rows, s->qkv_dim, D, s->qkv, false, L.bqkv ? 1.f : 0.f);
        if (r != MG_OK) return r;
    }
    CU(rope_append(s->qkv, rows, H, KVH, hd, s->rope_cs, s->meta_d, li, st), "rope");

    // Attention: runs of decode rows (steps with few tokens) go to the
    // split-sequence kernel in groups of <= 16 rows; long steps to prefill.
    int run_start = -1, run_max = 0;
    auto flush = [&](int end) -> mg_status {
        for (int r0 = run_start; r0 < end; r0 += kGemvMaxRows) {
            const int nr = end - r0 < kGemvMaxRows ? end - r0 : kGemvMaxRows;
            CU(attn_decode(s->qkv + (size_t)r0 * s->qkv_dim, s->qkv_dim, s->meta_d + r0, nr, li, H, KVH, hd,
                           max_len > 0 ? max_len : run_max, s->attn, s->att + (size_t)r0 * s->q_dim, st),
               "decode attention");
        }
        run_start = -1;
        run_max = 0;
        return MG_OK;
    };
    for (const Piece &p : pieces) {
        if (p.n < kPrefillMin) {
            if (run_start < 0) run_start = p.row;
            if (p.pos + p.n > run_max) run_max = p.pos + p.n;
            continue;
        }
        if (run_start >= 0) {
            mg_status r = flush(p.row);
            if (r != MG_OK) return r;
        }
        const size_t off = (size_t)li * p.sess->layer_stride;
        const bf16 *q = s->qkv + (size_t)p.row * s->qkv_dim;
        bf16 *o = s->att + (size_t)p.row * s->q_dim;
        const size_t need = attn_prefill_gemm_bytes(p.n, p.pos, H, KVH, hd);
        // cuBLAS by default: 62% of the GEMM rate on 8B at 512 tokens against
        // 40% for the tiled kernel (H200, docs/performance.md); the tiled kernel
        // stays for MG_PREFILL_ATTENTION_TILED and beyond the scratch cap.
        if (!s->attn.f32_softmax && !s->ks.prefill_tiled && need <= kPrefillGemmMax) {
            if (need > s->pf_cap) {
                CU(cudaStreamSynchronize(st), "prefill scratch");
                cudaFree(s->pf_buf);
                s->pf_buf = nullptr;
                s->pf_cap = 0;
                mg_status r = dalloc(&s->pf_buf, need, "prefill attention scratch");
                if (r != MG_OK) return r;
                s->pf_cap = need;
            }
            cublasStatus_t bs;
            CU(attn_prefill_gemm(s->blas, q, s->qkv_dim, p.n, p.pos, p.sess->k + off, p.sess->v + off, H, KVH, hd,
                                 s->pf_buf, o, st, &bs),
               "prefill attention (cublas)");
            if (bs != CUBLAS_STATUS_SUCCESS) return failf(MG_ERR_BACKEND, "cublas: prefill attention: status %d", (int)bs);
        } else {
            CU(attn_prefill(q, s->qkv_dim, p.n, p.pos, p.sess->k + off, p.sess->v + off, H, KVH, hd,
                            s->attn.f32_softmax, o, st),
               "prefill attention");
        }
    }
    if (run_start >= 0) {
        mg_status r = flush(rows);
        if (r != MG_OK) return r;
    }

    if (small) {
        CU(gemv(kResidual, L.wo, s->att, rows, D, s->q_dim, nullptr, s->x, nullptr, st), "o gemv");
    } else {
        // HF rounds the projection to bf16 before the residual add: h is free.
        mg_status r = blas_gemm(s, L.wo, s->att, rows, D, s->q_dim, s->h, false, 0.f);
        if (r != MG_OK) return r;
        CU(add_inplace(s->x, s->h, (size_t)rows * D, st), "residual add");
    }
    CU(rmsnorm(s->x, L.mlp_norm, c.rms_eps, rows, D, s->h, st), "rmsnorm");
    if (small) {
        CU(gemv(kSwiGLU, L.wgu, s->h, rows, I, D, nullptr, s->act, nullptr, st), "gate/up gemv");
        CU(gemv(kResidual, L.wdown, s->act, rows, D, I, nullptr, s->x, nullptr, st), "down gemv");
    } else {
        mg_status r = blas_gemm(s, L.wgu, s->h, rows, 2 * I, D, s->gu, false, 0.f);
        if (r != MG_OK) return r;
        CU(swiglu(s->gu, rows, I, s->act, st), "swiglu");
        r = blas_gemm(s, L.wdown, s->act, rows, D, I, s->h, false, 0.f);
        if (r != MG_OK) return r;
        CU(add_inplace(s->x, s->h, (size_t)rows * D, st), "residual add");
    }
    return MG_OK;
}

mg_status run_layers(mg_stack *s, int l0, int l1, int rows, const std::vector<Piece> &pieces, int max_len) {
    for (int li = l0; li <= l1; li++) {
        mg_status r = run_layer(s, li, rows, pieces, max_len);
        if (r != MG_OK) return r;
    }
    return MG_OK;
}

// Host -> s->x (bf16) for rows rows of dtype.
mg_status load_rows(mg_stack *s, int32_t dtype, const void *in, int rows) {
    const size_t n = (size_t)rows * s->cfg.hidden;
    if (dtype == MG_BF16) {
        CU(cudaMemcpyAsync(s->x, in, n * 2, cudaMemcpyHostToDevice, s->st), "input copy");
    } else {
        CU(cudaMemcpyAsync(s->io_f32, in, n * 4, cudaMemcpyHostToDevice, s->st), "input copy");
        CU(f32_to_bf16(s->io_f32, n, s->x, s->st), "input convert");
    }
    return MG_OK;
}

mg_status store_rows(mg_stack *s, int32_t dtype, const bf16 *src, void *out, int rows) {
    const size_t n = (size_t)rows * s->cfg.hidden;
    if (dtype == MG_BF16) {
        CU(cudaMemcpyAsync(out, src, n * 2, cudaMemcpyDeviceToHost, s->st), "output copy");
    } else {
        CU(bf16_to_f32(src, n, s->io_f32, s->st), "output convert");
        CU(cudaMemcpyAsync(out, s->io_f32, n * 4, cudaMemcpyDeviceToHost, s->st), "output copy");
    }
    return MG_OK;
}

void fill_meta(mg_stack *s, const std::vector<Piece> &pieces) {
    for (const Piece &p : pieces)
        for (int i = 0; i < p.n; i++) {
            mg_row_meta &m = s->meta_h[p.row + i];
            m.k = p.sess->k;
            m.v = p.sess->v;
            m.layer_stride = p.sess->layer_stride;
            m.pos = p.pos + i;
            m.pad = 0;
        }
}

int bucket_for(mg_stack *s, int max_len) {
    int b = 256;
    while (b < max_len) b *= 2;
    return b < s->cfg.max_context ? b : s->cfg.max_context;
}

// Decode with a captured graph: rows single-token steps.
mg_status run_decode_graph(mg_stack *s, int l0, int l1, int rows, const std::vector<Piece> &pieces,
                           int max_len) {
    const int bucket = bucket_for(s, max_len);
    const auto key = std::make_tuple(rows, l0, l1, bucket);
    auto it = s->graphs.find(key);
    if (it == s->graphs.end()) {
        if (s->graphs.size() >= kMaxGraphs) clear_graphs(s);
        cudaGraph_t g = nullptr;
        CU(cudaStreamBeginCapture(s->st, cudaStreamCaptureModeThreadLocal), "graph capture");
        mg_status r = run_layers(s, l0, l1, rows, pieces, bucket);
        cudaError_t e = cudaStreamEndCapture(s->st, &g);
        if (r != MG_OK) {
            if (g) cudaGraphDestroy(g);
            return r;
        }
        if (e != cudaSuccess) return cuda_fail(e, "graph capture");
        cudaGraphExec_t exec = nullptr;
        e = cudaGraphInstantiateWithFlags(&exec, g, 0);
        cudaGraphDestroy(g);
        if (e != cudaSuccess) return cuda_fail(e, "graph instantiate");
        it = s->graphs.emplace(key, exec).first;
    }
    CU(cudaGraphLaunch(it->second, s->st), "graph launch");
    return MG_OK;
}

// ---------- ABI entry points ----------

const char *api_last_error(void) { return g_err; }

mg_status api_backend_open(const mg_backend_options *opts, mg_backend **out) {
    if (!out) return failf(MG_ERR_INVALID_ARGUMENT, "backend_open: out is NULL");
    *out = nullptr;
    KernelSettings ks;
    if (!kernel_settings(opts, &ks) || (opts && opts->threads < 0))
        return failf(MG_ERR_INVALID_ARGUMENT, "backend_open: attention %d, prefill_attention %d, no_graphs %d, threads %d: out of range",
                     opts->attention, opts->prefill_attention, opts->no_graphs, opts->threads);
    const int device = opts ? opts->device : 0; // threads: the CPU backend's
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) return failf(MG_ERR_BACKEND, "cuda: no usable GPU: %s", cudaGetErrorString(e));
    if (device < 0 || device >= count)
        return failf(MG_ERR_INVALID_ARGUMENT, "backend_open: device %d out of range (%d GPUs)", device, count);
    CU(cudaSetDevice(device), "set device");
    CU(cudaFree(nullptr), "context init");
    cudaDeviceProp p;
    CU(cudaGetDeviceProperties(&p, device), "device properties");
    if (p.major < 8)
        return failf(MG_ERR_UNSUPPORTED, "cuda: %s is sm_%d%d; meshgpu needs sm_80 or newer (bf16)", p.name,
                     p.major, p.minor);
    mg_backend *b = new (std::nothrow) mg_backend;
    if (!b) return failf(MG_ERR_OUT_OF_MEMORY, "backend_open: out of host memory");
    b->device = device;
    b->ks = ks;
    snprintf(b->desc, sizeof b->desc, "%s, sm_%d%d, %d SMs, %.0f GiB", p.name, p.major, p.minor,
             p.multiProcessorCount, (double)p.totalGlobalMem / (1024.0 * 1024 * 1024));
    *out = b;
    return MG_OK;
}

void api_backend_close(mg_backend *b) { delete b; }

mg_status api_backend_memory(mg_backend *b, uint64_t *free_bytes, uint64_t *total_bytes) {
    if (!b || !free_bytes || !total_bytes) return failf(MG_ERR_INVALID_ARGUMENT, "backend_memory: NULL argument");
    CU(cudaSetDevice(b->device), "set device");
    size_t f = 0, t = 0;
    CU(cudaMemGetInfo(&f, &t), "memory info");
    *free_bytes = f;
    *total_bytes = t;
    return MG_OK;
}

const char *api_backend_describe(mg_backend *b) { return b ? b->desc : ""; }

mg_status api_host_alloc(mg_backend *b, size_t nbytes, void **out) {
    if (!b || !out) return failf(MG_ERR_INVALID_ARGUMENT, "host_alloc: NULL argument");
    *out = nullptr;
    if (nbytes == 0) return failf(MG_ERR_INVALID_ARGUMENT, "host_alloc: zero bytes");
    CU(cudaSetDevice(b->device), "set device");
    cudaError_t e = cudaHostAlloc(out, nbytes, cudaHostAllocPortable);
    if (e != cudaSuccess) {
        *out = nullptr;
        return failf(MG_ERR_OUT_OF_MEMORY, "cuda: pinned host allocation of %zu bytes: %s", nbytes,
                     cudaGetErrorString(e));
    }
    return MG_OK;
}

void api_host_free(mg_backend *b, void *p) {
    if (b && p) {
        cudaSetDevice(b->device);
        cudaFreeHost(p);
    }
}

void free_stack(mg_stack *s) {
    if (!s) return;
    cudaSetDevice(s->b->device);
    if (s->st) cudaStreamSynchronize(s->st);
    clear_graphs(s);
    for (Layer &L : s->layers) {
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
    cudaFree(s->attn_stats);
    cudaFree(s->io_f32);
    cudaFree(s->logits);
    cudaFree(s->meta_d);
    cudaFree(s->tok_d);
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
    if (s->ready) return MG_OK;
    CU(cudaSetDevice(s->b->device), "set device");
    const size_t R = kChunkRows, D = c.hidden, I = c.intermediate;
    mg_status r = MG_OK;
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
        s->attn.partial = s->partial;
        s->attn.scores = s->attn_scores;
        s->attn.scores_stride = c.max_context;
        s->attn.stats = s->attn_stats;
        if (r == MG_OK) {
            std::vector<float> inv(c.head_dim / 2);
            rope_inv_freq(c.rope_type, c.rope_theta, c.rope_factor, c.rope_low_freq_factor,
                          c.rope_high_freq_factor, c.rope_original_max_pos, c.head_dim, inv.data());
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
    if (s->n_local > 0) {
        const size_t n = (size_t)s->n_local * ss->layer_stride;
        mg_status r = dalloc_n(&ss->k, n, "K cache");
        if (r == MG_OK) r = dalloc_n(&ss->v, n, "V cache");
        if (r != MG_OK) {
            cudaFree(ss->k);
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
    delete ss;
}

int32_t api_session_len(mg_session *ss) { return ss ? ss->len() : -1; }

mg_status api_embed(mg_stack *s, const int32_t *tokens, int32_t n, int32_t dtype, void *out) {
    if (!s) return failf(MG_ERR_INVALID_ARGUMENT, "embed: stack is NULL");
    std::lock_guard<std::mutex> lock(s->mu);
    if (!s->ready) return failf(MG_ERR_INVALID_ARGUMENT, "embed: stack is not ready");
    if (!s->cfg.has_embed) return failf(MG_ERR_INVALID_ARGUMENT, "embed: this stack holds no embedding");
    if (n <= 0 || !tokens || !out) return failf(MG_ERR_INVALID_ARGUMENT, "embed: need n > 0 tokens and an output");
    if (dtype != MG_F32 && dtype != MG_BF16) return failf(MG_ERR_INVALID_ARGUMENT, "embed: dtype must be f32 or bf16");
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= s->cfg.vocab)
            return failf(MG_ERR_INVALID_ARGUMENT, "embed: token %d at %d outside vocab 0..%d", tokens[i], i,
                         s->cfg.vocab - 1);
    CU(cudaSetDevice(s->b->device), "set device");
    const size_t row_bytes = (size_t)s->cfg.hidden * (dtype == MG_F32 ? 4 : 2);
    for (int r0 = 0; r0 < n; r0 += kChunkRows) {
        const int m = n - r0 < kChunkRows ? n - r0 : kChunkRows;
        CU(cudaMemcpyAsync(s->tok_d, tokens + r0, m * sizeof(int32_t), cudaMemcpyHostToDevice, s->st), "tokens");
        CU(mg::embed(s->embed, s->tok_d, m, s->cfg.hidden, s->x, s->st), "embed");
        mg_status r = store_rows(s, dtype, s->x, (char *)out + r0 * row_bytes, m);
        if (r != MG_OK) return r;
        CU(cudaStreamSynchronize(s->st), "embed");
    }
    return MG_OK;
}

mg_status api_forward(mg_stack *s, const mg_step *steps, int32_t n_steps, int32_t first_layer, int32_t last_layer,
                      int32_t dtype, const void *in, void *out) {
    const uint64_t t_enter = now_ns();
    if (!s) return failf(MG_ERR_INVALID_ARGUMENT, "forward: stack is NULL");
    std::lock_guard<std::mutex> lock(s->mu);
    const mg_stack_config &c = s->cfg;
    if (!s->ready) return failf(MG_ERR_INVALID_ARGUMENT, "forward: stack is not ready");
    if (s->n_local == 0) return failf(MG_ERR_INVALID_ARGUMENT, "forward: this stack holds no layers");
    if (first_layer < c.first_layer || last_layer > c.last_layer || first_layer > last_layer)
        return failf(MG_ERR_INVALID_ARGUMENT, "forward: layers %d..%d outside this stack's %d..%d", first_layer,
                     last_layer, c.first_layer, c.last_layer);
    if (dtype != MG_F32 && dtype != MG_BF16) return failf(MG_ERR_INVALID_ARGUMENT, "forward: dtype must be f32 or bf16");
    if (!steps || n_steps <= 0 || n_steps > 65536 || !in || !out)
        return failf(MG_ERR_INVALID_ARGUMENT, "forward: need 1..65536 steps, input and output");
    const int l0 = first_layer - c.first_layer, l1 = last_layer - c.first_layer;
    long long total = 0;
    for (int i = 0; i < n_steps; i++) {
        const mg_step &st = steps[i];
        if (!st.session || st.session->s != s)
            return failf(MG_ERR_INVALID_ARGUMENT, "forward: step %d: session is NULL or from another stack", i);
        for (int j = 0; j < i; j++)
            if (steps[j].session == st.session)
                return failf(MG_ERR_INVALID_ARGUMENT, "forward: steps %d and %d name the same session", j, i);
        if (st.n_tokens <= 0) return failf(MG_ERR_INVALID_ARGUMENT, "forward: step %d: n_tokens %d", i, st.n_tokens);
        if (st.pos < 0) return failf(MG_ERR_INVALID_ARGUMENT, "forward: step %d: negative position %d", i, st.pos);
        const int32_t slen = st.session->len();
        for (int l = l0; l <= l1; l++) {
            const int32_t have = st.session->layer_len[l];
            if (st.pos > have && have < slen)
                return failf(MG_ERR_INVALID_ARGUMENT,
                             "forward: step %d: position %d, but layer %d holds only %d positions (earlier calls skipped it)",
                             i, st.pos, l + c.first_layer, have);
            if (st.pos > have)
                return failf(MG_ERR_INVALID_ARGUMENT, "forward: step %d: position %d beyond the session length %d", i,
                             st.pos, have);
        }
        if ((long long)st.pos + st.n_tokens > st.session->max_tokens)
            return failf(MG_ERR_CAPACITY, "forward: step %d: positions up to %lld exceed the session's %d tokens", i,
                         (long long)st.pos + st.n_tokens, st.session->max_tokens);
        total += st.n_tokens;
    }
    if (total > (1 << 24)) return failf(MG_ERR_INVALID_ARGUMENT, "forward: %lld rows is too many", total);
    CU(cudaSetDevice(s->b->device), "set device");
    // Truncate first (a retried hop); on failure the range stays at pos.
    for (int i = 0; i < n_steps; i++)
        for (int l = l0; l <= l1; l++) steps[i].session->layer_len[l] = steps[i].pos;
    uint64_t t_enqueued = 0, t_synced = 0; // host-time accounting (decode path)

    const size_t row_bytes = (size_t)c.hidden * (dtype == MG_F32 ? 4 : 2);
    mg_status r = MG_OK;

    bool all_single = n_steps <= kGemvMaxRows;
    for (int i = 0; i < n_steps && all_single; i++) all_single = steps[i].n_tokens == 1;
    if (all_single) {
        std::vector<Piece> pieces;
        int max_len = 0;
        for (int i = 0; i < n_steps; i++) {
            pieces.push_back({steps[i].session, i, 1, steps[i].pos});
            if (steps[i].pos + 1 > max_len) max_len = steps[i].pos + 1;
        }
        fill_meta(s, pieces);
        bool ran = false;
        cudaError_t e = cudaMemcpyAsync(s->meta_d, s->meta_h, n_steps * sizeof(mg_row_meta), cudaMemcpyHostToDevice, s->st);
        if (e != cudaSuccess) r = cuda_fail(e, "row metadata");
        if (r == MG_OK) r = load_rows(s, dtype, in, n_steps);
        if (r == MG_OK && s->graphs_on) {
            r = run_decode_graph(s, l0, l1, n_steps, pieces, max_len);
            if (r != MG_OK) {
                // A capture the driver refuses must not take decode down:
                // log once, run without graphs from now on.
                fprintf(stderr, "meshgpu cuda: CUDA graphs disabled for this stack: %s\n", g_err);
                cudaGetLastError();
                s->graphs_on = false;
                r = MG_OK;
            } else {
                ran = true;
            }
        }
        if (r == MG_OK && !ran) r = run_layers(s, l0, l1, n_steps, pieces, 0);
        if (r == MG_OK) r = store_rows(s, dtype, s->x, out, n_steps);
        t_enqueued = now_ns();
        if (r == MG_OK) {
            e = cudaStreamSynchronize(s->st);
            if (e != cudaSuccess) r = cuda_fail(e, "forward");
        }
        t_synced = now_ns();
    } else {
        // Pack steps into chunks of <= kChunkRows rows; a long step spans
        // several chunks, run in order so later chunks see earlier keys.
        struct Part { int step, tok0, n; long long in_row; };
        std::vector<Part> parts;
        long long in_row = 0;
        for (int i = 0; i < n_steps; i++) {
            for (int t = 0; t < steps[i].n_tokens; t += kChunkRows) {
                const int m = steps[i].n_tokens - t < kChunkRows ? steps[i].n_tokens - t : kChunkRows;
                parts.push_back({i, t, m, in_row + t});
            }
            in_row += steps[i].n_tokens;
        }
        size_t pi = 0;
        while (pi < parts.size() && r == MG_OK) {
            std::vector<Piece> pieces;
            std::vector<Part> used;
            int rows = 0;
            while (pi < parts.size() && rows + parts[pi].n <= kChunkRows) {
                const Part &p = parts[pi];
                // A later part of a step already in this chunk must wait.
                bool clash = false;
                for (const Part &u : used) clash |= u.step == p.step;
                if (clash) break;
                pieces.push_back({steps[p.step].session, rows, p.n, steps[p.step].pos + p.tok0});
                used.push_back(p);
                rows += p.n;
                pi++;
            }
            fill_meta(s, pieces);
            cudaError_t e = cudaMemcpyAsync(s->meta_d, s->meta_h, rows * sizeof(mg_row_meta), cudaMemcpyHostToDevice, s->st);
            if (e != cudaSuccess) r = cuda_fail(e, "row metadata");
            // Input rows of a chunk are contiguous per part, not across parts.
            for (size_t i = 0; i < used.size() && r == MG_OK; i++) {
                const size_t n = (size_t)used[i].n * c.hidden;
                const char *src = (const char *)in + used[i].in_row * row_bytes;
                if (dtype == MG_BF16) {
                    e = cudaMemcpyAsync(s->x + (size_t)pieces[i].row * c.hidden, src, n * 2, cudaMemcpyHostToDevice, s->st);
                } else {
                    e = cudaMemcpyAsync(s->io_f32 + (size_t)pieces[i].row * c.hidden, src, n * 4, cudaMemcpyHostToDevice, s->st);
                }
                if (e != cudaSuccess) r = cuda_fail(e, "input copy");
            }
            if (r == MG_OK && dtype == MG_F32) {
                e = f32_to_bf16(s->io_f32, (size_t)rows * c.hidden, s->x, s->st);
                if (e != cudaSuccess) r = cuda_fail(e, "input convert");
            }
            if (r == MG_OK) r = run_layers(s, l0, l1, rows, pieces, 0);
            if (r == MG_OK && dtype == MG_F32) {
                e = bf16_to_f32(s->x, (size_t)rows * c.hidden, s->io_f32, s->st);
                if (e != cudaSuccess) r = cuda_fail(e, "output convert");
            }
            for (size_t i = 0; i < used.size() && r == MG_OK; i++) {
                const size_t n = (size_t)used[i].n * c.hidden;
                char *dst = (char *)out + used[i].in_row * row_bytes;
                if (dtype == MG_BF16) {
                    e = cudaMemcpyAsync(dst, s->x + (size_t)pieces[i].row * c.hidden, n * 2, cudaMemcpyDeviceToHost, s->st);
                } else {
                    e = cudaMemcpyAsync(dst, s->io_f32 + (size_t)pieces[i].row * c.hidden, n * 4, cudaMemcpyDeviceToHost, s->st);
                }
                if (e != cudaSuccess) r = cuda_fail(e, "output copy");
            }
            if (r == MG_OK) {
                e = cudaStreamSynchronize(s->st);
                if (e != cudaSuccess) r = cuda_fail(e, "forward");
            }
        }
    }
    if (r != MG_OK) {
        cudaStreamSynchronize(s->st);
        return r; // lengths stay truncated to pos: the caller retries from there
    }
    for (int i = 0; i < n_steps; i++)
        for (int l = l0; l <= l1; l++) steps[i].session->layer_len[l] = steps[i].pos + steps[i].n_tokens;
    g_fwd_host_ns = t_enqueued ? (t_enqueued - t_enter) + (now_ns() - t_synced) : 0;
    return MG_OK;
}

mg_status api_logits(mg_stack *s, int32_t n_rows, int32_t dtype, const void *in, float *out) {
    if (!s) return failf(MG_ERR_INVALID_ARGUMENT, "logits: stack is NULL");
    std::lock_guard<std::mutex> lock(s->mu);
    const mg_stack_config &c = s->cfg;
    if (!s->ready) return failf(MG_ERR_INVALID_ARGUMENT, "logits: stack is not ready");
    if (!c.has_head) return failf(MG_ERR_INVALID_ARGUMENT, "logits: this stack holds no LM head");
    if (n_rows <= 0 || !in || !out) return failf(MG_ERR_INVALID_ARGUMENT, "logits: need n_rows > 0, input and output");
    if (dtype != MG_F32 && dtype != MG_BF16) return failf(MG_ERR_INVALID_ARGUMENT, "logits: dtype must be f32 or bf16");
    CU(cudaSetDevice(s->b->device), "set device");
    const size_t row_bytes = (size_t)c.hidden * (dtype == MG_F32 ? 4 : 2);
    for (int r0 = 0; r0 < n_rows; r0 += kLogitRows) {
        const int m = n_rows - r0 < kLogitRows ? n_rows - r0 : kLogitRows;
        mg_status r = load_rows(s, dtype, (const char *)in + r0 * row_bytes, m);
        if (r != MG_OK) return r;
        CU(rmsnorm(s->x, s->final_norm, c.rms_eps, m, c.hidden, s->h, s->st), "final norm");
        if (m <= kGemvMaxRows) {
            CU(gemv(kF32, s->lm_head, s->h, m, c.vocab, c.hidden, nullptr, nullptr, s->logits, s->st), "lm head");
        } else {
            r = blas_gemm(s, s->lm_head, s->h, m, c.vocab, c.hidden, s->logits, true, 0.f);
            if (r != MG_OK) return r;
            CU(round_to_bf16(s->logits, (size_t)m * c.vocab, s->st), "logits");
        }
        CU(cudaMemcpyAsync(out + (size_t)r0 * c.vocab, s->logits, (size_t)m * c.vocab * 4, cudaMemcpyDeviceToHost, s->st),
           "logits copy");
        CU(cudaStreamSynchronize(s->st), "logits");
    }
    return MG_OK;
}

const mg_api kApi = {
    MG_ABI_VERSION,
    "cuda",
    api_last_error,
    api_backend_open,
    api_backend_close,
    api_backend_memory,
    api_backend_describe,
    api_host_alloc,
    api_host_free,
    api_stack_create,
    api_stack_set_tensor,
    api_stack_ready,
    api_stack_free,
    api_session_create,
    api_session_free,
    api_session_len,
    api_embed,
    api_forward,
    api_logits,
};

} // namespace

namespace mg {
uint64_t last_forward_host_ns() { return g_fwd_host_ns; }
} // namespace mg

extern "C" MG_EXPORT const mg_api *mg_cuda_api(int32_t abi_version) {
    if (abi_version != MG_ABI_VERSION) {
        snprintf(g_err, sizeof g_err, "libmeshgpu_cuda: ABI version %d requested, library has %d", abi_version,
                 MG_ABI_VERSION);
        return nullptr;
    }
    return &kApi;
}

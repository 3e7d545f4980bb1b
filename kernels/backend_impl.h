// backend_impl.h: what the CUDA backend's files share (backend.cu: the ABI
// table and the backend; backend_stack.cu: stacks, weights and sessions;
// backend_forward.cu: embed, forward with its row packing, logits;
// backend_quant.cu: the projections on quantized weights;
// backend_graphs.cu: the decode CUDA graphs). Not included by ops.cu, which
// shares only backend.h and dispatch.h.
#pragma once

#include <cublas_v2.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "../native/meshgpu.h"
#include "backend.h"
#include "dispatch.h"
#include "kernels.h"

namespace mgcuda {

using namespace mg;

// The calling thread's last error (api_last_error), set by failf.
extern thread_local char g_err[512];

mg_status failf(mg_status s, const char *fmt, ...);
mg_status cuda_fail(cudaError_t e, const char *what);

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
constexpr size_t kMaxGraphs = 64;   // captured decode graphs kept per stack

// A block-quantized matrix as the file's blocks in device memory.
struct QMat {
    void *data = nullptr;
    int32_t dtype = -1;
    int rows = 0, cols = 0;
    size_t bytes = 0;
};

struct Layer {
    bf16 *attn_norm = nullptr, *wqkv = nullptr, *bqkv = nullptr, *wo = nullptr;
    bf16 *mlp_norm = nullptr, *wgu = nullptr, *wdown = nullptr;
    uint32_t set = 0; // bit per tensor kind
    // Quantized matrices by kind (wq..w_down), each its own blocks; a layer
    // runs on them when all seven are quantized (quant, set by stack_ready).
    QMat qm[MG_TENSOR_KIND_COUNT];
    bool quant = false;
};

} // namespace mgcuda

struct mg_backend {
    int device = 0;
    char desc[256] = {0};
    mg::KernelSettings ks; // from backend_open's options; each stack copies them
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
    // The token history (meshgpu.h mg_token_step) in device memory:
    // max_tokens + 1 ids, the first hist_len valid; the sampler writes its
    // pick at hist_len - 1 on the device.
    int32_t *hist = nullptr;
    int32_t hist_len = 0;
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
    std::vector<mgcuda::Layer> layers;
    bf16 *embed = nullptr, *final_norm = nullptr, *lm_head = nullptr;
    bool head_tied = false;               // lm_head aliases embed
    // Quantized embedding and LM head (data null when float); qhead may
    // alias qembed (qhead_tied) when their blocks are the same bytes.
    mgcuda::QMat qembed, qhead;
    bool qhead_tied = false;
    // quantized matrix-vector activations (kGemvMaxRows rows) and the bf16
    // chunk prefill dequantizes into (deq_elems), allocated by stack_ready
    int8_t *xq = nullptr;
    float *xd = nullptr;
    bf16 *deq = nullptr;
    size_t deq_elems = 0;
    int32_t embed_dtype = -1;             // dtype and size the embedding was set with
    size_t embed_bytes = 0;
    uint32_t global_set = 0;
    bool ready = false;
    // device scratch, allocated by stack_ready
    float2 *rope_cs = nullptr;
    bf16 *x = nullptr, *h = nullptr, *qkv = nullptr, *att = nullptr, *gu = nullptr, *act = nullptr;
    float *partial = nullptr, *io_f32 = nullptr, *logits = nullptr, *attn_stats = nullptr;
    bf16 *attn_scores = nullptr;
    unsigned *attn_arrivals = nullptr; // fused decode attention's counts (ks.fused_decode)
    mg::AttnScratch attn;
    void *pf_buf = nullptr; // cuBLAS prefill attention scratch (grown on demand)
    size_t pf_cap = 0;
    uint8_t *tree_mask = nullptr; // a chunk's token-tree masks (backend_tree.cu; grown on demand)
    size_t tree_mask_cap = 0;
    mg_row_meta *meta_d = nullptr, *meta_h = nullptr; // meta_h pinned
    int32_t *tok_d = nullptr;
    int max_chunks = 0;
    // decode graphs: (rows, first, last, bucket, ends) -> exec
    std::map<std::tuple<int, int, int, int, int>, cudaGraphExec_t> graphs;
    // The ends (backend_ends.cu): sampler scratch (head stacks), the last
    // row of each step of a long call, per-row results (device and pinned).
    void *samp_mem = nullptr;
    mg::SampleScratch samp;
    bf16 *last_rows = nullptr;
    int last_cap = 0;
    mg_sample_result *res_d = nullptr, *res_h = nullptr;
    // Per-row non-finite flags of the logits (device and pinned): a row
    // holding NaN or +Inf fails the call (MG_ERR_NON_FINITE).
    int32_t *bad_d = nullptr, *bad_h = nullptr;
    // Pinned staging for a call's token ids: a copy from pageable memory
    // would wait for the stream (the whole forward) before it starts.
    int32_t *tok_h = nullptr;
    size_t tok_cap = 0;
    mg::KernelSettings ks; // the backend's, copied at stack_create
    bool graphs_on = true; // ks.graphs, until a capture the driver refuses turns them off
};

namespace mgcuda {

// ---- backend_stack.cu ----
// cudaMalloc into *p unless it already holds memory; OUT_OF_MEMORY names what.
mg_status dalloc(void **p, size_t bytes, const char *what);
template <class T> mg_status dalloc_n(T **p, size_t n, const char *what) {
    return dalloc(reinterpret_cast<void **>(p), n * sizeof(T), what);
}
void free_stack(mg_stack *s);
mg_status api_stack_create(mg_backend *b, const mg_stack_config *cfg, mg_stack **out);
mg_status api_stack_set_tensor(mg_stack *s, int32_t kind, int32_t layer, int32_t dtype, const int64_t *shape,
                               int32_t ndim, const void *data, size_t nbytes);
mg_status api_stack_ready(mg_stack *s);
void api_stack_free(mg_stack *s);
mg_status api_session_create(mg_stack *s, int32_t max_tokens, mg_session **out);
void api_session_free(mg_session *ss);
int32_t api_session_len(mg_session *ss);

// ---- backend_forward.cu ----
// One contiguous run of rows of one step inside a chunk.
struct Piece {
    mg_session *sess;
    int row;   // first row within the chunk
    int n;     // rows
    int pos;   // position of the first row
    // A token tree's rows (meshgpu.h mg_tree_step), a whole step: parents
    // (host, n entries) and its [n][n] ancestor mask on the device; both
    // null for a chain.
    const int32_t *parents = nullptr;
    const uint8_t *mask = nullptr;
};
// Runs local layers l0..l1 over rows rows held in s->x (run_layer, per layer).
mg_status run_layers(mg_stack *s, int l0, int l1, int rows, const std::vector<Piece> &pieces, int max_len);
mg_status api_embed(mg_stack *s, const int32_t *tokens, int32_t n, int32_t dtype, void *out);
mg_status api_forward(mg_stack *s, const mg_step *steps, int32_t n_steps, int32_t first_layer, int32_t last_layer,
                      int32_t dtype, const void *in, void *out);
mg_status api_logits(mg_stack *s, int32_t n_rows, int32_t dtype, const void *in, float *out);

// forward's body with the stack locked, its arguments checked. Rows come
// from the host (tokens == nullptr: in, dtype) or are embedded from tokens
// (host, concatenated); they go to the host (last == nullptr: out, dtype)
// or stay on the device: *last points at each step's last row, n_steps
// rows of hidden bf16, valid until the stack's next call. The decode path
// (all steps single tokens) does not wait for the stream when they stay.
struct FwdIo {
    const int32_t *tokens = nullptr;
    int32_t dtype = MG_BF16;
    const void *in = nullptr;
    void *out = nullptr;
    const bf16 **last = nullptr;
    // With last: a tail asks for the final norm and LM head of the rows into
    // s->logits; *head_done says whether the decode graph ran them (fused_decode).
    bool *head_done = nullptr;
    // forward_tree: parents[i] is step i's tree (checked, at most
    // MG_MAX_TREE_ROWS rows) or null (a chain); null: all chains.
    const int32_t *const *parents = nullptr;
};
// The host-time accounting hop_host_ns reports (meshgpu_ops.h).
uint64_t host_now_ns();
void note_hop_host_ns(uint64_t ns);
mg_status check_steps(mg_stack *s, const char *op, const mg_step *steps, int32_t n_steps, int l0, int l1);
mg_status forward_locked(mg_stack *s, const mg_step *steps, int32_t n_steps, int l0, int l1, const FwdIo &io);
mg_status api_head_forward(mg_stack *s, const mg_token_step *steps, int32_t n_steps, int32_t last_layer, int32_t dtype,
                           void *out);
mg_status api_tail_forward(mg_stack *s, const mg_token_step *steps, int32_t n_steps, int32_t first_layer, int32_t dtype,
                           const void *in);
mg_status api_decode(mg_stack *s, const mg_token_step *steps, int32_t n_steps);
// The final norm and LM head of m rows x (device) into s->logits (f32).
mg_status head_logits(mg_stack *s, const bf16 *x, int m);

// ---- backend_tree.cu: token trees (meshgpu.h forward_tree, session_compact) ----
mg_status api_forward_tree(mg_stack *s, const mg_tree_step *steps, int32_t n_steps, int32_t first_layer,
                           int32_t last_layer, int32_t dtype, const void *in, void *out);
mg_status api_session_compact(mg_session *ss, int32_t dst, const int32_t *src, int32_t n);
// Uploads the ancestor masks of the chunk's tree pieces to s->tree_mask
// and points each piece's mask at its own.
mg_status upload_tree_masks(mg_stack *s, std::vector<Piece> &pieces);

// ---- backend_quant.cu: the quantized projections ----
// Frees a QMat's device memory.
void qmat_free(QMat &q);
// Decode (rows <= kGemvMaxRows): out[r * ldo + ...] = epi(x_r . rows of
// mats[0..nm-1], their rows back to back as output columns), x rmsnorm'ed
// by norm_w first when not null; kSwiGLU: mats = {gate}, up the up rows.
mg_status qmv(mg_stack *s, int epi, const QMat *const *mats, int nm, const QMat *up, const bf16 *x, const bf16 *norm_w,
              int rows, const bf16 *bias, bf16 *out, float *out_f32, int ldo);
// Prefill: Y[:, cols of mats back to back] (row stride ldy) = X [rows, k] @
// mats^T + beta * Y, each matrix dequantized to bf16 in row chunks of
// s->deq and multiplied by cuBLAS.
mg_status qmm(mg_stack *s, const QMat *const *mats, int nm, const bf16 *X, int rows, void *Y, int ldy, bool y_f32,
              float beta);
// The final norm and LM head of m rows x (bf16, on the device) into
// s->logits when the head is quantized.
mg_status qhead_logits(mg_stack *s, const bf16 *x, int m);
// The embedding of n device token ids into out (float or quantized table).
cudaError_t embed_rows(mg_stack *s, const int32_t *tokens, int n, bf16 *out);

// ---- backend_graphs.cu ----
// Frees every captured graph of s (weights changed, or too many kept).
void clear_graphs(mg_stack *s);
// What a decode graph holds besides the layers (fused_decode): the embedding
// of s->tok_d into s->x before them, the final norm and LM head into
// s->logits after them.
enum { kGraphEmbed = 1, kGraphHead = 2 };
// Decode with a captured graph: rows single-token steps, ends kGraph* bits.
mg_status run_decode_graph(mg_stack *s, int l0, int l1, int rows, const std::vector<Piece> &pieces,
                           int max_len, int ends);

} // namespace mgcuda

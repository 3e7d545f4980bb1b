/*
 * meshgpu.h: the only door between Go and native code.
 *
 * Two implementations export the same function table (mg_api):
 *   - the CPU backend, C compiled into the binary by cgo (mg_cpu_api), the
 *     reference every CUDA op is tested against;
 *   - the CUDA backend, libmeshgpu_cuda.so, loaded at run time with dlopen and
 *     found through the symbol MG_CUDA_ENTRY.
 *
 * No CUDA types appear here. Handles are opaque. Sizes are size_t. Every call
 * that can fail returns mg_status; the message of the last failure on the
 * calling thread is api->last_error().
 *
 * Granularity: Go asks for "embed these tokens", "run layers a..b for these
 * sessions at these positions", "final norm + logits", never one kernel, so a
 * backend may fuse kernels and capture graphs. forward() takes several
 * sessions at once (batched decode): rows of all steps are concatenated.
 *
 * Activations cross as row-major [rows, hidden] arrays in host memory, in
 * MG_F32 or MG_BF16. Buffers from host_alloc are pinned on CUDA, so Go can
 * read and write them as []byte without a copy.
 *
 * Threads: calls on one stack and its sessions must not overlap (the caller
 * serializes them; native/binding.go does); calls on different stacks and
 * backends may run on different threads at once.
 */
#ifndef MESHGPU_H
#define MESHGPU_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 3: the ends of the mesh in one call each (head_forward, tail_forward,
 * decode) with sampling in the backend; table_size.
 * 4: mg_stack_config.rope_freq_factors.
 * 5: mg_backend_options.fused_decode; later appended calls (found through
 * table_size, so libraries built before them keep loading):
 * forward_tree, session_compact. */
#define MG_ABI_VERSION 5
#define MG_CUDA_ENTRY "mg_cuda_api"

typedef enum mg_status {
    MG_OK = 0,
    MG_ERR_INVALID_ARGUMENT = 1, /* wrong shape, dtype, layer, position */
    MG_ERR_OUT_OF_MEMORY = 2,    /* device or host allocation failed */
    MG_ERR_CAPACITY = 3,         /* session KV cache full */
    MG_ERR_UNSUPPORTED = 4,      /* feature not in this backend */
    MG_ERR_BACKEND = 5,          /* driver/runtime failure, no device, ... */
    MG_ERR_NON_FINITE = 6        /* (appended to ABI 5) tail_forward, decode: the logits hold NaN or +Inf */
} mg_status;

/* Element types. Activations are MG_F32 or MG_BF16. Weights may also be
 * ggml's block-quantized types (numbered as ggml numbers them), stored as the
 * GGUF file's blocks: a [rows, cols] matrix whose cols are a whole number of
 * blocks, row r at r * row_bytes, row_bytes = cols / block_elems *
 * block_bytes. Only matrices (and the embedding table) may be quantized;
 * norms and biases are float. A backend without kernels for a type refuses
 * it in stack_set_tensor with MG_ERR_UNSUPPORTED.
 *   MG_Q8_0: 32 weights, 34 bytes: f16 d, int8 q[32]; w = d * q.
 *   MG_Q4_K: 256 weights, 144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit
 *            scales and mins of 8 sub-blocks of 32, 128 bytes of 4-bit q;
 *            w = d * sc * q - dmin * m.
 *   MG_Q5_K: 256 weights, 176 bytes: as Q4_K plus 32 bytes of fifth bits.
 *   MG_Q6_K: 256 weights, 210 bytes: 128 bytes of low 4 bits, 64 of high 2
 *            bits, int8 scales of 16 sub-blocks of 16, f16 d;
 *            w = d * sc * (q - 32). */
typedef enum mg_dtype {
    MG_F32 = 0,
    MG_F16 = 1,
    MG_BF16 = 2,
    MG_Q8_0 = 8,
    MG_Q4_K = 12,
    MG_Q5_K = 13,
    MG_Q6_K = 14
} mg_dtype;

/* Tensor roles, in HF Llama layout. Matrices are [out_features, in_features]
 * row-major, as nn.Linear stores them. Per-layer kinds take a global layer
 * index; whole-model kinds take layer = -1. */
typedef enum mg_tensor_kind {
    MG_TOK_EMBED = 0,  /* [vocab, hidden] */
    MG_FINAL_NORM = 1, /* [hidden] */
    MG_LM_HEAD = 2,    /* [vocab, hidden]; pass the embedding when tied */
    MG_ATTN_NORM = 3,  /* [hidden] */
    MG_WQ = 4,         /* [n_heads*head_dim, hidden] */
    MG_WK = 5,         /* [n_kv_heads*head_dim, hidden] */
    MG_WV = 6,         /* [n_kv_heads*head_dim, hidden] */
    MG_BQ = 7,         /* [n_heads*head_dim] (qkv_bias only) */
    MG_BK = 8,         /* [n_kv_heads*head_dim] */
    MG_BV = 9,         /* [n_kv_heads*head_dim] */
    MG_WO = 10,        /* [hidden, n_heads*head_dim] */
    MG_MLP_NORM = 11,  /* [hidden] (post_attention_layernorm) */
    MG_W_GATE = 12,    /* [intermediate, hidden] */
    MG_W_UP = 13,      /* [intermediate, hidden] */
    MG_W_DOWN = 14,    /* [hidden, intermediate] */
    MG_TENSOR_KIND_COUNT = 15
} mg_tensor_kind;

typedef enum mg_rope_type {
    MG_ROPE_DEFAULT = 0,
    MG_ROPE_LLAMA3 = 1
} mg_rope_type;

#define MG_MAX_ROPE_FACTORS 512 /* head_dim / 2 for head_dim up to 1024 */

typedef struct mg_stack_config {
    int32_t hidden;
    int32_t intermediate;
    int32_t n_heads;
    int32_t n_kv_heads;
    int32_t head_dim;
    int32_t vocab;
    int32_t n_layers;    /* layers in the whole model */
    int32_t first_layer; /* layers held: first..last inclusive; */
    int32_t last_layer;  /* last < first holds no layers */
    int32_t has_embed;   /* holds MG_TOK_EMBED */
    int32_t has_head;    /* holds MG_FINAL_NORM and MG_LM_HEAD */
    int32_t qkv_bias;    /* q/k/v projections have biases (Qwen2) */
    int32_t max_context; /* upper bound for any session's max_tokens */
    float rms_eps;
    int32_t rope_type; /* mg_rope_type */
    float rope_theta;
    float rope_factor;           /* llama3 only */
    float rope_low_freq_factor;  /* llama3 only */
    float rope_high_freq_factor; /* llama3 only */
    int32_t rope_original_max_pos; /* llama3 only */
    /* ABI 4: divisors of the rotary frequencies, one per pair of head
     * dimensions (a GGUF file's rope_freqs tensor, how llama.cpp's files
     * carry llama3 scaling), applied after rope_type's own scaling; all
     * zero = none. Otherwise the first head_dim/2 must be positive. */
    float rope_freq_factors[MG_MAX_ROPE_FACTORS];
} mg_stack_config;

/* Attention numerics (mg_backend_options.attention). */
typedef enum mg_attention {
    MG_ATTENTION_HF_BF16 = 0, /* PyTorch's math SDPA in bf16, as HF transformers computes it */
    MG_ATTENTION_F32 = 1      /* flash-style: f32 scores and online softmax, P rounded to bf16 */
} mg_attention;

/* The prefill attention kernel (mg_backend_options.prefill_attention). */
typedef enum mg_prefill_attention {
    MG_PREFILL_ATTENTION_AUTO = 0, /* cuBLAS while its scratch fits in 1 GiB, else the tiled kernel */
    MG_PREFILL_ATTENTION_TILED = 1 /* always the tiled kernel */
} mg_prefill_attention;

/* What backend_open configures; all zeros is every default. The caller
 * owns configuration (meshgpu's flags, docs/cuda-settings.md): no backend
 * reads the environment. Every backend accepts every field, ignores those
 * that do not apply to it (cpu: device, attention, prefill_attention and
 * no_graphs, its attention being f32 math; cuda: threads) and refuses
 * values outside their ranges with MG_ERR_INVALID_ARGUMENT. */
typedef struct mg_backend_options {
    int32_t device;            /* GPU ordinal */
    int32_t threads;           /* CPU threads; 0 = all cores */
    int32_t attention;         /* mg_attention */
    int32_t prefill_attention; /* mg_prefill_attention */
    int32_t no_graphs;         /* 1: decode without CUDA graphs; 0: capture them */
    int32_t batch_mma;         /* ABI 3. 1: decode matrix-vectors (1-16 rows) on tensor-core tiles; 0: FMA kernels */
    int32_t fused_decode;      /* ABI 5. 1: single-token steps: RoPE + KV append inside decode attention, embedding and final norm + LM head inside the decode graph; 0: separate */
} mg_backend_options;

typedef struct mg_backend mg_backend;
typedef struct mg_stack mg_stack;
typedef struct mg_session mg_session;

/* One sequence's part of a forward() call: n_tokens rows at positions
 * pos..pos+n_tokens-1. pos must be <= the session's length; a smaller pos
 * first truncates the cache to pos (so a retried hop is idempotent). */
typedef struct mg_step {
    mg_session *session;
    int32_t pos;
    int32_t n_tokens;
} mg_step;

/* A forward_tree step: a token tree in n_tokens rows (a verify pass with
 * branching drafts). parents[i] is row i's parent row (0 <= parents[i] < i)
 * or -1 for a root; NULL makes every row the child of the one before (a
 * plain mg_step). Row i runs at RoPE position pos + depth(i) (a root has
 * depth 0) and attends to the cached positions 0..pos-1 and to its own
 * ancestors and itself, no other row; its K/V land in cache slot pos + i, so
 * after the call the session holds pos + n_tokens slots, and a branch that
 * is kept is moved to consecutive slots with session_compact. */
#define MG_MAX_TREE_ROWS 256

typedef struct mg_tree_step {
    mg_session *session;
    int32_t pos;
    int32_t n_tokens;
    const int32_t *parents; /* n_tokens entries, or NULL */
} mg_tree_step;

/* ---- Sampling in the backend (ABI 3) ----
 * The same semantics as Go's meshgpu/sample (sample.Choose), bit for bit on
 * the same logits: penalties (repetition over the whole history, then
 * presence/frequency over history[generated_from:]), then greedy, or
 * temperature + top-k + top-p + min-p and a draw that is a pure function of
 * (seed, draw). Probabilities are float64 e^x computed as sample.expNeg
 * does; sums over the vocabulary are 256 fixed chunks summed in index order,
 * then the chunk sums in order; candidates sort by (probability desc, id
 * asc). */
#define MG_MAX_TOP_LOGPROBS 20

typedef struct mg_sample_params {
    double temperature;        /* 0 = greedy */
    double top_p;              /* 0 or 1 = off */
    double min_p;              /* 0 = off */
    double repetition_penalty; /* 0 or 1 = off */
    double presence_penalty;   /* OpenAI, over generated tokens */
    double frequency_penalty;  /* OpenAI, over generated tokens */
    uint64_t seed;
    int32_t top_k;        /* 0 = off */
    int32_t top_logprobs; /* 0..MG_MAX_TOP_LOGPROBS */
    int32_t logprobs;     /* 1: also the chosen id's model_logprob (implied by top_logprobs > 0) */
    int32_t reserved;
} mg_sample_params;

typedef struct mg_sample_result {
    int32_t id;
    float logprob; /* under the final distribution (sample.Choose) */
    /* With logprobs or top_logprobs (else 0): the log-softmax of the
     * penalized logits at id, and its n_top most likely entries (0 when that
     * distribution is not finite). */
    float model_logprob;
    int32_t n_top;
    int32_t top_ids[MG_MAX_TOP_LOGPROBS];
    float top_logprobs[MG_MAX_TOP_LOGPROBS];
} mg_sample_result;

/* One sequence's part of a head_forward/tail_forward/decode call: n_tokens
 * rows at positions pos.. (as mg_step), with the token ids and sampling.
 *
 * A session keeps its token history in the backend (device memory on CUDA):
 * the ids at positions 0..len-1 and, after a tail or decode call, the id it
 * sampled at position pos+n_tokens. tokens, when not NULL, are the ids at
 * pos..pos+n_tokens-1 (pos <= the history length; later ones are dropped);
 * NULL means "the ids the history already holds" (a tail feeding back its
 * own sample: pos+n_tokens <= the history length). head_forward needs
 * tokens; it records nothing. */
typedef struct mg_token_step {
    mg_session *session;
    int32_t pos;
    int32_t n_tokens;
    const int32_t *tokens;  /* n_tokens ids, or NULL (tail) */
    int32_t generated_from; /* history[generated_from:] are the generated ids */
    int32_t reserved;
    int64_t draw;             /* the generated token's index: seeds its draw */
    mg_sample_params sample;  /* tail, decode */
    mg_sample_result *result; /* tail, decode: out */
    float *logits;            /* tail, decode: NULL, or out [vocab] f32 raw logits of the last row */
} mg_token_step;

typedef struct mg_api {
    int32_t abi_version; /* MG_ABI_VERSION */
    const char *name;    /* "cpu", "cuda" */
    /* sizeof(mg_api) as the library was built: calls are appended, and a
     * caller uses one only when its offset is below table_size. */
    size_t table_size;

    /* Thread-local message of the last failed call on this thread. */
    const char *(*last_error)(void);

    /* opts: see mg_backend_options (NULL: every default). */
    mg_status (*backend_open)(const mg_backend_options *opts, mg_backend **out);
    void (*backend_close)(mg_backend *b);
    /* Free and total bytes of the memory weights and caches live in. */
    mg_status (*backend_memory)(mg_backend *b, uint64_t *free_bytes, uint64_t *total_bytes);
    /* Human-readable device description ("NVIDIA H200, sm_90", "cpu x16"). */
    const char *(*backend_describe)(mg_backend *b);

    /* Host memory for activations: pinned (cudaHostAlloc) on CUDA. */
    mg_status (*host_alloc)(mg_backend *b, size_t nbytes, void **out);
    void (*host_free)(mg_backend *b, void *p);

    mg_status (*stack_create)(mg_backend *b, const mg_stack_config *cfg, mg_stack **out);
    /* Copies the tensor in; data may be freed or unmapped after the call.
     * shape has ndim entries and must match what kind expects. */
    mg_status (*stack_set_tensor)(mg_stack *s, int32_t kind, int32_t layer, int32_t dtype,
                                  const int64_t *shape, int32_t ndim, const void *data,
                                  size_t nbytes);
    /* Checks every tensor the config needs was set; call before use. */
    mg_status (*stack_ready)(mg_stack *s);
    void (*stack_free)(mg_stack *s);

    /* A KV cache for this stack's layers, for up to max_tokens positions. */
    mg_status (*session_create)(mg_stack *s, int32_t max_tokens, mg_session **out);
    void (*session_free)(mg_session *sess);
    int32_t (*session_len)(mg_session *sess);

    /* Token embeddings: out is [n, hidden] in dtype (MG_F32 or MG_BF16). */
    mg_status (*embed)(mg_stack *s, const int32_t *tokens, int32_t n, int32_t dtype, void *out);
    /* Runs layers first..last (inclusive, within the stack) for every step.
     * in and out are [sum(n_tokens), hidden] in dtype; they may alias. */
    mg_status (*forward)(mg_stack *s, const mg_step *steps, int32_t n_steps, int32_t first_layer,
                         int32_t last_layer, int32_t dtype, const void *in, void *out);
    /* Final norm + LM head on n_rows rows of in: out is [n_rows, vocab] f32. */
    mg_status (*logits)(mg_stack *s, int32_t n_rows, int32_t dtype, const void *in, float *out);

    /* ---- ABI 3: the mesh's ends, one call each ---- */
    /* Head: embed each step's tokens and run layers first_layer (the
     * stack's first, which must be 0) ..last_layer; out is [sum(n_tokens),
     * hidden] in dtype, written once at the end (the hop buffer). */
    mg_status (*head_forward)(mg_stack *s, const mg_token_step *steps, int32_t n_steps, int32_t last_layer,
                              int32_t dtype, void *out);
    /* Tail: run layers first_layer..the stack's last on in ([sum(n_tokens),
     * hidden] in dtype), then the final norm, LM head and sampling on each
     * step's last row: steps[i].result (and .logits when asked). A step
     * whose logits hold NaN or +Inf (a model that blew up) fails the call
     * with MG_ERR_NON_FINITE rather than sampling a token from them; the
     * steps' caches and histories then hold the call's positions, which a
     * retry at the same pos overwrites. */
    mg_status (*tail_forward)(mg_stack *s, const mg_token_step *steps, int32_t n_steps, int32_t first_layer,
                              int32_t dtype, const void *in);
    /* Single node: tokens in, sampled tokens out (embed, all layers, head,
     * sampling); nothing but the results (and logits when asked) crosses.
     * Non-finite logits fail it as they fail tail_forward. */
    mg_status (*decode)(mg_stack *s, const mg_token_step *steps, int32_t n_steps);

    /* ---- Appended to ABI 5: token trees (check table_size) ---- */
    /* forward with a tree per step (mg_tree_step), at most
     * MG_MAX_TREE_ROWS rows in a step with parents. */
    mg_status (*forward_tree)(mg_stack *s, const mg_tree_step *steps, int32_t n_steps, int32_t first_layer,
                              int32_t last_layer, int32_t dtype, const void *in, void *out);
    /* Keeps a branch of a tree: moves every held layer's K/V (and the token
     * history's ids) at slots src[0..n-1] to dst..dst+n-1, then truncates the
     * session to dst+n. src must be strictly increasing, src[j] >= dst+j and
     * below every held layer's length; n = 0 only truncates. Copying is
     * exact: a tree row's keys were rotated at pos + depth, which is the slot
     * the kept branch moves it to. */
    mg_status (*session_compact)(mg_session *sess, int32_t dst, const int32_t *src, int32_t n);
} mg_api;

/* The CPU backend (compiled into the binary). */
const mg_api *mg_cpu_api(void);

/* Exported by libmeshgpu_cuda.so under MG_CUDA_ENTRY; NULL on ABI mismatch. */
typedef const mg_api *(*mg_get_api_fn)(int32_t abi_version);

#ifdef __cplusplus
}
#endif

#endif /* MESHGPU_H */

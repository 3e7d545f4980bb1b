/*
 * meshgpu_ops.h: an op-level test table. One entry per op family of a
 * backend, taking host pointers and dimensions, so each CUDA op can be
 * compared with the CPU backend's reference kernel on the same random inputs
 * (native/ops_test.go). Not used for inference: the stack API in meshgpu.h is.
 *
 * Two implementations:
 *   - cpu: native/cpu_ops.c, calling the reference kernels of cpu_kernels.h;
 *   - cuda: libmeshgpu_cuda.so exports MG_CUDA_OPS_ENTRY; each op copies its
 *     inputs to the device, runs the kernel the CUDA backend runs for the
 *     same shape (both ask choose_kernel in kernels/dispatch.h, under the
 *     settings passed in), and copies the result back. What an op cannot
 *     show: the backend's chunking of rows (512 per forward chunk, 64 per
 *     logits chunk) and its decode CUDA graphs.
 *
 * Activations are f32 on both sides. The CUDA side stores them in bf16 like
 * its backend does, so callers pass values that bf16 represents exactly
 * (what the test does) and compare with tolerances meant for bf16 outputs.
 * Weights are passed as stored (f32, f16, bf16, or for matmul and embed
 * ggml's quantized blocks, meshgpu.h).
 */
#ifndef MESHGPU_OPS_H
#define MESHGPU_OPS_H

#include <stdint.h>

#include "meshgpu.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MG_OPS_ABI_VERSION 5 /* 3: sample, norm_matmul, matmul_mma, mma_gbps; 4: rope_attention; 5: attention_tree */
#define MG_CUDA_OPS_ENTRY "mg_cuda_ops"

/* A weight as stored: dtype is an mg_dtype; [rows, cols] row-major
 * (nn.Linear's [out, in]); cols = 1 for vectors. */
typedef struct mg_ops_weight {
    int32_t dtype;
    const void *data;
    int32_t rows, cols;
} mg_ops_weight;

typedef struct mg_ops_rope {
    int32_t type; /* mg_rope_type */
    float theta, factor, low_freq_factor, high_freq_factor;
    int32_t original_max_pos;
    int32_t head_dim;
} mg_ops_rope;

typedef struct mg_ops_api {
    int32_t abi_version; /* MG_OPS_ABI_VERSION */
    const char *name;    /* "cpu", "cuda" */
    const char *(*last_error)(void);

    /* out [n, table.cols] = table[tokens[i]]. */
    mg_status (*embed)(const mg_ops_weight *table, const int32_t *tokens, int32_t n, float *out);
    /* HF LlamaRMSNorm: out = x * rsqrt(mean(x^2) + eps) * w, rows of dim = w.rows. */
    mg_status (*rmsnorm)(const float *x, const mg_ops_weight *w, float eps, int32_t n, float *out);
    /* out [n, w.rows] = x [n, w.cols] @ w^T (+ bias) (+ residual [n, w.rows]).
     * bias and residual may be NULL. The CUDA side runs choose_kernel's
     * pick for n rows: the matrix-vector kernel up to 16, cuBLAS above. */
    mg_status (*matmul)(const float *x, const mg_ops_weight *w, const mg_ops_weight *bias,
                        const float *residual, int32_t n, float *out);
    /* The MLP's first half: out [n, gate.rows] = silu(x @ gate^T) * (x @ up^T). */
    mg_status (*swiglu)(const float *x, const mg_ops_weight *gate, const mg_ops_weight *up,
                        int32_t n, float *out);
    /* In place, x [n, n_heads, head_dim]; token t at positions[t]. */
    mg_status (*rope)(float *x, int32_t n, int32_t n_heads, const int32_t *positions,
                      const mg_ops_rope *p);
    /* q [n, n_heads, hd]; k, v [pos0 + n, n_kv, hd] (the cache including this
     * call's keys); query i attends keys 0..pos0+i; out [n, n_heads * hd].
     * attention and prefill_attention are the backend's settings
     * (mg_attention, mg_prefill_attention in meshgpu.h): the CUDA side runs
     * the kernel its backend would run for one step of n tokens under them.
     * The CPU reference is f32 either way. */
    mg_status (*attention)(const float *q, const float *k, const float *v, int32_t n, int32_t pos0,
                           int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, int32_t attention,
                           int32_t prefill_attention, float *out);
    /* Final norm + LM head: out [n, head.rows] f32. */
    mg_status (*logits)(const float *x, const mg_ops_weight *norm, const mg_ops_weight *head,
                        float eps, int32_t n, float *out);

    /* Ceilings for the benchmarks (MG_ERR_UNSUPPORTED on cpu). */
    /* Device-to-device copy of bytes, iters times: GB/s counting read + write. */
    mg_status (*copy_gbps)(uint64_t bytes, int32_t iters, double *gbps);
    /* [n, k] x [m, k]^T bf16 products with f32 compute through cuBLAS: TFLOP/s. */
    mg_status (*gemm_tflops)(int32_t m, int32_t n, int32_t k, int32_t iters, double *tflops);
    /* The decode matrix-vector kernel on a [m, k] bf16 weight, n rows: GB/s of weights. */
    mg_status (*matvec_gbps)(int32_t m, int32_t k, int32_t n, int32_t iters, double *gbps);
    /* Host time in ns of this thread's last single-token-per-session
     * forward() on the backend (0 for other shapes): entry to everything
     * enqueued, plus stream completion to return; GPU time excluded. */
    mg_status (*hop_host_ns)(uint64_t *ns);

    /* The backend sampler (meshgpu.h "Sampling in the backend") on one row
     * of logits (not modified) with history [n_history]; the CUDA side runs
     * the kernels tail_forward runs, on a copy of them in device memory. */
    mg_status (*sample)(const float *logits, int32_t vocab, const mg_sample_params *p, const int32_t *history,
                        int32_t n_history, int32_t generated_from, int64_t draw, mg_sample_result *out);
    /* out [n, w.rows] = rmsnorm(x, norm, eps) @ w^T: the CUDA side runs
     * choose_kernel's pick for Op::NormMatmul (the RMSNorm folded into the
     * matrix-vector kernel up to 16 rows, rmsnorm + cuBLAS above). */
    mg_status (*norm_matmul)(const float *x, const mg_ops_weight *norm, float eps, const mg_ops_weight *w, int32_t n,
                             float *out);
    /* out [n, w.rows] = x @ w^T under the batch_mma setting: the CUDA side
     * runs the tensor-core matrix-vector kernel (matvec_mma.cu) up to 16
     * rows; the CPU reference is matmul. */
    mg_status (*matmul_mma)(const float *x, const mg_ops_weight *w, int32_t n, float *out);
    /* The tensor-core matrix-vector kernel on a [m, k] bf16 weight, n rows:
     * GB/s of weights (MG_ERR_UNSUPPORTED on cpu). */
    mg_status (*mma_gbps)(int32_t m, int32_t k, int32_t n, int32_t iters, double *gbps);
    /* Decode with the RoPE and the KV append inside attention (the CUDA
     * side: attention_fused.cu, what fused_decode runs): n single-token
     * sequences at position pos, each with its own cache. q [n, H, hd] and
     * kn, vn [n, KVH, hd] are the new rows before RoPE; k, v [n, pos + 1,
     * KVH, hd] the caches, entries 0..pos-1 already rotated keys, entry pos
     * overwritten with rope(kn) and vn; out [n, H * hd]. attention is an
     * mg_attention; hd is rope->head_dim. The CPU reference: rope, append,
     * attention, f32 math. */
    mg_status (*rope_attention)(const float *q, const float *kn, const float *vn, float *k, float *v, int32_t n,
                                int32_t pos, int32_t n_heads, int32_t n_kv_heads, const mg_ops_rope *rope,
                                int32_t attention, float *out);
    /* attention over a token tree (meshgpu.h mg_tree_step): as attention,
     * but query i attends keys 0..pos0-1 and this call's keys j that are i
     * or its ancestors (parents[n], parents[i] in -1..i-1). The CUDA side
     * runs the tree kernel (attention_tree.cu), f32 softmax. */
    mg_status (*attention_tree)(const float *q, const float *k, const float *v, int32_t n, int32_t pos0,
                                const int32_t *parents, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
                                float *out);
} mg_ops_api;

/* The CPU table (native/cpu_ops.c). */
const mg_ops_api *mg_cpu_ops(void);

/* Exported by libmeshgpu_cuda.so under MG_CUDA_OPS_ENTRY; NULL on mismatch. */
typedef const mg_ops_api *(*mg_get_ops_fn)(int32_t abi_version);

#ifdef __cplusplus
}
#endif

#endif /* MESHGPU_OPS_H */

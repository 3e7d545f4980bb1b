/*
 * cpu_kernels.h: the CPU backend's reference kernels. Activations are f32.
 *
 * The CUDA backend's op tests compare each CUDA op against these functions,
 * so their numerics follow HF transformers Llama in f32. The plain functions
 * run on the calling thread; the *_par variants take a thread pool
 * (cpu_pool.h, NULL = calling thread only) and give bit-identical results
 * for any thread count.
 *
 * To use them outside cgo: compile native/cpu_kernels.c, cpu_matmul_avx512.c,
 * cpu_matmul_avx2.c, cpu_isa.c and cpu_pool.c (gcc -std=c11 -O3 -march=x86-64-v3 on x86-64, as
 * cgo builds them; -lpthread -lm). The matrix products pick their path at run
 * time (mg_cpu_isa); the AVX-512 ones have their own target attributes.
 */
#ifndef MESHGPU_CPU_KERNELS_H
#define MESHGPU_CPU_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A weight as stored: dtype is an mg_dtype (0 f32, 1 f16, 2 bf16, or a
 * block-quantized type, see below); matrices
 * are [rows, cols] row-major (nn.Linear's [out, in]); cols = 1 for vectors. */
typedef struct mg_cpu_weight {
    int32_t dtype;
    const void *data;
    int32_t rows, cols;
    /* 0: row-major. MG_CPU_TILE: a bf16 matrix stored as column blocks of
     * MG_CPU_TILE columns, each block [rows, width] row-major, blocks in
     * order (mg_cpu_tile_bf16 makes it). Decode then reads x in pieces that
     * stay in L1, about 1.2-2x faster on wide matrices; results are the
     * same bits as row-major. Leave 0 unless the data was tiled. */
    int32_t tiled;
} mg_cpu_weight;

#define MG_CPU_TILE 1024
/* Whether mg_cpu_tile_bf16 applies to a [rows, cols] bf16 matrix. */
int mg_cpu_tileable(int32_t rows, int32_t cols);
/* Copies a row-major bf16 [rows, cols] matrix into the tiled layout. */
void mg_cpu_tile_bf16(const uint16_t *src, int32_t rows, int32_t cols, uint16_t *dst);

/* type is an mg_rope_type (0 default, 1 llama3). */
typedef struct mg_rope_params {
    int32_t type;
    float theta, factor, low_freq_factor, high_freq_factor;
    int32_t original_max_pos;
    int32_t head_dim;
} mg_rope_params;

/* out [n, table.cols]: rows of the table, converted to f32. */
void mg_cpu_embed(const mg_cpu_weight *table, const int32_t *tokens, int32_t n, float *out);
/* HF LlamaRMSNorm in f32: out = (x * rsqrt(mean(x^2) + eps)) * w, per row of dim. */
void mg_cpu_rmsnorm(const float *x, const mg_cpu_weight *w, float eps, int32_t n, int32_t dim,
                    float *out);
/* x [n, w.cols] -> out [n, w.rows] = x @ w^T (+ bias); bias may be NULL. */
void mg_cpu_matmul(const float *x, const mg_cpu_weight *w, const mg_cpu_weight *bias, int32_t n,
                   float *out);
/* In place, x [n, n_heads, head_dim], HF rotate_half convention (pairs i and
 * i + head_dim/2), token t at positions[t]. */
void mg_cpu_rope(float *x, int32_t n, int32_t n_heads, const int32_t *positions,
                 const mg_rope_params *p);
/* q [n, n_heads, hd]; caches [pos0+n, n_kv, hd] already holding this call's
 * keys/values; causal: query i attends to keys 0..pos0+i; GQA: head h uses kv
 * head h / (n_heads/n_kv); scale 1/sqrt(hd), softmax in f32; out [n, n_heads*hd]. */
void mg_cpu_attention(const float *q, const float *k_cache, const float *v_cache, int32_t n,
                      int32_t pos0, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
                      float *out);
/* out = silu(gate) * up, n elements; out may alias gate or up. */
void mg_cpu_swiglu(const float *gate, const float *up, int32_t n, float *out);

/* --- helpers shared with the backend --- */

/* The RoPE inverse frequencies, head_dim/2 values, as HF computes them in f32
 * (including llama3 scaling). */
void mg_cpu_rope_inv_freq(const mg_rope_params *p, float *inv_freq);
/* Whether any of a stack config's head_dim/2 rope frequency factors is set. */
int mg_cpu_has_rope_factors(const float *factors, int32_t head_dim);
/* mg_cpu_rope with precomputed inverse frequencies (head_dim <= 1024). */
void mg_cpu_rope_freq(float *x, int32_t n, int32_t n_heads, const int32_t *positions, int32_t head_dim,
                      const float *inv_freq);
/* f32 <-> bf16 (round to nearest even; NaN stays NaN) and f16 -> f32. */
float mg_bf16_to_f32(uint16_t h);
uint16_t mg_f32_to_bf16(float f);
float mg_f16_to_f32(uint16_t h);

/* --- pooled variants used by the backend (pool may be NULL) --- */
struct mg_pool;
void mg_cpu_matmul_par(struct mg_pool *pool, const float *x, const mg_cpu_weight *w,
                       const mg_cpu_weight *bias, int32_t n, float *out);
/* Several weights with the same input (q/k/v, gate/up) in one parallel
 * pass: out[m] = x @ ws[m]^T (+ biases[m]); biases may be NULL, or hold NULLs.
 * All ws have the same cols; at most MG_MATMUL_MAX. */
#define MG_MATMUL_MAX 3
void mg_cpu_matmul_multi(struct mg_pool *pool, const float *x, int32_t n, int32_t count,
                         const mg_cpu_weight *const *ws, const mg_cpu_weight *const *biases,
                         float *const *outs);
/* The two above with an explicit path (MG_ISA_*) instead of mg_cpu_isa(). */
void mg_cpu_matmul_multi_isa(struct mg_pool *pool, int isa, const float *x, int32_t n, int32_t count,
                             const mg_cpu_weight *const *ws, const mg_cpu_weight *const *biases,
                             float *const *outs);
void mg_cpu_matmul_par_isa(struct mg_pool *pool, int isa, const float *x, const mg_cpu_weight *w,
                           const mg_cpu_weight *bias, int32_t n, float *out);
/* As mg_cpu_attention; scratch holds mg_pool_threads(pool) * (pos0+n) floats. */
void mg_cpu_attention_par(struct mg_pool *pool, const float *q, const float *k_cache,
                          const float *v_cache, int32_t n, int32_t pos0, int32_t n_heads,
                          int32_t n_kv_heads, int32_t head_dim, float *out, float *scratch);
/* As mg_cpu_attention_par with a tree mask (meshgpu.h mg_tree_step): this
 * call's key j is seen by query i when tree[i*n + j] is 1 (j is i or one of
 * its ancestors); the cached keys 0..pos0-1 by every query. tree NULL:
 * causal. */
void mg_cpu_attention_tree_par(struct mg_pool *pool, const float *q, const float *k_cache,
                               const float *v_cache, int32_t n, int32_t pos0, const uint8_t *tree,
                               int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, float *out,
                               float *scratch);

/* --- block-quantized weights (cpu_quant.c) ---
 * A quantized mg_cpu_weight (dtype MG_Q8_0, MG_Q4_K, MG_Q5_K, MG_Q6_K) holds
 * rows of mg_cpu_quant_row_bytes(dtype, cols) bytes of ggml blocks, row-major,
 * never tiled. mg_cpu_embed dequantizes the rows it looks up; the matrix
 * products above read the blocks (cpu_quant.c says in which order). */

int mg_cpu_is_quant(int32_t dtype);
/* Elements and bytes of one block; 0 for a type that is not quantized. */
int mg_cpu_quant_block(int32_t dtype, int32_t *elems, int32_t *bytes);
/* Bytes of a row of cols elements; 0 when cols is not a whole number of blocks. */
size_t mg_cpu_quant_row_bytes(int32_t dtype, int64_t cols);
/* Elements sharing one scale (16 or 32), and whether groups also have mins. */
int32_t mg_cpu_quant_group(int32_t dtype);
int mg_cpu_quant_has_min(int32_t dtype);
/* ggml's dequantization of n elements (whole blocks) of a row. */
void mg_cpu_dequant_row(int32_t dtype, const void *src, int32_t n, float *dst);
/* A token's activations for the products: per group g of 32, xs[g] their
 * f32 sum, xd[g] = max|x| / 32767 and xq (int16) = rint(x / xd), cols/32
 * and cols values. */
void mg_cpu_qx(int isa, const float *x, int32_t cols, int16_t *xq, float *xd, float *xs);
/* Floats of a widened row (mg_cpu_qprep_row) of cols elements. */
size_t mg_cpu_qprep_floats(int32_t cols);
/* A row widened for several tokens' products: q as int16 [cols], the
 * group scales, the mins (cpu_quant.c); the same values on every path. */
void mg_cpu_qprep_row(int isa, int32_t dtype, const void *row, int32_t cols, float *buf);
/* x . row, row as stored, x as mg_cpu_qx gives it; buf has
 * mg_cpu_qprep_floats(cols) floats of scratch. */
float mg_cpu_qdot(int isa, int32_t dtype, const void *row, const int16_t *xq, const float *xd, const float *xs, int32_t cols,
                  float *buf);
/* mg_cpu_qdot for nr consecutive rows, rb bytes apart, into out: the same
 * bits for each row. */
void mg_cpu_qdot_rows(int isa, int32_t dtype, const void *row0, size_t rb, int32_t nr, const int16_t *xq, const float *xd,
                      const float *xs, int32_t cols, float *buf, float *out);
/* x . row for nt (1..4) tokens and a row widened by mg_cpu_qprep_row: the
 * same bits as mg_cpu_qdot for each. */
void mg_cpu_qdot_prepn(int isa, int32_t dtype, const float *buf, int nt, const int16_t *const *xq, const float *const *xd,
                       const float *const *xs, int32_t cols, float *out);

/* Several tokens on AVX-512 (cpu_quant.c): mg_cpu_q16_pairs says whether
 * path isa has it; mg_cpu_qx_pairs interleaves n tokens' mg_cpu_qx values
 * by 32-bit pairs into x2 (n rounded up to even, times cols, int16; an odd
 * last token paired with zeros); mg_cpu_qdot_prepn_pairs is
 * mg_cpu_qdot_prepn for nr (1..32) widened rows pf floats apart and 2 np
 * (np 1..4) tokens given as np pairs (x2 rows 2 cols apart), xd and xs per
 * token, into out[8 r + t]; 0 where the path lacks it. Meanwhile it
 * fetches next_bytes from next (NULL: none), the blocks the caller widens
 * next, into L2 a few lines at a time: widening rows straight from DRAM
 * stalled on every line (7 GB/s a thread on Zen 5, where the decode
 * kernels' prefetched reads run 15-35). */
int mg_cpu_q16_pairs(int isa);
void mg_cpu_qx_pairs(const int16_t *xq, int32_t n, int32_t cols, int16_t *x2);
int mg_cpu_qdot_prepn_pairs(int isa, int32_t dtype, const float *buf, size_t pf, int32_t nr, int np, const int16_t *const *x2,
                            const float *const *xd, const float *const *xs, int32_t cols, float *out, const void *next,
                            size_t next_bytes);
/* mg_cpu_qdot_prepn_pairs on nr rows of blocks (rb bytes apart) read
 * directly, one pass of up to 8 tokens per call (a batch of more takes
 * several passes over the same rows, each unpacking the blocks again:
 * cheaper than widening them once and reloading the words), where widening
 * would store and reload every weight: Q8_0, Q4_K and Q6_K (cutting Q5_K's
 * fifth bits per group cost what widening saved, or more: its rows are
 * widened); the same bits; 0 where the path or the type lacks it. */
int mg_cpu_q16_blocks(int isa, int32_t dtype); /* whether mg_cpu_qdot_blocks_pairs takes dtype on path isa */
int mg_cpu_qdot_blocks_pairs(int isa, int32_t dtype, const void *w, size_t rb, int32_t nr, int np, const int16_t *const *x2,
                             const float *const *xd, const float *const *xs, int32_t cols, float *out, const void *next,
                             size_t next_bytes);
/* Which kernels quantized weights' products take on path isa at the
 * current activation width: "avx512vnni", "avx512bw", "avx2" or "scalar". */
const char *mg_cpu_quant_kernels(int isa);
/* Tests: whether the AVX-512 16-bit kernels use VNNI where the CPU has it (1, the default). */
void mg_cpu_q16_set_vnni(int on);
/* 8-bit activations (cpu_quant8.c, llama.cpp's scheme): a
 * token's activations in int8 blocks of mg_cpu_q8act_block(dtype) (32 for
 * Q8_0, 256 for the K-quants) with f32 scales d and bs the int sums of each
 * 16 q (K-quants). */
typedef struct {
    const int8_t *q;
    const float *d;
    const int16_t *bs;
} mg_cpu_q8act;
int32_t mg_cpu_q8act_block(int32_t dtype);
/* Quantizes x [cols] in blocks of blk; bs (cols/16) may be NULL. */
void mg_cpu_q8x(const float *x, int32_t cols, int32_t blk, int8_t *q, float *d, int16_t *bs);
/* x[t] . row for nt (1..MG_Q8_NT) tokens into out[t], row as stored: each
 * token's bits are those of a one-token call, on every path (cpu_quant8.c). */
#define MG_Q8_NT 8
void mg_cpu_q8dot_n(int isa, int32_t dtype, const void *row, int32_t cols, int nt, const mg_cpu_q8act *x, float *out);
/* cpu_quant8.c's mg_cpu_q8dot_n on AVX-512 VNNI (cpu_quant8_avx512.c), the
 * same bits; 0 without touching out where the CPU lacks VNNI. */
int mg_cpu_q8dot_n_avx512(int32_t dtype, const void *row, int32_t cols, int nt, const mg_cpu_q8act *x, float *out);
/* The activations quantized weights' products use: 8 (cpu_quant8.c) or 16
 * (cpu_quant.c); unless set, 16 (cpu_isa.c says why).
 * mg_cpu_set_quant_act(0) restores that default and
 * returns -1 for values other than 0, 8, 16. Call it while no kernel runs. */
int mg_cpu_quant_act(void);
int mg_cpu_set_quant_act(int bits);

/* --- instruction sets (cpu_isa.c) --- */

/* The matrix products' paths, each a superset of the one before. */
enum { MG_ISA_SCALAR = 0, MG_ISA_AVX2 = 1, MG_ISA_AVX512F = 2, MG_ISA_AVX512BF16 = 3 };
/* The path in use: mg_cpu_set_isa's choice, else the default. Native code
 * reads no environment: MESHGPU_CPU_ISA is the CLI's --cpu-isa variable,
 * applied through native.Options.CPUISA. */
int mg_cpu_isa(void);
/* The newest path this CPU, its OS and this build support. */
int mg_cpu_isa_best(void);
/* The path used when none is named: the best, except avx512f where
 * avx512bf16's tile is not clearly faster on this CPU (cpu_isa.c). */
int mg_cpu_isa_default(void);
/* How many times the avx512f register tile's time the avx512bf16 tile
 * takes less on this CPU, measured once (about 2 ms) on the first call;
 * 0 where avx512bf16 is not supported. */
double mg_cpu_bf16_speedup(void);
/* Forward steps of this many tokens or more (prompts) take the prompt
 * products (cpu_backend.c step_path): MG_PATH_PROMPT. */
#define MG_PROMPT_STEP_MIN 32
/* Or'd into a path (MG_ISA_*) given to mg_cpu_matmul_multi_isa: the rows
 * are a prompt's, and quantized weights (and bf16 ones on avx512f) take
 * the prompt kernel where the path has it (mg_cpu_matmul_prompt_avx512). */
#define MG_PATH_PROMPT 0x100
int mg_cpu_isa_supported(int isa);
/* 0, or -1 when isa is not supported (nothing changes); isa < 0 restores the
 * default. Call it while no kernel runs. */
int mg_cpu_set_isa(int isa);
const char *mg_cpu_isa_name(int isa);
/* Whether the CPU and OS run AVX512_VNNI (with the avx512f path's set). */
int mg_cpu_has_vnni(void);
/* Whether the CPU's vendor is AMD (cpuid; mg_cpu_faster_measured's tie-break). */
int mg_cpu_is_amd(void);
/* Whether a kernel that measured speedup times another's speed at start-up
 * runs in its place: where clearly faster, not where clearly slower, and in
 * between on AMD only (cpu_isa.c: so that two processes on one machine
 * choose alike when one process's readings scatter). */
int mg_cpu_faster_measured(double speedup);
/* -1 for an unknown name. */
int mg_cpu_isa_parse(const char *name);

/* The AVX-512 matrix products (cpu_matmul_avx512.c) for bf16 weights; as
 * mg_cpu_matmul_multi. Returns 0 without touching outs when it does not
 * apply (another isa, weights not all bf16, no memory): use the AVX2 path. */
int mg_cpu_matmul_multi_avx512(struct mg_pool *pool, int isa, const float *x, int32_t n, int32_t count,
                               const mg_cpu_weight *const *ws, const mg_cpu_weight *const *biases,
                               float *const *outs);

/* A prompt's rows on AVX-512 (cpu_matmul_avx512.c): f32 products on row
 * blocks dequantized (quantized weights) or widened (bf16 weights, avx512f
 * only), tokens in the lanes; quantized weights take
 * mg_cpu_matmul_prompt_q16 instead where mg_cpu_prompt_q16 says so; as
 * mg_cpu_matmul_multi.
 * Returns 0 when it does not apply (another isa, a weight not quantized,
 * no memory): outs may then be partly written, and the caller's path
 * writes every one. */
int mg_cpu_matmul_prompt_avx512(struct mg_pool *pool, int isa, const float *x, int32_t n, int32_t count,
                                      const mg_cpu_weight *const *ws, const mg_cpu_weight *const *biases,
                                      float *const *outs);
/* The same with the f32 tile whatever mg_cpu_prompt_q16 says (its
 * start-up measurement times both). */
int mg_cpu_matmul_prompt_f32(struct mg_pool *pool, int isa, const float *x, int32_t n, int32_t count,
                             const mg_cpu_weight *const *ws, const mg_cpu_weight *const *biases, float *const *outs);
/* A prompt's rows of quantized weights on 16-bit VNNI products, tokens in
 * the lanes (cpu_matmul_q16prompt.c); as mg_cpu_matmul_prompt_avx512. */
int mg_cpu_matmul_prompt_q16(struct mg_pool *pool, int isa, const float *x, int32_t n, int32_t count,
                             const mg_cpu_weight *const *ws, const mg_cpu_weight *const *biases, float *const *outs);
/* Whether quantized prompt rows take mg_cpu_matmul_prompt_q16: where the
 * CPU has AVX-512 VNNI and that kernel ran at least 1.15x the f32 tile's
 * speed at start-up (mg_cpu_prompt_q16_speedup: the ratio, 0 unmeasured or
 * unsupported), or as tests set it (mg_cpu_set_prompt_q16: 0, 1; -1 back
 * to the measurement). */
int mg_cpu_prompt_q16(void);
double mg_cpu_prompt_q16_speedup(void);
void mg_cpu_set_prompt_q16(int on);

/* A bias vector's value r (0 without one): f32 in the backend, bf16 only in tests. */
static inline float mg_cpu_bias_at(const mg_cpu_weight *b, int32_t r) {
    if (!b) return 0.0f;
    if (b->dtype == 0) return ((const float *)b->data)[r];
    return mg_bf16_to_f32(((const uint16_t *)b->data)[r]);
}

/* The AVX2 register-tiled products (cpu_matmul_avx2.c) for bf16 weights
 * (f32 or bf16 biases), the same bits as the one-row path; as
 * mg_cpu_matmul_multi. Returns 0 without touching outs when it does not
 * apply (weights not all bf16, no AVX2 in the build, no memory). */
int mg_cpu_matmul_multi_avx2(struct mg_pool *pool, const float *x, int32_t n, int32_t count,
                             const mg_cpu_weight *const *ws, const mg_cpu_weight *const *biases,
                             float *const *outs);

#ifdef __cplusplus
}
#endif

#endif /* MESHGPU_CPU_KERNELS_H */

// kernels.h: host-side launchers, one group per .cu file. The backend
// (backend*.cu) and the op test table (ops.cu) call only these, choosing
// among them with choose_kernel (dispatch.h). Launchers
// enqueue on the given stream and return the launch error (cudaSuccess when
// the kernel was queued); they never synchronize.
#pragma once

#include <cublas_v2.h>

#include "common.cuh"

#include "../native/meshgpu.h"

namespace mg {

// ---- convert.cu: dtype conversion and embedding gather ----
// dst[i] = bf16(src[i]); src dtype is an mg_dtype (f32, f16, bf16).
cudaError_t convert_to_bf16(const void *src, int dtype, size_t n, bf16 *dst, cudaStream_t st);
cudaError_t bf16_to_f32(const bf16 *src, size_t n, float *dst, cudaStream_t st);
cudaError_t f32_to_bf16(const float *src, size_t n, bf16 *dst, cudaStream_t st);
// out[i, :] = table[tokens[i], :]; tokens already validated.
cudaError_t embed(const bf16 *table, const int32_t *tokens, int n, int hidden, bf16 *out,
                  cudaStream_t st);

// ---- rmsnorm.cu ----
// HF LlamaRMSNorm in bf16: out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))).
// dim % 8 == 0.
cudaError_t rmsnorm(const bf16 *x, const bf16 *w, float eps, int rows, int dim, bf16 *out,
                    cudaStream_t st);

// ---- matvec.cu: decode matrix-vector products, n <= kGemvMaxRows ----
constexpr int kGemvMaxRows = 16;
enum GemvEpilogue {
    kStore = 0,    // out[b, r] = bf16(dot + bias[r])
    kResidual = 1, // out[b, r] = bf16(out[b, r] + bf16(dot))   (in place)
    kSwiGLU = 2,   // W holds 2m rows (gate then up): out = bf16(silu(g) * u)
    kF32 = 3,      // out_f32[b, r] = bf16(dot) widened to f32 (logits, as HF bf16)
};
// x [n, k], W [m (or 2m for kSwiGLU), k] row-major, out [n, m]. k % 8 == 0,
// x and W 16-byte aligned. bias may be null (kStore only).
cudaError_t gemv(int epilogue, const bf16 *W, const bf16 *x, int n, int m, int k,
                 const bf16 *bias, bf16 *out, float *out_f32, cudaStream_t st);
// ---- matvec_mma.cu: the same products on tensor cores (mma.sync m16n8k16
// bf16, f32 accumulation), for batches; k % 32 == 0 (gemv_mma_fits). ----
bool gemv_mma_fits(int n, int k);
cudaError_t gemv_mma(int epilogue, const bf16 *W, const bf16 *x, int n, int m, int k, const bf16 *bias, bf16 *out,
                     float *out_f32, cudaStream_t st);
// gemv of rmsnorm(x, norm_w, eps) without materializing it: the same bits
// as rmsnorm() then gemv() (epilogues kStore, kSwiGLU, kF32).
cudaError_t gemv_norm(int epilogue, const bf16 *W, const bf16 *x, const bf16 *norm_w, float eps, int n, int m,
                      int k, const bf16 *bias, bf16 *out, float *out_f32, cudaStream_t st);

// ---- gemm.cu: prefill matrix products through cuBLAS ----
// Y[n, m] = X[n, k] @ W[m, k]^T + beta * Y; Y is bf16 or f32 (y_f32).
// f32 accumulation. handle must be bound to the caller's stream.
cublasStatus_t gemm(cublasHandle_t h, const bf16 *W, const bf16 *X, int n, int m, int k, void *Y,
                    bool y_f32, float beta);
// The same with Y's rows ldy elements apart (a column range of a wider Y).
cublasStatus_t gemm_ld(cublasHandle_t h, const bf16 *W, const bf16 *X, int n, int m, int k, void *Y, int ldy,
                       bool y_f32, float beta);
// Y[r, :] = bias for every row (before a beta = 1 GEMM adds the product).
cudaError_t fill_rows(const bf16 *bias, int rows, int m, bf16 *Y, cudaStream_t st);
// out[r, i] = bf16(silu(bf16 gate) * up) where gu[r] = [gate (m) | up (m)].
cudaError_t swiglu(const bf16 *gu, int rows, int m, bf16 *out, cudaStream_t st);
// x[i] = bf16(x[i] + y[i]) (the residual add of HF bf16); n % 8 == 0.
cudaError_t add_inplace(bf16 *x, const bf16 *y, size_t n, cudaStream_t st);
// x[i] = bf16(x[i]) widened (f32 logits as HF bf16 computes them).
cudaError_t round_to_bf16(float *x, size_t n, cudaStream_t st);

// ---- quant.cu: ggml's block-quantized weights (meshgpu.h), read as the
// file's blocks ----
// Elements and bytes of a block of a quantized mg_dtype; false for others.
bool quant_block(int dtype, int *elems, int *bytes);
// Bytes of a row of cols elements; 0 unless dtype is quantized and cols a
// whole number of its blocks.
size_t quant_row_bytes(int dtype, long long cols);
// Activation rows for qgemv: x [n, k] bf16 (with norm_w: first the RMSNorm,
// the same bits as rmsnorm()), rounded per group of 32 to int8 as ggml's
// q8_1: xd[r, g] = max|x| / 127, xq = round(x / xd). k % 32 == 0; xq
// [n, k], xd [n, k / 32].
cudaError_t quantize_rows(const bf16 *x, const bf16 *norm_w, float eps, int n, int k, int8_t *xq, float *xd,
                          cudaStream_t st);
// The rows of one qgemv launch: up to 3 segments of one dtype and width;
// segment j holds launch rows end[j-1]..end[j]-1 (end[-1] = 0), row i of it
// at w[j] + i * row_bytes, written to output column out0[j] + i.
struct QSegs {
    const void *w[3];
    int end[3];
    int out0[3];
    int n;
};
// out[b * ldo + col] = epilogue(x_b . row) for n <= kGemvMaxRows quantized
// activation rows (quantize_rows) and m weight rows; the epilogues of gemv
// (bias indexed by output column). kSwiGLU: one segment of gate rows, up
// the up rows (else null).
cudaError_t qgemv(int epilogue, int dtype, const QSegs &segs, const void *up, int n, int m, int k, const int8_t *xq,
                  const float *xd, const bf16 *bias, bf16 *out, float *out_f32, int ldo, cudaStream_t st);
// out [rows, k] = the rows dequantized as ggml does (f32), rounded to bf16.
cudaError_t dequant_rows(int dtype, const void *W, int rows, int k, bf16 *out, cudaStream_t st);
// out[i, :] = bf16(dequantized table[tokens[i], :]); tokens already validated.
cudaError_t embed_quant(int dtype, const void *table, const int32_t *tokens, int n, int hidden, bf16 *out,
                        cudaStream_t st);

// ---- rope.cu: RoPE and KV-cache append ----
// qkv rows are [q (H*hd) | k (KVH*hd) | v (KVH*hd)]. Rotates q in place and
// writes rotated k and v into the cache at meta[row].pos of local layer
// `layer`. cs is the [max_pos, hd/2] (cos, sin) table. KVH may be 0 (q only).
cudaError_t rope_append(bf16 *qkv, int rows, int H, int KVH, int hd, const float2 *cs,
                        const mg_row_meta *meta, int layer, cudaStream_t st);

// ---- attention.cu ----
// Chunk length and chunk count for decode attention over at most max_len keys.
int attn_chunk(int max_len);
int attn_chunks(int max_len);
// Numerics: by default attention follows PyTorch's math SDPA in bf16 (what
// HF transformers ran for golden.json): q and k scaled by bf16(sqrt(scale))
// and rounded, bf16 scores, a bf16 normalized softmax, then P @ V. With
// f32_softmax (MG_ATTENTION_F32, --cuda-attention f32) it is flash-style: f32 scores and
// online softmax, only P rounded to bf16 for P @ V (closer to f32 math).
struct AttnScratch {
    bool f32_softmax = false;
    float *partial = nullptr; // attn_partial_floats(rows, H, hd, max_len)
    bf16 *scores = nullptr;   // [rows][H][scores_stride] (bf16 numerics only)
    int scores_stride = 0;    // >= max_len
    float *stats = nullptr;   // [rows][H][chunks][2] (bf16 numerics only)
    unsigned *arrivals = nullptr; // [kGemvMaxRows][KVH], zeroed once (attn_decode_rope)
};
size_t attn_partial_floats(int rows, int H, int hd, int max_len);
// Decode (few query rows per sequence): row r attends keys 0..meta[r].pos of
// its session, split over attn_chunks(max_len) chunks, then merged. q rows
// are qkv rows (stride q_stride elements). out [rows, H*hd]. G = H/KVH <= 8.
cudaError_t attn_decode(const bf16 *qkv, int q_stride, const mg_row_meta *meta, int rows, int layer, int H, int KVH,
                        int hd, int max_len, const AttnScratch &scr, bf16 *out, cudaStream_t st);
// Prefill for one sequence: n query rows at positions pos0.., causal over the
// cache (which already holds keys 0..pos0+n-1). k, v: this layer's cache.
cudaError_t attn_prefill(const bf16 *qkv, int q_stride, int n, int pos0, const bf16 *k, const bf16 *v, int H,
                         int KVH, int hd, bool f32_softmax, bf16 *out, cudaStream_t st);

// ---- attention_fused.cu: decode attention with RoPE and the KV append
// inside (rope_append + attn_decode in two launches, bf16 numerics, or one,
// f32), the chunks merged by the last block of each (row, kv head); the
// same bits. Rows are single-token steps of distinct sessions, at most
// kGemvMaxRows; qkv rows are rope_append's; q is read, not rotated in place.
cudaError_t attn_decode_rope(const bf16 *qkv, int q_stride, const mg_row_meta *meta, int rows, int layer, int H, int KVH,
                             int hd, int max_len, const float2 *cs, const AttnScratch &scr, bf16 *out,
                             cudaStream_t st);

// ---- attention_tree.cu: a token tree's rows (meshgpu.h mg_tree_step):
// n query rows at pos0.., row i seeing the keys 0..pos0-1 and this call's
// key j where mask[i*n + j] (device memory, [n][n]) is set; f32 softmax
// (the flash-style numerics). k, v: the cache, [pos0+n][KVH][hd].
cudaError_t attn_tree(const bf16 *qkv, int q_stride, int n, int pos0, const uint8_t *mask, const bf16 *k,
                      const bf16 *v, int H, int KVH, int hd, bf16 *out, cudaStream_t st);

// ---- compact.cu: keeping a token tree's branch (meshgpu.h session_compact) ----
// Slots moved by one launch; a longer move is several, in order.
constexpr int kCompactSlots = 64;
struct CompactSlots {
    int32_t src[kCompactSlots];
};
// rows[dst + j] = rows[src.src[j]] for j < n (n <= kCompactSlots), rows of
// width elements, for k and v; sources increasing and at or after their
// destinations, so each element's copies run in order in one thread.
cudaError_t compact_rows(bf16 *k, bf16 *v, int width, int dst, const CompactSlots &src, int n, cudaStream_t st);
// hist[dst + j] = hist[src.src[j]] for j < n, in order (one thread).
cudaError_t compact_ids(int32_t *hist, int dst, const CompactSlots &src, int n, cudaStream_t st);

// ---- attention_gemm.cu: the same prefill (bf16 math numerics) through
// cuBLAS; the default (MG_PREFILL_ATTENTION_TILED opts out). scratch holds
// attn_prefill_gemm_bytes(). A cuBLAS failure is returned in *bs.
size_t attn_prefill_gemm_bytes(int n, int pos0, int H, int KVH, int hd);
cudaError_t attn_prefill_gemm(cublasHandle_t blas, const bf16 *qkv, int q_stride, int n, int pos0, const bf16 *k,
                              const bf16 *v, int H, int KVH, int hd, void *scratch, bf16 *out, cudaStream_t st,
                              cublasStatus_t *bs);

} // namespace mg

namespace mg {

// ---- rope.cu (host): the RoPE inverse frequencies as HF computes them in
// f32 (llama3 scaling when type == 1) and the (cos, sin) table for
// positions 0..max_pos-1, [max_pos][hd/2].
void rope_inv_freq(int type, float theta, float factor, float low_freq_factor,
                   float high_freq_factor, int original_max_pos, int hd, float *inv_freq);
void rope_table(const float *inv_freq, int hd, int max_pos, float2 *table);

// ---- probe.cu: ceilings measured in the same run as the benchmarks ----
// Device-to-device copy of bytes, iters times; GB/s counting read + write.
cudaError_t probe_copy_gbps(size_t bytes, int iters, double *gbps);
// Fills n bf16 with uniform values in [-scale, scale) from a hash of seed and
// index (benchmarks must not run on zeros).
cudaError_t fill_random(bf16 *p, size_t n, uint32_t seed, float scale, cudaStream_t st);
// bf16 GEMM rate through cuBLAS, TFLOP/s, on random data.
cudaError_t probe_gemm_tflops(int m, int n, int k, int iters, double *tflops, const char **err);
// The decode matrix-vector kernel's achieved weight bandwidth, GB/s.
// mma: gemv_mma (tensor-core tiles) instead of gemv.
cudaError_t probe_gemv_gbps(int m, int k, int n, int iters, double *gbps, bool mma = false);

// ---- sample.cu: the backend sampler (meshgpu.h), one row at a time ----
// Device scratch for one row of vocab logits: sample_scratch_bytes(vocab)
// bytes, zeroed once when allocated (cnt must stay zero between calls).
struct SampleScratch {
    double *q = nullptr, *lse_parts = nullptr, *parts = nullptr;
    float *part_v = nullptr;
    int *part_i = nullptr, *order = nullptr;
    int32_t *cnt = nullptr;
};
size_t sample_scratch_bytes(int vocab);
SampleScratch sample_scratch(void *mem, int vocab);
bool sample_params_ok(const mg_sample_params &p);
// Penalizes logits (device, in place) and writes the pick to res (device);
// hist (device) holds n_hist ids, history[gen_from:] generated; hist_out
// (device, may be null) receives the picked id.
cudaError_t sample_row(float *logits, int vocab, const mg_sample_params &p, const int32_t *hist, int n_hist, int gen_from,
                       int64_t draw, int32_t *hist_out, const SampleScratch &sc, mg_sample_result *res, cudaStream_t st);
// flags[r] (device) = 1 when row r of rows rows of logits (device) holds NaN
// or +Inf, else 0.
cudaError_t non_finite_rows(const float *logits, int rows, int vocab, int32_t *flags, cudaStream_t st);

} // namespace mg


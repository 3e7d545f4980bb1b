/*
 * cpu_matmul_avx512.c: bf16-weight matrix products on AVX-512, chosen at run
 * time (cpu_isa.c), for prefill and batched decode; and the f32 prompt
 * kernel (below) for prompts' rows of quantized and bf16 weights (quantized
 * ones take cpu_matmul_q16prompt.c's where that measured clearly faster).
 *
 * The binary is built for x86-64-v3; these functions carry their own target
 * attributes and run only after cpuid and xgetbv said the CPU and the OS
 * support them. The reference is the AVX2 path in cpu_kernels.c (and the Go
 * references in reference_test.go); the op tests run every path the machine
 * has against them.
 *
 * Both paths compute each output as one 16-lane accumulator advanced over the
 * row in order, then one horizontal sum, whatever the number of tokens and
 * however rows and tokens are split among threads and register tiles: a
 * session's result does not depend on what it was batched with.
 *
 *   avx512f:    f32 activations; bf16 weights widened in registers; 16 f32
 *               multiply-adds per instruction.
 *   avx512bf16: activations rounded to bf16 once per call (vcvtne2ps2bf16);
 *               vdpbf16ps does 32 bf16 products per instruction, summed in
 *               f32, at bf16 input precision. Twice the products per
 *               instruction: 1.7x avx512f's rate on Zen 4, 1.9x on Zen
 *               5, 0.64x on Sapphire Rapids, so the default is measured
 *               (cpu_isa.c, mg_cpu_bf16_speedup below).
 */
#define _GNU_SOURCE /* clock_gettime */
#include "cpu_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)

#include <immintrin.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpu_pool.h"

#define X512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2")))
#define XBF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,avx2")))
#define INLINE inline __attribute__((always_inline))

enum { DT_BF16 = 2 };
enum { RM = 4, RN = 6 }; /* register tile: RM weight rows x RN tokens = 24 accumulators */
/* One token (decode) takes RM1 rows at once (one_token below): 8
 * independent FMA chains, where one would wait on its own latency. */
enum { RM1 = 8 };

/* The start of row r's column block k0 (width columns wide) of a bf16 matrix. */
static inline const uint16_t *row_seg(const mg_cpu_weight *w, int32_t r, int32_t k0, int32_t width) {
    const uint16_t *base = w->data;
    if (w->tiled) return base + (size_t)k0 * (size_t)w->rows + (size_t)r * width;
    return base + (size_t)r * w->cols + k0;
}

/* ---- avx512f: f32 activations ---- */

static INLINE X512 __m512 widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

/* out[t, r] for rm rows r0, r0 + sp, ... and rn tokens (x rows xs apart). */
static INLINE X512 void tile_f32(const mg_cpu_weight *w, int32_t r0, int32_t sp, const int rm, const float *x, size_t xs,
                                 const int rn, const mg_cpu_weight *bias, float *out, size_t os) {
    __m512 acc[RM][RN];
#pragma GCC unroll 8
    for (int i = 0; i < rm; i++)
#pragma GCC unroll 6
        for (int j = 0; j < rn; j++) acc[i][j] = _mm512_setzero_ps();
    int32_t cols = w->cols, bw = w->tiled ? MG_CPU_TILE : cols;
    for (int32_t k0 = 0; k0 < cols; k0 += bw) {
        int32_t width = cols - k0 < bw ? cols - k0 : bw;
        const uint16_t *wr[RM];
#pragma GCC unroll 8
        for (int i = 0; i < rm; i++) wr[i] = row_seg(w, r0 + i * sp, k0, width);
        const float *xr = x + k0;
        int32_t k = 0;
        for (; k + 16 <= width; k += 16) {
            __m512 wv[RM];
#pragma GCC unroll 8
            for (int i = 0; i < rm; i++) wv[i] = widen_bf16(_mm256_loadu_si256((const __m256i *)(wr[i] + k)));
#pragma GCC unroll 6
            for (int j = 0; j < rn; j++) {
                __m512 xv = _mm512_loadu_ps(xr + (size_t)j * xs + k);
#pragma GCC unroll 8
                for (int i = 0; i < rm; i++) acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
            }
        }
        if (k < width) { /* masked tail: zeros add nothing */
            __mmask16 m = (__mmask16)((1u << (width - k)) - 1);
            __m512 wv[RM];
#pragma GCC unroll 8
            for (int i = 0; i < rm; i++) wv[i] = widen_bf16(_mm256_maskz_loadu_epi16(m, wr[i] + k));
#pragma GCC unroll 6
            for (int j = 0; j < rn; j++) {
                __m512 xv = _mm512_maskz_loadu_ps(m, xr + (size_t)j * xs + k);
#pragma GCC unroll 8
                for (int i = 0; i < rm; i++) acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < rm; i++) {
        float b = mg_cpu_bias_at(bias, r0 + i * sp);
#pragma GCC unroll 6
        for (int j = 0; j < rn; j++) out[(size_t)j * os + r0 + i * sp] = _mm512_reduce_add_ps(acc[i][j]) + b;
    }
}

/* ---- avx512bf16: bf16 activations, kp (a multiple of 32) apart, zero-padded ---- */

static INLINE XBF16 void tile_bf16(const mg_cpu_weight *w, int32_t r0, int32_t sp, const int rm, const uint16_t *x,
                                   size_t xs, const int rn, const mg_cpu_weight *bias, float *out, size_t os) {
    __m512 acc[RM][RN];
#pragma GCC unroll 8
    for (int i = 0; i < rm; i++)
#pragma GCC unroll 6
        for (int j = 0; j < rn; j++) acc[i][j] = _mm512_setzero_ps();
    int32_t cols = w->cols, bw = w->tiled ? MG_CPU_TILE : cols;
    for (int32_t k0 = 0; k0 < cols; k0 += bw) {
        int32_t width = cols - k0 < bw ? cols - k0 : bw;
        const uint16_t *wr[RM];
#pragma GCC unroll 8
        for (int i = 0; i < rm; i++) wr[i] = row_seg(w, r0 + i * sp, k0, width);
        const uint16_t *xr = x + k0;
        int32_t k = 0;
        for (; k + 32 <= width; k += 32) {
            __m512bh wv[RM];
#pragma GCC unroll 8
            for (int i = 0; i < rm; i++) wv[i] = (__m512bh)_mm512_loadu_si512(wr[i] + k);
#pragma GCC unroll 6
            for (int j = 0; j < rn; j++) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + (size_t)j * xs + k);
#pragma GCC unroll 8
                for (int i = 0; i < rm; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[i], xv);
            }
        }
        if (k < width) { /* masked weight tail; x is zero-padded */
            __mmask32 m = (__mmask32)((1u << (width - k)) - 1);
            __m512bh wv[RM];
#pragma GCC unroll 8
            for (int i = 0; i < rm; i++) wv[i] = (__m512bh)_mm512_maskz_loadu_epi16(m, wr[i] + k);
#pragma GCC unroll 6
            for (int j = 0; j < rn; j++) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + (size_t)j * xs + k);
#pragma GCC unroll 8
                for (int i = 0; i < rm; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[i], xv);
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < rm; i++) {
        float b = mg_cpu_bias_at(bias, r0 + i * sp);
#pragma GCC unroll 6
        for (int j = 0; j < rn; j++) out[(size_t)j * os + r0 + i * sp] = _mm512_reduce_add_ps(acc[i][j]) + b;
    }
}

/* ---- one token (decode): the tiles' chains, rows spaced apart ----
 *
 * Decode reads each weight once, so its speed is the memory's. The old
 * one-token tile took 8 neighbouring rows at once: 8 streams 2 KiB apart,
 * in the same 4-KiB pages, which the Zen 4 core's prefetchers did not
 * follow (one thread, 1024-column rows from DRAM: 8 neighbours 13 GB/s, 2
 * neighbours 10, one row 20-26, 8 rows 16 apart 22-25; bf16 decode ran at
 * 0.57x the AVX2 path's, docs/performance.md). Here a group of up to G1
 * rows keeps its 16-lane accumulators in memory; for each column block the
 * register tile takes rows sp = n / RM1 apart (r, r + sp, ..., r + 7 sp),
 * the leftover n % RM1 rows last. Every lane's chain advances over the
 * columns in the same order as in tile_f32 / tile_bf16 and is summed the
 * same way, so a token gets the bits the tiles give it in a batch. */
enum { G1 = 128 };

static INLINE X512 void step1_f32(const mg_cpu_weight *w, int32_t r0, int32_t sp, const int rm, const float *x,
                                  int32_t k0, int32_t width, __m512 *acc) {
    __m512 a[RM1];
    const uint16_t *wr[RM1];
#pragma GCC unroll 8
    for (int i = 0; i < rm; i++) a[i] = acc[i * sp], wr[i] = row_seg(w, r0 + i * sp, k0, width);
    const float *xr = x + k0;
    int32_t k = 0;
    for (; k + 16 <= width; k += 16) {
        __m512 xv = _mm512_loadu_ps(xr + k);
#pragma GCC unroll 8
        for (int i = 0; i < rm; i++)
            a[i] = _mm512_fmadd_ps(widen_bf16(_mm256_loadu_si256((const __m256i *)(wr[i] + k))), xv, a[i]);
    }
    if (k < width) { /* masked tail: zeros add nothing */
        __mmask16 m = (__mmask16)((1u << (width - k)) - 1);
        __m512 xv = _mm512_maskz_loadu_ps(m, xr + k);
#pragma GCC unroll 8
        for (int i = 0; i < rm; i++) a[i] = _mm512_fmadd_ps(widen_bf16(_mm256_maskz_loadu_epi16(m, wr[i] + k)), xv, a[i]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < rm; i++) acc[i * sp] = a[i];
}

static INLINE XBF16 void step1_bf16(const mg_cpu_weight *w, int32_t r0, int32_t sp, const int rm, const uint16_t *x,
                                    int32_t k0, int32_t width, __m512 *acc) {
    __m512 a[RM1];
    const uint16_t *wr[RM1];
#pragma GCC unroll 8
    for (int i = 0; i < rm; i++) a[i] = acc[i * sp], wr[i] = row_seg(w, r0 + i * sp, k0, width);
    const uint16_t *xr = x + k0;
    int32_t k = 0;
    for (; k + 32 <= width; k += 32) {
        __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + k);
#pragma GCC unroll 8
        for (int i = 0; i < rm; i++) a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_loadu_si512(wr[i] + k), xv);
    }
    if (k < width) { /* masked weight tail; x is zero-padded */
        __mmask32 m = (__mmask32)((1u << (width - k)) - 1);
        __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + k);
#pragma GCC unroll 8
        for (int i = 0; i < rm; i++) a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_maskz_loadu_epi16(m, wr[i] + k), xv);
    }
#pragma GCC unroll 8
    for (int i = 0; i < rm; i++) acc[i * sp] = a[i];
}

/* rm rows r0, r0 + sp, ..., their accumulators acc[0], acc[sp], ... */
typedef void (*step1_fn)(const mg_cpu_weight *, int32_t, int32_t, const void *, int32_t, int32_t, __m512 *);
#define DEF_STEP1(r)                                                                                                 \
    static X512 void s1f32_##r(const mg_cpu_weight *w, int32_t r0, int32_t sp, const void *x, int32_t k0,            \
                               int32_t width, __m512 *acc) {                                                         \
        step1_f32(w, r0, sp, r, x, k0, width, acc);                                                                  \
    }                                                                                                                \
    static XBF16 void s1bf16_##r(const mg_cpu_weight *w, int32_t r0, int32_t sp, const void *x, int32_t k0,          \
                                 int32_t width, __m512 *acc) {                                                       \
        step1_bf16(w, r0, sp, r, x, k0, width, acc);                                                                 \
    }
DEF_STEP1(1) DEF_STEP1(2) DEF_STEP1(3) DEF_STEP1(4) DEF_STEP1(5) DEF_STEP1(6) DEF_STEP1(7) DEF_STEP1(8)
static const step1_fn steps1_f32[RM1] = {s1f32_1, s1f32_2, s1f32_3, s1f32_4, s1f32_5, s1f32_6, s1f32_7, s1f32_8};
static const step1_fn steps1_bf16[RM1] = {s1bf16_1, s1bf16_2, s1bf16_3, s1bf16_4,
                                          s1bf16_5, s1bf16_6, s1bf16_7, s1bf16_8};

/* out[r] for one token and rows r0..r1-1. */
static X512 void one_token(const step1_fn *steps, const mg_cpu_weight *w, int32_t r0, int32_t r1, const void *x,
                           const mg_cpu_weight *bias, float *out) {
    __m512 acc[G1];
    int32_t cols = w->cols, bw = w->tiled ? MG_CPU_TILE : cols;
    for (int32_t g0 = r0; g0 < r1; g0 += G1) {
        int32_t g1 = g0 + G1 < r1 ? g0 + G1 : r1;
        for (int32_t r = g0; r < g1; r++) acc[r - g0] = _mm512_setzero_ps();
        for (int32_t k0 = 0; k0 < cols; k0 += bw) {
            int32_t width = cols - k0 < bw ? cols - k0 : bw;
            /* rows g0 + r + i * sp together (sp rows apart), then the rest */
            int32_t n = g1 - g0, sp = n / RM1, rest = n % RM1;
            for (int32_t r = 0; r < sp; r++) steps[RM1 - 1](w, g0 + r, sp, x, k0, width, acc + r);
            if (rest) steps[rest - 1](w, g0 + sp * RM1, 1, x, k0, width, acc + sp * RM1);
        }
        for (int32_t r = g0; r < g1; r++) out[r] = _mm512_reduce_add_ps(acc[r - g0]) + mg_cpu_bias_at(bias, r);
    }
}

/* Every (rm, rn) shape as its own unrolled function, so the accumulators live
 * in registers. */
#define SHAPES(F) \
    F(1, 1) F(1, 2) F(1, 3) F(1, 4) F(1, 5) F(1, 6) F(2, 1) F(2, 2) F(2, 3) F(2, 4) F(2, 5) F(2, 6) \
    F(3, 1) F(3, 2) F(3, 3) F(3, 4) F(3, 5) F(3, 6) F(4, 1) F(4, 2) F(4, 3) F(4, 4) F(4, 5) F(4, 6)

/* rm rows r0, r0 + sp, ... times rn tokens */
typedef void (*tile_fn)(const mg_cpu_weight *, int32_t, int32_t, const void *, size_t, const mg_cpu_weight *, float *,
                        size_t);

#define DEF_F32(a, b)                                                                                                \
    static X512 void f32_##a##x##b(const mg_cpu_weight *w, int32_t r0, int32_t sp, const void *x, size_t xs,         \
                                   const mg_cpu_weight *bias, float *out, size_t os) {                               \
        tile_f32(w, r0, sp, a, x, xs, b, bias, out, os);                                                             \
    }
#define DEF_BF16(a, b)                                                                                               \
    static XBF16 void bf16_##a##x##b(const mg_cpu_weight *w, int32_t r0, int32_t sp, const void *x, size_t xs,       \
                                     const mg_cpu_weight *bias, float *out, size_t os) {                             \
        tile_bf16(w, r0, sp, a, x, xs, b, bias, out, os);                                                            \
    }
SHAPES(DEF_F32)
SHAPES(DEF_BF16)
#define REF_F32(a, b) f32_##a##x##b,
#define REF_BF16(a, b) bf16_##a##x##b,
static const tile_fn tiles_f32[RM * RN] = {SHAPES(REF_F32)};
static const tile_fn tiles_bf16[RM * RN] = {SHAPES(REF_BF16)};

/* x [n, cols] f32 -> [n, kp] bf16, round to nearest even, zeros past cols. */
static XBF16 void to_bf16_rows(const float *x, int32_t n, int32_t cols, int32_t kp, uint16_t *xb) {
    for (int32_t t = 0; t < n; t++) {
        const float *s = x + (size_t)t * cols;
        uint16_t *d = xb + (size_t)t * kp;
        int32_t k = 0;
        for (; k + 32 <= cols; k += 32) {
            __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + k + 16), _mm512_loadu_ps(s + k));
            _mm512_storeu_si512(d + k, (__m512i)v);
        }
        for (; k < cols; k++) d[k] = mg_f32_to_bf16(s[k]);
        for (; k < kp; k++) d[k] = 0;
    }
}

/* ---- the parallel loop ---- */

struct x512_job {
    const tile_fn *tiles;  /* [rm-1][rn-1] */
    const step1_fn *steps1; /* one token: [rm-1] */
    const void *x; /* f32 [n, cols] or bf16 [n, kp] */
    size_t xs;     /* elements between tokens of x */
    int32_t n, tb; /* tokens; tokens per chunk */
    const mg_cpu_weight *w[MG_MATMUL_MAX], *bias[MG_MATMUL_MAX];
    float *out[MG_MATMUL_MAX];
    int32_t rb[MG_MATMUL_MAX];              /* rows per chunk, a multiple of RM1 */
    int64_t first_chunk[MG_MATMUL_MAX + 1]; /* matrix m owns first_chunk[m]..first_chunk[m+1]-1 */
    size_t esz;                             /* bytes per element of x */
};

/* A chunk is rb rows of one weight times tb tokens: the rows stay in L2 while
 * the tokens pass them RN at a time, each RM-row tile in L1 meanwhile. */
static void x512_chunk(void *ctx, int64_t chunk, int ith) {
    (void)ith;
    struct x512_job *j = ctx;
    int m = 0;
    while (chunk >= j->first_chunk[m + 1]) m++;
    const mg_cpu_weight *w = j->w[m];
    int64_t c = chunk - j->first_chunk[m];
    int64_t ntb = (j->n + j->tb - 1) / j->tb;
    int32_t r0 = (int32_t)(c / ntb) * j->rb[m], t0 = (int32_t)(c % ntb) * j->tb;
    int32_t r1 = r0 + j->rb[m] < w->rows ? r0 + j->rb[m] : w->rows;
    int32_t t1 = t0 + j->tb < j->n ? t0 + j->tb : j->n;
    size_t os = (size_t)w->rows;
    if (t1 - t0 == 1) {
        const char *xt = (const char *)j->x + (size_t)t0 * j->xs * j->esz;
        one_token(j->steps1, w, r0, r1, xt, j->bias[m], j->out[m] + (size_t)t0 * os);
        return;
    }
    /* A few tokens read the rows at memory's pace: tile q takes rows
     * r0 + q + i * full, as one_token does for the prefetchers (2 and 8
     * tokens 1.1-1.2x on Zen 4, alternating A/B); more tokens, bound by the
     * FMAs, take neighbouring rows (spaced, 64 tokens ran 5% slower in one
     * A/B). The rest last. */
    int32_t full = (r1 - r0) / RM, rest = (r1 - r0) % RM;
    int spaced = t1 - t0 <= 8;
    for (int32_t q = 0; q < full + (rest > 0); q++) {
        int32_t r = q == full ? r0 + full * RM : spaced ? r0 + q : r0 + q * RM;
        int32_t rs = q < full && spaced ? full : 1;
        int rm = q == full ? rest : RM;
        for (int32_t t = t0; t < t1; t += RN) {
            int rn = t1 - t < RN ? t1 - t : RN;
            const char *xt = (const char *)j->x + (size_t)t * j->xs * j->esz;
            j->tiles[(rm - 1) * RN + (rn - 1)](w, r, rs, xt, j->xs, j->bias[m], j->out[m] + (size_t)t * os, os);
        }
    }
}

int mg_cpu_matmul_multi_avx512(struct mg_pool *pool, int isa, const float *x, int32_t n, int32_t count,
                               const mg_cpu_weight *const *ws, const mg_cpu_weight *const *biases, float *const *outs) {
    if (isa != MG_ISA_AVX512F && isa != MG_ISA_AVX512BF16) return 0;
    if (count <= 0 || count > MG_MATMUL_MAX || n <= 0) return 0;
    int64_t macs = 0;
    for (int m = 0; m < count; m++) {
        if (ws[m]->dtype != DT_BF16 || ws[m]->cols != ws[0]->cols) return 0;
        macs += (int64_t)ws[m]->rows * ws[m]->cols * n;
    }
    int32_t cols = ws[0]->cols;
    struct x512_job j;
    memset(&j, 0, sizeof j);
    uint16_t *xb = NULL;
    if (isa == MG_ISA_AVX512BF16) {
        int32_t kp = (cols + 31) / 32 * 32;
        xb = malloc((size_t)n * (size_t)kp * 2);
        if (!xb) return 0; /* the caller's path needs no scratch of this size */
        to_bf16_rows(x, n, cols, kp, xb);
        j.tiles = tiles_bf16, j.steps1 = steps1_bf16, j.x = xb, j.xs = (size_t)kp, j.esz = 2;
    } else {
        j.tiles = tiles_f32, j.steps1 = steps1_f32, j.x = x, j.xs = (size_t)cols, j.esz = 4;
    }
    j.n = n;
    int nth = mg_pool_threads(pool);
    if (macs < (1 << 20)) { /* waking workers costs more than it saves */
        pool = NULL;
        nth = 1;
    }
    /* Tokens per chunk: a block of x that stays in L2 (~512 KiB), in whole
     * register tiles; at most n. */
    int32_t tb = (int32_t)((512 << 10) / ((size_t)cols * j.esz)) / RN * RN;
    if (tb < RN) tb = RN;
    if (tb > n) tb = n;
    j.tb = tb;
    int64_t ntb = (n + tb - 1) / tb;
    for (int m = 0; m < count; m++) {
        j.w[m] = ws[m];
        j.bias[m] = biases ? biases[m] : NULL;
        j.out[m] = outs[m];
        /* Rows per chunk: about 1 MiB of weights, which stays in L2 while the
         * chunk's tokens pass (every row block reads x once from L3), but
         * enough chunks to balance threads the OS schedules unevenly. */
        int64_t rows = ws[m]->rows;
        int64_t rb = ((int64_t)1 << 20) / ((int64_t)cols * 2);
        int64_t most = rows * ntb / ((int64_t)nth * 8);
        if (rb > most) rb = most;
        rb = rb / RM1 * RM1; /* whole tiles of either size */
        if (rb < RM1) rb = RM1;
        if (nth == 1 || rb > rows) rb = rows;
        j.rb[m] = (int32_t)rb;
        j.first_chunk[m + 1] = j.first_chunk[m] + (ws[m]->rows + rb - 1) / rb * ntb;
    }
    mg_pool_for(pool, j.first_chunk[count], x512_chunk, &j);
    free(xb);
    return 1;
}

/* ---- prompt steps: f32 products, tokens in the lanes ----
 *
 * Prompt steps (cpu_backend.c step_path: MG_PATH_PROMPT) of quantized
 * weights take f32 products on the weights dequantized exactly as ggml
 * defines them (mg_cpu_qprep_row's q and scales, then w = s * q - m, each
 * rounded: mg_cpu_dequant_row's values) instead of the 16-bit integer
 * products decode uses (cpu_quant.c), whose three integer-unit
 * instructions per 64 products share one port where f32 FMAs have two
 * (Intel); unless mg_cpu_prompt_q16 chose cpu_matmul_q16prompt.c, as on
 * Zen 4, where one vpdpwssd does twice an FMA's products at its rate. The
 * prompt rows' results differ from what the same tokens get through the
 * 16-bit path by that path's rounding of the activations (below 2^-16 of a
 * group's largest), far below the bf16 hop rounding an audit tolerates.
 * bf16 weights (on avx512f) take the same kernel on their rows widened to
 * f32: decode's products summed in another order (one chain per output,
 * where decode's tiles keep 16 lanes), so a prompt's rows differ from
 * decode's in the last bits.
 *
 * Tokens go in the lanes: the call's activations are transposed once into
 * panels of TP tokens ([cols][TP], zero-padded), and a register tile of
 * up to PR rows x 3 zmm of tokens advances each output (row r, token t) as
 * one f32 FMA chain over the columns in order, weights broadcast from the
 * dequantized rows: 11 loads per 24 FMAs, from L1 and L2. An output's
 * arithmetic is the same wherever its token sits in the call, so a step's
 * bits do not depend on its batch or on the threads.
 *
 * A chunk is a block of one weight's rows (about 512 KiB as f32, in L2),
 * dequantized once and passed by every token panel. */

enum { PR = 8, PZ = 3, TP = 16 * PZ };
/* Columns per pass: a panel's KC columns (24 KiB) stay in L1 while every
 * row tile of the chunk passes over them; the tiles' accumulators wait in
 * the thread's buffer between passes. */
enum { KC = 128 }; /* 64, 256 and 512 measured within noise of it */

/* The rm rows (w, cols apart) x nz zmm of tokens tile over columns
 * k0..k0+kw-1 of panel xt ([cols][TP]), its accumulators in acc16
 * ([PR][PZ] zmm) between passes; the last pass writes out[t, r0 + i] for
 * the panel's first nt tokens. */
static INLINE X512 void tile_tp(const float *w, int32_t cols, const int rm, const float *xt, const int nz, int32_t nt,
                                int32_t k0, int32_t kw, float *acc16, const mg_cpu_weight *bias, int32_t r0, float *out,
                                size_t os) {
    __m512 acc[PR][PZ];
#pragma GCC unroll 8
    for (int i = 0; i < rm; i++)
#pragma GCC unroll 3
        for (int c = 0; c < nz; c++) acc[i][c] = k0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(acc16 + (i * PZ + c) * 16);
#pragma GCC unroll 2
    for (int32_t k = k0; k < k0 + kw; k++) {
        __m512 xv[PZ];
#pragma GCC unroll 3
        for (int c = 0; c < nz; c++) xv[c] = _mm512_loadu_ps(xt + (size_t)k * TP + 16 * c);
#pragma GCC unroll 8
        for (int i = 0; i < rm; i++) {
            const __m512 wv = _mm512_set1_ps(w[(size_t)i * cols + k]);
#pragma GCC unroll 3
            for (int c = 0; c < nz; c++) acc[i][c] = _mm512_fmadd_ps(wv, xv[c], acc[i][c]);
        }
    }
    if (k0 + kw < cols) {
#pragma GCC unroll 8
        for (int i = 0; i < rm; i++)
#pragma GCC unroll 3
            for (int c = 0; c < nz; c++) _mm512_store_ps(acc16 + (i * PZ + c) * 16, acc[i][c]);
        return;
    }
    float lanes[16] __attribute__((aligned(64)));
#pragma GCC unroll 8
    for (int i = 0; i < rm; i++) {
        const float b = mg_cpu_bias_at(bias, r0 + i);
        for (int c = 0; c < nz; c++) {
            _mm512_store_ps(lanes, acc[i][c]);
            for (int l = 0; l < 16 && 16 * c + l < nt; l++) out[(size_t)(16 * c + l) * os + r0 + i] = lanes[l] + b;
        }
    }
}

typedef void (*tiletp_fn)(const float *, int32_t, const float *, int32_t, int32_t, int32_t, float *, const mg_cpu_weight *,
                          int32_t, float *, size_t);
#define DEF_TP(a, b)                                                                                                   \
    static X512 void tp_##a##x##b(const float *w, int32_t cols, const float *xt, int32_t nt, int32_t k0, int32_t kw,    \
                                  float *acc16, const mg_cpu_weight *bias, int32_t r0, float *out, size_t os) {         \
        tile_tp(w, cols, a, xt, b, nt, k0, kw, acc16, bias, r0, out, os);                                               \
    }
#define SHAPES_TP(F) \
    F(1, 1) F(1, 2) F(1, 3) F(2, 1) F(2, 2) F(2, 3) F(3, 1) F(3, 2) F(3, 3) F(4, 1) F(4, 2) F(4, 3) \
    F(5, 1) F(5, 2) F(5, 3) F(6, 1) F(6, 2) F(6, 3) F(7, 1) F(7, 2) F(7, 3) F(8, 1) F(8, 2) F(8, 3)
SHAPES_TP(DEF_TP)
#define REF_TP(a, b) tp_##a##x##b,
static const tiletp_fn tiles_tp[PR * PZ] = {SHAPES_TP(REF_TP)};

/* A prep buffer's row (mg_cpu_qprep_row) as f32: s * q - m per element,
 * each rounded (mg_cpu_dequant_row's arithmetic, no fused multiply-add). */
static X512 void dequant_prep(int32_t dtype, const float *prep, int32_t cols, float *w) {
    const int16_t *q = (const int16_t *)prep;
    const int32_t gl = mg_cpu_quant_group(dtype);
    const float *sc = prep + cols / 2, *dm = sc + cols / gl;
    const int mins = mg_cpu_quant_has_min(dtype);
    for (int32_t g = 0; g < cols / gl; g++) {
        const __m512 s = _mm512_set1_ps(sc[g]), m = _mm512_set1_ps(mins ? dm[g] : 0.0f);
        for (int32_t e = 0; e < gl; e += 16) {
            const int32_t i = g * gl + e;
            __m512 v = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(q + i)))));
            _mm512_storeu_ps(w + i, mins ? _mm512_sub_ps(v, m) : v);
        }
    }
}

/* Row r of a bf16 matrix (row-major or tiled) as f32 (exact). */
static X512 void widen_row(const mg_cpu_weight *wt, int32_t r, float *w) {
    const int32_t cols = wt->cols, bw = wt->tiled ? MG_CPU_TILE : cols;
    for (int32_t k0 = 0; k0 < cols; k0 += bw) {
        const int32_t width = cols - k0 < bw ? cols - k0 : bw;
        const uint16_t *src = row_seg(wt, r, k0, width);
        int32_t k = 0;
        for (; k + 16 <= width; k += 16) _mm512_storeu_ps(w + k0 + k, widen_bf16(_mm256_loadu_si256((const __m256i *)(src + k))));
        for (; k < width; k++) w[k0 + k] = mg_bf16_to_f32(src[k]);
    }
}

/* x [n, cols] -> panels of TP tokens, each [cols][TP], zeros past n. */
static X512 void to_panels(const float *x, int32_t n, int32_t cols, float *xt) {
    for (int32_t p = 0; p * TP < n; p++) {
        float *d = xt + (size_t)p * cols * TP;
        const int32_t t0 = p * TP, nt = n - t0 < TP ? n - t0 : TP;
        for (int32_t k0 = 0; k0 < cols; k0 += 16) { /* 16 columns of every token at a time: rows of x read in lines */
            const int32_t kw = cols - k0 < 16 ? cols - k0 : 16;
            for (int32_t t = 0; t < TP; t++)
                for (int32_t k = 0; k < kw; k++) d[(size_t)(k0 + k) * TP + t] = t < nt ? x[(size_t)(t0 + t) * cols + k0 + k] : 0.0f;
        }
    }
}

struct xq_job {
    const float *xt; /* to_panels */
    int32_t n, cols, isa;
    const mg_cpu_weight *w[MG_MATMUL_MAX], *bias[MG_MATMUL_MAX];
    float *out[MG_MATMUL_MAX];
    int32_t rb;                             /* rows per chunk, a multiple of PR */
    int64_t first_chunk[MG_MATMUL_MAX + 1]; /* matrix m owns first_chunk[m]..first_chunk[m+1]-1 */
    float *buf[256];                        /* per thread: the accumulators, rb dequantized rows, one prep row */
    int failed;
};

static void xq_chunk(void *ctx, int64_t chunk, int ith) {
    struct xq_job *j = ctx;
    int m = 0;
    while (chunk >= j->first_chunk[m + 1]) m++;
    const mg_cpu_weight *wt = j->w[m];
    const int32_t cols = j->cols, n = j->n;
    const int32_t r0 = (int32_t)(chunk - j->first_chunk[m]) * j->rb, r1 = r0 + j->rb < wt->rows ? r0 + j->rb : wt->rows;
    const size_t afloats = (size_t)j->rb / PR * PR * PZ * 16, wfloats = (size_t)j->rb * (size_t)cols;
    float *acc16 = j->buf[ith];
    if (!acc16) {
        acc16 = j->buf[ith] = aligned_alloc(64, (afloats + wfloats + mg_cpu_qprep_floats(cols) + 15) / 16 * 64);
        if (!acc16) {
            __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
            return;
        }
    }
    float *w = acc16 + afloats, *prep = w + wfloats;
    if (wt->dtype == DT_BF16)
        for (int32_t r = r0; r < r1; r++) widen_row(wt, r, w + (size_t)(r - r0) * cols);
    else {
        const size_t rbytes = mg_cpu_quant_row_bytes(wt->dtype, cols);
        for (int32_t r = r0; r < r1; r++) {
            mg_cpu_qprep_row(j->isa, wt->dtype, (const char *)wt->data + (size_t)r * rbytes, cols, prep);
            dequant_prep(wt->dtype, prep, cols, w + (size_t)(r - r0) * cols);
        }
    }
    const size_t os = (size_t)wt->rows;
    for (int32_t t0 = 0; t0 < n; t0 += TP) {
        const int32_t nt = n - t0 < TP ? n - t0 : TP, nz = (nt + 15) / 16;
        const float *xt = j->xt + (size_t)(t0 / TP) * cols * TP;
        for (int32_t k0 = 0; k0 < cols; k0 += KC) {
            const int32_t kw = cols - k0 < KC ? cols - k0 : KC;
            for (int32_t r = r0; r < r1; r += PR) {
                const int rm = r1 - r < PR ? r1 - r : PR;
                tiles_tp[(rm - 1) * PZ + (nz - 1)](w + (size_t)(r - r0) * cols, cols, xt, nt, k0, kw,
                                                   acc16 + (size_t)(r - r0) / PR * PR * PZ * 16, j->bias[m], r,
                                                   j->out[m] + (size_t)t0 * os, os);
            }
        }
    }
}

int mg_cpu_matmul_prompt_avx512(struct mg_pool *pool, int isa, const float *x, int32_t n, int32_t count,
                                const mg_cpu_weight *const *ws, const mg_cpu_weight *const *biases, float *const *outs) {
    int quant = count > 0 && (isa == MG_ISA_AVX512F || isa == MG_ISA_AVX512BF16);
    for (int m = 0; m < count && m < MG_MATMUL_MAX; m++) quant &= mg_cpu_is_quant(ws[m]->dtype);
    if (quant && mg_cpu_prompt_q16() && mg_cpu_matmul_prompt_q16(pool, isa, x, n, count, ws, biases, outs)) return 1;
    return mg_cpu_matmul_prompt_f32(pool, isa, x, n, count, ws, biases, outs);
}

int mg_cpu_matmul_prompt_f32(struct mg_pool *pool, int isa, const float *x, int32_t n, int32_t count,
                             const mg_cpu_weight *const *ws, const mg_cpu_weight *const *biases, float *const *outs) {
    if (isa != MG_ISA_AVX512F && isa != MG_ISA_AVX512BF16) return 0;
    if (count <= 0 || count > MG_MATMUL_MAX || n <= 0) return 0;
    const int32_t cols = ws[0]->cols;
    for (int m = 0; m < count; m++)
        if (!(mg_cpu_is_quant(ws[m]->dtype) || (ws[m]->dtype == DT_BF16 && isa == MG_ISA_AVX512F)) || ws[m]->cols != cols)
            return 0; /* avx512bf16 keeps its bf16 products for bf16 weights */
    struct xq_job *j = calloc(1, sizeof *j);
    float *xt = malloc((size_t)(n + TP - 1) / TP * TP * (size_t)cols * sizeof(float));
    if (!j || !xt) {
        free(j), free(xt);
        return 0;
    }
    to_panels(x, n, cols, xt);
    j->xt = xt, j->n = n, j->cols = cols, j->isa = isa;
    int nth = mg_pool_threads(pool);
    /* Rows per chunk: about 512 KiB of f32 weights, which stay in L2 while
     * every token panel passes, but enough chunks to balance threads the OS
     * schedules unevenly. */
    int64_t rows = 0;
    for (int m = 0; m < count; m++) rows += ws[m]->rows;
    int64_t rb = ((int64_t)512 << 10) / ((int64_t)cols * 4), most = rows / ((int64_t)nth * 8);
    if (rb > most) rb = most;
    rb = rb / PR * PR;
    if (rb < PR) rb = PR;
    j->rb = (int32_t)rb;
    for (int m = 0; m < count; m++) {
        j->w[m] = ws[m];
        j->bias[m] = biases ? biases[m] : NULL;
        j->out[m] = outs[m];
        j->first_chunk[m + 1] = j->first_chunk[m] + (ws[m]->rows + rb - 1) / rb;
    }
    mg_pool_for(nth > 1 ? pool : NULL, j->first_chunk[count], xq_chunk, j);
    for (int i = 0; i < 256; i++) free(j->buf[i]);
    int ok = !j->failed;
    free(j);
    free(xt);
    return ok; /* 0: the caller's path, from the start (every output is written again) */
}

/* ---- which tile is faster on this CPU ---- */

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

/* The 4x6 tile of each path on data that stays in L1/L2 (4 rows x 2048
 * columns of weights, 6 tokens), so the numbers are the instructions'
 * rates, not memory's: the best of 5 alternated rounds of 64 calls each.
 * About 2 ms on one core; called once, on the first use of the default. */
static double bf16_speedup;

static void measure_bf16_speedup(void) {
    enum { COLS = 2048, REPS = 64, ROUNDS = 5 };
    uint16_t *wd = malloc((size_t)RM * COLS * 2), *xb = malloc((size_t)RN * COLS * 2);
    float *xf = malloc((size_t)RN * COLS * 4), out[RN * RM];
    if (!wd || !xb || !xf) {
        free(wd), free(xb), free(xf);
        bf16_speedup = 0; /* unknown: the default keeps f32 */
        return;
    }
    for (int i = 0; i < RM * COLS; i++) wd[i] = mg_f32_to_bf16((float)((i * 37 % 101) - 50) * 1e-3f);
    for (int i = 0; i < RN * COLS; i++) xf[i] = (float)((i * 53 % 97) - 48) * 1e-2f, xb[i] = mg_f32_to_bf16(xf[i]);
    mg_cpu_weight w = {.dtype = DT_BF16, .data = wd, .rows = RM, .cols = COLS, .tiled = 0};
    double best_f = 1e30, best_b = 1e30;
    for (int r = 0; r < ROUNDS; r++) {
        double t0 = now_ns();
        for (int i = 0; i < REPS; i++) f32_4x6(&w, 0, 1, xf, COLS, NULL, out, RM);
        double t1 = now_ns();
        for (int i = 0; i < REPS; i++) bf16_4x6(&w, 0, 1, xb, COLS, NULL, out, RM);
        double t2 = now_ns();
        if (t1 - t0 < best_f) best_f = t1 - t0;
        if (t2 - t1 < best_b) best_b = t2 - t1;
    }
    free(wd), free(xb), free(xf);
    bf16_speedup = best_b > 0 ? best_f / best_b : 0;
}

double mg_cpu_bf16_speedup(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    if (!mg_cpu_isa_supported(MG_ISA_AVX512BF16)) return 0;
    pthread_once(&once, measure_bf16_speedup);
    return bf16_speedup;
}

#else /* not x86-64 GCC/Clang: no AVX-512 paths */

double mg_cpu_bf16_speedup(void) { return 0; }

int mg_cpu_matmul_multi_avx512(struct mg_pool *pool, int isa, const float *x, int32_t n, int32_t count,
                               const mg_cpu_weight *const *ws, const mg_cpu_weight *const *biases, float *const *outs) {
    (void)pool, (void)isa, (void)x, (void)n, (void)count, (void)ws, (void)biases, (void)outs;
    return 0;
}

int mg_cpu_matmul_prompt_avx512(struct mg_pool *pool, int isa, const float *x, int32_t n, int32_t count,
                                      const mg_cpu_weight *const *ws, const mg_cpu_weight *const *biases, float *const *outs) {
    (void)pool, (void)isa, (void)x, (void)n, (void)count, (void)ws, (void)biases, (void)outs;
    return 0;
}

int mg_cpu_matmul_prompt_f32(struct mg_pool *pool, int isa, const float *x, int32_t n, int32_t count,
                             const mg_cpu_weight *const *ws, const mg_cpu_weight *const *biases, float *const *outs) {
    (void)pool, (void)isa, (void)x, (void)n, (void)count, (void)ws, (void)biases, (void)outs;
    return 0;
}

#endif

/*
 * cpu_matmul_avx2.c: bf16-weight matrix products for several tokens on AVX2
 * (prefill chunks and decode batches): register tiles of 3 weight rows x 4
 * tokens, 12 accumulators, each weight and activation load used 3-4 times.
 *
 * The same bits as cpu_kernels.c's one-row path (dot_bf16 / dot_perm): that
 * path keeps four 8-lane accumulators a0..a3, where aq takes the 8 elements
 * q of every 32-element block (in bf16 order), and returns
 * hsum8((a0 + a1) + (a2 + a3)) plus a scalar tail. Each aq is a chain of
 * multiply-adds independent of the other three, so here the row and the
 * tokens are stored "q-major" (the q = 0 pieces of every block, then q = 1,
 * ...; the tail last) and the tile runs the four chains one after another
 * over contiguous memory, combining them in the same order at the end. A
 * session's result therefore does not depend on the batch it is in, nor on
 * which path ran, and the golden tests see the bits they always saw.
 */
#include "cpu_kernels.h"

#if defined(__AVX2__) && defined(__FMA__)

#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_pool.h"

#define INLINE inline __attribute__((always_inline))

enum { DT_BF16 = 2 };
enum { RM = 3, RN = 4 }; /* register tile: 12 accumulators + 3 weights + 1 token = 16 ymm */
enum { MAX_RB = 48 };     /* rows per chunk at most (a multiple of RM) */

/* cpu_kernels.c's hsum8: the same adds in the same order. */
static INLINE float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* A token's activations in q-major order: the piece q of block b (bf16 order:
 * q0 = 0-3 8-11, q1 = 4-7 12-15, q2 = 16-19 24-27, q3 = 20-23 28-31) at
 * q * nb * 8 + b * 8, then the cols % 32 tail in place. */
static void x_qmajor(const float *x, int32_t cols, float *dst) {
    int32_t nb = cols / 32;
    size_t s = (size_t)nb * 8;
    for (int32_t b = 0; b < nb; b++) {
        const float *p = x + (size_t)b * 32;
        __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8), v2 = _mm256_loadu_ps(p + 16),
               v3 = _mm256_loadu_ps(p + 24);
        float *d = dst + (size_t)b * 8;
        _mm256_storeu_ps(d, _mm256_permute2f128_ps(v0, v1, 0x20));
        _mm256_storeu_ps(d + s, _mm256_permute2f128_ps(v0, v1, 0x31));
        _mm256_storeu_ps(d + 2 * s, _mm256_permute2f128_ps(v2, v3, 0x20));
        _mm256_storeu_ps(d + 3 * s, _mm256_permute2f128_ps(v2, v3, 0x31));
    }
    memcpy(dst + 4 * s, x + 4 * s, (size_t)(cols - 4 * (int32_t)s) * sizeof(float));
}

/* Row r of a bf16 matrix widened to f32 in q-major order (row-major or
 * MG_CPU_TILE column blocks, whose widths are multiples of 32). */
static void w_qmajor(const mg_cpu_weight *w, int32_t r, float *dst) {
    int32_t cols = w->cols, nb = cols / 32;
    size_t s = (size_t)nb * 8;
    const __m256i z = _mm256_setzero_si256();
    const uint16_t *base = w->data, *row = base + (size_t)r * cols;
    for (int32_t b = 0; b < nb; b++) {
        int32_t c = b * 32;
        const uint16_t *p = row + c;
        if (w->tiled) {
            int32_t k0 = c / MG_CPU_TILE * MG_CPU_TILE, width = cols - k0 < MG_CPU_TILE ? cols - k0 : MG_CPU_TILE;
            p = base + (size_t)k0 * (size_t)w->rows + (size_t)r * width + (c - k0);
        }
        __m256i v0 = _mm256_loadu_si256((const __m256i *)p), v1 = _mm256_loadu_si256((const __m256i *)(p + 16));
        float *d = dst + (size_t)b * 8;
        _mm256_storeu_si256((__m256i *)d, _mm256_unpacklo_epi16(z, v0));
        _mm256_storeu_si256((__m256i *)(d + s), _mm256_unpackhi_epi16(z, v0));
        _mm256_storeu_si256((__m256i *)(d + 2 * s), _mm256_unpacklo_epi16(z, v1));
        _mm256_storeu_si256((__m256i *)(d + 3 * s), _mm256_unpackhi_epi16(z, v1));
    }
    for (int32_t c = 4 * (int32_t)s; c < cols; c++) dst[c] = mg_bf16_to_f32(row[c]); /* tiled only when cols % 32 == 0 */
}

/* One of the four chains (q) of an rm-row x rn-token tile: rm widened rows
 * and rn q-major tokens, both cols floats apart. The chains' partial sums
 * wait in st (2 * RM * RN vectors: a0 + a1, then a2) between calls; the last
 * chain writes out[j * os + i] = x_j . w_i + bias_i. Running one chain over
 * every row of a chunk before the next keeps the tokens' quarter rows in L1. */
static INLINE void tile(const float *wq, const int rm, const float *xq, const int rn, int32_t cols, int q, __m256 *st,
                        const float *bias, float *out, size_t os) {
    int32_t nb = cols / 32;
    size_t s = (size_t)nb * 8;
    __m256 acc[RM][RN];
#pragma GCC unroll 3
    for (int i = 0; i < rm; i++)
#pragma GCC unroll 4
        for (int j = 0; j < rn; j++) acc[i][j] = _mm256_setzero_ps();
    const float *wp = wq + (size_t)q * s, *xp = xq + (size_t)q * s;
    for (size_t k = 0; k < s; k += 8) {
        __m256 wv[RM];
#pragma GCC unroll 3
        for (int i = 0; i < rm; i++) wv[i] = _mm256_loadu_ps(wp + (size_t)i * cols + k);
#pragma GCC unroll 4
        for (int j = 0; j < rn; j++) {
            __m256 xv = _mm256_loadu_ps(xp + (size_t)j * cols + k);
#pragma GCC unroll 3
            for (int i = 0; i < rm; i++) acc[i][j] = _mm256_fmadd_ps(xv, wv[i], acc[i][j]);
        }
    }
    __m256 *s01 = st, *a2 = st + RM * RN;
    int32_t t0 = 4 * (int32_t)s;
#pragma GCC unroll 3
    for (int i = 0; i < rm; i++)
#pragma GCC unroll 4
        for (int j = 0; j < rn; j++) {
            __m256 *p = &s01[i * RN + j];
            if (q == 0) *p = acc[i][j];
            else if (q == 1) *p = _mm256_add_ps(*p, acc[i][j]);
            else if (q == 2) a2[i * RN + j] = acc[i][j];
            else { /* (a0 + a1) + (a2 + a3), hsum8, the tail, the bias: dot_perm's order */
                const float *w = wq + (size_t)i * cols, *x = xq + (size_t)j * cols;
                float v = hsum8(_mm256_add_ps(*p, _mm256_add_ps(a2[i * RN + j], acc[i][j])));
                for (int32_t c = t0; c < cols; c++) v += x[c] * w[c];
                out[(size_t)j * os + i] = v + (bias ? bias[i] : 0.0f);
            }
        }
}

typedef void (*tile_fn)(const float *, const float *, int32_t, int, __m256 *, const float *, float *, size_t);
#define SHAPES(F) F(1, 1) F(1, 2) F(1, 3) F(1, 4) F(2, 1) F(2, 2) F(2, 3) F(2, 4) F(3, 1) F(3, 2) F(3, 3) F(3, 4)
#define DEF(a, b)                                                                                                  \
    static void tile_##a##x##b(const float *wq, const float *xq, int32_t cols, int q, __m256 *st, const float *bias, \
                               float *out, size_t os) {                                                          \
        tile(wq, a, xq, b, cols, q, st, bias, out, os);                                                          \
    }
#define REF(a, b) tile_##a##x##b,
SHAPES(DEF)
static const tile_fn tiles[RM * RN] = {SHAPES(REF)};

struct avx2_job {
    const float *xq; /* [n, cols] q-major */
    int32_t n, cols, tb, rb[MG_MATMUL_MAX];
    const mg_cpu_weight *w[MG_MATMUL_MAX], *bias[MG_MATMUL_MAX];
    float *out[MG_MATMUL_MAX];
    int64_t first_chunk[MG_MATMUL_MAX + 1]; /* matrix m owns first_chunk[m]..first_chunk[m+1]-1 */
    float *wbuf[256];                       /* per thread: rb rows widened, allocated on first use */
    size_t wbuf_floats;
    int failed;
};

/* A chunk is rb rows of one weight times tb tokens: the rows are widened
 * once into the thread's buffer (in L2), then every 4 tokens pass them 3
 * rows at a time, one chain (a quarter of each row) after another. */
static void avx2_chunk(void *ctx, int64_t chunk, int ith) {
    struct avx2_job *j = ctx;
    int m = 0;
    while (chunk >= j->first_chunk[m + 1]) m++;
    const mg_cpu_weight *w = j->w[m];
    int64_t c = chunk - j->first_chunk[m], ntb = (j->n + j->tb - 1) / j->tb;
    int32_t r0 = (int32_t)(c / ntb) * j->rb[m], t0 = (int32_t)(c % ntb) * j->tb, cols = j->cols;
    int32_t r1 = r0 + j->rb[m] < w->rows ? r0 + j->rb[m] : w->rows, t1 = t0 + j->tb < j->n ? t0 + j->tb : j->n;
    float *wq = j->wbuf[ith];
    if (!wq) {
        wq = j->wbuf[ith] = malloc(j->wbuf_floats * sizeof(float));
        if (!wq) {
            __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
            return;
        }
    }
    for (int32_t r = r0; r < r1; r++) w_qmajor(w, r, wq + (size_t)(r - r0) * cols);
    float bias[MAX_RB];
    const mg_cpu_weight *b = j->bias[m];
    for (int32_t r = r0; r < r1; r++) /* f32 in the backend; bf16 only in tests */
        bias[r - r0] = !b ? 0.0f : b->dtype == 0 ? ((const float *)b->data)[r] : mg_bf16_to_f32(((const uint16_t *)b->data)[r]);
    __m256 st[MAX_RB / RM][2 * RM * RN]; /* the chains' partial sums, per row tile */
    size_t os = (size_t)w->rows;
    for (int32_t t = t0; t < t1; t += RN) {
        int rn = t1 - t < RN ? t1 - t : RN;
        for (int q = 0; q < 4; q++)
            for (int32_t r = r0; r < r1; r += RM) {
                int rm = r1 - r < RM ? r1 - r : RM;
                tiles[(rm - 1) * RN + (rn - 1)](wq + (size_t)(r - r0) * cols, j->xq + (size_t)t * cols, cols, q,
                                                st[(r - r0) / RM], b ? bias + (r - r0) : NULL, j->out[m] + (size_t)t * os + r, os);
            }
    }
}

int mg_cpu_matmul_multi_avx2(struct mg_pool *pool, const float *x, int32_t n, int32_t count,
                             const mg_cpu_weight *const *ws, const mg_cpu_weight *const *biases, float *const *outs) {
    if (count <= 0 || count > MG_MATMUL_MAX || n <= 0) return 0;
    int32_t cols = ws[0]->cols;
    int64_t macs = 0;
    for (int m = 0; m < count; m++) {
        if (ws[m]->dtype != DT_BF16 || ws[m]->cols != cols) return 0;
        const mg_cpu_weight *b = biases ? biases[m] : NULL;
        if (b && b->dtype != 0 && b->dtype != DT_BF16) return 0;
        macs += (int64_t)ws[m]->rows * cols * n;
    }
    struct avx2_job *j = calloc(1, sizeof *j);
    float *xq = malloc((size_t)n * (size_t)cols * sizeof(float));
    if (!j || !xq) {
        free(j);
        free(xq);
        return 0; /* the caller's path */
    }
    for (int32_t t = 0; t < n; t++) x_qmajor(x + (size_t)t * cols, cols, xq + (size_t)t * cols);
    int nth = mg_pool_threads(pool);
    if (macs < (1 << 20)) { /* waking workers costs more than it saves */
        pool = NULL;
        nth = 1;
    }
    j->xq = xq, j->n = n, j->cols = cols;
    /* Tokens per chunk: enough to pay for widening the rows, in whole tiles. */
    j->tb = n < 64 ? n : 64;
    /* Rows per chunk: about 192 KiB widened (stays in L2 with the tokens'
     * tiles), in whole tiles, but enough chunks to balance the threads. */
    int64_t ntb = (n + j->tb - 1) / j->tb, rb0 = ((int64_t)192 << 10) / ((int64_t)cols * 4) / RM * RM;
    if (rb0 < RM) rb0 = RM;
    if (rb0 > MAX_RB) rb0 = MAX_RB;
    int32_t most_rb = 0;
    for (int m = 0; m < count; m++) {
        int64_t rows = ws[m]->rows, rb = rb0, most = rows * ntb / ((int64_t)nth * 8) / RM * RM;
        if (nth > 1 && rb > most) rb = most < RM ? RM : most;
        if (rb > rows) rb = rows;
        j->rb[m] = (int32_t)rb;
        if (rb > most_rb) most_rb = (int32_t)rb;
        j->w[m] = ws[m];
        j->bias[m] = biases ? biases[m] : NULL;
        j->out[m] = outs[m];
        j->first_chunk[m + 1] = j->first_chunk[m] + (rows + rb - 1) / rb * ntb;
    }
    j->wbuf_floats = (size_t)most_rb * (size_t)cols;
    mg_pool_for(pool, j->first_chunk[count], avx2_chunk, j);
    int ok = !j->failed;
    for (int i = 0; i < 256; i++) free(j->wbuf[i]);
    free(j);
    free(xq);
    return ok; /* 0: some chunks ran out of memory; the caller's path redoes them all */
}

#else /* no AVX2 in this build: the caller's path */

int mg_cpu_matmul_multi_avx2(struct mg_pool *pool, const float *x, int32_t n, int32_t count,
                             const mg_cpu_weight *const *ws, const mg_cpu_weight *const *biases, float *const *outs) {
    (void)pool, (void)x, (void)n, (void)count, (void)ws, (void)biases, (void)outs;
    return 0;
}

#endif

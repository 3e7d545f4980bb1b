/*
 * cpu_kernels.c: the CPU reference kernels (see cpu_kernels.h).
 *
 * Every dot product goes through dot_f32/dot_bf16, which share one
 * accumulation order, so a matmul gives the same bits whether the weight row
 * is read as bf16 directly (decode) or converted to f32 first (prefill), and
 * whatever the thread count.
 */
#include "cpu_kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_pool.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MG_AVX2 1
#endif

enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2, DT_Q8_0 = 8, DT_Q5_K = 13, DT_Q6_K = 14 }; /* meshgpu.h MG_* */

float mg_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t mg_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                           /* nearest even */
    return (uint16_t)(u >> 16);
}

float mg_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    uint32_t u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while ((man & 0x400) == 0);
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---- dot products: 4 x 8-lane accumulators over blocks of 32, then 8, then scalar ---- */

#ifdef MG_AVX2
static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
static inline __m256 load_bf16x8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

static inline float dot_f32(const float *x, const float *w, int32_t n) {
    int32_t i = 0;
    float s;
#ifdef MG_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(w + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(w + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), _mm256_loadu_ps(w + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), _mm256_loadu_ps(w + i + 24), a3);
    }
    for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(w + i), a0);
    s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
    float a[8] = {0};
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) a[j] += x[i + j] * w[i + j];
    s = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
#endif
    for (; i < n; i++) s += x[i] * w[i];
    return s;
}

/*
 * bf16 matrices: the fast decode kernel widens 16 bf16 at a time by
 * interleaving them with zeros (unpacklo/unpackhi), which yields elements in
 * the order 0-3,8-11 | 4-7,12-15 within each 16. Rather than shuffle the
 * weights back, x is permuted once per call into that order ("bf16 order",
 * per 32-block: 0-3 8-11 4-7 12-15 16-19 24-27 20-23 28-31; the tail past the
 * last full 32 stays in place). dot_bf16(xp, w) and dot_perm(xp, wp) with wp
 * a row converted by row_bf16_perm() do the same operations in the same
 * order, so decode and prefill agree bit for bit.
 */
static void perm_bf16_order(const float *x, int32_t n, float *xp) {
    static const int8_t perm[32] = {0,  1,  2,  3,  8,  9,  10, 11, 4,  5,  6,  7,  12, 13, 14, 15,
                                    16, 17, 18, 19, 24, 25, 26, 27, 20, 21, 22, 23, 28, 29, 30, 31};
    int32_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 32; j++) xp[i + j] = x[i + perm[j]];
    for (; i < n; i++) xp[i] = x[i];
}

/* A bf16 row widened to f32 in bf16 order. */
static void row_bf16_perm(const uint16_t *w, int32_t n, float *wp) {
    int32_t i = 0;
#ifdef MG_AVX2
    const __m256i z = _mm256_setzero_si256();
    for (; i + 32 <= n; i += 32) {
        __m256i v0 = _mm256_loadu_si256((const __m256i *)(w + i));
        __m256i v1 = _mm256_loadu_si256((const __m256i *)(w + i + 16));
        _mm256_storeu_si256((__m256i *)(wp + i), _mm256_unpacklo_epi16(z, v0));
        _mm256_storeu_si256((__m256i *)(wp + i + 8), _mm256_unpackhi_epi16(z, v0));
        _mm256_storeu_si256((__m256i *)(wp + i + 16), _mm256_unpacklo_epi16(z, v1));
        _mm256_storeu_si256((__m256i *)(wp + i + 24), _mm256_unpackhi_epi16(z, v1));
    }
#else
    static const int8_t perm[32] = {0,  1,  2,  3,  8,  9,  10, 11, 4,  5,  6,  7,  12, 13, 14, 15,
                                    16, 17, 18, 19, 24, 25, 26, 27, 20, 21, 22, 23, 28, 29, 30, 31};
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 32; j++) wp[i + j] = mg_bf16_to_f32(w[i + perm[j]]);
#endif
    for (; i < n; i++) wp[i] = mg_bf16_to_f32(w[i]);
}

/* Both in bf16 order: 4 accumulators over 32-blocks, then a scalar tail. */
static inline float dot_perm(const float *xp, const float *wp, int32_t n) {
    int32_t i = 0;
    float s;
#ifdef MG_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xp + i), _mm256_loadu_ps(wp + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xp + i + 8), _mm256_loadu_ps(wp + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xp + i + 16), _mm256_loadu_ps(wp + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xp + i + 24), _mm256_loadu_ps(wp + i + 24), a3);
    }
    s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
    float a[32] = {0};
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 32; j++) a[j] += xp[i + j] * wp[i + j];
    s = 0;
    for (int j = 0; j < 8; j++) s += (a[j] + a[j + 8]) + (a[j + 16] + a[j + 24]);
#endif
    for (; i < n; i++) s += xp[i] * wp[i];
    return s;
}

/* dot_perm for three tokens at once: wp is loaded once per 8 elements and
 * used three times (prefill is bound by loads, not multiply-adds). Each
 * token's sum is computed exactly as dot_perm computes it. */
static inline void dot_perm3(const float *x0, const float *x1, const float *x2, const float *wp, int32_t n,
                             float *out0, float *out1, float *out2) {
#ifdef MG_AVX2
    int32_t i = 0;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    for (; i + 32 <= n; i += 32) {
        __m256 w = _mm256_loadu_ps(wp + i);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + i), w, a0);
        b0 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + i), w, b0);
        c0 = _mm256_fmadd_ps(_mm256_loadu_ps(x2 + i), w, c0);
        w = _mm256_loadu_ps(wp + i + 8);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + i + 8), w, a1);
        b1 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + i + 8), w, b1);
        c1 = _mm256_fmadd_ps(_mm256_loadu_ps(x2 + i + 8), w, c1);
        w = _mm256_loadu_ps(wp + i + 16);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + i + 16), w, a2);
        b2 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + i + 16), w, b2);
        c2 = _mm256_fmadd_ps(_mm256_loadu_ps(x2 + i + 16), w, c2);
        w = _mm256_loadu_ps(wp + i + 24);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + i + 24), w, a3);
        b3 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + i + 24), w, b3);
        c3 = _mm256_fmadd_ps(_mm256_loadu_ps(x2 + i + 24), w, c3);
    }
    float s0 = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    float s1 = hsum8(_mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3)));
    float s2 = hsum8(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)));
    for (; i < n; i++) {
        s0 += x0[i] * wp[i];
        s1 += x1[i] * wp[i];
        s2 += x2[i] * wp[i];
    }
    *out0 = s0;
    *out1 = s1;
    *out2 = s2;
#else
    *out0 = dot_perm(x0, wp, n);
    *out1 = dot_perm(x1, wp, n);
    *out2 = dot_perm(x2, wp, n);
#endif
}

/* xp in bf16 order, w a bf16 row as stored: same arithmetic as dot_perm. */
static inline float dot_bf16(const float *xp, const uint16_t *w, int32_t n) {
#ifdef MG_AVX2
    int32_t i = 0;
    const __m256i z = _mm256_setzero_si256();
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 32 <= n; i += 32) {
        __m256i v0 = _mm256_loadu_si256((const __m256i *)(w + i));
        __m256i v1 = _mm256_loadu_si256((const __m256i *)(w + i + 16));
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xp + i), _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v0)), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xp + i + 8), _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v0)), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xp + i + 16), _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v1)), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xp + i + 24), _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v1)), a3);
    }
    float s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < n; i++) s += xp[i] * mg_bf16_to_f32(w[i]);
    return s;
#else
    float wp[32];
    float s = 0;
    int32_t i = 0;
    /* same structure as dot_perm, 32 elements at a time */
    float a[32] = {0};
    for (; i + 32 <= n; i += 32) {
        row_bf16_perm(w + i, 32, wp);
        for (int j = 0; j < 32; j++) a[j] += xp[i + j] * wp[j];
    }
    for (int j = 0; j < 8; j++) s += (a[j] + a[j + 8]) + (a[j + 16] + a[j + 24]);
    for (; i < n; i++) s += xp[i] * mg_bf16_to_f32(w[i]);
    return s;
#endif
}

/* Converts n elements of a stored row to f32. */
static void row_to_f32(int32_t dtype, const void *src, int32_t n, float *dst) {
    int32_t i = 0;
    switch (dtype) {
    case DT_F32:
        memcpy(dst, src, (size_t)n * 4);
        break;
    case DT_BF16: {
        const uint16_t *s = src;
#ifdef MG_AVX2
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_bf16x8(s + i));
#endif
        for (; i < n; i++) dst[i] = mg_bf16_to_f32(s[i]);
        break;
    }
    case DT_F16: {
        const uint16_t *s = src;
#if defined(MG_AVX2) && defined(__F16C__)
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#endif
        for (; i < n; i++) dst[i] = mg_f16_to_f32(s[i]);
        break;
    }
    }
}

static size_t dtype_size(int32_t dtype) { return dtype == DT_F32 ? 4 : 2; }

/* Offset of element (r, c) of a tiled matrix. */
static inline size_t tiled_index(const mg_cpu_weight *w, int32_t r, int32_t c) {
    int32_t k0 = c / MG_CPU_TILE * MG_CPU_TILE, width = w->cols - k0 < MG_CPU_TILE ? w->cols - k0 : MG_CPU_TILE;
    return (size_t)k0 * (size_t)w->rows + (size_t)r * (size_t)width + (size_t)(c - k0);
}

int mg_cpu_tileable(int32_t rows, int32_t cols) { return rows > 0 && cols > MG_CPU_TILE && cols % 32 == 0; }

void mg_cpu_tile_bf16(const uint16_t *src, int32_t rows, int32_t cols, uint16_t *dst) {
    for (int32_t k0 = 0; k0 < cols; k0 += MG_CPU_TILE) {
        int32_t width = cols - k0 < MG_CPU_TILE ? cols - k0 : MG_CPU_TILE;
        uint16_t *blk = dst + (size_t)k0 * (size_t)rows;
        for (int32_t r = 0; r < rows; r++)
            memcpy(blk + (size_t)r * width, src + (size_t)r * cols + k0, (size_t)width * 2);
    }
}

static inline float weight_at(const mg_cpu_weight *w, size_t i) {
    switch (w->dtype) {
    case DT_F32:
        return ((const float *)w->data)[i];
    case DT_BF16:
        return mg_bf16_to_f32(((const uint16_t *)w->data)[i]);
    default:
        return mg_f16_to_f32(((const uint16_t *)w->data)[i]);
    }
}

/* ---- embed, rmsnorm, swiglu ---- */

void mg_cpu_embed(const mg_cpu_weight *table, const int32_t *tokens, int32_t n, float *out) {
    size_t cols = (size_t)table->cols, es = dtype_size(table->dtype);
    if (mg_cpu_is_quant(table->dtype)) { /* only the rows looked up are dequantized */
        size_t rb = mg_cpu_quant_row_bytes(table->dtype, table->cols);
        for (int32_t t = 0; t < n; t++)
            mg_cpu_dequant_row(table->dtype, (const char *)table->data + (size_t)tokens[t] * rb, table->cols, out + (size_t)t * cols);
        return;
    }
    for (int32_t t = 0; t < n; t++)
        row_to_f32(table->dtype, (const char *)table->data + (size_t)tokens[t] * cols * es,
                   table->cols, out + (size_t)t * cols);
}

void mg_cpu_rmsnorm(const float *x, const mg_cpu_weight *w, float eps, int32_t n, int32_t dim,
                    float *out) {
    for (int32_t t = 0; t < n; t++) {
        const float *xr = x + (size_t)t * dim;
        float *o = out + (size_t)t * dim;
        float ss = dot_f32(xr, xr, dim);
        float r = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int32_t i = 0; i < dim; i++) o[i] = (xr[i] * r) * weight_at(w, (size_t)i);
    }
}

void mg_cpu_swiglu(const float *gate, const float *up, int32_t n, float *out) {
    for (int32_t i = 0; i < n; i++) {
        float g = gate[i];
        out[i] = (g / (1.0f + expf(-g))) * up[i];
    }
}

/* ---- matmul ---- */

/* Below this many multiply-adds a kernel runs on the calling thread: waking
 * workers costs more than it saves (and the small test model stays fast on
 * busy machines). */
#define MG_PAR_MIN_MACS (1 << 20)

/* A row of a tiled bf16 matrix widened to f32 in bf16 order: the same
 * values row_bf16_perm gives for the row-major row. */
static void row_bf16_perm_tiled(const mg_cpu_weight *w, int32_t r, float *wp) {
    for (int32_t k0 = 0; k0 < w->cols; k0 += MG_CPU_TILE) {
        int32_t width = w->cols - k0 < MG_CPU_TILE ? w->cols - k0 : MG_CPU_TILE;
        const uint16_t *seg = (const uint16_t *)w->data + (size_t)k0 * (size_t)w->rows + (size_t)r * width;
        row_bf16_perm(seg, width, wp + k0); /* width is a multiple of 32: no reordered tail */
    }
}

/* Decode (one token) over rows r0..r1-1 of a tiled bf16 matrix: for each
 * column block, every row's four accumulators are loaded, advanced over
 * the block and stored, which is dot_bf16's arithmetic in dot_bf16's order. */
static void matvec_tiled(const float *xp, const mg_cpu_weight *w, const mg_cpu_weight *bias, int32_t r0, int32_t r1,
                         float *out) {
    enum { G = 64 };
#ifdef MG_AVX2
    const __m256i z = _mm256_setzero_si256();
    __m256 acc[G][4];
    for (int32_t g0 = r0; g0 < r1; g0 += G) {
        int32_t g1 = g0 + G < r1 ? g0 + G : r1;
        for (int32_t g = 0; g < g1 - g0; g++) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = _mm256_setzero_ps();
        for (int32_t k0 = 0; k0 < w->cols; k0 += MG_CPU_TILE) {
            int32_t width = w->cols - k0 < MG_CPU_TILE ? w->cols - k0 : MG_CPU_TILE;
            const uint16_t *blk = (const uint16_t *)w->data + (size_t)k0 * (size_t)w->rows;
            const float *x = xp + k0;
            for (int32_t r = g0; r < g1; r++) {
                const uint16_t *wr = blk + (size_t)r * width;
                __m256 a0 = acc[r - g0][0], a1 = acc[r - g0][1], a2 = acc[r - g0][2], a3 = acc[r - g0][3];
                for (int32_t i = 0; i < width; i += 32) {
                    __m256i v0 = _mm256_loadu_si256((const __m256i *)(wr + i));
                    __m256i v1 = _mm256_loadu_si256((const __m256i *)(wr + i + 16));
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v0)), a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v0)), a1);
                    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v1)), a2);
                    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v1)), a3);
                }
                acc[r - g0][0] = a0, acc[r - g0][1] = a1, acc[r - g0][2] = a2, acc[r - g0][3] = a3;
            }
        }
        for (int32_t r = g0; r < g1; r++) {
            __m256 *a = acc[r - g0];
            out[r] = hsum8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]))) +
                     (bias ? weight_at(bias, (size_t)r) : 0.0f);
        }
    }
#else
    /* dot_perm's scalar arithmetic: 32 accumulators carried across blocks */
    for (int32_t r = r0; r < r1; r++) {
        float a[32] = {0}, wp[32];
        for (int32_t k0 = 0; k0 < w->cols; k0 += MG_CPU_TILE) {
            int32_t width = w->cols - k0 < MG_CPU_TILE ? w->cols - k0 : MG_CPU_TILE;
            const uint16_t *seg = (const uint16_t *)w->data + (size_t)k0 * (size_t)w->rows + (size_t)r * width;
            for (int32_t i = 0; i < width; i += 32) { /* width is a multiple of 32 */
                row_bf16_perm(seg + i, 32, wp);
                for (int j = 0; j < 32; j++) a[j] += xp[k0 + i + j] * wp[j];
            }
        }
        float s = 0;
        for (int j = 0; j < 8; j++) s += (a[j] + a[j + 8]) + (a[j + 16] + a[j + 24]);
        out[r] = s + (bias ? weight_at(bias, (size_t)r) : 0.0f);
    }
#endif
}

struct matmul_job {
    int32_t count, n, isa;
    const float *x, *xp; /* x as given; x in bf16 order (NULL without bf16 weights) */
    /* With quantized weights (mg_cpu_qx): [n, cols] int16 activations,
     * [n, cols/32] their scales and f32 group sums; else NULL. */
    const int16_t *xq;
    const float *xd, *xs;
    /* Several tokens on a path with mg_cpu_q16_pairs: xq as token pairs
     * (mg_cpu_qx_pairs); else NULL. */
    const int16_t *x2;
    /* With 8-bit activations (cpu_quant8.c) instead: per token, cols int8
     * and cols/32 scales for Q8_0 weights (q32, d32), cols int8, cols/256
     * scales and cols/16 int sums for K-quants. */
    int q8;
    const int8_t *q32, *q256;
    const float *d32, *d256;
    const int16_t *bs16;
    const mg_cpu_weight *w[MG_MATMUL_MAX], *bias[MG_MATMUL_MAX];
    float *out[MG_MATMUL_MAX];
    int32_t rows_per_chunk[MG_MATMUL_MAX];
    int64_t first_chunk[MG_MATMUL_MAX + 1]; /* matrix m owns chunks first_chunk[m]..first_chunk[m+1]-1 */
    float *rowbuf[256];                     /* per thread, allocated on first use */
    size_t rowbuf_floats;                   /* each rowbuf's size */
    int failed;                             /* a row buffer could not be allocated */
};

/* From this many tokens bf16 weights take the AVX2 register tiles
 * (cpu_matmul_avx2.c: the same bits; BenchmarkCPUMatmulISA on 2 Zen 3
 * cores: 2x faster from 64 tokens, about 1.15x at 8, even at 4, slower at
 * 2, where the rows' widening is not paid back). */
#ifndef MG_AVX2_TILE_MIN
#define MG_AVX2_TILE_MIN 4
#endif

/* The most tokens whose products with a quantized weight take the one-token
 * kernels token by token (matmul_chunk) rather than the batched kernels:
 * measured one thread, 8192x2048 (docs/performance.md, issue 24). The
 * AVX-512 pairs kernel on the blocks themselves (Q8_0, Q4_K, Q6_K) paid off
 * from 3 tokens on an Emerald Rapids Xeon (1.26-1.35x there, about even at
 * 2); Q5_K's, which widens rows first, from 4 on Zen 5; the AVX2 one, which
 * widens too, from 3 (Q6_K: 2) there. */
static int qtoken_max(int isa, int32_t dtype) {
    if (mg_cpu_q16_pairs(isa)) return dtype == DT_Q5_K ? 3 : 2;
    if (isa >= MG_ISA_AVX2) return dtype == DT_Q6_K ? 1 : 2;
    return 1;
}

/* Rows of a quantized matrix widened at once for several tokens. */
static int32_t qrows_of(int32_t cols) {
    int32_t r = (int32_t)((192u << 10) / ((size_t)cols * 4));
    return r < 1 ? 1 : r > 32 ? 32 : r;
}

/* Rows r0..r1 of a quantized weight with 8-bit activations: one token a row
 * at a time (decode streams the blocks); several, rows in blocks that stay
 * in L2 (about 192 KiB of blocks), every token passed through each block
 * MG_Q8_NT at a time, so each weight is unpacked once per 8 tokens. */
static void q8_chunk(const struct matmul_job *j, const mg_cpu_weight *w, const mg_cpu_weight *bias, int32_t r0, int32_t r1,
                     float *outp) {
    const int32_t cols = w->cols, rows = w->rows, n = j->n, q80 = mg_cpu_q8act_block(w->dtype) == 32;
    const size_t rb = mg_cpu_quant_row_bytes(w->dtype, cols);
    int32_t R = (int32_t)((192u << 10) / rb);
    R = R < 1 ? 1 : R;
    for (int32_t q0 = r0; q0 < r1; q0 += R) {
        int32_t q1 = q0 + R < r1 ? q0 + R : r1;
        for (int32_t t = 0; t < n; t += MG_Q8_NT) {
            int nt = n - t < MG_Q8_NT ? n - t : MG_Q8_NT;
            mg_cpu_q8act a[MG_Q8_NT];
            for (int i = 0; i < nt; i++) {
                size_t k = (size_t)(t + i);
                if (q80)
                    a[i] = (mg_cpu_q8act){j->q32 + k * cols, j->d32 + k * (cols / 32), NULL};
                else
                    a[i] = (mg_cpu_q8act){j->q256 + k * cols, j->d256 + k * (cols / 256), j->bs16 + k * (cols / 16)};
            }
            for (int32_t r = q0; r < q1; r++) {
                float o4[MG_Q8_NT], b = bias ? weight_at(bias, (size_t)r) : 0.0f;
                mg_cpu_q8dot_n(j->isa, w->dtype, (const char *)w->data + (size_t)r * rb, cols, nt, a, o4);
                for (int i = 0; i < nt; i++) outp[(size_t)(t + i) * rows + r] = o4[i] + b;
            }
        }
    }
}

/* The pairs kernels' inputs for tokens t..t+nt-1 (nt <= 8): np pairs of
 * mg_cpu_qx_pairs rows, and each token's xd and xs (a zero-padded last
 * token reads the real last one's scales). Returns np. */
static int pair_inputs(const struct matmul_job *j, int32_t cols, int32_t t, int nt, const int16_t **x2, const float **xd,
                       const float **xs) {
    const int np = (nt + 1) / 2;
    const size_t xsn = (size_t)cols / 32;
    for (int i = 0; i < 2 * np; i++) {
        int32_t k = t + i < j->n ? t + i : j->n - 1;
        xd[i] = j->xd + (size_t)k * xsn;
        xs[i] = j->xs + (size_t)k * xsn;
    }
    for (int p = 0; p < np; p++) x2[p] = j->x2 + (size_t)(t + 2 * p) * cols;
    return np;
}

/* A pairs kernel's out[(r - q0) * 8 + i], plus the bias, into rows q0..q1-1
 * of tokens t..t+nt-1. */
static void put_pairs(float *outp, int32_t rows, const mg_cpu_weight *bias, int32_t q0, int32_t q1, int32_t t, int nt,
                      const float *o8) {
    for (int32_t r = q0; r < q1; r++) {
        float b = bias ? weight_at(bias, (size_t)r) : 0.0f;
        for (int i = 0; i < nt; i++) outp[(size_t)(t + i) * rows + r] = o8[(r - q0) * 8 + i] + b;
    }
}

/* Rows r0..r1 of a quantized weight for a batch of tokens on AVX-512, for
 * the types mg_cpu_q16_blocks takes: the pairs kernel reads the blocks
 * themselves, 32 rows at a time (their blocks stay in L1/L2 while passes of
 * 8 tokens run over them; unpacking the blocks again each pass cost less
 * than widening them once and reading the words back, docs/performance.md),
 * and fetches the next 32 rows' blocks during the first pass. */
static void pairs_blocks(const struct matmul_job *j, const mg_cpu_weight *w, const mg_cpu_weight *bias, int32_t r0, int32_t r1,
                        float *outp) {
    const int32_t cols = w->cols, rows = w->rows, R = 32;
    const size_t rb = mg_cpu_quant_row_bytes(w->dtype, cols);
    for (int32_t q0 = r0; q0 < r1; q0 += R) {
        const int32_t q1 = q0 + R < r1 ? q0 + R : r1;
        const char *next = q1 < r1 ? (const char *)w->data + (size_t)q1 * rb : NULL;
        const size_t next_bytes = (size_t)((q1 + R < r1 ? q1 + R : r1) - q1) * rb;
        for (int32_t t = 0; t < j->n; t += 8) {
            const int nt = j->n - t < 8 ? j->n - t : 8;
            const int16_t *x2[4];
            const float *xd[8], *xs[8];
            const int np = pair_inputs(j, cols, t, nt, x2, xd, xs);
            float o8[32 * 8];
            mg_cpu_qdot_blocks_pairs(j->isa, w->dtype, (const char *)w->data + (size_t)q0 * rb, rb, q1 - q0, np, x2, xd, xs, cols, o8,
                                     t == 0 ? next : NULL, next_bytes);
            put_pairs(outp, rows, bias, q0, q1, t, nt, o8);
        }
    }
}

/* A chunk is a run of one weight's rows: each row is read from memory once
 * per call and applied to all n tokens (converted to f32 once when n > 1). */
static void matmul_chunk(void *ctx, int64_t chunk, int ith) {
    struct matmul_job *j = ctx;
    int m = 0;
    while (chunk >= j->first_chunk[m + 1]) m++;
    const mg_cpu_weight *w = j->w[m];
    const mg_cpu_weight *bias = j->bias[m];
    float *outp = j->out[m];
    int32_t rows = w->rows, cols = w->cols, n = j->n;
    int32_t r0 = (int32_t)(chunk - j->first_chunk[m]) * j->rows_per_chunk[m], r1 = r0 + j->rows_per_chunk[m];
    if (r1 > rows) r1 = rows;
    size_t es = dtype_size(w->dtype);
    int bf16 = w->dtype == DT_BF16, quant = mg_cpu_is_quant(w->dtype);
    const float *x = bf16 ? j->xp : j->x;
    float *rowbuf = NULL;
    if (w->dtype != DT_F32 && (n > 1 || !bf16)) {
        rowbuf = j->rowbuf[ith];
        if (!rowbuf) {
            rowbuf = j->rowbuf[ith] = malloc(j->rowbuf_floats * sizeof(float));
            if (!rowbuf) {
                __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
                return;
            }
        }
    }
    if (w->tiled && n == 1) {
        matvec_tiled(x, w, bias, r0, r1, outp);
        return;
    }
    if (quant && j->q8) {
        q8_chunk(j, w, bias, r0, r1, outp);
        return;
    }
    if (quant) {
        size_t rb = mg_cpu_quant_row_bytes(w->dtype, cols), xsn = (size_t)cols / 32;
        if (n <= qtoken_max(j->isa, w->dtype)) {
            /* A few tokens (a small decode batch): the one-token kernels, token
             * by token over blocks of rows small enough to stay in L2, so the
             * blocks come from memory once (qtoken_max says up to how many
             * tokens that beats the batched kernels below); the same bits
             * either way. */
            int32_t B = (int32_t)(((size_t)256 << 10) / rb);
            if (B < 16) B = 16;
            B -= B % 4; /* whole groups of the 4 rows the AVX-512 kernels take at once (qdot_rows_z; a rest goes row by row) */
            for (int32_t q0 = r0; q0 < r1; q0 += B) {
                int32_t q1 = q0 + B < r1 ? q0 + B : r1;
                for (int32_t t = 0; t < n; t++) {
                    float *o = outp + (size_t)t * rows;
                    mg_cpu_qdot_rows(j->isa, w->dtype, (const char *)w->data + (size_t)q0 * rb, rb, q1 - q0, j->xq + (size_t)t * cols,
                                     j->xd + (size_t)t * xsn, j->xs + (size_t)t * xsn, cols, rowbuf, o + q0);
                    if (bias)
                        for (int32_t r = q0; r < q1; r++) o[r] += weight_at(bias, (size_t)r);
                }
            }
            return;
        }
        /* More tokens (a larger decode batch, a short chunk): widen a few rows
         * (qrows_of: about 192 KiB, in L2; AVX2 widening costs little once
         * their blocks are in L2, fetched meanwhile), then pass every token
         * through them 4 at a time (8 on AVX-512), so each weight is
         * unpacked once for all tokens and the tokens' activations are read
         * once per few rows rather than once per row. Faster than the
         * one-token kernels token by token from qtoken_max + 1 tokens. On
         * AVX-512 the pairs kernel reads Q8_0, Q4_K and Q6_K blocks without
         * widening them (pairs_blocks); Q5_K is widened. */
        if (j->x2 && mg_cpu_q16_blocks(j->isa, w->dtype)) {
            pairs_blocks(j, w, bias, r0, r1, outp);
            return;
        }
        size_t pf = mg_cpu_qprep_floats(cols);
        int32_t R = qrows_of(cols);
        for (int32_t q0 = r0; q0 < r1; q0 += R) {
            int32_t q1 = q0 + R < r1 ? q0 + R : r1;
            for (int32_t r = q0; r < q1; r++)
                mg_cpu_qprep_row(j->isa, w->dtype, (const char *)w->data + (size_t)r * rb, cols, rowbuf + (size_t)(r - q0) * pf);
            /* The next rows' blocks, fetched into L2 while the tokens pass
             * these: widening straight from DRAM stalled on every line. */
            const char *next = q1 < r1 ? (const char *)w->data + (size_t)q1 * rb : NULL;
            size_t next_bytes = (size_t)((q1 + R < r1 ? q1 + R : r1) - q1) * rb;
            if (j->x2) { /* AVX-512: 8 tokens a pass, two per register (cpu_quant.c) */
                for (int32_t t = 0; t < n; t += 8) {
                    int nt = n - t < 8 ? n - t : 8;
                    const int16_t *x2[4];
                    const float *xd[8], *xs[8];
                    int np = pair_inputs(j, cols, t, nt, x2, xd, xs);
                    float o8[32 * 8];
                    mg_cpu_qdot_prepn_pairs(j->isa, w->dtype, rowbuf, pf, q1 - q0, np, x2, xd, xs, cols, o8,
                                            t == 0 ? next : NULL, next_bytes);
                    put_pairs(outp, rows, bias, q0, q1, t, nt, o8);
                }
                continue;
            }
            /* a few of next's lines a row during the first pass */
            size_t lines = next ? (next_bytes + 63) / 64 : 0, line = 0;
            size_t per = (lines + (size_t)(q1 - q0) - 1) / (size_t)(q1 - q0);
            for (int32_t t = 0; t < n; t += 4) {
                int nt = n - t < 4 ? n - t : 4;
                const int16_t *xq[4];
                const float *xd[4], *xs[4];
                for (int i = 0; i < nt; i++) {
                    xq[i] = j->xq + (size_t)(t + i) * cols;
                    xd[i] = j->xd + (size_t)(t + i) * xsn;
                    xs[i] = j->xs + (size_t)(t + i) * xsn;
                }
                for (int32_t r = q0; r < q1; r++) {
                    for (size_t e = line + per < lines ? line + per : lines; line < e; line++)
                        __builtin_prefetch(next + line * 64, 0, 2);
                    float o4[4], b = bias ? weight_at(bias, (size_t)r) : 0.0f;
                    mg_cpu_qdot_prepn(j->isa, w->dtype, rowbuf + (size_t)(r - q0) * pf, nt, xq, xd, xs, cols, o4);
                    for (int i = 0; i < nt; i++) outp[(size_t)(t + i) * rows + r] = o4[i] + b;
                }
            }
        }
        return;
    }
    for (int32_t r = r0; r < r1; r++) {
        const void *wr = (const char *)w->data + (size_t)r * cols * es;
        float b = bias ? weight_at(bias, (size_t)r) : 0.0f;
        if (bf16 && n == 1) {
            outp[r] = dot_bf16(x, wr, cols) + b;
            continue;
        }
        float *o = outp + r;
        if (bf16) {
            if (w->tiled)
                row_bf16_perm_tiled(w, r, rowbuf);
            else
                row_bf16_perm(wr, cols, rowbuf);
            int32_t t = 0;
            for (; t + 3 <= n; t += 3) {
                float s0, s1, s2;
                dot_perm3(x + (size_t)t * cols, x + (size_t)(t + 1) * cols, x + (size_t)(t + 2) * cols, rowbuf, cols, &s0,
                          &s1, &s2);
                o[(size_t)t * rows] = s0 + b;
                o[(size_t)(t + 1) * rows] = s1 + b;
                o[(size_t)(t + 2) * rows] = s2 + b;
            }
            for (; t < n; t++) o[(size_t)t * rows] = dot_perm(x + (size_t)t * cols, rowbuf, cols) + b;
            continue;
        }
        const float *wf = wr;
        if (rowbuf) {
            row_to_f32(w->dtype, wr, cols, rowbuf);
            wf = rowbuf;
        }
        for (int32_t t = 0; t < n; t++) o[(size_t)t * rows] = dot_f32(x + (size_t)t * cols, wf, cols) + b;
    }
}

/* Plain loops: used only when scratch memory cannot be allocated. */
static void matmul_slow(const float *x, const mg_cpu_weight *w, const mg_cpu_weight *bias, int32_t n, float *out) {
    if (mg_cpu_is_quant(w->dtype)) { /* the reference, one 256-element block widened at a time */
        size_t rb = mg_cpu_quant_row_bytes(w->dtype, w->cols);
        for (int32_t r = 0; r < w->rows; r++)
            for (int32_t t = 0; t < n; t++) {
                float s = 0, blk[256];
                const float *xr = x + (size_t)t * w->cols;
                for (int32_t c = 0; c < w->cols; c += 256) {
                    int32_t len = w->cols - c < 256 ? w->cols - c : 256;
                    mg_cpu_dequant_row(w->dtype, (const char *)w->data + (size_t)r * rb + mg_cpu_quant_row_bytes(w->dtype, c), len, blk);
                    for (int32_t i = 0; i < len; i++) s += xr[c + i] * blk[i];
                }
                out[(size_t)t * w->rows + r] = s + (bias ? weight_at(bias, (size_t)r) : 0.0f);
            }
        return;
    }
    for (int32_t r = 0; r < w->rows; r++) {
        for (int32_t t = 0; t < n; t++) {
            const float *xr = x + (size_t)t * w->cols;
            float s = 0;
            for (int32_t c = 0; c < w->cols; c++)
                s += xr[c] * weight_at(w, w->tiled ? tiled_index(w, r, c) : (size_t)r * w->cols + c);
            out[(size_t)t * w->rows + r] = s + (bias ? weight_at(bias, (size_t)r) : 0.0f);
        }
    }
}

void mg_cpu_matmul_multi(struct mg_pool *pool, const float *x, int32_t n, int32_t count,
                         const mg_cpu_weight *const *ws, const mg_cpu_weight *const *biases,
                         float *const *outs) {
    mg_cpu_matmul_multi_isa(pool, mg_cpu_isa(), x, n, count, ws, biases, outs);
}

void mg_cpu_matmul_multi_isa(struct mg_pool *pool, int isa, const float *x, int32_t n, int32_t count,
                             const mg_cpu_weight *const *ws, const mg_cpu_weight *const *biases,
                             float *const *outs) {
    if (count <= 0 || count > MG_MATMUL_MAX || n <= 0) return;
    const int prompt = isa & MG_PATH_PROMPT;
    isa &= ~MG_PATH_PROMPT;
    if (prompt && mg_cpu_matmul_prompt_avx512(pool, isa, x, n, count, ws, biases, outs)) return;
    if (mg_cpu_matmul_multi_avx512(pool, isa, x, n, count, ws, biases, outs)) return;
    if (isa == MG_ISA_AVX2 && n >= MG_AVX2_TILE_MIN && mg_cpu_matmul_multi_avx2(pool, x, n, count, ws, biases, outs)) return;
    struct matmul_job j;
    memset(&j, 0, sizeof j);
    int32_t cols = ws[0]->cols;
    int any_bf16 = 0, any_quant = 0;
    int64_t macs = 0;
    for (int m = 0; m < count; m++) {
        any_bf16 |= ws[m]->dtype == DT_BF16;
        any_quant |= mg_cpu_is_quant(ws[m]->dtype);
        macs += (int64_t)ws[m]->rows * ws[m]->cols * n;
    }
    void *qmem = NULL; /* activations for quantized weights (mg_cpu_qx), once for all weights */
    int16_t *xq = NULL, *x2 = NULL;
    float *xd = NULL, *xs = NULL;
    if (any_quant && mg_cpu_quant_act() == 8) { /* each token quantized on its own: batch-invariant */
        int any_q80 = 0, any_k = 0;
        for (int m = 0; m < count; m++) {
            any_q80 |= mg_cpu_is_quant(ws[m]->dtype) && mg_cpu_q8act_block(ws[m]->dtype) == 32;
            any_k |= mg_cpu_is_quant(ws[m]->dtype) && mg_cpu_q8act_block(ws[m]->dtype) == 256;
        }
        size_t nc = (size_t)n * (size_t)cols;
        size_t bytes = (any_q80 ? nc + nc / 32 * sizeof(float) : 0) +
                       (any_k ? nc + nc / 256 * sizeof(float) + nc / 16 * sizeof(int16_t) : 0);
        qmem = malloc(bytes + 64);
        if (!qmem) {
            for (int m = 0; m < count; m++) matmul_slow(x, ws[m], biases ? biases[m] : NULL, n, outs[m]);
            return;
        }
        char *p = qmem; /* floats first, then int16, then int8: each aligned */
        float *d32 = NULL, *d256 = NULL;
        int16_t *bs16 = NULL;
        int8_t *q32 = NULL, *q256 = NULL;
        if (any_q80) d32 = (float *)p, p += nc / 32 * sizeof(float);
        if (any_k) {
            d256 = (float *)p, p += nc / 256 * sizeof(float);
            bs16 = (int16_t *)p, p += nc / 16 * sizeof(int16_t);
        }
        if (any_q80) q32 = (int8_t *)p, p += nc;
        if (any_k) q256 = (int8_t *)p;
        for (int32_t t = 0; t < n; t++) {
            const float *xt = x + (size_t)t * cols;
            size_t k = (size_t)t * cols;
            if (any_q80) mg_cpu_q8x(xt, cols, 32, q32 + k, d32 + k / 32, NULL);
            if (any_k) mg_cpu_q8x(xt, cols, 256, q256 + k, d256 + k / 256, bs16 + k / 16);
        }
        j.q8 = 1, j.q32 = q32, j.d32 = d32, j.q256 = q256, j.d256 = d256, j.bs16 = bs16;
    } else if (any_quant) {
        size_t g = (size_t)n * (size_t)(cols / 32);
        qmem = malloc((size_t)n * (size_t)cols * sizeof(int16_t) + 2 * g * sizeof(float));
        if (!qmem) {
            for (int m = 0; m < count; m++) matmul_slow(x, ws[m], biases ? biases[m] : NULL, n, outs[m]);
            return;
        }
        xd = qmem;
        xs = xd + g;
        xq = (int16_t *)(xs + g);
        for (int32_t t = 0; t < n; t++)
            mg_cpu_qx(isa, x + (size_t)t * cols, cols, xq + (size_t)t * cols, xd + (size_t)t * (cols / 32), xs + (size_t)t * (cols / 32));
        int batched = 0; /* some weight takes the batched kernels (more tokens than qtoken_max) */
        for (int m = 0; m < count; m++) batched |= mg_cpu_is_quant(ws[m]->dtype) && n > qtoken_max(isa, ws[m]->dtype);
        if (batched && mg_cpu_q16_pairs(isa)) {
            x2 = malloc((size_t)(n + 1) / 2 * 2 * (size_t)cols * sizeof(int16_t));
            if (x2) mg_cpu_qx_pairs(xq, n, cols, x2); /* else the 4-token kernels, the same bits */
        }
    }
    float *xp = NULL;
    if (any_bf16) { /* x in bf16 order (see perm_bf16_order), once for all weights */
        xp = malloc((size_t)n * (size_t)cols * sizeof(float));
        if (!xp) {
            for (int m = 0; m < count; m++) matmul_slow(x, ws[m], biases ? biases[m] : NULL, n, outs[m]);
            free(x2);
            free(qmem);
            return;
        }
        for (int32_t t = 0; t < n; t++) perm_bf16_order(x + (size_t)t * cols, cols, xp + (size_t)t * cols);
    }
    j.count = count;
    j.n = n;
    j.isa = isa;
    j.rowbuf_floats = (size_t)cols;
    for (int m = 0; m < count; m++)
        if (mg_cpu_is_quant(ws[m]->dtype)) {
            /* widened rows for the batched kernels unless they read the blocks (matmul_chunk) */
            int widen = n > qtoken_max(isa, ws[m]->dtype) && !(x2 && mg_cpu_q16_blocks(isa, ws[m]->dtype));
            size_t f = mg_cpu_qprep_floats(cols) * (widen ? (size_t)qrows_of(cols) : 1);
            if (f > j.rowbuf_floats) j.rowbuf_floats = f;
        }
    j.x = x;
    j.xp = xp;
    j.xq = xq;
    j.xd = xd;
    j.xs = xs;
    j.x2 = x2;
    int nth = mg_pool_threads(pool);
    if (macs < MG_PAR_MIN_MACS) {
        pool = NULL;
        nth = 1;
    }
    for (int m = 0; m < count; m++) {
        j.w[m] = ws[m];
        j.bias[m] = biases ? biases[m] : NULL;
        j.out[m] = outs[m];
        /* enough chunks to balance threads the OS schedules unevenly */
        int32_t per = ws[m]->rows / (nth * 8);
        j.rows_per_chunk[m] = nth == 1 ? ws[m]->rows : per < 4 ? 4 : per;
        j.first_chunk[m + 1] = j.first_chunk[m] + (ws[m]->rows + j.rows_per_chunk[m] - 1) / j.rows_per_chunk[m];
    }
    mg_pool_for(pool, j.first_chunk[count], matmul_chunk, &j);
    for (int i = 0; i < 256; i++) free(j.rowbuf[i]);
    free(xp);
    free(x2);
    free(qmem);
    if (j.failed)
        for (int m = 0; m < count; m++) matmul_slow(x, ws[m], biases ? biases[m] : NULL, n, outs[m]);
}

void mg_cpu_matmul_par(struct mg_pool *pool, const float *x, const mg_cpu_weight *w,
                       const mg_cpu_weight *bias, int32_t n, float *out) {
    mg_cpu_matmul_multi(pool, x, n, 1, &w, &bias, &out);
}

void mg_cpu_matmul_par_isa(struct mg_pool *pool, int isa, const float *x, const mg_cpu_weight *w,
                           const mg_cpu_weight *bias, int32_t n, float *out) {
    mg_cpu_matmul_multi_isa(pool, isa, x, n, 1, &w, &bias, &out);
}

void mg_cpu_matmul(const float *x, const mg_cpu_weight *w, const mg_cpu_weight *bias, int32_t n,
                   float *out) {
    mg_cpu_matmul_par(NULL, x, w, bias, n, out);
}

/* ---- rope ---- */

int mg_cpu_has_rope_factors(const float *factors, int32_t head_dim) {
    for (int32_t i = 0; i < head_dim / 2; i++)
        if (factors[i] != 0) return 1;
    return 0;
}

void mg_cpu_rope_inv_freq(const mg_rope_params *p, float *inv_freq) {
    int32_t half = p->head_dim / 2;
    float base = p->theta, dim = (float)p->head_dim;
    for (int32_t i = 0; i < half; i++) {
        /* HF: 1 / base ** (arange(0, dim, 2).float() / dim), in f32 */
        float inv = 1.0f / powf(base, (float)(2 * i) / dim);
        if (p->type == 1) { /* llama3 */
            float old_ctx = (float)p->original_max_pos;
            float low_wl = old_ctx / p->low_freq_factor;
            float high_wl = old_ctx / p->high_freq_factor;
            float wavelen = (1.0f / inv) * (float)6.283185307179586;
            if (wavelen > low_wl) {
                inv = inv / p->factor;
            } else if (!(wavelen < high_wl)) {
                float smooth = ((1.0f / wavelen) * old_ctx - p->low_freq_factor) /
                               (p->high_freq_factor - p->low_freq_factor);
                inv = (1.0f - smooth) * inv / p->factor + smooth * inv;
            }
        }
        inv_freq[i] = inv;
    }
}

void mg_cpu_rope_freq(float *x, int32_t n, int32_t n_heads, const int32_t *positions,
                      int32_t head_dim, const float *inv_freq) {
    int32_t half = head_dim / 2;
    float cs[512], sn[512]; /* head_dim <= 1024 is checked by the backend */
    for (int32_t t = 0; t < n; t++) {
        float pos = (float)positions[t];
        for (int32_t i = 0; i < half; i++) {
            float a = pos * inv_freq[i];
            cs[i] = cosf(a);
            sn[i] = sinf(a);
        }
        for (int32_t h = 0; h < n_heads; h++) {
            float *v = x + ((size_t)t * n_heads + h) * head_dim;
            for (int32_t i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * cs[i] - b * sn[i];
                v[i + half] = b * cs[i] + a * sn[i];
            }
        }
    }
}

void mg_cpu_rope(float *x, int32_t n, int32_t n_heads, const int32_t *positions,
                 const mg_rope_params *p) {
    float inv[512];
    if (p->head_dim <= 0 || p->head_dim > 1024 || p->head_dim % 2) return;
    mg_cpu_rope_inv_freq(p, inv);
    mg_cpu_rope_freq(x, n, n_heads, positions, p->head_dim, inv);
}

/* ---- attention ---- */

struct attn_job {
    const float *q, *k, *v;
    int32_t n, pos0, n_heads, n_kv, hd;
    float *out, *scratch;
    const uint8_t *tree; /* NULL: causal; else [n, n]: tree[i*n+j] = query i sees this call's key j */
};

/* Whether query i sees key p: every cached key, and this call's keys that are
 * at or before it (causal) or its ancestors and itself (a tree). */
static inline int attn_sees(const struct attn_job *j, int32_t i, int32_t p) {
    return p < j->pos0 || !j->tree || j->tree[(size_t)i * j->n + (p - j->pos0)];
}

/* A chunk is one (query, head) pair. */
static void attn_chunk(void *ctx, int64_t task, int ith) {
    struct attn_job *j = ctx;
    int32_t group = j->n_heads / j->n_kv;
    float *sc = j->scratch + (size_t)ith * (size_t)(j->pos0 + j->n);
    float scale = 1.0f / sqrtf((float)j->hd);
    size_t kv_row = (size_t)j->n_kv * j->hd;
    int32_t i = (int32_t)(task / j->n_heads), h = (int32_t)(task % j->n_heads), kvh = h / group;
    int32_t len = j->pos0 + i + 1;
    const float *q = j->q + ((size_t)i * j->n_heads + h) * j->hd;
    /* A key a tree row does not see scores -inf: its weight is exactly 0,
     * and adding 0 changes no sum, so a tree row computes bit for bit what
     * the same branch run alone does (its ancestors lie at increasing
     * slots, the order the branch's keys have). */
    float mx = -INFINITY;
    for (int32_t p = 0; p < len; p++) {
        if (!attn_sees(j, i, p)) {
            sc[p] = -INFINITY;
            continue;
        }
        float s = dot_f32(q, j->k + (size_t)p * kv_row + (size_t)kvh * j->hd, j->hd) * scale;
        sc[p] = s;
        if (s > mx) mx = s;
    }
    float sum = 0;
    for (int32_t p = 0; p < len; p++) {
        sc[p] = expf(sc[p] - mx);
        sum += sc[p];
    }
    float inv = 1.0f / sum;
    float *o = j->out + (size_t)i * j->n_heads * j->hd + (size_t)h * j->hd;
    const float *v0 = j->v + (size_t)kvh * j->hd;
    int32_t d0 = 0;
#ifdef MG_AVX2
    /* 64 columns at a time in 8 registers: the scalar loop's operations
     * (o[d] += w * v[d], a multiply then an add, p in order), but without
     * storing o and loading it back for every key, which took about half
     * of prefill attention's time. */
    for (; d0 + 64 <= j->hd; d0 += 64) {
        __m256 a[8];
        for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();
        for (int32_t p = 0; p < len; p++) {
            __m256 w = _mm256_set1_ps(sc[p] * inv);
            const float *vr = v0 + (size_t)p * kv_row + d0;
            for (int u = 0; u < 8; u++) a[u] = _mm256_add_ps(a[u], _mm256_mul_ps(w, _mm256_loadu_ps(vr + 8 * u)));
        }
        for (int u = 0; u < 8; u++) _mm256_storeu_ps(o + d0 + 8 * u, a[u]);
    }
#endif
    for (int32_t d = d0; d < j->hd; d++) o[d] = 0;
    for (int32_t p = 0; d0 < j->hd && p < len; p++) {
        float w = sc[p] * inv;
        const float *vr = v0 + (size_t)p * kv_row;
        for (int32_t d = d0; d < j->hd; d++) o[d] += w * vr[d];
    }
}

void mg_cpu_attention_tree_par(struct mg_pool *pool, const float *q, const float *k_cache,
                               const float *v_cache, int32_t n, int32_t pos0, const uint8_t *tree,
                               int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, float *out,
                               float *scratch) {
    struct attn_job j = {q, k_cache, v_cache, n, pos0, n_heads, n_kv_heads, head_dim, out, scratch, tree};
    int64_t macs = (int64_t)n * n_heads * head_dim * 2 * (pos0 + n);
    mg_pool_for(macs < MG_PAR_MIN_MACS ? NULL : pool, (int64_t)n * n_heads, attn_chunk, &j);
}

void mg_cpu_attention_par(struct mg_pool *pool, const float *q, const float *k_cache,
                          const float *v_cache, int32_t n, int32_t pos0, int32_t n_heads,
                          int32_t n_kv_heads, int32_t head_dim, float *out, float *scratch) {
    mg_cpu_attention_tree_par(pool, q, k_cache, v_cache, n, pos0, NULL, n_heads, n_kv_heads, head_dim, out,
                              scratch);
}

void mg_cpu_attention(const float *q, const float *k_cache, const float *v_cache, int32_t n,
                      int32_t pos0, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
                      float *out) {
    float *scratch = malloc((size_t)(pos0 + n) * sizeof(float));
    if (!scratch) return;
    mg_cpu_attention_par(NULL, q, k_cache, v_cache, n, pos0, n_heads, n_kv_heads, head_dim, out,
                         scratch);
    free(scratch);
}

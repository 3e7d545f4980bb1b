/*
 * cpu_quant.c: ggml's block-quantized weights (meshgpu.h MG_Q8_0, MG_Q4_K,
 * MG_Q5_K, MG_Q6_K) on the CPU, read as the GGUF file's blocks.
 *
 * Dequantization is ggml's (and gguf-py's) arithmetic in f32: a group
 * scale s = d * sc and min m = dmin * mn, each rounded, then w = s * q - m
 * (w = s * q without mins), each rounded.
 *
 * Products keep the activations in f32 and factor the scales out of each
 * group of 16 or 32 weights sharing one: for output r,
 *
 *   sum_g s_g * (x_g . q_g) - sum_g m_g * sum(x_g)
 *
 * which reads each weight once, as a small integer widened to f32, with one
 * multiply-add. Its order is fixed, the same on every path and whatever the
 * number of tokens (see "The order" below), so a session's result does not
 * depend on what it is batched with, and the AVX2 path gives the scalar
 * reference's bits exactly (native tests compare them, and both with a
 * float64 product over the dequantized weights).
 *
 * The order, for one row: 8 lanes. For each group g (elements e0..e0+L-1,
 * L = 32, or 16 for Q6_K; groups in element order):
 *   p[l] = x[e0+l] * q[e0+l];  p[l] = fma(x[e0+8k+l], q[e0+8k+l], p[l]) for k = 1..L/8-1
 *   acc[l] = fma(s_g, p[l], acc[l])
 * With mins (Q4_K, Q5_K), per block b of 8 groups: macc[i] = fma(m_{8b+i},
 * xs[8b+i], macc[i]), xs[g] = sum(x_g) (mg_cpu_qxsum). The result is
 * hsum8(acc) - hsum8(macc), hsum8(a) = ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))
 * (cpu_kernels.c's hsum8).
 *
 * Decode (one token) reads the blocks directly; several tokens first widen
 * one row's q values and scales into a per-thread buffer (the row, never
 * the matrix) and apply it to each token.
 */
#include <math.h>
#include <string.h>

#include "cpu_kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define MG_QAVX2 1
#endif

enum { DT_Q8_0 = 8, DT_Q4_K = 12, DT_Q5_K = 13, DT_Q6_K = 14 };

int mg_cpu_is_quant(int32_t dtype) {
    return dtype == DT_Q8_0 || dtype == DT_Q4_K || dtype == DT_Q5_K || dtype == DT_Q6_K;
}

int mg_cpu_quant_block(int32_t dtype, int32_t *elems, int32_t *bytes) {
    int32_t e = 0, b = 0;
    switch (dtype) {
    case DT_Q8_0: e = 32, b = 34; break;
    case DT_Q4_K: e = 256, b = 144; break;
    case DT_Q5_K: e = 256, b = 176; break;
    case DT_Q6_K: e = 256, b = 210; break;
    default: return 0;
    }
    if (elems) *elems = e;
    if (bytes) *bytes = b;
    return 1;
}

size_t mg_cpu_quant_row_bytes(int32_t dtype, int64_t cols) {
    int32_t e, b;
    if (!mg_cpu_quant_block(dtype, &e, &b) || cols <= 0 || cols % e != 0) return 0;
    return (size_t)(cols / e) * (size_t)b;
}

int32_t mg_cpu_quant_group(int32_t dtype) { return dtype == DT_Q6_K ? 16 : 32; }

int mg_cpu_quant_has_min(int32_t dtype) { return dtype == DT_Q4_K || dtype == DT_Q5_K; }

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* ggml's 6-bit scale and min of sub-block j of a Q4_K/Q5_K block's 12 bytes:
 * bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7,
 * bytes 4-7 the same for the mins, bytes 8-11 the low 4 bits of scale 4-7
 * (low nibble) and min 4-7 (high nibble). */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

static inline void k4_scales(const uint8_t *s12, float d, float dmin, float *sc, float *dm) {
    for (int j = 0; j < 8; j++) {
        int a, m;
        scale_min_k4(j, s12, &a, &m);
        sc[j] = d * (float)a;
        dm[j] = dmin * (float)m;
    }
}

/* One block widened: q values as f32 (exact small integers, Q6_K's less
 * 32), the scale of each group and, for Q4_K/Q5_K, the min of each. */
static void block_unpack(int32_t dtype, const uint8_t *b, float *qf, float *sc, float *dm) {
    switch (dtype) {
    case DT_Q8_0: {
        sc[0] = mg_f16_to_f32(rd16(b));
        const int8_t *q = (const int8_t *)(b + 2);
        for (int i = 0; i < 32; i++) qf[i] = (float)q[i];
        break;
    }
    case DT_Q4_K: {
        k4_scales(b + 4, mg_f16_to_f32(rd16(b)), mg_f16_to_f32(rd16(b + 2)), sc, dm);
        const uint8_t *qs = b + 16;
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                qf[64 * j + l] = (float)(qs[32 * j + l] & 0xF);
                qf[64 * j + 32 + l] = (float)(qs[32 * j + l] >> 4);
            }
        break;
    }
    case DT_Q5_K: {
        k4_scales(b + 4, mg_f16_to_f32(rd16(b)), mg_f16_to_f32(rd16(b + 2)), sc, dm);
        const uint8_t *qh = b + 16, *qs = b + 48;
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                qf[64 * j + l] = (float)((qs[32 * j + l] & 0xF) | (((qh[l] >> (2 * j)) & 1) << 4));
                qf[64 * j + 32 + l] = (float)((qs[32 * j + l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4));
            }
        break;
    }
    case DT_Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *s = (const int8_t *)(b + 192);
        float d = mg_f16_to_f32(rd16(b + 208));
        for (int g = 0; g < 16; g++) sc[g] = d * (float)s[g];
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                const uint8_t *a = ql + 64 * h, *c = qh + 32 * h;
                float *y = qf + 128 * h;
                y[l] = (float)((int)((a[l] & 0xF) | ((c[l] & 3) << 4)) - 32);
                y[l + 32] = (float)((int)((a[l + 32] & 0xF) | (((c[l] >> 2) & 3) << 4)) - 32);
                y[l + 64] = (float)((int)((a[l] >> 4) | (((c[l] >> 4) & 3) << 4)) - 32);
                y[l + 96] = (float)((int)((a[l + 32] >> 4) | (((c[l] >> 6) & 3) << 4)) - 32);
            }
        break;
    }
    }
}

void mg_cpu_dequant_row(int32_t dtype, const void *src, int32_t n, float *dst) {
    int32_t be, bb;
    if (!mg_cpu_quant_block(dtype, &be, &bb)) return;
    int32_t gl = mg_cpu_quant_group(dtype), mins = mg_cpu_quant_has_min(dtype);
    float qf[256], sc[16], dm[8];
    for (int32_t b = 0; b < n / be; b++) {
        block_unpack(dtype, (const uint8_t *)src + (size_t)b * bb, qf, sc, dm);
        float *y = dst + (size_t)b * be;
        for (int32_t i = 0; i < be; i++) y[i] = mins ? sc[i / gl] * qf[i] - dm[i / gl] : sc[i / gl] * qf[i];
    }
}

size_t mg_cpu_qprep_floats(int32_t cols) { return (size_t)cols + (size_t)cols / 16 + (size_t)cols / 32 + 16; }

void mg_cpu_qprep_row(int32_t dtype, const void *row, int32_t cols, float *buf) {
    int32_t be, bb;
    if (!mg_cpu_quant_block(dtype, &be, &bb)) return;
    int32_t gl = mg_cpu_quant_group(dtype), groups = be / gl;
    float *qf = buf, *sc = qf + cols, *dm = sc + cols / gl;
    for (int32_t b = 0; b < cols / be; b++)
        block_unpack(dtype, (const uint8_t *)row + (size_t)b * bb, qf + (size_t)b * be, sc + (size_t)b * groups,
                     dm + (size_t)b * 8);
}

/* ---- the scalar reference ---- */

static inline float hsum8_ref(const float *a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

static float xsum32_ref(const float *x) {
    float v[8];
    for (int l = 0; l < 8; l++) v[l] = x[l];
    for (int k = 1; k < 4; k++)
        for (int l = 0; l < 8; l++) v[l] = v[l] + x[8 * k + l];
    return hsum8_ref(v);
}

/* x . row for a row widened by mg_cpu_qprep_row. */
static float qdot_prep_ref(int32_t dtype, const float *buf, const float *x, const float *xs, int32_t cols) {
    int32_t gl = mg_cpu_quant_group(dtype);
    const float *qf = buf, *sc = qf + cols, *dm = sc + cols / gl;
    float acc[8] = {0}, macc[8] = {0};
    for (int32_t g = 0; g < cols / gl; g++) {
        const float *xg = x + (size_t)g * gl, *qg = qf + (size_t)g * gl;
        float p[8];
        for (int l = 0; l < 8; l++) p[l] = xg[l] * qg[l];
        for (int k = 1; k < gl / 8; k++)
            for (int l = 0; l < 8; l++) p[l] = fmaf(xg[8 * k + l], qg[8 * k + l], p[l]);
        for (int l = 0; l < 8; l++) acc[l] = fmaf(sc[g], p[l], acc[l]);
    }
    if (!mg_cpu_quant_has_min(dtype)) return hsum8_ref(acc);
    for (int32_t b = 0; b < cols / 256; b++)
        for (int i = 0; i < 8; i++) {
            int32_t g = 8 * b + i;
            macc[i] = fmaf(dm[g], xs ? xs[g] : xsum32_ref(x + (size_t)g * 32), macc[i]);
        }
    return hsum8_ref(acc) - hsum8_ref(macc);
}

/* ---- AVX2 ---- */

#ifdef MG_QAVX2
static inline float hsum8q(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline __m256i zx8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline __m256 sx8f(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline float f16(const uint8_t *p) { return _cvtsh_ss(rd16(p)); }

static float xsum32_avx2(const float *x) {
    __m256 v = _mm256_loadu_ps(x);
    v = _mm256_add_ps(v, _mm256_loadu_ps(x + 8));
    v = _mm256_add_ps(v, _mm256_loadu_ps(x + 16));
    v = _mm256_add_ps(v, _mm256_loadu_ps(x + 24));
    return hsum8q(v);
}

static float qdot_q8_0_avx2(const uint8_t *row, const float *x, int32_t cols) {
    __m256 acc = _mm256_setzero_ps();
    for (int32_t b = 0; b < cols / 32; b++) {
        const uint8_t *blk = row + (size_t)b * 34, *q = blk + 2;
        const float *xb = x + (size_t)b * 32;
        __m256 p = _mm256_mul_ps(_mm256_loadu_ps(xb), sx8f(q));
        p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), sx8f(q + 8), p);
        p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), sx8f(q + 16), p);
        p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), sx8f(q + 24), p);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(blk)), p, acc);
    }
    return hsum8q(acc);
}

/* Q4_K (hbits NULL) and Q5_K: per 64 elements j, 32 bytes of nibbles: low
 * nibbles are group 2j, high nibbles group 2j+1; Q5_K's fifth bits are bit
 * 2j and 2j+1 of the 32 hbits bytes. */
static float qdot_k45_avx2(const uint8_t *row, int q5, const float *x, const float *xs, int32_t cols) {
    const __m256i m4 = _mm256_set1_epi32(0xF), one = _mm256_set1_epi32(1);
    __m256 acc = _mm256_setzero_ps(), macc = _mm256_setzero_ps();
    const int32_t bb = q5 ? 176 : 144;
    for (int32_t b = 0; b < cols / 256; b++) {
        const uint8_t *blk = row + (size_t)b * bb;
        const uint8_t *qh = blk + 16, *qs = blk + (q5 ? 48 : 16);
        const float *xb = x + (size_t)b * 256;
        float sc[8], dm[8];
        k4_scales(blk + 4, f16(blk), f16(blk + 2), sc, dm);
        for (int j = 0; j < 4; j++) {
            __m256 plo = _mm256_setzero_ps(), phi = plo;
            const __m256i slo = _mm256_set1_epi32(2 * j), shi = _mm256_set1_epi32(2 * j + 1);
            for (int k = 0; k < 4; k++) {
                __m256i v = zx8(qs + 32 * j + 8 * k);
                __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_srli_epi32(v, 4);
                if (q5) {
                    __m256i h = zx8(qh + 8 * k);
                    lo = _mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(h, slo), one), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(h, shi), one), 4));
                }
                __m256 xl = _mm256_loadu_ps(xb + 64 * j + 8 * k), xh = _mm256_loadu_ps(xb + 64 * j + 32 + 8 * k);
                if (k == 0) {
                    plo = _mm256_mul_ps(xl, _mm256_cvtepi32_ps(lo));
                    phi = _mm256_mul_ps(xh, _mm256_cvtepi32_ps(hi));
                } else {
                    plo = _mm256_fmadd_ps(xl, _mm256_cvtepi32_ps(lo), plo);
                    phi = _mm256_fmadd_ps(xh, _mm256_cvtepi32_ps(hi), phi);
                }
            }
            acc = _mm256_fmadd_ps(_mm256_set1_ps(sc[2 * j]), plo, acc);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(sc[2 * j + 1]), phi, acc);
        }
        macc = _mm256_fmadd_ps(_mm256_loadu_ps(dm), _mm256_loadu_ps(xs + (size_t)b * 8), macc);
    }
    return hsum8q(acc) - hsum8q(macc);
}

/* Q6_K: per 128 elements h, element 32*quad + l (l < 32) takes the low
 * nibble (quads 0, 1) or high nibble (2, 3) of ql[l] (quads 0, 2) or
 * ql[l + 32] (1, 3) and bits 2*quad of qh[l]; its group is 8h + 2 quad + l/16. */
static float qdot_q6_k_avx2(const uint8_t *row, const float *x, int32_t cols) {
    const __m256i m4 = _mm256_set1_epi32(0xF), m2 = _mm256_set1_epi32(3), o32 = _mm256_set1_epi32(32);
    __m256 acc = _mm256_setzero_ps();
    for (int32_t b = 0; b < cols / 256; b++) {
        const uint8_t *blk = row + (size_t)b * 210;
        const int8_t *s = (const int8_t *)(blk + 192);
        float d = f16(blk + 208), sc[16];
        for (int g = 0; g < 16; g++) sc[g] = d * (float)s[g];
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
            const float *xh = x + (size_t)b * 256 + 128 * h;
            __m256 p[4][2];
            for (int sub = 0; sub < 2; sub++)
                for (int k = 0; k < 2; k++) {
                    int l8 = 16 * sub + 8 * k;
                    __m256i a = zx8(ql + l8), a2 = zx8(ql + 32 + l8), c = zx8(qh + l8);
                    __m256i q[4];
                    q[0] = _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_slli_epi32(_mm256_and_si256(c, m2), 4));
                    q[1] = _mm256_or_si256(_mm256_and_si256(a2, m4),
                                           _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(c, 2), m2), 4));
                    q[2] = _mm256_or_si256(_mm256_srli_epi32(a, 4),
                                           _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(c, 4), m2), 4));
                    q[3] = _mm256_or_si256(_mm256_srli_epi32(a2, 4), _mm256_slli_epi32(_mm256_srli_epi32(c, 6), 4));
                    for (int quad = 0; quad < 4; quad++) {
                        __m256 qv = _mm256_cvtepi32_ps(_mm256_sub_epi32(q[quad], o32));
                        __m256 xv = _mm256_loadu_ps(xh + 32 * quad + l8);
                        p[quad][sub] = k == 0 ? _mm256_mul_ps(xv, qv) : _mm256_fmadd_ps(xv, qv, p[quad][sub]);
                    }
                }
            for (int quad = 0; quad < 4; quad++)
                for (int sub = 0; sub < 2; sub++)
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(sc[8 * h + 2 * quad + sub]), p[quad][sub], acc);
        }
    }
    return hsum8q(acc);
}

static float qdot_prep_avx2(int32_t dtype, const float *buf, const float *x, const float *xs, int32_t cols) {
    int32_t gl = mg_cpu_quant_group(dtype);
    const float *qf = buf, *sc = qf + cols, *dm = sc + cols / gl;
    __m256 acc = _mm256_setzero_ps();
    if (gl == 32) {
        for (int32_t g = 0; g < cols / 32; g++) {
            const float *xg = x + (size_t)g * 32, *qg = qf + (size_t)g * 32;
            __m256 p = _mm256_mul_ps(_mm256_loadu_ps(xg), _mm256_loadu_ps(qg));
            p = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 8), _mm256_loadu_ps(qg + 8), p);
            p = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 16), _mm256_loadu_ps(qg + 16), p);
            p = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 24), _mm256_loadu_ps(qg + 24), p);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(sc[g]), p, acc);
        }
    } else {
        for (int32_t g = 0; g < cols / 16; g++) {
            const float *xg = x + (size_t)g * 16, *qg = qf + (size_t)g * 16;
            __m256 p = _mm256_mul_ps(_mm256_loadu_ps(xg), _mm256_loadu_ps(qg));
            p = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 8), _mm256_loadu_ps(qg + 8), p);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(sc[g]), p, acc);
        }
    }
    if (!mg_cpu_quant_has_min(dtype)) return hsum8q(acc);
    __m256 macc = _mm256_setzero_ps();
    for (int32_t b = 0; b < cols / 256; b++)
        macc = _mm256_fmadd_ps(_mm256_loadu_ps(dm + (size_t)b * 8), _mm256_loadu_ps(xs + (size_t)b * 8), macc);
    return hsum8q(acc) - hsum8q(macc);
}

/* qdot_prep_avx2 for 4 tokens at once: each row value is loaded once and
 * used four times (several tokens are bound by loads); every token's sum is
 * computed exactly as qdot_prep_avx2 computes it. */
static void qdot_prep4_avx2(int32_t dtype, const float *buf, const float *const *x, const float *const *xs, int32_t cols,
                            float *out) {
    int32_t gl = mg_cpu_quant_group(dtype);
    const float *qf = buf, *sc = qf + cols, *dm = sc + cols / gl;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
#define MG_Q4TOK(k0, FIRST)                                                              \
    do {                                                                                 \
        __m256 qv = _mm256_loadu_ps(qg + (k0));                                          \
        if (FIRST) {                                                                     \
            p0 = _mm256_mul_ps(_mm256_loadu_ps(x[0] + off + (k0)), qv);                  \
            p1 = _mm256_mul_ps(_mm256_loadu_ps(x[1] + off + (k0)), qv);                  \
            p2 = _mm256_mul_ps(_mm256_loadu_ps(x[2] + off + (k0)), qv);                  \
            p3 = _mm256_mul_ps(_mm256_loadu_ps(x[3] + off + (k0)), qv);                  \
        } else {                                                                         \
            p0 = _mm256_fmadd_ps(_mm256_loadu_ps(x[0] + off + (k0)), qv, p0);            \
            p1 = _mm256_fmadd_ps(_mm256_loadu_ps(x[1] + off + (k0)), qv, p1);            \
            p2 = _mm256_fmadd_ps(_mm256_loadu_ps(x[2] + off + (k0)), qv, p2);            \
            p3 = _mm256_fmadd_ps(_mm256_loadu_ps(x[3] + off + (k0)), qv, p3);            \
        }                                                                                \
    } while (0)
    for (int32_t g = 0; g < cols / gl; g++) {
        size_t off = (size_t)g * gl;
        const float *qg = qf + off;
        __m256 p0, p1, p2, p3;
        MG_Q4TOK(0, 1);
        MG_Q4TOK(8, 0);
        if (gl == 32) {
            MG_Q4TOK(16, 0);
            MG_Q4TOK(24, 0);
        }
        __m256 s = _mm256_set1_ps(sc[g]);
        a0 = _mm256_fmadd_ps(s, p0, a0);
        a1 = _mm256_fmadd_ps(s, p1, a1);
        a2 = _mm256_fmadd_ps(s, p2, a2);
        a3 = _mm256_fmadd_ps(s, p3, a3);
    }
#undef MG_Q4TOK
    out[0] = hsum8q(a0), out[1] = hsum8q(a1), out[2] = hsum8q(a2), out[3] = hsum8q(a3);
    if (!mg_cpu_quant_has_min(dtype)) return;
    for (int t = 0; t < 4; t++) {
        __m256 macc = _mm256_setzero_ps();
        for (int32_t b = 0; b < cols / 256; b++)
            macc = _mm256_fmadd_ps(_mm256_loadu_ps(dm + (size_t)b * 8), _mm256_loadu_ps(xs[t] + (size_t)b * 8), macc);
        out[t] = out[t] - hsum8q(macc);
    }
}
#endif

/* ---- dispatch ---- */

static int use_avx2(int isa) {
#ifdef MG_QAVX2
    return isa >= MG_ISA_AVX2;
#else
    (void)isa;
    return 0;
#endif
}

void mg_cpu_qxsum(int isa, const float *x, int32_t cols, float *xs) {
    for (int32_t g = 0; g < cols / 32; g++) {
#ifdef MG_QAVX2
        if (use_avx2(isa)) {
            xs[g] = xsum32_avx2(x + (size_t)g * 32);
            continue;
        }
#endif
        xs[g] = xsum32_ref(x + (size_t)g * 32);
    }
}

float mg_cpu_qdot(int isa, int32_t dtype, const void *row, const float *x, const float *xs, int32_t cols, float *buf) {
#ifdef MG_QAVX2
    if (use_avx2(isa) && (xs || !mg_cpu_quant_has_min(dtype))) {
        switch (dtype) {
        case DT_Q8_0: return qdot_q8_0_avx2(row, x, cols);
        case DT_Q4_K: return qdot_k45_avx2(row, 0, x, xs, cols);
        case DT_Q5_K: return qdot_k45_avx2(row, 1, x, xs, cols);
        case DT_Q6_K: return qdot_q6_k_avx2(row, x, cols);
        }
    }
#endif
    mg_cpu_qprep_row(dtype, row, cols, buf);
    return qdot_prep_ref(dtype, buf, x, xs, cols);
}

float mg_cpu_qdot_prep(int isa, int32_t dtype, const float *buf, const float *x, const float *xs, int32_t cols) {
#ifdef MG_QAVX2
    if (use_avx2(isa) && (xs || !mg_cpu_quant_has_min(dtype))) return qdot_prep_avx2(dtype, buf, x, xs, cols);
#endif
    (void)isa;
    return qdot_prep_ref(dtype, buf, x, xs, cols);
}

void mg_cpu_qdot_prep4(int isa, int32_t dtype, const float *buf, const float *const *x, const float *const *xs, int32_t cols,
                       float *out) {
#ifdef MG_QAVX2
    if (use_avx2(isa) && (xs[0] || !mg_cpu_quant_has_min(dtype))) {
        qdot_prep4_avx2(dtype, buf, x, xs, cols, out);
        return;
    }
#endif
    for (int t = 0; t < 4; t++) out[t] = mg_cpu_qdot_prep(isa, dtype, buf, x[t], xs[t], cols);
}

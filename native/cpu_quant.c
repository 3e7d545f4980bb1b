/*
 * cpu_quant.c: ggml's block-quantized weights (meshgpu.h MG_Q8_0, MG_Q4_K,
 * MG_Q5_K, MG_Q6_K) on the CPU, read as the GGUF file's blocks.
 *
 * Dequantization is ggml's (and gguf-py's) arithmetic in f32: a group
 * scale s = d * sc and min m = dmin * mn, each rounded, then w = s * q - m
 * (w = s * q without mins), each rounded.
 *
 * The 16-bit path (the default for decode steps and short prompts; on
 * AVX-512 prompts take f32 products on dequantized rows,
 * cpu_matmul_avx512.c, or this path's rounding with tokens in the lanes,
 * cpu_matmul_q16prompt.c; cpu_quant8.c has the 8-bit one, chosen by name:
 * cpu_isa.c says why). Products round each token's activations to 16 bits per group of 32
 * (xd = max|x| / 32767, xq = rint(x / xd) as x * (32767 / max|x|): a
 * relative error below 2^-16 of the group's largest value, far below the
 * weights' own) and factor the scales out of each group of 16 or 32
 * weights sharing one: for output r,
 *
 *   sum_g (s_g * xd_g) * (xq_g . q_g) - sum_g m_g * sum(x_g)
 *
 * The integer dot products are exact (vpmaddwd on AVX2: 16 multiply-adds
 * per instruction, against 8 for f32 FMAs, and no widening of weights to
 * f32), so each weight costs about a third of what an f32 product of the
 * same weights costs; the min term uses the f32 sums of x. The order of
 * the float operations is fixed, the same on every path and whatever the
 * number of tokens (see "The order" below), so a session's result does not
 * depend on what it is batched with, and the AVX2 and AVX-512 paths give
 * the scalar reference's bits exactly (native tests compare them, and both with a
 * float64 product over the dequantized weights).
 *
 * The order, for one row: 8 lanes. For each group g (elements e0..e0+L-1,
 * L = 32, or 16 for Q6_K; groups in element order), lane l holds the exact
 * integer p[l] = sum over k of xq[e0+16k+2l] q[e0+16k+2l] + xq[e0+16k+2l+1]
 * q[e0+16k+2l+1] (k < L/16: vpmaddwd's pairs), and
 *   acc[l] = fma(s_g * xd_{e0/32}, (float)p[l], acc[l])
 * With mins (Q4_K, Q5_K), per block b of 8 groups: macc[i] = fma(m_{8b+i},
 * xs[8b+i], macc[i]), xs[g] = sum(x_g) in f32 (mg_cpu_qx). The result is
 * hsum8(acc) - hsum8(macc), hsum8(a) = ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))
 * (cpu_kernels.c's hsum8).
 *
 * Decode (one token) reads the blocks directly; several tokens first widen
 * a few rows' q values (int16) and scales into a per-thread buffer (rows,
 * never the matrix) and pass the tokens through them 4 at a time (AVX2)
 * or 8 (AVX-512, two per register: see the AVX-512 section).
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

/* A widened row: q as int16 [cols], then the group scales (cols/L
 * floats), then the mins (cols/32 floats). */
size_t mg_cpu_qprep_floats(int32_t cols) { return (size_t)cols / 2 + (size_t)cols / 16 + (size_t)cols / 32 + 16; }

static void qprep_row_ref(int32_t dtype, const void *row, int32_t cols, float *buf) {
    int32_t be, bb;
    if (!mg_cpu_quant_block(dtype, &be, &bb)) return;
    int32_t gl = mg_cpu_quant_group(dtype), groups = be / gl;
    int16_t *q = (int16_t *)buf;
    float *sc = buf + cols / 2, *dm = sc + cols / gl, qf[256];
    for (int32_t b = 0; b < cols / be; b++) {
        block_unpack(dtype, (const uint8_t *)row + (size_t)b * bb, qf, sc + (size_t)b * groups, dm + (size_t)b * 8);
        for (int32_t i = 0; i < be; i++) q[(size_t)b * be + i] = (int16_t)qf[i];
    }
}

/* ---- the scalar reference ---- */

static inline float hsum8_ref(const float *a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

static void qx_ref(const float *x, int32_t cols, int16_t *xq, float *xd, float *xs) {
    for (int32_t g = 0; g < cols / 32; g++) {
        const float *xg = x + (size_t)g * 32;
        float v[8], amax = 0;
        for (int l = 0; l < 8; l++) v[l] = xg[l];
        for (int k = 1; k < 4; k++)
            for (int l = 0; l < 8; l++) v[l] = v[l] + xg[8 * k + l];
        xs[g] = hsum8_ref(v);
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xg[i]));
        float id = amax > 0 ? 32767.0f / amax : 0.0f;
        xd[g] = amax / 32767.0f;
        for (int i = 0; i < 32; i++) xq[(size_t)g * 32 + i] = (int16_t)rintf(xg[i] * id);
    }
}

/* x . row for a row widened by mg_cpu_qprep_row. */
static float qdot_prep_ref(int32_t dtype, const float *buf, const int16_t *xq, const float *xd, const float *xs, int32_t cols) {
    int32_t gl = mg_cpu_quant_group(dtype);
    const int16_t *q = (const int16_t *)buf;
    const float *sc = buf + cols / 2, *dm = sc + cols / gl;
    float acc[8] = {0}, macc[8] = {0};
    for (int32_t g = 0; g < cols / gl; g++) {
        size_t e0 = (size_t)g * gl;
        float s = sc[g] * xd[e0 / 32];
        for (int l = 0; l < 8; l++) {
            int32_t p = 0;
            for (int k = 0; k < gl / 16; k++) {
                size_t e = e0 + 16 * k + 2 * l;
                p += (int32_t)xq[e] * q[e] + (int32_t)xq[e + 1] * q[e + 1];
            }
            acc[l] = fmaf(s, (float)p, acc[l]);
        }
    }
    if (!mg_cpu_quant_has_min(dtype)) return hsum8_ref(acc);
    for (int32_t b = 0; b < cols / 256; b++)
        for (int i = 0; i < 8; i++) macc[i] = fmaf(dm[8 * b + i], xs[8 * b + i], macc[i]);
    return hsum8_ref(acc) - hsum8_ref(macc);
}

/* ---- AVX2 ---- */

#ifdef MG_QAVX2
/* decode kernels prefetch the weights this many bytes ahead (see below) */
#ifndef MG_QPF
#define MG_QPF 2048
#endif

static inline float hsum8q(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline float f16(const uint8_t *p) { return _cvtsh_ss(rd16(p)); }
static inline __m256i ld(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* The exact p lanes of a 32-element group: 32 weights as bytes (unsigned
 * or signed widening) against 32 int16 activations. */
static inline __m256i dot32u(__m256i w8, const int16_t *x) {
    __m256i a = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(w8)), b = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(w8, 1));
    return _mm256_add_epi32(_mm256_madd_epi16(a, ld(x)), _mm256_madd_epi16(b, ld(x + 16)));
}
static inline __m256i dot32s(__m256i w8, const int16_t *x) {
    __m256i a = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w8)), b = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w8, 1));
    return _mm256_add_epi32(_mm256_madd_epi16(a, ld(x)), _mm256_madd_epi16(b, ld(x + 16)));
}
/* *p in every lane, loaded so: with the scales kept in registers GCC
 * broadcast each with two shuffles, on the port the kernels' unpacking
 * already fills. */
static inline __m256 bcast_mem(const float *p) {
    __m256 v;
    __asm__("vbroadcastss %1, %0" : "=v"(v) : "m"(*p));
    return v;
}
/* acc + *s * p, the group's scale from memory */
static inline __m256 acc_group(__m256 acc, const float *s, __m256i p) { return _mm256_fmadd_ps(bcast_mem(s), _mm256_cvtepi32_ps(p), acc); }

static void qx_avx2(const float *x, int32_t cols, int16_t *xq, float *xd, float *xs) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int32_t g = 0; g < cols / 32; g++) {
        const float *xg = x + (size_t)g * 32;
        __m256 v0 = _mm256_loadu_ps(xg), v1 = _mm256_loadu_ps(xg + 8), v2 = _mm256_loadu_ps(xg + 16), v3 = _mm256_loadu_ps(xg + 24);
        xs[g] = hsum8q(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v0, v1), v2), v3));
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, absmask), _mm256_and_ps(v1, absmask)),
                                 _mm256_max_ps(_mm256_and_ps(v2, absmask), _mm256_and_ps(v3, absmask)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        float amax = _mm_cvtss_f32(h);
        float id = amax > 0 ? 32767.0f / amax : 0.0f;
        xd[g] = amax / 32767.0f;
        __m256 iv = _mm256_set1_ps(id);
        __m256i a = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v0, iv)), _mm256_cvtps_epi32(_mm256_mul_ps(v1, iv)));
        __m256i b = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v2, iv)), _mm256_cvtps_epi32(_mm256_mul_ps(v3, iv)));
        /* packs interleaves 128-bit halves: 0-3 8-11 4-7 12-15; put them back */
        _mm256_storeu_si256((__m256i *)(xq + (size_t)g * 32), _mm256_permute4x64_epi64(a, 0xD8));
        _mm256_storeu_si256((__m256i *)(xq + (size_t)g * 32 + 16), _mm256_permute4x64_epi64(b, 0xD8));
    }
}

static float qdot_q8_0_avx2(const uint8_t *row, const int16_t *xq, const float *xd, int32_t cols) {
    __m256 acc = _mm256_setzero_ps();
    for (int32_t b = 0; b < cols / 32; b++) {
        const uint8_t *blk = row + (size_t)b * 34;
        _mm_prefetch((const char *)blk + MG_QPF, _MM_HINT_T0);
        const float s = f16(blk) * xd[b];
        acc = acc_group(acc, &s, dot32s(ld(blk + 2), xq + (size_t)b * 32));
    }
    return hsum8q(acc);
}

/* Q4_K (q5 0) and Q5_K: per 64 elements j, 32 bytes of nibbles: low
 * nibbles are group 2j, high nibbles group 2j+1; Q5_K's fifth bits are bit
 * 2j and 2j+1 of its 32 bytes. */
/* k4_scales in registers: the 8 scales d * sc and mins dmin * m (the same
 * f32 products), from the 12 bytes read as three words. */
static inline void k4_scales_avx2(const uint8_t *s12, float d, float dmin, __m256 *sc, __m256 *dm) {
    uint32_t w[3];
    memcpy(w, s12, 12);
    uint32_t s03 = w[0] & 0x3f3f3f3fu, m03 = w[1] & 0x3f3f3f3fu;
    uint32_t s47 = (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4);
    uint32_t m47 = ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4);
    __m256 fs = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)s03 | (long long)s47 << 32)));
    __m256 fm = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m03 | (long long)m47 << 32)));
    *sc = _mm256_mul_ps(_mm256_set1_ps(d), fs);
    *dm = _mm256_mul_ps(_mm256_set1_ps(dmin), fm);
}

/* A Q4_K/Q5_K block's start in the one-token kernels (AVX2 and AVX-512):
 * prefetch the block MG_QPF ahead, and its 8 group scales times the
 * activations' (s_g * xd_g) into sc, its mins (dmin * m) into dm. */
static inline void k45_block_scales(const uint8_t *blk, const float *xd8, float sc[8], __m256 *dm) {
    _mm_prefetch((const char *)blk + MG_QPF, _MM_HINT_T0);
    _mm_prefetch((const char *)blk + MG_QPF + 64, _MM_HINT_T0);
    _mm_prefetch((const char *)blk + MG_QPF + 128, _MM_HINT_T0);
    __m256 scv;
    k4_scales_avx2(blk + 4, f16(blk), f16(blk + 2), &scv, dm);
    _mm256_storeu_ps(sc, _mm256_mul_ps(scv, _mm256_loadu_ps(xd8))); /* s_g * xd_g */
}

static float qdot_k45_avx2(const uint8_t *row, int q5, const int16_t *xq, const float *xd, const float *xs, int32_t cols) {
    const __m256i m4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps(), macc = _mm256_setzero_ps();
    const int32_t bb = q5 ? 176 : 144;
    for (int32_t b = 0; b < cols / 256; b++) {
        const uint8_t *blk = row + (size_t)b * bb;
        const uint8_t *qs = blk + (q5 ? 48 : 16);
        const int16_t *xb = xq + (size_t)b * 256;
        float sc[8];
        __m256 dmv;
        k45_block_scales(blk, xd + (size_t)b * 8, sc, &dmv);
        __m256i hb = q5 ? ld(blk + 16) : _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            __m256i v = ld(qs + 32 * j);
            __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if (q5) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * j)), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * j + 1)), one), 4));
            }
            acc = acc_group(acc, sc + 2 * j, dot32u(lo, xb + 64 * j));
            acc = acc_group(acc, sc + 2 * j + 1, dot32u(hi, xb + 64 * j + 32));
        }
        macc = _mm256_fmadd_ps(dmv, _mm256_loadu_ps(xs + (size_t)b * 8), macc);
    }
    return hsum8q(acc) - hsum8q(macc);
}

/* Decode kernels over NR rows at once (1 or 2; each row's arithmetic is
 * the single-row order above). Decode calls them with NR 1: on this
 * backend's test machine (2-core EPYC, AVX2) two interleaved rows read as
 * two streams ran at half the speed from memory. Weights are widened to
 * int16 straight from memory (vpmovzxbw with a memory operand), then
 * nibbles and high bits are cut out in 16-bit lanes: the same q values with
 * fewer lane-crossing shuffles. Each block prefetches the weights MG_QPF
 * bytes ahead (into the following rows, which lie next in memory): about
 * a third more decode speed there than the hardware prefetcher alone. */
#define MG_AI static inline __attribute__((always_inline))
static inline __m256i ldw(const uint8_t *p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)); }

MG_AI void qdot_q4_k_rows(int NR, const uint8_t *row0, size_t rb, const int16_t *xq, const float *xd, const float *xs,
                          int32_t cols, float *out) {
    const __m256i m4 = _mm256_set1_epi16(0xF);
    __m256 acc[2], macc[2];
#pragma GCC unroll 2
    for (int r = 0; r < NR; r++) acc[r] = macc[r] = _mm256_setzero_ps();
    for (int32_t b = 0; b < cols / 256; b++) {
        const int16_t *xb = xq + (size_t)b * 256;
        const __m256 xdv = _mm256_loadu_ps(xd + (size_t)b * 8), xsv = _mm256_loadu_ps(xs + (size_t)b * 8);
        float sc[2][8];
        const uint8_t *blk[2];
#pragma GCC unroll 2
        for (int r = 0; r < NR; r++) {
            blk[r] = row0 + (size_t)r * rb + (size_t)b * 144;
            _mm_prefetch((const char *)blk[r] + MG_QPF, _MM_HINT_T0);
            _mm_prefetch((const char *)blk[r] + MG_QPF + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)blk[r] + MG_QPF + 128, _MM_HINT_T0);
            __m256 scv, dmv;
            k4_scales_avx2(blk[r] + 4, f16(blk[r]), f16(blk[r] + 2), &scv, &dmv);
            _mm256_storeu_ps(sc[r], _mm256_mul_ps(scv, xdv));
            macc[r] = _mm256_fmadd_ps(dmv, xsv, macc[r]);
        }
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            const int16_t *x = xb + 64 * j;
            __m256i x0 = ld(x), x1 = ld(x + 16), x2 = ld(x + 32), x3 = ld(x + 48);
#pragma GCC unroll 2
            for (int r = 0; r < NR; r++) {
                const uint8_t *qs = blk[r] + 16 + 32 * j;
                __m256i v0 = ldw(qs), v1 = ldw(qs + 16);
                __m256i plo = _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(v0, m4), x0), _mm256_madd_epi16(_mm256_and_si256(v1, m4), x1));
                __m256i phi = _mm256_add_epi32(_mm256_madd_epi16(_mm256_srli_epi16(v0, 4), x2), _mm256_madd_epi16(_mm256_srli_epi16(v1, 4), x3));
                acc[r] = acc_group(acc[r], sc[r] + 2 * j, plo);
                acc[r] = acc_group(acc[r], sc[r] + 2 * j + 1, phi);
            }
        }
    }
#pragma GCC unroll 2
    for (int r = 0; r < NR; r++) out[r] = hsum8q(acc[r]) - hsum8q(macc[r]);
}

/* Q6_K: per 128 elements h, element 32*quad + l (l < 32) takes the low
 * nibble (quads 0, 1) or high nibble (2, 3) of ql[l] (quads 0, 2) or
 * ql[l + 32] (1, 3) and bits 2*quad of qh[l]; its group is 8h + 2 quad + l/16. */
MG_AI void qdot_q6_k_rows(int NR, const uint8_t *row0, size_t rb, const int16_t *xq, const float *xd, int32_t cols, float *out) {
    const __m256i m4 = _mm256_set1_epi16(0xF), m30 = _mm256_set1_epi16(0x30), o32 = _mm256_set1_epi16(32);
    __m256 acc[2];
#pragma GCC unroll 2
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    for (int32_t b = 0; b < cols / 256; b++) {
        float sc[2][16]; /* (d * sc_g) * xd of the group's 32 */
        const uint8_t *blk[2];
#pragma GCC unroll 2
        for (int r = 0; r < NR; r++) {
            blk[r] = row0 + (size_t)r * rb + (size_t)b * 210;
            _mm_prefetch((const char *)blk[r] + MG_QPF, _MM_HINT_T0);
            _mm_prefetch((const char *)blk[r] + MG_QPF + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)blk[r] + MG_QPF + 128, _MM_HINT_T0);
            _mm_prefetch((const char *)blk[r] + MG_QPF + 192, _MM_HINT_T0);
            const __m256 d = _mm256_set1_ps(f16(blk[r] + 208));
            __m128i s8 = _mm_loadu_si128((const __m128i *)(blk[r] + 192));
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                __m128 x4 = _mm_loadu_ps(xd + (size_t)b * 8 + 4 * h);
                __m256 x8 = _mm256_set_m128(_mm_unpackhi_ps(x4, x4), _mm_unpacklo_ps(x4, x4));
                __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h ? _mm_srli_si128(s8, 8) : s8));
                _mm256_storeu_ps(sc[r] + 8 * h, _mm256_mul_ps(_mm256_mul_ps(d, f), x8));
            }
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const int16_t *x = xq + (size_t)b * 256 + 128 * h;
            const __m256i x00 = ld(x), x01 = ld(x + 16);
            __m256i A0[2], A1[2], B0[2], B1[2], C0[2], C1[2];
#pragma GCC unroll 2
            for (int r = 0; r < NR; r++) {
                const uint8_t *a = blk[r] + 64 * h, *c = blk[r] + 128 + 32 * h;
                A0[r] = ldw(a), A1[r] = ldw(a + 16), B0[r] = ldw(a + 32), B1[r] = ldw(a + 48), C0[r] = ldw(c), C1[r] = ldw(c + 16);
            }
#define Q6STEP(Q, XV, G)                                                                                  \
    do {                                                                                                  \
        const __m256i xv_ = (XV);                                                                         \
        _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++) acc[r] =                                     \
            acc_group(acc[r], sc[r] + (G), _mm256_madd_epi16(_mm256_sub_epi16((Q), o32), xv_));           \
    } while (0)
            const int g = 8 * h;
            Q6STEP(_mm256_or_si256(_mm256_and_si256(A0[r], m4), _mm256_and_si256(_mm256_slli_epi16(C0[r], 4), m30)), x00, g);
            Q6STEP(_mm256_or_si256(_mm256_and_si256(A1[r], m4), _mm256_and_si256(_mm256_slli_epi16(C1[r], 4), m30)), x01, g + 1);
            Q6STEP(_mm256_or_si256(_mm256_and_si256(B0[r], m4), _mm256_and_si256(_mm256_slli_epi16(C0[r], 2), m30)), ld(x + 32), g + 2);
            Q6STEP(_mm256_or_si256(_mm256_and_si256(B1[r], m4), _mm256_and_si256(_mm256_slli_epi16(C1[r], 2), m30)), ld(x + 48), g + 3);
            Q6STEP(_mm256_or_si256(_mm256_srli_epi16(A0[r], 4), _mm256_and_si256(C0[r], m30)), ld(x + 64), g + 4);
            Q6STEP(_mm256_or_si256(_mm256_srli_epi16(A1[r], 4), _mm256_and_si256(C1[r], m30)), ld(x + 80), g + 5);
            Q6STEP(_mm256_or_si256(_mm256_srli_epi16(B0[r], 4), _mm256_and_si256(_mm256_srli_epi16(C0[r], 2), m30)), ld(x + 96), g + 6);
            Q6STEP(_mm256_or_si256(_mm256_srli_epi16(B1[r], 4), _mm256_and_si256(_mm256_srli_epi16(C1[r], 2), m30)), ld(x + 112), g + 7);
#undef Q6STEP
        }
    }
#pragma GCC unroll 2
    for (int r = 0; r < NR; r++) out[r] = hsum8q(acc[r]);
}

/* mg_cpu_qprep_row in AVX2: the same int16 q values and f32 scales (the
 * same single products as block_unpack's) in the same layout; the decode
 * kernels' cutting of nibbles and high bits in 16-bit lanes. Scalar
 * widening cost as much as the products at 8 tokens. */
static inline void st(int16_t *p, __m256i v) { _mm256_storeu_si256((__m256i *)p, v); }

/* A Q6_K block's 16 group scales d * sc_g (the widened rows' scales). */
static inline void q6_scales(const uint8_t *blk, float *sc) {
    const __m256 d = _mm256_set1_ps(f16(blk + 208));
    const __m128i s8 = _mm_loadu_si128((const __m128i *)(blk + 192));
    _mm256_storeu_ps(sc, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8))));
    _mm256_storeu_ps(sc + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8)))));
}

static void qprep_row_avx2(int32_t dtype, const uint8_t *row, int32_t cols, float *buf) {
    const int32_t gl = mg_cpu_quant_group(dtype);
    int16_t *q = (int16_t *)buf;
    float *sc = buf + cols / 2, *dm = sc + cols / gl;
    const __m256i m4 = _mm256_set1_epi16(0xF), m30 = _mm256_set1_epi16(0x30), o32 = _mm256_set1_epi16(32), one = _mm256_set1_epi16(1);
    switch (dtype) {
    case DT_Q8_0:
        for (int32_t b = 0; b < cols / 32; b++) {
            const uint8_t *blk = row + (size_t)b * 34;
            sc[b] = f16(blk);
            st(q + 32 * b, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2))));
            st(q + 32 * b + 16, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18))));
        }
        return;
    case DT_Q4_K:
    case DT_Q5_K: {
        const int q5 = dtype == DT_Q5_K;
        const int32_t bb = q5 ? 176 : 144;
        for (int32_t b = 0; b < cols / 256; b++) {
            const uint8_t *blk = row + (size_t)b * bb, *qs = blk + (q5 ? 48 : 16);
            __m256 scv, dmv;
            k4_scales_avx2(blk + 4, f16(blk), f16(blk + 2), &scv, &dmv);
            _mm256_storeu_ps(sc + 8 * b, scv);
            _mm256_storeu_ps(dm + 8 * b, dmv);
            const __m256i h0 = q5 ? ldw(blk + 16) : _mm256_setzero_si256(), h1 = q5 ? ldw(blk + 32) : _mm256_setzero_si256();
            int16_t *y = q + (size_t)b * 256;
            for (int j = 0; j < 4; j++) {
                __m256i v0 = ldw(qs + 32 * j), v1 = ldw(qs + 32 * j + 16);
                __m256i l0 = _mm256_and_si256(v0, m4), l1 = _mm256_and_si256(v1, m4), u0 = _mm256_srli_epi16(v0, 4), u1 = _mm256_srli_epi16(v1, 4);
                if (q5) { /* bit 2j of qh[l] is element l's fifth bit, bit 2j+1 element 32 + l's */
                    const __m128i lo = _mm_cvtsi32_si128(2 * j), hi = _mm_cvtsi32_si128(2 * j + 1);
                    l0 = _mm256_or_si256(l0, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h0, lo), one), 4));
                    l1 = _mm256_or_si256(l1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h1, lo), one), 4));
                    u0 = _mm256_or_si256(u0, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h0, hi), one), 4));
                    u1 = _mm256_or_si256(u1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h1, hi), one), 4));
                }
                st(y + 64 * j, l0), st(y + 64 * j + 16, l1), st(y + 64 * j + 32, u0), st(y + 64 * j + 48, u1);
            }
        }
        return;
    }
    case DT_Q6_K:
        for (int32_t b = 0; b < cols / 256; b++) {
            const uint8_t *blk = row + (size_t)b * 210;
            q6_scales(blk, sc + 16 * b);
            for (int h = 0; h < 2; h++) { /* qdot_q6_k_rows' order of the 8 runs of 16 */
                const uint8_t *a = blk + 64 * h, *c = blk + 128 + 32 * h;
                const __m256i A0 = ldw(a), A1 = ldw(a + 16), B0 = ldw(a + 32), B1 = ldw(a + 48), C0 = ldw(c), C1 = ldw(c + 16);
                int16_t *y = q + (size_t)b * 256 + 128 * h;
                st(y, _mm256_sub_epi16(_mm256_or_si256(_mm256_and_si256(A0, m4), _mm256_and_si256(_mm256_slli_epi16(C0, 4), m30)), o32));
                st(y + 16, _mm256_sub_epi16(_mm256_or_si256(_mm256_and_si256(A1, m4), _mm256_and_si256(_mm256_slli_epi16(C1, 4), m30)), o32));
                st(y + 32, _mm256_sub_epi16(_mm256_or_si256(_mm256_and_si256(B0, m4), _mm256_and_si256(_mm256_slli_epi16(C0, 2), m30)), o32));
                st(y + 48, _mm256_sub_epi16(_mm256_or_si256(_mm256_and_si256(B1, m4), _mm256_and_si256(_mm256_slli_epi16(C1, 2), m30)), o32));
                st(y + 64, _mm256_sub_epi16(_mm256_or_si256(_mm256_srli_epi16(A0, 4), _mm256_and_si256(C0, m30)), o32));
                st(y + 80, _mm256_sub_epi16(_mm256_or_si256(_mm256_srli_epi16(A1, 4), _mm256_and_si256(C1, m30)), o32));
                st(y + 96, _mm256_sub_epi16(_mm256_or_si256(_mm256_srli_epi16(B0, 4), _mm256_and_si256(_mm256_srli_epi16(C0, 2), m30)), o32));
                st(y + 112, _mm256_sub_epi16(_mm256_or_si256(_mm256_srli_epi16(B1, 4), _mm256_and_si256(_mm256_srli_epi16(C1, 2), m30)), o32));
            }
        }
        return;
    }
}

/* Groups whose scale products s_g * xd_g are tabled at once (see prepn_acc). */
#define MG_QSB 64

/* For nt (1..4) tokens at once: each row value is loaded once per group and
 * used for every token; each token's sum is the single-token arithmetic.
 * The products s_g * xd_g are computed 8 at a time into a table first (the
 * same single rounding as the scalar product), so the loop over a group
 * spends no multiply and no register broadcast on them. Inlined with
 * constant gl and nt (the common nt = 4) to drop the loop's branches. */
static inline __attribute__((always_inline)) void prepn_acc(const float *buf, int32_t gl, int nt, const int16_t *const *xq,
                                                             const float *const *xd, int32_t cols, __m256 *acc) {
    const int16_t *q = (const int16_t *)buf;
    const float *sc = buf + cols / 2;
    const int16_t *xt[4];
    const float *dt[4];
    for (int t = 0; t < nt; t++) xt[t] = xq[t], dt[t] = xd[t];
    const __m256i dup = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    float S[4][MG_QSB] __attribute__((aligned(32)));
    __m256 a[4]; /* local, so that constant nt keeps them in registers */
    for (int t = 0; t < nt; t++) a[t] = acc[t];
    const int32_t ng = cols / gl;
    for (int32_t g0 = 0; g0 < ng; g0 += MG_QSB) {
        const int32_t gn = ng - g0 < MG_QSB ? ng - g0 : MG_QSB;
        for (int t = 0; t < nt; t++) {
            int32_t g = 0;
            for (; g + 8 <= gn; g += 8) {
                __m256 d = gl == 32 ? _mm256_loadu_ps(dt[t] + g0 + g)
                                    : _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(dt[t] + (g0 + g) / 2)), dup);
                _mm256_store_ps(S[t] + g, _mm256_mul_ps(_mm256_loadu_ps(sc + g0 + g), d));
            }
            for (; g < gn; g++) S[t][g] = sc[g0 + g] * dt[t][(size_t)(g0 + g) * gl / 32];
        }
        if (nt == 4) { /* named accumulators: gcc keeps an indexed array of them in memory */
            __m256 a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
            for (int32_t g = 0; g < gn; g++) {
                const size_t e0 = (size_t)(g0 + g) * gl;
                const __m256i q0 = ld(q + e0), q1 = gl == 32 ? ld(q + e0 + 16) : _mm256_setzero_si256();
#define PREPN_T(t, at)                                                                                  \
    do {                                                                                                \
        __m256i p = _mm256_madd_epi16(q0, ld(xt[t] + e0));                                              \
        if (gl == 32) p = _mm256_add_epi32(p, _mm256_madd_epi16(q1, ld(xt[t] + e0 + 16)));              \
        at = _mm256_fmadd_ps(_mm256_broadcast_ss(&S[t][g]), _mm256_cvtepi32_ps(p), at);                 \
    } while (0)
                PREPN_T(0, a0);
                PREPN_T(1, a1);
                PREPN_T(2, a2);
                PREPN_T(3, a3);
#undef PREPN_T
            }
            a[0] = a0, a[1] = a1, a[2] = a2, a[3] = a3;
            continue;
        }
        for (int32_t g = 0; g < gn; g++) {
            const size_t e0 = (size_t)(g0 + g) * gl;
            const __m256i q0 = ld(q + e0), q1 = gl == 32 ? ld(q + e0 + 16) : _mm256_setzero_si256();
            for (int t = 0; t < nt; t++) {
                __m256i p = _mm256_madd_epi16(q0, ld(xt[t] + e0));
                if (gl == 32) p = _mm256_add_epi32(p, _mm256_madd_epi16(q1, ld(xt[t] + e0 + 16)));
                a[t] = _mm256_fmadd_ps(_mm256_broadcast_ss(&S[t][g]), _mm256_cvtepi32_ps(p), a[t]);
            }
        }
    }
    for (int t = 0; t < nt; t++) acc[t] = a[t];
}

static void qdot_prepn_avx2(int32_t dtype, const float *buf, int nt, const int16_t *const *xq, const float *const *xd,
                            const float *const *xs, int32_t cols, float *out) {
    int32_t gl = mg_cpu_quant_group(dtype);
    const float *dm = buf + cols / 2 + cols / gl;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    /* constant nt also for the rest of a batch (n % 4): decode batches of 5-7 */
#define PREPN_NT(GL)                                                 \
    switch (nt) {                                                    \
    case 4: prepn_acc(buf, GL, 4, xq, xd, cols, acc); break;         \
    case 3: prepn_acc(buf, GL, 3, xq, xd, cols, acc); break;         \
    case 2: prepn_acc(buf, GL, 2, xq, xd, cols, acc); break;         \
    default: prepn_acc(buf, GL, 1, xq, xd, cols, acc); break;        \
    }
    if (gl == 32) {
        PREPN_NT(32)
    } else {
        PREPN_NT(16)
    }
#undef PREPN_NT
    for (int t = 0; t < nt; t++) {
        out[t] = hsum8q(acc[t]);
        if (mg_cpu_quant_has_min(dtype)) {
            __m256 macc = _mm256_setzero_ps();
            for (int32_t b = 0; b < cols / 256; b++)
                macc = _mm256_fmadd_ps(_mm256_loadu_ps(dm + (size_t)b * 8), _mm256_loadu_ps(xs[t] + (size_t)b * 8), macc);
            out[t] = out[t] - hsum8q(macc);
        }
    }
}
#endif

/* ---- AVX-512 (BW/VL; VNNI where the CPU has it) ----
 *
 * The same integers p[l] and the same f32 order as above, so the same bits
 * as the scalar reference. A zmm holds a 32-element group's 32 int16
 * weights; vpmaddwd gives 16 int32 pair sums, lane l (k = 0) and lane
 * l + 8 (k = 1) of the reference's lane l, added as integers (exact).
 *
 * One token (decode) reads the blocks: two groups' 16-lane sums are folded
 * into one zmm [p_g | p_g+1] by two 128-bit shuffles and an add, converted
 * once, and FMA'd into the 8-lane accumulator half by half (Q6_K's groups
 * of 16 need no fold: one vpmaddwd gives [p_g | p_g+1]).
 *
 * Several tokens pass over a widened row (qprep_row_avx2's layout) two per
 * zmm: mg_cpu_qx_pairs interleaves two tokens' activations by 32-bit pairs
 * (lane 2m + s of a zmm is token s's pair m), each group's weight pairs are
 * duplicated to match (one vpermd per half), and vpmaddwd then vpdpwssd
 * (vpmaddwd and an add without VNNI) give each token's p[m] in lane 2m + s
 * with no fold; one FMA advances both tokens' 8 lanes, its scales
 * (s_g * xd_g of each token) one 64-bit broadcast. 8 tokens (4 zmm
 * accumulators) per pass: each weight is loaded and duplicated once per 8. */

#if defined(MG_QAVX2) && defined(__x86_64__) && defined(__GNUC__)
#define MG_QZ 1
#define QZ __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,avx2,f16c")))
#define QZI static inline __attribute__((always_inline)) QZ

static int q16_vnni_off; /* tests: the AVX-512 path without VNNI (mg_cpu_q16_set_vnni) */

void mg_cpu_q16_set_vnni(int on) { __atomic_store_n(&q16_vnni_off, !on, __ATOMIC_RELAXED); }
static int q16_vnni(void) { return mg_cpu_has_vnni() && !__atomic_load_n(&q16_vnni_off, __ATOMIC_RELAXED); }

QZI __m512i ldz(const void *p) { return _mm512_loadu_si512(p); }
/* [p_a | p_b] from two groups' 16-lane pair sums: lanes l and l + 8 of each. */
QZI __m512i fold2(__m512i a, __m512i b) { return _mm512_add_epi32(_mm512_shuffle_i64x2(a, b, 0x44), _mm512_shuffle_i64x2(a, b, 0xEE)); }
/* acc + f * *s, *s broadcast by the FMA itself (EVEX {1to8}: one
 * instruction where bcast_mem and an FMA are two; the same bits, as the
 * product commutes). */
QZI __m256 fma_bcast(__m256 acc, __m256 f, const float *s) {
    __asm__("vfmadd231ps %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(f), "m"(*s));
    return acc;
}
/* acc = fma(s[0], p_a, acc) then fma(s[1], p_b, acc) for P = [p_a | p_b]
 * (the scales from memory). */
QZI __m256 acc2(__m256 acc, const float *s, __m512i P) {
    const __m512 f = _mm512_cvtepi32_ps(P);
    acc = fma_bcast(acc, _mm512_castps512_ps256(f), s);
    return fma_bcast(acc, _mm512_extractf32x8_ps(f, 1), s + 1);
}

/* The one-token kernels below take NR rows at once (qdot_rows_z): each
 * row's arithmetic is the one-row order above, but NR independent chains of
 * multiply-adds, where one row waits on its accumulator's latency, and
 * the activations loaded once for all NR. */
enum { NRZ = 4 };

QZI void qdot_q8_0_zn(const uint8_t *const *row, const int NR, const int16_t *xq, const float *xd, int32_t cols, float *out) {
    __m256 acc[NRZ];
    for (int i = 0; i < NR; i++) acc[i] = _mm256_setzero_ps();
    const int32_t nb = cols / 32;
    int32_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const __m512i x0 = ldz(xq + (size_t)b * 32), x1 = ldz(xq + (size_t)b * 32 + 32);
#pragma GCC unroll 4
        for (int i = 0; i < NR; i++) {
            const uint8_t *blk = row[i] + (size_t)b * 34;
            _mm_prefetch((const char *)blk + MG_QPF, _MM_HINT_T0);
            const __m512i w0 = _mm512_cvtepi8_epi16(ld(blk + 2)), w1 = _mm512_cvtepi8_epi16(ld(blk + 36));
            const __m512i P = fold2(_mm512_madd_epi16(w0, x0), _mm512_madd_epi16(w1, x1));
            const float s[2] = {f16(blk) * xd[b], f16(blk + 34) * xd[b + 1]};
            acc[i] = acc2(acc[i], s, P);
        }
    }
    if (b < nb) /* an odd last block */
        for (int i = 0; i < NR; i++) {
            const uint8_t *blk = row[i] + (size_t)b * 34;
            const __m512i P = _mm512_madd_epi16(_mm512_cvtepi8_epi16(ld(blk + 2)), ldz(xq + (size_t)b * 32));
            const __m256i p = _mm256_add_epi32(_mm512_castsi512_si256(P), _mm512_extracti64x4_epi64(P, 1));
            const float s = f16(blk) * xd[b];
            acc[i] = acc_group(acc[i], &s, p);
        }
    for (int i = 0; i < NR; i++) out[i] = hsum8q(acc[i]);
}

/* Q4_K (q5 0) and Q5_K: per 64 elements j the 32 bytes of nibbles widened
 * once to 32 words: low nibbles group 2j, high nibbles group 2j+1; Q5_K's
 * fifth bits are bits 2j and 2j+1 of qh[l], moved to bit 4. */
QZI __m512i bit_to4(__m512i h, int bit) {
    const __m512i b4 = _mm512_set1_epi16(0x10);
    switch (bit) { /* constant after unrolling */
    case 0: return _mm512_and_si512(_mm512_slli_epi16(h, 4), b4);
    case 1: return _mm512_and_si512(_mm512_slli_epi16(h, 3), b4);
    case 2: return _mm512_and_si512(_mm512_slli_epi16(h, 2), b4);
    case 3: return _mm512_and_si512(_mm512_slli_epi16(h, 1), b4);
    case 4: return _mm512_and_si512(h, b4);
    case 5: return _mm512_and_si512(_mm512_srli_epi16(h, 1), b4);
    case 6: return _mm512_and_si512(_mm512_srli_epi16(h, 2), b4);
    default: return _mm512_and_si512(_mm512_srli_epi16(h, 3), b4);
    }
}

QZI void qdot_k45_zn(const uint8_t *const *row, const int NR, int q5, const int16_t *xq, const float *xd, const float *xs,
                     int32_t cols, float *out) {
    const __m512i m4 = _mm512_set1_epi16(0xF);
    __m256 acc[NRZ], macc[NRZ];
    for (int i = 0; i < NR; i++) acc[i] = macc[i] = _mm256_setzero_ps();
    const int32_t bb = q5 ? 176 : 144;
    for (int32_t b = 0; b < cols / 256; b++) {
        const int16_t *xb = xq + (size_t)b * 256;
        float sc[NRZ][8];
        __m512i h[NRZ];
#pragma GCC unroll 4
        for (int i = 0; i < NR; i++) {
            const uint8_t *blk = row[i] + (size_t)b * bb;
            __m256 dmv;
            k45_block_scales(blk, xd + (size_t)b * 8, sc[i], &dmv);
            macc[i] = _mm256_fmadd_ps(dmv, _mm256_loadu_ps(xs + (size_t)b * 8), macc[i]);
            h[i] = q5 ? _mm512_cvtepu8_epi16(ld(blk + 16)) : _mm512_setzero_si512();
        }
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            const __m512i xl = ldz(xb + 64 * j), xh = ldz(xb + 64 * j + 32);
#pragma GCC unroll 4
            for (int i = 0; i < NR; i++) {
                const uint8_t *qs = row[i] + (size_t)b * bb + (q5 ? 48 : 16);
                const __m512i v = _mm512_cvtepu8_epi16(ld(qs + 32 * j));
                __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_srli_epi16(v, 4);
                if (q5) lo = _mm512_or_si512(lo, bit_to4(h[i], 2 * j)), hi = _mm512_or_si512(hi, bit_to4(h[i], 2 * j + 1));
                const __m512i P = fold2(_mm512_madd_epi16(lo, xl), _mm512_madd_epi16(hi, xh));
                acc[i] = acc2(acc[i], sc[i] + 2 * j, P);
            }
        }
    }
    for (int i = 0; i < NR; i++) out[i] = hsum8q(acc[i]) - hsum8q(macc[i]);
}

/* Where the pairs kernel's weights come from: rows widened by
 * mg_cpu_qprep_row, or a quantized type's blocks themselves, unpacked per
 * group in registers (one pass of up to 8 tokens: widening first, a store
 * and a reload of every weight, had cost a third of the pass). */
enum { SRC_WIDE, SRC_Q8_0, SRC_Q4_K, SRC_Q6_K };

/* Group g of a widened row or a Q8_0 row as 32 words. */
QZI __m512i group_words(int SRC, const void *row, int32_t g) {
    if (SRC == SRC_WIDE) return ldz((const int16_t *)row + (size_t)g * 32);
    return _mm512_cvtepi8_epi16(ld((const uint8_t *)row + (size_t)g * 34 + 2));
}

/* Groups g..g+7 of 16 (128 elements, g a multiple of 8) of a Q6_K row as
 * four registers of 32 words: q - 32, as mg_cpu_qprep_row widens them
 * (from words of ql[64h..+31] (A), ql[64h+32..+63] (B) and qh[32h..+31]
 * (C) for the block's half h). */
QZI void q6_words(int SRC, const void *row, int32_t g, __m512i *w) {
    if (SRC == SRC_WIDE) {
        for (int k = 0; k < 4; k++) w[k] = ldz((const int16_t *)row + (size_t)g * 16 + 32 * k);
        return;
    }
    const __m512i m4 = _mm512_set1_epi16(0xF), m30 = _mm512_set1_epi16(0x30), o32 = _mm512_set1_epi16(32);
    const uint32_t h = ((uint32_t)g % 16) / 8; /* which half of the block (g is not negative: unsigned, no sign fixups) */
    const uint8_t *blk = (const uint8_t *)row + (size_t)((uint32_t)g / 16) * 210, *a = blk + 64 * h;
    const __m512i A = _mm512_cvtepu8_epi16(ld(a)), B = _mm512_cvtepu8_epi16(ld(a + 32)), C = _mm512_cvtepu8_epi16(ld(blk + 128 + 32 * h));
    w[0] = _mm512_sub_epi16(_mm512_or_si512(_mm512_and_si512(A, m4), _mm512_and_si512(_mm512_slli_epi16(C, 4), m30)), o32);
    w[1] = _mm512_sub_epi16(_mm512_or_si512(_mm512_and_si512(B, m4), _mm512_and_si512(_mm512_slli_epi16(C, 2), m30)), o32);
    w[2] = _mm512_sub_epi16(_mm512_or_si512(_mm512_srli_epi16(A, 4), _mm512_and_si512(C, m30)), o32);
    w[3] = _mm512_sub_epi16(_mm512_or_si512(_mm512_srli_epi16(B, 4), _mm512_and_si512(_mm512_srli_epi16(C, 2), m30)), o32);
}

/* Q6_K: per 128 elements h, q6_words' four registers; 32 elements (two
 * groups of 16) per zmm, in qdot_q6_k_rows' order of the runs. */
QZI void qdot_q6_k_zn(const uint8_t *const *row, const int NR, const int16_t *xq, const float *xd, int32_t cols, float *out) {
    __m256 acc[NRZ];
    for (int i = 0; i < NR; i++) acc[i] = _mm256_setzero_ps();
    for (int32_t b = 0; b < cols / 256; b++) {
        float sc[NRZ][16]; /* (d * sc_g) * xd of the group's 32, as qdot_q6_k_rows */
#pragma GCC unroll 4
        for (int i = 0; i < NR; i++) {
            const uint8_t *blk = row[i] + (size_t)b * 210;
            _mm_prefetch((const char *)blk + MG_QPF, _MM_HINT_T0);
            _mm_prefetch((const char *)blk + MG_QPF + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)blk + MG_QPF + 128, _MM_HINT_T0);
            _mm_prefetch((const char *)blk + MG_QPF + 192, _MM_HINT_T0);
            const __m256 d = _mm256_set1_ps(f16(blk + 208));
            const __m128i s8 = _mm_loadu_si128((const __m128i *)(blk + 192));
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                __m128 x4 = _mm_loadu_ps(xd + (size_t)b * 8 + 4 * h);
                __m256 x8 = _mm256_set_m128(_mm_unpackhi_ps(x4, x4), _mm_unpacklo_ps(x4, x4));
                __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h ? _mm_srli_si128(s8, 8) : s8));
                _mm256_storeu_ps(sc[i] + 8 * h, _mm256_mul_ps(_mm256_mul_ps(d, f), x8));
            }
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const int16_t *x = xq + (size_t)b * 256 + 128 * h;
#pragma GCC unroll 4
            for (int i = 0; i < NR; i++) {
                const float *s = sc[i] + 8 * h;
                __m512i q[4];
                q6_words(SRC_Q6_K, row[i], b * 16 + 8 * h, q);
                acc[i] = acc2(acc[i], s + 0, _mm512_madd_epi16(q[0], ldz(x)));
                acc[i] = acc2(acc[i], s + 2, _mm512_madd_epi16(q[1], ldz(x + 32)));
                acc[i] = acc2(acc[i], s + 4, _mm512_madd_epi16(q[2], ldz(x + 64)));
                acc[i] = acc2(acc[i], s + 6, _mm512_madd_epi16(q[3], ldz(x + 96)));
            }
        }
    }
    for (int i = 0; i < NR; i++) out[i] = hsum8q(acc[i]);
}

QZI void qdot_zn(int32_t dtype, const uint8_t *const *row, const int NR, const int16_t *xq, const float *xd, const float *xs,
                 int32_t cols, float *out) {
    switch (dtype) {
    case DT_Q8_0: qdot_q8_0_zn(row, NR, xq, xd, cols, out); return;
    case DT_Q4_K: qdot_k45_zn(row, NR, 0, xq, xd, xs, cols, out); return;
    case DT_Q5_K: qdot_k45_zn(row, NR, 1, xq, xd, xs, cols, out); return;
    default: qdot_q6_k_zn(row, NR, xq, xd, cols, out); return;
    }
}

QZ static float qdot_z(int32_t dtype, const void *row, const int16_t *xq, const float *xd, const float *xs, int32_t cols) {
    const uint8_t *r[1] = {row};
    float o;
    qdot_zn(dtype, r, 1, xq, xd, xs, cols, &o);
    return o;
}

/* nr consecutive rows (rb bytes apart) into out: NRZ rows at a time, sp =
 * nr / NRZ rows apart (r, r + sp, ...), then the rest one by one. Rows
 * read side by side from the same pages were not followed by Zen 4's
 * prefetchers (cpu_matmul_avx512.c one_token). */
QZ static void qdot_rows_z(int32_t dtype, const uint8_t *w, size_t rb, int32_t nr, const int16_t *xq, const float *xd,
                           const float *xs, int32_t cols, float *out) {
    const int32_t sp = nr / NRZ;
    for (int32_t r = 0; r < sp; r++) {
        const uint8_t *rows[NRZ];
        float o[NRZ];
        for (int i = 0; i < NRZ; i++) rows[i] = w + (size_t)(r + i * sp) * rb;
        qdot_zn(dtype, rows, NRZ, xq, xd, xs, cols, o);
        for (int i = 0; i < NRZ; i++) out[r + i * sp] = o[i];
    }
    for (int32_t r = sp * NRZ; r < nr; r++) out[r] = qdot_z(dtype, w + (size_t)r * rb, xq, xd, xs, cols);
}

/* Token pairs: x2 dword 2e + s is token s's dword e (elements 2e, 2e+1);
 * an odd last token is paired with zeros. */
void mg_cpu_qx_pairs(const int16_t *xq, int32_t n, int32_t cols, int16_t *x2) {
    const int32_t dw = cols / 2;
    for (int32_t t = 0; t < n; t += 2) {
        const uint32_t *a = (const uint32_t *)(const void *)(xq + (size_t)t * cols);
        const uint32_t *b = t + 1 < n ? (const uint32_t *)(const void *)(xq + (size_t)(t + 1) * cols) : NULL;
        uint32_t *o = (uint32_t *)(void *)(x2 + (size_t)t * cols);
        for (int32_t e = 0; e < dw; e++) o[2 * e] = a[e], o[2 * e + 1] = b ? b[e] : 0;
    }
}

/* The scales s_g of groups g0..g0+gn-1 of a row from its blocks, as
 * mg_cpu_qprep_row computes them (K-quants: g0 and gn whole blocks), and
 * Q4_K's mins into dm. */
QZI void group_scales(int SRC, const void *row, int32_t g0, int32_t gn, float *sc, float *dm) {
    const uint8_t *r = row;
    if (SRC == SRC_Q8_0) {
        for (int32_t g = 0; g < gn; g++) sc[g] = f16(r + (size_t)(g0 + g) * 34);
        return;
    }
    if (SRC == SRC_Q6_K) {
        for (int32_t g = 0; g < gn; g += 16) q6_scales(r + (size_t)((g0 + g) / 16) * 210, sc + g);
        return;
    }
    for (int32_t g = 0; g < gn; g += 8) {
        const uint8_t *blk = r + (size_t)((g0 + g) / 8) * 144;
        __m256 scv, dmv;
        k4_scales_avx2(blk + 4, f16(blk), f16(blk + 2), &scv, &dmv);
        _mm256_storeu_ps(sc + g, scv);
        _mm256_storeu_ps(dm + g, dmv);
    }
}

/* Up to NP token pairs over groups gb..ge-1 (at most MG_QSB) of one row
 * (SRC: widened, sc its scales from group 0; or blocks, sc NULL); GL 32 or
 * 16 (Q6_K), VNNI 0 or 1. XD[p][2k + s] is the scale xd of token
 * 2p + s for the chunk's k-th 32 elements (qdot_pairs_z). For a type with
 * mins (macc not NULL) also the chunk's blocks' dm . xs, token 2p in
 * macc[p]'s low 8 lanes and 2p + 1 in its high 8: each lane the one-token
 * kernel's chain over the blocks in order (dmw: a widened row's mins). */
QZI void prepn_z(int SRC, const void *row, const float *sc, const float *dmw, int GL, int NP, int VNNI, const int16_t *const *x2,
                 const float (*XD)[2 * MG_QSB], const float *const *xs, int32_t gb, int32_t ge, __m512 *acc, __m512 *macc) {
    const __m512i dlo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i dhi = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
    const __m512i d16 = _mm512_setr_epi32(0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7); /* a scale for two groups of 16 */
    float S[4][2 * MG_QSB] __attribute__((aligned(64))); /* S[p][2g + s]: s_g * xd_g of token 2p + s */
    float scb[MG_QSB], dmb[MG_QSB];                      /* the chunk's scales and mins, from blocks */
    __m512 a[4];
    for (int p = 0; p < NP; p++) a[p] = acc[p];
    const int32_t g0 = gb, gn = ge - gb;
    if (SRC != SRC_WIDE) group_scales(SRC, row, g0, gn, scb, dmb);
    const float *s = SRC == SRC_WIDE ? sc + g0 : scb;
    if (macc) {
        const float *dm = SRC == SRC_WIDE ? dmw + g0 : dmb;
        __m512 m[4];
        for (int p = 0; p < NP; p++) m[p] = macc[p];
        for (int32_t k = 0; k < gn; k += 8) { /* a block: 8 groups of 32 */
            const __m512 d2 = _mm512_broadcast_f32x8(_mm256_loadu_ps(dm + k));
            const size_t e = (size_t)(g0 + k);
            for (int p = 0; p < NP; p++)
                m[p] = _mm512_fmadd_ps(
                    d2, _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(xs[2 * p] + e)), _mm256_loadu_ps(xs[2 * p + 1] + e), 1),
                    m[p]);
        }
        for (int p = 0; p < NP; p++) macc[p] = m[p];
    }
    int32_t g = 0;
    for (; g + 8 <= gn; g += 8) { /* [s_g s_g s_g+1 s_g+1 ...] times [xd_g of token 2p, of 2p+1, ...] */
        const __m512 sd = _mm512_permutexvar_ps(dlo, _mm512_castps256_ps512(_mm256_loadu_ps(s + g)));
        for (int p = 0; p < NP; p++) {
            const __m512 e = GL == 32 ? _mm512_loadu_ps(XD[p] + 2 * g)
                                      : _mm512_permutexvar_ps(d16, _mm512_castps256_ps512(_mm256_loadu_ps(XD[p] + g)));
            _mm512_store_ps(S[p] + 2 * g, _mm512_mul_ps(sd, e));
        }
    }
    for (; g < gn; g++)
        for (int p = 0; p < NP; p++) {
            const int32_t k = g * GL / 32;
            S[p][2 * g] = s[g] * XD[p][2 * k], S[p][2 * g + 1] = s[g] * XD[p][2 * k + 1];
        }
#define PZ_FMA(p, P, g) \
    a[p] = _mm512_fmadd_ps(_mm512_castpd_ps(_mm512_broadcastsd_pd(_mm_load_sd((const double *)(S[p] + 2 * (g))))), _mm512_cvtepi32_ps(P), a[p])
    /* group g (of the chunk) of 32 words w, every pair */
#define PZ_GROUP(W, G)                                                                                                    \
    do {                                                                                                                  \
        const size_t e0 = (size_t)(g0 + (G)) * 32;                                                                        \
        const __m512i w_ = (W), wl = _mm512_permutexvar_epi32(dlo, w_), wh = _mm512_permutexvar_epi32(dhi, w_);           \
        _Pragma("GCC unroll 4") for (int p = 0; p < NP; p++) {                                                            \
            const int16_t *x = x2[p] + 2 * e0;                                                                            \
            __m512i P = _mm512_madd_epi16(wl, ldz(x));                                                                    \
            P = VNNI ? _mm512_dpwssd_epi32(P, wh, ldz(x + 32)) : _mm512_add_epi32(P, _mm512_madd_epi16(wh, ldz(x + 32))); \
            PZ_FMA(p, P, G);                                                                                              \
        }                                                                                                                 \
    } while (0)
    if (SRC == SRC_Q4_K) { /* whole blocks: low and high nibbles of each 32 bytes are two groups */
        const __m512i m4 = _mm512_set1_epi16(0xF);
        const uint8_t *blk = (const uint8_t *)row + (size_t)(g0 / 8) * 144;
        for (int32_t g = 0; g < gn; g += 8, blk += 144) {
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_cvtepu8_epi16(ld(blk + 16 + 32 * j));
                PZ_GROUP(_mm512_and_si512(v, m4), g + 2 * j);
                PZ_GROUP(_mm512_srli_epi16(v, 4), g + 2 * j + 1);
            }
        }
    } else if (GL == 32) {
        for (int32_t g = 0; g < gn; g++) PZ_GROUP(group_words(SRC, row, g0 + g), g);
    } else { /* Q6_K: two groups of 16 per zmm of weights, 8 groups at a time; gn is a multiple of 16 (a block) */
        for (int32_t g = 0; g < gn; g += 8) {
            __m512i w[4];
            q6_words(SRC, row, g0 + g, w);
            for (int k = 0; k < 4; k++) {
                const size_t e0 = (size_t)(g0 + g + 2 * k) * 16;
                const __m512i wl = _mm512_permutexvar_epi32(dlo, w[k]), wh = _mm512_permutexvar_epi32(dhi, w[k]);
#pragma GCC unroll 4
                for (int p = 0; p < NP; p++) {
                    const int16_t *x = x2[p] + 2 * e0;
                    PZ_FMA(p, _mm512_madd_epi16(wl, ldz(x)), g + 2 * k);
                    PZ_FMA(p, _mm512_madd_epi16(wh, ldz(x + 32)), g + 2 * k + 1);
                }
            }
        }
    }
#undef PZ_GROUP
#undef PZ_FMA
    for (int p = 0; p < NP; p++) acc[p] = a[p];
}

/* Elements of a row per pass: the pairs' activations for them (8 tokens:
 * 8 KiB) stay in L1 while every row of the block passes over them; a whole
 * row's (32 KiB for 2048 columns) came from L2 for each row, and the loop
 * ran at L2's speed. */
#define MG_QZCOL 512

/* x . row for 2 np (np 1..4) tokens, as pairs (mg_cpu_qx_pairs), and nr
 * rows into out[r * 8 + t]: the same bits as mg_cpu_qdot for each. The
 * rows are SRC's (prepn_z): widened by mg_cpu_qprep_row (stride floats
 * apart) or blocks (stride bytes apart). Columns are taken MG_QZCOL at a
 * time for all rows; each (row, token) accumulator carries over. */
QZI void qdot_pairs_z(int SRC, int32_t dtype, const void *rows, size_t stride, int32_t nr, int np, const int16_t *const *x2,
                      const float *const *xd, const float *const *xs, int32_t cols, float *out, const char *next,
                      size_t next_bytes) {
    const int32_t gl = mg_cpu_quant_group(dtype), ng = cols / gl, gstep = MG_QZCOL / gl;
    const int vnni = q16_vnni();
    const size_t row_bytes = SRC == SRC_WIDE ? stride * sizeof(float) : stride;
    /* next's lines, a few per row pass, into L2 (see mg_cpu_qdot_prepn_pairs) */
    const size_t lines = next ? (next_bytes + 63) / 64 : 0, passes = (size_t)((ng + gstep - 1) / gstep) * (size_t)nr;
    const size_t per = (lines + passes - 1) / passes;
    size_t line = 0;
    const int mins = mg_cpu_quant_has_min(dtype);
    __m512 accs[32][4], maccs[32][4]; /* maccs: the mins' chains (prepn_z) */
    for (int32_t r = 0; r < nr; r++)
        for (int p = 0; p < 4; p++) accs[r][p] = maccs[r][p] = _mm512_setzero_ps();
#define PZ_NP(GL, V)                                                                       \
    switch (np) {                                                                          \
    case 4: prepn_z(SRC, row, sc, dmw, GL, 4, V, x2, XD, xs, gb, ge, accs[r], macc); break;  \
    case 3: prepn_z(SRC, row, sc, dmw, GL, 3, V, x2, XD, xs, gb, ge, accs[r], macc); break;  \
    case 2: prepn_z(SRC, row, sc, dmw, GL, 2, V, x2, XD, xs, gb, ge, accs[r], macc); break;  \
    default: prepn_z(SRC, row, sc, dmw, GL, 1, V, x2, XD, xs, gb, ge, accs[r], macc); break; \
    }
    float XD[4][2 * MG_QSB] __attribute__((aligned(64))); /* the chunk's xd, by pairs: once for all rows */
    for (int32_t gb = 0; gb < ng; gb += gstep) {
        const int32_t ge = ng - gb < gstep ? ng : gb + gstep, k0 = gb * gl / 32, nk = (ge - gb) * gl / 32;
        for (int p = 0; p < np; p++)
            for (int32_t k = 0; k < nk; k++) XD[p][2 * k] = xd[2 * p][k0 + k], XD[p][2 * k + 1] = xd[2 * p + 1][k0 + k];
        for (int32_t r = 0; r < nr; r++) {
            const void *row = (const char *)rows + (size_t)r * row_bytes;
            const float *sc = SRC == SRC_WIDE ? (const float *)row + cols / 2 : NULL, *dmw = sc ? sc + cols / gl : NULL;
            __m512 *macc = mins ? maccs[r] : NULL;
            for (size_t e = line + per < lines ? line + per : lines; line < e; line++) _mm_prefetch(next + line * 64, _MM_HINT_T1);
            if (gl == 32 && vnni) {
                PZ_NP(32, 1)
            } else if (gl == 32) {
                PZ_NP(32, 0)
            } else {
                PZ_NP(16, 0)
            }
        }
    }
#undef PZ_NP
    /* token 2p's lanes are the even ones, 2p+1's the odd ones */
    const __m512i split = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int32_t r = 0; r < nr; r++) {
        float *o = out + (size_t)r * 8;
        for (int p = 0; p < np; p++) {
            const __m512 v = _mm512_permutexvar_ps(split, accs[r][p]);
            o[2 * p] = hsum8q(_mm512_castps512_ps256(v));
            o[2 * p + 1] = hsum8q(_mm512_extractf32x8_ps(v, 1));
        }
        if (!mins) continue;
        for (int p = 0; p < np; p++) {
            o[2 * p] = o[2 * p] - hsum8q(_mm512_castps512_ps256(maccs[r][p]));
            o[2 * p + 1] = o[2 * p + 1] - hsum8q(_mm512_extractf32x8_ps(maccs[r][p], 1));
        }
    }
}

QZ static void qdot_prepn_pairs_z(int32_t dtype, const float *buf, size_t pf, int32_t nr, int np, const int16_t *const *x2,
                                  const float *const *xd, const float *const *xs, int32_t cols, float *out, const char *next,
                                  size_t next_bytes) {
    qdot_pairs_z(SRC_WIDE, dtype, buf, pf, nr, np, x2, xd, xs, cols, out, next, next_bytes);
}

QZ static void qdot_blocks_pairs_z(int32_t dtype, const void *w, size_t rb, int32_t nr, int np, const int16_t *const *x2,
                                   const float *const *xd, const float *const *xs, int32_t cols, float *out, const char *next,
                                   size_t next_bytes) {
    switch (dtype) {
    case DT_Q8_0: qdot_pairs_z(SRC_Q8_0, dtype, w, rb, nr, np, x2, xd, xs, cols, out, next, next_bytes); return;
    case DT_Q4_K: qdot_pairs_z(SRC_Q4_K, dtype, w, rb, nr, np, x2, xd, xs, cols, out, next, next_bytes); return;
    default: qdot_pairs_z(SRC_Q6_K, dtype, w, rb, nr, np, x2, xd, xs, cols, out, next, next_bytes); return;
    }
}
#else
void mg_cpu_q16_set_vnni(int on) { (void)on; }
void mg_cpu_qx_pairs(const int16_t *xq, int32_t n, int32_t cols, int16_t *x2) { (void)xq, (void)n, (void)cols, (void)x2; }
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

void mg_cpu_qx(int isa, const float *x, int32_t cols, int16_t *xq, float *xd, float *xs) {
#ifdef MG_QAVX2
    if (use_avx2(isa)) {
        qx_avx2(x, cols, xq, xd, xs);
        return;
    }
#endif
    qx_ref(x, cols, xq, xd, xs);
}

static int use_avx512(int isa) {
#ifdef MG_QZ
    return isa >= MG_ISA_AVX512F;
#else
    (void)isa;
    return 0;
#endif
}

float mg_cpu_qdot(int isa, int32_t dtype, const void *row, const int16_t *xq, const float *xd, const float *xs, int32_t cols,
                  float *buf) {
#ifdef MG_QZ
    if (use_avx512(isa) && mg_cpu_is_quant(dtype)) return qdot_z(dtype, row, xq, xd, xs, cols);
#endif
#ifdef MG_QAVX2
    if (use_avx2(isa)) {
        switch (dtype) {
        case DT_Q8_0: return qdot_q8_0_avx2(row, xq, xd, cols);
        case DT_Q4_K: {
            float o;
            qdot_q4_k_rows(1, row, 0, xq, xd, xs, cols, &o);
            return o;
        }
        case DT_Q5_K: return qdot_k45_avx2(row, 1, xq, xd, xs, cols);
        case DT_Q6_K: {
            float o;
            qdot_q6_k_rows(1, row, 0, xq, xd, cols, &o);
            return o;
        }
        }
    }
#endif
    qprep_row_ref(dtype, row, cols, buf);
    return qdot_prep_ref(dtype, buf, xq, xd, xs, cols);
}

void mg_cpu_qprep_row(int isa, int32_t dtype, const void *row, int32_t cols, float *buf) {
#ifdef MG_QAVX2
    if (use_avx2(isa)) {
        qprep_row_avx2(dtype, row, cols, buf);
        return;
    }
#endif
    qprep_row_ref(dtype, row, cols, buf);
}

void mg_cpu_qdot_prepn(int isa, int32_t dtype, const float *buf, int nt, const int16_t *const *xq, const float *const *xd,
                       const float *const *xs, int32_t cols, float *out) {
#ifdef MG_QAVX2
    if (use_avx2(isa)) {
        qdot_prepn_avx2(dtype, buf, nt, xq, xd, xs, cols, out);
        return;
    }
#endif
    for (int t = 0; t < nt; t++) out[t] = qdot_prep_ref(dtype, buf, xq[t], xd[t], xs[t], cols);
}

int mg_cpu_q16_pairs(int isa) { return use_avx512(isa); }

int mg_cpu_q16_blocks(int isa, int32_t dtype) {
#ifdef MG_QZ
    return use_avx512(isa) && (dtype == DT_Q8_0 || dtype == DT_Q4_K || dtype == DT_Q6_K);
#else
    (void)isa, (void)dtype;
    return 0;
#endif
}

const char *mg_cpu_quant_kernels(int isa) {
    if (mg_cpu_quant_act() == 8) /* cpu_quant8.c's dispatch */
        return isa >= MG_ISA_AVX512F && mg_cpu_has_vnni() ? "avx512vnni" : isa >= MG_ISA_AVX2 ? "avx2" : "scalar";
#ifdef MG_QZ
    if (use_avx512(isa)) return q16_vnni() ? "avx512vnni" : "avx512bw";
#endif
    return use_avx2(isa) ? "avx2" : "scalar";
}

int mg_cpu_qdot_prepn_pairs(int isa, int32_t dtype, const float *buf, size_t pf, int32_t nr, int np, const int16_t *const *x2,
                            const float *const *xd, const float *const *xs, int32_t cols, float *out, const void *next,
                            size_t next_bytes) {
#ifdef MG_QZ
    if (use_avx512(isa) && mg_cpu_is_quant(dtype) && np >= 1 && np <= 4 && nr >= 1 && nr <= 32) {
        qdot_prepn_pairs_z(dtype, buf, pf, nr, np, x2, xd, xs, cols, out, next, next_bytes);
        return 1;
    }
#endif
    (void)isa, (void)dtype, (void)buf, (void)pf, (void)nr, (void)np, (void)x2, (void)xd, (void)xs, (void)cols, (void)out;
    (void)next, (void)next_bytes;
    return 0;
}

int mg_cpu_qdot_blocks_pairs(int isa, int32_t dtype, const void *w, size_t rb, int32_t nr, int np, const int16_t *const *x2,
                             const float *const *xd, const float *const *xs, int32_t cols, float *out, const void *next,
                             size_t next_bytes) {
#ifdef MG_QZ
    if (mg_cpu_q16_blocks(isa, dtype) && np >= 1 && np <= 4 && nr >= 1 && nr <= 32) {
        qdot_blocks_pairs_z(dtype, w, rb, nr, np, x2, xd, xs, cols, out, next, next_bytes);
        return 1;
    }
#endif
    (void)isa, (void)dtype, (void)w, (void)rb, (void)nr, (void)np, (void)x2, (void)xd, (void)xs, (void)cols, (void)out;
    (void)next, (void)next_bytes;
    return 0;
}

/* x . row for nr consecutive rows (row stride rb bytes) into out[0..nr-1]:
 * the same bits as mg_cpu_qdot for each row. */
void mg_cpu_qdot_rows(int isa, int32_t dtype, const void *row0, size_t rb, int32_t nr, const int16_t *xq, const float *xd,
                      const float *xs, int32_t cols, float *buf, float *out) {
    const uint8_t *w = row0;
#ifdef MG_QZ
    if (use_avx512(isa) && mg_cpu_is_quant(dtype)) {
        qdot_rows_z(dtype, w, rb, nr, xq, xd, xs, cols, out);
        return;
    }
#endif
    for (int32_t r = 0; r < nr; r++) out[r] = mg_cpu_qdot(isa, dtype, w + (size_t)r * rb, xq, xd, xs, cols, buf);
}

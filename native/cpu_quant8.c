/*
 * cpu_quant8.c: products of quantized weights with 8-bit activations,
 * llama.cpp's scheme, chosen by name (MESHGPU_CPU_QUANT_ACT=8; fast on
 * AVX-512 VNNI, cpu_quant8_avx512.c); cpu_quant.c's 16 bits are the
 * default (cpu_isa.c says why).
 *
 * Activations, each token on its own (so a token's bits never depend on
 * its batch): int8 in blocks with one f32 scale d = max|x| / 127,
 * q = rint(x / d) (as x * (127 / max|x|)):
 *   - Q8_0 weights: blocks of 32 (the weights' own blocks; llama.cpp's
 *     q8_0 activations, with an f32 scale where llama.cpp rounds it to f16);
 *   - K-quants: blocks of 256 (llama.cpp's q8_K) with the integer sums of
 *     each 16 (bs) for Q6_K's offset of 32 and Q4_K/Q5_K's mins. The mins
 *     need the sums of the rounded x, as llama.cpp: with f32 sums of x the
 *     error is (s q) . (x' - x) instead of w . (x' - x), and q4_k_m's KL
 *     divergence went to 1.13x llama.cpp's (q5_k_m's 1.43x).
 * One scale per 256 lets a K-quant super-block's products stay integers:
 * vpmaddubsw (unsigned weights x signed activations, 32 multiply-adds),
 * vpmaddwd against the 16 sub-block scales (as int16), vpaddd: 3
 * instructions per 32 weights and token, against 6 with 16-bit activations,
 * then one convert and one FMA per 256.
 *
 * The order, for one row and token: 8 int32 lanes; element e of a
 * super-block (or Q8_0 block) goes to lane (e % 32) / 4 (vpmaddubsw then
 * vpmaddwd pair adjacent bytes), so per block lane m holds the exact
 *   P[m] = sum over e in lane m of sc(e) q(e) xq(e)  [- 32 (bs[2m] sc[2m] + bs[2m+1] sc[2m+1]) for Q6_K]
 * (sc 1 for Q8_0, q unsigned for the K-quants, Q6_K's before its offset),
 * and acc[m] = fma(d_w * d_x, (float)P[m], acc[m]) (Q8_0: two such
 * accumulators, even blocks and odd blocks, added lane by lane at the end,
 * so AVX-512 takes two blocks per FMA); Q4_K/Q5_K's mins:
 * macc[m] = fma(dmin * d_x, (float)(bs[2m] m_m + bs[2m+1] m_m), macc[m]).
 * The result is hsum8(acc) - hsum8(macc). The integer sums
 * cannot overflow (|P| < 2^26), so the AVX2 path gives the scalar
 * reference's bits exactly.
 */
#include <math.h>
#include <string.h>

#include "cpu_kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define MG_Q8AVX2 1
#endif

enum { Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

int32_t mg_cpu_q8act_block(int32_t dtype) { return dtype == Q8_0 ? 32 : 256; }

static inline float hsum8r(const float *a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

void mg_cpu_q8x(const float *x, int32_t cols, int32_t blk, int8_t *q, float *d, int16_t *bs) {
    for (int32_t b = 0; b < cols / blk; b++) {
        const float *xb = x + (size_t)b * blk;
        float amax = 0;
        for (int32_t i = 0; i < blk; i++) amax = fmaxf(amax, fabsf(xb[i]));
        float id = amax > 0 ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        for (int32_t i = 0; i < blk; i++) {
            float v = rintf(xb[i] * id);
            q[(size_t)b * blk + i] = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
        }
    }
    if (bs)
        for (int32_t g = 0; g < cols / 16; g++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += q[(size_t)g * 16 + i];
            bs[g] = (int16_t)s;
        }
}

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* The 8 6-bit scales (bytes 0-7) and mins (8-15) of a Q4_K/Q5_K block's 12
 * bytes (ggml's get_scale_min_k4, as three words). */
static inline void k4_sm(const uint8_t *s12, uint8_t sm[16]) {
    uint32_t w[3];
    memcpy(w, s12, 12);
    uint32_t v[4] = {w[0] & 0x3f3f3f3fu, (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4), w[1] & 0x3f3f3f3fu,
                     ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4)};
    memcpy(sm, v, 16);
}

/* ---- the scalar reference ---- */

/* One block's q values (unsigned for the K-quants; Q6_K's before -32) and
 * integer scale of each element. */
static void block_ints(int32_t dtype, const uint8_t *b, int32_t *q, int32_t *sc, float *dw, float *dm, int32_t *mn) {
    switch (dtype) {
    case Q8_0:
        *dw = mg_f16_to_f32(rd16(b));
        for (int i = 0; i < 32; i++) q[i] = ((const int8_t *)b)[2 + i], sc[i] = 1;
        return;
    case Q4_K:
    case Q5_K: {
        uint8_t sm[16];
        k4_sm(b + 4, sm);
        *dw = mg_f16_to_f32(rd16(b));
        *dm = mg_f16_to_f32(rd16(b + 2));
        for (int j = 0; j < 8; j++) mn[j] = sm[8 + j];
        const int q5 = dtype == Q5_K;
        const uint8_t *qh = b + 16, *qs = b + (q5 ? 48 : 16);
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                q[64 * j + l] = (qs[32 * j + l] & 0xF) | (q5 ? ((qh[l] >> (2 * j)) & 1) << 4 : 0);
                q[64 * j + 32 + l] = (qs[32 * j + l] >> 4) | (q5 ? ((qh[l] >> (2 * j + 1)) & 1) << 4 : 0);
            }
        for (int e = 0; e < 256; e++) sc[e] = sm[e / 32];
        return;
    }
    case Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *s = (const int8_t *)(b + 192);
        *dw = mg_f16_to_f32(rd16(b + 208));
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                const uint8_t *a = ql + 64 * h, *c = qh + 32 * h;
                int32_t *y = q + 128 * h;
                y[l] = (a[l] & 0xF) | ((c[l] & 3) << 4);
                y[l + 32] = (a[l + 32] & 0xF) | (((c[l] >> 2) & 3) << 4);
                y[l + 64] = (a[l] >> 4) | (((c[l] >> 4) & 3) << 4);
                y[l + 96] = (a[l + 32] >> 4) | (((c[l] >> 6) & 3) << 4);
            }
        for (int e = 0; e < 256; e++) sc[e] = s[e / 16];
        return;
    }
    }
}

static float q8dot_ref(int32_t dtype, const uint8_t *row, int32_t cols, const mg_cpu_q8act *x) {
    int32_t be, bb;
    mg_cpu_quant_block(dtype, &be, &bb);
    float acc2[2][8] = {{0}}, macc[8] = {0}, dw = 0, dm = 0;
    int32_t q[256], sc[256], mn[8] = {0};
    for (int32_t b = 0; b < cols / be; b++) {
        float *acc = acc2[dtype == Q8_0 ? b & 1 : 0]; /* Q8_0: even and odd blocks apart */
        block_ints(dtype, row + (size_t)b * bb, q, sc, &dw, &dm, mn);
        const int8_t *xq = x->q + (size_t)b * be;
        int32_t P[8] = {0};
        for (int32_t e = 0; e < be; e++) P[(e % 32) / 4] += sc[e] * q[e] * xq[e];
        if (dtype == Q6_K) {
            const int8_t *s = (const int8_t *)(row + (size_t)b * bb + 192);
            const int16_t *bs = x->bs + (size_t)b * 16;
            for (int m = 0; m < 8; m++) P[m] -= 32 * (bs[2 * m] * s[2 * m] + bs[2 * m + 1] * s[2 * m + 1]);
        }
        float D = dw * x->d[b];
        for (int m = 0; m < 8; m++) acc[m] = fmaf(D, (float)P[m], acc[m]);
        if (dtype == Q4_K || dtype == Q5_K) {
            const int16_t *bs = x->bs + (size_t)b * 16;
            float Dm = dm * x->d[b];
            for (int m = 0; m < 8; m++) macc[m] = fmaf(Dm, (float)(bs[2 * m] * mn[m] + bs[2 * m + 1] * mn[m]), macc[m]);
        }
    }
    if (dtype == Q8_0)
        for (int m = 0; m < 8; m++) acc2[0][m] += acc2[1][m];
    return hsum8r(acc2[0]) - hsum8r(macc);
}

/* ---- AVX2: NT (1..4) tokens per pass over a row, unpacked once ---- */

#ifdef MG_Q8AVX2
#ifndef MG_Q8PF
#define MG_Q8PF 2048 /* prefetch distance, as cpu_quant.c's decode kernels */
#endif
#define AI static inline __attribute__((always_inline))

static inline float hsum8v(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
static inline __m256i ld(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline float f16(const uint8_t *p) { return _cvtsh_ss(rd16(p)); }
static inline void pf(const uint8_t *p, int lines) {
    for (int i = 0; i < lines; i++) _mm_prefetch((const char *)p + MG_Q8PF + 64 * i, _MM_HINT_T0);
}

AI void q8_0_n(int NT, const uint8_t *row, int32_t cols, const mg_cpu_q8act *x, float *out) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[2][4]; /* even and odd blocks (the reference's order) */
    for (int t = 0; t < NT; t++) acc[0][t] = acc[1][t] = _mm256_setzero_ps();
    for (int32_t b = 0; b < cols / 32; b++) {
        const uint8_t *blk = row + (size_t)b * 34;
        pf(blk, 1);
        const __m256i w = ld(blk + 2), aw = _mm256_abs_epi8(w);
        const float dw = f16(blk);
        __m256 *a = acc[b & 1];
        for (int t = 0; t < NT; t++) {
            __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(ld(x[t].q + (size_t)b * 32), w)), ones);
            a[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x[t].d[b]), _mm256_cvtepi32_ps(p), a[t]);
        }
    }
    for (int t = 0; t < NT; t++) out[t] = hsum8v(_mm256_add_ps(acc[0][t], acc[1][t]));
}

/* The int16 scale vector of two groups of 16: low 128 bits sc0, high sc1. */
static inline __m256i sc2(int a, int b) { return _mm256_set_m128i(_mm_set1_epi16((short)b), _mm_set1_epi16((short)a)); }

AI void k45_n(int NT, int q5, const uint8_t *row, int32_t cols, const mg_cpu_q8act *x, float *out) {
    const __m256i m4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
    const int32_t bb = q5 ? 176 : 144;
    __m256 acc[4], macc[4];
    for (int t = 0; t < NT; t++) acc[t] = macc[t] = _mm256_setzero_ps();
    for (int32_t b = 0; b < cols / 256; b++) {
        const uint8_t *blk = row + (size_t)b * bb, *qs = blk + (q5 ? 48 : 16);
        pf(blk, q5 ? 3 : 3);
        uint8_t sm[16];
        k4_sm(blk + 4, sm);
        const float dw = f16(blk);
        const float dmin = f16(blk + 2);
        const __m128i mb = _mm_loadl_epi64((const __m128i *)(sm + 8));
        const __m256i mn16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mb, mb)); /* m0 m0 m1 m1 ... m7 m7 */
        const __m256i hb = q5 ? ld(blk + 16) : _mm256_setzero_si256();
        __m256i P[4];
        for (int t = 0; t < NT; t++) P[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            const __m256i v = ld(qs + 32 * j);
            __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if (q5) { /* bits 2j, 2j+1 of each byte, to bit 4 (16-bit shifts, then byte masks) */
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * j), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * j + 1), one), 4));
            }
            const __m256i slo = _mm256_set1_epi16(sm[2 * j]), shi = _mm256_set1_epi16(sm[2 * j + 1]);
            for (int t = 0; t < NT; t++) {
                const int8_t *xb = x[t].q + (size_t)b * 256 + 64 * j;
                P[t] = _mm256_add_epi32(P[t], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, ld(xb)), slo));
                P[t] = _mm256_add_epi32(P[t], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, ld(xb + 32)), shi));
            }
        }
        for (int t = 0; t < NT; t++) {
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x[t].d[b]), _mm256_cvtepi32_ps(P[t]), acc[t]);
            const __m256i M = _mm256_madd_epi16(ld(x[t].bs + (size_t)b * 16), mn16);
            macc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dmin * x[t].d[b]), _mm256_cvtepi32_ps(M), macc[t]);
        }
    }
    for (int t = 0; t < NT; t++) out[t] = hsum8v(acc[t]) - hsum8v(macc[t]);
}

AI void q6_k_n(int NT, const uint8_t *row, int32_t cols, const mg_cpu_q8act *x, float *out) {
    const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
    __m256 acc[4];
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    for (int32_t b = 0; b < cols / 256; b++) {
        const uint8_t *blk = row + (size_t)b * 210;
        pf(blk, 4);
        const int8_t *s = (const int8_t *)(blk + 192);
        const float dw = f16(blk + 208);
        const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)s));
        __m256i P[4];
        for (int t = 0; t < NT; t++) /* the offset: -32 sum_g sc_g bs_g */
            P[t] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                    _mm256_slli_epi32(_mm256_madd_epi16(ld(x[t].bs + (size_t)b * 16), s16), 5));
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const uint8_t *a = blk + 64 * h, *c = blk + 128 + 32 * h;
            const __m256i A = ld(a), B = ld(a + 32), Cv = ld(c);
            const __m256i q[4] = {
                _mm256_or_si256(_mm256_and_si256(A, m4), _mm256_and_si256(_mm256_slli_epi16(Cv, 4), m30)),
                _mm256_or_si256(_mm256_and_si256(B, m4), _mm256_and_si256(_mm256_slli_epi16(Cv, 2), m30)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), m4), _mm256_and_si256(Cv, m30)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), m4), _mm256_and_si256(_mm256_srli_epi16(Cv, 2), m30)),
            };
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const int g = 8 * h + 2 * k;
                const __m256i sv = sc2(s[g], s[g + 1]);
                for (int t = 0; t < NT; t++)
                    P[t] = _mm256_add_epi32(
                        P[t], _mm256_madd_epi16(_mm256_maddubs_epi16(q[k], ld(x[t].q + (size_t)b * 256 + 128 * h + 32 * k)), sv));
            }
        }
        for (int t = 0; t < NT; t++) acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x[t].d[b]), _mm256_cvtepi32_ps(P[t]), acc[t]);
    }
    for (int t = 0; t < NT; t++) out[t] = hsum8v(acc[t]);
}

#define Q8_BY_NT(F, ...)                                 \
    switch (nt) {                                        \
    case 4: F(4, __VA_ARGS__); break;                    \
    case 3: F(3, __VA_ARGS__); break;                    \
    case 2: F(2, __VA_ARGS__); break;                    \
    default: F(1, __VA_ARGS__); break;                   \
    }
static void q8dot_n_avx2(int32_t dtype, const uint8_t *row, int32_t cols, int nt, const mg_cpu_q8act *x, float *out) {
    switch (dtype) {
    case Q8_0: Q8_BY_NT(q8_0_n, row, cols, x, out) return;
    case Q4_K: Q8_BY_NT(k45_n, 0, row, cols, x, out) return;
    case Q5_K: Q8_BY_NT(k45_n, 1, row, cols, x, out) return;
    case Q6_K: Q8_BY_NT(q6_k_n, row, cols, x, out) return;
    }
}
#undef Q8_BY_NT
#endif

void mg_cpu_q8dot_n(int isa, int32_t dtype, const void *row, int32_t cols, int nt, const mg_cpu_q8act *x, float *out) {
    if (isa >= MG_ISA_AVX512F && mg_cpu_q8dot_n_avx512(dtype, row, cols, nt, x, out)) return;
#ifdef MG_Q8AVX2
    if (isa >= MG_ISA_AVX2) {
        for (int t = 0; t < nt; t += 4) q8dot_n_avx2(dtype, row, cols, nt - t < 4 ? nt - t : 4, x + t, out + t);
        return;
    }
#endif
    (void)isa;
    for (int t = 0; t < nt; t++) out[t] = q8dot_ref(dtype, row, cols, &x[t]);
}

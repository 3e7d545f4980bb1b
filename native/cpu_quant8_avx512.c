/*
 * cpu_quant8_avx512.c: cpu_quant8.c's products (8-bit activations) on
 * AVX-512 with VNNI, chosen at run time: the avx512f and avx512bf16 paths
 * on a CPU that has AVX512_VNNI (mg_cpu_has_vnni).
 *
 * The same integers and the same float order as cpu_quant8.c's reference
 * (its comment), so every path gives the reference's bits: a zmm register
 * holds 64 weights, two of the reference's 32-element runs; lane k of a
 * 16-lane int32 sum covers bytes 4k..4k+3, i.e. lane k % 8 of the
 * reference's 8, and the two halves are added (exact integers) before the
 * one convert and FMA per block (Q8_0's two 32-weight blocks per zmm keep
 * their halves apart: the reference's even- and odd-block accumulators).
 * Per 64 weights and token a K-quant costs
 * vpmaddubsw (unsigned weights x signed activations) and vpdpwssd (the
 * pairs times the sub-block scales, summed into int32): 2 instructions,
 * where AVX2 needs 6 (cpu_quant8.c). Q8_0's signed weights take vpdpbusd on
 * |w| and x with w's sign.
 */
#include "cpu_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)

#include <immintrin.h>
#include <string.h>

#define XV __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,avx2,f16c")))
#define XVI static inline __attribute__((always_inline)) XV

#ifndef MG_Q8PF
#define MG_Q8PF 2048 /* prefetch distance, as cpu_quant8.c's */
#endif

enum { Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
/* Tokens per pass over a row (prefill and decode batches): each weight
 * unpacked once per MAXT tokens. */
enum { MAXT = 8 };

XVI float hsum8z(__m256 v) { /* cpu_quant8.c's hsum8v: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)) */
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
XVI __m256i fold(__m512i p) { return _mm256_add_epi32(_mm512_castsi512_si256(p), _mm512_extracti64x4_epi64(p, 1)); }
XVI float f16z(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return _cvtsh_ss(v);
}
XVI void pfz(const uint8_t *p, int lines) {
    for (int i = 0; i < lines; i++) _mm_prefetch((const char *)p + MG_Q8PF + 64 * i, _MM_HINT_T0);
}
XVI __m512i bcast32(const uint8_t *p) { return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p)); }

/* The 8 6-bit scales and mins of a Q4_K/Q5_K block (cpu_quant8.c's k4_sm). */
XVI void k4_sm_z(const uint8_t *s12, uint8_t sm[16]) {
    uint32_t w[3];
    memcpy(w, s12, 12);
    uint32_t v[4] = {w[0] & 0x3f3f3f3fu, (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4), w[1] & 0x3f3f3f3fu,
                     ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4)};
    memcpy(sm, v, 16);
}

/* Q8_0: two blocks per zmm, the reference's even-block accumulator in
 * lanes 0-7 and its odd-block one in 8-15, so one convert and one FMA per
 * two blocks and token; the pair's two scales d_w d_x are one 2-lane
 * multiply spread to 8 lanes each by one permute. */
XVI void q8_0_z(int NT, const uint8_t *row, int32_t cols, const mg_cpu_q8act *x, float *out) {
    const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc[MAXT];
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps();
    const int32_t nb = cols / 32;
    int32_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *blk = row + (size_t)b * 34;
        pfz(blk, 2);
        const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(blk + 2))),
                                             _mm256_loadu_si256((const __m256i *)(blk + 36)), 1);
        const __m512i aw = _mm512_abs_epi8(w);
        const __mmask64 neg = _mm512_movepi8_mask(w);
        const __m128 dw = _mm_setr_ps(f16z(blk), f16z(blk + 34), 0, 0);
        for (int t = 0; t < NT; t++) {
            const __m512i xv = _mm512_loadu_si512(x[t].q + (size_t)b * 32);
            const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv));
            const __m128 d2 = _mm_mul_ps(dw, _mm_castpd_ps(_mm_load_sd((const double *)(x[t].d + b))));
            acc[t] = _mm512_fmadd_ps(_mm512_permutexvar_ps(spread, _mm512_castps128_ps512(d2)), _mm512_cvtepi32_ps(p), acc[t]);
        }
    }
    if (b < nb) { /* an odd last block (even b): the lower half */
        const uint8_t *blk = row + (size_t)b * 34;
        const __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 2)), aw = _mm256_abs_epi8(w);
        const float d0 = f16z(blk);
        for (int t = 0; t < NT; t++) {
            const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw,
                                                  _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(x[t].q + (size_t)b * 32)), w));
            const __m256 lo = _mm256_fmadd_ps(_mm256_set1_ps(d0 * x[t].d[b]), _mm256_cvtepi32_ps(p), _mm512_castps512_ps256(acc[t]));
            acc[t] = _mm512_insertf32x8(acc[t], lo, 0);
        }
    }
    for (int t = 0; t < NT; t++)
        out[t] = hsum8z(_mm256_add_ps(_mm512_castps512_ps256(acc[t]), _mm512_extractf32x8_ps(acc[t], 1)));
}

/* Q4_K and Q5_K: per 64 elements j, 32 bytes whose low nibbles are group
 * 2j and high nibbles group 2j+1; a zmm holds both (the bytes broadcast to
 * both halves, the upper half shifted by 4), matching the activations'
 * 64 bytes. Q5_K's fifth bits: bit 2j (lower half) and 2j+1 (upper) of qh. */
static const int16_t k4_gidx[4][32] = { /* int16 lane i of the zmm for elements 64j.. takes scale 2j + i/16 */
#define G16(g) g, g, g, g, g, g, g, g, g, g, g, g, g, g, g, g
    {G16(0), G16(1)}, {G16(2), G16(3)}, {G16(4), G16(5)}, {G16(6), G16(7)},
#undef G16
};

XVI void k45_z(int NT, int q5, const uint8_t *row, int32_t cols, const mg_cpu_q8act *x, float *out) {
    const __m512i m4 = _mm512_set1_epi8(0xF), one = _mm512_set1_epi8(1), nib = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
    const int32_t bb = q5 ? 176 : 144;
    /* Tokens in pairs share a zmm for their 8-lane sums (lanes 0-7 token
     * 2i, 8-15 token 2i+1: the same per-lane FMAs); an odd last token
     * keeps a ymm. */
    const int NP = NT / 2;
    __m512 acc2[MAXT / 2], macc2[MAXT / 2];
    __m256 acc1 = _mm256_setzero_ps(), macc1 = _mm256_setzero_ps();
    for (int i = 0; i < NP; i++) acc2[i] = macc2[i] = _mm512_setzero_ps();
    for (int32_t b = 0; b < cols / 256; b++) {
        const uint8_t *blk = row + (size_t)b * bb, *qs = blk + (q5 ? 48 : 16);
        pfz(blk, 3);
        uint8_t sm[16];
        k4_sm_z(blk + 4, sm);
        const float dw = f16z(blk), dmin = f16z(blk + 2);
        const __m128i mb = _mm_loadl_epi64((const __m128i *)(sm + 8));
        const __m256i mn16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mb, mb)); /* m0 m0 m1 m1 ... m7 m7 */
        const __m512i sm16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)sm)));
        const __m512i hb = q5 ? bcast32(blk + 16) : _mm512_setzero_si512();
        __m512i P[MAXT];
        for (int t = 0; t < NT; t++) P[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            __m512i w = _mm512_and_si512(_mm512_srlv_epi64(bcast32(qs + 32 * j), nib), m4);
            if (q5) {
                const __m512i sh = _mm512_set_epi64(2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j, 2 * j, 2 * j, 2 * j);
                w = _mm512_or_si512(w, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi64(hb, sh), one), 4));
            }
            const __m512i sc = _mm512_permutexvar_epi16(_mm512_loadu_si512(k4_gidx[j]), sm16);
            for (int t = 0; t < NT; t++)
                P[t] = _mm512_dpwssd_epi32(P[t], _mm512_maddubs_epi16(w, _mm512_loadu_si512(x[t].q + (size_t)b * 256 + 64 * j)), sc);
        }
        const __m512i mn16z = _mm512_broadcast_i64x4(mn16);
        const __m512 dwv = _mm512_set1_ps(dw), dmv = _mm512_set1_ps(dmin);
        for (int i = 0; i < NP; i++) {
            const int t = 2 * i;
            const __m512i lo = _mm512_shuffle_i64x2(P[t], P[t + 1], 0x44), hi = _mm512_shuffle_i64x2(P[t], P[t + 1], 0xEE);
            const __m512 xd = _mm512_insertf32x8(_mm512_set1_ps(x[t].d[b]), _mm256_set1_ps(x[t + 1].d[b]), 1);
            acc2[i] = _mm512_fmadd_ps(_mm512_mul_ps(dwv, xd), _mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)), acc2[i]);
            const __m512i bs = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(x[t].bs + (size_t)b * 16))),
                                                  _mm256_loadu_si256((const __m256i *)(x[t + 1].bs + (size_t)b * 16)), 1);
            macc2[i] = _mm512_fmadd_ps(_mm512_mul_ps(dmv, xd), _mm512_cvtepi32_ps(_mm512_madd_epi16(bs, mn16z)), macc2[i]);
        }
        if (NT & 1) {
            const int t = NT - 1;
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(dw * x[t].d[b]), _mm256_cvtepi32_ps(fold(P[t])), acc1);
            const __m256i M = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(x[t].bs + (size_t)b * 16)), mn16);
            macc1 = _mm256_fmadd_ps(_mm256_set1_ps(dmin * x[t].d[b]), _mm256_cvtepi32_ps(M), macc1);
        }
    }
    for (int i = 0; i < NP; i++) {
        out[2 * i] = hsum8z(_mm512_castps512_ps256(acc2[i])) - hsum8z(_mm512_castps512_ps256(macc2[i]));
        out[2 * i + 1] = hsum8z(_mm512_extractf32x8_ps(acc2[i], 1)) - hsum8z(_mm512_extractf32x8_ps(macc2[i], 1));
    }
    if (NT & 1) out[NT - 1] = hsum8z(acc1) - hsum8z(macc1);
}

/* Q6_K: per 128 elements h, the 64 bytes ql[64h..] hold the low 4 bits of
 * elements 0-63 (low nibbles) and 64-127 (high nibbles), qh[32h..] their
 * top 2 bits (cpu_quant8.c's q[0..3], two per zmm). Groups of 16: each
 * pair of bytes takes its group's scale (vpermw of the 16 scales). */
static const int16_t q6_gidx[4][32] = {
#define G8(g) g, g, g, g, g, g, g, g
    {G8(0), G8(1), G8(2), G8(3)}, {G8(4), G8(5), G8(6), G8(7)}, {G8(8), G8(9), G8(10), G8(11)}, {G8(12), G8(13), G8(14), G8(15)},
#undef G8
};

XVI void q6_k_z(int NT, const uint8_t *row, int32_t cols, const mg_cpu_q8act *x, float *out) {
    const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30);
    const __m512i shl = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4), shr = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
    __m512i gidx[4]; /* int16 lane i of the zmm for elements 64k.. of the block takes scale 4k + i/8 */
    for (int k = 0; k < 4; k++) gidx[k] = _mm512_loadu_si512(q6_gidx[k]);
    __m256 acc[MAXT];
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    for (int32_t b = 0; b < cols / 256; b++) {
        const uint8_t *blk = row + (size_t)b * 210;
        pfz(blk, 4);
        const float dw = f16z(blk + 208);
        const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        const __m512i s16z = _mm512_castsi256_si512(s16);
        __m512i P[MAXT];
        for (int t = 0; t < NT; t++) P[t] = _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m512i ab = _mm512_loadu_si512(blk + 64 * h), c = bcast32(blk + 128 + 32 * h);
            const __m512i q01 = _mm512_or_si512(_mm512_and_si512(ab, m4), _mm512_and_si512(_mm512_sllv_epi64(c, shl), m30));
            const __m512i q23 =
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ab, 4), m4), _mm512_and_si512(_mm512_srlv_epi64(c, shr), m30));
            const __m512i s01 = _mm512_permutexvar_epi16(gidx[2 * h], s16z), s23 = _mm512_permutexvar_epi16(gidx[2 * h + 1], s16z);
            for (int t = 0; t < NT; t++) {
                const int8_t *xb = x[t].q + (size_t)b * 256 + 128 * h;
                P[t] = _mm512_dpwssd_epi32(P[t], _mm512_maddubs_epi16(q01, _mm512_loadu_si512(xb)), s01);
                P[t] = _mm512_dpwssd_epi32(P[t], _mm512_maddubs_epi16(q23, _mm512_loadu_si512(xb + 64)), s23);
            }
        }
        for (int t = 0; t < NT; t++) { /* the offset: -32 sum_g sc_g bs_g */
            const __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(x[t].bs + (size_t)b * 16)), s16), 5);
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x[t].d[b]), _mm256_cvtepi32_ps(_mm256_sub_epi32(fold(P[t]), off)), acc[t]);
        }
    }
    for (int t = 0; t < NT; t++) out[t] = hsum8z(acc[t]);
}

#define Q8Z_BY_NT(F, ...)              \
    switch (nt) {                      \
    case 8: F(8, __VA_ARGS__); break;  \
    case 7: F(7, __VA_ARGS__); break;  \
    case 6: F(6, __VA_ARGS__); break;  \
    case 5: F(5, __VA_ARGS__); break;  \
    case 4: F(4, __VA_ARGS__); break;  \
    case 3: F(3, __VA_ARGS__); break;  \
    case 2: F(2, __VA_ARGS__); break;  \
    default: F(1, __VA_ARGS__); break; \
    }

XV int mg_cpu_q8dot_n_avx512(int32_t dtype, const void *row, int32_t cols, int nt, const mg_cpu_q8act *x, float *out) {
    if (!mg_cpu_has_vnni() || nt < 1 || nt > MAXT) return 0;
    switch (dtype) {
    case Q8_0: Q8Z_BY_NT(q8_0_z, row, cols, x, out) return 1;
    case Q4_K: Q8Z_BY_NT(k45_z, 0, row, cols, x, out) return 1;
    case Q5_K: Q8Z_BY_NT(k45_z, 1, row, cols, x, out) return 1;
    case Q6_K: Q8Z_BY_NT(q6_k_z, row, cols, x, out) return 1;
    }
    return 0;
}

#else /* not x86-64 GCC/Clang */

int mg_cpu_q8dot_n_avx512(int32_t dtype, const void *row, int32_t cols, int nt, const mg_cpu_q8act *x, float *out) {
    (void)dtype, (void)row, (void)cols, (void)nt, (void)x, (void)out;
    return 0;
}

#endif

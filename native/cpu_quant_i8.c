/*
 * cpu_quant_i8.c: measurement only, not used by the backend. The other
 * scheme for quantized products, llama.cpp's: activations rounded to 8-bit
 * blocks of 32 (an f32 scale, 32 int8) and integer dot products (AVX2
 * vpmaddubsw + vpmaddwd), on Q8_0 weights, so BenchmarkQuantActivations
 * can compare its speed and error with cpu_quant.c's 16-bit activations
 * (docs/performance.md, issue 24).
 */
#include <math.h>
#include <string.h>

#include "cpu_kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

/* x [cols] -> 32-blocks: xd[b] = max|x| / 127, xq = round(x / xd). */
void mg_cpu_i8_quantize_x(const float *x, int32_t cols, int8_t *xq, float *xd) {
    for (int32_t b = 0; b < cols / 32; b++) {
        float amax = 0;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[32 * b + i]));
        float d = amax / 127, id = d > 0 ? 1 / d : 0;
        xd[b] = d;
        for (int i = 0; i < 32; i++) xq[32 * b + i] = (int8_t)lrintf(x[32 * b + i] * id);
    }
}

/* out[r] = row r of a Q8_0 matrix . the quantized x, for rows r0..r1-1. */
void mg_cpu_i8_matvec_q8_0(const void *w, int32_t rows, int32_t cols, const int8_t *xq, const float *xd, float *out) {
    const __m256i ones = _mm256_set1_epi16(1);
    size_t rb = (size_t)cols / 32 * 34;
    for (int32_t r = 0; r < rows; r++) {
        const uint8_t *row = (const uint8_t *)w + (size_t)r * rb;
        __m256 acc = _mm256_setzero_ps();
        for (int32_t b = 0; b < cols / 32; b++) {
            const uint8_t *blk = row + (size_t)b * 34;
            uint16_t h;
            memcpy(&h, blk, 2);
            __m256i wq = _mm256_loadu_si256((const __m256i *)(blk + 2));
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + 32 * b));
            __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xv, wq));
            __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(h) * xd[b]), p, acc);
        }
        __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
        out[r] = _mm_cvtss_f32(_mm_add_ss(lo, _mm_movehdup_ps(lo)));
    }
}
#else
void mg_cpu_i8_quantize_x(const float *x, int32_t cols, int8_t *xq, float *xd) { (void)x, (void)cols, (void)xq, (void)xd; }
void mg_cpu_i8_matvec_q8_0(const void *w, int32_t rows, int32_t cols, const int8_t *xq, const float *xd, float *out) {
    (void)w, (void)cols, (void)xq, (void)xd;
    for (int32_t r = 0; r < rows; r++) out[r] = 0;
}
#endif

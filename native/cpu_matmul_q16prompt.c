/*
 * cpu_matmul_q16prompt.c: prompt steps of quantized weights on 16-bit
 * integer products (AVX-512 VNNI vpdpwssd), tokens in the lanes: the other
 * prompt kernel, chosen where it measured faster than the f32 tile of
 * cpu_matmul_avx512.c when the first backend opened (mg_cpu_prompt_q16).
 *
 * Why: on Zen 4 a 512-bit f32 FMA and a 512-bit vpdpwssd both issue once a
 * cycle, but vpdpwssd does 32 multiply-adds where the FMA does 16. In L1,
 * one core: this kernel's 6x2 tile 134-141 GFLOP/s, the f32 8x3 tile 92. On
 * an Intel core with two FMA ports and vpdpwssd on one, the f32 tile wins.
 *
 * The arithmetic is decode's 16-bit scheme (cpu_quant.c): each token's
 * activations rounded to 16 bits per group of 32 (mg_cpu_qx: xq, xd, and
 * the f32 group sums xs), the weights' q values and group scales s_g (and
 * mins m_g) as mg_cpu_qprep_row gives them. For output (row r, token t),
 * groups in column order:
 *
 *   acc = fma((float)p_g, s_g * xd_g(t), acc), p_g = sum over the group of
 *   q * xq (exact in int32); with mins acc = fnmadd(m_g, xs_g(t), acc)
 *
 * one f32 chain per output, in the lane of its token, so a token's bits do
 * not depend on the batch, the panel it sits in, or the threads. They differ
 * from decode's (8 lanes summed at the end) in the last bits, as the f32
 * prompt kernel's do.
 *
 * Layout: the call's tokens in panels of VT; a panel holds, per column pair
 * kp, the VT tokens' (xq[2kp], xq[2kp+1]) as int32 ([cols/2][VT]), and per
 * 32-group the VT tokens' xd and xs ([cols/32][VT]). A chunk is a block of
 * rows prepped once (about 256 KiB, in L2) and passed by every panel, VKC
 * columns at a time so the panel's slice (VKC * 64 bytes) stays in L1; the
 * tile's f32 accumulators wait in the thread's buffer between passes.
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

#define QV __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,avx2")))
#define INLINE inline __attribute__((always_inline))

enum { DT_Q8_0 = 8 };

/* tile: VR rows x VZ zmm of tokens: VR * VZ int32 and as many f32
 * accumulators, VZ activation registers and one broadcast weight pair */
enum { VR = 6, VZ = 2, VT = 16 * VZ };
enum { VKC = 256 }; /* columns per pass, a multiple of 32 */

struct qpanel {
    int32_t *xp;    /* [cols/2][VT] token pairs */
    float *xd, *xs; /* [cols/32][VT] */
};

/* out[t, r] for rm rows (preps pf floats apart) and nz zmm of tokens over
 * columns k0..k0+kw-1; gl the group length, mins whether the type has mins. */
static INLINE QV void tile_q16(const float *prep, size_t pf, int32_t cols, const int rm, const int nz, const int gl,
                               const int mins, const struct qpanel *p, int32_t nt, int32_t k0, int32_t kw, float *accbuf,
                               const mg_cpu_weight *bias, int32_t r0, float *out, size_t os) {
    __m512 acc[VR][VZ];
#pragma GCC unroll 6
    for (int i = 0; i < rm; i++)
#pragma GCC unroll 2
        for (int c = 0; c < nz; c++) acc[i][c] = k0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(accbuf + (i * VZ + c) * 16);
    const int32_t *q[VR];
    const float *sc[VR], *dm[VR];
#pragma GCC unroll 6
    for (int i = 0; i < rm; i++) {
        q[i] = (const int32_t *)(const void *)(prep + (size_t)i * pf); /* q values, two per int32 */
        sc[i] = prep + (size_t)i * pf + cols / 2;
        dm[i] = sc[i] + cols / gl;
    }
    for (int32_t g = k0 / gl; g < (k0 + kw) / gl; g++) {
        __m512i pi[VR][VZ];
#pragma GCC unroll 6
        for (int i = 0; i < rm; i++)
#pragma GCC unroll 2
            for (int c = 0; c < nz; c++) pi[i][c] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int32_t kp = g * gl / 2; kp < (g + 1) * gl / 2; kp++) {
            __m512i xv[VZ];
#pragma GCC unroll 2
            for (int c = 0; c < nz; c++) xv[c] = _mm512_loadu_si512(p->xp + (size_t)kp * VT + 16 * c);
#pragma GCC unroll 6
            for (int i = 0; i < rm; i++) {
                const __m512i wv = _mm512_set1_epi32(q[i][kp]);
#pragma GCC unroll 2
                for (int c = 0; c < nz; c++) pi[i][c] = _mm512_dpwssd_epi32(pi[i][c], wv, xv[c]);
            }
        }
        const int32_t g32 = g * gl / 32;
#pragma GCC unroll 2
        for (int c = 0; c < nz; c++) {
            const __m512 xd = _mm512_loadu_ps(p->xd + (size_t)g32 * VT + 16 * c);
            const __m512 xs = mins ? _mm512_loadu_ps(p->xs + (size_t)g32 * VT + 16 * c) : xd;
#pragma GCC unroll 6
            for (int i = 0; i < rm; i++) {
                acc[i][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pi[i][c]), _mm512_mul_ps(_mm512_set1_ps(sc[i][g]), xd), acc[i][c]);
                if (mins) acc[i][c] = _mm512_fnmadd_ps(_mm512_set1_ps(dm[i][g]), xs, acc[i][c]);
            }
        }
    }
    if (k0 + kw < cols) {
#pragma GCC unroll 6
        for (int i = 0; i < rm; i++)
#pragma GCC unroll 2
            for (int c = 0; c < nz; c++) _mm512_store_ps(accbuf + (i * VZ + c) * 16, acc[i][c]);
        return;
    }
    float lanes[16] __attribute__((aligned(64)));
#pragma GCC unroll 6
    for (int i = 0; i < rm; i++) {
        const float b = mg_cpu_bias_at(bias, r0 + i);
        for (int c = 0; c < nz; c++) {
            _mm512_store_ps(lanes, acc[i][c]);
            for (int l = 0; l < 16 && 16 * c + l < nt; l++) out[(size_t)(16 * c + l) * os + r0 + i] = lanes[l] + b;
        }
    }
}

/* Every (rows, token registers, group kind) as its own function: kind 0 is
 * 32-groups with mins (Q4_K, Q5_K), 1 32-groups (Q8_0), 2 16-groups (Q6_K). */
typedef void (*tileq_fn)(const float *, size_t, int32_t, const struct qpanel *, int32_t, int32_t, int32_t, float *,
                         const mg_cpu_weight *, int32_t, float *, size_t);
#define DEF_Q(a, b, k)                                                                                                 \
    static QV void q16_##a##x##b##_##k(const float *prep, size_t pf, int32_t cols, const struct qpanel *p, int32_t nt,  \
                                       int32_t k0, int32_t kw, float *accbuf, const mg_cpu_weight *bias, int32_t r0,    \
                                       float *out, size_t os) {                                                         \
        tile_q16(prep, pf, cols, a, b, k == 2 ? 16 : 32, k == 0, p, nt, k0, kw, accbuf, bias, r0, out, os);             \
    }
#define SHAPES_Q(F, k) F(1, 1, k) F(1, 2, k) F(2, 1, k) F(2, 2, k) F(3, 1, k) F(3, 2, k) \
                       F(4, 1, k) F(4, 2, k) F(5, 1, k) F(5, 2, k) F(6, 1, k) F(6, 2, k)
SHAPES_Q(DEF_Q, 0)
SHAPES_Q(DEF_Q, 1)
SHAPES_Q(DEF_Q, 2)
#define REF_Q(a, b, k) q16_##a##x##b##_##k,
static const tileq_fn tiles_q16[3][VR * VZ] = {{SHAPES_Q(REF_Q, 0)}, {SHAPES_Q(REF_Q, 1)}, {SHAPES_Q(REF_Q, 2)}};

static int group_kind(int32_t dtype) {
    if (mg_cpu_quant_group(dtype) == 16) return 2;
    return mg_cpu_quant_has_min(dtype) ? 0 : 1;
}

/* The call's tokens as panels (zeros past n): every token through mg_cpu_qx. */
static QV int to_qpanels(int isa, const float *x, int32_t n, int32_t cols, struct qpanel *ps) {
    int16_t *xq = malloc((size_t)cols * sizeof(int16_t));
    float *xd = malloc((size_t)cols / 32 * sizeof(float)), *xs = malloc((size_t)cols / 32 * sizeof(float));
    if (!xq || !xd || !xs) {
        free(xq), free(xd), free(xs);
        return 0;
    }
    const int32_t np = (n + VT - 1) / VT, ng = cols / 32;
    for (int32_t pi = 0; pi < np; pi++) {
        struct qpanel *p = &ps[pi];
        for (int32_t l = 0; l < VT; l++) {
            const int32_t t = pi * VT + l;
            if (t < n) mg_cpu_qx(isa, x + (size_t)t * cols, cols, xq, xd, xs);
            const uint32_t *pairs = (const uint32_t *)(const void *)xq;
            for (int32_t kp = 0; kp < cols / 2; kp++) p->xp[(size_t)kp * VT + l] = t < n ? (int32_t)pairs[kp] : 0;
            for (int32_t g = 0; g < ng; g++) {
                p->xd[(size_t)g * VT + l] = t < n ? xd[g] : 0.0f;
                p->xs[(size_t)g * VT + l] = t < n ? xs[g] : 0.0f;
            }
        }
    }
    free(xq), free(xd), free(xs);
    return 1;
}

struct q16_job {
    const struct qpanel *ps;
    int32_t n, cols, isa;
    const mg_cpu_weight *w[MG_MATMUL_MAX], *bias[MG_MATMUL_MAX];
    float *out[MG_MATMUL_MAX];
    int32_t rb;                             /* rows per chunk, a multiple of VR */
    int64_t first_chunk[MG_MATMUL_MAX + 1]; /* matrix m owns first_chunk[m]..first_chunk[m+1]-1 */
    float *buf[256];                        /* per thread: the accumulators, then rb prepped rows */
    int failed;
};

static void q16_chunk(void *ctx, int64_t chunk, int ith) {
    struct q16_job *j = ctx;
    int m = 0;
    while (chunk >= j->first_chunk[m + 1]) m++;
    const mg_cpu_weight *wt = j->w[m];
    const int32_t cols = j->cols, n = j->n;
    const int32_t r0 = (int32_t)(chunk - j->first_chunk[m]) * j->rb, r1 = r0 + j->rb < wt->rows ? r0 + j->rb : wt->rows;
    const size_t pf = (mg_cpu_qprep_floats(cols) + 15) / 16 * 16; /* floats per prepped row */
    const size_t afloats = (size_t)(j->rb + VR - 1) / VR * VR * VZ * 16;
    float *accbuf = j->buf[ith];
    if (!accbuf) {
        accbuf = j->buf[ith] = aligned_alloc(64, (afloats + (size_t)j->rb * pf) * sizeof(float));
        if (!accbuf) {
            __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
            return;
        }
    }
    float *prep = accbuf + afloats;
    const size_t rbytes = mg_cpu_quant_row_bytes(wt->dtype, cols);
    for (int32_t r = r0; r < r1; r++)
        mg_cpu_qprep_row(j->isa, wt->dtype, (const char *)wt->data + (size_t)r * rbytes, cols, prep + (size_t)(r - r0) * pf);
    const tileq_fn *tiles = tiles_q16[group_kind(wt->dtype)];
    const size_t os = (size_t)wt->rows;
    for (int32_t t0 = 0; t0 < n; t0 += VT) {
        const int32_t nt = n - t0 < VT ? n - t0 : VT, nz = (nt + 15) / 16;
        const struct qpanel *p = &j->ps[t0 / VT];
        for (int32_t k0 = 0; k0 < cols; k0 += VKC) {
            const int32_t kw = cols - k0 < VKC ? cols - k0 : VKC;
            for (int32_t r = r0; r < r1; r += VR) {
                const int rm = r1 - r < VR ? r1 - r : VR;
                tiles[(rm - 1) * VZ + (nz - 1)](prep + (size_t)(r - r0) * pf, pf, cols, p, nt, k0, kw,
                                                accbuf + (size_t)(r - r0) / VR * VR * VZ * 16, j->bias[m], r,
                                                j->out[m] + (size_t)t0 * os, os);
            }
        }
    }
}

static int prompt_q16(struct mg_pool *pool, int isa, const float *x, int32_t n, int32_t count, const mg_cpu_weight *const *ws,
                      const mg_cpu_weight *const *biases, float *const *outs) {
    const int32_t cols = ws[0]->cols, np = (n + VT - 1) / VT;
    if (cols % 32) return 0;
    for (int m = 0; m < count; m++)
        if (!mg_cpu_is_quant(ws[m]->dtype) || ws[m]->cols != cols) return 0;
    struct q16_job *j = calloc(1, sizeof *j);
    struct qpanel *ps = calloc((size_t)np, sizeof *ps);
    const size_t pn = (size_t)cols / 2 * VT, gn = (size_t)cols / 32 * VT;
    int32_t *xp = malloc((size_t)np * pn * sizeof(int32_t));
    float *xf = malloc((size_t)np * 2 * gn * sizeof(float));
    int ok = j && ps && xp && xf;
    if (ok) {
        for (int32_t i = 0; i < np; i++)
            ps[i].xp = xp + (size_t)i * pn, ps[i].xd = xf + (size_t)i * 2 * gn, ps[i].xs = ps[i].xd + gn;
        ok = to_qpanels(isa, x, n, cols, ps);
    }
    if (ok) {
        j->ps = ps, j->n = n, j->cols = cols, j->isa = isa;
        int nth = mg_pool_threads(pool);
        /* Rows per chunk: about 256 KiB of prepped rows, which stay in L2
         * while every panel passes, but enough chunks to balance threads. */
        int64_t rows = 0;
        for (int m = 0; m < count; m++) rows += ws[m]->rows;
        const int64_t pfb = (int64_t)mg_cpu_qprep_floats(cols) * 4;
        int64_t rb = ((int64_t)256 << 10) / pfb, most = rows / ((int64_t)nth * 8);
        if (rb > most) rb = most;
        rb = rb / VR * VR;
        if (rb < VR) rb = VR;
        j->rb = (int32_t)rb;
        for (int m = 0; m < count; m++) {
            j->w[m] = ws[m];
            j->bias[m] = biases ? biases[m] : NULL;
            j->out[m] = outs[m];
            j->first_chunk[m + 1] = j->first_chunk[m] + (ws[m]->rows + rb - 1) / rb;
        }
        mg_pool_for(nth > 1 ? pool : NULL, j->first_chunk[count], q16_chunk, j);
        for (int i = 0; i < 256; i++) free(j->buf[i]);
        ok = !j->failed;
    }
    free(j), free(ps), free(xp), free(xf);
    return ok; /* 0: the caller's path, from the start (every output is written again) */
}

/* ---- which prompt kernel: measured once ---- */

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static double q16_speedup;
static int q16_forced = -1; /* tests: 0 or 1; -1: by the measurement */

/* Both prompt kernels on one thread, a Q8_0 weight of 48 x 2048 (L2-sized)
 * and 64 tokens, preparation included: the best of 5 alternated rounds of
 * 4 calls each. About 10 ms; once, when the first backend opens (its
 * description says which kernel runs). Q8_0 stands for every type: the
 * tiles differ only in their scales' few instructions per group. The
 * reading is per process and scatters, so it decides only where it is
 * clear (mg_cpu_prompt_q16): two processes on one machine then choose
 * alike unless their readings straddle 1.5x (other vendors) or 0.9x (AMD). */
static void measure_q16(void) {
    enum { ROWS = 48, COLS = 2048, N = 64, REPS = 4, ROUNDS = 5 };
    const size_t rbytes = mg_cpu_quant_row_bytes(DT_Q8_0, COLS);
    uint8_t *wd = malloc(ROWS * rbytes);
    float *x = malloc((size_t)N * COLS * sizeof(float)), *out = malloc((size_t)N * ROWS * sizeof(float));
    q16_speedup = 0; /* unknown: the f32 tile */
    if (wd && x && out && mg_cpu_isa_supported(MG_ISA_AVX512F) && mg_cpu_has_vnni()) {
        for (size_t i = 0; i < ROWS * rbytes; i++) wd[i] = (uint8_t)(i * 37 % 251);
        for (size_t b = 0; b < ROWS * rbytes; b += 34) wd[b] = 0x00, wd[b + 1] = 0x20; /* f16 scale 2^-7 */
        for (int i = 0; i < N * COLS; i++) x[i] = (float)((i * 53 % 97) - 48) * 1e-2f;
        mg_cpu_weight w = {.dtype = DT_Q8_0, .data = wd, .rows = ROWS, .cols = COLS};
        const mg_cpu_weight *ws[1] = {&w};
        float *outs[1] = {out};
        double best_f = 1e30, best_q = 1e30;
        int ok = 1;
        for (int r = 0; r < ROUNDS && ok; r++) {
            double t0 = now_ns();
            for (int i = 0; i < REPS; i++) ok &= mg_cpu_matmul_prompt_f32(NULL, MG_ISA_AVX512F, x, N, 1, ws, NULL, outs);
            double t1 = now_ns();
            for (int i = 0; i < REPS; i++) ok &= prompt_q16(NULL, MG_ISA_AVX512F, x, N, 1, ws, NULL, outs);
            double t2 = now_ns();
            if (t1 - t0 < best_f) best_f = t1 - t0;
            if (t2 - t1 < best_q) best_q = t2 - t1;
        }
        if (ok && best_q > 0) q16_speedup = best_f / best_q;
    }
    free(wd), free(x), free(out);
}

double mg_cpu_prompt_q16_speedup(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, measure_q16);
    return q16_speedup;
}

void mg_cpu_set_prompt_q16(int on) { __atomic_store_n(&q16_forced, on < 0 ? -1 : !!on, __ATOMIC_RELEASE); }

/* The two kernels' bits differ, so every process on a machine must choose
 * alike: one process's reading scattered over 0.95-1.41x on an Emerald
 * Rapids VM (10 processes), where a single 1.15x threshold had 3 take this
 * kernel and 7 the f32 tile. So the banded rule of the bf16 default
 * (mg_cpu_faster_measured): Zen 4 (1.56-1.62x) and Zen 5 (1.36x) take it,
 * other vendors' cores keep the f32 tile unless it reads 1.5x or more. */
int mg_cpu_prompt_q16(void) {
    if (!mg_cpu_isa_supported(MG_ISA_AVX512F) || !mg_cpu_has_vnni()) return 0;
    int f = __atomic_load_n(&q16_forced, __ATOMIC_ACQUIRE);
    if (f >= 0) return f;
    return mg_cpu_faster_measured(mg_cpu_prompt_q16_speedup());
}

int mg_cpu_matmul_prompt_q16(struct mg_pool *pool, int isa, const float *x, int32_t n, int32_t count,
                             const mg_cpu_weight *const *ws, const mg_cpu_weight *const *biases, float *const *outs) {
    if (isa != MG_ISA_AVX512F && isa != MG_ISA_AVX512BF16) return 0;
    if (count <= 0 || count > MG_MATMUL_MAX || n <= 0 || !mg_cpu_has_vnni()) return 0;
    return prompt_q16(pool, isa, x, n, count, ws, biases, outs);
}

#else /* not x86-64 GCC/Clang: no AVX-512 paths */

double mg_cpu_prompt_q16_speedup(void) { return 0; }
void mg_cpu_set_prompt_q16(int on) { (void)on; }
int mg_cpu_prompt_q16(void) { return 0; }
int mg_cpu_matmul_prompt_q16(struct mg_pool *pool, int isa, const float *x, int32_t n, int32_t count,
                             const mg_cpu_weight *const *ws, const mg_cpu_weight *const *biases, float *const *outs) {
    (void)pool, (void)isa, (void)x, (void)n, (void)count, (void)ws, (void)biases, (void)outs;
    return 0;
}

#endif

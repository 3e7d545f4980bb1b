/*
 * membw.c: the machine's memory read bandwidth, measured the way the CPU
 * backend streams weights (all threads, each summing its part of a buffer
 * much larger than the caches), so benchmarks can report decode weight GB/s
 * as a fraction of what the machine can read.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "cpu_pool.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

struct bw_job {
    const float *buf;
    size_t n_floats, per_chunk;
    double sums[256];
};

static void bw_chunk(void *ctx, int64_t chunk, int ith) {
    struct bw_job *j = ctx;
    size_t a = (size_t)chunk * j->per_chunk, b = a + j->per_chunk;
    if (b > j->n_floats) b = j->n_floats;
    const float *p = j->buf;
    float s;
#if defined(__AVX2__)
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    size_t i = a;
    for (; i + 32 <= b; i += 32) {
        s0 = _mm256_add_ps(s0, _mm256_load_ps(p + i));
        s1 = _mm256_add_ps(s1, _mm256_load_ps(p + i + 8));
        s2 = _mm256_add_ps(s2, _mm256_load_ps(p + i + 16));
        s3 = _mm256_add_ps(s3, _mm256_load_ps(p + i + 24));
    }
    float t[8];
    _mm256_storeu_ps(t, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    s = t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
    for (; i < b; i++) s += p[i];
#else
    float acc[8] = {0};
    size_t i = a;
    for (; i + 8 <= b; i += 8)
        for (int k = 0; k < 8; k++) acc[k] += p[i + k];
    s = acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7];
    for (; i < b; i++) s += p[i];
#endif
    j->sums[ith] += s;
}

/* Reads an nbytes buffer reps times with threads threads (0 = all cores);
 * returns the best pass in GB/s (1e9 bytes/s), or -1 if out of memory. */
double mg_mem_read_gbps(size_t nbytes, int threads, int reps) {
    nbytes = nbytes / (2u << 20) * (2u << 20); /* whole huge pages */
    if (nbytes == 0 || reps <= 0) return -1;
    mg_pool *pool = mg_pool_create(threads);
    if (!pool) return -1;
    float *buf = NULL;
    if (posix_memalign((void **)&buf, 2u << 20, nbytes) != 0) {
        mg_pool_free(pool);
        return -1;
    }
#ifdef MADV_HUGEPAGE
    madvise(buf, nbytes, MADV_HUGEPAGE); /* as the backend's weights */
#endif
    memset(buf, 1, nbytes); /* commit every page before timing */
    struct bw_job *j = calloc(1, sizeof *j);
    if (!j) {
        free(buf);
        mg_pool_free(pool);
        return -1;
    }
    j->buf = buf;
    j->n_floats = nbytes / 4;
    j->per_chunk = 1 << 16; /* 256 KiB, a multiple of 32 floats */
    int64_t chunks = (int64_t)((j->n_floats + j->per_chunk - 1) / j->per_chunk);
    double best = 0;
    for (int r = 0; r < reps; r++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        mg_pool_for(pool, chunks, bw_chunk, j);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
        double gbps = (double)nbytes / s / 1e9;
        if (gbps > best) best = gbps;
    }
    free(j);
    free(buf);
    mg_pool_free(pool);
    return best;
}

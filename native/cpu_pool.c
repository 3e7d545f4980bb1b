#define _GNU_SOURCE
#include "cpu_pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MG_PAUSE() _mm_pause()
#else
#define MG_PAUSE() ((void)0)
#endif

/* How long an idle worker or a waiting caller spins before sleeping. */
#define MG_SPIN_NS 50000LL

struct mg_pool {
    int nth;
    pthread_t *threads;
    pthread_mutex_t run_mu; /* one job at a time */
    pthread_mutex_t mu;     /* guards the job fields and the condition variables */
    pthread_cond_t cv_work, cv_done;
    /* the current job */
    mg_chunk_fn fn;
    void *ctx;
    int64_t n_chunks;
    int64_t next;  /* next chunk to take (atomic) */
    int open;      /* workers may still join the job */
    int active;    /* workers inside the job (atomic) */
    unsigned gen;  /* bumped per job (atomic) */
    int quit;
};

struct worker_arg {
    mg_pool *p;
    int ith;
};

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void drain(mg_pool *p, mg_chunk_fn fn, void *ctx, int64_t n, int ith) {
    int64_t c;
    while ((c = __atomic_fetch_add(&p->next, 1, __ATOMIC_RELAXED)) < n) fn(ctx, c, ith);
}

static void *worker_main(void *arg) {
    struct worker_arg wa = *(struct worker_arg *)arg;
    free(arg);
    mg_pool *p = wa.p;
    unsigned seen = 0;
    for (;;) {
        long long t0 = now_ns();
        int i = 0;
        while (__atomic_load_n(&p->gen, __ATOMIC_ACQUIRE) == seen && !__atomic_load_n(&p->quit, __ATOMIC_ACQUIRE)) {
            MG_PAUSE();
            if ((++i & 63) == 0 && now_ns() - t0 > MG_SPIN_NS) break;
        }
        pthread_mutex_lock(&p->mu);
        while (p->gen == seen && !p->quit) pthread_cond_wait(&p->cv_work, &p->mu);
        if (p->quit) {
            pthread_mutex_unlock(&p->mu);
            return NULL;
        }
        seen = p->gen;
        if (!p->open) { /* woke too late: the caller finished this job alone */
            pthread_mutex_unlock(&p->mu);
            continue;
        }
        __atomic_add_fetch(&p->active, 1, __ATOMIC_ACQ_REL);
        mg_chunk_fn fn = p->fn;
        void *ctx = p->ctx;
        int64_t n = p->n_chunks;
        pthread_mutex_unlock(&p->mu);

        drain(p, fn, ctx, n, wa.ith);

        if (__atomic_sub_fetch(&p->active, 1, __ATOMIC_ACQ_REL) == 0) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->cv_done);
            pthread_mutex_unlock(&p->mu);
        }
    }
}

int mg_cpu_count(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return n;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

mg_pool *mg_pool_create(int nthreads) {
    if (nthreads <= 0) nthreads = mg_cpu_count();
    if (nthreads > 256) nthreads = 256;
    mg_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->nth = nthreads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_mutex_init(&p->run_mu, NULL);
    pthread_cond_init(&p->cv_work, NULL);
    pthread_cond_init(&p->cv_done, NULL);
    if (nthreads > 1) {
        p->threads = calloc((size_t)nthreads, sizeof(pthread_t));
        if (!p->threads) {
            p->nth = 1;
            return p;
        }
        for (int i = 1; i < nthreads; i++) {
            struct worker_arg *wa = malloc(sizeof *wa);
            if (!wa) {
                p->nth = i; /* keep the workers that started */
                break;
            }
            wa->p = p;
            wa->ith = i;
            if (pthread_create(&p->threads[i], NULL, worker_main, wa) != 0) {
                free(wa);
                p->nth = i;
                break;
            }
        }
    }
    return p;
}

void mg_pool_free(mg_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    __atomic_store_n(&p->quit, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->nth; i++) pthread_join(p->threads[i], NULL);
    free(p->threads);
    pthread_mutex_destroy(&p->mu);
    pthread_mutex_destroy(&p->run_mu);
    pthread_cond_destroy(&p->cv_work);
    pthread_cond_destroy(&p->cv_done);
    free(p);
}

int mg_pool_threads(const mg_pool *p) { return p ? p->nth : 1; }

void mg_pool_for(mg_pool *p, int64_t n_chunks, mg_chunk_fn fn, void *ctx) {
    if (n_chunks <= 0) return;
    if (!p || p->nth <= 1 || n_chunks == 1) {
        for (int64_t c = 0; c < n_chunks; c++) fn(ctx, c, 0);
        return;
    }
    pthread_mutex_lock(&p->run_mu);
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->n_chunks = n_chunks;
    __atomic_store_n(&p->next, 0, __ATOMIC_RELAXED);
    p->open = 1;
    __atomic_add_fetch(&p->gen, 1, __ATOMIC_ACQ_REL);
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);

    drain(p, fn, ctx, n_chunks, 0);

    pthread_mutex_lock(&p->mu);
    p->open = 0; /* late wakers skip this job */
    pthread_mutex_unlock(&p->mu);
    long long t0 = now_ns();
    int i = 0;
    while (__atomic_load_n(&p->active, __ATOMIC_ACQUIRE) > 0) {
        MG_PAUSE();
        if ((++i & 63) == 0 && now_ns() - t0 > MG_SPIN_NS) break;
    }
    pthread_mutex_lock(&p->mu);
    while (__atomic_load_n(&p->active, __ATOMIC_ACQUIRE) > 0) pthread_cond_wait(&p->cv_done, &p->mu);
    pthread_mutex_unlock(&p->mu);
    pthread_mutex_unlock(&p->run_mu);
}

/*
 * cpu_pool.h: a small thread pool for the CPU backend. Workers spin briefly
 * after each job (back-to-back kernels of one forward pass dispatch quickly)
 * and then sleep on a condition variable, so an idle node does not burn the
 * cores its HTTP servers need.
 */
#ifndef MESHGPU_CPU_POOL_H
#define MESHGPU_CPU_POOL_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mg_pool mg_pool;

/* One chunk of a parallel loop: ith is the running thread (0 = the caller,
 * < mg_pool_threads), for per-thread scratch. */
typedef void (*mg_chunk_fn)(void *ctx, int64_t chunk, int ith);

/* nthreads <= 0: all cores this process may run on. NULL on failure. */
mg_pool *mg_pool_create(int nthreads);
void mg_pool_free(mg_pool *p);
/* Threads chunks may run on; 1 for NULL. */
int mg_pool_threads(const mg_pool *p);
/* Runs fn for chunks 0..n_chunks-1 and returns when all are done. Threads
 * take chunks one at a time, so a worker the OS has not scheduled yet costs
 * nothing: the caller takes its share. Calls from several threads are
 * serialized. p may be NULL (the caller runs every chunk). */
void mg_pool_for(mg_pool *p, int64_t n_chunks, mg_chunk_fn fn, void *ctx);
/* Cores this process may run on (sched_getaffinity), at least 1. */
int mg_cpu_count(void);

#ifdef __cplusplus
}
#endif

#endif

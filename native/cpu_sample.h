/*
 * cpu_sample.h: the backend sampler (meshgpu.h "Sampling in the backend"),
 * the reference the CUDA sampler (kernels/sample.cu) is compared with and
 * that native tests compare with Go's meshgpu/sample.
 */
#ifndef MG_CPU_SAMPLE_H
#define MG_CPU_SAMPLE_H

#include <stdint.h>

#include "meshgpu.h"

/* Penalizes logits in place and picks a token into out. history holds
 * n_history ids; history[generated_from:] are the generated ones.
 * MG_ERR_OUT_OF_MEMORY or MG_ERR_INVALID_ARGUMENT (message in err). */
mg_status mg_cpu_sample(float *logits, int32_t vocab, const mg_sample_params *p, const int32_t *history,
                        int32_t n_history, int32_t generated_from, int64_t draw, mg_sample_result *out,
                        char *err, int errlen);

/* Checks p's ranges as sample.Params.Validate does. */
int mg_sample_params_ok(const mg_sample_params *p);

#endif

/*
 * cpu_ends.h: the CPU backend's ends of the mesh (meshgpu.h ABI 3), built
 * on its embed/forward/logits and cpu_sample.c, and the few accessors of
 * cpu_backend.c's handles they need.
 */
#ifndef MG_CPU_ENDS_H
#define MG_CPU_ENDS_H

#include "meshgpu.h"

mg_status mg_cpu_head_forward(mg_stack *s, const mg_token_step *steps, int32_t n_steps, int32_t last_layer, int32_t dtype,
                              void *out);
mg_status mg_cpu_tail_forward(mg_stack *s, const mg_token_step *steps, int32_t n_steps, int32_t first_layer, int32_t dtype,
                              const void *in);
mg_status mg_cpu_decode(mg_stack *s, const mg_token_step *steps, int32_t n_steps);

/* cpu_backend.c */
mg_status mg_cpu_fail(mg_status st, const char *msg);
const mg_stack_config *mg_cpu_stack_config(const mg_stack *s);
int32_t mg_cpu_stack_held(const mg_stack *s);
mg_stack *mg_cpu_session_stack(const mg_session *se);
int32_t *mg_cpu_session_history(mg_session *se, int32_t **len, int32_t *cap);

#endif

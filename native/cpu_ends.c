/*
 * cpu_ends.c: head_forward, tail_forward and decode (meshgpu.h ABI 3) on
 * the CPU backend. They run the same embed, forward and logits as the
 * separate calls, in the call's activation dtype, so they compute exactly
 * what those calls plus sample.Choose compute (native tests check).
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_ends.h"
#include "cpu_kernels.h"
#include "cpu_sample.h"

static _Thread_local char ebuf[512];
#define FAIL(st, ...) (snprintf(ebuf, sizeof ebuf, __VA_ARGS__), mg_cpu_fail((st), ebuf))

enum { WANT_EMBED = 1, WANT_HEAD = 2 };

/* Checks every step before anything runs, so a refused call changes no
 * session. */
static mg_status check_steps(mg_stack *s, const char *op, const mg_token_step *steps, int32_t n_steps, int mode,
                             int64_t *rows) {
    const mg_stack_config *c = mg_cpu_stack_config(s);
    if (n_steps <= 0 || n_steps > 65536) return FAIL(MG_ERR_INVALID_ARGUMENT, "%s: %d steps", op, n_steps);
    int64_t r = 0;
    for (int32_t i = 0; i < n_steps; i++) {
        const mg_token_step *t = &steps[i];
        if (!t->session || mg_cpu_session_stack(t->session) != s)
            return FAIL(MG_ERR_INVALID_ARGUMENT, "%s: step %d: session is NULL or belongs to another stack", op, i);
        if (t->n_tokens <= 0 || t->pos < 0)
            return FAIL(MG_ERR_INVALID_ARGUMENT, "%s: step %d: %d tokens at position %d", op, i, t->n_tokens, t->pos);
        int32_t *len, cap;
        mg_cpu_session_history(t->session, &len, &cap);
        if ((int64_t)t->pos + t->n_tokens + 1 > cap)
            return FAIL(MG_ERR_CAPACITY, "%s: step %d: positions %d..%d exceed the session's %d tokens", op, i, t->pos,
                        t->pos + t->n_tokens - 1, cap - 1);
        if (!t->tokens && (mode & WANT_EMBED))
            return FAIL(MG_ERR_INVALID_ARGUMENT, "%s: step %d: no tokens to embed", op, i);
        if (t->tokens) {
            for (int32_t j = 0; j < t->n_tokens; j++)
                if (t->tokens[j] < 0 || t->tokens[j] >= c->vocab)
                    return FAIL(MG_ERR_INVALID_ARGUMENT, "%s: step %d: token %d outside the vocabulary 0..%d", op, i,
                                t->tokens[j], c->vocab - 1);
            if ((mode & WANT_HEAD) && t->pos > *len)
                return FAIL(MG_ERR_INVALID_ARGUMENT, "%s: step %d: position %d beyond the history's %d tokens", op, i, t->pos,
                            *len);
        } else if ((int64_t)t->pos + t->n_tokens > *len) {
            return FAIL(MG_ERR_INVALID_ARGUMENT, "%s: step %d: no tokens given and the history holds %d, not %d", op, i, *len,
                        t->pos + t->n_tokens);
        }
        if (mode & WANT_HEAD) {
            if (!t->result) return FAIL(MG_ERR_INVALID_ARGUMENT, "%s: step %d: result is NULL", op, i);
            if (!mg_sample_params_ok(&t->sample))
                return FAIL(MG_ERR_INVALID_ARGUMENT, "%s: step %d: sampling parameters out of range", op, i);
            if (t->generated_from < 0) return FAIL(MG_ERR_INVALID_ARGUMENT, "%s: step %d: generated_from < 0", op, i);
        }
        for (int32_t j = 0; j < i; j++)
            if (steps[j].session == t->session)
                return FAIL(MG_ERR_INVALID_ARGUMENT, "%s: steps %d and %d use the same session", op, j, i);
        r += t->n_tokens;
    }
    if (r > (1 << 24)) return FAIL(MG_ERR_INVALID_ARGUMENT, "%s: %lld rows is too many", op, (long long)r);
    *rows = r;
    return MG_OK;
}

/* Whether every logit is finite or -Inf (a masked token): NaN or +Inf
 * means the model blew up, and no token is sampled from it. */
static int logits_finite(const float *lg, int32_t n) {
    for (int32_t i = 0; i < n; i++)
        if (isnan(lg[i]) || lg[i] > FLT_MAX) return 0;
    return 1;
}

/* The whole path: embed (mode & WANT_EMBED) or in, layers first..last
 * (none when last < first), then out (head) or logits + sampling (tail).
 * The rows stay in dtype throughout, as the separate calls hand them over
 * (bf16 rows are rounded at every hand-over, and take bf16 products where
 * the CPU has them), so each call computes what embed, forward and logits
 * in that dtype compute. */
static mg_status run(mg_stack *s, const char *op, const mg_token_step *steps, int32_t n_steps, int32_t first, int32_t last,
                     int mode, int32_t dtype, const void *in, void *out) {
    if (!s || !steps) return FAIL(MG_ERR_INVALID_ARGUMENT, "%s: NULL argument", op);
    const mg_stack_config *c = mg_cpu_stack_config(s);
    if ((mode & WANT_EMBED) && !c->has_embed) return FAIL(MG_ERR_INVALID_ARGUMENT, "%s: stack has no embeddings", op);
    if ((mode & WANT_HEAD) && !c->has_head) return FAIL(MG_ERR_INVALID_ARGUMENT, "%s: stack has no head", op);
    if (!(mode & WANT_EMBED) && !in) return FAIL(MG_ERR_INVALID_ARGUMENT, "%s: in is NULL", op);
    if (!(mode & WANT_HEAD) && !out) return FAIL(MG_ERR_INVALID_ARGUMENT, "%s: out is NULL", op);
    if (dtype != MG_F32 && dtype != MG_BF16)
        return FAIL(MG_ERR_INVALID_ARGUMENT, "%s: activation dtype %d must be f32 (0) or bf16 (2)", op, dtype);
    int64_t rows = 0;
    mg_status st = check_steps(s, op, steps, n_steps, mode, &rows);
    if (st) return st;
    const mg_api *api = mg_cpu_api();
    size_t H = (size_t)c->hidden, R = (size_t)rows, row = H * (dtype == MG_BF16 ? 2 : 4);
    char *x = malloc(R * row + R * sizeof(int32_t) + n_steps * sizeof(mg_step));
    if (!x) return FAIL(MG_ERR_OUT_OF_MEMORY, "%s: out of memory", op);
    int32_t *tok = (int32_t *)(x + R * row);
    mg_step *ms = (mg_step *)(tok + R);
    size_t r = 0;
    for (int32_t i = 0; i < n_steps; i++) {
        ms[i] = (mg_step){steps[i].session, steps[i].pos, steps[i].n_tokens};
        if (mode & WANT_EMBED) memcpy(tok + r, steps[i].tokens, sizeof(int32_t) * (size_t)steps[i].n_tokens);
        r += (size_t)steps[i].n_tokens;
    }
    if (mode & WANT_EMBED) {
        st = api->embed(s, tok, (int32_t)R, dtype, x);
    } else {
        memcpy(x, in, R * row);
    }
    if (!st && last >= first && mg_cpu_stack_held(s) > 0) st = api->forward(s, ms, n_steps, first, last, dtype, x, x);
    if (st) goto done;
    if (!(mode & WANT_HEAD)) {
        memcpy(out, x, R * row);
        goto done;
    }
    /* The head for up to HEAD_BATCH steps' last rows at once: its weights,
     * the largest matrix, are read once per batch rather than once per
     * step (a batch's rows get the bits each would get alone). */
    enum { HEAD_BATCH = 16 };
    const size_t V = (size_t)c->vocab, B = n_steps < HEAD_BATCH ? (size_t)n_steps : HEAD_BATCH;
    float *lg = malloc(sizeof(float) * V * B);
    char *last_rows = malloc(row * B);
    if (!lg || !last_rows) {
        free(lg), free(last_rows);
        st = FAIL(MG_ERR_OUT_OF_MEMORY, "%s: out of memory", op);
        goto done;
    }
    r = 0;
    for (int32_t i0 = 0; i0 < n_steps && !st; i0 += HEAD_BATCH) {
        const int32_t nb = n_steps - i0 < HEAD_BATCH ? n_steps - i0 : HEAD_BATCH;
        for (int32_t k = 0; k < nb; k++) {
            r += (size_t)steps[i0 + k].n_tokens;
            memcpy(last_rows + (size_t)k * row, x + (r - 1) * row, row);
        }
        st = api->logits(s, nb, dtype, last_rows, lg);
        for (int32_t k = 0; k < nb && !st; k++) {
            const int32_t i = i0 + k;
            const mg_token_step *t = &steps[i];
            float *l = lg + (size_t)k * V; /* sampling may rework it in place */
            if (t->logits) memcpy(t->logits, l, sizeof(float) * V);
            if (!logits_finite(l, c->vocab)) {
                st = FAIL(MG_ERR_NON_FINITE, "%s: step %d: the model's logits are not finite (NaN or +Inf); no token sampled", op, i);
                break;
            }
            int32_t *len, cap;
            int32_t *hist = mg_cpu_session_history(t->session, &len, &cap);
            if (t->tokens) memcpy(hist + t->pos, t->tokens, sizeof(int32_t) * (size_t)t->n_tokens);
            *len = t->pos + t->n_tokens;
            char err[256];
            st = mg_cpu_sample(l, c->vocab, &t->sample, hist, *len, t->generated_from, t->draw, t->result, err, sizeof err);
            if (st) {
                st = FAIL(st, "%s: step %d: %s", op, i, err);
                break;
            }
            hist[*len] = t->result->id;
            *len += 1;
        }
    }
    free(last_rows);
    free(lg);
done:
    free(x);
    return st;
}

mg_status mg_cpu_head_forward(mg_stack *s, const mg_token_step *steps, int32_t n_steps, int32_t last_layer, int32_t dtype,
                              void *out) {
    if (!s) return FAIL(MG_ERR_INVALID_ARGUMENT, "head_forward: stack is NULL");
    const mg_stack_config *c = mg_cpu_stack_config(s);
    if (mg_cpu_stack_held(s) > 0 && (last_layer < c->first_layer || last_layer > c->last_layer))
        return FAIL(MG_ERR_INVALID_ARGUMENT, "head_forward: last layer %d not within this stack's %d..%d", last_layer,
                    c->first_layer, c->last_layer);
    return run(s, "head_forward", steps, n_steps, c->first_layer, last_layer, WANT_EMBED, dtype, NULL, out);
}

mg_status mg_cpu_tail_forward(mg_stack *s, const mg_token_step *steps, int32_t n_steps, int32_t first_layer, int32_t dtype,
                              const void *in) {
    if (!s) return FAIL(MG_ERR_INVALID_ARGUMENT, "tail_forward: stack is NULL");
    const mg_stack_config *c = mg_cpu_stack_config(s);
    if (mg_cpu_stack_held(s) > 0 && (first_layer < c->first_layer || first_layer > c->last_layer + 1))
        return FAIL(MG_ERR_INVALID_ARGUMENT, "tail_forward: first layer %d not within this stack's %d..%d", first_layer,
                    c->first_layer, c->last_layer + 1);
    return run(s, "tail_forward", steps, n_steps, first_layer, c->last_layer, WANT_HEAD, dtype, in, NULL);
}

mg_status mg_cpu_decode(mg_stack *s, const mg_token_step *steps, int32_t n_steps) {
    if (!s) return FAIL(MG_ERR_INVALID_ARGUMENT, "decode: stack is NULL");
    const mg_stack_config *c = mg_cpu_stack_config(s);
    return run(s, "decode", steps, n_steps, c->first_layer, c->last_layer, WANT_EMBED | WANT_HEAD, MG_F32, NULL, NULL);
}

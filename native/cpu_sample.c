/*
 * cpu_sample.c: sample.Choose (Go, meshgpu/sample) in C, bit for bit: the
 * same float64 expNeg, the same 256 fixed chunks for every vocabulary sum,
 * the same candidate search and (probability desc, id asc) order, the same
 * counter-based draw. Compiled with -std=c11, so no multiply-add is fused.
 */
#include "cpu_sample.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SUM_CHUNKS 256

static void chunk_bounds(int32_t n, int c, int32_t *lo, int32_t *hi) {
    *lo = (int32_t)((int64_t)n * c / SUM_CHUNKS);
    *hi = (int32_t)((int64_t)n * (c + 1) / SUM_CHUNKS);
}

static const double ln2_hi = 6.93147180369123816490e-01, ln2_lo = 1.90821492927058770002e-10;

/* sample.expNeg: e^x for x <= 0 with explicit roundings. */
static double exp_neg(double x) {
    if (!(x >= -708)) return 0;
    if (x > 0) return exp(x);
    double k = floor(x * 1.44269504088896340735992468100189214 + 0.5);
    double r = x - k * ln2_hi;
    r = r - k * ln2_lo;
    double p = ((((r * (1.0 / 362880) + 1.0 / 40320) * r + 1.0 / 5040) * r + 1.0 / 720) * r + 1.0 / 120) * r + 1.0 / 24;
    p = (((p * r + 1.0 / 6) * r + 0.5) * r + 1) * r + 1;
    uint64_t bits = (uint64_t)((int64_t)k + 1023) << 52;
    double sc;
    memcpy(&sc, &bits, sizeof sc);
    return p * sc;
}

static uint64_t mix(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double uniform(uint64_t seed, int64_t step) {
    uint64_t x = mix(seed ^ 0x9E3779B97F4A7C15ull);
    x = mix(x ^ (uint64_t)step * 0xD1B54A32D192ED03ull);
    return (double)(x >> 11) / 9007199254740992.0;
}

/* First index of the largest logit; NaN never wins; 0 when all are NaN. */
static int32_t argmax_f(const float *x, int32_t n) {
    int32_t best = -1;
    for (int32_t i = 0; i < n; i++) {
        if (isnan(x[i])) continue;
        if (best < 0 || x[i] > x[best]) best = i;
    }
    return best < 0 ? 0 : best;
}

/* sum over e^(x - mx) of non-NaN x, in chunks */
static double sum_exp(const float *x, int32_t n, double mx) {
    double total = 0;
    for (int c = 0; c < SUM_CHUNKS; c++) {
        int32_t lo, hi;
        chunk_bounds(n, c, &lo, &hi);
        double s = 0;
        for (int32_t i = lo; i < hi; i++)
            if (!isnan(x[i])) s += exp_neg((double)x[i] - mx);
        total += s;
    }
    return total;
}

static double chunked_sum(const double *q, int32_t n, double *parts, double t, int thresholded) {
    double total = 0;
    for (int c = 0; c < SUM_CHUNKS; c++) {
        int32_t lo, hi;
        chunk_bounds(n, c, &lo, &hi);
        double s = 0;
        for (int32_t i = lo; i < hi; i++)
            if (!thresholded || (q[i] > 0 && q[i] >= t)) s += q[i];
        if (parts) parts[c] = s;
        total += s;
    }
    return total;
}

static const double *sort_probs;
static int by_prob(const void *a, const void *b) {
    int32_t ia = *(const int32_t *)a, ib = *(const int32_t *)b;
    double qa = sort_probs[ia], qb = sort_probs[ib];
    if (qa > qb) return -1;
    if (qa < qb) return 1;
    return ia < ib ? -1 : ia > ib;
}

int mg_sample_params_ok(const mg_sample_params *p) {
#define BAD(v) (isnan(v) || isinf(v))
    return p && !BAD(p->temperature) && p->temperature >= 0 && p->temperature <= 100 && p->top_k >= 0 && !BAD(p->top_p) &&
           p->top_p >= 0 && p->top_p <= 1 && !BAD(p->min_p) && p->min_p >= 0 && p->min_p <= 1 &&
           !BAD(p->repetition_penalty) && p->repetition_penalty >= 0 && p->repetition_penalty <= 100 &&
           !BAD(p->presence_penalty) && p->presence_penalty >= -2 && p->presence_penalty <= 2 &&
           !BAD(p->frequency_penalty) && p->frequency_penalty >= -2 && p->frequency_penalty <= 2 && p->top_logprobs >= 0 &&
           p->top_logprobs <= MG_MAX_TOP_LOGPROBS && (p->logprobs == 0 || p->logprobs == 1);
#undef BAD
}

/* sample.filter: zero what top-k, top-p and min-p remove. */
static int filter(double *q, int32_t n, const mg_sample_params *p) {
    int top_p = p->top_p > 0 && p->top_p < 1, top_k = p->top_k > 0 && p->top_k < n;
    if (top_k || top_p) {
        double mx = 0;
        for (int32_t i = 0; i < n; i++) mx = fmax(mx, q[i]);
        double all = chunked_sum(q, n, NULL, 0, 0);
        int32_t *order = malloc(sizeof(int32_t) * (size_t)n);
        if (!order) return -1;
        int32_t cnt = 0;
        for (double t = mx / 1024;; t /= 1024) {
            if (t < 1e-300) t = 0;
            cnt = 0;
            for (int32_t i = 0; i < n; i++)
                if (q[i] > 0 && q[i] >= t) order[cnt++] = i;
            if (t == 0 || (top_k && cnt >= p->top_k)) break;
            if (!top_k && chunked_sum(q, n, NULL, t, 1) >= p->top_p * all) break;
        }
        sort_probs = q;
        qsort(order, (size_t)cnt, sizeof(int32_t), by_prob);
        int32_t keep = cnt;
        if (top_k && p->top_k < keep) keep = p->top_k;
        if (top_p) {
            double total = 0;
            if (top_k)
                for (int32_t j = 0; j < keep; j++) total += q[order[j]];
            else
                total = all;
            double cum = 0;
            for (int32_t j = 0; j < keep; j++) {
                if (cum >= p->top_p * total) {
                    keep = j;
                    break;
                }
                cum += q[order[j]];
            }
        }
        /* mark kept with the sign bit of a copy-free pass: negate kept, zero the rest, restore */
        for (int32_t j = 0; j < keep; j++) q[order[j]] = -q[order[j]];
        for (int32_t i = 0; i < n; i++) q[i] = q[i] < 0 ? -q[i] : 0;
        free(order);
    }
    if (p->min_p > 0) {
        double mx = 0;
        for (int32_t i = 0; i < n; i++) mx = fmax(mx, q[i]);
        for (int32_t i = 0; i < n; i++)
            if (q[i] < p->min_p * mx) q[i] = 0;
    }
    return 0;
}

static int32_t draw(const double *q, int32_t n, const double *parts, double u) {
    int32_t last = -1;
    for (int c = 0; c < SUM_CHUNKS; c++) {
        int32_t lo, hi;
        chunk_bounds(n, c, &lo, &hi);
        if (!(u < parts[c])) {
            u -= parts[c];
            for (int32_t i = hi - 1; i >= lo; i--)
                if (q[i] > 0) {
                    last = i;
                    break;
                }
            continue;
        }
        for (int32_t i = lo; i < hi; i++) {
            if (q[i] == 0) continue;
            last = i;
            if (u < q[i]) return i;
            u -= q[i];
        }
        return last;
    }
    return last;
}

mg_status mg_cpu_sample(float *logits, int32_t n, const mg_sample_params *p, const int32_t *history, int32_t n_history,
                        int32_t generated_from, int64_t step, mg_sample_result *out, char *err, int errlen) {
    if (!logits || n <= 0 || !p || !out || n_history < 0 || (n_history > 0 && !history)) {
        snprintf(err, (size_t)errlen, "sample: bad arguments");
        return MG_ERR_INVALID_ARGUMENT;
    }
    if (!mg_sample_params_ok(p)) {
        snprintf(err, (size_t)errlen, "sample: parameters out of range");
        return MG_ERR_INVALID_ARGUMENT;
    }
    memset(out, 0, sizeof *out);
    int pen_gen = (p->presence_penalty != 0 || p->frequency_penalty != 0) && generated_from < n_history;
    if ((p->repetition_penalty != 0 && p->repetition_penalty != 1) || pen_gen) {
        int32_t *cnt = calloc((size_t)n, sizeof(int32_t));
        if (!cnt) {
            snprintf(err, (size_t)errlen, "sample: out of memory");
            return MG_ERR_OUT_OF_MEMORY;
        }
        if (p->repetition_penalty != 0 && p->repetition_penalty != 1) {
            float r = (float)p->repetition_penalty;
            for (int32_t j = 0; j < n_history; j++) {
                int32_t id = history[j];
                if (id < 0 || id >= n || cnt[id]) continue;
                cnt[id] = 1;
                float l = logits[id];
                logits[id] = l > 0 ? l / r : l * r;
            }
            memset(cnt, 0, (size_t)n * sizeof(int32_t));
        }
        if (pen_gen) {
            for (int32_t j = generated_from < 0 ? 0 : generated_from; j < n_history; j++)
                if (history[j] >= 0 && history[j] < n) cnt[history[j]]++;
            for (int32_t j = generated_from < 0 ? 0 : generated_from; j < n_history; j++) {
                int32_t id = history[j];
                if (id < 0 || id >= n || cnt[id] == 0) continue;
                logits[id] = (float)((double)logits[id] - p->frequency_penalty * (double)cnt[id] - p->presence_penalty);
                cnt[id] = 0; /* once per distinct id */
            }
        }
        free(cnt);
    }
    /* the model distribution's normalizer, for model_logprob and the top */
    int want_lp = p->logprobs || p->top_logprobs > 0;
    double lse = 0;
    if (want_lp) {
        double mx = (double)logits[argmax_f(logits, n)];
        lse = mx + log(sum_exp(logits, n, mx));
        if (isnan(lse) || isinf(lse)) want_lp = 0;
    }
    if (p->top_logprobs > 0) {
        if (want_lp) {
            int32_t k = p->top_logprobs < n ? p->top_logprobs : n, m = 0;
            int32_t *top = out->top_ids;
            for (int32_t i = 0; i < n; i++) {
                float v = logits[i];
                if (isnan(v)) continue;
                int32_t pos = m;
                while (pos > 0 && logits[top[pos - 1]] < v) pos--;
                if (pos >= k) continue;
                int32_t end = m < k ? m : k - 1;
                for (int32_t j = end; j > pos; j--) top[j] = top[j - 1];
                top[pos] = i;
                if (m < k) m++;
            }
            out->n_top = m;
            for (int32_t j = 0; j < m; j++) out->top_logprobs[j] = (float)((double)logits[top[j]] - lse);
        }
    }
    if (p->temperature == 0) {
        int32_t best = argmax_f(logits, n);
        double mx = (double)logits[best];
        double lp = (double)logits[best] - mx - log(sum_exp(logits, n, mx));
        if (isnan(lp) || isinf(lp)) lp = 0;
        out->id = best;
        out->logprob = (float)lp;
        if (want_lp) out->model_logprob = (float)((double)logits[best] - lse);
        return MG_OK;
    }
    double inv = 1 / p->temperature;
    int32_t amax = argmax_f(logits, n);
    double mx = (double)logits[amax] * inv;
    double *q = malloc(sizeof(double) * (size_t)n);
    if (!q) {
        snprintf(err, (size_t)errlen, "sample: out of memory");
        return MG_ERR_OUT_OF_MEMORY;
    }
    for (int32_t i = 0; i < n; i++) q[i] = isnan(logits[i]) ? 0 : exp_neg((double)logits[i] * inv - mx);
    if (filter(q, n, p) != 0) {
        free(q);
        snprintf(err, (size_t)errlen, "sample: out of memory");
        return MG_ERR_OUT_OF_MEMORY;
    }
    double parts[SUM_CHUNKS];
    double total = chunked_sum(q, n, parts, 0, 0);
    if (!(total > 0)) {
        out->id = amax;
        out->logprob = 0;
    } else {
        int32_t i = draw(q, n, parts, uniform(p->seed, step) * total);
        out->id = i;
        out->logprob = (float)log(q[i] / total);
    }
    if (want_lp) out->model_logprob = (float)((double)logits[out->id] - lse);
    free(q);
    return MG_OK;
}

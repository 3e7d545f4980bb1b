// backend_ends.cu: the mesh's ends in one call each (meshgpu.h ABI 3).
// head_forward embeds on the device and runs its layers, the rows crossing
// to the host once, at the end (the hop buffer); tail_forward and decode
// keep every step's last row on the device for the final norm, the LM head
// and the sampler (sample.cu), so only a small result struct per step
// crosses, in one copy and one wait per call (plus the logits a client
// asks for). The token history lives in each session's device memory.
#include <cstring>
#include <vector>

#include "backend_impl.h"

namespace mgcuda {

namespace {

enum { kWantEmbed = 1, kWantHead = 2 };

// Checks every step before anything runs (a refused call changes nothing)
// and builds forward's steps.
mg_status check_token_steps(mg_stack *s, const char *op, const mg_token_step *steps, int32_t n_steps, int mode,
                            std::vector<mg_step> &ms) {
    const mg_stack_config &c = s->cfg;
    if (!steps || n_steps <= 0 || n_steps > 65536) return failf(MG_ERR_INVALID_ARGUMENT, "%s: %d steps", op, n_steps);
    long long rows = 0;
    for (int i = 0; i < n_steps; i++) {
        const mg_token_step &t = steps[i];
        if (!t.session || t.session->s != s)
            return failf(MG_ERR_INVALID_ARGUMENT, "%s: step %d: session is NULL or from another stack", op, i);
        if (t.n_tokens <= 0 || t.pos < 0)
            return failf(MG_ERR_INVALID_ARGUMENT, "%s: step %d: %d tokens at position %d", op, i, t.n_tokens, t.pos);
        if ((long long)t.pos + t.n_tokens > t.session->max_tokens)
            return failf(MG_ERR_CAPACITY, "%s: step %d: positions %d..%lld exceed the session's %d tokens", op, i, t.pos,
                         (long long)t.pos + t.n_tokens - 1, t.session->max_tokens);
        if (!t.tokens && (mode & kWantEmbed)) return failf(MG_ERR_INVALID_ARGUMENT, "%s: step %d: no tokens to embed", op, i);
        if (t.tokens) {
            for (int j = 0; j < t.n_tokens; j++)
                if (t.tokens[j] < 0 || t.tokens[j] >= c.vocab)
                    return failf(MG_ERR_INVALID_ARGUMENT, "%s: step %d: token %d outside the vocabulary 0..%d", op, i,
                                 t.tokens[j], c.vocab - 1);
            if ((mode & kWantHead) && t.pos > t.session->hist_len)
                return failf(MG_ERR_INVALID_ARGUMENT, "%s: step %d: position %d beyond the history's %d tokens", op, i,
                             t.pos, t.session->hist_len);
        } else if ((long long)t.pos + t.n_tokens > t.session->hist_len) {
            return failf(MG_ERR_INVALID_ARGUMENT, "%s: step %d: no tokens given and the history holds %d, not %d", op, i,
                         t.session->hist_len, t.pos + t.n_tokens);
        }
        if (mode & kWantHead) {
            if (!t.result) return failf(MG_ERR_INVALID_ARGUMENT, "%s: step %d: result is NULL", op, i);
            if (!sample_params_ok(t.sample))
                return failf(MG_ERR_INVALID_ARGUMENT, "%s: step %d: sampling parameters out of range", op, i);
            if (t.generated_from < 0 || t.draw < 0)
                return failf(MG_ERR_INVALID_ARGUMENT, "%s: step %d: generated_from or draw < 0", op, i);
        }
        for (int j = 0; j < i; j++)
            if (steps[j].session == t.session)
                return failf(MG_ERR_INVALID_ARGUMENT, "%s: steps %d and %d use the same session", op, j, i);
        rows += t.n_tokens;
        if (rows > (1 << 24)) return failf(MG_ERR_INVALID_ARGUMENT, "%s: too many rows", op);
    }
    try { // an exception must not cross the C ABI
        ms.resize(n_steps);
    } catch (const std::bad_alloc &) {
        return failf(MG_ERR_OUT_OF_MEMORY, "%s: out of host memory", op);
    }
    for (int i = 0; i < n_steps; i++) ms[i] = mg_step{steps[i].session, steps[i].pos, steps[i].n_tokens};
    return MG_OK;
}

mg_status run_ends(mg_stack *s, const char *op, const mg_token_step *steps, int32_t n_steps, int32_t first, int32_t last,
                   int mode, int32_t dtype, const void *in, void *out) {
    const uint64_t t_enter = host_now_ns();
    if (!s) return failf(MG_ERR_INVALID_ARGUMENT, "%s: stack is NULL", op);
    std::lock_guard<std::mutex> lock(s->mu);
    const mg_stack_config &c = s->cfg;
    if (!s->ready) return failf(MG_ERR_INVALID_ARGUMENT, "%s: stack is not ready", op);
    if ((mode & kWantEmbed) && !c.has_embed) return failf(MG_ERR_INVALID_ARGUMENT, "%s: this stack holds no embedding", op);
    if ((mode & kWantHead) && !c.has_head) return failf(MG_ERR_INVALID_ARGUMENT, "%s: this stack holds no LM head", op);
    if (!(mode & kWantEmbed) && !in) return failf(MG_ERR_INVALID_ARGUMENT, "%s: in is NULL", op);
    if (!(mode & kWantHead) && !out) return failf(MG_ERR_INVALID_ARGUMENT, "%s: out is NULL", op);
    if (dtype != MG_F32 && dtype != MG_BF16) return failf(MG_ERR_INVALID_ARGUMENT, "%s: dtype must be f32 or bf16", op);
    if (s->n_local > 0 && (first < c.first_layer || last > c.last_layer || first > last + 1))
        return failf(MG_ERR_INVALID_ARGUMENT, "%s: layers %d..%d outside this stack's %d..%d", op, first, last,
                     c.first_layer, c.last_layer);
    const int l0 = first - c.first_layer, l1 = last - c.first_layer;
    std::vector<mg_step> ms;
    mg_status r = check_token_steps(s, op, steps, n_steps, mode, ms);
    if (r == MG_OK && s->n_local > 0 && l0 <= l1) r = check_steps(s, op, ms.data(), n_steps, l0, l1);
    if (r != MG_OK) return r;

    // Every token id of the call, staged in pinned memory: forward's embed
    // and the history copies read them from there.
    size_t ntok = 0;
    for (int i = 0; i < n_steps; i++)
        if (steps[i].tokens) ntok += (size_t)steps[i].n_tokens;
    if (ntok > s->tok_cap) {
        if (s->tok_h) cudaFreeHost(s->tok_h);
        s->tok_h = nullptr;
        s->tok_cap = 0;
        const size_t cap = ntok < 1024 ? 1024 : ntok;
        cudaError_t e = cudaHostAlloc((void **)&s->tok_h, cap * sizeof(int32_t), cudaHostAllocPortable);
        if (e != cudaSuccess) {
            s->tok_h = nullptr;
            return cuda_fail(e, "pinned token staging");
        }
        s->tok_cap = cap;
    }
    std::vector<const int32_t *> staged;
    try {
        staged.assign(n_steps, nullptr);
    } catch (const std::bad_alloc &) {
        return failf(MG_ERR_OUT_OF_MEMORY, "%s: out of host memory", op);
    }
    {
        size_t at = 0;
        for (int i = 0; i < n_steps; i++)
            if (steps[i].tokens) {
                staged[i] = s->tok_h + at;
                memcpy(s->tok_h + at, steps[i].tokens, (size_t)steps[i].n_tokens * sizeof(int32_t));
                at += (size_t)steps[i].n_tokens;
            }
    }
    FwdIo io;
    // embedding needs every step's tokens: then they are contiguous in tok_h
    io.tokens = (mode & kWantEmbed) ? s->tok_h : nullptr;
    io.dtype = dtype;
    io.in = in;
    io.out = out;
    const bf16 *rows = nullptr;
    bool head_done = false; // the decode graph ran the head (fused_decode)
    if (mode & kWantHead) {
        io.last = &rows;
        io.head_done = &head_done;
    }
    r = forward_locked(s, ms.data(), n_steps, s->n_local > 0 ? l0 : 0, s->n_local > 0 ? l1 : -1, io);
    if (r != MG_OK || !(mode & kWantHead)) return r;

    // Final norm, LM head and sampler, kLogitRows steps at a time.
    cudaStream_t st = s->st;
    uint64_t busy_ns = 0;
    for (int c0 = 0; c0 < n_steps; c0 += kLogitRows) {
        const int m = n_steps - c0 < kLogitRows ? n_steps - c0 : kLogitRows;
        if (!head_done) {
            r = head_logits(s, rows + (size_t)c0 * c.hidden, m);
            if (r != MG_OK) return r;
        }
        // before the sampler, which penalizes the rows in place
        CU(non_finite_rows(s->logits, m, c.vocab, s->bad_d, st), "non-finite check");
        for (int j = 0; j < m; j++) {
            const mg_token_step &t = steps[c0 + j];
            mg_session *ss = t.session;
            float *row = s->logits + (size_t)j * c.vocab;
            if (staged[c0 + j])
                CU(cudaMemcpyAsync(ss->hist + t.pos, staged[c0 + j], (size_t)t.n_tokens * 4, cudaMemcpyHostToDevice, st),
                   "history");
            if (t.logits) CU(cudaMemcpyAsync(t.logits, row, (size_t)c.vocab * 4, cudaMemcpyDeviceToHost, st), "logits copy");
            const int n_hist = t.pos + t.n_tokens;
            CU(sample_row(row, c.vocab, t.sample, ss->hist, n_hist, t.generated_from, t.draw, ss->hist + n_hist, s->samp,
                          s->res_d + j, st),
               "sample");
        }
        CU(cudaMemcpyAsync(s->res_h, s->res_d, (size_t)m * sizeof(mg_sample_result), cudaMemcpyDeviceToHost, st), "results");
        CU(cudaMemcpyAsync(s->bad_h, s->bad_d, (size_t)m * sizeof(int32_t), cudaMemcpyDeviceToHost, st), "non-finite flags");
        const uint64_t t_enq = host_now_ns();
        CU(cudaStreamSynchronize(st), op);
        busy_ns += host_now_ns() - t_enq;
        for (int j = 0; j < m; j++) {
            const mg_token_step &t = steps[c0 + j];
            *t.result = s->res_h[j];
            t.session->hist_len = t.pos + t.n_tokens + 1;
        }
        for (int j = 0; j < m; j++)
            if (s->bad_h[j])
                return failf(MG_ERR_NON_FINITE, "%s: step %d: the model's logits are not finite (NaN or +Inf); no token sampled",
                             op, c0 + j);
    }
    // host time: the whole call less the waits for the device
    note_hop_host_ns(host_now_ns() - t_enter - busy_ns);
    return MG_OK;
}

} // namespace

mg_status head_logits(mg_stack *s, const bf16 *x, int m) {
    const mg_stack_config &c = s->cfg;
    cudaStream_t st = s->st;
    const Kernel hk = choose_kernel(Op::NormMatmul, m, 0, s->ks);
    if (s->qhead.data) return qhead_logits(s, x, m);
    if (hk == Kernel::GemvNorm) {
        CU(gemv_norm(kF32, s->lm_head, x, s->final_norm, c.rms_eps, m, c.vocab, c.hidden, nullptr, nullptr, s->logits, st),
           "final norm + lm head");
    } else if (hk == Kernel::GemvMma) {
        CU(rmsnorm(x, s->final_norm, c.rms_eps, m, c.hidden, s->h, st), "final norm");
        CU(gemv_mma(kF32, s->lm_head, s->h, m, c.vocab, c.hidden, nullptr, nullptr, s->logits, st), "lm head");
    } else {
        CU(rmsnorm(x, s->final_norm, c.rms_eps, m, c.hidden, s->h, st), "final norm");
        BLAS(gemm(s->blas, s->lm_head, s->h, m, c.vocab, c.hidden, s->logits, true, 0.f), "lm head");
        CU(round_to_bf16(s->logits, (size_t)m * c.vocab, st), "logits");
    }
    return MG_OK;
}

mg_status api_head_forward(mg_stack *s, const mg_token_step *steps, int32_t n_steps, int32_t last_layer, int32_t dtype,
                           void *out) {
    if (!s) return failf(MG_ERR_INVALID_ARGUMENT, "head_forward: stack is NULL");
    return run_ends(s, "head_forward", steps, n_steps, s->cfg.first_layer, s->n_local > 0 ? last_layer : s->cfg.first_layer - 1,
                    kWantEmbed, dtype, nullptr, out);
}

mg_status api_tail_forward(mg_stack *s, const mg_token_step *steps, int32_t n_steps, int32_t first_layer, int32_t dtype,
                           const void *in) {
    if (!s) return failf(MG_ERR_INVALID_ARGUMENT, "tail_forward: stack is NULL");
    return run_ends(s, "tail_forward", steps, n_steps, first_layer, s->cfg.last_layer, kWantHead, dtype, in, nullptr);
}

mg_status api_decode(mg_stack *s, const mg_token_step *steps, int32_t n_steps) {
    if (!s) return failf(MG_ERR_INVALID_ARGUMENT, "decode: stack is NULL");
    return run_ends(s, "decode", steps, n_steps, s->cfg.first_layer, s->cfg.last_layer, kWantEmbed | kWantHead, MG_BF16,
                    nullptr, nullptr);
}

} // namespace mgcuda

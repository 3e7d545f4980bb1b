// backend_forward.cu: the CUDA backend's embed, forward and logits. forward()
// runs rows in chunks of at most kChunkRows through the requested layers
// (packing the steps' rows into chunks; a long step spans several chunks,
// run in order); batches of single-token steps go through a captured graph
// (backend_graphs.cu). Each op's kernel is choose_kernel's (dispatch.h).
#include <chrono>
#include <cstdio>
#include <vector>

#include "backend_impl.h"

namespace mgcuda {

namespace {

thread_local uint64_t g_fwd_host_ns;

uint64_t now_ns() {
    return (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

mg_status blas_gemm(mg_stack *s, const bf16 *W, const bf16 *X, int n, int m, int k, void *Y, bool f32,
                    float beta) {
    BLAS(gemm(s->blas, W, X, n, m, k, Y, f32, beta), "gemm");
    return MG_OK;
}

// The longest key count of the pieces (their last position + 1).
int max_pos_plus_one(const std::vector<Piece> &pieces) {
    int m = 0;
    for (const Piece &p : pieces) m = p.pos + p.n > m ? p.pos + p.n : m;
    return m;
}

// Runs local layer li over rows rows held in s->x. Decode rows read their
// metadata from s->meta_d; prefill pieces pass their cache pointers here.
// max_len bounds every decode row's key count (the attention grid).
mg_status run_layer(mg_stack *s, int li, int rows, const std::vector<Piece> &pieces, int max_len) {
    const mg_stack_config &c = s->cfg;
    const Layer &L = s->layers[li];
    const int H = c.n_heads, KVH = c.n_kv_heads, hd = c.head_dim, D = c.hidden, I = c.intermediate;
    const Kernel mk = choose_kernel(Op::Matmul, rows, 0, s->ks);
    const bool small = mk == Kernel::Gemv || mk == Kernel::GemvMma;
    // the matrix-vector launcher choose_kernel picked (tensor-core tiles or FMA)
    auto mv = [mk](int epi, const bf16 *W, const bf16 *x, int n, int m, int k, const bf16 *bias, bf16 *out,
                   cudaStream_t st) {
        return mk == Kernel::GemvMma ? gemv_mma(epi, W, x, n, m, k, bias, out, nullptr, st)
                                     : gemv(epi, W, x, n, m, k, bias, out, nullptr, st);
    };
    // the RMSNorms fold into the matrix-vector kernel that follows them
    const bool fold = choose_kernel(Op::NormMatmul, rows, 0, s->ks) == Kernel::GemvNorm;
    cudaStream_t st = s->st;
    // block-quantized layers: int8 activation blocks for decode rows,
    // dequantized chunks + cuBLAS for prefill (backend_quant.cu)
    const bool qdec = L.quant && choose_kernel(Op::QuantMatmul, rows, 0, s->ks) == Kernel::GemvQuant;
    const QMat *qkv_m[3] = {&L.qm[MG_WQ], &L.qm[MG_WK], &L.qm[MG_WV]};
    const QMat *o_m = &L.qm[MG_WO], *down_m = &L.qm[MG_W_DOWN];
    const QMat *gu_m[2] = {&L.qm[MG_W_GATE], &L.qm[MG_W_UP]};

    if (qdec) {
        mg_status r = qmv(s, kStore, qkv_m, 3, nullptr, s->x, L.attn_norm, rows, L.bqkv, s->qkv, nullptr, s->qkv_dim);
        if (r != MG_OK) return r;
    } else if (L.quant) {
        CU(rmsnorm(s->x, L.attn_norm, c.rms_eps, rows, D, s->h, st), "rmsnorm");
        if (L.bqkv) CU(fill_rows(L.bqkv, rows, s->qkv_dim, s->qkv, st), "qkv bias");
        mg_status r = qmm(s, qkv_m, 3, s->h, rows, s->qkv, s->qkv_dim, false, L.bqkv ? 1.f : 0.f);
        if (r != MG_OK) return r;
    } else if (fold) {
        CU(gemv_norm(kStore, L.wqkv, s->x, L.attn_norm, c.rms_eps, rows, s->qkv_dim, D, L.bqkv, s->qkv, nullptr, st),
           "norm + qkv gemv");
    } else if (small) {
        CU(rmsnorm(s->x, L.attn_norm, c.rms_eps, rows, D, s->h, st), "rmsnorm");
        CU(mv(kStore, L.wqkv, s->h, rows, s->qkv_dim, D, L.bqkv, s->qkv, st), "qkv gemv");
    } else {
        CU(rmsnorm(s->x, L.attn_norm, c.rms_eps, rows, D, s->h, st), "rmsnorm");
        if (L.bqkv) CU(fill_rows(L.bqkv, rows, s->qkv_dim, s->qkv, st), "qkv bias");
        mg_status r = blas_gemm(s, L.wqkv, s->h, rows, s->qkv_dim, D, s->qkv, false, L.bqkv ? 1.f : 0.f);
        if (r != MG_OK) return r;
    }
    // Single-token steps under fused_decode: the RoPE and the append run
    // inside decode attention (attention_fused.cu), 16 rows a launch.
    bool fused = !pieces.empty();
    for (const Piece &p : pieces)
        fused = fused && !p.mask && choose_kernel(Op::Attention, p.n, 0, s->ks) == Kernel::AttnDecodeRope;
    if (fused) {
        for (int r0 = 0; r0 < rows; r0 += kGemvMaxRows) {
            const int nr = rows - r0 < kGemvMaxRows ? rows - r0 : kGemvMaxRows;
            CU(attn_decode_rope(s->qkv + (size_t)r0 * s->qkv_dim, s->qkv_dim, s->meta_d + r0, nr, li, H, KVH, hd,
                                max_len > 0 ? max_len : max_pos_plus_one(pieces), s->rope_cs, s->attn,
                                s->att + (size_t)r0 * s->q_dim, st),
               "decode attention (rope + append inside)");
        }
    } else {
        CU(rope_append(s->qkv, rows, H, KVH, hd, s->rope_cs, s->meta_d, li, st), "rope");
    }

    // Attention: runs of decode rows (steps with few tokens) go to the
    // split-sequence kernel in groups of <= 16 rows; long steps to prefill.
    int run_start = -1, run_max = 0;
    auto flush = [&](int end) -> mg_status {
        for (int r0 = run_start; r0 < end; r0 += kGemvMaxRows) {
            const int nr = end - r0 < kGemvMaxRows ? end - r0 : kGemvMaxRows;
            CU(attn_decode(s->qkv + (size_t)r0 * s->qkv_dim, s->qkv_dim, s->meta_d + r0, nr, li, H, KVH, hd,
                           max_len > 0 ? max_len : run_max, s->attn, s->att + (size_t)r0 * s->q_dim, st),
               "decode attention");
        }
        run_start = -1;
        run_max = 0;
        return MG_OK;
    };
    for (const Piece &p : pieces) {
        if (fused) break;
        if (p.mask) { // a token tree: its rows see the cache and their ancestors (backend_tree.cu)
            if (run_start >= 0) {
                mg_status r = flush(p.row);
                if (r != MG_OK) return r;
            }
            const size_t off = (size_t)li * p.sess->layer_stride;
            CU(attn_tree(s->qkv + (size_t)p.row * s->qkv_dim, s->qkv_dim, p.n, p.pos, p.mask, p.sess->k + off,
                         p.sess->v + off, H, KVH, hd, s->att + (size_t)p.row * s->q_dim, st),
               "tree attention");
            continue;
        }
        const size_t need = attn_prefill_gemm_bytes(p.n, p.pos, H, KVH, hd);
        const Kernel kernel = choose_kernel(Op::Attention, p.n, need, s->ks);
        // a single token beside longer steps: rope_append ran for every row
        if (kernel == Kernel::AttnDecode || kernel == Kernel::AttnDecodeRope) {
            if (run_start < 0) run_start = p.row;
            if (p.pos + p.n > run_max) run_max = p.pos + p.n;
            continue;
        }
        if (run_start >= 0) {
            mg_status r = flush(p.row);
            if (r != MG_OK) return r;
        }
        const size_t off = (size_t)li * p.sess->layer_stride;
        const bf16 *q = s->qkv + (size_t)p.row * s->qkv_dim;
        bf16 *o = s->att + (size_t)p.row * s->q_dim;
        if (kernel == Kernel::AttnPrefillGemm) {
            if (need > s->pf_cap) {
                CU(cudaStreamSynchronize(st), "prefill scratch");
                cudaFree(s->pf_buf);
                s->pf_buf = nullptr;
                s->pf_cap = 0;
                mg_status r = dalloc(&s->pf_buf, need, "prefill attention scratch");
                if (r != MG_OK) return r;
                s->pf_cap = need;
            }
            cublasStatus_t bs;
            CU(attn_prefill_gemm(s->blas, q, s->qkv_dim, p.n, p.pos, p.sess->k + off, p.sess->v + off, H, KVH, hd,
                                 s->pf_buf, o, st, &bs),
               "prefill attention (cublas)");
            if (bs != CUBLAS_STATUS_SUCCESS) return failf(MG_ERR_BACKEND, "cublas: prefill attention: status %d", (int)bs);
        } else {
            CU(attn_prefill(q, s->qkv_dim, p.n, p.pos, p.sess->k + off, p.sess->v + off, H, KVH, hd,
                            s->attn.f32_softmax, o, st),
               "prefill attention");
        }
    }
    if (run_start >= 0) {
        mg_status r = flush(rows);
        if (r != MG_OK) return r;
    }

    if (qdec) {
        mg_status r = qmv(s, kResidual, &o_m, 1, nullptr, s->att, nullptr, rows, nullptr, s->x, nullptr, D);
        if (r != MG_OK) return r;
    } else if (L.quant) {
        mg_status r = qmm(s, &o_m, 1, s->att, rows, s->h, D, false, 0.f);
        if (r != MG_OK) return r;
        CU(add_inplace(s->x, s->h, (size_t)rows * D, st), "residual add");
    } else if (small) {
        CU(mv(kResidual, L.wo, s->att, rows, D, s->q_dim, nullptr, s->x, st), "o gemv");
    } else {
        // HF rounds the projection to bf16 before the residual add: h is free.
        mg_status r = blas_gemm(s, L.wo, s->att, rows, D, s->q_dim, s->h, false, 0.f);
        if (r != MG_OK) return r;
        CU(add_inplace(s->x, s->h, (size_t)rows * D, st), "residual add");
    }
    if (qdec) {
        mg_status r;
        if (gu_m[0]->dtype == gu_m[1]->dtype) { // gate and up rows in one launch, SwiGLU in its epilogue
            r = qmv(s, kSwiGLU, gu_m, 1, gu_m[1], s->x, L.mlp_norm, rows, nullptr, s->act, nullptr, I);
        } else {
            r = qmv(s, kStore, gu_m, 2, nullptr, s->x, L.mlp_norm, rows, nullptr, s->gu, nullptr, 2 * I);
            if (r == MG_OK) CU(swiglu(s->gu, rows, I, s->act, st), "swiglu");
        }
        if (r == MG_OK) r = qmv(s, kResidual, &down_m, 1, nullptr, s->act, nullptr, rows, nullptr, s->x, nullptr, D);
        if (r != MG_OK) return r;
    } else if (L.quant) {
        CU(rmsnorm(s->x, L.mlp_norm, c.rms_eps, rows, D, s->h, st), "rmsnorm");
        mg_status r = qmm(s, gu_m, 2, s->h, rows, s->gu, 2 * I, false, 0.f);
        if (r != MG_OK) return r;
        CU(swiglu(s->gu, rows, I, s->act, st), "swiglu");
        r = qmm(s, &down_m, 1, s->act, rows, s->h, D, false, 0.f);
        if (r != MG_OK) return r;
        CU(add_inplace(s->x, s->h, (size_t)rows * D, st), "residual add");
    } else if (fold) {
        CU(gemv_norm(kSwiGLU, L.wgu, s->x, L.mlp_norm, c.rms_eps, rows, I, D, nullptr, s->act, nullptr, st),
           "norm + gate/up gemv");
        CU(gemv(kResidual, L.wdown, s->act, rows, D, I, nullptr, s->x, nullptr, st), "down gemv");
    } else if (small) {
        CU(rmsnorm(s->x, L.mlp_norm, c.rms_eps, rows, D, s->h, st), "rmsnorm");
        CU(mv(kSwiGLU, L.wgu, s->h, rows, I, D, nullptr, s->act, st), "gate/up gemv");
        CU(mv(kResidual, L.wdown, s->act, rows, D, I, nullptr, s->x, st), "down gemv");
    } else {
        CU(rmsnorm(s->x, L.mlp_norm, c.rms_eps, rows, D, s->h, st), "rmsnorm");
        mg_status r = blas_gemm(s, L.wgu, s->h, rows, 2 * I, D, s->gu, false, 0.f);
        if (r != MG_OK) return r;
        CU(swiglu(s->gu, rows, I, s->act, st), "swiglu");
        r = blas_gemm(s, L.wdown, s->act, rows, D, I, s->h, false, 0.f);
        if (r != MG_OK) return r;
        CU(add_inplace(s->x, s->h, (size_t)rows * D, st), "residual add");
    }
    return MG_OK;
}

// Host -> s->x (bf16) for rows rows of dtype.
mg_status load_rows(mg_stack *s, int32_t dtype, const void *in, int rows) {
    const size_t n = (size_t)rows * s->cfg.hidden;
    if (dtype == MG_BF16) {
        CU(cudaMemcpyAsync(s->x, in, n * 2, cudaMemcpyHostToDevice, s->st), "input copy");
    } else {
        CU(cudaMemcpyAsync(s->io_f32, in, n * 4, cudaMemcpyHostToDevice, s->st), "input copy");
        CU(f32_to_bf16(s->io_f32, n, s->x, s->st), "input convert");
    }
    return MG_OK;
}

mg_status store_rows(mg_stack *s, int32_t dtype, const bf16 *src, void *out, int rows) {
    const size_t n = (size_t)rows * s->cfg.hidden;
    if (dtype == MG_BF16) {
        CU(cudaMemcpyAsync(out, src, n * 2, cudaMemcpyDeviceToHost, s->st), "output copy");
    } else {
        CU(bf16_to_f32(src, n, s->io_f32, s->st), "output convert");
        CU(cudaMemcpyAsync(out, s->io_f32, n * 4, cudaMemcpyDeviceToHost, s->st), "output copy");
    }
    return MG_OK;
}

// fill_meta: each row's RoPE position and cache slot for rope_append. A
// tree row i runs at pos + depth(i) but takes slot pos + i: its cache
// pointers are shifted by i - depth(i) slots (rope_append writes at the
// position it rotates at); attention reads the cache unshifted.
void fill_meta(mg_stack *s, const std::vector<Piece> &pieces) {
    std::vector<int> depth;
    for (const Piece &p : pieces) {
        if (p.parents) {
            depth.assign(p.n, 0);
            for (int i = 0; i < p.n; i++) depth[i] = p.parents[i] < 0 ? 0 : depth[p.parents[i]] + 1;
        }
        for (int i = 0; i < p.n; i++) {
            mg_row_meta &m = s->meta_h[p.row + i];
            const int d = p.parents ? depth[i] : i;
            const size_t shift = (size_t)(i - d) * s->kv_dim;
            m.k = p.sess->k + shift;
            m.v = p.sess->v + shift;
            m.layer_stride = p.sess->layer_stride;
            m.pos = p.pos + d;
            m.pad = 0;
        }
    }
}

} // namespace

uint64_t host_now_ns() { return now_ns(); }
void note_hop_host_ns(uint64_t ns) { g_fwd_host_ns = ns; }

mg_status run_layers(mg_stack *s, int l0, int l1, int rows, const std::vector<Piece> &pieces, int max_len) {
    for (int li = l0; li <= l1; li++) {
        mg_status r = run_layer(s, li, rows, pieces, max_len);
        if (r != MG_OK) return r;
    }
    return MG_OK;
}

mg_status api_embed(mg_stack *s, const int32_t *tokens, int32_t n, int32_t dtype, void *out) {
    if (!s) return failf(MG_ERR_INVALID_ARGUMENT, "embed: stack is NULL");
    std::lock_guard<std::mutex> lock(s->mu);
    if (!s->ready) return failf(MG_ERR_INVALID_ARGUMENT, "embed: stack is not ready");
    if (!s->cfg.has_embed) return failf(MG_ERR_INVALID_ARGUMENT, "embed: this stack holds no embedding");
    if (n <= 0 || !tokens || !out) return failf(MG_ERR_INVALID_ARGUMENT, "embed: need n > 0 tokens and an output");
    if (dtype != MG_F32 && dtype != MG_BF16) return failf(MG_ERR_INVALID_ARGUMENT, "embed: dtype must be f32 or bf16");
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= s->cfg.vocab)
            return failf(MG_ERR_INVALID_ARGUMENT, "embed: token %d at %d outside vocab 0..%d", tokens[i], i,
                         s->cfg.vocab - 1);
    CU(cudaSetDevice(s->b->device), "set device");
    const size_t row_bytes = (size_t)s->cfg.hidden * (dtype == MG_F32 ? 4 : 2);
    for (int r0 = 0; r0 < n; r0 += kChunkRows) {
        const int m = n - r0 < kChunkRows ? n - r0 : kChunkRows;
        CU(cudaMemcpyAsync(s->tok_d, tokens + r0, m * sizeof(int32_t), cudaMemcpyHostToDevice, s->st), "tokens");
        CU(embed_rows(s, s->tok_d, m, s->x), "embed");
        mg_status r = store_rows(s, dtype, s->x, (char *)out + r0 * row_bytes, m);
        if (r != MG_OK) return r;
        CU(cudaStreamSynchronize(s->st), "embed");
    }
    return MG_OK;
}

mg_status check_steps(mg_stack *s, const char *op, const mg_step *steps, int32_t n_steps, int l0, int l1) {
    const mg_stack_config &c = s->cfg;
    long long total = 0;
    for (int i = 0; i < n_steps; i++) {
        const mg_step &st = steps[i];
        if (!st.session || st.session->s != s)
            return failf(MG_ERR_INVALID_ARGUMENT, "%s: step %d: session is NULL or from another stack", op, i);
        for (int j = 0; j < i; j++)
            if (steps[j].session == st.session)
                return failf(MG_ERR_INVALID_ARGUMENT, "%s: steps %d and %d name the same session", op, j, i);
        if (st.n_tokens <= 0) return failf(MG_ERR_INVALID_ARGUMENT, "%s: step %d: n_tokens %d", op, i, st.n_tokens);
        if (st.pos < 0) return failf(MG_ERR_INVALID_ARGUMENT, "%s: step %d: negative position %d", op, i, st.pos);
        const int32_t slen = st.session->len();
        for (int l = l0; l <= l1; l++) {
            const int32_t have = st.session->layer_len[l];
            if (st.pos > have && have < slen)
                return failf(MG_ERR_INVALID_ARGUMENT,
                             "%s: step %d: position %d, but layer %d holds only %d positions (earlier calls skipped it)",
                             op, i, st.pos, l + c.first_layer, have);
            if (st.pos > have)
                return failf(MG_ERR_INVALID_ARGUMENT, "%s: step %d: position %d beyond the session length %d", op, i,
                             st.pos, have);
        }
        if ((long long)st.pos + st.n_tokens > st.session->max_tokens)
            return failf(MG_ERR_CAPACITY, "%s: step %d: positions up to %lld exceed the session's %d tokens", op, i,
                         (long long)st.pos + st.n_tokens, st.session->max_tokens);
        total += st.n_tokens;
    }
    if (total > (1 << 24)) return failf(MG_ERR_INVALID_ARGUMENT, "%s: %lld rows is too many", op, total);
    return MG_OK;
}

mg_status api_forward(mg_stack *s, const mg_step *steps, int32_t n_steps, int32_t first_layer, int32_t last_layer,
                      int32_t dtype, const void *in, void *out) {
    if (!s) return failf(MG_ERR_INVALID_ARGUMENT, "forward: stack is NULL");
    std::lock_guard<std::mutex> lock(s->mu);
    const mg_stack_config &c = s->cfg;
    if (!s->ready) return failf(MG_ERR_INVALID_ARGUMENT, "forward: stack is not ready");
    if (s->n_local == 0) return failf(MG_ERR_INVALID_ARGUMENT, "forward: this stack holds no layers");
    if (first_layer < c.first_layer || last_layer > c.last_layer || first_layer > last_layer)
        return failf(MG_ERR_INVALID_ARGUMENT, "forward: layers %d..%d outside this stack's %d..%d", first_layer,
                     last_layer, c.first_layer, c.last_layer);
    if (dtype != MG_F32 && dtype != MG_BF16) return failf(MG_ERR_INVALID_ARGUMENT, "forward: dtype must be f32 or bf16");
    if (!steps || n_steps <= 0 || n_steps > 65536 || !in || !out)
        return failf(MG_ERR_INVALID_ARGUMENT, "forward: need 1..65536 steps, input and output");
    const int l0 = first_layer - c.first_layer, l1 = last_layer - c.first_layer;
    mg_status r = check_steps(s, "forward", steps, n_steps, l0, l1);
    if (r != MG_OK) return r;
    FwdIo io;
    io.dtype = dtype;
    io.in = in;
    io.out = out;
    return forward_locked(s, steps, n_steps, l0, l1, io);
}

namespace {

// ensure_last_rows grows the buffer the last rows of n_steps steps are
// gathered into (io.last: a tail's logits read them on the device).
mg_status ensure_last_rows(mg_stack *s, int32_t n_steps) {
    if (n_steps <= s->last_cap) return MG_OK;
    cudaStreamSynchronize(s->st);
    cudaFree(s->last_rows);
    s->last_rows = nullptr;
    s->last_cap = 0;
    mg_status r = dalloc_n(&s->last_rows, (size_t)n_steps * s->cfg.hidden, "last rows");
    if (r != MG_OK) return r;
    s->last_cap = n_steps;
    return MG_OK;
}

// forward_single runs a batch of single-token steps (decode): one set of
// row metadata, the captured graph when it works, one synchronisation.
// t_enqueued and t_synced bracket the wait for the device (host time).
mg_status forward_single(mg_stack *s, const mg_step *steps, int32_t n_steps, int l0, int l1, const FwdIo &io,
                         bool layers, uint64_t *t_enqueued, uint64_t *t_synced) {
    std::vector<Piece> pieces;
    int max_len = 0;
    for (int i = 0; i < n_steps; i++) {
        pieces.push_back({steps[i].session, i, 1, steps[i].pos});
        if (steps[i].pos + 1 > max_len) max_len = steps[i].pos + 1;
    }
    mg_status r = MG_OK;
    bool ran = false;
    cudaError_t e = cudaSuccess;
    if (layers) {
        fill_meta(s, pieces);
        e = cudaMemcpyAsync(s->meta_d, s->meta_h, n_steps * sizeof(mg_row_meta), cudaMemcpyHostToDevice, s->st);
        if (e != cudaSuccess) r = cuda_fail(e, "row metadata");
    }
    // fused_decode: the embedding and a tail's final norm and LM head go
    // into the decode graph with the layers (two launches fewer per call).
    int ends = 0;
    if (layers && s->graphs_on && s->ks.fused_decode) {
        if (io.tokens) ends |= kGraphEmbed;
        if (io.last && io.head_done) ends |= kGraphHead;
    }
    if (r == MG_OK && io.tokens) {
        e = cudaMemcpyAsync(s->tok_d, io.tokens, n_steps * sizeof(int32_t), cudaMemcpyHostToDevice, s->st);
        if (e == cudaSuccess && !(ends & kGraphEmbed)) e = embed_rows(s, s->tok_d, n_steps, s->x);
        if (e != cudaSuccess) r = cuda_fail(e, "embed");
    } else if (r == MG_OK) {
        r = load_rows(s, io.dtype, io.in, n_steps);
    }
    if (r == MG_OK && layers && s->graphs_on) {
        r = run_decode_graph(s, l0, l1, n_steps, pieces, max_len, ends);
        if (r != MG_OK) {
            // A capture the driver refuses must not take decode down:
            // log once, run without graphs from now on.
            fprintf(stderr, "meshgpu cuda: CUDA graphs disabled for this stack: %s\n", g_err);
            cudaGetLastError();
            s->graphs_on = false;
            r = MG_OK;
            if (ends & kGraphEmbed) {
                e = embed_rows(s, s->tok_d, n_steps, s->x);
                if (e != cudaSuccess) r = cuda_fail(e, "embed");
            }
            ends = 0;
        } else {
            ran = true;
        }
    }
    if (io.head_done) *io.head_done = ran && (ends & kGraphHead);
    if (r == MG_OK && layers && !ran) r = run_layers(s, l0, l1, n_steps, pieces, 0);
    if (io.last) {
        *io.last = s->x;
        return r;
    }
    if (r == MG_OK) r = store_rows(s, io.dtype, s->x, io.out, n_steps);
    *t_enqueued = now_ns();
    if (r == MG_OK) {
        e = cudaStreamSynchronize(s->st);
        if (e != cudaSuccess) r = cuda_fail(e, "forward");
    }
    *t_synced = now_ns();
    return r;
}

// A Part is the rows [tok0, tok0+n) of one step, at row in_row of the input.
struct Part {
    int step, tok0, n;
    long long in_row;
};

// pack_parts cuts the steps into parts of at most kChunkRows rows.
std::vector<Part> pack_parts(const mg_step *steps, int32_t n_steps) {
    std::vector<Part> parts;
    long long in_row = 0;
    for (int i = 0; i < n_steps; i++) {
        for (int t = 0; t < steps[i].n_tokens; t += kChunkRows) {
            const int m = steps[i].n_tokens - t < kChunkRows ? steps[i].n_tokens - t : kChunkRows;
            parts.push_back({i, t, m, in_row + t});
        }
        in_row += steps[i].n_tokens;
    }
    return parts;
}

// chunk_input copies a chunk's input rows (ids or activations; contiguous
// per part, not across parts) to the device and embeds or converts them
// into s->x.
mg_status chunk_input(mg_stack *s, const FwdIo &io, const std::vector<Part> &used, const std::vector<Piece> &pieces,
                      int rows) {
    const mg_stack_config &c = s->cfg;
    const size_t row_bytes = (size_t)c.hidden * (io.dtype == MG_F32 ? 4 : 2);
    cudaError_t e = cudaSuccess;
    for (size_t i = 0; i < used.size(); i++) {
        const size_t n = (size_t)used[i].n * c.hidden;
        if (io.tokens) {
            e = cudaMemcpyAsync(s->tok_d + pieces[i].row, io.tokens + used[i].in_row, used[i].n * sizeof(int32_t),
                                cudaMemcpyHostToDevice, s->st);
        } else {
            const char *src = (const char *)io.in + used[i].in_row * row_bytes;
            if (io.dtype == MG_BF16) {
                e = cudaMemcpyAsync(s->x + (size_t)pieces[i].row * c.hidden, src, n * 2, cudaMemcpyHostToDevice, s->st);
            } else {
                e = cudaMemcpyAsync(s->io_f32 + (size_t)pieces[i].row * c.hidden, src, n * 4, cudaMemcpyHostToDevice, s->st);
            }
        }
        if (e != cudaSuccess) return cuda_fail(e, "input copy");
    }
    if (io.tokens) {
        e = embed_rows(s, s->tok_d, rows, s->x);
        if (e != cudaSuccess) return cuda_fail(e, "embed");
    } else if (io.dtype == MG_F32) {
        e = f32_to_bf16(s->io_f32, (size_t)rows * c.hidden, s->x, s->st);
        if (e != cudaSuccess) return cuda_fail(e, "input convert");
    }
    return MG_OK;
}

// chunk_output copies a chunk's rows out: every row to the host output,
// or (io.last) each step's last row, once its last part ran, into
// s->last_rows.
mg_status chunk_output(mg_stack *s, const mg_step *steps, const FwdIo &io, const std::vector<Part> &used,
                       const std::vector<Piece> &pieces, int rows) {
    const mg_stack_config &c = s->cfg;
    cudaError_t e = cudaSuccess;
    if (io.last) {
        for (size_t i = 0; i < used.size(); i++) {
            if (used[i].tok0 + used[i].n != steps[used[i].step].n_tokens) continue;
            e = cudaMemcpyAsync(s->last_rows + (size_t)used[i].step * c.hidden,
                                s->x + (size_t)(pieces[i].row + used[i].n - 1) * c.hidden, (size_t)c.hidden * 2,
                                cudaMemcpyDeviceToDevice, s->st);
            if (e != cudaSuccess) return cuda_fail(e, "last rows");
        }
        return MG_OK;
    }
    if (io.dtype == MG_F32) {
        e = bf16_to_f32(s->x, (size_t)rows * c.hidden, s->io_f32, s->st);
        if (e != cudaSuccess) return cuda_fail(e, "output convert");
    }
    const size_t row_bytes = (size_t)c.hidden * (io.dtype == MG_F32 ? 4 : 2);
    for (size_t i = 0; i < used.size(); i++) {
        const size_t n = (size_t)used[i].n * c.hidden;
        char *dst = (char *)io.out + used[i].in_row * row_bytes;
        if (io.dtype == MG_BF16) {
            e = cudaMemcpyAsync(dst, s->x + (size_t)pieces[i].row * c.hidden, n * 2, cudaMemcpyDeviceToHost, s->st);
        } else {
            e = cudaMemcpyAsync(dst, s->io_f32 + (size_t)pieces[i].row * c.hidden, n * 4, cudaMemcpyDeviceToHost, s->st);
        }
        if (e != cudaSuccess) return cuda_fail(e, "output copy");
    }
    return MG_OK;
}

// forward_chunked runs steps of any length: packed into chunks of at most
// kChunkRows rows; a long step spans several chunks, run in order so that
// later chunks see earlier keys. Each chunk is synchronised before the
// next reuses tok_d, x and the staging buffers.
mg_status forward_chunked(mg_stack *s, const mg_step *steps, int32_t n_steps, int l0, int l1, const FwdIo &io,
                          bool layers) {
    const std::vector<Part> parts = pack_parts(steps, n_steps);
    if (io.last) *io.last = s->last_rows;
    mg_status r = MG_OK;
    size_t pi = 0;
    while (pi < parts.size() && r == MG_OK) {
        std::vector<Piece> pieces;
        std::vector<Part> used;
        int rows = 0;
        while (pi < parts.size() && rows + parts[pi].n <= kChunkRows) {
            const Part &p = parts[pi];
            // A later part of a step already in this chunk must wait.
            bool clash = false;
            for (const Part &u : used) clash |= u.step == p.step;
            if (clash) break;
            // a tree (at most MG_MAX_TREE_ROWS rows) is one part: tok0 is 0
            pieces.push_back({steps[p.step].session, rows, p.n, steps[p.step].pos + p.tok0,
                              io.parents ? io.parents[p.step] : nullptr});
            used.push_back(p);
            rows += p.n;
            pi++;
        }
        if (layers) {
            r = upload_tree_masks(s, pieces);
            fill_meta(s, pieces);
            cudaError_t e = cudaMemcpyAsync(s->meta_d, s->meta_h, rows * sizeof(mg_row_meta), cudaMemcpyHostToDevice, s->st);
            if (r == MG_OK && e != cudaSuccess) r = cuda_fail(e, "row metadata");
        }
        if (r == MG_OK) r = chunk_input(s, io, used, pieces, rows);
        if (r == MG_OK && layers) r = run_layers(s, l0, l1, rows, pieces, 0);
        if (r == MG_OK) r = chunk_output(s, steps, io, used, pieces, rows);
        if (r == MG_OK) {
            cudaError_t e = cudaStreamSynchronize(s->st);
            if (e != cudaSuccess) r = cuda_fail(e, "forward");
        }
    }
    return r;
}

} // namespace

mg_status forward_locked(mg_stack *s, const mg_step *steps, int32_t n_steps, int l0, int l1, const FwdIo &io) {
    const uint64_t t_enter = now_ns();
    const bool layers = l0 <= l1 && s->n_local > 0;
    CU(cudaSetDevice(s->b->device), "set device");
    if (io.tokens && !s->embed && !s->qembed.data) return failf(MG_ERR_INVALID_ARGUMENT, "forward: this stack holds no embedding");
    if (io.last) {
        mg_status r = ensure_last_rows(s, n_steps);
        if (r != MG_OK) return r;
    }
    // Truncate first (a retried hop); on failure the range stays at pos.
    for (int i = 0; i < n_steps; i++)
        for (int l = l0; l <= l1; l++) steps[i].session->layer_len[l] = steps[i].pos;
    uint64_t t_enqueued = 0, t_synced = 0; // host-time accounting (decode path)

    bool all_single = n_steps <= kGemvMaxRows;
    for (int i = 0; i < n_steps && all_single; i++) all_single = steps[i].n_tokens == 1 && !(io.parents && io.parents[i]);
    const mg_status r = all_single ? forward_single(s, steps, n_steps, l0, l1, io, layers, &t_enqueued, &t_synced)
                                   : forward_chunked(s, steps, n_steps, l0, l1, io, layers);
    if (r != MG_OK) {
        cudaStreamSynchronize(s->st);
        return r; // lengths stay truncated to pos: the caller retries from there
    }
    for (int i = 0; i < n_steps; i++)
        for (int l = l0; l <= l1; l++) steps[i].session->layer_len[l] = steps[i].pos + steps[i].n_tokens;
    g_fwd_host_ns = t_enqueued ? (t_enqueued - t_enter) + (now_ns() - t_synced) : 0;
    return MG_OK;
}

mg_status api_logits(mg_stack *s, int32_t n_rows, int32_t dtype, const void *in, float *out) {
    if (!s) return failf(MG_ERR_INVALID_ARGUMENT, "logits: stack is NULL");
    std::lock_guard<std::mutex> lock(s->mu);
    const mg_stack_config &c = s->cfg;
    if (!s->ready) return failf(MG_ERR_INVALID_ARGUMENT, "logits: stack is not ready");
    if (!c.has_head) return failf(MG_ERR_INVALID_ARGUMENT, "logits: this stack holds no LM head");
    if (n_rows <= 0 || !in || !out) return failf(MG_ERR_INVALID_ARGUMENT, "logits: need n_rows > 0, input and output");
    if (dtype != MG_F32 && dtype != MG_BF16) return failf(MG_ERR_INVALID_ARGUMENT, "logits: dtype must be f32 or bf16");
    CU(cudaSetDevice(s->b->device), "set device");
    const size_t row_bytes = (size_t)c.hidden * (dtype == MG_F32 ? 4 : 2);
    for (int r0 = 0; r0 < n_rows; r0 += kLogitRows) {
        const int m = n_rows - r0 < kLogitRows ? n_rows - r0 : kLogitRows;
        mg_status r = load_rows(s, dtype, (const char *)in + r0 * row_bytes, m);
        if (r != MG_OK) return r;
        const Kernel lk = choose_kernel(Op::Matmul, m, 0, s->ks);
        if (!s->qhead.data) CU(rmsnorm(s->x, s->final_norm, c.rms_eps, m, c.hidden, s->h, s->st), "final norm");
        if (s->qhead.data) { // the final norm folded in (backend_quant.cu)
            r = qhead_logits(s, s->x, m);
            if (r != MG_OK) return r;
        } else if (lk == Kernel::Gemv) {
            CU(gemv(kF32, s->lm_head, s->h, m, c.vocab, c.hidden, nullptr, nullptr, s->logits, s->st), "lm head");
        } else if (lk == Kernel::GemvMma) {
            CU(gemv_mma(kF32, s->lm_head, s->h, m, c.vocab, c.hidden, nullptr, nullptr, s->logits, s->st), "lm head");
        } else {
            r = blas_gemm(s, s->lm_head, s->h, m, c.vocab, c.hidden, s->logits, true, 0.f);
            if (r != MG_OK) return r;
            CU(round_to_bf16(s->logits, (size_t)m * c.vocab, s->st), "logits");
        }
        CU(cudaMemcpyAsync(out + (size_t)r0 * c.vocab, s->logits, (size_t)m * c.vocab * 4, cudaMemcpyDeviceToHost, s->st),
           "logits copy");
        CU(cudaStreamSynchronize(s->st), "logits");
    }
    return MG_OK;
}

} // namespace mgcuda

namespace mg {
uint64_t last_forward_host_ns() { return mgcuda::g_fwd_host_ns; }
} // namespace mg

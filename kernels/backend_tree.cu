// backend_tree.cu: token trees on the CUDA backend (meshgpu.h forward_tree,
// session_compact), as the CPU backend runs them. A tree step is forward's
// chunked path with two differences (backend_forward.cu): its row metadata
// puts row i's RoPE at pos + depth(i) and its K/V in slot pos + i (fill_meta
// shifts the cache pointers by i - depth(i) rows, so rope_append writes the
// slot while rotating at the depth), and its attention is attn_tree with
// the ancestor mask (attention_tree.cu). Compaction copies the kept slots
// down on the device (compact.cu).
#include <cstring>
#include <vector>

#include "backend_impl.h"

namespace mgcuda {

namespace {

// check_tree: parents[i] in -1..i-1, at most MG_MAX_TREE_ROWS rows.
mg_status check_tree(int step, const int32_t *parents, int n) {
    if (n > MG_MAX_TREE_ROWS)
        return failf(MG_ERR_INVALID_ARGUMENT, "forward_tree: step %d: %d rows in a tree (at most %d)", step, n, MG_MAX_TREE_ROWS);
    for (int i = 0; i < n; i++)
        if (parents[i] < -1 || parents[i] >= i)
            return failf(MG_ERR_INVALID_ARGUMENT, "forward_tree: step %d: row %d has parent %d (want -1..%d)", step, i,
                         parents[i], i - 1);
    return MG_OK;
}

} // namespace

mg_status api_forward_tree(mg_stack *s, const mg_tree_step *steps, int32_t n_steps, int32_t first_layer,
                           int32_t last_layer, int32_t dtype, const void *in, void *out) {
    if (!s) return failf(MG_ERR_INVALID_ARGUMENT, "forward_tree: stack is NULL");
    if (!steps || n_steps <= 0 || n_steps > 65536 || !in || !out)
        return failf(MG_ERR_INVALID_ARGUMENT, "forward_tree: need 1..65536 steps, input and output");
    std::vector<mg_step> plain(n_steps);
    std::vector<const int32_t *> parents(n_steps);
    for (int i = 0; i < n_steps; i++) {
        plain[i] = mg_step{steps[i].session, steps[i].pos, steps[i].n_tokens};
        // a one-row tree is a chain: the fused decode path may take it
        parents[i] = steps[i].n_tokens > 1 ? steps[i].parents : nullptr;
        if (parents[i]) {
            mg_status r = check_tree(i, parents[i], steps[i].n_tokens);
            if (r != MG_OK) return r;
        }
    }
    std::lock_guard<std::mutex> lock(s->mu);
    const mg_stack_config &c = s->cfg;
    if (!s->ready) return failf(MG_ERR_INVALID_ARGUMENT, "forward_tree: stack is not ready");
    if (s->n_local == 0) return failf(MG_ERR_INVALID_ARGUMENT, "forward_tree: this stack holds no layers");
    if (first_layer < c.first_layer || last_layer > c.last_layer || first_layer > last_layer)
        return failf(MG_ERR_INVALID_ARGUMENT, "forward_tree: layers %d..%d outside this stack's %d..%d", first_layer,
                     last_layer, c.first_layer, c.last_layer);
    if (dtype != MG_F32 && dtype != MG_BF16)
        return failf(MG_ERR_INVALID_ARGUMENT, "forward_tree: dtype must be f32 or bf16");
    const int l0 = first_layer - c.first_layer, l1 = last_layer - c.first_layer;
    mg_status r = check_steps(s, "forward_tree", plain.data(), n_steps, l0, l1);
    if (r != MG_OK) return r;
    FwdIo io;
    io.dtype = dtype;
    io.in = in;
    io.out = out;
    io.parents = parents.data();
    return forward_locked(s, plain.data(), n_steps, l0, l1, io);
}

mg_status upload_tree_masks(mg_stack *s, std::vector<Piece> &pieces) {
    size_t bytes = 0;
    for (const Piece &p : pieces)
        if (p.parents) bytes += (size_t)p.n * p.n;
    if (bytes == 0) return MG_OK;
    if (bytes > s->tree_mask_cap) {
        CU(cudaStreamSynchronize(s->st), "tree mask");
        cudaFree(s->tree_mask);
        s->tree_mask = nullptr;
        s->tree_mask_cap = 0;
        mg_status r = dalloc(reinterpret_cast<void **>(&s->tree_mask), bytes, "tree mask");
        if (r != MG_OK) return r;
        s->tree_mask_cap = bytes;
    }
    // row i's mask row: its parent's and itself (parents precede children)
    std::vector<uint8_t> host(bytes, 0);
    size_t off = 0;
    for (Piece &p : pieces) {
        if (!p.parents) continue;
        uint8_t *m = host.data() + off;
        for (int i = 0; i < p.n; i++) {
            const int par = p.parents[i];
            if (par >= 0) memcpy(m + (size_t)i * p.n, m + (size_t)par * p.n, (size_t)par + 1);
            m[(size_t)i * p.n + i] = 1;
        }
        p.mask = s->tree_mask + off;
        off += (size_t)p.n * p.n;
    }
    // from pageable memory: the copy has read host before it returns
    CU(cudaMemcpyAsync(s->tree_mask, host.data(), bytes, cudaMemcpyHostToDevice, s->st), "tree mask");
    return MG_OK;
}

mg_status api_session_compact(mg_session *ss, int32_t dst, const int32_t *src, int32_t n) {
    if (!ss || (n > 0 && !src)) return failf(MG_ERR_INVALID_ARGUMENT, "session_compact: NULL argument");
    mg_stack *s = ss->s;
    std::lock_guard<std::mutex> lock(s->mu);
    if (dst < 0 || n < 0 || (long long)dst + n > ss->max_tokens)
        return failf(MG_ERR_INVALID_ARGUMENT, "session_compact: %d slots to %d in a session of %d", n, dst, ss->max_tokens);
    for (int j = 0; j < n; j++) {
        if (src[j] < dst + j || (j > 0 && src[j] <= src[j - 1]))
            return failf(MG_ERR_INVALID_ARGUMENT,
                         "session_compact: slot %d from %d: want increasing sources at or after their destinations", dst + j,
                         src[j]);
        for (int l = 0; l < s->n_local; l++)
            if (src[j] >= ss->layer_len[l])
                return failf(MG_ERR_INVALID_ARGUMENT, "session_compact: slot %d beyond layer %d's %d positions", src[j],
                             s->cfg.first_layer + l, ss->layer_len[l]);
    }
    CU(cudaSetDevice(s->b->device), "set device");
    // the history's kept ids: the sources it holds (CPU backend's rule)
    int kept = 0;
    if (ss->hist_len > dst)
        while (kept < n && src[kept] < ss->hist_len) kept++;
    for (int j0 = 0; j0 < n; j0 += kCompactSlots) {
        const int m = n - j0 < kCompactSlots ? n - j0 : kCompactSlots;
        CompactSlots cs{};
        memcpy(cs.src, src + j0, (size_t)m * sizeof(int32_t));
        for (int l = 0; l < s->n_local; l++) {
            if (ss->layer_len[l] < dst) continue; // holds less: nothing to move or cut
            const size_t off = (size_t)l * ss->layer_stride;
            CU(compact_rows(ss->k + off, ss->v + off, s->kv_dim, dst + j0, cs, m, s->st), "compact K/V");
        }
        if (j0 < kept) CU(compact_ids(ss->hist, dst + j0, cs, kept - j0 < m ? kept - j0 : m, s->st), "compact history");
    }
    CU(cudaStreamSynchronize(s->st), "session_compact");
    for (int l = 0; l < s->n_local; l++)
        if (ss->layer_len[l] >= dst) ss->layer_len[l] = dst + n;
    if (ss->hist_len > dst) ss->hist_len = dst + kept;
    return MG_OK;
}

} // namespace mgcuda

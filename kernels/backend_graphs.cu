// backend_graphs.cu: the CUDA backend's decode graphs. A batch of
// single-token steps is captured once per (rows, layer range, KV-length
// bucket, ends) and replayed; its kernels read positions and cache pointers from
// device memory (mg_row_meta), so one graph serves any sessions at any
// positions within its bucket. At most kMaxGraphs are kept per stack.
#include <tuple>

#include "backend_impl.h"

namespace mgcuda {

namespace {

int bucket_for(mg_stack *s, int max_len) {
    int b = 256;
    while (b < max_len) b *= 2;
    return b < s->cfg.max_context ? b : s->cfg.max_context;
}

} // namespace

void clear_graphs(mg_stack *s) {
    for (auto &kv : s->graphs) cudaGraphExecDestroy(kv.second);
    s->graphs.clear();
}

// Decode with a captured graph: rows single-token steps.
mg_status run_decode_graph(mg_stack *s, int l0, int l1, int rows, const std::vector<Piece> &pieces,
                           int max_len, int ends) {
    const int bucket = bucket_for(s, max_len);
    const auto key = std::make_tuple(rows, l0, l1, bucket, ends);
    auto it = s->graphs.find(key);
    if (it == s->graphs.end()) {
        if (s->graphs.size() >= kMaxGraphs) clear_graphs(s);
        cudaGraph_t g = nullptr;
        CU(cudaStreamBeginCapture(s->st, cudaStreamCaptureModeThreadLocal), "graph capture");
        mg_status r = MG_OK;
        if (ends & kGraphEmbed) {
            const cudaError_t ee = embed_rows(s, s->tok_d, rows, s->x);
            if (ee != cudaSuccess) r = cuda_fail(ee, "embed");
        }
        if (r == MG_OK) r = run_layers(s, l0, l1, rows, pieces, bucket);
        if (r == MG_OK && (ends & kGraphHead)) r = head_logits(s, s->x, rows);
        cudaError_t e = cudaStreamEndCapture(s->st, &g);
        if (r != MG_OK) {
            if (g) cudaGraphDestroy(g);
            return r;
        }
        if (e != cudaSuccess) return cuda_fail(e, "graph capture");
        cudaGraphExec_t exec = nullptr;
        e = cudaGraphInstantiateWithFlags(&exec, g, 0);
        cudaGraphDestroy(g);
        if (e != cudaSuccess) return cuda_fail(e, "graph instantiate");
        it = s->graphs.emplace(key, exec).first;
    }
    CU(cudaGraphLaunch(it->second, s->st), "graph launch");
    return MG_OK;
}

} // namespace mgcuda

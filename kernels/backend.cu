// backend.cu: the CUDA implementation of the C ABI in native/meshgpu.h,
// exported as mg_cuda_api: the function table, the backend (device,
// settings, pinned host memory) and the thread-local last error. Semantics
// follow the CPU backend (validation, statuses, thread-local last error,
// truncation when pos < len, capacity). The rest lives by concern:
// backend_stack.cu (stacks, weights, sessions), backend_forward.cu (embed,
// forward and its row packing, logits), backend_graphs.cu (decode CUDA
// graphs); backend_impl.h is what they share, dispatch.h the kernel choice.
//
// Per stack: one stream, one cuBLAS handle, bf16 weights (Q/K/V rows fused
// into one matrix, gate/up into another), a (cos, sin) RoPE table, and
// scratch for up to kChunkRows rows. forward() runs rows in chunks of at most
// kChunkRows through the requested layers; decode rows (<= 16) use the
// hand-written matrix-vector kernels and, when every step has one token,
// a CUDA graph captured per (rows, layer range, KV-length bucket) whose
// kernels read positions and cache pointers from device memory.
#include <cstdarg>
#include <cstdio>
#include <new>

#include "backend_impl.h"

namespace mgcuda {

thread_local char g_err[512];

mg_status failf(mg_status s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof g_err, fmt, ap);
    va_end(ap);
    return s;
}

mg_status cuda_fail(cudaError_t e, const char *what) {
    return failf(e == cudaErrorMemoryAllocation ? MG_ERR_OUT_OF_MEMORY : MG_ERR_BACKEND, "cuda: %s: %s",
                 what, cudaGetErrorString(e));
}

namespace {

// ---------- ABI entry points ----------

const char *api_last_error(void) { return g_err; }

mg_status api_backend_open(const mg_backend_options *opts, mg_backend **out) {
    if (!out) return failf(MG_ERR_INVALID_ARGUMENT, "backend_open: out is NULL");
    *out = nullptr;
    KernelSettings ks;
    if (!kernel_settings(opts, &ks) || (opts && opts->threads < 0))
        return failf(MG_ERR_INVALID_ARGUMENT,
                     "backend_open: attention %d, prefill_attention %d, no_graphs %d, batch_mma %d, fused_decode %d, threads %d: "
                     "out of range",
                     opts->attention, opts->prefill_attention, opts->no_graphs, opts->batch_mma, opts->fused_decode,
                     opts->threads);
    const int device = opts ? opts->device : 0; // threads: the CPU backend's
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) return failf(MG_ERR_BACKEND, "cuda: no usable GPU: %s", cudaGetErrorString(e));
    if (device < 0 || device >= count)
        return failf(MG_ERR_INVALID_ARGUMENT, "backend_open: device %d out of range (%d GPUs)", device, count);
    CU(cudaSetDevice(device), "set device");
    CU(cudaFree(nullptr), "context init");
    cudaDeviceProp p;
    CU(cudaGetDeviceProperties(&p, device), "device properties");
    if (p.major < 8)
        return failf(MG_ERR_UNSUPPORTED, "cuda: %s is sm_%d%d; meshgpu needs sm_80 or newer (bf16)", p.name,
                     p.major, p.minor);
    mg_backend *b = new (std::nothrow) mg_backend;
    if (!b) return failf(MG_ERR_OUT_OF_MEMORY, "backend_open: out of host memory");
    b->device = device;
    b->ks = ks;
    snprintf(b->desc, sizeof b->desc, "%s, sm_%d%d, %d SMs, %.0f GiB", p.name, p.major, p.minor,
             p.multiProcessorCount, (double)p.totalGlobalMem / (1024.0 * 1024 * 1024));
    *out = b;
    return MG_OK;
}

void api_backend_close(mg_backend *b) { delete b; }

mg_status api_backend_memory(mg_backend *b, uint64_t *free_bytes, uint64_t *total_bytes) {
    if (!b || !free_bytes || !total_bytes) return failf(MG_ERR_INVALID_ARGUMENT, "backend_memory: NULL argument");
    CU(cudaSetDevice(b->device), "set device");
    size_t f = 0, t = 0;
    CU(cudaMemGetInfo(&f, &t), "memory info");
    *free_bytes = f;
    *total_bytes = t;
    return MG_OK;
}

const char *api_backend_describe(mg_backend *b) { return b ? b->desc : ""; }

mg_status api_host_alloc(mg_backend *b, size_t nbytes, void **out) {
    if (!b || !out) return failf(MG_ERR_INVALID_ARGUMENT, "host_alloc: NULL argument");
    *out = nullptr;
    if (nbytes == 0) return failf(MG_ERR_INVALID_ARGUMENT, "host_alloc: zero bytes");
    CU(cudaSetDevice(b->device), "set device");
    cudaError_t e = cudaHostAlloc(out, nbytes, cudaHostAllocPortable);
    if (e != cudaSuccess) {
        *out = nullptr;
        return failf(MG_ERR_OUT_OF_MEMORY, "cuda: pinned host allocation of %zu bytes: %s", nbytes,
                     cudaGetErrorString(e));
    }
    return MG_OK;
}

void api_host_free(mg_backend *b, void *p) {
    if (b && p) {
        cudaSetDevice(b->device);
        cudaFreeHost(p);
    }
}

const mg_api kApi = {
    MG_ABI_VERSION,
    "cuda",
    sizeof(mg_api),
    api_last_error,
    api_backend_open,
    api_backend_close,
    api_backend_memory,
    api_backend_describe,
    api_host_alloc,
    api_host_free,
    api_stack_create,
    api_stack_set_tensor,
    api_stack_ready,
    api_stack_free,
    api_session_create,
    api_session_free,
    api_session_len,
    api_embed,
    api_forward,
    api_logits,
    api_head_forward,
    api_tail_forward,
    api_decode,
    api_forward_tree,
    api_session_compact,
};

} // namespace
} // namespace mgcuda

extern "C" MG_EXPORT const mg_api *mg_cuda_api(int32_t abi_version) {
    if (abi_version != MG_ABI_VERSION) {
        snprintf(mgcuda::g_err, sizeof mgcuda::g_err, "libmeshgpu_cuda: ABI version %d requested, library has %d", abi_version,
                 MG_ABI_VERSION);
        return nullptr;
    }
    return &mgcuda::kApi;
}

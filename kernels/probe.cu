// probe.cu: the ceilings the benchmarks are judged against, measured in the
// same process and run: device-to-device copy bandwidth, the cuBLAS bf16
// GEMM rate, and the decode matrix-vector kernel's own bandwidth. Timed with
// CUDA events after a warm-up, on random (never zero) data.
#include "kernels.h"

namespace mg {
namespace {

__global__ void fill_random_kernel(bf16 *p, size_t n, uint32_t seed, float scale) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        uint32_t h = (uint32_t)i * 0x9E3779B1u ^ seed ^ (uint32_t)(i >> 32) * 0x85EBCA77u;
        h ^= h >> 16;
        h *= 0x7FEB352Du;
        h ^= h >> 15;
        h *= 0x846CA68Bu;
        h ^= h >> 16;
        const float u = (float)(h >> 8) * (1.0f / 16777216.0f); // [0, 1)
        p[i] = __float2bfloat16((2.f * u - 1.f) * scale);
    }
}

struct Events {
    cudaEvent_t a = nullptr, b = nullptr;
    Events() {
        cudaEventCreate(&a);
        cudaEventCreate(&b);
    }
    ~Events() {
        if (a) cudaEventDestroy(a);
        if (b) cudaEventDestroy(b);
    }
    float ms() {
        float t = 0.f;
        cudaEventElapsedTime(&t, a, b);
        return t;
    }
};

} // namespace

cudaError_t fill_random(bf16 *p, size_t n, uint32_t seed, float scale, cudaStream_t st) {
    size_t blocks = (n + 255) / 256;
    if (blocks > 8192) blocks = 8192;
    if (blocks == 0) blocks = 1;
    fill_random_kernel<<<(unsigned)blocks, 256, 0, st>>>(p, n, seed, scale);
    return cudaGetLastError();
}

cudaError_t probe_copy_gbps(size_t bytes, int iters, double *gbps) {
    void *src = nullptr, *dst = nullptr;
    cudaError_t e = cudaMalloc(&src, bytes);
    if (e == cudaSuccess) e = cudaMalloc(&dst, bytes);
    if (e == cudaSuccess) e = fill_random((bf16 *)src, bytes / 2, 1, 1.f, 0);
    Events ev;
    if (e == cudaSuccess) e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, 0);
    if (e == cudaSuccess) e = cudaEventRecord(ev.a, 0);
    for (int i = 0; i < iters && e == cudaSuccess; i++)
        e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, 0);
    if (e == cudaSuccess) e = cudaEventRecord(ev.b, 0);
    if (e == cudaSuccess) e = cudaEventSynchronize(ev.b);
    if (e == cudaSuccess) *gbps = 2.0 * (double)bytes * iters / (ev.ms() * 1e-3) / 1e9;
    cudaFree(src);
    cudaFree(dst);
    return e;
}

cudaError_t probe_gemm_tflops(int m, int n, int k, int iters, double *tflops, const char **err) {
    bf16 *A = nullptr, *B = nullptr, *C = nullptr;
    cublasHandle_t h = nullptr;
    *err = nullptr;
    cudaError_t e = cudaMalloc(&A, (size_t)m * k * 2);
    if (e == cudaSuccess) e = cudaMalloc(&B, (size_t)n * k * 2);
    if (e == cudaSuccess) e = cudaMalloc(&C, (size_t)n * m * 2);
    if (e == cudaSuccess) e = fill_random(A, (size_t)m * k, 2, 1.f, 0);
    if (e == cudaSuccess) e = fill_random(B, (size_t)n * k, 3, 1.f, 0);
    if (e == cudaSuccess && cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) *err = "cublasCreate failed";
    Events ev;
    if (e == cudaSuccess && !*err) {
        // Same call and layout as the prefill path (gemm.cu).
        for (int i = 0; i < 3 && !*err; i++)
            if (gemm(h, A, B, n, m, k, C, false, 0.f) != CUBLAS_STATUS_SUCCESS) *err = "cublasGemmEx failed";
        cudaEventRecord(ev.a, 0);
        for (int i = 0; i < iters && !*err; i++)
            if (gemm(h, A, B, n, m, k, C, false, 0.f) != CUBLAS_STATUS_SUCCESS) *err = "cublasGemmEx failed";
        cudaEventRecord(ev.b, 0);
        e = cudaEventSynchronize(ev.b);
        if (e == cudaSuccess && !*err) *tflops = 2.0 * m * n * (double)k * iters / (ev.ms() * 1e-3) / 1e12;
    }
    if (h) cublasDestroy(h);
    cudaFree(A);
    cudaFree(B);
    cudaFree(C);
    return e;
}

cudaError_t probe_gemv_gbps(int m, int k, int n, int iters, double *gbps, bool mma) {
    auto run = [mma](const bf16 *W, const bf16 *x, int n, int m, int k, bf16 *y) {
        return mma ? gemv_mma(kStore, W, x, n, m, k, nullptr, y, nullptr, 0) : gemv(kStore, W, x, n, m, k, nullptr, y, nullptr, 0);
    };
    // Several weight copies rotate so repeated calls do not run from L2.
    const int copies = 4;
    bf16 *W = nullptr, *x = nullptr, *y = nullptr;
    const size_t wn = (size_t)m * k;
    cudaError_t e = cudaMalloc(&W, wn * 2 * copies);
    if (e == cudaSuccess) e = cudaMalloc(&x, (size_t)n * k * 2);
    if (e == cudaSuccess) e = cudaMalloc(&y, (size_t)n * m * 2);
    if (e == cudaSuccess) e = fill_random(W, wn * copies, 4, 0.05f, 0);
    if (e == cudaSuccess) e = fill_random(x, (size_t)n * k, 5, 1.f, 0);
    Events ev;
    for (int i = 0; i < copies && e == cudaSuccess; i++) e = run(W + wn * i, x, n, m, k, y);
    if (e == cudaSuccess) e = cudaEventRecord(ev.a, 0);
    for (int i = 0; i < iters && e == cudaSuccess; i++)
        e = run(W + wn * (i % copies), x, n, m, k, y);
    if (e == cudaSuccess) e = cudaEventRecord(ev.b, 0);
    if (e == cudaSuccess) e = cudaEventSynchronize(ev.b);
    if (e == cudaSuccess) *gbps = (double)wn * 2 * iters / (ev.ms() * 1e-3) / 1e9;
    cudaFree(W);
    cudaFree(x);
    cudaFree(y);
    return e;
}

} // namespace mg

// convert.cu: dtype conversion (weights at load, activations at the host
// boundary) and the embedding gather. All grid-stride, 16 bytes per access
// where the layout allows it.
#include <cuda_fp16.h>

#include "kernels.h"

namespace mg {
namespace {

__global__ void f32_to_bf16_kernel(const float *__restrict__ src, size_t n, bf16 *__restrict__ dst) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = __float2bfloat16(src[i]);
}

__global__ void f16_to_bf16_kernel(const __half *__restrict__ src, size_t n, bf16 *__restrict__ dst) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = __float2bfloat16(__half2float(src[i]));
}

__global__ void bf16_to_f32_kernel(const bf16 *__restrict__ src, size_t n, float *__restrict__ dst) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = __bfloat162float(src[i]);
}

// One block per token; hidden % 8 == 0 so rows copy as uint4.
__global__ void embed_kernel(const bf16 *__restrict__ table, const int32_t *__restrict__ tokens,
                             int hidden, bf16 *__restrict__ out) {
    const uint4 *src = reinterpret_cast<const uint4 *>(table + (size_t)tokens[blockIdx.x] * hidden);
    uint4 *dst = reinterpret_cast<uint4 *>(out + (size_t)blockIdx.x * hidden);
    for (int i = threadIdx.x; i < hidden / 8; i += blockDim.x) dst[i] = __ldg(src + i);
}

int grid_for(size_t n) {
    size_t g = (n + 255) / 256;
    return (int)(g > 65535 ? 65535 : (g == 0 ? 1 : g));
}

} // namespace

cudaError_t convert_to_bf16(const void *src, int dtype, size_t n, bf16 *dst, cudaStream_t st) {
    switch (dtype) {
    case 0:
        f32_to_bf16_kernel<<<grid_for(n), 256, 0, st>>>((const float *)src, n, dst);
        break;
    case 1:
        f16_to_bf16_kernel<<<grid_for(n), 256, 0, st>>>((const __half *)src, n, dst);
        break;
    case 2:
        return cudaMemcpyAsync(dst, src, n * sizeof(bf16), cudaMemcpyDeviceToDevice, st);
    default:
        return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

cudaError_t bf16_to_f32(const bf16 *src, size_t n, float *dst, cudaStream_t st) {
    bf16_to_f32_kernel<<<grid_for(n), 256, 0, st>>>(src, n, dst);
    return cudaGetLastError();
}

cudaError_t f32_to_bf16(const float *src, size_t n, bf16 *dst, cudaStream_t st) {
    f32_to_bf16_kernel<<<grid_for(n), 256, 0, st>>>(src, n, dst);
    return cudaGetLastError();
}

cudaError_t embed(const bf16 *table, const int32_t *tokens, int n, int hidden, bf16 *out,
                  cudaStream_t st) {
    if (n <= 0) return cudaSuccess;
    int threads = hidden / 8 < 256 ? ((hidden / 8 + 31) / 32) * 32 : 256;
    embed_kernel<<<n, threads, 0, st>>>(table, tokens, hidden, out);
    return cudaGetLastError();
}

} // namespace mg

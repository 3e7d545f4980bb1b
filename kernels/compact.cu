// compact.cu: moving a kept branch of a token tree to consecutive cache
// slots (meshgpu.h session_compact). The slots a tree's rows took are
// pos..pos+n-1 in row order; the kept branch moves down to pos+1.. . A
// destination is never a later move's source (sources increase and are at
// or after their destinations), so copying each element's slots in order
// is exact; threads take elements, not slots.
#include "kernels.h"

namespace mg {
namespace {

__global__ void compact_rows_kernel(bf16 *__restrict__ k, bf16 *__restrict__ v, int width, int dst, CompactSlots src,
                                    int n) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= width) return;
    bf16 *rows = blockIdx.y == 0 ? k : v;
    for (int j = 0; j < n; j++) rows[(size_t)(dst + j) * width + t] = rows[(size_t)src.src[j] * width + t];
}

__global__ void compact_ids_kernel(int32_t *hist, int dst, CompactSlots src, int n) {
    for (int j = 0; j < n; j++) hist[dst + j] = hist[src.src[j]];
}

} // namespace

cudaError_t compact_rows(bf16 *k, bf16 *v, int width, int dst, const CompactSlots &src, int n, cudaStream_t st) {
    if (n <= 0) return cudaSuccess;
    if (n > kCompactSlots || width <= 0) return cudaErrorInvalidValue;
    const dim3 grid((width + 127) / 128, 2);
    compact_rows_kernel<<<grid, 128, 0, st>>>(k, v, width, dst, src, n);
    return cudaGetLastError();
}

cudaError_t compact_ids(int32_t *hist, int dst, const CompactSlots &src, int n, cudaStream_t st) {
    if (n <= 0) return cudaSuccess;
    if (n > kCompactSlots) return cudaErrorInvalidValue;
    compact_ids_kernel<<<1, 1, 0, st>>>(hist, dst, src, n);
    return cudaGetLastError();
}

} // namespace mg

// attention_gemm.cu: prefill attention through cuBLAS (the default;
// MG_PREFILL_ATTENTION_TILED, --cuda-prefill-attn tiled, selects attention.cu's kernel), in the bf16 math-SDPA numerics: the
// same steps PyTorch's math path takes, on tensor cores.
//   1. q_s = bf16(q * sf), k_s = bf16(k * sf)            (scale kernel)
//   2. S_h = q_s,h k_s,g^T, bf16 output                   (strided batched GEMM per kv head)
//   3. P = bf16(softmax(S) with the causal mask), in place (softmax kernel)
//   4. O_h = P_h v_g, bf16 output into the attention rows (strided batched GEMM per kv head)
// S takes H * n * T bf16 scratch; callers fall back to the tiled kernel when
// that is too large.
#include "kernels.h"

namespace mg {
namespace {

// dst[i] = bf16(src[i] * sf) over rows of `width` elements read with stride
// `src_stride` (q rows inside qkv rows) or contiguous (the K cache).
__global__ void scale_rows_kernel(const bf16 *__restrict__ src, int src_stride, int width, int rows, float sf,
                                  bf16 *__restrict__ dst) {
    const int per_row = width / 8;
    const size_t n = (size_t)rows * per_row;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const size_t r = i / per_row, c = i % per_row;
        float f[8];
        unpack8(ldg16(src + r * src_stride + c * 8), f);
#pragma unroll
        for (int j = 0; j < 8; j++) f[j] *= sf;
        *reinterpret_cast<uint4 *>(dst + r * width + c * 8) = pack8(f);
    }
}

// One block per (query row i, head h): S row [T] (bf16) -> P row, keys past
// pos0 + i masked to 0. f32 max and sum; P = bf16(exp(s - max) * (1/sum)).
__global__ void softmax_rows_kernel(bf16 *S, int n, int T, int pos0) {
    const int i = blockIdx.x, h = blockIdx.y;
    bf16 *row = S + ((size_t)h * n + i) * T;
    const int valid = min(T, pos0 + i + 1);
    __shared__ float red[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < valid; j += blockDim.x) mx = fmaxf(mx, bf(row[j]));
    mx = warp_max(mx);
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    mx = -INFINITY;
    for (int w = 0; w < nw; w++) mx = fmaxf(mx, red[w]);
    __syncthreads();
    float sum = 0.f;
    for (int j = threadIdx.x; j < valid; j += blockDim.x) sum += expf(bf(row[j]) - mx);
    sum = warp_sum(sum);
    if (lane == 0) red[warp] = sum;
    __syncthreads();
    sum = 0.f;
    for (int w = 0; w < nw; w++) sum += red[w];
    const float inv = 1.f / sum;
    for (int j = threadIdx.x; j < T; j += blockDim.x)
        row[j] = __float2bfloat16(j < valid ? expf(bf(row[j]) - mx) * inv : 0.f);
}

int grid_for(size_t n) {
    size_t g = (n + 255) / 256;
    return (int)(g > 8192 ? 8192 : (g == 0 ? 1 : g));
}

} // namespace

size_t attn_prefill_gemm_bytes(int n, int pos0, int H, int KVH, int hd) {
    const size_t T = (size_t)pos0 + n;
    return ((size_t)H * n * T + (size_t)n * H * hd + T * KVH * hd) * sizeof(bf16);
}

cudaError_t attn_prefill_gemm(cublasHandle_t blas, const bf16 *qkv, int q_stride, int n, int pos0, const bf16 *k,
                              const bf16 *v, int H, int KVH, int hd, void *scratch, bf16 *out, cudaStream_t st,
                              cublasStatus_t *bs) {
    *bs = CUBLAS_STATUS_SUCCESS;
    if (n <= 0) return cudaSuccess;
    if (KVH <= 0 || H % KVH != 0 || hd % 8 != 0) return cudaErrorInvalidValue;
    const int T = pos0 + n, G = H / KVH;
    bf16 *S = static_cast<bf16 *>(scratch);          // [H][n][T]
    bf16 *Qs = S + (size_t)H * n * T;                 // [n][H][hd]
    bf16 *Ks = Qs + (size_t)n * H * hd;               // [T][KVH][hd]
    const float sf = __bfloat162float(__float2bfloat16(sqrtf(1.f / sqrtf((float)hd))));
    scale_rows_kernel<<<grid_for((size_t)n * H * hd / 8), 256, 0, st>>>(qkv, q_stride, H * hd, n, sf, Qs);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    scale_rows_kernel<<<grid_for((size_t)T * KVH * hd / 8), 256, 0, st>>>(k, KVH * hd, KVH * hd, T, sf, Ks);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    const float one = 1.f, zero = 0.f;
    for (int g = 0; g < KVH; g++) {
        // Column-major view: S_h^T [T, n] = op_T(Ks_g [hd, T]) * Qs_h [hd, n].
        *bs = cublasGemmStridedBatchedEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, T, n, hd, &one, Ks + (size_t)g * hd,
                                         CUDA_R_16BF, KVH * hd, 0, Qs + (size_t)g * G * hd, CUDA_R_16BF, H * hd, hd,
                                         &zero, S + (size_t)g * G * n * T, CUDA_R_16BF, T, (long long)n * T, G,
                                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (*bs != CUBLAS_STATUS_SUCCESS) return cudaSuccess;
    }
    softmax_rows_kernel<<<dim3(n, H), 256, 0, st>>>(S, n, T, pos0);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    for (int g = 0; g < KVH; g++) {
        // O_h^T [hd, n] = V_g [hd, T] * P_h^T [T, n], written into out rows.
        *bs = cublasGemmStridedBatchedEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, hd, n, T, &one, v + (size_t)g * hd,
                                         CUDA_R_16BF, KVH * hd, 0, S + (size_t)g * G * n * T, CUDA_R_16BF, T,
                                         (long long)n * T, &zero, out + (size_t)g * G * hd, CUDA_R_16BF, H * hd, hd,
                                         G, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (*bs != CUBLAS_STATUS_SUCCESS) return cudaSuccess;
    }
    return cudaSuccess;
}

} // namespace mg

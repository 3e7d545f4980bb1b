// gemm.cu: prefill matrix products (n > 16 rows) through cuBLAS with bf16
// operands and f32 compute, plus the elementwise helpers the prefill path
// needs around them (bias rows before a beta = 1 product, SwiGLU, the bf16
// residual add, bf16 rounding of f32 logits).
#include "kernels.h"

namespace mg {
namespace {

__global__ void fill_rows_kernel(const bf16 *__restrict__ bias, int rows, int m, bf16 *__restrict__ Y) {
    const size_t n = (size_t)rows * m;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        Y[i] = bias[i % m];
}

// 8 outputs per thread; m % 8 == 0.
__global__ void swiglu_kernel(const bf16 *__restrict__ gu, int rows, int m, bf16 *__restrict__ out) {
    const int per_row = m / 8;
    const size_t n = (size_t)rows * per_row;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const size_t r = i / per_row, c = i % per_row;
        float g[8], u[8], o[8];
        unpack8(ldg16(gu + r * 2 * m + c * 8), g);
        unpack8(ldg16(gu + r * 2 * m + m + c * 8), u);
#pragma unroll
        for (int j = 0; j < 8; j++) o[j] = round_bf16(g[j] / (1.f + __expf(-g[j]))) * u[j];
        *reinterpret_cast<uint4 *>(out + r * m + c * 8) = pack8(o);
    }
}

__global__ void add_kernel(bf16 *__restrict__ x, const bf16 *__restrict__ y, size_t n8) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += stride) {
        float a[8], b[8];
        unpack8(*reinterpret_cast<const uint4 *>(x + i * 8), a);
        unpack8(ldg16(y + i * 8), b);
#pragma unroll
        for (int j = 0; j < 8; j++) a[j] += b[j];
        *reinterpret_cast<uint4 *>(x + i * 8) = pack8(a);
    }
}

__global__ void round_kernel(float *x, size_t n) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) x[i] = round_bf16(x[i]);
}

int blocks_for(size_t n) {
    size_t b = (n + 255) / 256;
    return (int)(b > 4096 ? 4096 : (b == 0 ? 1 : b));
}

} // namespace

cublasStatus_t gemm(cublasHandle_t h, const bf16 *W, const bf16 *X, int n, int m, int k, void *Y,
                    bool y_f32, float beta) {
    return gemm_ld(h, W, X, n, m, k, Y, m, y_f32, beta);
}

cublasStatus_t gemm_ld(cublasHandle_t h, const bf16 *W, const bf16 *X, int n, int m, int k, void *Y, int ldy,
                       bool y_f32, float beta) {
    // Row-major Y[n,m] = X[n,k] W[m,k]^T is, column-major, Y'[m,n] =
    // op_T(W' [k,m]) * X' [k,n], where ' is the same memory read column-major.
    const float alpha = 1.f;
    return cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, W, CUDA_R_16BF, k, X,
                        CUDA_R_16BF, k, &beta, Y, y_f32 ? CUDA_R_32F : CUDA_R_16BF, ldy,
                        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

cudaError_t fill_rows(const bf16 *bias, int rows, int m, bf16 *Y, cudaStream_t st) {
    fill_rows_kernel<<<blocks_for((size_t)rows * m), 256, 0, st>>>(bias, rows, m, Y);
    return cudaGetLastError();
}

cudaError_t swiglu(const bf16 *gu, int rows, int m, bf16 *out, cudaStream_t st) {
    if (m % 8 != 0) return cudaErrorInvalidValue;
    swiglu_kernel<<<blocks_for((size_t)rows * m / 8), 256, 0, st>>>(gu, rows, m, out);
    return cudaGetLastError();
}

} // namespace mg

namespace mg {

cudaError_t add_inplace(bf16 *x, const bf16 *y, size_t n, cudaStream_t st) {
    if (n % 8 != 0) return cudaErrorInvalidValue;
    add_kernel<<<blocks_for(n / 8), 256, 0, st>>>(x, y, n / 8);
    return cudaGetLastError();
}

cudaError_t round_to_bf16(float *x, size_t n, cudaStream_t st) {
    round_kernel<<<blocks_for(n), 256, 0, st>>>(x, n);
    return cudaGetLastError();
}

} // namespace mg

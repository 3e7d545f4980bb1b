// matvec_mma.cu: batched decode matrix-vector products (2-16 rows of x) on
// tensor cores: mma.sync m16n8k16, bf16 inputs, f32 accumulation. The
// weights are still read once per call; what the FMA kernel (matvec.cu)
// pays per extra row of x (re-reading x from L1 per weight row block and
// 8 FMAs per weight per row) becomes one tensor-core op per 16x8x16 tile.
//
// A block owns 16 output rows (SwiGLU: 16 gate + 16 up rows) and its 4 warps
// split K. Each lane loads 16 contiguous bytes of two weight rows and of
// one x row per 32-wide K tile: the sum over k does not care which k goes
// where, so logical fragment index (2q, 2q+1, 2q+8, 2q+9) of k-step j maps
// to physical k 8q + 4j + (0..3), a bijection on the tile that turns the
// fragment loads into plain coalesced 16-byte loads (no shared memory, no
// ldmatrix). Epilogues as matvec.cu's.
#include "kernels.h"
#include "matvec_epilogue.cuh"

namespace mg {
namespace {

constexpr int kWarps = 4;

__device__ __forceinline__ void mma_bf16(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

template <int NT, int EPI>
__global__ void __launch_bounds__(kWarps * 32)
gemv_mma_kernel(const bf16 *__restrict__ W, const bf16 *__restrict__ x, int n, int m, int k,
                const bf16 *__restrict__ bias, bf16 *out, float *__restrict__ out_f32) {
    constexpr int NW = EPI == kSwiGLU ? 2 : 1; // gate and up tiles
    constexpr int NB = NT * 8;
    const int r0 = blockIdx.x * 16;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const bf16 *wr[NW][2];
#pragma unroll
    for (int t = 0; t < NW; t++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = min(r0 + g + 8 * h, m - 1); // clamped rows are read, never written
            wr[t][h] = W + ((size_t)t * m + r) * k;
        }
    const bf16 *xr[NT];
    bool xok[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) {
        xok[j] = g + 8 * j < n;
        xr[j] = x + (size_t)(xok[j] ? g + 8 * j : 0) * k;
    }
    float acc[NW][NT][4];
#pragma unroll
    for (int t = 0; t < NW; t++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[t][j][i] = 0.f;

    const int tiles = k / 32;
#pragma unroll 2
    for (int tile = warp; tile < tiles; tile += kWarps) {
        const size_t off = (size_t)tile * 32 + q * 8;
        uint4 a[NW][2], b[NT];
#pragma unroll
        for (int t = 0; t < NW; t++)
#pragma unroll
            for (int h = 0; h < 2; h++) a[t][h] = ldg16(wr[t][h] + off);
#pragma unroll
        for (int j = 0; j < NT; j++) b[j] = xok[j] ? ldg16(xr[j] + off) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int t = 0; t < NW; t++)
#pragma unroll
            for (int j = 0; j < NT; j++) {
                mma_bf16(acc[t][j], a[t][0].x, a[t][1].x, a[t][0].y, a[t][1].y, b[j].x, b[j].y);
                mma_bf16(acc[t][j], a[t][0].z, a[t][1].z, a[t][0].w, a[t][1].w, b[j].z, b[j].w);
            }
    }

    // C fragment: c0, c1 at (row g, cols 2q, 2q+1), c2, c3 at row g + 8.
    __shared__ float red[kWarps][NW][16][NB];
#pragma unroll
    for (int t = 0; t < NW; t++)
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const int col = 8 * j + 2 * q;
            red[warp][t][g][col] = acc[t][j][0];
            red[warp][t][g][col + 1] = acc[t][j][1];
            red[warp][t][g + 8][col] = acc[t][j][2];
            red[warp][t][g + 8][col + 1] = acc[t][j][3];
        }
    __syncthreads();
    for (int e = threadIdx.x; e < 16 * NB; e += blockDim.x) {
        const int row = e / NB, b = e % NB, r = r0 + row;
        if (b >= n || r >= m) continue;
        float d0 = 0.f, d1 = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; w++) {
            d0 += red[w][0][row][b];
            if (NW == 2) d1 += red[w][NW - 1][row][b];
        }
        gemv_epilogue<EPI>(d0, d1, bias, r, (size_t)b * m + r, out, out_f32);
    }
}

template <int NT>
cudaError_t launch_mma(int epi, const bf16 *W, const bf16 *x, int n, int m, int k, const bf16 *bias, bf16 *out,
                       float *out_f32, cudaStream_t st) {
    const dim3 grid((m + 15) / 16);
    switch (epi) {
    case kStore: gemv_mma_kernel<NT, kStore><<<grid, kWarps * 32, 0, st>>>(W, x, n, m, k, bias, out, out_f32); break;
    case kResidual: gemv_mma_kernel<NT, kResidual><<<grid, kWarps * 32, 0, st>>>(W, x, n, m, k, bias, out, out_f32); break;
    case kSwiGLU: gemv_mma_kernel<NT, kSwiGLU><<<grid, kWarps * 32, 0, st>>>(W, x, n, m, k, bias, out, out_f32); break;
    case kF32: gemv_mma_kernel<NT, kF32><<<grid, kWarps * 32, 0, st>>>(W, x, n, m, k, bias, out, out_f32); break;
    default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

} // namespace

bool gemv_mma_fits(int n, int k) { return n >= 1 && n <= kGemvMaxRows && k > 0 && k % 32 == 0; }

cudaError_t gemv_mma(int epi, const bf16 *W, const bf16 *x, int n, int m, int k, const bf16 *bias, bf16 *out,
                     float *out_f32, cudaStream_t st) {
    if (n <= 0 || m <= 0) return cudaSuccess;
    if (n > kGemvMaxRows) return cudaErrorInvalidValue;
    // K tiles of 32: other widths (none of the Llama shapes) take the FMA kernel
    if (!gemv_mma_fits(n, k)) return gemv(epi, W, x, n, m, k, bias, out, out_f32, st);
    if (n <= 8) return launch_mma<1>(epi, W, x, n, m, k, bias, out, out_f32, st);
    return launch_mma<2>(epi, W, x, n, m, k, bias, out, out_f32, st);
}

} // namespace mg

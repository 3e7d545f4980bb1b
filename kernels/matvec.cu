// matvec.cu: decode matrix-vector products, y = x @ W^T for n <= 16 rows of
// x (one per decoding session). Memory-bound: every weight byte is read once
// per call, so the kernel is shaped for HBM streaming:
//   - 16-byte loads (uint4 = 8 bf16), consecutive threads on consecutive
//     chunks of a weight row (fully coalesced);
//   - each block owns RPB output rows and splits K across all its threads
//     (split-K inside the block; a shared-memory reduce at the end), so even
//     few rows give many loads in flight;
//   - all sessions' x rows are applied to each weight chunk while it is in
//     registers (batch 2-16 costs one pass over the weights);
//   - epilogues fuse bias, the residual add, SwiGLU (gate and up rows in one
//     block) or write f32 logits;
//   - a prologue may fuse the RMSNorm before the product (gemv_norm): each
//     block reads the whole x rows anyway, so it sums their squares in the
//     exact order rmsnorm_kernel does (the same bits) and normalizes each
//     x chunk as it loads it; one kernel and one h round trip fewer.
#include "kernels.h"
#include "matvec_epilogue.cuh"

namespace mg {
namespace {

constexpr int kMaxThreads = 128;

// r[b] = rsqrt(mean(x_b^2) + eps) for the block's rows, bit for bit as
// rmsnorm_kernel computes it, replaying its reduction tree with
// norm_threads(k) virtual threads (common.cuh): virtual thread v sums chunks v, v+VT, ...
// with fmaf, each virtual warp reduces by warp_sum, the warps' sums are
// added in order.
template <int NB>
__device__ void norm_scales(const bf16 *__restrict__ x, int n, int k, float eps, float *r) {
    constexpr int kMaxVW = 256 / 32;
    __shared__ float red[NB][kMaxVW];
    const int chunks = k / 8, VT = norm_threads(k), nvw = VT / 32;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (int b = 0; b < n && b < NB; b++)
        for (int vw = warp; vw < nvw; vw += nw) {
            float ss = 0.f;
            for (int c = vw * 32 + lane; c < chunks; c += VT) {
                float f[8];
                unpack8(ldg16(x + (size_t)b * k + (size_t)c * 8), f);
#pragma unroll
                for (int i = 0; i < 8; i++) ss = fmaf(f[i], f[i], ss);
            }
            ss = warp_sum(ss);
            if (lane == 0) red[b][vw] = ss;
        }
    __syncthreads();
    if ((int)threadIdx.x < NB && (int)threadIdx.x < n) {
        float total = 0.f;
        for (int i = 0; i < nvw; i++) total += red[threadIdx.x][i];
        r[threadIdx.x] = rsqrtf(total / (float)k + eps);
    }
    __syncthreads();
}

template <int NB, int RPB, int EPI, bool NORM>
__global__ void __launch_bounds__(kMaxThreads)
gemv_kernel(const bf16 *__restrict__ W, const bf16 *__restrict__ x, int n, int m, int k,
            const bf16 *__restrict__ bias, bf16 *out, float *__restrict__ out_f32,
            const bf16 *__restrict__ norm_w, float eps) {
    __shared__ float nscale[NB];
    if (NORM) norm_scales<NB>(x, n, k, eps, nscale);
    constexpr int NW = EPI == kSwiGLU ? 2 : 1; // weight rows per output row
    constexpr int WR = RPB * NW;
    const int r0 = blockIdx.x * RPB;
    const bf16 *wrow[WR];
#pragma unroll
    for (int j = 0; j < RPB; j++) {
        // Rows past m are clamped (read, never written) to keep loads uniform.
        const int r = min(r0 + j, m - 1);
        wrow[j * NW] = W + (size_t)r * k;
        if (NW == 2) wrow[j * NW + 1] = W + (size_t)(m + r) * k;
    }
    float acc[WR][NB];
#pragma unroll
    for (int j = 0; j < WR; j++)
#pragma unroll
        for (int b = 0; b < NB; b++) acc[j][b] = 0.f;

    const int chunks = k / 8;
#pragma unroll 2
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        uint4 wv[WR];
#pragma unroll
        for (int j = 0; j < WR; j++) wv[j] = ldg16(wrow[j] + (size_t)c * 8);
        float wf[WR][8];
#pragma unroll
        for (int j = 0; j < WR; j++) unpack8(wv[j], wf[j]);
        float gf[8];
        if (NORM) unpack8(ldg16(norm_w + (size_t)c * 8), gf);
#pragma unroll
        for (int b = 0; b < NB; b++) {
            if (b < n) {
                float xf[8];
                unpack8(ldg16(x + (size_t)b * k + (size_t)c * 8), xf);
                if (NORM) {
                    // rmsnorm_kernel's value: bf16(w * bf16(x * r))
#pragma unroll
                    for (int i = 0; i < 8; i++) xf[i] = round_bf16(gf[i] * round_bf16(xf[i] * nscale[b]));
                }
#pragma unroll
                for (int j = 0; j < WR; j++)
#pragma unroll
                    for (int i = 0; i < 8; i++) acc[j][b] = fmaf(wf[j][i], xf[i], acc[j][b]);
            }
        }
    }

    // Reduce: warps by shuffle, then across warps in shared memory.
    __shared__ float red[kMaxThreads / 32][WR * NB];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < WR; j++)
#pragma unroll
        for (int b = 0; b < NB; b++) {
            float v = warp_sum(acc[j][b]);
            if (lane == 0) red[warp][j * NB + b] = v;
        }
    __syncthreads();
    const int nwarps = blockDim.x >> 5;
    const int t = threadIdx.x;
    if (t >= RPB * NB) return;
    const int jr = t / NB, b = t % NB, r = r0 + jr;
    if (b >= n || r >= m) return;
    float d0 = 0.f, d1 = 0.f;
    for (int w = 0; w < nwarps; w++) {
        d0 += red[w][(jr * NW) * NB + b];
        if (NW == 2) d1 += red[w][(jr * NW + 1) * NB + b];
    }
    gemv_epilogue<EPI>(d0, d1, bias, r, (size_t)b * m + r, out, out_f32);
}

template <int NB, int RPB, bool NORM>
cudaError_t launch_nb(int epi, const bf16 *W, const bf16 *x, int n, int m, int k, const bf16 *bias,
                      bf16 *out, float *out_f32, const bf16 *norm_w, float eps, cudaStream_t st) {
    const int chunks = k / 8;
    const int threads = chunks >= kMaxThreads ? kMaxThreads : ((chunks + 31) / 32) * 32;
    const dim3 grid((m + RPB - 1) / RPB);
    switch (epi) {
    case kStore:
        gemv_kernel<NB, RPB, kStore, NORM><<<grid, threads, 0, st>>>(W, x, n, m, k, bias, out, out_f32, norm_w, eps);
        break;
    case kResidual:
        gemv_kernel<NB, RPB, kResidual, NORM><<<grid, threads, 0, st>>>(W, x, n, m, k, bias, out, out_f32, norm_w, eps);
        break;
    case kSwiGLU:
        gemv_kernel<NB, RPB, kSwiGLU, NORM><<<grid, threads, 0, st>>>(W, x, n, m, k, bias, out, out_f32, norm_w, eps);
        break;
    case kF32:
        gemv_kernel<NB, RPB, kF32, NORM><<<grid, threads, 0, st>>>(W, x, n, m, k, bias, out, out_f32, norm_w, eps);
        break;
    default:
        return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

template <bool NORM>
cudaError_t gemv_any(int epi, const bf16 *W, const bf16 *x, int n, int m, int k, const bf16 *bias, bf16 *out,
                     float *out_f32, const bf16 *norm_w, float eps, cudaStream_t st) {
    if (n <= 0 || m <= 0) return cudaSuccess;
    if (k <= 0 || k % 8 != 0 || n > kGemvMaxRows) return cudaErrorInvalidValue;
    // Rows per block: 2 keeps 2-4 weight loads per thread in flight and the
    // accumulators (RPB * NB * (1 or 2)) in registers up to batch 16.
    if (n == 1) return launch_nb<1, 2, NORM>(epi, W, x, n, m, k, bias, out, out_f32, norm_w, eps, st);
    if (n == 2) return launch_nb<2, 2, NORM>(epi, W, x, n, m, k, bias, out, out_f32, norm_w, eps, st);
    if (n <= 4) return launch_nb<4, 2, NORM>(epi, W, x, n, m, k, bias, out, out_f32, norm_w, eps, st);
    if (n <= 8) return launch_nb<8, 2, NORM>(epi, W, x, n, m, k, bias, out, out_f32, norm_w, eps, st);
    return launch_nb<16, 2, NORM>(epi, W, x, n, m, k, bias, out, out_f32, norm_w, eps, st);
}

} // namespace

cudaError_t gemv(int epi, const bf16 *W, const bf16 *x, int n, int m, int k, const bf16 *bias,
                 bf16 *out, float *out_f32, cudaStream_t st) {
    return gemv_any<false>(epi, W, x, n, m, k, bias, out, out_f32, nullptr, 0.f, st);
}

cudaError_t gemv_norm(int epi, const bf16 *W, const bf16 *x, const bf16 *norm_w, float eps, int n, int m, int k,
                      const bf16 *bias, bf16 *out, float *out_f32, cudaStream_t st) {
    if (epi == kResidual) return cudaErrorInvalidValue; // x is the residual there, never normalized
    return gemv_any<true>(epi, W, x, n, m, k, bias, out, out_f32, norm_w, eps, st);
}

} // namespace mg

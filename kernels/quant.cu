// quant.cu: ggml's block-quantized weights (meshgpu.h MG_Q8_0, MG_Q4_K,
// MG_Q5_K, MG_Q6_K) read as the GGUF file's blocks, never a dequantized copy
// of a whole matrix.
//
// Decode (1-16 activation rows) is ggml-cuda's mmvq scheme: the activation
// rows are rounded to int8 per group of 32 (xd = max|x| / 127, ggml's q8_1
// without its sum) and each weight group's integer dot product with them is
// a few dp4a instructions, f32 accumulation of (group scale * xd) * dot.
// Why not dequantize to bf16 in registers and reuse matvec.cu's FMA loop:
// Q4_K is 0.56 bytes per weight, so at the H200's 4.8 TB/s the kernel has
// about 7 integer/float instructions per weight byte to spend; unpacking a
// nibble, converting it and an FMA per weight is ~4 instructions per weight
// (7 per byte: compute-bound), against ~0.6 per weight with dp4a (4
// multiply-adds per instruction on the packed nibbles). The same loop serves
// 1-16 rows, each weight item loaded once for all of them.
//
// The unit of work is an item of 32 weights of one row: two runs of 16
// consecutive weights, each with one scale (and min), whose q values sit in
// 16 bytes of the block (16 + 16 for Q8_0). load_item gives their int8
// values (K-quant nibbles and high bits assembled, Q6_K's less 32), the runs'
// first element and their f32 scales; the matrix-vector product, the
// dequantization for prefill and the embedding gather all read items, so
// the block layouts are decoded in one place.
//
// Prefill (more rows) dequantizes row chunks of a matrix to bf16 in a
// scratch buffer and runs cuBLAS on them (gemm.cu).
#include <cuda_fp16.h>

#include "kernels.h"
#include "matvec_epilogue.cuh"

namespace mg {

bool quant_block(int dtype, int *elems, int *bytes) {
    int e = 0, b = 0;
    switch (dtype) {
    case MG_Q8_0: e = 32, b = 34; break;
    case MG_Q4_K: e = 256, b = 144; break;
    case MG_Q5_K: e = 256, b = 176; break;
    case MG_Q6_K: e = 256, b = 210; break;
    default: return false;
    }
    if (elems) *elems = e;
    if (bytes) *bytes = b;
    return true;
}

size_t quant_row_bytes(int dtype, long long cols) {
    int e = 0, b = 0;
    if (!quant_block(dtype, &e, &b) || cols <= 0 || cols % e != 0) return 0;
    return (size_t)(cols / e) * (size_t)b;
}

namespace {

constexpr int kQThreads = 128;

// An f16 at a 2-byte aligned address (Q8_0 and Q6_K blocks are 34 and 210
// bytes: only 2-byte alignment holds for every block).
__device__ __forceinline__ float ldh(const uint8_t *p) {
    return __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short *>(p))));
}
// Four bytes at a 2-byte aligned address.
__device__ __forceinline__ uint32_t ld32a2(const uint8_t *p) {
    const unsigned short *h = reinterpret_cast<const unsigned short *>(p);
    return (uint32_t)__ldg(h) | ((uint32_t)__ldg(h + 1) << 16);
}

// ggml's 6-bit scale and min j of a Q4_K/Q5_K block's 12 scale bytes.
__device__ __forceinline__ void k4_scale_min(const uint8_t *s12, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = __ldg(s12 + j) & 63;
        *m = __ldg(s12 + j + 4) & 63;
    } else {
        const int a = __ldg(s12 + j + 4);
        *sc = (a & 0xF) | ((__ldg(s12 + j - 4) >> 6) << 4);
        *m = (a >> 4) | ((__ldg(s12 + j) >> 6) << 4);
    }
}

// 32 weights of one row: runs lo and hi of 16, at elements xlo and xhi of
// the row; value = s * q - m (m = 0 without mins). q are int8 in 4 words.
struct Item {
    int lo[4], hi[4];
    float slo, shi, mlo, mhi;
    int xlo, xhi;
};

template <int T> __device__ __forceinline__ void load_item(const uint8_t *__restrict__ row, int it, Item &w) {
    if (T == MG_Q8_0) {
        const uint8_t *blk = row + (size_t)it * 34;
        const float d = ldh(blk);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w.lo[i] = (int)ld32a2(blk + 2 + 4 * i);
            w.hi[i] = (int)ld32a2(blk + 18 + 4 * i);
        }
        w.slo = w.shi = d;
        w.mlo = w.mhi = 0.f;
        w.xlo = 32 * it;
        w.xhi = 32 * it + 16;
    } else if (T == MG_Q4_K || T == MG_Q5_K) {
        // Per 64 elements p: 32 bytes of nibbles, low nibbles group 2p,
        // high nibbles group 2p+1; item (p, hf) takes bytes 16hf..16hf+15.
        const int b = it >> 3, p = (it >> 1) & 3, hf = it & 1;
        const uint8_t *blk = row + (size_t)b * (T == MG_Q4_K ? 144 : 176);
        const float d = ldh(blk), dmin = ldh(blk + 2);
        int sc0, m0, sc1, m1;
        k4_scale_min(blk + 4, 2 * p, &sc0, &m0);
        k4_scale_min(blk + 4, 2 * p + 1, &sc1, &m1);
        const uint4 v = ldg16(blk + (T == MG_Q4_K ? 16 : 48) + 32 * p + 16 * hf);
        const uint32_t vw[4] = {v.x, v.y, v.z, v.w};
        uint32_t hw[4] = {0, 0, 0, 0};
        if (T == MG_Q5_K) { // fifth bits: bit 2p (low) and 2p+1 (high) of qh[l]
            const uint4 h = ldg16(blk + 16 + 16 * hf);
            hw[0] = h.x, hw[1] = h.y, hw[2] = h.z, hw[3] = h.w;
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w.lo[i] = (int)((vw[i] & 0x0F0F0F0Fu) | (((hw[i] >> (2 * p)) & 0x01010101u) << 4));
            w.hi[i] = (int)(((vw[i] >> 4) & 0x0F0F0F0Fu) | (((hw[i] >> (2 * p + 1)) & 0x01010101u) << 4));
        }
        // ggml's f32 products d * sc and dmin * m, each rounded once
        w.slo = __fmul_rn(d, (float)sc0);
        w.shi = __fmul_rn(d, (float)sc1);
        w.mlo = __fmul_rn(dmin, (float)m0);
        w.mhi = __fmul_rn(dmin, (float)m1);
        w.xlo = 256 * b + 64 * p + 16 * hf;
        w.xhi = w.xlo + 32;
    } else { // MG_Q6_K
        // Per 128 elements h, element 32 quad + l takes the low (quads 0, 1)
        // or high (2, 3) nibble of ql[64h + 32 (quad & 1) + l] and bits
        // 2 quad of qh[32h + l]; 16 groups of 16 with int8 scales. Item
        // (h, half, lh): quads half and half + 2, l = 16 lh .. 16 lh + 15.
        const int b = it >> 3, sub = it & 7, h = sub >> 2, half = (sub >> 1) & 1, lh = sub & 1;
        const uint8_t *blk = row + (size_t)b * 210;
        const uint8_t *ql = blk + 16 * sub, *qh = blk + 128 + 32 * h + 16 * lh;
        const float d = ldh(blk + 208);
        const int g = 8 * h + 2 * half + lh;
        const int sc0 = (int8_t)__ldg(blk + 192 + g), sc1 = (int8_t)__ldg(blk + 192 + g + 4);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t a = ld32a2(ql + 4 * i), c = ld32a2(qh + 4 * i);
            w.lo[i] = (int)__vsub4((a & 0x0F0F0F0Fu) | (((c >> (2 * half)) & 0x03030303u) << 4), 0x20202020u);
            w.hi[i] = (int)__vsub4(((a >> 4) & 0x0F0F0F0Fu) | (((c >> (2 * half + 4)) & 0x03030303u) << 4), 0x20202020u);
        }
        w.slo = __fmul_rn(d, (float)sc0);
        w.shi = __fmul_rn(d, (float)sc1);
        w.mlo = w.mhi = 0.f;
        w.xlo = 256 * b + 128 * h + 32 * half + 16 * lh;
        w.xhi = w.xlo + 64;
    }
}

__host__ __device__ constexpr bool has_min(int T) { return T == MG_Q4_K || T == MG_Q5_K; }

__device__ __forceinline__ int dot16(const int q[4], const int4 &x, int acc) {
    acc = __dp4a(q[0], x.x, acc);
    acc = __dp4a(q[1], x.y, acc);
    acc = __dp4a(q[2], x.z, acc);
    return __dp4a(q[3], x.w, acc);
}

// The item's contribution to x . row, x one activation row as int8 [k] and
// its group scales xd [k / 32]: xd * (s * (q . xq) - m * sum(xq)) per run,
// so the result is the exact product of the dequantized weights with the
// rounded activations up to f32 rounding.
template <int T>
__device__ __forceinline__ float dot_item(const Item &w, const int8_t *__restrict__ xq, const float *__restrict__ xd) {
    const int4 a = __ldg(reinterpret_cast<const int4 *>(xq + w.xlo));
    const int4 c = __ldg(reinterpret_cast<const int4 *>(xq + w.xhi));
    const int dl = dot16(w.lo, a, 0), dh = dot16(w.hi, c, 0);
    const float xl = __ldg(xd + (w.xlo >> 5)), xh = __ldg(xd + (w.xhi >> 5));
    if (has_min(T)) {
        const int ones[4] = {0x01010101, 0x01010101, 0x01010101, 0x01010101};
        const int sl = dot16(ones, a, 0), sh = dot16(ones, c, 0);
        return xl * (w.slo * (float)dl - w.mlo * (float)sl) + xh * (w.shi * (float)dh - w.mhi * (float)sh);
    }
    return xl * (w.slo * (float)dl) + xh * (w.shi * (float)dh);
}

// Row i (0..m-1 of the launch) of up to three segments: segment j holds
// rows end[j-1]..end[j]-1 at w[j], written to output columns out0[j]...
struct SegRow {
    const uint8_t *w;
    int col;
};
__device__ __forceinline__ SegRow seg_row(const QSegs &sg, int i, size_t rb) {
    int j = 0;
    while (j + 1 < sg.n && i >= sg.end[j]) j++;
    const int first = j ? sg.end[j - 1] : 0;
    return {static_cast<const uint8_t *>(sg.w[j]) + (size_t)(i - first) * rb, sg.out0[j] + (i - first)};
}

// matvec.cu's structure (RPB output rows per block, split-K over the
// block's threads, warp shuffles then shared memory, the shared epilogue)
// over items instead of 8-element bf16 chunks. kSwiGLU pairs gate row i
// (segment 0) with row i of up.
template <int T, int NB, int RPB, int EPI>
__global__ void __launch_bounds__(kQThreads)
qgemv_kernel(QSegs sg, const uint8_t *__restrict__ up, size_t rb, const int8_t *__restrict__ xq,
             const float *__restrict__ xd, int n, int m, int k, const bf16 *__restrict__ bias, bf16 *out,
             float *__restrict__ out_f32, int ldo) {
    constexpr int NW = EPI == kSwiGLU ? 2 : 1;
    constexpr int WR = RPB * NW;
    const int r0 = blockIdx.x * RPB;
    const uint8_t *wrow[WR];
    int col[RPB];
#pragma unroll
    for (int j = 0; j < RPB; j++) {
        const int r = min(r0 + j, m - 1); // clamped rows are read, never written
        const SegRow s = seg_row(sg, r, rb);
        wrow[j * NW] = s.w;
        col[j] = s.col;
        if (NW == 2) wrow[j * NW + 1] = up + (size_t)r * rb;
    }
    float acc[WR][NB];
#pragma unroll
    for (int j = 0; j < WR; j++)
#pragma unroll
        for (int b = 0; b < NB; b++) acc[j][b] = 0.f;

    const int items = k / 32, groups = k / 32;
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
        Item w[WR];
#pragma unroll
        for (int j = 0; j < WR; j++) load_item<T>(wrow[j], it, w[j]);
#pragma unroll
        for (int b = 0; b < NB; b++) {
            if (b < n) {
#pragma unroll
                for (int j = 0; j < WR; j++)
                    acc[j][b] += dot_item<T>(w[j], xq + (size_t)b * k, xd + (size_t)b * groups);
            }
        }
    }

    __shared__ float red[kQThreads / 32][WR * NB];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < WR; j++)
#pragma unroll
        for (int b = 0; b < NB; b++) {
            const float v = warp_sum(acc[j][b]);
            if (lane == 0) red[warp][j * NB + b] = v;
        }
    __syncthreads();
    const int nwarps = blockDim.x >> 5, t = threadIdx.x;
    if (t >= RPB * NB) return;
    const int jr = t / NB, b = t % NB, r = r0 + jr;
    if (b >= n || r >= m) return;
    float d0 = 0.f, d1 = 0.f;
    for (int w = 0; w < nwarps; w++) {
        d0 += red[w][(jr * NW) * NB + b];
        if (NW == 2) d1 += red[w][(jr * NW + 1) * NB + b];
    }
    gemv_epilogue<EPI>(d0, d1, bias, col[jr], (size_t)b * ldo + col[jr], out, out_f32);
}

// One block per row: (with NORM) the row's RMSNorm as rmsnorm_kernel
// computes it, bf16(w * bf16(x * r)), then per group of 32 (one warp each)
// xd = max|v| / 127 and xq = round(v / xd) as ggml's quantize_q8_1.
template <bool NORM>
__global__ void quantize_rows_kernel(const bf16 *__restrict__ x, const bf16 *__restrict__ norm_w, float eps, int k,
                                     int8_t *__restrict__ xq, float *__restrict__ xd) {
    const bf16 *xr = x + (size_t)blockIdx.x * k;
    float r = 1.f;
    if (NORM) r = row_rms_scale(xr, k, eps); // launched with norm_threads(k) threads
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (int g = warp; g < k / 32; g += nw) {
        const int e = g * 32 + lane;
        float v = bf(xr[e]);
        if (NORM) v = round_bf16(bf(norm_w[e]) * round_bf16(v * r));
        const float amax = warp_max(fabsf(v));
        const float d = amax / 127.f;
        xq[(size_t)blockIdx.x * k + e] = (int8_t)(amax == 0.f ? 0 : (int)roundf(v / d));
        if (lane == 0) xd[(size_t)blockIdx.x * (k / 32) + g] = d;
    }
}

// An item's 32 values as bf16 (f32 s * q - m, each product and the
// difference rounded as ggml's dequantization, then one bf16 rounding).
template <int T> __device__ __forceinline__ void store_item(const Item &w, bf16 *__restrict__ orow) {
    float f[16];
#pragma unroll
    for (int run = 0; run < 2; run++) {
        const int *q = run ? w.hi : w.lo;
        const float s = run ? w.shi : w.slo, mn = run ? w.mhi : w.mlo;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const float qv = (float)(int8_t)(q[i / 4] >> (8 * (i % 4)));
            f[i] = has_min(T) ? __fsub_rn(__fmul_rn(s, qv), mn) : __fmul_rn(s, qv);
        }
        uint4 *o = reinterpret_cast<uint4 *>(orow + (run ? w.xhi : w.xlo));
        o[0] = pack8(f);
        o[1] = pack8(f + 8);
    }
}

template <int T>
__global__ void dequant_kernel(const uint8_t *__restrict__ W, size_t rb, int rows, int k, bf16 *__restrict__ out) {
    const int per_row = k / 32;
    const size_t n = (size_t)rows * per_row, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const size_t r = i / per_row;
        Item w;
        load_item<T>(W + r * rb, (int)(i % per_row), w);
        store_item<T>(w, out + r * k);
    }
}

template <int T>
__global__ void embed_q_kernel(const uint8_t *__restrict__ table, size_t rb, const int32_t *__restrict__ tokens,
                               int hidden, bf16 *__restrict__ out) {
    const uint8_t *row = table + (size_t)tokens[blockIdx.x] * rb;
    for (int it = threadIdx.x; it < hidden / 32; it += blockDim.x) {
        Item w;
        load_item<T>(row, it, w);
        store_item<T>(w, out + (size_t)blockIdx.x * hidden);
    }
}

template <int T, int NB, int RPB>
cudaError_t launch_q(int epi, const QSegs &sg, const void *up, size_t rb, const int8_t *xq, const float *xd, int n,
                     int m, int k, const bf16 *bias, bf16 *out, float *out_f32, int ldo, cudaStream_t st) {
    const int items = k / 32;
    const int threads = items >= kQThreads ? kQThreads : ((items + 31) / 32) * 32;
    const dim3 grid((m + RPB - 1) / RPB);
    const uint8_t *u = static_cast<const uint8_t *>(up);
    switch (epi) {
    case kStore: qgemv_kernel<T, NB, RPB, kStore><<<grid, threads, 0, st>>>(sg, u, rb, xq, xd, n, m, k, bias, out, out_f32, ldo); break;
    case kResidual: qgemv_kernel<T, NB, RPB, kResidual><<<grid, threads, 0, st>>>(sg, u, rb, xq, xd, n, m, k, bias, out, out_f32, ldo); break;
    case kSwiGLU: qgemv_kernel<T, NB, RPB, kSwiGLU><<<grid, threads, 0, st>>>(sg, u, rb, xq, xd, n, m, k, bias, out, out_f32, ldo); break;
    case kF32: qgemv_kernel<T, NB, RPB, kF32><<<grid, threads, 0, st>>>(sg, u, rb, xq, xd, n, m, k, bias, out, out_f32, ldo); break;
    default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

template <int T>
cudaError_t qgemv_t(int epi, const QSegs &sg, const void *up, size_t rb, const int8_t *xq, const float *xd, int n, int m,
                    int k, const bf16 *bias, bf16 *out, float *out_f32, int ldo, cudaStream_t st) {
    // Two rows per block keep two weight items per thread in flight up to
    // batch 4; from 8 rows the accumulators (and SwiGLU's second weight
    // row) would spill, so one.
    if (n == 1) return launch_q<T, 1, 2>(epi, sg, up, rb, xq, xd, n, m, k, bias, out, out_f32, ldo, st);
    if (n == 2) return launch_q<T, 2, 2>(epi, sg, up, rb, xq, xd, n, m, k, bias, out, out_f32, ldo, st);
    if (n <= 4) return launch_q<T, 4, 2>(epi, sg, up, rb, xq, xd, n, m, k, bias, out, out_f32, ldo, st);
    if (n <= 8) return launch_q<T, 8, 1>(epi, sg, up, rb, xq, xd, n, m, k, bias, out, out_f32, ldo, st);
    return launch_q<T, 16, 1>(epi, sg, up, rb, xq, xd, n, m, k, bias, out, out_f32, ldo, st);
}

int blocks_for(size_t n) {
    const size_t b = (n + 255) / 256;
    return (int)(b > 8192 ? 8192 : (b == 0 ? 1 : b));
}

} // namespace

cudaError_t quantize_rows(const bf16 *x, const bf16 *norm_w, float eps, int n, int k, int8_t *xq, float *xd,
                          cudaStream_t st) {
    if (n <= 0) return cudaSuccess;
    if (k <= 0 || k % 32 != 0) return cudaErrorInvalidValue;
    if (norm_w) {
        quantize_rows_kernel<true><<<n, norm_threads(k), 0, st>>>(x, norm_w, eps, k, xq, xd);
    } else {
        const int threads = k / 32 >= 8 ? 256 : 32 * (k / 32);
        quantize_rows_kernel<false><<<n, threads, 0, st>>>(x, nullptr, eps, k, xq, xd);
    }
    return cudaGetLastError();
}

cudaError_t qgemv(int epi, int dtype, const QSegs &segs, const void *up, int n, int m, int k, const int8_t *xq,
                  const float *xd, const bf16 *bias, bf16 *out, float *out_f32, int ldo, cudaStream_t st) {
    if (n <= 0 || m <= 0) return cudaSuccess;
    const size_t rb = quant_row_bytes(dtype, k);
    if (!rb || n > kGemvMaxRows || segs.n < 1 || segs.n > 3 || segs.end[segs.n - 1] != m) return cudaErrorInvalidValue;
    if ((epi == kSwiGLU) != (up != nullptr) || (epi == kSwiGLU && segs.n != 1)) return cudaErrorInvalidValue;
    switch (dtype) {
    case MG_Q8_0: return qgemv_t<MG_Q8_0>(epi, segs, up, rb, xq, xd, n, m, k, bias, out, out_f32, ldo, st);
    case MG_Q4_K: return qgemv_t<MG_Q4_K>(epi, segs, up, rb, xq, xd, n, m, k, bias, out, out_f32, ldo, st);
    case MG_Q5_K: return qgemv_t<MG_Q5_K>(epi, segs, up, rb, xq, xd, n, m, k, bias, out, out_f32, ldo, st);
    case MG_Q6_K: return qgemv_t<MG_Q6_K>(epi, segs, up, rb, xq, xd, n, m, k, bias, out, out_f32, ldo, st);
    }
    return cudaErrorInvalidValue;
}

cudaError_t dequant_rows(int dtype, const void *W, int rows, int k, bf16 *out, cudaStream_t st) {
    if (rows <= 0) return cudaSuccess;
    const size_t rb = quant_row_bytes(dtype, k);
    if (!rb) return cudaErrorInvalidValue;
    const uint8_t *w = static_cast<const uint8_t *>(W);
    const int grid = blocks_for((size_t)rows * (k / 32));
    switch (dtype) {
    case MG_Q8_0: dequant_kernel<MG_Q8_0><<<grid, 256, 0, st>>>(w, rb, rows, k, out); break;
    case MG_Q4_K: dequant_kernel<MG_Q4_K><<<grid, 256, 0, st>>>(w, rb, rows, k, out); break;
    case MG_Q5_K: dequant_kernel<MG_Q5_K><<<grid, 256, 0, st>>>(w, rb, rows, k, out); break;
    case MG_Q6_K: dequant_kernel<MG_Q6_K><<<grid, 256, 0, st>>>(w, rb, rows, k, out); break;
    default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

cudaError_t embed_quant(int dtype, const void *table, const int32_t *tokens, int n, int hidden, bf16 *out,
                        cudaStream_t st) {
    if (n <= 0) return cudaSuccess;
    const size_t rb = quant_row_bytes(dtype, hidden);
    if (!rb) return cudaErrorInvalidValue;
    const uint8_t *t = static_cast<const uint8_t *>(table);
    const int items = hidden / 32, threads = items >= 256 ? 256 : ((items + 31) / 32) * 32;
    switch (dtype) {
    case MG_Q8_0: embed_q_kernel<MG_Q8_0><<<n, threads, 0, st>>>(t, rb, tokens, hidden, out); break;
    case MG_Q4_K: embed_q_kernel<MG_Q4_K><<<n, threads, 0, st>>>(t, rb, tokens, hidden, out); break;
    case MG_Q5_K: embed_q_kernel<MG_Q5_K><<<n, threads, 0, st>>>(t, rb, tokens, hidden, out); break;
    case MG_Q6_K: embed_q_kernel<MG_Q6_K><<<n, threads, 0, st>>>(t, rb, tokens, hidden, out); break;
    default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

} // namespace mg

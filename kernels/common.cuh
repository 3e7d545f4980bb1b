// common.cuh: device helpers shared by every kernel file (bf16 packing and
// unpacking, warp reductions, 16-byte loads) and the per-row metadata decode
// kernels read from device memory. No launchers: kernels.h declares those.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

namespace mg {

constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
    return v;
}

// Eight bf16 packed in 16 bytes -> eight floats. bf16 is the top half of an
// f32, so the conversion is a shift or a mask (element 0 is the low half).
__device__ __forceinline__ void unpack8(const uint4 &u, float f[8]) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&h);
}

__device__ __forceinline__ uint4 pack8(const float f[8]) {
    return make_uint4(pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7]));
}

__device__ __forceinline__ float bf(bf16 h) { return __bfloat162float(h); }
// Round to bf16 and back: where HF bf16 stores an intermediate tensor.
__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

// 16-byte load through the read-only path.
__device__ __forceinline__ uint4 ldg16(const void *p) { return __ldg(reinterpret_cast<const uint4 *>(p)); }

// rmsnorm_kernel's thread count for a row of dim elements (rmsnorm.cu).
// Kernels that fold the norm into their prologue sum in its order with it,
// so they give its bits.
__host__ __device__ constexpr int norm_threads(int dim) {
    return dim / 8 >= 256 ? 256 : ((dim / 8 + 31) / 32) * 32;
}

// rsqrt(mean(x^2) + eps) of one bf16 row of dim elements (a multiple of 8),
// summed by a block of norm_threads(dim) threads: each thread's chunks with
// fmaf, warp_sum per warp, the warps' sums in order. Every thread gets it.
__device__ __forceinline__ float row_rms_scale(const bf16 *__restrict__ xr, int dim, float eps) {
    const int chunks = dim / 8;
    float ss = 0.f;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        float f[8];
        unpack8(ldg16(xr + c * 8), f);
#pragma unroll
        for (int i = 0; i < 8; i++) ss = fmaf(f[i], f[i], ss);
    }
    __shared__ float red[256 / 32];
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    float total = 0.f;
    for (int i = 0; i < (int)(blockDim.x >> 5); i++) total += red[i];
    return rsqrtf(total / (float)dim + eps);
}

} // namespace mg

// One activation row's place in a session's KV cache. Decode kernels read it
// from device memory so a captured graph serves any sessions and positions.
struct mg_row_meta {
    bf16 *k;              // session's K cache at the stack's first layer
    bf16 *v;              // session's V cache at the stack's first layer
    long long layer_stride; // elements between two layers' caches
    int32_t pos;          // this row's position; it attends keys 0..pos
    int32_t pad;
};

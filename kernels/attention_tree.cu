// attention_tree.cu: attention of a token tree (meshgpu.h mg_tree_step):
// query row i attends to the cached keys 0..pos0-1 and to this call's keys
// j with mask[i*n + j] set (its ancestors and itself), nothing else.
//
// One block per (query row, head); its warps take keys in turn (a key the
// row does not see is skipped by the whole warp), each lane holding HD/32
// dimensions, with an online f32 softmax; the warps' partial results merge
// at the end. Numerics are flash-style f32 (MG_ATTENTION_F32) whatever the
// backend's setting: a tree is a verify pass of at most MG_MAX_TREE_ROWS
// rows, where the exact scores matter more than HF's bf16 roundings.
#include "kernels.h"

namespace mg {
namespace {

constexpr int kTreeWarps = 4;

template <int HD>
__global__ void __launch_bounds__(kTreeWarps * 32)
attn_tree_kernel(const bf16 *__restrict__ qkv, int q_stride, int n, int pos0, const uint8_t *__restrict__ mask,
                 const bf16 *__restrict__ k, const bf16 *__restrict__ v, int H, int KVH, bf16 *__restrict__ out) {
    constexpr int D = HD / 32;
    const int row = blockIdx.x, h = blockIdx.y, kvh = h / (H / KVH);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float scale = 1.0f / sqrtf((float)HD);
    const size_t ps = (size_t)KVH * HD;
    float q[D], acc[D];
#pragma unroll
    for (int d = 0; d < D; d++) {
        q[d] = bf(qkv[(size_t)row * q_stride + (size_t)h * HD + lane * D + d]);
        acc[d] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    const int len = pos0 + row + 1;
    for (int p = warp; p < len; p += kTreeWarps) {
        if (p >= pos0 && !mask[(size_t)row * n + (p - pos0)]) continue; // the same for the whole warp
        const bf16 *kp = k + (size_t)p * ps + (size_t)kvh * HD + lane * D;
        const bf16 *vp = v + (size_t)p * ps + (size_t)kvh * HD + lane * D;
        float s = 0.f;
#pragma unroll
        for (int d = 0; d < D; d++) s = fmaf(q[d], bf(kp[d]), s);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        s *= scale;
        const float mn = fmaxf(m, s), c = expf(m - mn), e = expf(s - mn);
        l = l * c + e;
#pragma unroll
        for (int d = 0; d < D; d++) acc[d] = acc[d] * c + e * bf(vp[d]);
        m = mn;
    }
    __shared__ float part[kTreeWarps][HD + 2];
#pragma unroll
    for (int d = 0; d < D; d++) part[warp][lane * D + d] = acc[d];
    if (lane == 0) part[warp][HD] = m, part[warp][HD + 1] = l;
    __syncthreads();
    if (warp != 0) return;
    // every row sees key 0 or itself, so some warp's max is finite
    float M = -INFINITY;
    for (int w = 0; w < kTreeWarps; w++) M = fmaxf(M, part[w][HD]);
    float L = 0.f, o[D];
#pragma unroll
    for (int d = 0; d < D; d++) o[d] = 0.f;
    for (int w = 0; w < kTreeWarps; w++) {
        if (part[w][HD] == -INFINITY) continue; // a warp that saw no key
        const float c = expf(part[w][HD] - M);
        L += part[w][HD + 1] * c;
#pragma unroll
        for (int d = 0; d < D; d++) o[d] += part[w][lane * D + d] * c;
    }
#pragma unroll
    for (int d = 0; d < D; d++) out[(size_t)row * H * HD + (size_t)h * HD + lane * D + d] = __float2bfloat16(o[d] / L);
}

} // namespace

cudaError_t attn_tree(const bf16 *qkv, int q_stride, int n, int pos0, const uint8_t *mask, const bf16 *k,
                      const bf16 *v, int H, int KVH, int hd, bf16 *out, cudaStream_t st) {
    const dim3 grid(n, H), block(kTreeWarps * 32);
    switch (hd) {
    case 32: attn_tree_kernel<32><<<grid, block, 0, st>>>(qkv, q_stride, n, pos0, mask, k, v, H, KVH, out); break;
    case 64: attn_tree_kernel<64><<<grid, block, 0, st>>>(qkv, q_stride, n, pos0, mask, k, v, H, KVH, out); break;
    case 128: attn_tree_kernel<128><<<grid, block, 0, st>>>(qkv, q_stride, n, pos0, mask, k, v, H, KVH, out); break;
    default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

} // namespace mg

// rope.cu: rotary embedding (HF rotate_half convention: element i pairs with
// i + hd/2) fused with the KV-cache append: one pass over the new q/k/v rows
// rotates q in place and writes rotated k and plain v into the session's
// bf16 cache [layer][pos][kv_head][hd]. cos/sin come from a per-stack f32
// table computed on the host as HF computes inv_freq (llama3 scaling too),
// and are rounded to bf16 where HF rounds them.
#include "kernels.h"

namespace mg {
namespace {

__global__ void rope_append_kernel(bf16 *__restrict__ qkv, int H, int KVH, int hd,
                                   const float2 *__restrict__ cs, const mg_row_meta *__restrict__ meta,
                                   int layer) {
    const int row = blockIdx.y;
    const int half = hd / 2;
    const int stride = (H + 2 * KVH) * hd;
    bf16 *x = qkv + (size_t)row * stride;
    const mg_row_meta mr = meta[row];
    const float2 *c = cs + (size_t)mr.pos * half;
    const size_t cache_off = (size_t)layer * mr.layer_stride + (size_t)mr.pos * KVH * hd;
    const int pairs = (H + KVH) * half;
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < pairs) {
        const int head = t / half, i = t % half;
        bf16 *hx = x + head * hd;
        const float x1 = bf(hx[i]), x2 = bf(hx[i + half]);
        // HF bf16: cos and sin are cast to bf16, then q*cos + rotate_half(q)*sin
        // runs as bf16 tensor ops (each product and the sum rounded).
        const float2 f = c[i];
        const float cb = round_bf16(f.x), sb = round_bf16(f.y);
        const bf16 o1 = __float2bfloat16(round_bf16(x1 * cb) - round_bf16(x2 * sb));
        const bf16 o2 = __float2bfloat16(round_bf16(x2 * cb) + round_bf16(x1 * sb));
        if (head < H) {
            hx[i] = o1;
            hx[i + half] = o2;
        } else {
            bf16 *k = mr.k + cache_off + (head - H) * hd;
            k[i] = o1;
            k[i + half] = o2;
        }
    }
    if (t < KVH * hd) mr.v[cache_off + t] = x[(H + KVH) * hd + t];
}

} // namespace

cudaError_t rope_append(bf16 *qkv, int rows, int H, int KVH, int hd, const float2 *cs,
                        const mg_row_meta *meta, int layer, cudaStream_t st) {
    if (rows <= 0) return cudaSuccess;
    const int work = max((H + KVH) * hd / 2, KVH * hd);
    const dim3 grid((work + 127) / 128, rows);
    rope_append_kernel<<<grid, 128, 0, st>>>(qkv, H, KVH, hd, cs, meta, layer);
    return cudaGetLastError();
}

} // namespace mg

namespace mg {

void rope_inv_freq(int type, float theta, float factor, float low_freq_factor,
                   float high_freq_factor, int original_max_pos, int hd, float *inv_freq) {
    const int half = hd / 2;
    for (int i = 0; i < half; i++) {
        // HF: 1.0 / (base ** (arange(0, dim, 2).float() / dim)), all f32.
        const float e = (float)(2 * i) / (float)hd;
        inv_freq[i] = 1.0f / powf(theta, e);
    }
    if (type != 1) return;
    // HF _compute_llama3_parameters, elementwise in f32.
    const float low_wavelen = (float)original_max_pos / low_freq_factor;
    const float high_wavelen = (float)original_max_pos / high_freq_factor;
    const float two_pi = 6.283185307179586f;
    for (int i = 0; i < half; i++) {
        const float f = inv_freq[i];
        const float wavelen = two_pi / f;
        const float scaled = wavelen > low_wavelen ? f / factor : f;
        const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
        if (medium) {
            const float smooth = ((float)original_max_pos / wavelen - low_freq_factor) /
                                 (high_freq_factor - low_freq_factor);
            inv_freq[i] = (1.f - smooth) * scaled / factor + smooth * scaled;
        } else {
            inv_freq[i] = scaled;
        }
    }
}

void rope_table(const float *inv_freq, int hd, int max_pos, float2 *table) {
    const int half = hd / 2;
    for (int p = 0; p < max_pos; p++)
        for (int i = 0; i < half; i++) {
            // HF: freqs = inv_freq * position in f32, then cos/sin in f32.
            const float a = (float)p * inv_freq[i];
            table[(size_t)p * half + i] = make_float2(cosf(a), sinf(a));
        }
}

} // namespace mg

// attention_fused.cu: decode attention with the RoPE and the KV-cache append
// inside it, and the chunks merged by the last block of each (row, kv head)
// (--cuda-fused-decode; dispatch.h Kernel::AttnDecodeRope). The same
// numerics and the same bits as rope_append (rope.cu) followed by
// attn_decode (attention.cu): the same sums in the same order; what changes
// is where they run.
//
// Every block of (kv head, chunk, row) rotates its G query heads itself
// (G * hd / 2 pairs, cheaper than a launch); the block whose chunk holds the
// row's position rotates the new key, appends key and value to the cache and
// uses them from shared memory (a key written by this kernel is never read
// back through the read-only cache). Then:
//   f32 numerics: one launch. Each block writes its chunk's unnormalized
//     output, max and sum; the last block of a (row, kv head) to arrive
//     (an atomic count, threadfence-reduction style: no block waits for
//     another, so no co-residency is assumed) merges them in chunk order.
//   bf16 numerics (HF math SDPA): the normalized bf16 probabilities need the
//     row's max and sum before P @ V, so two launches: scores (with the
//     RoPE and append) and P @ V, whose last block per (row, kv head) adds
//     the chunks in order (attn_sum_kernel's job).
// rope_append + attn_decode's four launches per layer (bf16) become two, their
// three (f32) one. Rows must be
// single-token steps of distinct sessions: a row's new key is visible to
// the row's own blocks only.
#include "kernels.h"

namespace mg {
namespace {

constexpr int kMaxG = 8;
constexpr int kThreads = 128;

// The pair (x1, x2) of a head rotated as rope.cu rotates it (HF bf16).
__device__ __forceinline__ void rotate_pair(float x1, float x2, float2 f, bf16 *o1, bf16 *o2) {
    const float cb = round_bf16(f.x), sb = round_bf16(f.y);
    *o1 = __float2bfloat16(round_bf16(x1 * cb) - round_bf16(x2 * sb));
    *o2 = __float2bfloat16(round_bf16(x2 * cb) + round_bf16(x1 * sb));
}

// Shared state every fused decode block sets up: the rotated, mapped query
// heads and (in the block that holds the position) the new key and value.
template <int HD> struct FusedSmem {
    float knew[HD]; // the new key after kmap (only in the block holding pos)
    float vnew[HD]; // the new value
};

// Rotates this block's G query heads into qs (qmap applied) and, when the
// chunk holds pos, the kv head's new key: appended to the cache with its
// value and kept in fs (kmap applied). Ends with __syncthreads.
template <int HD, typename QMap, typename KMap>
__device__ void rope_in_block(const bf16 *__restrict__ row_qkv, int H, int KVH, int kvh, int G, const float2 *cs,
                              const mg_row_meta &mr, int layer, bool holds_pos, float *qs, FusedSmem<HD> &fs,
                              QMap qmap, KMap kmap) {
    constexpr int half = HD / 2;
    const float2 *c = cs + (size_t)mr.pos * half;
    const bf16 *q = row_qkv + (size_t)kvh * G * HD;
    for (int t = threadIdx.x; t < G * half; t += blockDim.x) {
        const int g = t / half, i = t % half;
        bf16 o1, o2;
        rotate_pair(bf(q[g * HD + i]), bf(q[g * HD + i + half]), c[i], &o1, &o2);
        qs[g * HD + i] = qmap(bf(o1));
        qs[g * HD + i + half] = qmap(bf(o2));
    }
    if (holds_pos) {
        const bf16 *kx = row_qkv + (size_t)H * HD + (size_t)kvh * HD;
        const bf16 *vx = row_qkv + (size_t)(H + KVH) * HD + (size_t)kvh * HD;
        const size_t off = (size_t)layer * mr.layer_stride + (size_t)mr.pos * KVH * HD + (size_t)kvh * HD;
        for (int i = threadIdx.x; i < half; i += blockDim.x) {
            bf16 o1, o2;
            rotate_pair(bf(kx[i]), bf(kx[i + half]), c[i], &o1, &o2);
            mr.k[off + i] = o1;
            mr.k[off + i + half] = o2;
            fs.knew[i] = kmap(bf(o1));
            fs.knew[i + half] = kmap(bf(o2));
        }
        for (int i = threadIdx.x; i < HD; i += blockDim.x) {
            mr.v[off + i] = vx[i];
            fs.vnew[i] = bf(vx[i]);
        }
    }
    __syncthreads();
}

// q . k for keys [start, end) as attention.cu's chunk_scores computes them
// (LPP lanes per key, the same shuffle order); key pos comes from fs.knew.
template <int HD, typename KMap, typename Store>
__device__ void fused_scores(const float *qs, int G, const bf16 *__restrict__ kb, size_t pstride, int start, int end,
                             int pos, const FusedSmem<HD> &fs, KMap kmap, Store store) {
    constexpr int LPP = HD / 8, PPW = 32 / LPP;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    const int sub = lane / LPP, part = lane % LPP;
    for (int pb = start + warp * PPW; pb < end; pb += nwarps * PPW) {
        const int p = pb + sub;
        const bool ok = p < end;
        float kf[8];
        if (ok && p == pos) {
#pragma unroll
            for (int i = 0; i < 8; i++) kf[i] = fs.knew[part * 8 + i];
        } else if (ok) {
            unpack8(ldg16(kb + (size_t)p * pstride + part * 8), kf);
#pragma unroll
            for (int i = 0; i < 8; i++) kf[i] = kmap(kf[i]);
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) kf[i] = 0.f;
        }
#pragma unroll
        for (int g = 0; g < kMaxG; g++) {
            if (g < G) {
                const float *qg = qs + g * HD + part * 8;
                float s = 0.f;
#pragma unroll
                for (int i = 0; i < 8; i++) s = fmaf(qg[i], kf[i], s);
#pragma unroll
                for (int o = LPP / 2; o > 0; o >>= 1) s += __shfl_xor_sync(kFull, s, o);
                if (ok && part == 0) store(g, p, s);
            }
        }
    }
}

// P @ V of keys [start, end) as attention.cu's chunk_pv computes it; value
// pos (when vnew is not null) comes from shared memory.
template <int HD, typename Dst>
__device__ void fused_pv(const float *w, int C, int G, const bf16 *__restrict__ vb, size_t pstride, int start, int end,
                         int pos, const float *vnew, float *red, Dst dst) {
    constexpr int DG = HD / 8, PG = kThreads / DG;
    const int dg = threadIdx.x % DG, pg = threadIdx.x / DG;
    float acc[kMaxG][8];
#pragma unroll
    for (int g = 0; g < kMaxG; g++)
#pragma unroll
        for (int i = 0; i < 8; i++) acc[g][i] = 0.f;
    for (int p = start + pg; p < end; p += PG) {
        float vf[8];
        if (vnew && p == pos) {
#pragma unroll
            for (int i = 0; i < 8; i++) vf[i] = vnew[dg * 8 + i];
        } else {
            unpack8(ldg16(vb + (size_t)p * pstride + dg * 8), vf);
        }
#pragma unroll
        for (int g = 0; g < kMaxG; g++) {
            if (g < G) {
                const float wp = w[g * C + (p - start)];
#pragma unroll
                for (int i = 0; i < 8; i++) acc[g][i] = fmaf(wp, vf[i], acc[g][i]);
            }
        }
    }
#pragma unroll
    for (int g = 0; g < kMaxG; g++) {
        if (g < G) {
#pragma unroll
            for (int i = 0; i < 8; i++) red[pg * HD + dg * 8 + i] = acc[g][i];
            __syncthreads();
            float *out = dst(g);
            for (int d = threadIdx.x; d < HD; d += blockDim.x) {
                float sum = 0.f;
                for (int j = 0; j < PG; j++) sum += red[j * HD + d];
                out[d] = sum;
            }
            __syncthreads();
        }
    }
}

// Counts this block in for its (row, kv head); true in the last of used
// blocks to arrive, which then sees every other block's writes (and resets
// the count for the next launch or graph replay).
__device__ bool last_to_arrive(unsigned *count, int used) {
    __shared__ bool last;
    __threadfence(); // this block's partials before its arrival
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned before = atomicAdd(count, 1u);
        last = before == (unsigned)used - 1;
        if (last) *count = 0;
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

// f32 numerics in one launch: scores, the chunk's softmax, P @ V, and the
// merge of attn_reduce_kernel in the last block.
template <int HD>
__global__ void __launch_bounds__(kThreads)
fused_f32_kernel(const bf16 *__restrict__ qkv, int q_stride, const mg_row_meta *__restrict__ meta, int layer, int H,
                 int KVH, const float2 *__restrict__ cs, int C, int nchunks, float *__restrict__ partial,
                 unsigned *__restrict__ arrivals, bf16 *__restrict__ out) {
    const int kvh = blockIdx.x, chunk = blockIdx.y, row = blockIdx.z;
    const int G = H / KVH;
    const mg_row_meta mr = meta[row];
    const int len = mr.pos + 1, start = chunk * C;
    if (start >= len) return; // not counted: used chunks only
    const int end = min(start + C, len), used = (len + C - 1) / C;
    float *slot0 = partial + (((size_t)row * H + (size_t)kvh * G) * nchunks + chunk) * (HD + 2);
    const size_t head_step = (size_t)nchunks * (HD + 2);
    extern __shared__ float smem[];
    float *qs = smem;        // [G][HD], pre-scaled
    float *sc = qs + G * HD; // [G][C]
    float *red = sc + G * C; // [PG][HD]
    __shared__ FusedSmem<HD> fs;
    __shared__ float m_s[kMaxG], l_s[kMaxG];
    const float scale = rsqrtf((float)HD);
    const bool holds_pos = mr.pos < end;
    rope_in_block<HD>(qkv + (size_t)row * q_stride, H, KVH, kvh, G, cs, mr, layer, holds_pos, qs, fs,
                      [scale](float v) { return v * scale; }, [](float k) { return k; });

    const size_t kv_off = (size_t)layer * mr.layer_stride + (size_t)kvh * HD;
    const size_t pstride = (size_t)KVH * HD;
    fused_scores<HD>(qs, G, mr.k + kv_off, pstride, start, end, mr.pos, fs, [](float k) { return k; },
                     [&](int g, int p, float s) { sc[g * C + (p - start)] = s; });
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    const int n = end - start;
    for (int g = warp; g < G; g += nwarps) {
        float mx = -INFINITY;
        for (int i = lane; i < n; i += 32) mx = fmaxf(mx, sc[g * C + i]);
        mx = warp_max(mx);
        float sum = 0.f;
        for (int i = lane; i < n; i += 32) {
            const float e = expf(sc[g * C + i] - mx);
            sc[g * C + i] = round_bf16(e);
            sum += e;
        }
        sum = warp_sum(sum);
        if (lane == 0) {
            m_s[g] = mx;
            l_s[g] = sum;
        }
    }
    __syncthreads();
    fused_pv<HD>(sc, C, G, mr.v + kv_off, pstride, start, end, mr.pos, holds_pos ? fs.vnew : nullptr, red,
                 [&](int g) { return slot0 + g * head_step; });
    if ((int)threadIdx.x < G) {
        slot0[threadIdx.x * head_step + HD] = m_s[threadIdx.x];
        slot0[threadIdx.x * head_step + HD + 1] = l_s[threadIdx.x];
    }
    if (!last_to_arrive(arrivals + (size_t)row * KVH + kvh, used)) return;
    // attn_reduce_kernel's merge for the G heads (its skipped chunks are
    // the unused ones here, never written).
    for (int t = threadIdx.x; t < G * HD; t += blockDim.x) {
        const int h = kvh * G + t / HD, d = t % HD;
        const float *base = partial + ((size_t)row * H + h) * nchunks * (HD + 2);
        float M = -INFINITY;
        for (int c = 0; c < used; c++) {
            const float *s = base + (size_t)c * (HD + 2);
            if (__ldcg(s + HD + 1) > 0.f) M = fmaxf(M, __ldcg(s + HD));
        }
        float L = 0.f, o = 0.f;
        for (int c = 0; c < used; c++) {
            const float *s = base + (size_t)c * (HD + 2);
            const float l = __ldcg(s + HD + 1);
            if (l > 0.f) {
                const float w = expf(__ldcg(s + HD) - M);
                L = fmaf(l, w, L);
                o = fmaf(__ldcg(s + d), w, o);
            }
        }
        out[(size_t)row * H * HD + (size_t)h * HD + d] = __float2bfloat16(o / L);
    }
}

// bf16 numerics, launch 1: attention.cu's attn_scores_kernel with the RoPE
// and the append in front.
template <int HD>
__global__ void __launch_bounds__(kThreads)
fused_scores_kernel(const bf16 *__restrict__ qkv, int q_stride, const mg_row_meta *__restrict__ meta, int layer, int H,
                    int KVH, const float2 *__restrict__ cs, int C, int nchunks, float sf, bf16 *__restrict__ scores,
                    int S, float *__restrict__ stats) {
    const int kvh = blockIdx.x, chunk = blockIdx.y, row = blockIdx.z;
    const int G = H / KVH;
    const mg_row_meta mr = meta[row];
    const int len = mr.pos + 1, start = chunk * C;
    if (start >= len) return; // launch 2 reads used chunks only
    const int end = min(start + C, len);
    float *st0 = stats + (((size_t)row * H + (size_t)kvh * G) * nchunks + chunk) * 2;
    extern __shared__ float smem[];
    float *qs = smem;        // [G][HD]
    float *sc = qs + G * HD; // [G][C]
    __shared__ FusedSmem<HD> fs;
    auto kmap = [sf](float k) { return round_bf16(k * sf); };
    rope_in_block<HD>(qkv + (size_t)row * q_stride, H, KVH, kvh, G, cs, mr, layer, mr.pos < end, qs, fs, kmap, kmap);
    const size_t pstride = (size_t)KVH * HD;
    const bf16 *kb = mr.k + (size_t)layer * mr.layer_stride + (size_t)kvh * HD;
    fused_scores<HD>(qs, G, kb, pstride, start, end, mr.pos, fs, kmap, [&](int g, int p, float s) {
        s = round_bf16(s);
        sc[g * C + (p - start)] = s;
        scores[((size_t)row * H + kvh * G + g) * S + p] = __float2bfloat16(s);
    });
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    const int n = end - start;
    for (int g = warp; g < G; g += nwarps) {
        float mx = -INFINITY;
        for (int i = lane; i < n; i += 32) mx = fmaxf(mx, sc[g * C + i]);
        mx = warp_max(mx);
        float sum = 0.f;
        for (int i = lane; i < n; i += 32) sum += expf(sc[g * C + i] - mx);
        sum = warp_sum(sum);
        if (lane == 0) {
            st0[g * nchunks * 2] = mx;
            st0[g * nchunks * 2 + 1] = sum;
        }
    }
}

// bf16 numerics, launch 2: attention.cu's attn_pv_kernel, then in the last
// block of a (row, kv head) attn_sum_kernel's sum in chunk order.
template <int HD>
__global__ void __launch_bounds__(kThreads)
fused_pv_kernel(const mg_row_meta *__restrict__ meta, int layer, int H, int KVH, int C, int nchunks,
                const bf16 *__restrict__ scores, int S, const float *__restrict__ stats, float *__restrict__ partial,
                unsigned *__restrict__ arrivals, bf16 *__restrict__ out) {
    const int kvh = blockIdx.x, chunk = blockIdx.y, row = blockIdx.z;
    const int G = H / KVH;
    const mg_row_meta mr = meta[row];
    const int len = mr.pos + 1, start = chunk * C;
    if (start >= len) return;
    const int end = min(start + C, len), n = end - start, used = (len + C - 1) / C;
    extern __shared__ float smem[];
    float *P = smem;        // [G][C]
    float *red = P + G * C; // [PG][HD]
    __shared__ float Ms[kMaxG], Linv[kMaxG];
    if ((int)threadIdx.x < G) {
        const float *st = stats + ((size_t)row * H + kvh * G + threadIdx.x) * nchunks * 2;
        float M = -INFINITY;
        for (int c = 0; c < used; c++) M = fmaxf(M, st[2 * c]);
        float L = 0.f;
        for (int c = 0; c < used; c++) L += st[2 * c + 1] * expf(st[2 * c] - M);
        Ms[threadIdx.x] = M;
        Linv[threadIdx.x] = 1.f / L;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * n; i += blockDim.x) {
        const int g = i / n, j = i % n;
        const float sv = bf(scores[((size_t)row * H + kvh * G + g) * S + start + j]);
        P[g * C + j] = round_bf16(expf(sv - Ms[g]) * Linv[g]);
    }
    __syncthreads();
    const size_t pstride = (size_t)KVH * HD;
    const bf16 *vb = mr.v + (size_t)layer * mr.layer_stride + (size_t)kvh * HD;
    fused_pv<HD>(P, C, G, vb, pstride, start, end, -1, nullptr, red,
                 [&](int g) { return partial + (((size_t)row * H + kvh * G + g) * nchunks + chunk) * HD; });
    if (!last_to_arrive(arrivals + (size_t)row * KVH + kvh, used)) return;
    for (int t = threadIdx.x; t < G * HD; t += blockDim.x) {
        const int h = kvh * G + t / HD, d = t % HD;
        const float *base = partial + ((size_t)row * H + h) * nchunks * HD;
        float o = 0.f;
        for (int c = 0; c < used; c++) o += __ldcg(base + (size_t)c * HD + d);
        out[(size_t)row * H * HD + (size_t)h * HD + d] = __float2bfloat16(o);
    }
}

// bf16(sqrt(1/sqrt(hd))), as attention.cu's hf_sqrt_scale.
float sqrt_scale(int hd) { return __bfloat162float(__float2bfloat16(sqrtf(1.f / sqrtf((float)hd)))); }

template <int HD>
cudaError_t fused_hd(const bf16 *qkv, int q_stride, const mg_row_meta *meta, int rows, int layer, int H, int KVH,
                     int max_len, const float2 *cs, const AttnScratch &scr, bf16 *out, cudaStream_t st) {
    const int C = attn_chunk(max_len), nchunks = attn_chunks(max_len);
    const int G = H / KVH;
    const dim3 grid(KVH, nchunks, rows);
    constexpr int PG = kThreads / (HD / 8);
    if (scr.f32_softmax) {
        const size_t smem = (size_t)(G * HD + G * C + PG * HD) * sizeof(float);
        fused_f32_kernel<HD><<<grid, kThreads, smem, st>>>(qkv, q_stride, meta, layer, H, KVH, cs, C, nchunks,
                                                            scr.partial, scr.arrivals, out);
        return cudaGetLastError();
    }
    if (!scr.scores || scr.scores_stride < max_len) return cudaErrorInvalidValue;
    fused_scores_kernel<HD><<<grid, kThreads, (size_t)(G * HD + G * C) * sizeof(float), st>>>(
        qkv, q_stride, meta, layer, H, KVH, cs, C, nchunks, sqrt_scale(HD), scr.scores, scr.scores_stride, scr.stats);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    fused_pv_kernel<HD><<<grid, kThreads, (size_t)(G * C + PG * HD) * sizeof(float), st>>>(
        meta, layer, H, KVH, C, nchunks, scr.scores, scr.scores_stride, scr.stats, scr.partial, scr.arrivals, out);
    return cudaGetLastError();
}

} // namespace

cudaError_t attn_decode_rope(const bf16 *qkv, int q_stride, const mg_row_meta *meta, int rows, int layer, int H, int KVH,
                             int hd, int max_len, const float2 *cs, const AttnScratch &scr, bf16 *out,
                             cudaStream_t st) {
    if (rows <= 0) return cudaSuccess;
    if (KVH <= 0 || H % KVH != 0 || H / KVH > kMaxG || max_len <= 0 || !cs || !scr.arrivals || rows > kGemvMaxRows ||
        q_stride < (H + 2 * KVH) * hd)
        return cudaErrorInvalidValue;
    switch (hd) {
    case 32: return fused_hd<32>(qkv, q_stride, meta, rows, layer, H, KVH, max_len, cs, scr, out, st);
    case 64: return fused_hd<64>(qkv, q_stride, meta, rows, layer, H, KVH, max_len, cs, scr, out, st);
    case 128: return fused_hd<128>(qkv, q_stride, meta, rows, layer, H, KVH, max_len, cs, scr, out, st);
    }
    return cudaErrorInvalidValue;
}

} // namespace mg

// attention.cu: causal GQA attention over the bf16 KV cache.
//
// Two numerics (kernels.h, AttnScratch): by default PyTorch's math SDPA in
// bf16, which HF transformers ran for golden.json (bf16 scaled q/k, bf16
// scores, bf16 normalized probabilities); with f32_softmax, flash-style f32
// scores and online softmax.
//
// Decode (split over the sequence, flash-decoding layout): the keys 0..pos of
// each query row are cut into chunks; one block per (kv head, chunk, row)
// loads each key once for all G query heads that share it. f32 mode: each
// block writes an unnormalized partial output with its max and sum, and a
// merge kernel combines them. bf16 mode: the normalized bf16 probabilities
// need the row's global max and sum first, so a scores kernel writes bf16
// scores and per-chunk (max, sum), a P @ V kernel normalizes with the merged
// stats, and a sum kernel adds the chunks. Lengths and cache pointers come
// from device memory (mg_row_meta), so one captured graph serves any
// position up to the grid's max_len.
//
// Prefill: one block per (32-query tile, head), looping over 32-key tiles up
// to the causal limit, 4 threads per query row; f32 mode with an online
// softmax, bf16 mode with a first pass for the row's max and sum. Keys and
// values are read from the cache, so a chunk of a long prompt at pos0 > 0
// sees the earlier chunks.
#include "kernels.h"

namespace mg {
namespace {

constexpr int kMaxG = 8;
constexpr int kThreads = 128;

// q . k for the keys [start, end) of one chunk and the G query heads of a
// kv head: LPP lanes hold one key (16 bytes each) and reduce by shuffles.
// kmap transforms each loaded key value (the math numerics scale and round
// it); store(g, p, s) receives head g's score of key p (on one lane).
template <int HD, typename KMap, typename Store>
__device__ void chunk_scores(const float *qs, int G, const bf16 *__restrict__ kb, size_t pstride, int start, int end,
                             KMap kmap, Store store) {
    constexpr int LPP = HD / 8;   // lanes per key
    constexpr int PPW = 32 / LPP; // keys per warp per step
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    const int sub = lane / LPP, part = lane % LPP;
    for (int pb = start + warp * PPW; pb < end; pb += nwarps * PPW) {
        const int p = pb + sub;
        const bool ok = p < end;
        float kf[8];
        if (ok) {
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

// P @ V of one chunk of keys [start, end) for the G query heads of a kv
// head: w holds G rows of C probabilities (already bf16-rounded), each thread
// owns 8 dims for a strided subset of keys, and the per-thread sums meet in
// red ([PG][HD] floats of shared memory). dst(g) is where head g's HD f32
// sums go. Called by all kThreads threads of the block.
template <int HD, typename Dst>
__device__ void chunk_pv(const float *w, int C, int G, const bf16 *__restrict__ vb, size_t pstride, int start,
                         int end, float *red, Dst dst) {
    constexpr int DG = HD / 8, PG = kThreads / DG;
    const int dg = threadIdx.x % DG, pg = threadIdx.x / DG;
    float acc[kMaxG][8];
#pragma unroll
    for (int g = 0; g < kMaxG; g++)
#pragma unroll
        for (int i = 0; i < 8; i++) acc[g][i] = 0.f;
    for (int p = start + pg; p < end; p += PG) {
        float vf[8];
        unpack8(ldg16(vb + (size_t)p * pstride + dg * 8), vf);
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

template <int HD>
__global__ void __launch_bounds__(kThreads)
attn_decode_kernel(const bf16 *__restrict__ qkv, int q_stride, const mg_row_meta *__restrict__ meta,
                   int layer, int H, int KVH, int C, int nchunks, float *__restrict__ partial) {
    const int kvh = blockIdx.x, chunk = blockIdx.y, row = blockIdx.z;
    const int G = H / KVH;
    const mg_row_meta mr = meta[row];
    const int len = mr.pos + 1;
    const int start = chunk * C;
    const int end = min(start + C, len);
    // partial: [row][head][chunk][HD + 2] = (o unnormalized, max, sum)
    float *slot0 = partial + (((size_t)row * H + (size_t)kvh * G) * nchunks + chunk) * (HD + 2);
    const size_t head_step = (size_t)nchunks * (HD + 2);
    if (start >= len) {
        if ((int)threadIdx.x < G) {
            slot0[threadIdx.x * head_step + HD] = -INFINITY;
            slot0[threadIdx.x * head_step + HD + 1] = 0.f;
        }
        return;
    }
    extern __shared__ float smem[];
    float *qs = smem;          // [G][HD], pre-scaled
    float *sc = qs + G * HD;   // [G][C]
    float *red = sc + G * C;   // [PG][HD] for chunk_pv
    __shared__ float m_s[kMaxG], l_s[kMaxG];

    const float scale = rsqrtf((float)HD);
    const bf16 *q = qkv + (size_t)row * q_stride + (size_t)kvh * G * HD;
    for (int i = threadIdx.x; i < G * HD; i += blockDim.x) qs[i] = bf(q[i]) * scale;
    __syncthreads();

    const size_t kv_off = (size_t)layer * mr.layer_stride + (size_t)kvh * HD;
    const size_t pstride = (size_t)KVH * HD;
    const bf16 *kb = mr.k + kv_off;
    const bf16 *vb = mr.v + kv_off;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;

    // Scores in f32 (q carries the 1/sqrt(hd) scale).
    chunk_scores<HD>(qs, G, kb, pstride, start, end, [](float k) { return k; },
                     [&](int g, int p, float s) { sc[g * C + (p - start)] = s; });
    __syncthreads();

    // Softmax within the chunk: one warp per query head.
    const int n = end - start;
    for (int g = warp; g < G; g += nwarps) {
        float mx = -INFINITY;
        for (int i = lane; i < n; i += 32) mx = fmaxf(mx, sc[g * C + i]);
        mx = warp_max(mx);
        float sum = 0.f;
        for (int i = lane; i < n; i += 32) {
            // As PyTorch's flash SDPA on bf16: the sum uses f32 weights, the
            // P @ V product the weights rounded to bf16.
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

    // P @ V, then each head's max and sum beside its HD sums.
    chunk_pv<HD>(sc, C, G, vb, pstride, start, end, red, [&](int g) { return slot0 + g * head_step; });
    if ((int)threadIdx.x < G) {
        slot0[threadIdx.x * head_step + HD] = m_s[threadIdx.x];
        slot0[threadIdx.x * head_step + HD + 1] = l_s[threadIdx.x];
    }
}

// Merge chunk partials: one block per (head, row), one thread per dim.
template <int HD>
__global__ void attn_reduce_kernel(const float *__restrict__ partial, int H, int nchunks,
                                   bf16 *__restrict__ out) {
    const int h = blockIdx.x, row = blockIdx.y, d = threadIdx.x;
    const float *base = partial + ((size_t)row * H + h) * nchunks * (HD + 2);
    float M = -INFINITY;
    for (int c = 0; c < nchunks; c++) {
        const float *s = base + (size_t)c * (HD + 2);
        if (s[HD + 1] > 0.f) M = fmaxf(M, s[HD]);
    }
    float L = 0.f, o = 0.f;
    for (int c = 0; c < nchunks; c++) {
        const float *s = base + (size_t)c * (HD + 2);
        const float l = s[HD + 1];
        if (l > 0.f) {
            const float w = expf(s[HD] - M);
            L = fmaf(l, w, L);
            o = fmaf(s[d], w, o);
        }
    }
    out[(size_t)row * H * HD + (size_t)h * HD + d] = __float2bfloat16(o / L);
}

// Prefill tile helpers shared by both numerics.
template <int HD, int BQ, int BK>
struct PrefillSmem {
    float Qs[BQ][HD + 4];
    bf16 Ks[BK][HD + 8];
    bf16 Vs[BK][HD];
    float Ps[BQ][BK + 1];
};

// Loads keys/values k0..k0+BK-1 (zeros past last). HF: keys pre-scaled by
// sf and rounded to bf16, as the math SDPA scales k.
template <int HD, int BQ, int BK, bool HF>
__device__ __forceinline__ void prefill_load_tile(PrefillSmem<HD, BQ, BK> &sm, const bf16 *kb, const bf16 *vb,
                                                  size_t pstride, int k0, int last, float sf) {
    for (int i = threadIdx.x; i < BK * HD / 8; i += kThreads) {
        const int jj = i / (HD / 8), cc = i % (HD / 8), j = k0 + jj;
        uint4 kv = make_uint4(0, 0, 0, 0), vv = kv;
        if (j <= last) {
            kv = ldg16(kb + (size_t)j * pstride + cc * 8);
            vv = ldg16(vb + (size_t)j * pstride + cc * 8);
            if (HF) {
                float f[8];
                unpack8(kv, f);
#pragma unroll
                for (int e = 0; e < 8; e++) f[e] *= sf;
                kv = pack8(f);
            }
        }
        *reinterpret_cast<uint4 *>(&sm.Ks[jj][cc * 8]) = kv;
        *reinterpret_cast<uint4 *>(&sm.Vs[jj][cc * 8]) = vv;
    }
}

// This thread's BK/4 scores of row r (keys c4, c4+4, ...), masked past qpos.
template <int HD, int BQ, int BK, bool HF>
__device__ __forceinline__ void prefill_scores(const PrefillSmem<HD, BQ, BK> &sm, int r, int c4, int k0, int qpos,
                                               float s[BK / 4]) {
#pragma unroll
    for (int t = 0; t < BK / 4; t++) {
        const int jj = c4 + 4 * t;
        float acc = 0.f;
#pragma unroll 4
        for (int d = 0; d < HD; d += 8) {
            float kf[8];
            unpack8(*reinterpret_cast<const uint4 *>(&sm.Ks[jj][d]), kf);
            const float4 qa = *reinterpret_cast<const float4 *>(&sm.Qs[r][d]);
            const float4 qb = *reinterpret_cast<const float4 *>(&sm.Qs[r][d + 4]);
            acc = fmaf(qa.x, kf[0], acc);
            acc = fmaf(qa.y, kf[1], acc);
            acc = fmaf(qa.z, kf[2], acc);
            acc = fmaf(qa.w, kf[3], acc);
            acc = fmaf(qb.x, kf[4], acc);
            acc = fmaf(qb.y, kf[5], acc);
            acc = fmaf(qb.z, kf[6], acc);
            acc = fmaf(qb.w, kf[7], acc);
        }
        if (HF) acc = round_bf16(acc); // the math SDPA's bf16 score matrix
        s[t] = (k0 + jj <= qpos) ? acc : -INFINITY;
    }
}

// HF = false: one pass, online softmax in f32, P rounded to bf16 for P @ V
// (flash SDPA). HF = true: the math SDPA of PyTorch in bf16, which
// golden.json was computed with: q and k scaled by bf16(sqrt(scale)) and
// rounded, bf16 scores, softmax normalized and rounded to bf16, then P @ V.
// That needs the row's max and sum first: a first pass over the keys.
template <int HD, bool HF>
__global__ void __launch_bounds__(kThreads)
attn_prefill_kernel(const bf16 *__restrict__ qkv, int q_stride, int n, int pos0,
                    const bf16 *__restrict__ kc, const bf16 *__restrict__ vc, int H, int KVH, float sf,
                    bf16 *__restrict__ out) {
    constexpr int BQ = 32, BK = 32, DPT = HD / 4;
    __shared__ __align__(16) PrefillSmem<HD, BQ, BK> sm;
    const int h = blockIdx.y, q0 = blockIdx.x * BQ;
    const int G = H / KVH, kvh = h / G;
    const int tid = threadIdx.x, r = tid >> 2, c4 = tid & 3;
    const float scale = rsqrtf((float)HD);

    for (int i = tid; i < BQ * HD / 8; i += kThreads) {
        const int rr = i / (HD / 8), cc = i % (HD / 8);
        const int qi = min(q0 + rr, n - 1);
        float f[8];
        unpack8(ldg16(qkv + (size_t)qi * q_stride + (size_t)h * HD + cc * 8), f);
#pragma unroll
        for (int j = 0; j < 8; j++) sm.Qs[rr][cc * 8 + j] = HF ? round_bf16(f[j] * sf) : f[j] * scale;
    }
    // Rows past n repeat the last row and are not written.
    const int qpos = pos0 + min(q0 + r, n - 1);
    const int last = pos0 + min(n, q0 + BQ) - 1;
    const size_t pstride = (size_t)KVH * HD;
    const bf16 *kb = kc + (size_t)kvh * HD;
    const bf16 *vb = vc + (size_t)kvh * HD;

    float m_i = -INFINITY, l_i = 0.f;
    float s[BK / 4];
    if (HF) { // pass 1: the row's max and sum
        for (int k0 = 0; k0 <= last; k0 += BK) {
            __syncthreads();
            prefill_load_tile<HD, BQ, BK, HF>(sm, kb, vb, pstride, k0, last, sf);
            __syncthreads();
            prefill_scores<HD, BQ, BK, HF>(sm, r, c4, k0, qpos, s);
            float tmax = -INFINITY;
#pragma unroll
            for (int t = 0; t < BK / 4; t++) tmax = fmaxf(tmax, s[t]);
            tmax = fmaxf(tmax, __shfl_xor_sync(kFull, tmax, 1));
            tmax = fmaxf(tmax, __shfl_xor_sync(kFull, tmax, 2));
            const float m_new = fmaxf(m_i, tmax);
            float rs = 0.f;
#pragma unroll
            for (int t = 0; t < BK / 4; t++) rs += expf(s[t] - m_new);
            rs += __shfl_xor_sync(kFull, rs, 1);
            rs += __shfl_xor_sync(kFull, rs, 2);
            l_i = l_i * expf(m_i - m_new) + rs;
            m_i = m_new;
        }
    }
    const float inv_l = HF ? 1.f / l_i : 0.f;

    float o[DPT];
#pragma unroll
    for (int i = 0; i < DPT; i++) o[i] = 0.f;

    for (int k0 = 0; k0 <= last; k0 += BK) {
        __syncthreads(); // the previous tile is consumed (and Qs is loaded)
        prefill_load_tile<HD, BQ, BK, HF>(sm, kb, vb, pstride, k0, last, sf);
        __syncthreads();
        prefill_scores<HD, BQ, BK, HF>(sm, r, c4, k0, qpos, s);
        if (HF) {
#pragma unroll
            for (int t = 0; t < BK / 4; t++) sm.Ps[r][c4 + 4 * t] = round_bf16(expf(s[t] - m_i) * inv_l);
        } else {
            float tmax = -INFINITY;
#pragma unroll
            for (int t = 0; t < BK / 4; t++) tmax = fmaxf(tmax, s[t]);
            tmax = fmaxf(tmax, __shfl_xor_sync(kFull, tmax, 1));
            tmax = fmaxf(tmax, __shfl_xor_sync(kFull, tmax, 2));
            // Key 0 is visible to every row, so m_new is finite from tile 0 on.
            const float m_new = fmaxf(m_i, tmax);
            const float alpha = expf(m_i - m_new);
            float rs = 0.f;
#pragma unroll
            for (int t = 0; t < BK / 4; t++) {
                const float p = expf(s[t] - m_new);
                sm.Ps[r][c4 + 4 * t] = round_bf16(p); // bf16 P for P @ V, f32 sum (flash SDPA)
                rs += p;
            }
            rs += __shfl_xor_sync(kFull, rs, 1);
            rs += __shfl_xor_sync(kFull, rs, 2);
            l_i = l_i * alpha + rs;
#pragma unroll
            for (int i = 0; i < DPT; i++) o[i] *= alpha;
            m_i = m_new;
        }
        __syncwarp(); // a row's 4 threads are in one warp
        for (int jj = 0; jj < BK; jj++) {
            const float p = sm.Ps[r][jj];
#pragma unroll
            for (int d = 0; d < DPT; d += 8) {
                float vf[8];
                unpack8(*reinterpret_cast<const uint4 *>(&sm.Vs[jj][c4 * DPT + d]), vf);
#pragma unroll
                for (int i = 0; i < 8; i++) o[d + i] = fmaf(p, vf[i], o[d + i]);
            }
        }
    }
    if (q0 + r < n) {
        bf16 *orow = out + (size_t)(q0 + r) * H * HD + (size_t)h * HD + c4 * DPT;
        const float inv = HF ? 1.f : 1.f / l_i;
#pragma unroll
        for (int d = 0; d < DPT; d += 8) {
            float f[8];
#pragma unroll
            for (int i = 0; i < 8; i++) f[i] = o[d + i] * inv;
            *reinterpret_cast<uint4 *>(orow + d) = pack8(f);
        }
    }
}

// ---- decode, HF (math SDPA) numerics: scores, then P @ V, then a sum ----

// Scores of one chunk for the G heads of a kv head: bf16(q_s . k_s) with
// q_s, k_s scaled by sf and rounded; written to `scores` ([row][head][S],
// bf16-exact) with the chunk's max and sum of exp (stats [row][head][chunk][2]).
template <int HD>
__global__ void __launch_bounds__(kThreads)
attn_scores_kernel(const bf16 *__restrict__ qkv, int q_stride, const mg_row_meta *__restrict__ meta, int layer,
                   int H, int KVH, int C, int nchunks, float sf, bf16 *__restrict__ scores, int S,
                   float *__restrict__ stats) {
    const int kvh = blockIdx.x, chunk = blockIdx.y, row = blockIdx.z;
    const int G = H / KVH;
    const mg_row_meta mr = meta[row];
    const int len = mr.pos + 1;
    const int start = chunk * C;
    const int end = min(start + C, len);
    float *st0 = stats + (((size_t)row * H + (size_t)kvh * G) * nchunks + chunk) * 2;
    if (start >= len) {
        if ((int)threadIdx.x < G) {
            st0[threadIdx.x * nchunks * 2] = -INFINITY;
            st0[threadIdx.x * nchunks * 2 + 1] = 0.f;
        }
        return;
    }
    extern __shared__ float smem[];
    float *qs = smem;        // [G][HD]
    float *sc = qs + G * HD; // [G][C]
    const bf16 *q = qkv + (size_t)row * q_stride + (size_t)kvh * G * HD;
    for (int i = threadIdx.x; i < G * HD; i += blockDim.x) qs[i] = round_bf16(bf(q[i]) * sf);
    __syncthreads();
    const size_t pstride = (size_t)KVH * HD;
    const bf16 *kb = mr.k + (size_t)layer * mr.layer_stride + (size_t)kvh * HD;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    chunk_scores<HD>(qs, G, kb, pstride, start, end, [sf](float k) { return round_bf16(k * sf); },
                     [&](int g, int p, float s) {
                         s = round_bf16(s);
                         sc[g * C + (p - start)] = s;
                         scores[((size_t)row * H + kvh * G + g) * S + p] = __float2bfloat16(s);
                     });
    __syncthreads();
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

// P @ V of one chunk with the row's global max and sum (from all chunks'
// stats): P = bf16(exp(s - M) / L). Writes partial[row][head][chunk][HD].
template <int HD>
__global__ void __launch_bounds__(kThreads)
attn_pv_kernel(const mg_row_meta *__restrict__ meta, int layer, int H, int KVH, int C, int nchunks,
               const bf16 *__restrict__ scores, int S, const float *__restrict__ stats,
               float *__restrict__ partial) {
    const int kvh = blockIdx.x, chunk = blockIdx.y, row = blockIdx.z;
    const int G = H / KVH;
    const mg_row_meta mr = meta[row];
    const int len = mr.pos + 1;
    const int start = chunk * C;
    if (start >= len) return; // the sum kernel skips chunks past len
    const int end = min(start + C, len), n = end - start;
    extern __shared__ float smem[];
    float *P = smem;          // [G][C]
    float *red = P + G * C;   // [PG][HD] for chunk_pv
    __shared__ float Ms[kMaxG], Linv[kMaxG];
    if ((int)threadIdx.x < G) {
        const float *st = stats + ((size_t)row * H + kvh * G + threadIdx.x) * nchunks * 2;
        const int used = (len + C - 1) / C;
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
    chunk_pv<HD>(P, C, G, vb, pstride, start, end, red,
                 [&](int g) { return partial + (((size_t)row * H + kvh * G + g) * nchunks + chunk) * HD; });
}

template <int HD>
__global__ void attn_sum_kernel(const mg_row_meta *__restrict__ meta, int H, int C, int nchunks,
                                const float *__restrict__ partial, bf16 *__restrict__ out) {
    const int h = blockIdx.x, row = blockIdx.y, d = threadIdx.x;
    const int used = min(nchunks, (meta[row].pos + 1 + C - 1) / C);
    const float *base = partial + ((size_t)row * H + h) * nchunks * HD;
    float o = 0.f;
    for (int c = 0; c < used; c++) o += base[(size_t)c * HD + d];
    out[(size_t)row * H * HD + (size_t)h * HD + d] = __float2bfloat16(o);
}

// bf16(sqrt(1/sqrt(hd))): the math SDPA multiplies q and k by this scalar,
// which PyTorch's CPU kernels apply in bf16.
float hf_sqrt_scale(int hd) { return __bfloat162float(__float2bfloat16(sqrtf(1.f / sqrtf((float)hd)))); }

template <int HD>
cudaError_t decode_hd(const bf16 *qkv, int q_stride, const mg_row_meta *meta, int rows, int layer, int H, int KVH,
                      int max_len, const AttnScratch &scr, bf16 *out, cudaStream_t st) {
    const int C = attn_chunk(max_len), nchunks = attn_chunks(max_len);
    const int G = H / KVH;
    const dim3 grid(KVH, nchunks, rows);
    constexpr int PG = kThreads / (HD / 8);
    if (scr.f32_softmax) {
        const size_t smem = (size_t)(G * HD + G * C + PG * HD) * sizeof(float);
        attn_decode_kernel<HD><<<grid, kThreads, smem, st>>>(qkv, q_stride, meta, layer, H, KVH, C, nchunks,
                                                              scr.partial);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
        attn_reduce_kernel<HD><<<dim3(H, rows), HD, 0, st>>>(scr.partial, H, nchunks, out);
        return cudaGetLastError();
    }
    if (!scr.scores || scr.scores_stride < max_len) return cudaErrorInvalidValue;
    const float sf = hf_sqrt_scale(HD);
    attn_scores_kernel<HD><<<grid, kThreads, (size_t)(G * HD + G * C) * sizeof(float), st>>>(
        qkv, q_stride, meta, layer, H, KVH, C, nchunks, sf, scr.scores, scr.scores_stride, scr.stats);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    attn_pv_kernel<HD><<<grid, kThreads, (size_t)(G * C + PG * HD) * sizeof(float), st>>>(
        meta, layer, H, KVH, C, nchunks, scr.scores, scr.scores_stride, scr.stats, scr.partial);
    e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    attn_sum_kernel<HD><<<dim3(H, rows), HD, 0, st>>>(meta, H, C, nchunks, scr.partial, out);
    return cudaGetLastError();
}

template <int HD>
cudaError_t prefill_hd(const bf16 *qkv, int q_stride, int n, int pos0, const bf16 *k, const bf16 *v, int H,
                       int KVH, bool f32_softmax, bf16 *out, cudaStream_t st) {
    const dim3 grid((n + 31) / 32, H);
    if (f32_softmax)
        attn_prefill_kernel<HD, false><<<grid, kThreads, 0, st>>>(qkv, q_stride, n, pos0, k, v, H, KVH, 0.f, out);
    else
        attn_prefill_kernel<HD, true><<<grid, kThreads, 0, st>>>(qkv, q_stride, n, pos0, k, v, H, KVH,
                                                                 hf_sqrt_scale(HD), out);
    return cudaGetLastError();
}

} // namespace

int attn_chunk(int max_len) {
    // About 64 chunks per row, each 64..512 keys (scores stay in shared
    // memory). 8K context on 8B: 64 chunks of 128 keys, KVH x 64 = 512
    // blocks, 4 per SM, so each SM keeps about 4x the K/V loads in flight
    // that 32 chunks did (the H200 run measured the 32-chunk kernels at ~3x
    // their K/V read, latency-bound); the partial sums grow to 1 MB per layer
    // (3% of the 33.5 MB of K/V). Up to 2K keys nothing changes (64 keys).
    int want = (max_len + 63) / 64, c = 64;
    while (c < want && c < 512) c *= 2;
    return c;
}

int attn_chunks(int max_len) {
    const int c = attn_chunk(max_len);
    return (max_len + c - 1) / c;
}

size_t attn_partial_floats(int rows, int H, int hd, int max_len) {
    return (size_t)rows * H * attn_chunks(max_len) * (hd + 2);
}

cudaError_t attn_decode(const bf16 *qkv, int q_stride, const mg_row_meta *meta, int rows, int layer, int H, int KVH,
                        int hd, int max_len, const AttnScratch &scr, bf16 *out, cudaStream_t st) {
    if (rows <= 0) return cudaSuccess;
    if (KVH <= 0 || H % KVH != 0 || H / KVH > kMaxG || max_len <= 0) return cudaErrorInvalidValue;
    switch (hd) {
    case 32: return decode_hd<32>(qkv, q_stride, meta, rows, layer, H, KVH, max_len, scr, out, st);
    case 64: return decode_hd<64>(qkv, q_stride, meta, rows, layer, H, KVH, max_len, scr, out, st);
    case 128: return decode_hd<128>(qkv, q_stride, meta, rows, layer, H, KVH, max_len, scr, out, st);
    }
    return cudaErrorInvalidValue;
}

cudaError_t attn_prefill(const bf16 *qkv, int q_stride, int n, int pos0, const bf16 *k, const bf16 *v, int H,
                         int KVH, int hd, bool f32_softmax, bf16 *out, cudaStream_t st) {
    if (n <= 0) return cudaSuccess;
    if (KVH <= 0 || H % KVH != 0) return cudaErrorInvalidValue;
    switch (hd) {
    case 32: return prefill_hd<32>(qkv, q_stride, n, pos0, k, v, H, KVH, f32_softmax, out, st);
    case 64: return prefill_hd<64>(qkv, q_stride, n, pos0, k, v, H, KVH, f32_softmax, out, st);
    case 128: return prefill_hd<128>(qkv, q_stride, n, pos0, k, v, H, KVH, f32_softmax, out, st);
    }
    return cudaErrorInvalidValue;
}

} // namespace mg

// sample.cu: the backend sampler on the device (meshgpu.h "Sampling in the
// backend"): native/cpu_sample.c and Go's sample.Choose, bit for bit on the
// same logits. Every float64 product that feeds a sum is an explicit
// __dmul_rn/__dadd_rn, so nvcc fuses nothing the Go and C code round. Sums
// over the vocabulary are kSumChunks fixed chunks, each summed in index order
// by one thread, then the chunk sums in order by one thread; candidates sort
// by (probability desc, id asc), a total order, so their gathering order
// does not matter. The row's logits stay on the device; one small result
// struct leaves.
//
// Kernels per row: [penalize] (one block, when a penalty is on), chunk
// argmax (kSumChunks blocks), chunk exponentials (kSumChunks blocks, once
// for the log-softmax, once for the temperature), finish (one block: the
// filters, the draw, the top logprobs).
#include <cfloat>
#include <climits>

#include "kernels.h"

namespace mg {

namespace {

constexpr int kSumChunks = 256;
constexpr int kFinishThreads = 1024;

__device__ __forceinline__ void chunk_bounds(int n, int c, int &lo, int &hi) {
    lo = (int)((long long)n * c / kSumChunks);
    hi = (int)((long long)n * (c + 1) / kSumChunks);
}

// sample.expNeg: e^x for x <= 0, every rounding explicit.
__device__ double exp_neg(double x) {
    if (!(x >= -708)) return 0;
    if (x > 0) return exp(x);
    const double ln2_hi = 6.93147180369123816490e-01, ln2_lo = 1.90821492927058770002e-10;
    const double log2e = 1.44269504088896340735992468100189214;
    const double k = floor(__dadd_rn(__dmul_rn(x, log2e), 0.5));
    double r = __dsub_rn(x, __dmul_rn(k, ln2_hi));
    r = __dsub_rn(r, __dmul_rn(k, ln2_lo));
    double p = __dadd_rn(__dmul_rn(r, 1.0 / 362880), 1.0 / 40320);
    p = __dadd_rn(__dmul_rn(p, r), 1.0 / 5040);
    p = __dadd_rn(__dmul_rn(p, r), 1.0 / 720);
    p = __dadd_rn(__dmul_rn(p, r), 1.0 / 120);
    p = __dadd_rn(__dmul_rn(p, r), 1.0 / 24);
    p = __dadd_rn(__dmul_rn(p, r), 1.0 / 6);
    p = __dadd_rn(__dmul_rn(p, r), 0.5);
    p = __dadd_rn(__dmul_rn(p, r), 1.0);
    p = __dadd_rn(__dmul_rn(p, r), 1.0);
    const unsigned long long bits = (unsigned long long)((long long)k + 1023) << 52;
    return __dmul_rn(p, __longlong_as_double((long long)bits));
}

__device__ __forceinline__ uint64_t mix(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ double uniform(uint64_t seed, int64_t step) {
    uint64_t x = mix(seed ^ 0x9E3779B97F4A7C15ull);
    x = mix(x ^ (uint64_t)step * 0xD1B54A32D192ED03ull);
    return (double)(x >> 11) / 9007199254740992.0;
}

// (value, index) argmax: NaN (index -1) never wins; ties go to the lower index.
__device__ __forceinline__ bool better(float va, int ia, float vb, int ib) {
    if (ia < 0) return false;
    if (ib < 0) return true;
    return va > vb || (va == vb && ia < ib);
}

// Block argmax over (v, i) in shared arrays of blockDim.x (a power of two).
__device__ void block_argmax(float *sv, int *si) {
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if ((int)threadIdx.x < o && better(sv[threadIdx.x + o], si[threadIdx.x + o], sv[threadIdx.x], si[threadIdx.x])) {
            sv[threadIdx.x] = sv[threadIdx.x + o];
            si[threadIdx.x] = si[threadIdx.x + o];
        }
        __syncthreads();
    }
}

// Repetition penalty over the whole history (each distinct id once), then
// presence/frequency over history[gen:]. cnt is zero on entry and on exit.
__global__ void penalize_kernel(float *logits, int vocab, const int32_t *hist, int n_hist, int gen, mg_sample_params p,
                                int32_t *cnt) {
    const bool rep = p.repetition_penalty != 0 && p.repetition_penalty != 1;
    if (rep) {
        const float r = (float)p.repetition_penalty;
        for (int j = threadIdx.x; j < n_hist; j += blockDim.x) {
            const int id = hist[j];
            if (id < 0 || id >= vocab) continue;
            if (atomicExch(&cnt[id], 1) == 0) {
                const float l = logits[id];
                logits[id] = l > 0 ? l / r : l * r;
            }
        }
        __syncthreads();
        for (int j = threadIdx.x; j < n_hist; j += blockDim.x) {
            const int id = hist[j];
            if (id >= 0 && id < vocab) cnt[id] = 0;
        }
        __syncthreads();
    }
    if ((p.presence_penalty != 0 || p.frequency_penalty != 0) && gen < n_hist) {
        const int g0 = gen < 0 ? 0 : gen;
        for (int j = g0 + threadIdx.x; j < n_hist; j += blockDim.x) {
            const int id = hist[j];
            if (id >= 0 && id < vocab) atomicAdd(&cnt[id], 1);
        }
        __syncthreads();
        for (int j = g0 + threadIdx.x; j < n_hist; j += blockDim.x) {
            const int id = hist[j];
            if (id < 0 || id >= vocab) continue;
            const int c = atomicExch(&cnt[id], 0);
            if (c > 0) {
                // (l - frequency*c) - presence, as sample.penalizeGenerated
                const double t = __dsub_rn((double)logits[id], __dmul_rn(p.frequency_penalty, (double)c));
                logits[id] = (float)__dsub_rn(t, p.presence_penalty);
            }
        }
    }
}

// Block c: the argmax of chunk c.
__global__ void chunk_argmax_kernel(const float *logits, int vocab, float *part_v, int *part_i) {
    __shared__ float sv[256];
    __shared__ int si[256];
    int lo, hi;
    chunk_bounds(vocab, blockIdx.x, lo, hi);
    float bv = 0;
    int bi = -1;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float v = logits[i];
        if (!isnan(v) && better(v, i, bv, bi)) bv = v, bi = i;
    }
    sv[threadIdx.x] = bv;
    si[threadIdx.x] = bi;
    __syncthreads();
    block_argmax(sv, si);
    if (threadIdx.x == 0) part_v[blockIdx.x] = sv[0], part_i[blockIdx.x] = si[0];
}

// The whole row's argmax from the chunk partials (every thread gets it).
__device__ int row_argmax(const float *part_v, const int *part_i) {
    float bv = 0;
    int bi = -1;
    for (int c = 0; c < kSumChunks; c++)
        if (better(part_v[c], part_i[c], bv, bi)) bv = part_v[c], bi = part_i[c];
    return bi < 0 ? 0 : bi;
}

// Block c: q[i] = e^(l*inv - max*inv) over chunk c (0 for NaN), and
// parts[c] their sum in index order.
__global__ void chunk_exp_kernel(const float *logits, int vocab, double inv, const float *part_v, const int *part_i,
                                 double *q, double *parts) {
    __shared__ int amax;
    if (threadIdx.x == 0) amax = row_argmax(part_v, part_i);
    __syncthreads();
    const double mx = __dmul_rn((double)logits[amax], inv);
    int lo, hi;
    chunk_bounds(vocab, blockIdx.x, lo, hi);
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float l = logits[i];
        q[i] = isnan(l) ? 0.0 : exp_neg(__dsub_rn(__dmul_rn((double)l, inv), mx));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double s = 0;
        for (int i = lo; i < hi; i++) s += q[i];
        parts[blockIdx.x] = s;
    }
}

struct FinishShared {
    float sv[kFinishThreads];
    int si[kFinishThreads];
    double sd[kFinishThreads];
    double parts[kSumChunks];
    int lastk[kSumChunks];
    int cnt, keep;
    double total;
};

// Sum of q over every chunk (thresholded: only q > 0 && q >= t), chunk
// partials into sh.parts; every thread gets the total.
__device__ double chunked_sum(const double *q, int n, FinishShared &sh, bool thresholded, double t) {
    if (threadIdx.x < kSumChunks) {
        int lo, hi;
        chunk_bounds(n, threadIdx.x, lo, hi);
        double s = 0;
        int last = -1;
        for (int i = lo; i < hi; i++) {
            const double v = q[i];
            if (!thresholded || (v > 0 && v >= t)) s += v;
            if (v > 0) last = i;
        }
        sh.parts[threadIdx.x] = s;
        sh.lastk[threadIdx.x] = last;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double s = 0;
        for (int c = 0; c < kSumChunks; c++) s += sh.parts[c];
        sh.total = s;
    }
    __syncthreads();
    const double total = sh.total;
    __syncthreads();
    return total;
}

__device__ double block_max_q(const double *q, int n, FinishShared &sh) {
    double m = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmax(m, q[i]);
    sh.sd[threadIdx.x] = m;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if ((int)threadIdx.x < o) sh.sd[threadIdx.x] = fmax(sh.sd[threadIdx.x], sh.sd[threadIdx.x + o]);
        __syncthreads();
    }
    const double r = sh.sd[0];
    __syncthreads();
    return r;
}

__device__ int block_count(const double *q, int n, double t, FinishShared &sh) {
    if (threadIdx.x == 0) sh.cnt = 0;
    __syncthreads();
    int c = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) c += q[i] > 0 && q[i] >= t;
    atomicAdd(&sh.cnt, c);
    __syncthreads();
    const int r = sh.cnt;
    __syncthreads();
    return r;
}

// a sorts before b: probability descending, then id ascending; -1 pads last.
__device__ __forceinline__ bool before(const double *q, int a, int b) {
    if (a < 0) return false;
    if (b < 0) return true;
    return q[a] > q[b] || (q[a] == q[b] && a < b);
}

// sample.filter on q: top-k, top-p (candidates above a falling threshold,
// sorted), then min-p.
__device__ void filter(double *q, int n, const mg_sample_params &p, int *order, FinishShared &sh) {
    const bool top_p = p.top_p > 0 && p.top_p < 1, top_k = p.top_k > 0 && p.top_k < n;
    if (top_k || top_p) {
        const double mx = block_max_q(q, n, sh);
        const double all = chunked_sum(q, n, sh, false, 0);
        double t = mx / 1024;
        int cnt = 0;
        for (;; t /= 1024) {
            if (t < 1e-300) t = 0;
            cnt = block_count(q, n, t, sh);
            if (t == 0 || (top_k && cnt >= p.top_k)) break;
            if (!top_k && chunked_sum(q, n, sh, true, t) >= __dmul_rn(p.top_p, all)) break;
        }
        // gather the candidates (any order), pad to a power of two, sort
        if (threadIdx.x == 0) sh.cnt = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x)
            if (q[i] > 0 && q[i] >= t) order[atomicAdd(&sh.cnt, 1)] = i;
        int P = 1;
        while (P < cnt) P <<= 1;
        __syncthreads();
        for (int i = cnt + threadIdx.x; i < P; i += blockDim.x) order[i] = -1;
        __syncthreads();
        for (int k = 2; k <= P; k <<= 1)
            for (int j = k >> 1; j > 0; j >>= 1) {
                for (int i = threadIdx.x; i < P; i += blockDim.x) {
                    const int ixj = i ^ j;
                    if (ixj > i) {
                        const int a = order[i], b = order[ixj];
                        const bool up = (i & k) == 0;
                        if (up ? before(q, b, a) : before(q, a, b)) order[i] = b, order[ixj] = a;
                    }
                }
                __syncthreads();
            }
        if (threadIdx.x == 0) {
            int keep = cnt;
            if (top_k && p.top_k < keep) keep = p.top_k;
            if (top_p) {
                double total = 0;
                if (top_k)
                    for (int j = 0; j < keep; j++) total += q[order[j]];
                else
                    total = all;
                double cum = 0;
                const double target = __dmul_rn(p.top_p, total);
                for (int j = 0; j < keep; j++) {
                    if (cum >= target) {
                        keep = j;
                        break;
                    }
                    cum += q[order[j]];
                }
            }
            sh.keep = keep;
        }
        __syncthreads();
        for (int j = threadIdx.x; j < sh.keep; j += blockDim.x) q[order[j]] = -q[order[j]];
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) q[i] = q[i] < 0 ? -q[i] : 0.0;
        __syncthreads();
    }
    if (p.min_p > 0) {
        const double mx = block_max_q(q, n, sh);
        const double thr = __dmul_rn(p.min_p, mx);
        for (int i = threadIdx.x; i < n; i += blockDim.x)
            if (q[i] < thr) q[i] = 0;
        __syncthreads();
    }
}

// One block: top logprobs (lse_parts from the temperature-1 pass), greedy,
// or the filters and the draw on q (the temperature pass).
__global__ void __launch_bounds__(kFinishThreads) finish_kernel(const float *logits, int vocab, mg_sample_params p,
        int64_t draw, const float *part_v, const int *part_i, const double *lse_parts, double *q, int *order,
        mg_sample_result *res, int32_t *hist_out) {
    __shared__ FinishShared sh;
    const int amax = row_argmax(part_v, part_i);
    const double lmax = (double)logits[amax];
    double log_s = 0; // log of the sum of e^(l - max), as sample.logSoftmaxAt
    if (lse_parts) {
        double s = 0;
        for (int c = 0; c < kSumChunks; c++) s += lse_parts[c];
        log_s = log(s);
    }
    const double lse = lmax + log_s;
    // the chosen id's model logprob: wanted, and the distribution finite
    const bool want_lp = (p.logprobs || p.top_logprobs > 0) && lse_parts && !isnan(lse) && !isinf(lse);
    if (threadIdx.x == 0) res->n_top = 0, res->model_logprob = 0;
    __syncthreads();
    if (p.top_logprobs > 0 && want_lp) {
        const int k = p.top_logprobs < vocab ? p.top_logprobs : vocab;
        int taken = 0;
        for (int round = 0; round < k; round++) {
            float bv = 0;
            int bi = -1;
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                const float v = logits[i];
                if (isnan(v)) continue;
                bool used = false;
                for (int j = 0; j < taken; j++) used |= res->top_ids[j] == i;
                if (!used && better(v, i, bv, bi)) bv = v, bi = i;
            }
            sh.sv[threadIdx.x] = bv;
            sh.si[threadIdx.x] = bi;
            __syncthreads();
            block_argmax(sh.sv, sh.si);
            const int id = sh.si[0];
            __syncthreads();
            if (id < 0) break;
            if (threadIdx.x == 0) {
                res->top_ids[taken] = id;
                res->top_logprobs[taken] = (float)((double)logits[id] - lse);
            }
            taken++;
            __syncthreads();
        }
        if (threadIdx.x == 0) res->n_top = taken;
    }
    if (p.temperature == 0) {
        if (threadIdx.x == 0) {
            double lp = (double)logits[amax] - lmax - log_s;
            if (isnan(lp) || isinf(lp)) lp = 0;
            res->id = amax;
            res->logprob = (float)lp;
            if (want_lp) res->model_logprob = (float)((double)logits[amax] - lse);
            if (hist_out) *hist_out = amax;
        }
        return;
    }
    filter(q, vocab, p, order, sh);
    const double total = chunked_sum(q, vocab, sh, false, 0);
    if (threadIdx.x != 0) return;
    int id = amax;
    double lp = 0;
    if (total > 0) {
        double u = __dmul_rn(uniform(p.seed, draw), total);
        int last = -1, got = -1;
        for (int c = 0; c < kSumChunks && got < 0; c++) {
            if (!(u < sh.parts[c])) {
                u -= sh.parts[c];
                if (sh.lastk[c] >= 0) last = sh.lastk[c];
                continue;
            }
            int lo, hi;
            chunk_bounds(vocab, c, lo, hi);
            for (int i = lo; i < hi; i++) {
                const double v = q[i];
                if (v == 0) continue;
                last = i;
                if (u < v) {
                    got = i;
                    break;
                }
                u -= v;
            }
            if (got < 0) got = last;
        }
        id = got >= 0 ? got : last;
        lp = log(q[id] / total);
    }
    res->id = id;
    res->logprob = (float)lp;
    if (want_lp) res->model_logprob = (float)((double)logits[id] - lse);
    if (hist_out) *hist_out = id;
}

// Block r: flags[r] = 1 when row r of logits holds NaN or +Inf (the model
// blew up: no token is sampled from it), else 0.
__global__ void non_finite_kernel(const float *logits, int vocab, int32_t *flags) {
    const float *row = logits + (size_t)blockIdx.x * vocab;
    int bad = 0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = row[i];
        bad |= isnan(v) || v > FLT_MAX;
    }
    bad = __syncthreads_or(bad);
    if (threadIdx.x == 0) flags[blockIdx.x] = bad ? 1 : 0;
}

} // namespace

size_t sample_scratch_bytes(int vocab) {
    size_t pow2 = 1;
    while (pow2 < (size_t)vocab) pow2 <<= 1;
    return (size_t)vocab * 8 + pow2 * 4 + (size_t)vocab * 4 + kSumChunks * (8 + 8 + 4 + 4) + 256;
}

SampleScratch sample_scratch(void *mem, int vocab) {
    size_t pow2 = 1;
    while (pow2 < (size_t)vocab) pow2 <<= 1;
    char *b = static_cast<char *>(mem);
    SampleScratch sc;
    sc.q = reinterpret_cast<double *>(b);
    b += (size_t)vocab * 8;
    sc.lse_parts = reinterpret_cast<double *>(b);
    b += kSumChunks * 8;
    sc.parts = reinterpret_cast<double *>(b);
    b += kSumChunks * 8;
    sc.part_v = reinterpret_cast<float *>(b);
    b += kSumChunks * 4;
    sc.part_i = reinterpret_cast<int *>(b);
    b += kSumChunks * 4;
    sc.order = reinterpret_cast<int *>(b);
    b += pow2 * 4;
    sc.cnt = reinterpret_cast<int32_t *>(b);
    return sc;
}

bool sample_params_ok(const mg_sample_params &p) {
    auto bad = [](double v) { return v != v || v > DBL_MAX || v < -DBL_MAX; };
    return !bad(p.temperature) && p.temperature >= 0 && p.temperature <= 100 && p.top_k >= 0 && !bad(p.top_p) &&
           p.top_p >= 0 && p.top_p <= 1 && !bad(p.min_p) && p.min_p >= 0 && p.min_p <= 1 && !bad(p.repetition_penalty) &&
           p.repetition_penalty >= 0 && p.repetition_penalty <= 100 && !bad(p.presence_penalty) &&
           p.presence_penalty >= -2 && p.presence_penalty <= 2 && !bad(p.frequency_penalty) &&
           p.frequency_penalty >= -2 && p.frequency_penalty <= 2 && p.top_logprobs >= 0 &&
           p.top_logprobs <= MG_MAX_TOP_LOGPROBS && (p.logprobs == 0 || p.logprobs == 1);
}

cudaError_t sample_row(float *logits, int vocab, const mg_sample_params &p, const int32_t *hist, int n_hist, int gen_from,
                       int64_t draw, int32_t *hist_out, const SampleScratch &sc, mg_sample_result *res, cudaStream_t st) {
    const bool rep = p.repetition_penalty != 0 && p.repetition_penalty != 1;
    const bool pg = (p.presence_penalty != 0 || p.frequency_penalty != 0) && gen_from < n_hist;
    if ((rep || pg) && n_hist > 0) penalize_kernel<<<1, 1024, 0, st>>>(logits, vocab, hist, n_hist, gen_from, p, sc.cnt);
    chunk_argmax_kernel<<<kSumChunks, 256, 0, st>>>(logits, vocab, sc.part_v, sc.part_i);
    const bool greedy = p.temperature == 0;
    const bool lse = greedy || p.top_logprobs > 0 || p.logprobs;
    if (lse) chunk_exp_kernel<<<kSumChunks, 256, 0, st>>>(logits, vocab, 1.0, sc.part_v, sc.part_i, sc.q, sc.lse_parts);
    if (!greedy) {
        const double inv = 1 / p.temperature; // on the host: IEEE division, as Go's
        chunk_exp_kernel<<<kSumChunks, 256, 0, st>>>(logits, vocab, inv, sc.part_v, sc.part_i, sc.q, sc.parts);
    }
    finish_kernel<<<1, kFinishThreads, 0, st>>>(logits, vocab, p, draw, sc.part_v, sc.part_i,
                                                lse ? sc.lse_parts : nullptr, sc.q, sc.order,
                                                res, hist_out);
    return cudaGetLastError();
}

cudaError_t non_finite_rows(const float *logits, int rows, int vocab, int32_t *flags, cudaStream_t st) {
    non_finite_kernel<<<rows, 256, 0, st>>>(logits, vocab, flags);
    return cudaGetLastError();
}

} // namespace mg

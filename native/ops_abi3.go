package native

/*
#include <string.h>
#include "meshgpu_ops.h"

static mg_status o_sample(const mg_ops_api *a, const float *logits, int32_t vocab, const mg_sample_params *p,
		const int32_t *hist, int32_t nh, int32_t gen, int64_t draw, mg_sample_result *out, char *err, size_t errlen) {
	if (!a->sample) {
		strncpy(err, "the op table has no sample", errlen - 1);
		err[errlen - 1] = 0;
		return MG_ERR_UNSUPPORTED;
	}
	mg_status st = a->sample(logits, vocab, p, hist, nh, gen, draw, out);
	if (st != MG_OK) {
		const char *m = a->last_error ? a->last_error() : NULL;
		strncpy(err, m && *m ? m : "(no message)", errlen - 1);
		err[errlen - 1] = 0;
	}
	return st;
}

static mg_status o_norm_matmul(const mg_ops_api *a, const float *x, int32_t ndt, const void *np, int32_t nr, float eps,
		int32_t wdt, const void *wp, int32_t wr, int32_t wc, int32_t n, float *out, char *err, size_t errlen) {
	if (!a->norm_matmul) {
		strncpy(err, "the op table has no norm_matmul", errlen - 1);
		err[errlen - 1] = 0;
		return MG_ERR_UNSUPPORTED;
	}
	mg_ops_weight nw = {ndt, np, nr, 1}, w = {wdt, wp, wr, wc};
	mg_status st = a->norm_matmul(x, &nw, eps, &w, n, out);
	if (st != MG_OK) {
		const char *m = a->last_error ? a->last_error() : NULL;
		strncpy(err, m && *m ? m : "(no message)", errlen - 1);
		err[errlen - 1] = 0;
	}
	return st;
}

static mg_status o_matmul_mma(const mg_ops_api *a, const float *x, int32_t wdt, const void *wp, int32_t wr, int32_t wc,
		int32_t n, float *out, char *err, size_t errlen) {
	if (!a->matmul_mma) {
		strncpy(err, "the op table has no matmul_mma", errlen - 1);
		err[errlen - 1] = 0;
		return MG_ERR_UNSUPPORTED;
	}
	mg_ops_weight w = {wdt, wp, wr, wc};
	mg_status st = a->matmul_mma(x, &w, n, out);
	if (st != MG_OK) {
		const char *m = a->last_error ? a->last_error() : NULL;
		strncpy(err, m && *m ? m : "(no message)", errlen - 1);
		err[errlen - 1] = 0;
	}
	return st;
}

static mg_status o_mma_gbps(const mg_ops_api *a, int32_t m, int32_t k, int32_t n, int32_t iters, double *out, char *err, size_t errlen) {
	mg_status st = a->mma_gbps ? a->mma_gbps(m, k, n, iters, out) : MG_ERR_UNSUPPORTED;
	if (st != MG_OK) {
		const char *msg = a->mma_gbps && a->last_error ? a->last_error() : "the op table has no mma_gbps";
		strncpy(err, msg && *msg ? msg : "(no message)", errlen - 1);
		err[errlen - 1] = 0;
	}
	return st;
}
*/
import "C"

import (
	"math"

	"meshgpu/sample"
)

// Sample runs the backend sampler on one row of logits (left unchanged):
// what sample.Choose computes, on the device for CUDA.
func (o *Ops) Sample(logits []float32, p sample.Params, history []int32, generatedFrom, draw int) (sample.Choice, error) {
	if len(logits) == 0 || len(logits) > math.MaxInt32 || len(history) > math.MaxInt32 || generatedFrom < 0 ||
		generatedFrom > math.MaxInt32 || draw < 0 {
		return sample.Choice{}, argErr("sample", "%d logits, %d history, generated from %d, draw %d", len(logits), len(history), generatedFrom, draw)
	}
	cp, err := sampleParams(p)
	if err != nil {
		return sample.Choice{}, argErr("sample", "%v", err)
	}
	var hp *C.int32_t
	if len(history) > 0 {
		hp = (*C.int32_t)(&history[0])
	}
	var res C.mg_sample_result
	var eb [opsErrLen]C.char
	st := C.o_sample(o.api, f32p(logits), C.int32_t(len(logits)), &cp, hp, C.int32_t(len(history)), C.int32_t(generatedFrom),
		C.int64_t(draw), &res, &eb[0], opsErrLen)
	if err := opsErr("sample", st, &eb); err != nil {
		return sample.Choice{}, err
	}
	c := sample.Choice{ID: int32(res.id), Logprob: float32(res.logprob), ModelLogprob: float32(res.model_logprob)}
	for j := 0; j < int(res.n_top) && j < C.MG_MAX_TOP_LOGPROBS; j++ {
		c.Top = append(c.Top, sample.Candidate{ID: int32(res.top_ids[j]), Logprob: float32(res.top_logprobs[j])})
	}
	return c, nil
}

// NormMatmul returns rmsnorm(x, norm, eps) @ w^T, [n, w.Rows]: on CUDA the
// RMSNorm folded into the matrix-vector kernel (up to 16 rows).
func (o *Ops) NormMatmul(x []float32, norm OpsWeight, eps float32, w OpsWeight, n int) ([]float32, error) {
	if err := w.check("norm_matmul"); err != nil {
		return nil, err
	}
	if err := norm.check("norm_matmul"); err != nil {
		return nil, err
	}
	if n <= 0 || len(x) != n*w.Cols || norm.Rows != w.Cols {
		return nil, argErr("norm_matmul", "x has %d values, want %d rows of %d; norm %d", len(x), n, w.Cols, norm.Rows)
	}
	out := make([]float32, n*w.Rows)
	var eb [opsErrLen]C.char
	st := C.o_norm_matmul(o.api, f32p(x), C.int32_t(norm.DType), bytep(norm.Data), C.int32_t(norm.Rows), C.float(eps),
		C.int32_t(w.DType), bytep(w.Data), C.int32_t(w.Rows), C.int32_t(w.Cols), C.int32_t(n), f32p(out), &eb[0], opsErrLen)
	return out, opsErr("norm_matmul", st, &eb)
}

// MatmulMMA returns x @ w^T, [n, w.Rows], as the backend computes it under
// CUDASettings.BatchMMA: the tensor-core matrix-vector kernel on CUDA up to
// 16 rows; plain matmul on the CPU.
func (o *Ops) MatmulMMA(x []float32, w OpsWeight, n int) ([]float32, error) {
	if err := w.check("matmul_mma"); err != nil {
		return nil, err
	}
	if n <= 0 || len(x) != n*w.Cols {
		return nil, argErr("matmul_mma", "x has %d values, want %d rows of %d", len(x), n, w.Cols)
	}
	out := make([]float32, n*w.Rows)
	var eb [opsErrLen]C.char
	st := C.o_matmul_mma(o.api, f32p(x), C.int32_t(w.DType), bytep(w.Data), C.int32_t(w.Rows), C.int32_t(w.Cols),
		C.int32_t(n), f32p(out), &eb[0], opsErrLen)
	return out, opsErr("matmul_mma", st, &eb)
}

// MMAGBps measures the tensor-core matrix-vector kernel's weight bandwidth.
func (o *Ops) MMAGBps(m, k, n, iters int) (float64, error) {
	var v C.double
	var eb [opsErrLen]C.char
	st := C.o_mma_gbps(o.api, C.int32_t(m), C.int32_t(k), C.int32_t(n), C.int32_t(iters), &v, &eb[0], opsErrLen)
	return float64(v), opsErr("mma_gbps", st, &eb)
}

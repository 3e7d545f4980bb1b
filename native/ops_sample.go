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
	c := sample.Choice{ID: int32(res.id), Logprob: float32(res.logprob)}
	for j := 0; j < int(res.n_top) && j < C.MG_MAX_TOP_LOGPROBS; j++ {
		c.Top = append(c.Top, sample.TokenLogprob{ID: int32(res.top_ids[j]), Logprob: float32(res.top_logprobs[j])})
	}
	return c, nil
}

package native

/*
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include "meshgpu.h"

static void ends_copy_err(const mg_api *a, char *err, size_t n) {
	const char *m = a->last_error ? a->last_error() : NULL;
	if (!m || !*m) m = "(no message)";
	strncpy(err, m, n - 1);
	err[n - 1] = 0;
}

// ends_has reports whether the table has the ABI 3 calls (the table is
// extensible: a call exists when it lies below table_size and is set).
static int ends_has(const mg_api *a) {
	return a->abi_version >= 3 && a->table_size >= offsetof(mg_api, decode) + sizeof(a->decode) &&
	       a->head_forward && a->tail_forward && a->decode;
}

// which: 0 head_forward, 1 tail_forward, 2 decode.
static mg_status t_ends(const mg_api *a, int which, mg_stack *s, const mg_token_step *steps, int32_t n, int32_t layer,
		int32_t dtype, void *act, char *err, size_t errlen) {
	mg_status st;
	switch (which) {
	case 0: st = a->head_forward(s, steps, n, layer, dtype, act); break;
	case 1: st = a->tail_forward(s, steps, n, layer, dtype, act); break;
	default: st = a->decode(s, steps, n);
	}
	if (st != MG_OK) ends_copy_err(a, err, errlen);
	return st;
}
*/
import "C"

import (
	"math"
	"unsafe"

	"meshgpu/sample"
)

// TokenStep is one sequence's part of a HeadForward, TailForward or Decode
// call (meshgpu.h mg_token_step): Tokens (or, on a tail feeding back its own
// samples, NTokens with Tokens nil) at positions Pos.., with the sampling of
// the token that follows.
type TokenStep struct {
	Session Session
	Pos     int
	Tokens  []int32 // the ids at Pos..; nil: those the session's history holds
	NTokens int     // used when Tokens is nil
	// GeneratedFrom: history[GeneratedFrom:] are generated tokens (the
	// presence and frequency penalties count them).
	GeneratedFrom int
	Draw          int           // the generated token's index, which seeds its draw
	Params        sample.Params // tail and Decode
	// Logits, when not nil, receives the last row's raw logits (Vocab
	// values); nil: only the pick leaves the backend (these calls'
	// logits; the separate Logits call is how a verify pass gets its own).
	Logits []float32
}

func (t TokenStep) n() int {
	if t.Tokens != nil {
		return len(t.Tokens)
	}
	return t.NTokens
}

// Ends is implemented by stacks whose backend runs the mesh's ends in one
// call each (ABI 3): the head's embedding and layers, the tail's layers,
// head and sampling, or all of it on a single node. The session's token
// history stays in the backend. Logits holding NaN or +Inf fail TailForward
// and Decode with StatusNonFinite (no token sampled). Every native stack
// implements it; check HasEnds, as a CUDA library built before ABI 3 lacks
// the calls. sched runs them for works that sample (sched.Work.Sample).
type Ends interface {
	HasEnds() bool
	// HeadForward embeds each step's Tokens and runs layers First..last;
	// out receives the rows (dtype), as Forward's out.
	HeadForward(steps []TokenStep, last int, dtype DType, out []byte) error
	// TailForward runs layers first..Last on in, then the final norm, LM
	// head and sampling on each step's last row.
	TailForward(steps []TokenStep, first int, dtype DType, in []byte) ([]sample.Choice, error)
	// Decode is both: tokens in, one sampled token per step out.
	Decode(steps []TokenStep) ([]sample.Choice, error)
}

func (st *cStack) HasEnds() bool { return C.ends_has(st.be.api) != 0 }

func (st *cStack) HeadForward(steps []TokenStep, last int, dtype DType, out []byte) error {
	_, err := st.ends(0, "head_forward", steps, last, dtype, out)
	return err
}

func (st *cStack) TailForward(steps []TokenStep, first int, dtype DType, in []byte) ([]sample.Choice, error) {
	return st.ends(1, "tail_forward", steps, first, dtype, in)
}

func (st *cStack) Decode(steps []TokenStep) ([]sample.Choice, error) {
	return st.ends(2, "decode", steps, 0, F32, nil)
}

func b2i(v bool) int {
	if v {
		return 1
	}
	return 0
}

func sampleParams(p sample.Params) (C.mg_sample_params, error) {
	if err := p.Validate(); err != nil {
		return C.mg_sample_params{}, err
	}
	if p.TopK > math.MaxInt32 {
		p.TopK = math.MaxInt32
	}
	return C.mg_sample_params{temperature: C.double(p.Temperature), top_p: C.double(p.TopP), min_p: C.double(p.MinP),
		repetition_penalty: C.double(p.RepetitionPenalty), presence_penalty: C.double(p.PresencePenalty),
		frequency_penalty: C.double(p.FrequencyPenalty), seed: C.uint64_t(p.Seed), top_k: C.int32_t(p.TopK),
		top_logprobs: C.int32_t(p.TopLogprobs), logprobs: C.int32_t(b2i(p.Logprobs))}, nil
}

// ends runs one of the calls. The step array, token ids, results and
// logits live in one C allocation: C must not hold Go pointers in memory
// it reads.
func (st *cStack) ends(which int, op string, steps []TokenStep, layer int, dtype DType, act []byte) ([]sample.Choice, error) {
	if len(steps) == 0 || len(steps) > 65536 {
		return nil, invalid(op, "%d steps", len(steps))
	}
	cl, err := i32(op, "layer", layer)
	if err != nil {
		return nil, err
	}
	rows, toks, wantLogits := 0, 0, 0
	for i, s := range steps {
		se, ok := s.Session.(*cSession)
		if !ok || se == nil || se.st != st {
			return nil, invalid(op, "step %d: session does not belong to this stack", i)
		}
		n := s.n()
		if n <= 0 || n > math.MaxInt32 || s.Pos < 0 || s.Pos > math.MaxInt32 || s.GeneratedFrom < 0 ||
			s.GeneratedFrom > math.MaxInt32 || s.Draw < 0 {
			return nil, invalid(op, "step %d: position %d, %d tokens, generated from %d, draw %d", i, s.Pos, n, s.GeneratedFrom, s.Draw)
		}
		if which == 0 && s.Tokens == nil {
			return nil, invalid(op, "step %d: the head needs the tokens", i)
		}
		if s.Logits != nil {
			if len(s.Logits) < st.cfg.Vocab {
				return nil, invalid(op, "step %d: logits hold %d values, want %d", i, len(s.Logits), st.cfg.Vocab)
			}
			wantLogits++
		}
		rows += n
		if s.Tokens != nil {
			toks += n
		}
		if rows > 1<<24 {
			return nil, invalid(op, "too many rows")
		}
	}
	switch which {
	case 0:
		if err := rowBytes(op, "out", act, rows, st.cfg.Hidden, dtype); err != nil {
			return nil, err
		}
	case 1:
		if err := rowBytes(op, "in", act, rows, st.cfg.Hidden, dtype); err != nil {
			return nil, err
		}
	}
	cps := make([]C.mg_sample_params, len(steps))
	if which != 0 {
		for i, s := range steps {
			if cps[i], err = sampleParams(s.Params); err != nil {
				return nil, invalid(op, "step %d: %v", i, err)
			}
		}
	}
	ns := len(steps)
	size := ns*int(unsafe.Sizeof(C.mg_token_step{})) + ns*int(unsafe.Sizeof(C.mg_sample_result{})) +
		(toks+1)*4 + wantLogits*st.cfg.Vocab*4
	mem := C.calloc(1, C.size_t(size))
	if mem == nil {
		return nil, &Error{Status: StatusOutOfMemory, Op: op, Msg: "out of memory"}
	}
	defer C.free(mem)
	cs := unsafe.Slice((*C.mg_token_step)(mem), ns)
	res := unsafe.Slice((*C.mg_sample_result)(unsafe.Add(mem, ns*int(unsafe.Sizeof(C.mg_token_step{})))), ns)
	tokBase := unsafe.Add(unsafe.Pointer(&res[0]), ns*int(unsafe.Sizeof(C.mg_sample_result{})))
	ctoks := unsafe.Slice((*int32)(tokBase), toks+1)
	logBase := unsafe.Add(tokBase, (toks+1)*4)
	lgs := unsafe.Slice((*float32)(logBase), wantLogits*st.cfg.Vocab+1)

	st.mu.Lock()
	defer st.mu.Unlock()
	if st.s == nil {
		return nil, invalid(op, "stack is closed")
	}
	tk, lk := 0, 0
	for i, s := range steps {
		se := s.Session.(*cSession)
		if se.s == nil {
			return nil, invalid(op, "step %d: session is closed", i)
		}
		c := &cs[i]
		c.session = se.s
		c.pos = C.int32_t(s.Pos)
		c.n_tokens = C.int32_t(s.n())
		if s.Tokens != nil {
			copy(ctoks[tk:], s.Tokens)
			c.tokens = (*C.int32_t)(unsafe.Pointer(&ctoks[tk]))
			tk += len(s.Tokens)
		}
		c.generated_from = C.int32_t(s.GeneratedFrom)
		c.draw = C.int64_t(s.Draw)
		c.sample = cps[i]
		c.result = &res[i]
		if s.Logits != nil {
			c.logits = (*C.float)(unsafe.Pointer(&lgs[lk]))
			lk += st.cfg.Vocab
		}
	}
	if C.ends_has(st.be.api) == 0 {
		return nil, &Error{Status: StatusUnsupported, Op: op, Msg: "the backend library predates ABI 3 (no " + op + ")"}
	}
	var actp unsafe.Pointer
	if act != nil {
		actp = unsafe.Pointer(&act[0])
	}
	var eb errBuf
	p, n := eb.ptr()
	if err := eb.check(op, C.t_ends(st.be.api, C.int(which), st.s, &cs[0], C.int32_t(ns), cl, C.int32_t(dtype), actp, p, n)); err != nil {
		return nil, err
	}
	if which == 0 {
		return nil, nil
	}
	out := make([]sample.Choice, ns)
	lk = 0
	for i, s := range steps {
		r := &res[i]
		out[i] = sample.Choice{ID: int32(r.id), Logprob: float32(r.logprob), ModelLogprob: float32(r.model_logprob)}
		for j := 0; j < int(r.n_top) && j < C.MG_MAX_TOP_LOGPROBS; j++ {
			out[i].Top = append(out[i].Top, sample.Candidate{ID: int32(r.top_ids[j]), Logprob: float32(r.top_logprobs[j])})
		}
		if s.Logits != nil {
			copy(s.Logits, lgs[lk:lk+st.cfg.Vocab])
			lk += st.cfg.Vocab
		}
	}
	return out, nil
}

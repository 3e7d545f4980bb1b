package node

import (
	"math"
	"net/http"
	"slices"

	"meshgpu/sample"
	"meshgpu/sched"
	"meshgpu/wire"
)

// The node's ends sample in the backend where they can: a plain step on
// the node with the model's last layer (a tail's hop, or the head's own
// step when it holds every layer) runs as a sampling work (sched.Work.Sample,
// one native.Ends call for the batch), and only the picked token and its
// logprobs leave the backend, not Vocab logits per token (on CUDA, the
// final norm, LM head and sampler stay in the decode graph). The picks are
// those sampleWithHistory makes from the same logits (the backends'
// samplers are sample.Choose bit for bit). Verify passes, token trees and
// response formats (whose mask is applied in Go, node/constrained.go) keep
// the logits path, as does a backend without the ends.

// endsHistory is what this node knows of the token history the backend
// keeps for a session (meshgpu.h mg_token_step), which its sampler reads
// for the penalties and only sampling calls write: the backend holds at
// least held ids, and the first same of them are the session's history
// (same <= len(history)). Under the session's lock.
type endsHistory struct{ held, same int }

// sampled records a sampling call at pos of n rows; recorded: the
// session's history now ends with the call's ids (the backend's, which
// holds its pick after them).
func (h *endsHistory) sampled(pos, n int, recorded bool) {
	h.held = pos + n + 1
	if recorded && h.same >= pos {
		h.same = pos + n
	} else {
		h.same = min(h.same, pos)
	}
}

// changed: the session's history changes from pos (the backend's does not).
func (h *endsHistory) changed(pos int) { h.same = min(h.same, pos) }

// lost: the backend's history may end at pos (a failed sampling call, a
// compacted tree).
func (h *endsHistory) lost(pos int) { h.held, h.same = min(h.held, pos), min(h.same, pos) }

// backendSample is the sampling work of a plain step of sess at pos (n
// rows; ids: the step's token ids, nil when its hop carried none), or nil
// when the step samples in Go from the logits: a response format, a
// backend without the ends (or SampleOnHost), or a token history the
// backend's sampler would not read as the node's (after a verify pass,
// which records nothing there, or a hop without ids when the penalties
// read them).
func (s *Server) backendSample(sess *session, p sample.Params, pos, n int, ids []int32, step int) *sched.SampleStep {
	if s.SampleOnHost || len(p.ResponseFormat) > 0 || sess.ends.held < pos {
		return nil
	}
	if sc, err := s.scheduler(); err != nil || sc == nil || !sc.CanSample() {
		return nil
	}
	known := len(ids) == n
	if p.NeedsHistory() && (!known || sess.ends.same < pos) {
		return nil
	}
	if !known {
		ids = make([]int32, n) // the penalties read no history: any ids hold the places
	}
	if !p.Logprobs {
		p.TopLogprobs = 0 // (not reported: sampleWithHistory computes none)
	}
	// sampleWithHistory's rule: the last step ids of the history are generated
	return &sched.SampleStep{Params: p, GeneratedFrom: max(pos+n-step, 0), Draw: step, Tokens: ids}
}

// backendReply is the token reply of the backend's pick c, with the
// logprobs sampleWithHistory reports for p.
func backendReply(c sample.Choice, p sample.Params) wire.TokenReply {
	r := wire.TokenReply{Token: c.ID, Logprob: c.Logprob}
	if p.Logprobs {
		top := slices.DeleteFunc(c.Top, func(c sample.Candidate) bool { return math.IsInf(float64(c.Logprob), -1) })
		r.Logprobs = &sample.TokenLogprobs{Logprob: c.ModelLogprob, Top: top}
	}
	return r
}

// errNonFiniteLogits: the model's logits hold NaN or +Inf (sampling would
// pick a token from noise).
func errNonFiniteLogits() *apiError {
	return &apiError{Status: http.StatusInternalServerError, Type: "non_finite_logits",
		Message: "the model's logits are not finite (NaN or +Inf); no token sampled"}
}

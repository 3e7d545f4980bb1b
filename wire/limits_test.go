package wire

import (
	"math"
	"testing"
)

// A token answer holding what no sampler sends is refused, whatever the
// field; an honest one passes.
func TestTokenReplyCheck(t *testing.T) {
	nan := float32(math.NaN())
	good := func() *TokenReply {
		return &TokenReply{Token: 3, Logprob: -0.5, Logprobs: &TokenLogprobs{Logprob: -0.25, Top: []Candidate{{ID: 3, Logprob: -0.25}, {ID: 9, Logprob: -2}}}}
	}
	if err := good().Check(10); err != nil {
		t.Fatal(err)
	}
	if err := (&TokenReply{Token: 0, Logprob: 1e-7}).Check(10); err != nil {
		t.Fatalf("rounding above 0: %v", err)
	}
	for name, bad := range map[string]func(*TokenReply){
		"NaN logprob":       func(r *TokenReply) { r.Logprob = nan },
		"-Inf logprob":      func(r *TokenReply) { r.Logprob = float32(math.Inf(-1)) },
		"positive logprob":  func(r *TokenReply) { r.Logprob = 0.5 },
		"NaN model logprob": func(r *TokenReply) { r.Logprobs.Logprob = nan },
		"NaN top":           func(r *TokenReply) { r.Logprobs.Top[1].Logprob = nan },
		"top id":            func(r *TokenReply) { r.Logprobs.Top[0].ID = -1 },
		"token id":          func(r *TokenReply) { r.Token = 10 },
		"too many top":      func(r *TokenReply) { r.Logprobs.Top = make([]Candidate, MaxTopLogprobs+1) },
	} {
		r := good()
		bad(r)
		if err := r.Check(10); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

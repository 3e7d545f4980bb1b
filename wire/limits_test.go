package wire

import (
	"encoding/json"
	"math"
	"strings"
	"testing"
)

// Every request that passes validation fits its hop: a response format of
// MaxFormatBytes with every sampling number at its longest passes
// CheckHopSize and binds next to the longest route and ticket. (The
// binding's sampling field was 4 KiB under a 32 KiB request limit: a valid
// request failed at the hop and the tracker blamed the next node.)
func TestBindingCarriesEveryValidRequest(t *testing.T) {
	format, _ := json.Marshal(map[string]string{"type": "json_schema", "schema": strings.Repeat("x", MaxFormatBytes-40)})
	if len(format) > MaxFormatBytes || len(format) < MaxFormatBytes-64 {
		t.Fatalf("format of %d bytes, want just under %d", len(format), MaxFormatBytes)
	}
	odd := 1.0000000000000002 // the longest decimals
	p := SamplingParams{Temperature: 99.00000000000001, TopK: math.MaxInt64, TopP: odd / 2, MinP: odd / 3, RepetitionPenalty: 99.00000000000001,
		Seed: math.MaxUint64, PresencePenalty: -1.9999999999999998, FrequencyPenalty: -1.9999999999999998, Logprobs: true, TopLogprobs: MaxTopLogprobs,
		ResponseFormat: format}
	if err := p.Validate(); err != nil {
		t.Fatal(err)
	}
	if we := p.CheckHopSize(); we != nil {
		t.Fatalf("a valid request does not fit its hop: %v", we)
	}
	route := make([]Hop, 0, MaxRouteHops)
	for len(route) < 40 {
		route = append(route, Hop{Endpoint: "http://" + strings.Repeat("h", 200) + ":7000", StartLayer: len(route) + 1, EndLayer: len(route) + 1, PeerID: strings.Repeat("p", 100)})
	}
	for {
		b, _ := json.Marshal(route)
		if len(b) > MaxRouteBytes {
			route = route[:len(route)-1]
			break
		}
		route = append(route, Hop{Endpoint: "http://h:7000", StartLayer: len(route) + 1, EndLayer: len(route) + 1})
	}
	b := &Binding{StartLayer: 0, EndLayer: 0, Route: route, Sampling: p, Ticket: make([]byte, MaxTicketBytes)}
	enc, err := b.Append(nil)
	if err != nil {
		t.Fatalf("a binding with every field at its limit: %v", err)
	}
	if _, err := ParseBinding(enc, 0); err != nil {
		t.Fatalf("parsing it back: %v", err)
	}
	// Over the limit, the request itself is refused (400), before any hop.
	p.ResponseFormat, _ = json.Marshal(map[string]string{"type": "json_schema", "schema": strings.Repeat("x", MaxHopSampling)})
	if we := p.CheckHopSize(); we == nil || we.Status != 400 {
		t.Fatalf("sampling over the hop limit: %v, want a 400", we)
	}
}

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

package hopmux

import (
	"encoding/json"
	"math"
	"strings"
	"testing"

	"meshgpu/wire"
)

// Every request that passes validation fits its hop: a response format of
// MaxFormatBytes with every sampling number at its longest passes
// CheckHopSize and binds next to the longest route and ticket. (The
// binding's sampling field was 4 KiB under a 32 KiB request limit: a valid
// request failed at the hop and the tracker blamed the next node.)
func TestBindingCarriesEveryValidRequest(t *testing.T) {
	format, _ := json.Marshal(map[string]string{"type": "json_schema", "schema": strings.Repeat("x", wire.MaxFormatBytes-40)})
	if len(format) > wire.MaxFormatBytes || len(format) < wire.MaxFormatBytes-64 {
		t.Fatalf("format of %d bytes, want just under %d", len(format), wire.MaxFormatBytes)
	}
	odd := 1.0000000000000002 // the longest decimals
	p := wire.SamplingParams{Temperature: 99.00000000000001, TopK: math.MaxInt64, TopP: odd / 2, MinP: odd / 3, RepetitionPenalty: 99.00000000000001,
		Seed: math.MaxUint64, PresencePenalty: -1.9999999999999998, FrequencyPenalty: -1.9999999999999998, Logprobs: true, TopLogprobs: wire.MaxTopLogprobs,
		ResponseFormat: format}
	if err := p.Validate(); err != nil {
		t.Fatal(err)
	}
	if we := p.CheckHopSize(); we != nil {
		t.Fatalf("a valid request does not fit its hop: %v", we)
	}
	route := make([]wire.Hop, 0, wire.MaxRouteHops)
	for len(route) < 40 {
		route = append(route, wire.Hop{Endpoint: "http://" + strings.Repeat("h", 200) + ":7000", StartLayer: len(route) + 1, EndLayer: len(route) + 1, PeerID: strings.Repeat("p", 100)})
	}
	for {
		b, _ := json.Marshal(route)
		if len(b) > wire.MaxRouteBytes {
			route = route[:len(route)-1]
			break
		}
		route = append(route, wire.Hop{Endpoint: "http://h:7000", StartLayer: len(route) + 1, EndLayer: len(route) + 1})
	}
	b := &wire.Binding{StartLayer: 0, EndLayer: 0, Route: route, Sampling: p, Ticket: make([]byte, wire.MaxTicketBytes)}
	enc, err := AppendBinding(nil, b)
	if err != nil {
		t.Fatalf("a binding with every field at its limit: %v", err)
	}
	if _, err := ParseBinding(enc, 0); err != nil {
		t.Fatalf("parsing it back: %v", err)
	}
	// Over the limit, the request itself is refused (400), before any hop.
	p.ResponseFormat, _ = json.Marshal(map[string]string{"type": "json_schema", "schema": strings.Repeat("x", wire.MaxHopSampling)})
	if we := p.CheckHopSize(); we == nil || we.Status != 400 {
		t.Fatalf("sampling over the hop limit: %v, want a 400", we)
	}
}

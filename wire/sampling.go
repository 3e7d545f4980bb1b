package wire

import (
	"encoding/json"
	"fmt"
	"math"
	"reflect"
)

// Limits of the sampling parameters a request may ask for (the OpenAI
// API's validation, package openai, enforces them on arrival).
const (
	MaxTopLogprobs = 20 // chat top_logprobs and completions logprobs
	// MaxFormatBytes bounds a response format (a json_schema's compact
	// schema, or the format a head builds from tools): it travels in every
	// session binding, whose sampling field is sized from it (MaxHopSampling).
	MaxFormatBytes = 32 << 10
)

// SamplingParams are the sampling settings of one request (package sample
// draws with them; sample.Params is this type). They travel in the session
// binding, and in X-Meshnet-Sampling on POST /forward.
type SamplingParams struct {
	Temperature       float64 `json:"temperature"`                  // 0 = greedy
	TopK              int     `json:"top_k,omitempty"`              // 0 = off
	TopP              float64 `json:"top_p,omitempty"`              // 0 or 1 = off
	MinP              float64 `json:"min_p,omitempty"`              // 0 = off
	RepetitionPenalty float64 `json:"repetition_penalty,omitempty"` // 0 or 1 = off
	Seed              uint64  `json:"seed,omitempty"`
	// OpenAI's penalties on the generated tokens' counts: each id's logit
	// loses FrequencyPenalty per occurrence plus PresencePenalty once.
	PresencePenalty  float64 `json:"presence_penalty,omitempty"`
	FrequencyPenalty float64 `json:"frequency_penalty,omitempty"`
	// Logprobs asks the sampling node for each token's model logprob and
	// TopLogprobs alternatives (TokenLogprobs).
	Logprobs    bool `json:"logprobs,omitempty"`
	TopLogprobs int  `json:"top_logprobs,omitempty"`
	// ResponseFormat, when set, restricts the draw to tokens that keep the
	// output a valid JSON document: {"type":"json_object"} or
	// {"type":"json_schema","schema":{...}}. The sampling node masks the
	// logits before the draw (meshgpu/constrain).
	ResponseFormat json.RawMessage `json:"response_format,omitempty"`
}

// Validate reports the first setting out of range.
func (p SamplingParams) Validate() error {
	bad := func(v float64) bool { return math.IsNaN(v) || math.IsInf(v, 0) }
	switch {
	case bad(p.Temperature) || p.Temperature < 0 || p.Temperature > 100:
		return fmt.Errorf("temperature %v must be in 0..100 (0 = greedy)", p.Temperature)
	case p.TopK < 0:
		return fmt.Errorf("top_k %d must be >= 0 (0 = off)", p.TopK)
	case bad(p.TopP) || p.TopP < 0 || p.TopP > 1:
		return fmt.Errorf("top_p %v must be in 0..1 (0 or 1 = off)", p.TopP)
	case bad(p.MinP) || p.MinP < 0 || p.MinP > 1:
		return fmt.Errorf("min_p %v must be in 0..1 (0 = off)", p.MinP)
	case bad(p.RepetitionPenalty) || p.RepetitionPenalty < 0 || p.RepetitionPenalty > 100:
		return fmt.Errorf("repetition_penalty %v must be in 0..100 (0 or 1 = off)", p.RepetitionPenalty)
	case bad(p.PresencePenalty) || p.PresencePenalty < -2 || p.PresencePenalty > 2:
		return fmt.Errorf("presence_penalty %v must be in -2..2", p.PresencePenalty)
	case bad(p.FrequencyPenalty) || p.FrequencyPenalty < -2 || p.FrequencyPenalty > 2:
		return fmt.Errorf("frequency_penalty %v must be in -2..2", p.FrequencyPenalty)
	case p.TopLogprobs < 0 || p.TopLogprobs > MaxTopLogprobs:
		return fmt.Errorf("top_logprobs %d must be in 0..%d", p.TopLogprobs, MaxTopLogprobs)
	}
	return nil
}

// CheckHopSize reports whether p fits the sampling field of a session
// binding (MaxHopSampling), as a 400 for the request that carries it: a
// head checks it before it routes, so no hop is ever tried, and no node
// blamed, for a request too large to bind.
func (p SamplingParams) CheckHopSize() *Error {
	b, err := json.Marshal(p)
	if err != nil {
		return Invalid("", "the sampling parameters cannot be encoded: %v", err)
	}
	if len(b) > MaxHopSampling {
		return Invalid("response_format", "the sampling parameters with the response format are %d bytes; a hop carries at most %d (shorten the schema or the tools)", len(b), MaxHopSampling)
	}
	return nil
}

// Equal reports whether p and q are the same settings.
func (p SamplingParams) Equal(q SamplingParams) bool { return reflect.DeepEqual(p, q) }

// Greedy reports whether p always picks the most likely token.
func (p SamplingParams) Greedy() bool { return p.Temperature == 0 }

// NeedsHistory reports whether the draw reads the token history (a
// penalty, or a response format whose state is rebuilt from the generated
// ids), so the node with the last layer needs the token ids of every hop.
func (p SamplingParams) NeedsHistory() bool {
	return p.RepetitionPenalty != 0 && p.RepetitionPenalty != 1 || p.PresencePenalty != 0 || p.FrequencyPenalty != 0 ||
		len(p.ResponseFormat) > 0
}

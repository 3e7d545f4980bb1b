package wire

import (
	"fmt"
	"math"
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
	}
	return nil
}

// Greedy reports whether p always picks the most likely token.
func (p SamplingParams) Greedy() bool { return p.Temperature == 0 }

// Penalized reports whether a repetition penalty is active, so the node
// with the last layer needs the token ids of every hop.
func (p SamplingParams) Penalized() bool { return p.RepetitionPenalty != 0 && p.RepetitionPenalty != 1 }

package node

import (
	"context"
	"errors"
	"meshgpu/native"
	"slices"
	"time"

	"meshgpu/engine"
	"meshgpu/sample"
	"meshgpu/speculate"
	"meshgpu/wire"
)

// DefaultSpeculateMax bounds the drafts of one pass when SpeculateMax is 0.
const DefaultSpeculateMax = 8

// MaxSpeculateDrafts is the most drafts one pass verifies. A pass of 1+k rows
// stays shorter than native.PromptStepMin, so every node runs it with decode's
// products: the CPU backend takes other products for longer steps (prompts:
// f32 on dequantized rows for quantized weights, bf16 on avx512bf16), which
// would let a verify pass's picks differ from plain decoding's.
const MaxSpeculateDrafts = min(wire.MaxVerifyRows-1, native.PromptStepMin-2)

// speculation is one generation's drafting on the head.
type speculation struct {
	mode    wire.SpeculateMode
	drafter speculate.Drafter
	length  *speculate.Length
	window  *passWindow // nil: one pass at a time
	tree    *treeState  // ngram-tree: branching drafts (node/spectree.go); nil: chains
}

// treeState is the generation's tree drafting; nil without one.
func (sp *speculation) treeState() *treeState {
	if sp == nil {
		return nil
	}
	return sp.tree
}

// newSpeculation sets up drafting for one generation of up to maxTokens
// tokens in mode; nil when mode is off. A draft cache that cannot be had
// is no reason to fail the request: it then decodes plainly.
func (s *Server) newSpeculation(mode wire.SpeculateMode, maxTokens int) *speculation {
	n := s.SpeculateMax
	if n <= 0 {
		n = DefaultSpeculateMax
	}
	n = min(n, MaxSpeculateDrafts)
	sp := &speculation{mode: mode}
	switch mode {
	case wire.SpeculateNGram, wire.SpeculateNGramTree:
		// Prompt lookup costs nothing to draft: start long.
		sp.drafter, sp.length = speculate.NGram{}, speculate.NewLength(8, n)
		if mode == wire.SpeculateNGramTree {
			sp.tree = s.newTreeState()
		}
	case wire.SpeculateDraft:
		if s.DraftModel == nil {
			return nil
		}
		d, err := speculate.NewModel(s.DraftModel, maxTokens)
		if err != nil {
			s.Logger.Warn("no draft cache; decoding without speculation", "error", err)
			return nil
		}
		// A draft model's drafts cost compute on the head: start shorter
		// and give up on a failing one at its first rejected one-token draft.
		sp.drafter, sp.length = d, speculate.NewLength(4, n)
		sp.length.Misses = 1
	default:
		return nil
	}
	// A tree pass's successor depends on the branch it accepts (its Keep),
	// which no pass drafted ahead of the answer knows: trees go one pass
	// at a time.
	if k := s.speculateInFlight(); k > 1 && sp.tree == nil {
		sp.window = newPassWindow(s.metrics, k, s.inFlightFixed)
	}
	return sp
}

// speculateInFlight is the most passes a stream keeps in flight.
func (s *Server) speculateInFlight() int {
	if s.SpeculateInFlight <= 0 {
		return DefaultSpeculateInFlight
	}
	return min(s.SpeculateInFlight, MaxSpeculateInFlight)
}

// close ends the generation's drafting; its passes in flight first.
func (sp *speculation) close() {
	if sp != nil {
		if sp.window != nil {
			sp.window.close()
		}
		sp.drafter.Close()
	}
}

// multiStepper is the pipeline's engine.MultiStepper: without speculation
// one token per pass; with it, each pass after the prompt drafts up to the
// adapted length and verifies the drafts in one pass down the route.
func (p *pipeline) multiStepper() engine.MultiStepper {
	plain := p.stepper().Multi()
	if p.spec == nil {
		return plain
	}
	sp := p.spec
	if sp.window != nil && !p.local() {
		return p.inflightStepper(sp.window)
	}
	return func(ctx context.Context, pos int, tokens []int32, step, limit int) ([]sample.Draw, error) {
		if len(tokens) != 1 || limit < 2 {
			return plain(ctx, pos, tokens, step, limit)
		}
		k := min(sp.length.Next(), limit-1)
		if k <= 0 {
			return plain(ctx, pos, tokens, step, limit)
		}
		if sp.tree != nil {
			toks, drafts, cost, ok, ae := p.treePass(ctx, pos, tokens[0], k, limit, step)
			if ae != nil {
				return nil, ae
			}
			if ok { // depth k adapts as a chain's length does
				sp.length.Update(k, len(toks)-1)
				p.s.metrics.speculated(sp.mode, drafts, len(toks), cost)
				return p.draws(toks), nil
			}
		}
		// The head's history holds the ids fed at every position; those
		// from pos on are drafts of the last pass that were rejected.
		hist := append(slices.Clip(p.sess.history[:pos]), tokens[0])
		t0 := time.Now()
		drafts, err := sp.drafter.Propose(ctx, hist, k)
		cost := time.Since(t0)
		if err != nil {
			if ctx.Err() != nil {
				return nil, &apiError{Status: 499, Type: "canceled", Message: "request canceled: " + ctx.Err().Error()}
			}
			p.s.Logger.Warn("drafting failed; decoding the rest without speculation", "session", p.id, "error", err)
			sp.length.Max = 0 // plain passes from now on
			return plain(ctx, pos, tokens, step, limit)
		}
		drafts = drafts[:min(len(drafts), k)]
		if len(drafts) == 0 {
			p.s.metrics.speculated(sp.mode, 0, 1, cost)
			return plain(ctx, pos, tokens, step, limit)
		}
		toks, ae := p.pass(ctx, pos, append([]int32{tokens[0]}, drafts...), step, true)
		if ae != nil {
			return nil, ae
		}
		sp.length.Update(len(drafts), len(toks)-1)
		p.s.metrics.speculated(sp.mode, len(drafts), len(toks), cost)
		return p.draws(toks), nil
	}
}

func (p *pipeline) draws(toks []wire.TokenReply) []sample.Draw {
	out := make([]sample.Draw, len(toks))
	for i, t := range toks {
		p.tokenArrived()
		out[i] = sample.Draw{ID: t.Token, Logprob: t.Logprob}
	}
	return out
}

// verifyRows verifies a verify pass's drafts (tokens[1:]) on logits of
// len(tokens) rows: the accepted drafts and one more token (sample.Verify).
// The repetition penalty at row i sees the ids up to position pos+i.
func verifyRows(logits []float32, vocab int, tokens []int32, p sample.Params, s *session, pos, step int) []wire.TokenReply {
	draws := sample.Verify(func(i int) []float32 { return logits[i*vocab : (i+1)*vocab] }, tokens[1:], p,
		func(i int) []int32 { return s.history[:min(pos+i+1, len(s.history))] }, step)
	out := make([]wire.TokenReply, len(draws))
	for i, d := range draws {
		out[i] = wire.TokenReply{Token: d.ID, Logprob: d.Logprob}
	}
	return out
}

// checkSpeculation validates the head's speculation settings.
func (s *Server) checkSpeculation() error {
	if _, err := wire.ParseSpeculateMode(string(s.Speculate)); err != nil {
		return err
	}
	if s.Speculate == wire.SpeculateDraft && s.DraftModel == nil {
		return errors.New("speculate draft needs a draft model")
	}
	if s.DraftModel != nil && s.Model != nil {
		return speculate.CheckDraftModel(s.DraftModel, s.Model)
	}
	return nil
}

// speculationFor is the mode a choice decodes with: mode, unless its
// sampling needs what a verify pass does not carry (a response format's
// mask, which the sampling node applies step by step, and logprobs).
func speculationFor(mode wire.SpeculateMode, p sample.Params) wire.SpeculateMode {
	if len(p.ResponseFormat) > 0 || p.Logprobs || p.TopLogprobs > 0 {
		return wire.SpeculateOff
	}
	return mode
}

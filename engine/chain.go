package engine

import (
	"context"
	"errors"
	"fmt"

	"meshgpu/native"
	"meshgpu/sample"
)

// Chain is a model split into stages held by separate stacks (in one
// process): stage i's output activations are handed to stage i+1 in the hop
// dtype, as a mesh hop would carry them. It is the in-process reference for
// split execution.
type Chain struct {
	stages   []*Model
	sessions []native.Session
	hop      native.DType
	logits   []float32
	history  []int32
	act      []byte
}

// NewChain checks that stages cover the model's layers in order, from the
// embeddings to the head, and opens a session of maxTokens on each.
func NewChain(stages []*Model, maxTokens int, hop native.DType) (*Chain, error) {
	if len(stages) == 0 {
		return nil, errors.New("chain: no stages")
	}
	if hop != native.F32 && hop != native.BF16 {
		return nil, fmt.Errorf("chain: hop dtype %s (want f32 or bf16)", hop)
	}
	next := 0
	for i, s := range stages {
		if s.First != next {
			return nil, fmt.Errorf("chain: stage %d starts at layer %d, want %d", i, s.First, next)
		}
		next = s.Last + 1
	}
	last := stages[len(stages)-1]
	if next != last.Config.NumLayers {
		return nil, fmt.Errorf("chain: stages end at layer %d of %d", next-1, last.Config.NumLayers)
	}
	c := &Chain{stages: stages, hop: hop, logits: make([]float32, last.Config.Vocab)}
	for _, s := range stages {
		sess, err := s.Stack.NewSession(maxTokens)
		if err != nil {
			c.Close()
			return nil, err
		}
		c.sessions = append(c.sessions, sess)
	}
	return c, nil
}

// Close frees the chain's sessions (not the stages).
func (c *Chain) Close() {
	for _, s := range c.sessions {
		s.Close()
	}
	c.sessions = nil
}

// Stepper runs the chain for one generation with sampling p.
func (c *Chain) Stepper(p sample.Params) Stepper {
	return func(ctx context.Context, pos int, tokens []int32, step int) (int32, float32, error) {
		if err := ctx.Err(); err != nil {
			return 0, 0, err
		}
		if len(tokens) == 0 || pos < 0 || pos > len(c.history) {
			return 0, 0, fmt.Errorf("chain: %d tokens at position %d (history %d)", len(tokens), pos, len(c.history))
		}
		n := len(tokens)
		row := c.stages[0].Config.Hidden * c.hop.Size()
		if cap(c.act) < n*row {
			c.act = make([]byte, n*row)
		}
		act := c.act[:n*row]
		if err := RunStep(c.runStages(), pos, n, tokens, c.hop, act, c.logits); err != nil {
			return 0, 0, fmt.Errorf("chain: %w", err)
		}
		c.history = append(c.history[:pos], tokens...)
		id, lp := sample.Sample(c.logits, p, c.history, step)
		return id, lp, nil
	}
}

func (c *Chain) runStages() []Stage {
	st := make([]Stage, len(c.stages))
	for i, s := range c.stages {
		st[i] = Stage{Stack: s.Stack, Session: c.sessions[i], First: s.First, Last: s.Last}
	}
	return st
}

// SplitRanges splits a model of numLayers at the range first..last: the
// stages before it, the range itself, and the stages after it.
func SplitRanges(first, last, numLayers int) [][2]int {
	var r [][2]int
	if first > 0 {
		r = append(r, [2]int{0, first - 1})
	}
	r = append(r, [2]int{first, last})
	if last < numLayers-1 {
		r = append(r, [2]int{last + 1, numLayers - 1})
	}
	return r
}

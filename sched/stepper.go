package sched

import (
	"context"
	"fmt"

	"meshgpu/engine"
	"meshgpu/native"
	"meshgpu/sample"
)

// Stepper is an engine.Stepper for one session whose steps run through s
// (which must hold the whole model): engine.Decode then generates as
// engine.Model.LocalStepper does, batched with every other session on s. The
// repetition penalty sees the prompt and the generated tokens.
func (s *Scheduler) Stepper(sess native.Session, p sample.Params) engine.Stepper {
	var history []int32
	return func(ctx context.Context, pos int, tokens []int32, step int) (int32, float32, error) {
		if len(tokens) == 0 || pos < 0 || pos > len(history) {
			return 0, 0, fmt.Errorf("sched stepper: %d tokens at position %d (history %d)", len(tokens), pos, len(history))
		}
		res, err := s.Submit(ctx, Work{Session: sess, Pos: pos, Tokens: tokens, Logits: true})
		if err != nil {
			return 0, 0, err
		}
		history = append(history[:pos], tokens...)
		id, lp := sample.Sample(res.Logits, p, history, step)
		return id, lp, nil
	}
}

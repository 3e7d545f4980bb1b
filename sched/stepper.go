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
	return ChainStepper([]Link{{Sched: s, Session: sess}}, s.cfg.DType, p)
}

// Link is one stage of a generation split over stacks: the stack's
// scheduler (its layers are the stage's) and the generation's session on it.
type Link struct {
	Sched   *Scheduler
	Session native.Session
}

// ChainStepper is an engine.Stepper for one generation over links, from the
// embeddings to the head, each link's layers run by its stack's scheduler
// as a node's forwards are: the first link embeds the tokens, each hands its
// rows to the next in dtype hop (as a mesh hop would carry them), and the
// last link's backend samples the token (Work.Sample, as a node's tail
// does), or, where it lacks the ends, its last row's logits are sampled in
// Go. `meshgpu generate` runs it. The repetition penalty sees the prompt
// and the generated tokens.
func ChainStepper(links []Link, hop native.DType, p sample.Params) engine.Stepper {
	var history []int32
	return func(ctx context.Context, pos int, tokens []int32, step int) (int32, float32, error) {
		if len(links) == 0 || len(tokens) == 0 || pos < 0 || pos > len(history) {
			return 0, 0, fmt.Errorf("sched stepper: %d links, %d tokens at position %d (history %d)", len(links), len(tokens), pos, len(history))
		}
		var res Result
		for i, l := range links {
			w := Work{Session: l.Session, Pos: pos, Stage: &Stage{First: l.Sched.first, Last: l.Sched.last, DType: hop}}
			if i == 0 {
				w.Tokens = tokens
			} else {
				w.Acts = res.Acts
			}
			if i == len(links)-1 {
				if l.Sched.CanSample() {
					// sample.Sample's rule: the last step ids are the generated ones
					w.Sample = &SampleStep{Params: p, GeneratedFrom: max(pos+len(tokens)-step, 0), Draw: step, Tokens: tokens}
				} else {
					w.Logits = true
				}
			}
			var err error
			if res, err = l.Sched.Submit(ctx, w); err != nil {
				if len(links) > 1 {
					return 0, 0, fmt.Errorf("stage %d (layers %d-%d): %w", i, l.Sched.first, l.Sched.last, err)
				}
				return 0, 0, err
			}
		}
		history = append(history[:pos], tokens...)
		if res.Logits == nil {
			return res.Choice.ID, res.Choice.Logprob, nil
		}
		id, lp := sample.Sample(res.Logits, p, history, step)
		return id, lp, nil
	}
}

package engine

import (
	"fmt"

	"meshgpu/native"
)

// Stage is a contiguous range of layers on one stack, with the session
// (KV cache) a generation holds on it.
type Stage struct {
	Stack       native.Stack
	Session     native.Session
	First, Last int
}

// RunStep is one step of a generation, in place on act (n rows of the
// model's hidden size in dtype dt): the tokens' embeddings on the first
// stage when tokens is set, then every stage's layers in order, then, when
// logits is set, the last stage's LM head on the last row (on every row when
// logits holds n rows of the vocabulary: a speculative verify pass), one
// call each, unbatched. It is the in-process reference (the local and
// chained steppers, the draft model of speculative decoding, perplexity);
// a node's steps and `meshgpu generate` run the same calls through the
// stack's scheduler instead (sched.Scheduler, which batches sessions).
// Sampling is the caller's (each keeps its own repetition history).
func RunStep(stages []Stage, pos, n int, tokens []int32, dt native.DType, act []byte, logits []float32) error {
	if len(stages) == 0 || n <= 0 {
		return fmt.Errorf("step: %d stages, %d rows", len(stages), n)
	}
	if tokens != nil {
		if err := stages[0].Stack.Embed(tokens, dt, act); err != nil {
			return err
		}
	}
	for i, s := range stages {
		if err := s.Stack.Forward([]native.Step{{Session: s.Session, Pos: pos, NTokens: n}}, s.First, s.Last, dt, act, act); err != nil {
			if len(stages) > 1 {
				return fmt.Errorf("stage %d (layers %d-%d): %w", i, s.First, s.Last, err)
			}
			return err
		}
	}
	if logits == nil {
		return nil
	}
	row := len(act) / n
	last := stages[len(stages)-1].Stack
	if v := last.Config().Vocab; v > 0 && len(logits) == n*v && n > 1 {
		return last.Logits(n, dt, act, logits) // every row: a verify pass
	}
	return last.Logits(1, dt, act[(n-1)*row:], logits)
}

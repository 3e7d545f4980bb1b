package sample

import (
	"math"
	"slices"
	"testing"
)

// TestChooseLogprobsAndPenalties checks Choose against values computed here
// from the definitions: the model logprob and the top list are the
// log-softmax of the penalized logits (not of the temperature's
// distribution), and presence/frequency count only history[generatedFrom:].
func TestChooseLogprobsAndPenalties(t *testing.T) {
	logits := []float32{1, 3, 2, 3, -1}
	lsm := func(l []float32, i int) float64 {
		var s float64
		for _, v := range l {
			s += math.Exp(float64(v))
		}
		return float64(l[i]) - math.Log(s)
	}
	c := Choose(slices.Clone(logits), Params{Temperature: 1.7, Seed: 3, Logprobs: true, TopLogprobs: 3}, nil, 0, 0)
	if math.Abs(float64(c.ModelLogprob)-lsm(logits, int(c.ID))) > 1e-6 {
		t.Errorf("model logprob %v, want %v", c.ModelLogprob, lsm(logits, int(c.ID)))
	}
	if len(c.Top) != 3 || c.Top[0].ID != 1 || c.Top[1].ID != 3 || c.Top[2].ID != 2 {
		t.Fatalf("top %v, want ids 1, 3 (tie by id), 2", c.Top)
	}
	for _, e := range c.Top {
		if math.Abs(float64(e.Logprob)-lsm(logits, int(e.ID))) > 1e-6 {
			t.Errorf("top %d logprob %v, want %v", e.ID, e.Logprob, lsm(logits, int(e.ID)))
		}
	}
	// history: prompt [1 1], generated [3 3 4]; presence 0.5, frequency 1
	hist := []int32{1, 1, 3, 3, 4}
	work := slices.Clone(logits)
	Choose(work, Params{PresencePenalty: 0.5, FrequencyPenalty: 1}, hist, 2, 0)
	want := []float32{1, 3, 2, 3 - 2 - 0.5, -1 - 1 - 0.5}
	if !slices.Equal(work, want) {
		t.Errorf("penalized logits %v, want %v", work, want)
	}
	// greedy: the model logprob is the logprob
	g := Choose(slices.Clone(logits), Params{Logprobs: true}, nil, 0, 0)
	if g.ID != 1 || g.ModelLogprob != g.Logprob {
		t.Errorf("greedy %+v", g)
	}
	if c := Choose(slices.Clone(logits), Params{}, nil, 0, 0); c.ModelLogprob != 0 || c.Top != nil {
		t.Errorf("logprobs not asked for, got %+v", c)
	}
}

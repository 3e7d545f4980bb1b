package sched

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"meshgpu/engine"
	"meshgpu/internal/testenv"
	"meshgpu/native"
	"meshgpu/sample"
)

// sampledGen is one generation of a sampling-path test: how its steps
// enter the stack and how they sample.
type sampledGen struct {
	prompt []int32
	p      sample.Params
	dt     native.DType
	split  bool // two works a step: layers First..mid (ids in), mid+1..Last (rows in)
}

// runGen generates n tokens of g on sess through s: each step's token the
// backend's pick (useSample) or Go's sample.Choose from the step's logits,
// the penalties reading the prompt and the picks so far.
func runGen(ctx context.Context, s *Scheduler, sess native.Session, g sampledGen, n int, useSample bool) ([]sample.Choice, error) {
	mid := (s.first + s.last) / 2
	var out []sample.Choice
	var hist []int32
	tokens, pos := g.prompt, 0
	for step := 0; step < n; step++ {
		w := Work{Session: sess, Pos: pos, Stage: &Stage{First: s.first, Last: s.last, DType: g.dt}, Tokens: tokens}
		if g.split {
			res, err := s.Submit(ctx, Work{Session: sess, Pos: pos, Stage: &Stage{First: s.first, Last: mid, DType: g.dt}, Tokens: tokens})
			if err != nil {
				return out, err
			}
			w = Work{Session: sess, Pos: pos, Stage: &Stage{First: mid + 1, Last: s.last, DType: g.dt}, Acts: res.Acts}
		}
		hist = append(hist[:pos], tokens...)
		gen := max(len(hist)-step, 0)
		if useSample {
			w.Sample = &SampleStep{Params: g.p, GeneratedFrom: gen, Draw: step, Tokens: tokens}
		} else {
			w.Logits = true
		}
		res, err := s.Submit(ctx, w)
		if err != nil {
			return out, err
		}
		c := res.Choice
		if !useSample {
			c = sample.Choose(res.Logits, g.p, hist, gen, step)
		}
		out = append(out, c)
		pos += len(tokens)
		tokens = []int32{c.ID}
	}
	return out, nil
}

// TestSamplingWorksMatchLogits: generations whose tokens the backend
// samples (Work.Sample), several at once so their steps share calls, pick
// the tokens, logprobs and top logprobs that Go's sampler picks from the
// logits path's logits, bit for bit: greedy and seeded temperature with
// every penalty, ids in (Decode in f32, TailForward on embedded rows in
// bf16) and rows in (a split stack), and a prompt in several prefill
// chunks; the sampling calls were batched and counted.
func TestSamplingWorksMatchLogits(t *testing.T) {
	testenv.CheckGoroutines(t)
	m, _ := loadModel(t)
	s := newSched(t, m, Config{PrefillChunk: 8, Linger: 20 * time.Millisecond})
	if !s.CanSample() {
		t.Fatal("the CPU stack holding the head cannot sample")
	}
	warm := sample.Params{Temperature: 0.8, TopK: 40, TopP: 0.9, MinP: 0.02, RepetitionPenalty: 1.3, PresencePenalty: 0.4,
		FrequencyPenalty: 0.3, Seed: 42, Logprobs: true, TopLogprobs: 5}
	long := make([]int32, 27) // four chunks of 8
	for i := range long {
		long[i] = int32(1 + i*37%200)
	}
	gens := []sampledGen{
		{prompt: []int32{1, 5, 9}, p: sample.Params{}, dt: native.F32},
		{prompt: []int32{2, 7, 7, 7}, p: warm, dt: native.F32},
		{prompt: []int32{3, 4}, p: warm, dt: native.BF16},
		{prompt: []int32{8, 6, 4, 2}, p: warm, dt: native.BF16, split: true},
		{prompt: []int32{11, 12}, p: sample.Params{RepetitionPenalty: 1.5, Logprobs: true, TopLogprobs: 3}, dt: native.F32, split: true},
		{prompt: long, p: warm, dt: native.F32},
	}
	const n = 12
	got := make([][]sample.Choice, len(gens))
	errs := make([]error, len(gens))
	var wg sync.WaitGroup
	for i, g := range gens {
		sess := newSession(t, m, len(g.prompt)+n)
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i], errs[i] = runGen(context.Background(), s, sess, g, n, true)
		}()
	}
	wg.Wait()
	st := s.Stats()
	for i, g := range gens {
		want, err := runGen(context.Background(), s, newSession(t, m, len(g.prompt)+n), g, n, false)
		if err != nil || errs[i] != nil {
			t.Fatalf("generation %d: %v, reference %v", i, errs[i], err)
		}
		for k := range want {
			if !sameChoice(got[i][k], want[k]) {
				t.Fatalf("generation %d (%+v) token %d: backend %+v, Go %+v", i, g, k, got[i][k], want[k])
			}
		}
	}
	t.Logf("sampling phase: %+v", st)
	if st.Sampled != int64(len(gens)*n) {
		t.Errorf("%d tokens sampled in the backend, want %d", st.Sampled, len(gens)*n)
	}
	if st.MaxSessions < 2 {
		t.Errorf("the largest call held %d sessions: the generations never shared a call", st.MaxSessions)
	}
	if after := s.Stats(); after.Sampled != st.Sampled {
		t.Errorf("the logits path sampled %d tokens in the backend", after.Sampled-st.Sampled)
	}
}

// sameChoice: the same pick, logprobs and top logprobs, to the bit.
func sameChoice(a, b sample.Choice) bool {
	return a.ID == b.ID && a.Logprob == b.Logprob && a.ModelLogprob == b.ModelLogprob && slices.Equal(a.Top, b.Top)
}

// TestSamplingWorkRefused: a sampling work must end at the head and be
// neither a logits work nor a tree, and a rows work names its ids.
func TestSamplingWorkRefused(t *testing.T) {
	m, _ := loadModel(t)
	s := newSched(t, m, Config{})
	sess := newSession(t, m, 16)
	row := make([]byte, m.Config.Hidden*4)
	for name, w := range map[string]Work{
		"before the head":  {Session: sess, Stage: &Stage{First: 0, Last: 1, DType: native.F32}, Tokens: []int32{1}, Sample: &SampleStep{}},
		"with logits":      {Session: sess, Tokens: []int32{1}, Logits: true, Sample: &SampleStep{}},
		"a tree":           {Session: sess, Tokens: []int32{1, 2}, Parents: []int32{-1, 0}, Sample: &SampleStep{}},
		"rows without ids": {Session: sess, Acts: row, Sample: &SampleStep{}},
	} {
		if _, err := s.Submit(context.Background(), w); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// TestChainStepperSamplesInBackend: `meshgpu generate`'s stepper over two
// links (a model's layers split between two schedulers, bf16 between them)
// samples every token in the last link's backend, and gives the ids of the
// same chain on a stack that hides its ends (the logits path, Go's
// sampler), with seeded temperature and the penalties.
func TestChainStepperSamplesInBackend(t *testing.T) {
	testenv.CheckGoroutines(t)
	m, _ := loadModel(t)
	mid := m.Config.NumLayers / 2
	prompt := []int32{5, 17, 33, 2, 9}
	p := engine.GenerateParams{MaxTokens: 16, IgnoreEOS: true,
		Sampling: sample.Params{Temperature: 0.9, Seed: 11, TopP: 0.95, RepetitionPenalty: 1.2, PresencePenalty: 0.3, FrequencyPenalty: 0.2}}
	generate := func(st native.Stack) ([]int32, *Scheduler) {
		first, err := New(st, m.First, mid-1, Config{DType: native.BF16})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(first.Close)
		last, err := New(st, mid, m.Last, Config{DType: native.BF16})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(last.Close)
		sess := newSession(t, m, len(prompt)+p.MaxTokens)
		step := ChainStepper([]Link{{Sched: first, Session: sess}, {Sched: last, Session: sess}}, native.BF16, p.Sampling)
		res, err := engine.Decode(context.Background(), m.Tokenizer, m.EOS(), prompt, p, step, nil)
		if err != nil {
			t.Fatal(err)
		}
		if n := first.Stats().Sampled; n != 0 {
			t.Errorf("the first link sampled %d tokens", n)
		}
		return res.IDs, last
	}
	got, last := generate(m.Stack)
	want, ref := generate(struct{ native.Stack }{m.Stack}) // no native.Ends: the logits path
	if !slices.Equal(got, want) {
		t.Errorf("sampled in the backend %v, in Go %v", got, want)
	}
	if n := last.Stats().Sampled; n != int64(len(got)) {
		t.Errorf("the last link's backend sampled %d of %d tokens", n, len(got))
	}
	if ref.CanSample() || ref.Stats().Sampled != 0 {
		t.Error("the stack without the ends sampled in the backend")
	}
}

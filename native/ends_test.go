package native

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"meshgpu/sample"
)

// samplerCases are parameter sets covering every stage of the sampler.
var samplerCases = []sample.Params{
	{},
	{Temperature: 1},
	{Temperature: 0.7, TopK: 5},
	{Temperature: 1.3, TopP: 0.9},
	{Temperature: 0.8, TopK: 40, TopP: 0.95, MinP: 0.05},
	{Temperature: 1, MinP: 0.1},
	{Temperature: 2, TopP: 0.5},
	{Temperature: 1, TopK: 1},
	{RepetitionPenalty: 1.3, PresencePenalty: 0.5, FrequencyPenalty: 0.3, TopLogprobs: 5},
	{Temperature: 0.9, TopK: 50, TopP: 0.8, RepetitionPenalty: 1.2, PresencePenalty: -0.4, FrequencyPenalty: 1.1, TopLogprobs: 20},
	{Temperature: 0.05, TopLogprobs: 3},
	{Temperature: 1.1, TopP: 0.8, Logprobs: true},
	{Logprobs: true, PresencePenalty: 1.5},
}

// testLogits is a row of kind: 0 normal, 1 coarse (many exact ties),
// 2 with -Inf and NaN entries, 3 peaked.
func testLogits(r *rand.Rand, n, kind int) []float32 {
	l := make([]float32, n)
	for i := range l {
		v := r.NormFloat64() * 3
		switch kind {
		case 1:
			v = math.Round(v)
		case 2:
			if r.IntN(10) == 0 {
				v = math.Inf(-1)
			} else if r.IntN(50) == 0 {
				v = math.NaN()
			}
		case 3:
			if i == n/3 {
				v = 30
			}
		}
		l[i] = float32(v)
	}
	return l
}

func sameChoice(a, b sample.Choice) bool {
	if a.ID != b.ID || math.Abs(float64(a.Logprob-b.Logprob)) > 1e-5 || math.Abs(float64(a.ModelLogprob-b.ModelLogprob)) > 1e-5 ||
		len(a.Top) != len(b.Top) {
		return false
	}
	for i := range a.Top {
		if a.Top[i].ID != b.Top[i].ID || math.Abs(float64(a.Top[i].Logprob-b.Top[i].Logprob)) > 1e-5 {
			return false
		}
	}
	return true
}

// TestCPUSamplerMatchesGo compares the backend sampler (cpu_sample.c, the
// reference of the CUDA one) with Go's sample.Choose over vocabularies
// small and large (the parallel Go path starts at 32768), logits with ties,
// -Inf and NaN, histories and many seeds: the same id and logprobs.
func TestCPUSamplerMatchesGo(t *testing.T) {
	ops := CPUOps()
	r := rand.New(rand.NewPCG(11, 12))
	checked, inexact, differentIDs := 0, 0, map[int32]bool{}
	for _, vocab := range []int{7, 50, 1000, 40000} {
		for kind := 0; kind < 4; kind++ {
			logits := testLogits(r, vocab, kind)
			hist := make([]int32, 30)
			for i := range hist {
				hist[i] = int32(r.IntN(vocab))
			}
			hist[3] = -1 // out of range ids are ignored
			seeds := 40
			if vocab == 40000 {
				seeds = 6
			}
			for ci, p := range samplerCases {
				for seed := 0; seed < seeds; seed++ {
					p.Seed = uint64(seed) * 0x9E3779B9
					step := seed * 7
					gen := 10 + seed%20
					want := sample.Choose(slices.Clone(logits), p, hist, gen, step)
					got, err := ops.Sample(logits, p, hist, gen, step)
					if err != nil {
						t.Fatal(err)
					}
					if !sameChoice(got, want) {
						t.Fatalf("vocab %d kind %d case %d (%+v) seed %d: C %+v, Go %+v", vocab, kind, ci, p, seed, got, want)
					}
					checked++
					differentIDs[got.ID] = true
					if got.Logprob != want.Logprob {
						inexact++
					}
				}
			}
		}
	}
	// The sums are defined to the bit: only log itself may differ by an ulp
	// between C and Go, which float32 rounding nearly always hides.
	if inexact > checked/100 {
		t.Errorf("%d of %d logprobs differ in their bits", inexact, checked)
	}
	t.Logf("%d draws, %d distinct ids, %d logprobs not bit-equal", checked, len(differentIDs), inexact)
	if len(differentIDs) < 50 {
		t.Errorf("%d draws gave only %d distinct ids: the cases do not exercise sampling", checked, len(differentIDs))
	}
}

func TestCPUSamplerBadParams(t *testing.T) {
	ops := CPUOps()
	for _, p := range []sample.Params{{Temperature: -1}, {TopP: 2}, {PresencePenalty: 3}, {TopLogprobs: 21}, {Temperature: math.NaN()}} {
		if _, err := ops.Sample([]float32{1, 2}, p, nil, 0, 0); err == nil {
			t.Errorf("%+v: no error", p)
		}
	}
}

// separate is the reference path of one node: Embed, Forward, Logits and
// sample.Choose with the history kept in Go.
type separate struct {
	st   Stack
	sess Session
	hist []int32
}

func (s *separate) step(t *testing.T, pos int, tokens []int32, gen, draw int, p sample.Params) (sample.Choice, []float32) {
	t.Helper()
	cfg := s.st.Config()
	act := run(t, s.st, s.sess, pos, tokens, F32)
	logits := make([]float32, cfg.Vocab)
	if err := s.st.Logits(1, F32, act[(len(tokens)-1)*cfg.Hidden*4:], logits); err != nil {
		t.Fatal(err)
	}
	s.hist = append(s.hist[:pos], tokens...)
	return sample.Choose(slices.Clone(logits), p, s.hist, gen, draw), logits
}

var endsParams = sample.Params{Temperature: 0.9, TopK: 20, TopP: 0.9, RepetitionPenalty: 1.3, PresencePenalty: 0.4,
	FrequencyPenalty: 0.6, TopLogprobs: 4, Seed: 77}

// TestDecodeMatchesSeparateCalls runs a generation through Decode (tokens in,
// sampled token out) and through the separate calls plus Go's sampler:
// the same tokens, logprobs and (f32) logits, bit for bit.
func TestDecodeMatchesSeparateCalls(t *testing.T) {
	b := openCPU(t, 2)
	cfg := tinyConfig()
	st := newStack(t, b, cfg, 5)
	ends := st.(Ends)
	if !ends.HasEnds() {
		t.Fatal("cpu stack lacks the ABI 3 calls")
	}
	ref := &separate{st: st}
	var err error
	if ref.sess, err = st.NewSession(cfg.MaxContext); err != nil {
		t.Fatal(err)
	}
	sess, err := st.NewSession(cfg.MaxContext)
	if err != nil {
		t.Fatal(err)
	}
	prompt := []int32{1, 7, 7, 3, 9}
	tokens, pos := prompt, 0
	for draw := 0; draw < 12; draw++ {
		want, wantLogits := ref.step(t, pos, tokens, len(prompt), draw, endsParams)
		logits := make([]float32, cfg.Vocab)
		got, err := ends.Decode([]TokenStep{{Session: sess, Pos: pos, Tokens: tokens, GeneratedFrom: len(prompt), Draw: draw,
			Params: endsParams, Logits: logits}})
		if err != nil {
			t.Fatal(err)
		}
		if !sameChoice(got[0], want) || !slices.Equal(logits, wantLogits) {
			t.Fatalf("draw %d: decode %+v, separate %+v (logits equal: %v)", draw, got[0], want, slices.Equal(logits, wantLogits))
		}
		pos += len(tokens)
		tokens = []int32{got[0].ID}
	}
}

// TestHeadTailMatchSingleNode splits the model in two stacks (embed + layer
// 0 on the head, layer 1 + head on the tail) and checks HeadForward +
// TailForward (the tail feeding back its own samples, Tokens nil) against
// the separate calls on one stack holding everything; then that a retried
// tail step is idempotent.
func TestHeadTailMatchSingleNode(t *testing.T) {
	b := openCPU(t, 2)
	cfg := tinyConfig()
	whole := newStack(t, b, cfg, 9)
	hcfg, tcfg := cfg, cfg
	hcfg.Last, hcfg.HasHead = 0, false
	tcfg.First, tcfg.HasEmbed = 1, false
	tensors := randomTensors(cfg, 9)
	head, tail := shardStack(t, b, hcfg, tensors).(Ends), shardStack(t, b, tcfg, tensors).(Ends)
	hs, _ := head.(Stack).NewSession(cfg.MaxContext)
	ts, _ := tail.(Stack).NewSession(cfg.MaxContext)
	ref := &separate{st: whole}
	ref.sess, _ = whole.NewSession(cfg.MaxContext)

	prompt := []int32{4, 4, 8, 15, 16, 23}
	tokens, pos := prompt, 0
	act := make([]byte, len(prompt)*cfg.Hidden*4)
	for draw := 0; draw < 10; draw++ {
		want, _ := ref.step(t, pos, tokens, len(prompt), draw, endsParams)
		a := act[:len(tokens)*cfg.Hidden*4]
		if err := head.HeadForward([]TokenStep{{Session: hs, Pos: pos, Tokens: tokens}}, 0, F32, a); err != nil {
			t.Fatal(err)
		}
		tstep := TokenStep{Session: ts, Pos: pos, Tokens: tokens, GeneratedFrom: len(prompt), Draw: draw, Params: endsParams}
		if draw > 0 {
			tstep.Tokens, tstep.NTokens = nil, 1 // the tail's history holds its own last sample
		}
		got, err := tail.TailForward([]TokenStep{tstep}, 1, F32, a)
		if err != nil {
			t.Fatal(err)
		}
		if !sameChoice(got[0], want) {
			t.Fatalf("draw %d: head+tail %+v, single node %+v", draw, got[0], want)
		}
		if draw == 4 { // a retried hop: same position, same draw, same token
			again, err := tail.TailForward([]TokenStep{tstep}, 1, F32, a)
			if err != nil || !sameChoice(again[0], got[0]) {
				t.Fatalf("retried tail step: %+v, %v; first %+v", again, err, got[0])
			}
		}
		pos += len(tokens)
		tokens = []int32{got[0].ID}
	}
}

// shardStack is a stack of b for c holding the tensors (of the whole
// model) that c's layer range, embedding and head need; closed at cleanup.
func shardStack(t *testing.T, b Backend, c StackConfig, tensors []Tensor) Stack {
	t.Helper()
	st, err := b.NewStack(c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	for _, ts := range tensors {
		keep := (ts.Layer >= c.First && ts.Layer <= c.Last) || (ts.Kind == TokEmbed && c.HasEmbed) ||
			((ts.Kind == FinalNorm || ts.Kind == LMHead) && c.HasHead)
		if keep {
			if err := st.SetTensor(ts); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := st.Ready(); err != nil {
		t.Fatal(err)
	}
	return st
}

// TestDecodeBatchMatchesSingle runs 19 sequences of different lengths and
// sampling in one Decode call and each alone: the same picks and the same
// logits bit for bit. 19 spans more than one of the head's batches of
// steps (cpu_ends.c HEAD_BATCH) and a partial one.
func TestDecodeBatchMatchesSingle(t *testing.T) {
	b := openCPU(t, 2)
	cfg := tinyConfig()
	st := newStack(t, b, cfg, 3)
	ends := st.(Ends)
	ns := func() Session {
		s, err := st.NewSession(cfg.MaxContext)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	const n = 19
	steps := make([]TokenStep, n)
	for i := range steps {
		toks := make([]int32, 1+i%4)
		for k := range toks {
			toks[k] = int32((7*i + 3*k + 1) % cfg.Vocab)
		}
		p := endsParams
		p.Seed = uint64(5 + i)
		steps[i] = TokenStep{Session: ns(), Tokens: toks, GeneratedFrom: len(toks), Params: p, Logits: make([]float32, cfg.Vocab)}
	}
	got, err := ends.Decode(steps)
	if err != nil {
		t.Fatal(err)
	}
	for i, s := range steps {
		alone := s
		alone.Session, alone.Logits = ns(), make([]float32, cfg.Vocab)
		want, err := ends.Decode([]TokenStep{alone})
		if err != nil {
			t.Fatal(err)
		}
		if !sameChoice(got[i], want[0]) {
			t.Errorf("sequence %d: batched %+v, alone %+v", i, got[i], want[0])
		}
		for v := range s.Logits {
			if math.Float32bits(s.Logits[v]) != math.Float32bits(alone.Logits[v]) {
				t.Errorf("sequence %d: logit %d batched %g, alone %g", i, v, s.Logits[v], alone.Logits[v])
				break
			}
		}
	}
}

// TestEndsBadInput: every refused call names the problem and changes no
// session (the next valid call computes what it would have).
func TestEndsBadInput(t *testing.T) {
	b := openCPU(t, 1)
	cfg := tinyConfig()
	st := newStack(t, b, cfg, 1)
	other := newStack(t, b, cfg, 1)
	ends := st.(Ends)
	sess, _ := st.NewSession(8)
	foreign, _ := other.NewSession(8)
	act := make([]byte, 4*cfg.Hidden*4)
	cases := []struct {
		name string
		err  error
		s    Status
	}{
		{"head without tokens", ends.HeadForward([]TokenStep{{Session: sess, NTokens: 1}}, 1, F32, act), StatusInvalidArgument},
		{"tail without history", func() error {
			_, err := ends.TailForward([]TokenStep{{Session: sess, NTokens: 1}}, 0, F32, act)
			return err
		}(), StatusInvalidArgument},
		{"token outside vocab", func() error {
			_, err := ends.Decode([]TokenStep{{Session: sess, Tokens: []int32{int32(cfg.Vocab)}}})
			return err
		}(), StatusInvalidArgument},
		{"bad params", func() error {
			_, err := ends.Decode([]TokenStep{{Session: sess, Tokens: []int32{1}, Params: sample.Params{TopP: -1}}})
			return err
		}(), StatusInvalidArgument},
		{"foreign session", func() error {
			_, err := ends.Decode([]TokenStep{{Session: foreign, Tokens: []int32{1}}})
			return err
		}(), StatusInvalidArgument},
		{"past capacity", func() error {
			_, err := ends.Decode([]TokenStep{{Session: sess, Tokens: make([]int32, 9)}})
			return err
		}(), StatusCapacity},
		{"position past history", func() error {
			_, err := ends.Decode([]TokenStep{{Session: sess, Pos: 2, Tokens: []int32{1}}})
			return err
		}(), StatusInvalidArgument},
		{"short out", ends.HeadForward([]TokenStep{{Session: sess, Tokens: []int32{1, 2, 3, 4, 5}}}, 1, F32, act), StatusInvalidArgument},
	}
	for _, c := range cases {
		wantStatus(t, c.name, c.err, c.s)
	}
	if sess.Len() != 0 {
		t.Errorf("refused calls left the session at length %d", sess.Len())
	}
	fresh, _ := st.NewSession(8)
	want, err1 := ends.Decode([]TokenStep{{Session: fresh, Tokens: []int32{1, 2}, Params: endsParams}})
	got, err2 := ends.Decode([]TokenStep{{Session: sess, Tokens: []int32{1, 2}, Params: endsParams}})
	if err1 != nil || err2 != nil || !sameChoice(got[0], want[0]) {
		t.Fatalf("after refused calls: %+v %v, fresh session: %+v %v", got, err2, want, err1)
	}
}

// BenchmarkSamplerCPU: the C sampler (what the CPU backend's tail_forward
// and decode run) next to Go's sample.Choose on a Llama 3 vocabulary, the
// same logits, each as a ratio to a plain Go argmax in the same run.
func BenchmarkSamplerCPU(b *testing.B) {
	r := rand.New(rand.NewPCG(3, 4))
	logits := testLogits(r, 128256, 0)
	ops := CPUOps()
	for _, c := range []struct {
		name string
		p    sample.Params
	}{{"greedy", sample.Params{}}, {"topp0.9-t0.8", sample.Params{Temperature: 0.8, TopP: 0.9}},
		{"topk40-penalties", sample.Params{Temperature: 0.8, TopK: 40, RepetitionPenalty: 1.1, PresencePenalty: 0.5}}} {
		b.Run(c.name+"/go", func(b *testing.B) {
			work := make([]float32, len(logits))
			for i := 0; i < b.N; i++ {
				copy(work, logits)
				sample.Choose(work, c.p, []int32{1, 2, 3}, 1, i)
			}
		})
		b.Run(c.name+"/c", func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				if _, err := ops.Sample(logits, c.p, []int32{1, 2, 3}, 1, i); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	b.Run("argmax-floor", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			best := 0
			for j, v := range logits {
				if v > logits[best] {
					best = j
				}
			}
			_ = best
		}
	})
}

// TestEndsInBF16MatchSeparateCalls: with bf16 rows HeadForward writes what
// Embed and Forward in bf16 write, and TailForward picks what Forward and
// Logits in bf16 plus Go's sampler pick from the same logits (a node's
// tail samples in the backend what it sampled from those calls' logits).
func TestEndsInBF16MatchSeparateCalls(t *testing.T) {
	b := openCPU(t, 2)
	cfg := tinyConfig()
	hcfg, tcfg := cfg, cfg
	hcfg.Last, hcfg.HasHead = 0, false
	tcfg.First, tcfg.HasEmbed = 1, false
	tensors := randomTensors(cfg, 21)
	head, tail := shardStack(t, b, hcfg, tensors), shardStack(t, b, tcfg, tensors)
	hs, _ := head.NewSession(cfg.MaxContext)
	ts, _ := tail.NewSession(cfg.MaxContext)
	refHead, refTail := shardStack(t, b, hcfg, tensors), shardStack(t, b, tcfg, tensors)
	rhs, _ := refHead.NewSession(cfg.MaxContext)
	rts, _ := refTail.NewSession(cfg.MaxContext)

	prompt := []int32{3, 1, 4, 1, 5, 9, 2}
	tokens, pos, hist := prompt, 0, []int32(nil)
	row := cfg.Hidden * 2
	for draw := 0; draw < 8; draw++ {
		n := len(tokens)
		want := run(t, refHead, rhs, pos, tokens, BF16)
		got := make([]byte, n*row)
		if err := head.(Ends).HeadForward([]TokenStep{{Session: hs, Pos: pos, Tokens: tokens}}, 0, BF16, got); err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, want) {
			t.Fatalf("draw %d: HeadForward's bf16 rows differ from Embed+Forward's", draw)
		}
		act := slices.Clone(want)
		if err := refTail.Forward([]Step{{Session: rts, Pos: pos, NTokens: n}}, 1, 1, BF16, act, act); err != nil {
			t.Fatal(err)
		}
		wantLogits := make([]float32, cfg.Vocab)
		if err := refTail.Logits(1, BF16, act[(n-1)*row:], wantLogits); err != nil {
			t.Fatal(err)
		}
		hist = append(hist[:pos], tokens...)
		wantC := sample.Choose(slices.Clone(wantLogits), endsParams, hist, len(prompt), draw)
		logits := make([]float32, cfg.Vocab)
		c, err := tail.(Ends).TailForward([]TokenStep{{Session: ts, Pos: pos, Tokens: tokens, GeneratedFrom: len(prompt), Draw: draw,
			Params: endsParams, Logits: logits}}, 1, BF16, got)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(logits, wantLogits) || !sameChoice(c[0], wantC) {
			t.Fatalf("draw %d: TailForward %+v, Forward+Logits in bf16 %+v (logits equal: %v)", draw, c[0], wantC, slices.Equal(logits, wantLogits))
		}
		pos += n
		tokens = []int32{c[0].ID}
	}
}

// TestEndsRefuseNonFiniteLogits: a head whose logits hold NaN (a model
// that blew up) makes TailForward and Decode fail with StatusNonFinite,
// where Go's sampler would pick a token.
func TestEndsRefuseNonFiniteLogits(t *testing.T) {
	b := openCPU(t, 2)
	cfg := tinyConfig()
	tensors := randomTensors(cfg, 4)
	for i := range tensors {
		if tensors[i].Kind == LMHead {
			data := slices.Clone(tensors[i].Data)
			binary.LittleEndian.PutUint16(data[2*(7*cfg.Hidden):], 0x7fc0) // row 7 (token 7) starts with NaN
			tensors[i].Data = data
		}
	}
	st := shardStack(t, b, cfg, tensors)
	sess, _ := st.NewSession(cfg.MaxContext)
	act := run(t, st, sess, 0, []int32{1, 2}, F32)
	logits := make([]float32, cfg.Vocab)
	if err := st.Logits(1, F32, act[cfg.Hidden*4:], logits); err != nil {
		t.Fatal(err)
	}
	if !math.IsNaN(float64(logits[7])) {
		t.Fatalf("logit 7 is %v, want NaN (the test's head)", logits[7])
	}
	if c := sample.Choose(logits, sample.Params{}, nil, 0, 0); c.ID < 0 {
		t.Fatalf("Go's sampler picked %d", c.ID)
	}
	ends := st.(Ends)
	s1, _ := st.NewSession(cfg.MaxContext)
	_, err := ends.Decode([]TokenStep{{Session: s1, Tokens: []int32{1, 2}}})
	wantStatus(t, "decode with NaN logits", err, StatusNonFinite)
	s2, _ := st.NewSession(cfg.MaxContext)
	_, err = ends.TailForward([]TokenStep{{Session: s2, Tokens: []int32{1, 2}}}, 0, F32, act)
	wantStatus(t, "tail_forward with NaN logits", err, StatusNonFinite)
	if err == nil || !strings.Contains(err.Error(), "not finite") {
		t.Errorf("tail_forward: %v, want an error that says the logits are not finite", err)
	}
}

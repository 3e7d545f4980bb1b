package engine

import (
	"context"
	"fmt"
	"math"
	"os"
	"slices"
	"testing"

	"meshgpu/internal/testenv"
	"meshgpu/native"
)

// CUDA checks against golden.json (HF transformers in bf16) and the CPU
// backend. They run when MESHGPU_CUDA_LIB names libmeshgpu_cuda.so (the
// device check script sets it) and skip otherwise.

func openCUDAOrSkip(t testing.TB) native.Backend {
	t.Helper()
	path := os.Getenv("MESHGPU_CUDA_LIB")
	if path == "" {
		t.Skip("MESHGPU_CUDA_LIB is not set: CUDA golden checks run on a GPU host (scripts/device-check.sh)")
	}
	b, err := native.Open("cuda", native.Options{CUDALib: path})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// lastLogits embeds tokens, runs every layer at pos and returns the last
// row's logits, handing activations over in bf16 as the mesh does.
func lastLogits(t testing.TB, m *Model, sess native.Session, pos int, tokens []int32) []float32 {
	t.Helper()
	dt := native.BF16
	row := m.Config.Hidden * dt.Size()
	act := make([]byte, len(tokens)*row)
	if err := m.Stack.Embed(tokens, dt, act); err != nil {
		t.Fatal(err)
	}
	if err := m.Stack.Forward([]native.Step{{Session: sess, Pos: pos, NTokens: len(tokens)}}, m.First, m.Last, dt, act, act); err != nil {
		t.Fatal(err)
	}
	out := make([]float32, m.Config.Vocab)
	if err := m.Stack.Logits(1, dt, act[(len(tokens)-1)*row:], out); err != nil {
		t.Fatal(err)
	}
	return out
}

// top2 returns the argmax (lowest index on ties) and its margin over the
// runner-up.
func top2(l []float32) (int32, float32) {
	best, second := 0, -1
	for i := 1; i < len(l); i++ {
		if l[i] > l[best] {
			best, second = i, best
		} else if second < 0 || l[i] > l[second] {
			second = i
		}
	}
	return int32(best), l[best] - l[second]
}

func commonPrefix(a, b []int32) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}

// TestCUDAGoldenGreedy checks CUDA against golden.json's HF bf16 run and
// the CPU backend, per prompt:
//   - teacher-forced along bf16.greedy_ids (the prompt, then golden's own
//     tokens), golden's next token is CUDA's top-1 or within goldenTieULPs
//     bf16 ulps of CUDA's top logit at every step;
//   - free-running greedy decoding follows bf16.greedy_ids for at least 32
//     tokens, or up to a step where the teacher-forced check found golden's
//     token within that tie band (the same prefix, so the same computation);
//   - at every free-running step CUDA's top-1 equals the CPU's top-1 on the
//     same prefix whenever the CPU's top-2 margin exceeds 0.05, except where
//     HF's own bf16 run made CUDA's choice (counted and printed);
//   - Generate (f32 hand-over) gives the same ids as the bf16 loop.
//
// Why a tie band and not 32 free-running tokens on every prompt: greedy
// decoding of gocoder-6m meets bf16 logits one ulp apart (0.0625 at 8..16)
// on prompts 3 and 4, and which of the two wins depends on f32 summation
// order. bench/torch/emulate_golden.py's "cuda" variant (the kernels' own
// summation order) reproduces the first H200 run's 64 ids on prompts 3 and
// 4 exactly (10 and 7 leading golden ids), and teacher-forced it misses
// golden's token only where that token is its runner-up by 0..2 ulps;
// "math" (the same numerics in PyTorch's order) gets 52 and 64, "math64"
// (f64 sums) 24 on prompt 1 and 10 on prompt 3. The CPU f32 backend's
// worst gap is 1.4 ulps. A kernel or indexing bug moves logits by far more
// than 3 ulps.
func TestCUDAGoldenGreedy(t *testing.T) {
	be := openCUDAOrSkip(t)
	dir := testenv.GoCoder(t)
	g := loadGolden(t, dir)
	cu := loadModel(t, dir, be, 0, -1)
	cpu := loadModel(t, dir, openCPU(t), 0, -1)
	for i, gen := range g.Generations {
		want := gen.BF16.GreedyIDs
		n := len(want)
		cs, err := cu.Stack.NewSession(len(gen.PromptIDs) + n)
		if err != nil {
			t.Fatal(err)
		}
		ps, err := cpu.Stack.NewSession(len(gen.PromptIDs) + n)
		if err != nil {
			t.Fatal(err)
		}
		var ids []int32
		tokens, pos := gen.PromptIDs, 0
		confident, disagree, asHF := 0, 0, 0
		for step := 0; step < n; step++ {
			lc := lastLogits(t, cu, cs, pos, tokens)
			lp := lastLogits(t, cpu, ps, pos, tokens)
			bc, _ := top2(lc)
			bp, margin := top2(lp)
			if margin > 0.05 {
				confident++
				switch {
				case bc == bp:
				case commonPrefix(ids, want) == step && bc == want[step]:
					// HF in bf16 (golden) made cuda's choice against the f32
					// top-1: bf16 rounding moves logits by more than 0.05
					// here (seen at margins 0.09 and 0.10 on prompts 3 and 4
					// with bench/torch/emulate_golden.py's numerics).
					asHF++
					fmt.Printf("GOLDEN prompt %d step %d: cuda and HF bf16 pick %d, cpu f32 picks %d with margin %.3f\n", i, step, bc, bp, margin)
				default:
					disagree++
					t.Errorf("prompt %d step %d: cuda top-1 %d, cpu top-1 %d with margin %.3f", i, step, bc, bp, margin)
				}
			}
			ids = append(ids, bc)
			pos += len(tokens)
			tokens = []int32{bc}
		}
		cs.Close()
		ps.Close()
		match := commonPrefix(ids, want)
		forced := teacherForced(t, cu, gen.PromptIDs, want)
		fmt.Printf("GOLDEN prompt %d: cuda greedy == bf16.greedy_ids for %d of %d tokens (need 32 or a tie); top-1 vs cpu: %d of %d confident steps agree, %d more as HF bf16 does\n",
			i, match, n, confident-disagree-asHF, confident, asHF)
		missed := 0
		for step, f := range forced {
			if step < match && f.top != ids[step] {
				t.Errorf("prompt %d step %d: teacher-forced top-1 %d, free-running %d on the same prefix", i, step, f.top, ids[step])
			}
			if f.top == want[step] {
				continue
			}
			missed++
			fmt.Printf("GOLDEN prompt %d step %d (teacher-forced): cuda top-1 %d, golden %d is %.0f bf16 ulps lower (%.4f at %.4f)\n",
				i, step, f.top, want[step], f.gapULPs, f.gap, f.topLogit)
			if f.gapULPs > goldenTieULPs {
				t.Errorf("prompt %d step %d: golden token %d is %.0f bf16 ulps below cuda's top-1 %d, want <= %d",
					i, step, want[step], f.gapULPs, f.top, goldenTieULPs)
			}
		}
		fmt.Printf("GOLDEN prompt %d: teacher-forced, golden's token is cuda's top-1 at %d of %d steps, within %d bf16 ulps at the rest\n",
			i, n-missed, n, goldenTieULPs)
		if match < 32 && match < n && forced[match].gapULPs > goldenTieULPs {
			t.Errorf("prompt %d: cuda greedy matches bf16.greedy_ids for %d tokens, want >= 32 or a tie at the divergence\n got %v\nwant %v", i, match, ids, want)
		}
		res, err := cu.Generate(context.Background(), gen.PromptIDs, GenerateParams{MaxTokens: n, IgnoreEOS: true}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(res.IDs, ids) {
			t.Errorf("prompt %d: Generate (f32 hand-over) gives\n %v\nthe bf16 loop gave\n %v", i, res.IDs, ids)
		}
	}
}

// goldenTieULPs bounds how far (in bf16 ulps of CUDA's top logit) golden's
// token may sit below CUDA's top-1 on golden's own prefix: a rounding-order
// tie. The "cuda" emulation's worst case on the five prompts is 2.
const goldenTieULPs = 3

// bf16ULP is the spacing of bf16 values at v (8 significant bits).
func bf16ULP(v float32) float64 {
	_, e := math.Frexp(math.Abs(float64(v)))
	return math.Ldexp(1, e-8)
}

type forcedStep struct {
	top           int32   // CUDA's top-1
	topLogit, gap float32 // its logit and how far golden's token is below it
	gapULPs       float64 // gap in bf16 ulps of topLogit
}

// teacherForced runs the prompt, then golden's tokens one at a time, and
// returns where golden's next token stands in CUDA's logits at each step.
func teacherForced(t *testing.T, m *Model, prompt, want []int32) []forcedStep {
	t.Helper()
	sess, err := m.Stack.NewSession(len(prompt) + len(want))
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	out := make([]forcedStep, len(want))
	tokens, pos := prompt, 0
	for step := range want {
		l := lastLogits(t, m, sess, pos, tokens)
		if want[step] < 0 || int(want[step]) >= len(l) {
			t.Fatalf("golden token %d at step %d is outside the vocabulary of %d", want[step], step, len(l))
		}
		top, _ := top2(l)
		gap := l[top] - l[want[step]]
		out[step] = forcedStep{top: top, topLogit: l[top], gap: gap, gapULPs: float64(gap) / bf16ULP(l[top])}
		pos += len(tokens)
		tokens = []int32{want[step]}
	}
	return out
}

// TestCPUGoldenTieBand runs TestCUDAGoldenGreedy's teacher-forced check on
// the CPU backend (f32 math, no GPU needed): an independent implementation
// must meet the tie band too, or the band is too tight for the model.
func TestCPUGoldenTieBand(t *testing.T) {
	dir := testenv.GoCoder(t)
	g := loadGolden(t, dir)
	cpu := loadModel(t, dir, openCPU(t), 0, -1)
	for i, gen := range g.Generations {
		for step, f := range teacherForced(t, cpu, gen.PromptIDs, gen.BF16.GreedyIDs) {
			if f.gapULPs > goldenTieULPs {
				t.Errorf("prompt %d step %d: golden token %d is %.1f bf16 ulps below the cpu's top-1 %d, want <= %d",
					i, step, gen.BF16.GreedyIDs[step], f.gapULPs, f.top, goldenTieULPs)
			}
		}
	}
}

// TestCUDASplit: layers 0-2 and 3-5 as two CUDA stacks with bf16 hand-over
// give exactly the ids of one stack (the residual stream is bf16 on CUDA, so
// the hand-over loses nothing).
func TestCUDASplit(t *testing.T) {
	be := openCUDAOrSkip(t)
	dir := testenv.GoCoder(t)
	g := loadGolden(t, dir)
	whole := loadModel(t, dir, be, 0, -1)
	a := loadModel(t, dir, be, 0, 2)
	b := loadModel(t, dir, be, 3, -1)
	p := GenerateParams{MaxTokens: 64, IgnoreEOS: true}
	for i, gen := range g.Generations {
		one, err := whole.Generate(context.Background(), gen.PromptIDs, p, nil)
		if err != nil {
			t.Fatal(err)
		}
		split, err := Decode(context.Background(), whole.Tokenizer, whole.EOS(), gen.PromptIDs, p,
			newChain(t, []*Model{a, b}, native.BF16).Stepper(p.Sampling), nil)
		if err != nil {
			t.Fatal(err)
		}
		same := commonPrefix(split.IDs, one.IDs)
		fmt.Printf("SPLIT prompt %d: layers 0-2 + 3-5 (bf16 hop) == one stack for %d of %d tokens\n", i, same, len(one.IDs))
		if !slices.Equal(split.IDs, one.IDs) {
			t.Errorf("prompt %d: split\n got %v\nwant %v", i, split.IDs, one.IDs)
		}
	}
}

// TestCUDABatchMatchesSingle: sessions decoded together in one Forward (the
// batched matrix-vector kernels and one captured graph) give bit-identical
// activations to the same sessions decoded one at a time.
func TestCUDABatchMatchesSingle(t *testing.T) {
	be := openCUDAOrSkip(t)
	dir := testenv.GoCoder(t)
	g := loadGolden(t, dir)
	m := loadModel(t, dir, be, 0, -1)
	const nSess, steps = 5, 12
	dt := native.BF16
	row := m.Config.Hidden * dt.Size()
	type seq struct {
		batch, single native.Session
		tokens        []int32
	}
	seqs := make([]seq, nSess)
	for i := range seqs {
		prompt := g.Generations[i%len(g.Generations)].PromptIDs[:3+i]
		var err error
		if seqs[i].batch, err = m.Stack.NewSession(64); err != nil {
			t.Fatal(err)
		}
		if seqs[i].single, err = m.Stack.NewSession(64); err != nil {
			t.Fatal(err)
		}
		defer seqs[i].batch.Close()
		defer seqs[i].single.Close()
		seqs[i].tokens = prompt
		for _, s := range []native.Session{seqs[i].batch, seqs[i].single} {
			lastLogits(t, m, s, 0, prompt)
		}
	}
	for step := 0; step < steps; step++ {
		toks := make([]int32, nSess)
		stepsB := make([]native.Step, nSess)
		for i := range seqs {
			toks[i] = seqs[i].tokens[len(seqs[i].tokens)-1]
			stepsB[i] = native.Step{Session: seqs[i].batch, Pos: seqs[i].batch.Len(), NTokens: 1}
		}
		batched := make([]byte, nSess*row)
		if err := m.Stack.Embed(toks, dt, batched); err != nil {
			t.Fatal(err)
		}
		if err := m.Stack.Forward(stepsB, m.First, m.Last, dt, batched, batched); err != nil {
			t.Fatal(err)
		}
		for i := range seqs {
			one := make([]byte, row)
			if err := m.Stack.Embed(toks[i:i+1], dt, one); err != nil {
				t.Fatal(err)
			}
			s := seqs[i].single
			if err := m.Stack.Forward([]native.Step{{Session: s, Pos: s.Len(), NTokens: 1}}, m.First, m.Last, dt, one, one); err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(one, batched[i*row:(i+1)*row]) {
				t.Fatalf("step %d session %d: batched activations differ from single-session ones", step, i)
			}
			logits := make([]float32, m.Config.Vocab)
			if err := m.Stack.Logits(1, dt, one, logits); err != nil {
				t.Fatal(err)
			}
			id, _ := top2(logits)
			seqs[i].tokens = append(seqs[i].tokens, id)
		}
	}
}

// TestCUDAStatuses: the CUDA backend's statuses and truncation follow the
// CPU backend: pos beyond the session is invalid, past max_tokens is
// capacity, and pos < len truncates (a retried hop gives the same result).
func TestCUDAStatuses(t *testing.T) {
	be := openCUDAOrSkip(t)
	dir := testenv.GoCoder(t)
	m := loadModel(t, dir, be, 0, -1)
	sess, err := m.Stack.NewSession(8)
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	dt := native.BF16
	row := m.Config.Hidden * dt.Size()
	act := make([]byte, 3*row)
	if err := m.Stack.Embed([]int32{5, 6, 7}, dt, act); err != nil {
		t.Fatal(err)
	}
	if err := m.Stack.Forward([]native.Step{{Session: sess, Pos: 1, NTokens: 3}}, 0, m.Last, dt, act, act); !native.IsStatus(err, native.StatusInvalidArgument) {
		t.Errorf("pos 1 on an empty session: %v, want invalid argument", err)
	}
	if sess.Len() != 0 {
		t.Errorf("session length %d after a refused step on an empty session, want 0", sess.Len())
	}
	first := lastLogits(t, m, sess, 0, []int32{5, 6, 7, 8})
	again := lastLogits(t, m, sess, 0, []int32{5, 6, 7, 8}) // retried hop: truncates to 0
	if !slices.Equal(first, again) {
		t.Errorf("a retried hop at pos 0 gives different logits")
	}
	if sess.Len() != 4 {
		t.Errorf("session length %d after 4 tokens, want 4", sess.Len())
	}
	big := make([]byte, 5*row)
	if err := m.Stack.Embed([]int32{1, 2, 3, 4, 5}, dt, big); err != nil {
		t.Fatal(err)
	}
	if err := m.Stack.Forward([]native.Step{{Session: sess, Pos: 4, NTokens: 5}}, 0, m.Last, dt, big, big); !native.IsStatus(err, native.StatusCapacity) {
		t.Errorf("9 tokens in an 8-token session: %v, want capacity", err)
	}
	// A refused retry from an earlier position must not truncate either.
	if err := m.Stack.Forward([]native.Step{{Session: sess, Pos: 2, NTokens: 5}}, 0, m.Last, dt, big, big); err != nil {
		t.Fatalf("positions 2..6 of an 8-token session: %v", err)
	}
	if err := m.Stack.Forward([]native.Step{{Session: sess, Pos: 4, NTokens: 5}}, 0, m.Last, dt, big, big); !native.IsStatus(err, native.StatusCapacity) {
		t.Errorf("positions 4..8 of an 8-token session: %v, want capacity", err)
	}
	if sess.Len() != 7 {
		t.Errorf("session length %d after a refused step at 4, want 7 (a refused step must not truncate)", sess.Len())
	}
	if err := m.Stack.Embed([]int32{int32(m.Config.Vocab)}, dt, act[:row]); !native.IsStatus(err, native.StatusInvalidArgument) {
		t.Errorf("embedding token %d of vocab %d: %v, want invalid argument", m.Config.Vocab, m.Config.Vocab, err)
	}
}

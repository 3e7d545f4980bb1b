package tracker

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"

	"meshgpu/engine"
	"meshgpu/internal/testenv"
	"meshgpu/native"
	"meshgpu/sample"
)

// auditSpreadMargin is how far below the tolerance the honest spread must
// stay: the measured spread moves with the prompts and the sampled tokens,
// and a false alarm bans an honest node.
const auditSpreadMargin = 4

// TestAuditToleranceCoversHonestReplicas plays an audit on two honest
// replicas of each gocoder-6m GGUF file (bf16 and the four quantized ones),
// as the tracker compares them: the audited route generated every token in
// decode steps batched with other sessions (2 CPU threads, layers split over
// two stacks), and the referee teacher-forces prompt + ids[:k] alone in one
// prefill (1 thread), once with f32 hops and once with bf16 hops between
// its stacks. The largest difference of the chosen token's logprob over
// every position must stay auditSpreadMargin times below the tolerance the
// tracker applies (docs/security.md, "Audits of nodes' work", has the table).
func TestAuditToleranceCoversHonestReplicas(t *testing.T) {
	if testing.Short() {
		t.Skip("five models, two replicas each")
	}
	be1 := openCPUThreads(t, 1)
	be2 := openCPUThreads(t, 2)
	var table []string
	for _, variant := range []string{"bf16", "q8_0", "q6_k", "q5_k_m", "q4_k_m"} {
		path := testenv.GoCoderGGUF(t, variant)
		route := splitModel(t, path, be2)
		referee := splitModel(t, path, be1)
		gens := route.generateBatched(t, 4, 24)
		var worst [2]float64 // f32 hops, bf16 hops
		n := 0
		for _, g := range gens {
			for k := range g.ids {
				ctx := append(slices.Clone(g.prompt), g.ids[:k]...)
				for h, dt := range []native.DType{native.F32, native.BF16} {
					lp := referee.teacherForced(t, ctx, g.ids[k], dt)
					worst[h] = max(worst[h], math.Abs(float64(lp-g.logprobs[k])))
				}
				n++
			}
		}
		tol := DefaultAuditTolerance
		table = append(table, fmt.Sprintf("%s: %d positions, largest difference %.2g nats (f32 hops), %.2g (bf16 hops); tolerance %.2g", variant, n, worst[0], worst[1], tol))
		if w := max(worst[0], worst[1]); w*auditSpreadMargin > tol {
			t.Errorf("%s: honest replicas differ by up to %.3g nats, not %dx below the tolerance %.3g", variant, w, auditSpreadMargin, tol)
		}
	}
	t.Log("honest replicas:\n" + strings.Join(table, "\n"))
}

func openCPUThreads(t *testing.T, threads int) native.Backend {
	t.Helper()
	be, err := native.Open("cpu", native.Options{Threads: threads})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.Close() })
	return be
}

// splitReplica is a model on two stacks (layers 0-2 and 3-), a route of two
// nodes.
type splitReplica struct{ front, back *engine.Model }

func splitModel(t *testing.T, path string, be native.Backend) splitReplica {
	t.Helper()
	load := func(first, last int) *engine.Model {
		m, err := engine.Load(path, engine.Options{Backend: be, First: first, Last: last, MaxContext: 256})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		return m
	}
	return splitReplica{load(0, 2), load(3, -1)}
}

type auditedGen struct {
	prompt, ids []int32
	logprobs    []float32 // the route's logprob of each id
}

// step runs one forward call of several sessions, each adding one or more
// tokens at its position, through both stacks with hops in dt, and returns
// the logits of each session's last row.
func (r splitReplica) step(t *testing.T, sessF, sessB []native.Session, pos []int, toks [][]int32, dt native.DType) [][]float32 {
	t.Helper()
	var all []int32
	var steps, stepsB []native.Step
	for i, tk := range toks {
		all = append(all, tk...)
		steps = append(steps, native.Step{Session: sessF[i], Pos: pos[i], NTokens: len(tk)})
		stepsB = append(stepsB, native.Step{Session: sessB[i], Pos: pos[i], NTokens: len(tk)})
	}
	row := r.front.Config.Hidden * dt.Size()
	act := make([]byte, len(all)*row)
	if err := r.front.Stack.Embed(all, dt, act); err != nil {
		t.Fatal(err)
	}
	if err := r.front.Stack.Forward(steps, r.front.First, r.front.Last, dt, act, act); err != nil {
		t.Fatal(err)
	}
	if err := r.back.Stack.Forward(stepsB, r.back.First, r.back.Last, dt, act, act); err != nil {
		t.Fatal(err)
	}
	v := r.back.Config.Vocab
	out := make([][]float32, len(toks))
	end := 0
	for i, tk := range toks {
		end += len(tk)
		out[i] = make([]float32, v)
		if err := r.back.Stack.Logits(1, dt, act[(end-1)*row:end*row], out[i]); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// sessions opens n sessions on each stack; closeAll frees them.
func (r splitReplica) sessions(t *testing.T, n int) (front, back []native.Session, closeAll func()) {
	t.Helper()
	var all []native.Session
	closeAll = func() {
		for _, s := range all {
			s.Close()
		}
	}
	for range n {
		for _, m := range []*engine.Model{r.front, r.back} {
			s, err := m.Stack.NewSession(256)
			if err != nil {
				closeAll()
				t.Fatal(err)
			}
			all = append(all, s)
			if m == r.front {
				front = append(front, s)
			} else {
				back = append(back, s)
			}
		}
	}
	return front, back, closeAll
}

// generateBatched samples n tokens (temperature 0.8, so unlikely tokens
// are audited too) for each of s sessions of different prompts, prefilled
// together, then decoded one token each per forward call, with f32 hops.
func (r splitReplica) generateBatched(t *testing.T, s, n int) []auditedGen {
	t.Helper()
	front, back, closeAll := r.sessions(t, s)
	defer closeAll()
	gens := make([]auditedGen, s)
	toks := make([][]int32, s)
	pos := make([]int, s)
	for i := range gens {
		code := fmt.Sprintf("// Package p%d does thing %d.\nfunc Parse%d(s string) (int, error) {\n", i, i*7, i)
		gens[i].prompt = r.front.Tokenizer.Encode(strings.Repeat(code, 1+i%2), true)
		toks[i] = gens[i].prompt
	}
	for k := 0; k < n; k++ {
		logits := r.step(t, front, back, pos, toks, native.F32)
		for i := range gens {
			g := &gens[i]
			pos[i] += len(toks[i])
			p := sample.Params{Temperature: 0.8, Seed: uint64(1 + i)}
			id, _ := sample.Sample(slices.Clone(logits[i]), p, append(slices.Clone(g.prompt), g.ids...), k)
			lp := sample.Logprobs(logits[i], id, 0)
			g.ids = append(g.ids, id)
			g.logprobs = append(g.logprobs, lp.Logprob)
			toks[i] = []int32{id}
		}
	}
	return gens
}

// teacherForced is the referee's answer: ctx prefilled alone on fresh
// sessions, the logprob of want at the next position.
func (r splitReplica) teacherForced(t *testing.T, ctx []int32, want int32, dt native.DType) float32 {
	t.Helper()
	front, back, closeAll := r.sessions(t, 1)
	defer closeAll()
	logits := r.step(t, front, back, []int{0}, [][]int32{ctx}, dt)
	return sample.Logprobs(logits[0], want, 0).Logprob
}

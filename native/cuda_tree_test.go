package native

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// TestCUDATreePassMatchesCPU: the CUDA backend runs token trees
// (forward_tree) and keeps a branch (session_compact) as the CPU backend
// does. One random model (q/k/v biases, GQA, llama3 RoPE) on both: a
// 40-token prefill, then a tree pass of three branches (root 0; 0-1-2-3,
// 0-1-6, 0-4-5) whose rows must match the CPU's; the mask must matter
// (a chain pass of the same rows differs off the first branch). Then each
// branch is kept with Compact and the next two tokens run as a chain: the
// CPU's rows, and on CUDA those of a session that ran the branch alone
// (the tree pass and the sequential one accept the same tokens). The
// residual stream is bf16 on CUDA, f32 on the CPU: a relative L2 bound.
func TestCUDATreePassMatchesCPU(t *testing.T) {
	cb, pb := openBoth(t)
	treePassesMatch(t, cb, pb)
}

// treePassesMatch runs the checks of TestCUDATreePassMatchesCPU on cb
// (the backend under test) against pb (the CPU reference).
func treePassesMatch(t *testing.T, cb, pb Backend) {
	cfg := StackConfig{
		Hidden: 256, Intermediate: 512, Heads: 8, KVHeads: 2, HeadDim: 64, Vocab: 300,
		NumLayers: 2, First: 0, Last: 1, HasEmbed: true, HasHead: true, QKVBias: true,
		MaxContext: 128, RMSEps: 1e-5,
		Rope: Rope{Type: RopeLlama3, Theta: 500000, Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OrigMaxPos: 64},
	}
	seed := opsSeed(t)
	tensors := mixedTensors(cfg, seed)
	stacks := make([]Stack, 2) // cuda, cpu
	for i, b := range []Backend{cb, pb} {
		st, err := b.NewStack(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		for _, ts := range tensors {
			if err := st.SetTensor(ts); err != nil {
				t.Fatalf("%s: %v", b.Name(), err)
			}
		}
		if err := st.Ready(); err != nil {
			t.Fatal(err)
		}
		stacks[i] = st
	}
	if ts, ok := stacks[0].(TreeStack); !ok || !ts.HasTrees() {
		t.Fatal("the CUDA library has no forward_tree/session_compact")
	}
	r := rand.New(rand.NewPCG(seed, 5))
	toks := func(n int) []int32 {
		out := make([]int32, n)
		for i := range out {
			out[i] = int32(r.IntN(cfg.Vocab))
		}
		return out
	}
	prompt, tree, next := toks(40), toks(7), toks(2)
	parents := []int32{-1, 0, 1, 2, 0, 4, 1}
	branches := [][]int{{0, 1, 2, 3}, {0, 1, 6}, {0, 4, 5}}
	pos := len(prompt)

	// pass runs tokens at pos on stack i (a tree when parents is not nil)
	// and answers the output rows.
	pass := func(i int, sess Session, pos int, tokens, parents []int32) []float32 {
		t.Helper()
		act := make([]byte, len(tokens)*cfg.Hidden*4)
		if err := stacks[i].Embed(tokens, F32, act); err != nil {
			t.Fatal(err)
		}
		step := Step{Session: sess, Pos: pos, NTokens: len(tokens), Parents: parents}
		if err := stacks[i].Forward([]Step{step}, cfg.First, cfg.Last, F32, act, act); err != nil {
			t.Fatalf("%s: %v", []string{"cuda", "cpu"}[i], err)
		}
		return f32s(act)
	}
	session := func(i int) Session {
		t.Helper()
		s, err := stacks[i].NewSession(cfg.MaxContext)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		pass(i, s, 0, prompt, nil)
		return s
	}
	rowsOf := func(x []float32, rows ...int) []float32 {
		var out []float32
		for _, i := range rows {
			out = append(out, x[i*cfg.Hidden:(i+1)*cfg.Hidden]...)
		}
		return out
	}
	const tol = 3e-2
	check := func(what string, got, want []float32) {
		t.Helper()
		e := relErr(got, want)
		fmt.Printf("STACK tree %-39s rel L2 %.2e (< %.0e) %s\n", what, e, tol, okFail(e < tol))
		if !(e < tol) {
			t.Errorf("%s: rel L2 %.3g, want < %g", what, e, tol)
		}
	}

	cudaTree := pass(0, session(0), pos, tree, parents)
	check("tree pass, cuda vs cpu", cudaTree, pass(1, session(1), pos, tree, parents))
	cudaChain := pass(0, session(0), pos, tree, nil)
	e := relErr(rowsOf(cudaTree, 4, 5), rowsOf(cudaChain, 4, 5))
	fmt.Printf("STACK tree %-39s rel L2 %.2e (> %.0e) %s\n", "mask: tree rows 4-5 vs a chain's", e, 3*tol, okFail(e >= 3*tol))
	if e < 3*tol {
		t.Errorf("tree rows 4-5 are within %.3g of a chain pass's: the mask has no effect", e)
	}
	for _, b := range branches {
		branch := make([]int32, len(b))
		src := make([]int32, 0, len(b)-1)
		for d, i := range b {
			branch[d] = tree[i]
			if d > 0 {
				src = append(src, int32(pos+i))
			}
		}
		after := make([][]float32, 2)
		for i := range stacks {
			sess := session(i)
			pass(i, sess, pos, tree, parents)
			if err := sess.(Compacter).Compact(pos+1, src); err != nil {
				t.Fatalf("%s: compact %v: %v", []string{"cuda", "cpu"}[i], src, err)
			}
			if sess.Len() != pos+len(b) {
				t.Fatalf("%s: the compacted session holds %d positions, want %d", []string{"cuda", "cpu"}[i], sess.Len(), pos+len(b))
			}
			after[i] = pass(i, sess, pos+len(b), next, nil)
		}
		check(fmt.Sprintf("branch %v kept, next tokens: cuda vs cpu", b), after[0], after[1])
		alone := session(0)
		pass(0, alone, pos, branch, nil)
		check(fmt.Sprintf("branch %v kept vs run alone (cuda)", b), after[0], pass(0, alone, pos+len(b), next, nil))
	}
}

func okFail(ok bool) string {
	if ok {
		return "ok"
	}
	return "FAIL"
}

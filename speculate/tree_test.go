package speculate

import (
	"context"
	"slices"
	"testing"

	"meshgpu/engine"
	"meshgpu/native"
	"meshgpu/sample"
)

func TestTreeAddSharesPrefixesAndBoundsRows(t *testing.T) {
	tr := NewTree(9)
	if n := tr.Add([]int32{1, 2, 3}, 10); n != 3 {
		t.Fatalf("first branch added %d rows", n)
	}
	if n := tr.Add([]int32{1, 2, 4}, 10); n != 1 {
		t.Fatalf("a branch sharing 1 2 added %d rows, want 1", n)
	}
	if n := tr.Add([]int32{5, 6, 7}, 6); n != 1 {
		t.Fatalf("a branch at the row limit added %d rows, want 1", n)
	}
	want := &Tree{Tokens: []int32{9, 1, 2, 3, 4, 5}, Parents: []int32{-1, 0, 1, 2, 2, 0}}
	if !slices.Equal(tr.Tokens, want.Tokens) || !slices.Equal(tr.Parents, want.Parents) {
		t.Fatalf("tree %+v, want %+v", tr, want)
	}
	if rows, ok := tr.Path([]int32{1, 2, 4}); !ok || !slices.Equal(rows, []int{1, 2, 4}) {
		t.Errorf("Path(1 2 4) = %v %v", rows, ok)
	}
	if _, ok := tr.Path([]int32{1, 3}); ok {
		t.Error("Path(1 3) found a branch the tree does not have")
	}
	if d := tr.Depth(4); d != 3 {
		t.Errorf("Depth(4) = %d", d)
	}
}

// The tree drafter's first branch is NGram's draft; later branches are the
// continuations of other occurrences.
func TestNGramTreeBranchesAtForks(t *testing.T) {
	// "1 2" was followed by 3, then by 4, then by 5 (the most recent)
	hist := []int32{1, 2, 3, 8, 1, 2, 4, 8, 1, 2, 5, 8, 1, 2}
	chain, _ := NGram{}.Propose(context.Background(), hist, 2)
	tr, err := NGramTree{}.ProposeTree(context.Background(), hist, 2, 20)
	if err != nil {
		t.Fatal(err)
	}
	var first []int32
	for i := 1; i < tr.Rows() && len(first) < len(chain); i++ {
		first = append(first, tr.Tokens[i])
	}
	if !slices.Equal(first, chain) {
		t.Errorf("first branch %v, NGram drafts %v", first, chain)
	}
	for _, b := range [][]int32{{5, 8}, {4, 8}, {3, 8}} {
		if _, ok := tr.Path(b); !ok {
			t.Errorf("tree %+v lacks the branch %v", tr, b)
		}
	}
	if tr.Rows() > 7 {
		t.Errorf("%d rows for three 2-token branches", tr.Rows())
	}
	if tr, _ := (NGramTree{}).ProposeTree(context.Background(), []int32{1, 2, 3}, 4, 20); tr != nil {
		t.Errorf("nothing recurs, yet a tree %+v", tr)
	}
}

// verifyRig runs verify passes of the real test model: a chain with
// sample.Verify, a tree with AcceptTree, both after the same prefix.
type verifyRig struct {
	t      *testing.T
	m      *engine.Model
	prefix []int32 // cached before the pass; the pass's row 0 follows
	p      sample.Params
	step   int
}

func (r *verifyRig) logits(tokens, parents []int32) func(i int) []float32 {
	r.t.Helper()
	m := r.m
	sess, err := m.Stack.NewSession(256)
	if err != nil {
		r.t.Fatal(err)
	}
	defer sess.Close()
	act := make([]byte, len(r.prefix)*m.Config.Hidden*4)
	if err := engine.RunStep([]engine.Stage{{Stack: m.Stack, Session: sess, First: m.First, Last: m.Last}}, 0, len(r.prefix), r.prefix, native.F32, act, nil); err != nil {
		r.t.Fatal(err)
	}
	n := len(tokens)
	act = make([]byte, n*m.Config.Hidden*4)
	if err := m.Stack.Embed(tokens, native.F32, act); err != nil {
		r.t.Fatal(err)
	}
	st := native.Step{Session: sess, Pos: len(r.prefix), NTokens: n, Parents: parents}
	if err := m.Stack.Forward([]native.Step{st}, m.First, m.Last, native.F32, act, act); err != nil {
		r.t.Fatal(err)
	}
	out := make([]float32, n*m.Config.Vocab)
	if err := m.Stack.Logits(n, native.F32, act, out); err != nil {
		r.t.Fatal(err)
	}
	v := m.Config.Vocab
	return func(i int) []float32 { return out[i*v : (i+1)*v] }
}

// chain verifies tokens (row 0 and drafts) as one sequential pass.
func (r *verifyRig) chain(tokens []int32) []int32 {
	rows := r.logits(tokens, nil)
	hist := func(i int) []int32 { return append(slices.Clone(r.prefix), tokens[:i+1]...) }
	var out []int32
	for _, d := range sample.Verify(rows, tokens[1:], r.p, hist, r.step) {
		out = append(out, d.ID)
	}
	return out
}

// tree verifies tr in one pass.
func (r *verifyRig) tree(tr *Tree) []int32 {
	rows := r.logits(tr.Tokens, tr.Parents)
	_, draws := AcceptTree(tr, func(row, depth int) sample.Draw {
		var hist []int32
		if r.p.NeedsHistory() {
			hist = slices.Clone(r.prefix)
			path := []int32{}
			for q := row; q >= 0; q = int(tr.Parents[q]) {
				path = append(path, tr.Tokens[q])
			}
			slices.Reverse(path)
			hist = append(hist, path...)
		}
		id, lp := sample.Sample(rows(row), r.p, hist, r.step+depth)
		return sample.Draw{ID: id, Logprob: lp}
	})
	var out []int32
	for _, d := range draws {
		out = append(out, d.ID)
	}
	return out
}

// A tree pass accepts what the best of its branches accepts run as a
// sequential verify pass, and both are the plain decoding's tokens: under
// greedy decoding and under seeded sampling (with a repetition penalty,
// which sees each branch's own history).
func TestTreePassAcceptsAsSequentialPasses(t *testing.T) {
	m := loadGoCoder(t)
	prompt := m.Tokenizer.Encode("func max(a, b int) int {\n\tif a > b {\n\t\treturn a\n\t}\n", true)
	for _, p := range []sample.Params{{}, {Temperature: 0.8, TopK: 20, Seed: 7, RepetitionPenalty: 1.2}} {
		ref, err := m.Generate(context.Background(), prompt, engine.GenerateParams{MaxTokens: 8, IgnoreEOS: true, Sampling: p}, nil)
		if err != nil {
			t.Fatal(err)
		}
		g := ref.IDs
		r := &verifyRig{t: t, m: m, prefix: prompt[:len(prompt)-1], p: p}
		root := prompt[len(prompt)-1]
		wrong := func(x int32) int32 { return (x + 1) % int32(m.Config.Vocab) }
		branches := [][]int32{
			{wrong(g[0]), g[1]},       // wrong at once
			{g[0], g[1], wrong(g[2])}, // two right
			{g[0], g[1], g[2], g[3]},  // four right
			{g[0], wrong(g[1]), g[2]}, // one right
		}
		tr := NewTree(root)
		best := 0
		var bestSeq []int32
		for _, b := range branches {
			tr.Add(b, 64)
			seq := r.chain(append([]int32{root}, b...))
			if len(seq) > best {
				best, bestSeq = len(seq), seq
			}
		}
		got := r.tree(tr)
		if !slices.Equal(got, bestSeq) {
			t.Errorf("%+v: tree pass accepts %v, the best sequential pass %v", p, got, bestSeq)
		}
		if !slices.Equal(got, g[:len(got)]) || len(got) != 5 {
			t.Errorf("%+v: tree pass gives %v, plain decoding %v (want 4 drafts and one more)", p, got, g[:5])
		}
	}
}

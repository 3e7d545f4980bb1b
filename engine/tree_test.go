package engine

import (
	"math"
	"slices"
	"testing"

	"meshgpu/internal/testenv"
	"meshgpu/native"
)

// treeRig runs passes of the real test model on the CPU backend: a prompt
// prefilled into a fresh session, then a pass of rows (a chain, or a tree
// with parents) whose every row's logits come back.
type treeRig struct {
	t      *testing.T
	m      *Model
	prompt []int32
}

func newTreeRig(t *testing.T) *treeRig {
	dir := testenv.GoCoder(t)
	m := loadModel(t, dir, openCPU(t), 0, -1)
	prompt := m.Tokenizer.Encode("func add(a, b int) int {\n\treturn a + b\n}\n\nfunc sub(a, b int) int {\n", true)
	return &treeRig{t: t, m: m, prompt: prompt}
}

// session holds the prompt.
func (r *treeRig) session() native.Session {
	sess, err := r.m.Stack.NewSession(256)
	if err != nil {
		r.t.Fatal(err)
	}
	r.t.Cleanup(func() { sess.Close() })
	r.pass(sess, 0, r.prompt, nil)
	return sess
}

// pass runs tokens at pos (a tree when parents is not nil) and answers
// every row's logits.
func (r *treeRig) pass(sess native.Session, pos int, tokens, parents []int32) [][]float32 {
	r.t.Helper()
	n, cfg := len(tokens), r.m.Config
	act := make([]byte, n*cfg.Hidden*4)
	if err := r.m.Stack.Embed(tokens, native.F32, act); err != nil {
		r.t.Fatal(err)
	}
	step := native.Step{Session: sess, Pos: pos, NTokens: n, Parents: parents}
	if err := r.m.Stack.Forward([]native.Step{step}, r.m.First, r.m.Last, native.F32, act, act); err != nil {
		r.t.Fatal(err)
	}
	logits := make([]float32, n*cfg.Vocab)
	if err := r.m.Stack.Logits(n, native.F32, act, logits); err != nil {
		r.t.Fatal(err)
	}
	rows := make([][]float32, n)
	for i := range rows {
		rows[i] = logits[i*cfg.Vocab : (i+1)*cfg.Vocab]
	}
	return rows
}

func maxDiff(a, b []float32) float64 {
	d := 0.0
	for i := range a {
		d = max(d, math.Abs(float64(a[i]-b[i])))
	}
	return d
}

// A test tree: root 0 (the last accepted token) with branches 0-1-2-3,
// 0-1-6 and 0-4-5. branchOf lists each leaf's rows root first.
var (
	treeTokens  = []int32{0, 0, 0, 0, 0, 0, 0} // filled from the prompt
	treeParents = []int32{-1, 0, 1, 2, 0, 4, 1}
	treeLeaves  = [][]int{{0, 1, 2, 3}, {0, 1, 6}, {0, 4, 5}}
)

func (r *treeRig) tree() []int32 {
	// tokens of the prompt's text, so that branches are plausible code
	toks := slices.Clone(treeTokens)
	for i := range toks {
		toks[i] = r.prompt[3+2*i]
	}
	return toks
}

// A tree pass's logits at every row equal those of its branch run alone as
// a plain pass: the tree mask hides the other branches and each row runs at
// its depth's position.
func TestTreePassEqualsEachBranch(t *testing.T) {
	r := newTreeRig(t)
	pos := len(r.prompt)
	toks := r.tree()
	tree := r.pass(r.session(), pos, toks, treeParents)
	chain := r.pass(r.session(), pos, toks, nil)
	for _, rows := range treeLeaves {
		branch := make([]int32, len(rows))
		for d, i := range rows {
			branch[d] = toks[i]
		}
		alone := r.pass(r.session(), pos, branch, nil)
		for d, i := range rows {
			if diff := maxDiff(tree[i], alone[d]); diff > 1e-5 {
				t.Errorf("branch %v: tree row %d differs from the branch alone at depth %d by %g", rows, i, d, diff)
			}
		}
	}
	// The mask must matter: a row off the first branch sees other keys in
	// a chain pass (the comparison above would fail without the mask).
	if diff := maxDiff(tree[4], chain[4]); diff < 1e-3 {
		t.Errorf("tree row 4 equals the chain's row 4 (diff %g): the mask has no effect", diff)
	}
}

// After a tree pass, keeping one branch with Compact leaves the session as
// if it had run that branch alone: the same length and the same logits for
// the next tokens.
func TestTreeCompactKeepsTheBranch(t *testing.T) {
	r := newTreeRig(t)
	pos := len(r.prompt)
	toks := r.tree()
	next := []int32{r.prompt[1], r.prompt[2]}
	for _, rows := range treeLeaves {
		sess := r.session()
		r.pass(sess, pos, toks, treeParents)
		src := make([]int32, 0, len(rows)-1)
		branch := []int32{toks[0]}
		for _, i := range rows[1:] {
			src = append(src, int32(pos+i))
			branch = append(branch, toks[i])
		}
		if err := sess.(native.Compacter).Compact(pos+1, src); err != nil {
			t.Fatal(err)
		}
		ref := r.session()
		r.pass(ref, pos, branch, nil)
		if sess.Len() != ref.Len() {
			t.Fatalf("branch %v: compacted session holds %d positions, the branch alone %d", rows, sess.Len(), ref.Len())
		}
		got := r.pass(sess, pos+len(branch), next, nil)
		want := r.pass(ref, pos+len(branch), next, nil)
		for d := range next {
			if diff := maxDiff(got[d], want[d]); diff > 1e-5 {
				t.Errorf("branch %v: after compaction row %d differs from the branch alone by %g", rows, d, diff)
			}
		}
	}
}

// Bad trees and compactions are refused with invalid argument, and the
// session stays usable.
func TestTreeBadInput(t *testing.T) {
	r := newTreeRig(t)
	sess := r.session()
	pos := len(r.prompt)
	n, h := 3, r.m.Config.Hidden*4
	act := make([]byte, n*h)
	if err := r.m.Stack.Embed(r.prompt[:n], native.F32, act); err != nil {
		t.Fatal(err)
	}
	for _, parents := range [][]int32{{-1, 1, 0}, {-1, 0, 3}, {-2, 0, 1}, {-1, 0}} {
		err := r.m.Stack.Forward([]native.Step{{Session: sess, Pos: pos, NTokens: n, Parents: parents}}, r.m.First, r.m.Last, native.F32, act, act)
		if !native.IsStatus(err, native.StatusInvalidArgument) {
			t.Errorf("parents %v: %v, want invalid argument", parents, err)
		}
	}
	c := sess.(native.Compacter)
	for _, src := range [][]int32{{int32(pos + 5)}, {int32(pos - 2)}, {int32(pos), int32(pos)}} {
		if err := c.Compact(pos-1, src); !native.IsStatus(err, native.StatusInvalidArgument) {
			t.Errorf("compact %v to %d: %v, want invalid argument", src, pos-1, err)
		}
	}
	if sess.Len() != pos {
		t.Errorf("session holds %d positions after refused calls, want %d", sess.Len(), pos)
	}
	r.pass(sess, pos, r.prompt[:n], []int32{-1, 0, 0})
}

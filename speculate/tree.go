package speculate

import (
	"context"
	"slices"

	"meshgpu/sample"
)

// Tree is the token tree of a verify pass with branching drafts (wire's
// tree.go): row 0 is the last accepted token (the root), Parents[i] is row
// i's parent row (-1 for the root, else < i). Siblings carry distinct
// tokens, so the target's token at a row selects at most one child.
type Tree struct {
	Tokens  []int32
	Parents []int32
}

// NewTree is a tree of only its root.
func NewTree(root int32) *Tree {
	return &Tree{Tokens: []int32{root}, Parents: []int32{-1}}
}

// Rows is the number of rows: the root and the drafts.
func (t *Tree) Rows() int { return len(t.Tokens) }

// child is the row under parent that carries token, or -1.
func (t *Tree) child(parent int, token int32) int {
	for i := parent + 1; i < len(t.Tokens); i++ {
		if int(t.Parents[i]) == parent && t.Tokens[i] == token {
			return i
		}
	}
	return -1
}

// Add inserts branch, a continuation of the root, sharing the rows of the
// prefix it has in common with earlier branches, until the tree holds
// maxRows rows. It answers the rows it added.
func (t *Tree) Add(branch []int32, maxRows int) int {
	at, added := 0, 0
	for _, tok := range branch {
		if c := t.child(at, tok); c >= 0 {
			at = c
			continue
		}
		if len(t.Tokens) >= maxRows {
			break
		}
		t.Tokens = append(t.Tokens, tok)
		t.Parents = append(t.Parents, int32(at))
		at = len(t.Tokens) - 1
		added++
	}
	return added
}

// Path is the rows the tokens follow from the root, each a child of the one
// before; ok is false where a token has no such row.
func (t *Tree) Path(tokens []int32) (rows []int, ok bool) {
	at := 0
	for _, tok := range tokens {
		if at = t.child(at, tok); at < 0 {
			return rows, false
		}
		rows = append(rows, at)
	}
	return rows, true
}

// Depth is row i's distance from the root.
func (t *Tree) Depth(i int) int {
	d := 0
	for p := t.Parents[i]; p >= 0; p = t.Parents[p] {
		d++
	}
	return d
}

// AcceptTree verifies a tree pass: from the root, choose(row, depth) is the
// target's token after that row, the draw plain decoding makes at that
// step (sample.Verify's rule, at step+depth); while a child of the row
// carries it, the walk goes on there. It answers the accepted rows (root
// excluded) and the draws along the walk: the accepted drafts and then one
// more token, which no child matched.
//
// The output is the very text plain decoding of the same seed produces:
// each draw is the plain draw at its step on the same prefix (the accepted
// branch), and a draw ends the walk unless the tree guessed it. So greedy
// output is identical and sampled output keeps the target's distribution
// exactly (the drafts being deterministic, this is speculative sampling
// with one-hot draft distributions, as sample.Verify argues, applied to
// whichever child the draw lands on: siblings are distinct, so at most
// one matches).
func AcceptTree(t *Tree, choose func(row, depth int) sample.Draw) (rows []int, draws []sample.Draw) {
	at := 0
	for depth := 0; ; depth++ {
		d := choose(at, depth)
		draws = append(draws, d)
		c := t.child(at, d.ID)
		if c < 0 {
			return rows, draws
		}
		rows = append(rows, c)
		at = c
	}
}

// TreeDrafter proposes a tree of at most rows rows whose branches are up to
// k tokens deep, rooted at history's last token.
type TreeDrafter interface {
	ProposeTree(ctx context.Context, history []int32, k, rows int) (*Tree, error)
	Close()
}

// NGramTree is prompt lookup with branches: the continuations after
// several earlier occurrences of history's suffixes (longest suffix first,
// then the most recent occurrence first; NGram's first pick is the first
// branch), merged into one tree. Where the text forked after a repeated
// phrase, one pass tries each fork.
type NGramTree struct {
	MaxN, MinN int // suffix lengths tried, as NGram; defaults 4 and 1
	Branches   int // at most this many continuations; default 4
}

// ProposeTree implements TreeDrafter.
func (g NGramTree) ProposeTree(_ context.Context, history []int32, k, rows int) (*Tree, error) {
	if len(history) == 0 {
		return nil, nil
	}
	t := NewTree(history[len(history)-1])
	maxN, minN, branches := g.MaxN, g.MinN, g.Branches
	if maxN <= 0 {
		maxN = 4
	}
	if minN <= 0 {
		minN = 1
	}
	if branches <= 0 {
		branches = 4
	}
	h, found := len(history), 0
	for n := min(maxN, h-1); n >= minN && found < branches && t.Rows() < rows && k > 0; n-- {
		suffix := history[h-n:]
		for start := h - n - 1; start >= 0 && found < branches && t.Rows() < rows; start-- {
			if !slices.Equal(history[start:start+n], suffix) {
				continue
			}
			// a shorter suffix's match inside a longer one's continues
			// the same way: Add shares its rows, and it does not count
			if t.Add(continuation(history, start+n, k), rows) > 0 {
				found++
			}
		}
	}
	if t.Rows() == 1 {
		return nil, nil
	}
	return t, nil
}

// continuation is the k tokens from history[from:]. One that runs into
// the end of history repeats with the match's period (the history ends in
// a loop).
func continuation(history []int32, from, k int) []int32 {
	h := len(history)
	out := make([]int32, 0, k)
	for q := from; len(out) < k; q++ {
		if q < h {
			out = append(out, history[q])
		} else {
			out = append(out, out[q-h])
		}
	}
	return out
}

// Close implements TreeDrafter.
func (NGramTree) Close() {}

package node

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"time"

	"meshgpu/native"
	"meshgpu/sample"
	"meshgpu/speculate"
	"meshgpu/wire"
)

// Branching drafts (--speculate ngram-tree; wire/tree.go): a verify pass
// carries a token tree, the node with the last layer accepts its longest
// matching branch (speculate.AcceptTree), and the session's next hop tells
// every node which cache slots that branch took (Keep), which each moves to
// consecutive positions (native.Compacter). The head's own cache is
// compacted as soon as the answer arrives.

// treeState is a generation's tree drafting on the head.
type treeState struct {
	drafter speculate.TreeDrafter
	// pass is the tree of the pass being sent; nil outside a tree pass.
	pass *speculate.Tree
	// keep is the accepted branch's slots for the hop at keepAt.
	keep   []int32
	keepAt int
}

// DefaultTreeBranches is how many continuations a tree drafts: on the
// Go prompts two accept about as many tokens per pass as four (2.90 and
// 2.96, docs/performance.md) with half the rows.
const DefaultTreeBranches = 2

// parents is the pass's tree, nil for a chain.
func (t *treeState) parents() []int32 {
	if t == nil || t.pass == nil {
		return nil
	}
	return t.pass.Parents
}

// keepFor is the Keep of a hop at pos: the last tree pass's branch when pos
// is the position right after it, else nothing.
func (t *treeState) keepFor(pos int) []int32 {
	if t == nil || len(t.keep) == 0 || pos != t.keepAt {
		return nil
	}
	return t.keep
}

// treePass drafts a tree of up to k-deep branches after root at pos and
// verifies it in one pass; a pass's rows take cache slots, so at most limit
// (the tokens the generation may still add, as a chain's drafts + 1). ok
// is false when no tree could be drafted (the caller runs its chain or
// plain pass instead).
func (p *pipeline) treePass(ctx context.Context, pos int, root int32, k, limit, step int) (toks []wire.TokenReply, drafts int, cost time.Duration, ok bool, ae *apiError) {
	ts := p.spec.tree
	hist := append(slices.Clip(p.sess.history[:pos]), root)
	t0 := time.Now()
	tr, err := ts.drafter.ProposeTree(ctx, hist, k, min(wire.MaxVerifyRows, 1+k*DefaultTreeBranches, limit))
	cost = time.Since(t0)
	if err != nil || tr == nil || tr.Rows() < 2 {
		return nil, 0, cost, false, nil
	}
	ts.pass = tr
	toks, ae = p.pass(ctx, pos, tr.Tokens, step, true)
	ts.pass = nil
	if ae != nil {
		return nil, 0, cost, true, ae
	}
	rows, _ := tr.Path(tokensOf(toks[:len(toks)-1])) // checked by pass
	if ae := p.keepBranch(pos, tr.Rows(), rows); ae != nil {
		return nil, 0, cost, true, ae
	}
	return toks, tr.Rows() - 1, cost, true, nil
}

// keepBranch compacts the head's cache to the accepted rows of a tree pass
// of n rows at pos and remembers them for the next hop, unless they are
// already consecutive (the next hop's position truncates the rest).
func (p *pipeline) keepBranch(pos, n int, rows []int) *apiError {
	ts := p.spec.tree
	ts.keep, ts.keepAt = nil, 0
	src := make([]int32, len(rows))
	moved := false
	for j, r := range rows {
		src[j] = int32(pos + r)
		moved = moved || r != j+1
	}
	p.sess.tree.pos, p.sess.tree.rows = pos, n
	if ae := p.sess.keepBranch(pos+1, src); ae != nil {
		return ae
	}
	if moved {
		ts.keep, ts.keepAt = src, pos+1+len(src)
	}
	return nil
}

func tokensOf(toks []wire.TokenReply) []int32 {
	out := make([]int32, len(toks))
	for i, t := range toks {
		out[i] = t.Token
	}
	return out
}

// checkTreeAnswer refuses a verify answer whose accepted tokens are not a
// branch of tr: a tail that claims others would leave every cache on the
// route holding tokens the text does not have.
func checkTreeAnswer(tr *speculate.Tree, toks []wire.TokenReply) error {
	if _, ok := tr.Path(tokensOf(toks[:len(toks)-1])); !ok {
		return fmt.Errorf("the verify answer accepts %v, which is no branch of the tree the head sent", tokensOf(toks[:len(toks)-1]))
	}
	return nil
}

// keepBranch moves the cache slots src of the session's last tree hop to
// dst, dst+1, ... (the accepted branch; wire/tree.go). It applies once: a
// retried hop (the tree already compacted) and a hop after no tree leave
// the cache as it is, so a hop stays idempotent.
func (s *session) keepBranch(dst int, src []int32) *apiError {
	t := s.tree
	s.tree.rows = 0
	if t.rows == 0 || dst != t.pos+1 || len(src) == 0 {
		return nil
	}
	for _, v := range src {
		if int(v) < dst || int(v) >= t.pos+t.rows {
			return &apiError{Status: http.StatusBadRequest, Type: "invalid_keep",
				Message: fmt.Sprintf("keep slot %d is not a row of the tree at %d-%d", v, t.pos, t.pos+t.rows-1)}
		}
	}
	c, ok := s.kv.(native.Compacter)
	if !ok {
		return &apiError{Status: http.StatusBadRequest, Type: "invalid_keep", Message: "this node's backend keeps no tree branches"}
	}
	if err := c.Compact(dst, src); err != nil {
		return backendError(err)
	}
	for j, v := range src {
		if int(v) < len(s.history) {
			s.history[dst+j] = s.history[v]
		}
	}
	s.history = s.history[:min(len(s.history), dst+len(src))]
	s.ends.lost(dst)
	return nil
}

// verifyPass verifies a verify pass's rows: a chain (verifyRows) or, with
// parents, a tree (the longest branch the node's sampler agrees with).
func verifyPass(logits []float32, vocab int, tokens, parents []int32, p sample.Params, s *session, pos, step int) []wire.TokenReply {
	if parents == nil {
		return verifyRows(logits, vocab, tokens, p, s, pos, step)
	}
	tr := &speculate.Tree{Tokens: tokens, Parents: parents}
	_, draws := speculate.AcceptTree(tr, func(row, depth int) sample.Draw {
		var hist []int32
		if p.NeedsHistory() {
			hist = append(slices.Clip(s.history[:min(pos, len(s.history))]), branchTokens(tr, row)...)
		}
		id, lp := sample.Sample(logits[row*vocab:(row+1)*vocab], p, hist, step+depth)
		return sample.Draw{ID: id, Logprob: lp}
	})
	out := make([]wire.TokenReply, len(draws))
	for i, d := range draws {
		out[i] = wire.TokenReply{Token: d.ID, Logprob: d.Logprob}
	}
	return out
}

// branchTokens is the tokens from the root to row, inclusive.
func branchTokens(tr *speculate.Tree, row int) []int32 {
	var out []int32
	for q := row; q >= 0; q = int(tr.Parents[q]) {
		out = append(out, tr.Tokens[q])
	}
	slices.Reverse(out)
	return out
}

// newTreeState is tree drafting for one generation, nil when the head's
// backend runs no token trees (a CUDA library without them): it then
// drafts chains.
func (s *Server) newTreeState() *treeState {
	if ts, ok := s.stack.(native.TreeStack); !ok || !ts.HasTrees() {
		s.Logger.Warn("this backend runs no token trees; speculating with chain drafts")
		return nil
	}
	return &treeState{drafter: speculate.NGramTree{Branches: DefaultTreeBranches}}
}

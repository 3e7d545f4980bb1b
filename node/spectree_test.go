package node

import (
	"slices"
	"testing"

	"meshgpu/speculate"
	"meshgpu/wire"
)

// compactSession records the compactions a session is asked for.
type compactSession struct {
	fakeSession
	moves [][]int32
}

func (s *compactSession) Compact(dst int, src []int32) error {
	s.moves = append(s.moves, append([]int32{int32(dst)}, src...))
	s.n = dst + len(src)
	return nil
}

// A peer sending Keep can move only the slots of the tree the session ran
// last, only right after it and only once: slots outside the tree are
// refused, a Keep with no tree before it (or a retried hop's) moves
// nothing, so a hop stays idempotent and a sender cannot shuffle the
// prompt's cache.
func TestKeepMovesOnlyTheLastTreesSlots(t *testing.T) {
	kv := &compactSession{fakeSession: fakeSession{n: 20}}
	s := &session{kv: kv, history: make([]int32, 20)}
	for i := range s.history {
		s.history[i] = int32(100 + i)
	}
	// no tree: nothing moves
	if ae := s.keepBranch(11, []int32{13}); ae != nil || len(kv.moves) != 0 {
		t.Fatalf("keep without a tree: %v, moves %v", ae, kv.moves)
	}
	s.tree.pos, s.tree.rows = 10, 6 // a tree hop at 10 of 6 rows: slots 10-15
	for _, src := range [][]int32{{16}, {9}, {10}} {
		s.tree.pos, s.tree.rows = 10, 6
		if ae := s.keepBranch(11, src); ae == nil || ae.Type != "invalid_keep" {
			t.Errorf("keep %v outside the tree's drafts: %v, want invalid_keep", src, ae)
		}
	}
	s.tree.pos, s.tree.rows = 10, 6
	if ae := s.keepBranch(11, []int32{13, 15}); ae != nil {
		t.Fatal(ae)
	}
	if !slices.Equal(kv.moves[len(kv.moves)-1], []int32{11, 13, 15}) || !slices.Equal(s.history[11:], []int32{113, 115}) {
		t.Errorf("moves %v, history %v", kv.moves, s.history[10:])
	}
	// the retry of that hop: already kept
	if ae := s.keepBranch(11, []int32{13, 15}); ae != nil || len(kv.moves) != 1 {
		t.Errorf("a retried keep: %v, moves %v", ae, kv.moves)
	}
}

// The head refuses a tail's answer that is not a branch of the tree it
// sent: accepting it would leave the route's caches holding other text.
func TestHeadRefusesAnAnswerOffTheTree(t *testing.T) {
	tr := speculate.NewTree(1)
	tr.Add([]int32{2, 3}, 10)
	tr.Add([]int32{4}, 10)
	ok := []wire.TokenReply{{Token: 4}, {Token: 9}}
	if err := checkTreeAnswer(tr, ok); err != nil {
		t.Errorf("a branch refused: %v", err)
	}
	for _, bad := range [][]wire.TokenReply{{{Token: 3}, {Token: 9}}, {{Token: 2}, {Token: 4}, {Token: 9}}} {
		if err := checkTreeAnswer(tr, bad); err == nil {
			t.Errorf("answer %v off the tree accepted", bad)
		}
	}
}

package wire

import (
	"errors"
	"fmt"
)

// Branching drafts (docs/protocol.md, "Verify hops"): a verify hop may
// carry a token tree instead of a chain. Row 0 is the last accepted token
// (the root); Parents[i] is row i's parent row (< i). Every node runs row i
// at position Position + depth(i), attending to the cached positions and
// to its ancestors only, and stores its K/V in cache slot Position + i. The
// node with the last layer samples at each row it reaches from the root
// and answers, as for a chain, the accepted drafts (one branch, root
// excluded) and the sampled token.
//
// Keeping the accepted branch: the session's next hop carries Keep, the
// cache slots of that branch's drafts (Position - len(Keep) + j for
// j = 0.. are where they go, in order). Every node moves them before it
// runs the hop, so each node's cache holds the branch at consecutive
// positions, exactly as if the branch had run alone (its keys were
// rotated at position + depth, which is where they land).

// CheckTree validates a verify hop's tree for rows rows: one root at row 0
// and every other row's parent before it.
func CheckTree(parents []int32, rows int) error {
	if len(parents) != rows || rows < 1 || rows > MaxVerifyRows {
		return fmt.Errorf("wire: a tree of %d parents for %d rows (1-%d)", len(parents), rows, MaxVerifyRows)
	}
	if parents[0] != -1 {
		return errors.New("wire: a tree's row 0 is its root (parent -1)")
	}
	for i, p := range parents[1:] {
		if p < 0 || int(p) > i {
			return fmt.Errorf("wire: tree row %d has parent %d (want 0-%d)", i+1, p, i)
		}
	}
	return nil
}

// CheckKeep validates a hop's Keep at position pos: increasing slots, each
// at or after where it goes (pos - len(keep) + j) and within the previous
// verify hop's rows.
func CheckKeep(keep []int32, pos int) error {
	n := len(keep)
	if n > MaxVerifyRows-1 || n > pos {
		return fmt.Errorf("wire: keep of %d slots at position %d (at most %d, and no more than the position)", n, pos, MaxVerifyRows-1)
	}
	dst := pos - n
	for j, s := range keep {
		off := int(s) - dst
		if off < j || off >= j+MaxVerifyRows || (j > 0 && s <= keep[j-1]) {
			return fmt.Errorf("wire: keep slot %d for position %d: want increasing slots at or after their positions, within %d", s, dst+j, MaxVerifyRows)
		}
	}
	return nil
}

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

// Hop head flags of trees.
const (
	// HopTree: a verify hop's rows are a tree; its parents follow the
	// tokens, one byte per row: the parent row + 1 (0 for the root).
	HopTree uint8 = 0x08
	// HopKeep: before this hop, move cache slots; count u8, then count
	// bytes, each slot's offset from Position - count.
	HopKeep uint8 = 0x10
)

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

func appendTree(dst []byte, parents []int32) []byte {
	for _, p := range parents {
		dst = append(dst, byte(p+1))
	}
	return dst
}

func appendKeep(dst []byte, keep []int32, pos int) []byte {
	base := int32(pos - len(keep))
	dst = append(dst, byte(len(keep)))
	for _, s := range keep {
		dst = append(dst, byte(s-base))
	}
	return dst
}

func (r *reader) tree(rows int) ([]int32, error) {
	b := r.take(rows)
	if r.err != nil {
		return nil, errors.New("wire: truncated hop tree")
	}
	parents := make([]int32, rows)
	for i, v := range b {
		parents[i] = int32(v) - 1
	}
	return parents, CheckTree(parents, rows)
}

func (r *reader) keep(pos int) ([]int32, error) {
	n := int(r.u8())
	b := r.take(n)
	if r.err != nil {
		return nil, errors.New("wire: truncated hop keep")
	}
	if n == 0 || n > pos {
		return nil, fmt.Errorf("wire: keep of %d slots at position %d", n, pos)
	}
	keep := make([]int32, n)
	for j, v := range b {
		keep[j] = int32(pos-n) + int32(v)
	}
	return keep, CheckKeep(keep, pos)
}

// Package speculate proposes drafts for speculative decoding on the head
// of a mesh: prompt lookup (NGram), a draft model with the same vocabulary
// (Model), and the draft length that adapts to how often drafts are
// accepted (Length). Verification is the last node's (sample.Verify); the
// protocol is wire's (speculate.go).
package speculate

import (
	"context"
	"slices"
)

// Drafter proposes up to k tokens to follow history (the prompt and the
// accepted output so far, ending with the last accepted token). It may
// propose fewer, or none.
type Drafter interface {
	Propose(ctx context.Context, history []int32, k int) ([]int32, error)
	// Close frees what the drafter holds for its generation.
	Close()
}

// NGram is prompt-lookup decoding: it finds the most recent earlier
// occurrence of the longest suffix of history (MaxN tokens down to MinN)
// and proposes the k tokens that followed it, repeating them with the
// match's period where they run into the end of history. It needs no
// model: code and chat answers repeat their prompt's identifiers, lines
// and phrases.
type NGram struct {
	MaxN, MinN int // suffix lengths tried, longest first; defaults 4 and 1
}

// Propose implements Drafter.
func (g NGram) Propose(_ context.Context, history []int32, k int) ([]int32, error) {
	maxN, minN := g.MaxN, g.MinN
	if maxN <= 0 {
		maxN = 4
	}
	if minN <= 0 {
		minN = 1
	}
	h := len(history)
	if k <= 0 {
		return nil, nil
	}
	for n := min(maxN, h-1); n >= minN; n-- {
		suffix := history[h-n:]
		// the most recent match that ends before the suffix itself
		for start := h - n - 1; start >= 0; start-- {
			if !slices.Equal(history[start:start+n], suffix) {
				continue
			}
			return continuation(history, start+n, k), nil
		}
	}
	return nil, nil
}

// Close implements Drafter.
func (NGram) Close() {}

// Length is the draft length of one generation, adapted to the measured
// acceptance: it doubles after a fully accepted draft, becomes one more
// than the accepted count after a partial one and halves after a draft
// with nothing accepted, down to one draft; after Misses passes in a row
// of one rejected draft it drops to 0 and the generation decodes plainly,
// probing with a one-token draft after 1, 2, 4, ... up to 64 plain passes.
// So a generation whose drafts keep failing runs almost only plain passes,
// and one whose drafts fail now and then keeps drafting.
type Length struct {
	Max     int // at most this many drafts per pass
	Misses  int // rejected one-token drafts in a row before plain decoding; default 8
	k       int
	miss    int
	wait    int // plain passes left before the next probe
	backoff int
}

// NewLength starts at min(start, most) drafts per pass, at most most.
func NewLength(start, most int) *Length {
	return &Length{Max: most, k: min(max(start, 0), most), backoff: 1}
}

// Next is the number of drafts to propose in this pass (0: a plain pass).
func (l *Length) Next() int {
	if l.Max <= 0 {
		return 0
	}
	if l.k > 0 {
		return l.k
	}
	if l.wait > 0 {
		l.wait--
		return 0
	}
	return 1 // a probe
}

// Update records a pass that proposed drafts tokens, accepted of them.
func (l *Length) Update(drafts, accepted int) {
	if drafts <= 0 {
		return
	}
	misses := l.Misses
	if misses <= 0 {
		misses = 8
	}
	probe := l.k == 0
	if accepted > 0 {
		l.miss, l.backoff = 0, 1
	}
	switch {
	case accepted == drafts:
		l.k = min(max(2*drafts, 1), l.Max)
	case accepted > 0:
		l.k = min(accepted+1, l.Max)
	case probe:
		l.backoff = min(2*l.backoff, 64)
		l.wait = l.backoff
	case l.k > 1:
		l.k /= 2
	default:
		if l.miss++; l.miss >= misses {
			l.k, l.miss = 0, 0
			l.wait = l.backoff
		}
	}
}

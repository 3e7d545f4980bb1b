package deadline

import (
	"testing"
	"time"
)

// TestExtendMovesOncePerEighth: frames in quick succession move the
// deadline once; once an eighth of the timeout has run down it moves
// again, to a full timeout from then; Set always sets.
func TestExtendMovesOncePerEighth(t *testing.T) {
	var sets []time.Time
	set := func(t time.Time) error { sets = append(sets, t); return nil }
	var l Lazy
	const timeout = 80 * time.Millisecond
	for range 100 {
		l.Extend(set, timeout)
	}
	if len(sets) != 1 {
		t.Fatalf("100 quick extends set the deadline %d times, want 1", len(sets))
	}
	if left := time.Until(sets[0]); left <= timeout-timeout/8 || left > timeout {
		t.Fatalf("deadline %v ahead, want about %v", left, timeout)
	}
	time.Sleep(timeout/8 + 5*time.Millisecond)
	l.Extend(set, timeout)
	if len(sets) != 2 || time.Until(sets[1]) <= timeout-timeout/8 {
		t.Fatalf("after an eighth ran down: %d sets (want 2), last %v ahead", len(sets), time.Until(sets[len(sets)-1]))
	}
	l.Set(set, time.Time{})
	l.Extend(set, timeout)
	if len(sets) != 4 || !sets[2].IsZero() {
		t.Fatalf("Set then Extend: %d sets, want 4 with the third cleared", len(sets))
	}
}

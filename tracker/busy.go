package tracker

import (
	"sync"
	"time"

	"meshgpu/internal/boundmap"
)

// busyBackoff is the tracker's memory, across requests, of nodes that
// answer back-pressure (429, 503 busy) without making progress: each such
// answer doubles how long the node is avoided (from defaultBusyRetry up to
// Config.BusyBackoffMax), and a generation that finishes through a node
// resets it. Each attempt costs a route ticket, so a node that takes
// tickets and answers 429 forever (docs/security.md, "Tickets bound what
// they open") is sent fewer and fewer, not one per client every 200 ms;
// an honest busy node frees slots as it finishes and is back at once.
// The shared one holds only heads (the nodes the tracker gave tickets to);
// each generation keeps its own of the hops its heads named busy, whose
// names are the heads' word (generation.avoidUntil).
type busyBackoff struct {
	mu  sync.Mutex
	m   boundmap.Map[string, *busyState]
	max time.Duration
}

type busyState struct {
	until time.Time
	step  time.Duration
}

// maxBusyEntries bounds the map; above it, a state long expired goes.
const maxBusyEntries = 4096

func newBusyBackoff(max time.Duration) *busyBackoff {
	return &busyBackoff{m: boundmap.Map[string, *busyState]{Max: maxBusyEntries}, max: max}
}

// busy records a busy answer of peer (with its Retry-After, 0 if none) at
// now and returns until when the peer is to be avoided.
func (b *busyBackoff) busy(peer string, retryAfter time.Duration, now time.Time) time.Time {
	b.mu.Lock()
	defer b.mu.Unlock()
	st, _ := b.m.Get(peer)
	if st == nil {
		st = &busyState{}
		b.m.Evictable = func(_ string, s *busyState) bool { return now.Sub(s.until) > b.max }
		b.m.Put(peer, st) // refused when none is long expired: this answer still counts, unremembered
	}
	st.step = min(max(2*st.step, defaultBusyRetry), b.max)
	wait := max(st.step, min(retryAfter, maxBusyRetry))
	if u := now.Add(wait); u.After(st.until) {
		st.until = u
	}
	return st.until
}

// until is when peer's backoff ends (zero: none).
func (b *busyBackoff) until(peer string) time.Time {
	b.mu.Lock()
	defer b.mu.Unlock()
	if st, _ := b.m.Get(peer); st != nil {
		return st.until
	}
	return time.Time{}
}

// progress forgets the backoff of peers that just served a generation.
func (b *busyBackoff) progress(peers ...string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, p := range peers {
		b.m.Delete(p)
	}
}

// Package latency is the one definition of the latency percentiles meshgpu
// reports (a node's /stats and tracker heartbeat, the bench tables):
// nearest rank, over a window of the most recent samples.
package latency

import (
	"cmp"
	"math"
	"slices"
	"sync"
	"time"
)

// Percentile is the q-quantile (0 < q <= 1) of sorted samples by nearest
// rank: the smallest sample with at least q·n samples at or below it,
// sorted[ceil(q·n)-1]. The zero value when there are no samples.
func Percentile[T cmp.Ordered](sorted []T, q float64) T {
	var zero T
	n := len(sorted)
	if n == 0 {
		return zero
	}
	// The epsilon keeps q·n exact for whole ranks (0.99·100 is 98.99999...).
	r := int(math.Ceil(q*float64(n) - 1e-9))
	return sorted[min(max(r-1, 0), n-1)]
}

// Window keeps the last N latency samples. It is safe for concurrent use.
type Window struct {
	mu   sync.Mutex
	buf  []time.Duration
	next int
	full bool
}

// NewWindow returns a window of the last n samples (n > 0).
func NewWindow(n int) *Window { return &Window{buf: make([]time.Duration, n)} }

// Add records one sample, dropping the oldest once the window is full.
func (w *Window) Add(d time.Duration) {
	w.mu.Lock()
	w.buf[w.next] = d
	w.next++
	if w.next == len(w.buf) {
		w.next, w.full = 0, true
	}
	w.mu.Unlock()
}

// Percentiles returns the p50 and p99 of the samples held (zero without
// samples).
func (w *Window) Percentiles() (p50, p99 time.Duration) {
	w.mu.Lock()
	n := w.next
	if w.full {
		n = len(w.buf)
	}
	s := slices.Clone(w.buf[:n])
	w.mu.Unlock()
	slices.Sort(s)
	return Percentile(s, 0.50), Percentile(s, 0.99)
}

// Millis is d in milliseconds, as /stats and heartbeats carry it.
func Millis(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

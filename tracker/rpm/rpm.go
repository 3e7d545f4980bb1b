// Package rpm keeps a node's rolling request statistics for its tracker
// heartbeat: requests per minute over the last 1 and 5 minutes, tokens per
// second, and hop latency percentiles.
//
// Counts live in one bucket per second over the last 300 seconds, so a
// figure is exact for whole seconds: Rate1m counts the requests recorded in
// the 60 one-second buckets ending with the current second.
package rpm

import (
	"sort"
	"sync"
	"time"
)

const (
	windowSeconds = 300 // five minutes of one-second buckets
	latencySlots  = 1024
)

// Stats is safe for concurrent use. The zero value is not usable; call New.
type Stats struct {
	clock func() time.Time

	mu       sync.Mutex
	sec      [windowSeconds]int64 // the unix second each bucket currently holds
	requests [windowSeconds]int64
	tokens   [windowSeconds]int64
	lat      [latencySlots]time.Duration
	latN     int // samples written so far (ring index = latN % latencySlots)

	totals     bool  // RecordTotals has been called
	lastReq    int64 // the totals of the previous RecordTotals call
	lastTokens int64
}

// New returns empty stats reading time from clock (time.Now when nil).
func New(clock func() time.Time) *Stats {
	if clock == nil {
		clock = time.Now
	}
	s := &Stats{clock: clock}
	for i := range s.sec {
		s.sec[i] = -1
	}
	return s
}

// bucket returns the index for unix second now, clearing it when it still
// holds an older second. Caller holds mu.
func (s *Stats) bucket(now int64) int {
	i := int(((now % windowSeconds) + windowSeconds) % windowSeconds)
	if s.sec[i] != now {
		s.sec[i] = now
		s.requests[i] = 0
		s.tokens[i] = 0
	}
	return i
}

// Record counts n requests now.
func (s *Stats) Record(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.requests[s.bucket(s.clock().Unix())] += int64(n)
}

// RecordTokens counts n generated (or processed) tokens now.
func (s *Stats) RecordTokens(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.tokens[s.bucket(s.clock().Unix())] += int64(n)
}

// RecordTotals feeds cumulative counters (requests and tokens served since
// start, e.g. a node's /stats): the increase since the previous call is
// recorded now. The first call only sets the baseline; a counter that went
// backwards (restart) restarts the baseline.
func (s *Stats) RecordTotals(requests, tokens int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.totals && requests >= s.lastReq && tokens >= s.lastTokens {
		i := s.bucket(s.clock().Unix())
		s.requests[i] += requests - s.lastReq
		s.tokens[i] += tokens - s.lastTokens
	}
	s.totals, s.lastReq, s.lastTokens = true, requests, tokens
}

// ObserveLatency adds one hop latency sample; the percentiles use the last
// 1024 samples.
func (s *Stats) ObserveLatency(d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lat[s.latN%latencySlots] = d
	s.latN++
}

// sum adds the buckets of the last n seconds ending with the current one.
func (s *Stats) sum(counts *[windowSeconds]int64, n int64) int64 {
	now := s.clock().Unix()
	var total int64
	for i := range s.sec {
		if sec := s.sec[i]; sec > now-n && sec <= now {
			total += counts[i]
		}
	}
	return total
}

// Rate1m is requests per minute over the last 60 seconds.
func (s *Stats) Rate1m() float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return float64(s.sum(&s.requests, 60))
}

// Rate5m is requests per minute over the last 300 seconds.
func (s *Stats) Rate5m() float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return float64(s.sum(&s.requests, 300)) / 5
}

// TokensPerSecond is tokens per second over the last 60 seconds.
func (s *Stats) TokensPerSecond() float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return float64(s.sum(&s.tokens, 60)) / 60
}

// Latency returns the p50 and p99 of the retained samples (nearest rank),
// zero when there are none.
func (s *Stats) Latency() (p50, p99 time.Duration) {
	s.mu.Lock()
	n := min(s.latN, latencySlots)
	samples := make([]time.Duration, n)
	copy(samples, s.lat[:n])
	s.mu.Unlock()
	if n == 0 {
		return 0, 0
	}
	sort.Slice(samples, func(i, j int) bool { return samples[i] < samples[j] })
	return samples[nearestRank(n, 50)], samples[nearestRank(n, 99)]
}

// nearestRank is the 0-based index of the p-th percentile of n sorted
// samples: ceil(p/100 * n) - 1.
func nearestRank(n, p int) int {
	r := (p*n + 99) / 100
	return max(r-1, 0)
}

// Snapshot is the figures a heartbeat carries.
type Snapshot struct {
	RPM1         float64 `json:"rpm1"`
	RPM5         float64 `json:"rpm5"`
	TokensPerSec float64 `json:"tokens_per_sec"`
	HopP50Ms     float64 `json:"hop_p50_ms"`
	HopP99Ms     float64 `json:"hop_p99_ms"`
}

// Snapshot reads all figures at once.
func (s *Stats) Snapshot() Snapshot {
	p50, p99 := s.Latency()
	return Snapshot{
		RPM1:         s.Rate1m(),
		RPM5:         s.Rate5m(),
		TokensPerSec: s.TokensPerSecond(),
		HopP50Ms:     float64(p50) / float64(time.Millisecond),
		HopP99Ms:     float64(p99) / float64(time.Millisecond),
	}
}

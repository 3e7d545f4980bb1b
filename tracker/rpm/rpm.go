// Package rpm keeps a node's rolling request statistics for its tracker
// heartbeat: requests per minute over the last 1 and 5 minutes and tokens
// per second, from the node's cumulative counters. (The heartbeat's hop
// latency percentiles are the node's own /stats figures, internal/latency.)
//
// Counts live in one bucket per second over the last 300 seconds, so a
// figure is exact for whole seconds: Rate1m counts the requests recorded in
// the 60 one-second buckets ending with the current second.
package rpm

import (
	"sync"
	"time"
)

const windowSeconds = 300 // five minutes of one-second buckets

// Stats is safe for concurrent use. The zero value is not usable; call New.
type Stats struct {
	clock func() time.Time

	mu       sync.Mutex
	sec      [windowSeconds]int64 // the unix second each bucket currently holds
	requests [windowSeconds]int64
	tokens   [windowSeconds]int64

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

// Snapshot is the rate figures of a heartbeat (tracker.NodeStats carries
// them on the wire).
type Snapshot struct {
	RPM1, RPM5   float64 // requests per minute over the last 1 and 5 minutes
	TokensPerSec float64 // over the last minute
}

// Snapshot reads all figures at once.
func (s *Stats) Snapshot() Snapshot {
	return Snapshot{RPM1: s.Rate1m(), RPM5: s.Rate5m(), TokensPerSec: s.TokensPerSecond()}
}

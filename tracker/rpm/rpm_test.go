package rpm

import (
	"testing"
	"time"
)

// fakeClock is a settable clock for driving the windows.
type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time      { return c.t }
func (c *fakeClock) set(sec float64)     { c.t = base.Add(time.Duration(sec * float64(time.Second))) }
func (c *fakeClock) add(d time.Duration) { c.t = c.t.Add(d) }

var base = time.Unix(1_700_000_000, 0)

// counters stands in for a node's cumulative counters, fed to Stats the
// way a heartbeat feeds them: the baseline first, then totals.
type counters struct {
	s                *Stats
	requests, tokens int64
}

func newCounters(s *Stats) *counters {
	s.RecordTotals(0, 0)
	return &counters{s: s}
}

func (c *counters) serve(requests, tokens int64) {
	c.requests += requests
	c.tokens += tokens
	c.s.RecordTotals(c.requests, c.tokens)
}

func TestRatesFollowAKnownPattern(t *testing.T) {
	c := &fakeClock{}
	s := New(c.now)
	c.set(-1)
	n := newCounters(s)
	// One request per second at seconds 0..239 (240 requests in 4 minutes).
	for sec := 0; sec < 240; sec++ {
		c.set(float64(sec) + 0.25)
		n.serve(1, 0)
	}
	check := func(at float64, want1, want5 float64) {
		t.Helper()
		c.set(at)
		if got := s.Rate1m(); got != want1 {
			t.Errorf("t=%v: Rate1m = %v, want %v", at, got, want1)
		}
		if got := s.Rate5m(); got != want5 {
			t.Errorf("t=%v: Rate5m = %v, want %v", at, got, want5)
		}
	}
	// At second 239 the last minute holds seconds 180..239: 60 requests;
	// the last five minutes hold all 240: 48 per minute.
	check(239.9, 60, 48)
	// At second 299 the last minute (240..299) is empty; five minutes
	// (0..299) still hold all 240.
	check(299.5, 0, 48)
	// At second 360 the five-minute window is 61..360: 179 requests.
	check(360, 0, 35.8)
	// At second 540 everything has rolled out.
	check(540, 0, 0)
}

func TestBurstLeavesTheMinuteWindowAfterSixtySeconds(t *testing.T) {
	c := &fakeClock{}
	s := New(c.now)
	n := newCounters(s)
	c.set(10.5)
	n.serve(30, 600)
	c.set(69.99) // second 69: window 10..69 still holds second 10
	if got := s.Rate1m(); got != 30 {
		t.Fatalf("Rate1m at 69.99 = %v, want 30", got)
	}
	if got := s.TokensPerSecond(); got != 10 {
		t.Fatalf("TokensPerSecond = %v, want 600/60 = 10", got)
	}
	c.set(70) // window 11..70
	if got := s.Rate1m(); got != 0 {
		t.Fatalf("Rate1m at 70 = %v, want 0", got)
	}
	if got := s.Rate5m(); got != 6 {
		t.Fatalf("Rate5m at 70 = %v, want 30/5 = 6", got)
	}
	// A bucket reused after the ring wraps must not keep its old count:
	// second 310 shares second 10's slot.
	c.set(310)
	n.serve(1, 0)
	if got := s.Rate5m(); got != 0.2 {
		t.Fatalf("Rate5m after wrap = %v, want 1/5", got)
	}
}

func TestRecordTotalsCountsIncreases(t *testing.T) {
	c := &fakeClock{}
	s := New(c.now)
	c.set(0)
	s.RecordTotals(1000, 50000) // baseline: earlier traffic is not counted
	// Heartbeats every 5 s with 10 more requests and 200 more tokens.
	for i := 1; i <= 24; i++ {
		c.set(float64(5 * i))
		s.RecordTotals(1000+int64(10*i), 50000+int64(200*i))
	}
	// At 120 s: the last minute holds the deltas at 65..120 s (12 x 10).
	if got := s.Rate1m(); got != 120 {
		t.Fatalf("Rate1m = %v, want 120", got)
	}
	if got := s.Rate5m(); got != 48 {
		t.Fatalf("Rate5m = %v, want 240/5", got)
	}
	if got := s.TokensPerSecond(); got != 40 {
		t.Fatalf("TokensPerSecond = %v, want 12 x 200 / 60", got)
	}
	c.set(125)
	s.RecordTotals(5, 5) // the counters restarted: no negative counts
	if got := s.Rate1m(); got != 110 {
		t.Fatalf("Rate1m after a counter reset = %v, want 110 (65 s slot rolled out, nothing added)", got)
	}
}

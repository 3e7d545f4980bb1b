package latency

import (
	"slices"
	"testing"
	"time"
)

// Nearest rank against the definition written out by hand: the smallest
// sample with at least q·n samples at or below it.
func TestPercentileIsNearestRank(t *testing.T) {
	if got := Percentile([]float64(nil), 0.5); got != 0 {
		t.Fatalf("no samples: %v, want 0", got)
	}
	for n := 1; n <= 300; n++ {
		s := make([]int, n)
		for i := range s {
			s[i] = 10 * (i + 1)
		}
		for _, q := range []float64{0.01, 0.25, 0.5, 0.9, 0.99, 1} {
			want := -1
			for _, v := range s { // first v with count(<= v) >= q·n
				if float64(v/10) >= q*float64(n)-1e-9 {
					want = v
					break
				}
			}
			if got := Percentile(s, q); got != want {
				t.Fatalf("n=%d q=%v: %d, want %d", n, q, got, want)
			}
		}
	}
	// 1..100: p50 is 50, p99 is 99 (a floor-of-(n-1) index would give 50 and 99 too,
	// but at n = 10 it gives p99 = 9, not 10).
	hundred := make([]int, 100)
	for i := range hundred {
		hundred[i] = i + 1
	}
	if p50, p99 := Percentile(hundred, 0.5), Percentile(hundred, 0.99); p50 != 50 || p99 != 99 {
		t.Fatalf("1..100: p50=%d p99=%d", p50, p99)
	}
	if p99 := Percentile(hundred[:10], 0.99); p99 != 10 {
		t.Fatalf("1..10: p99=%d, want 10", p99)
	}
}

func TestWindowKeepsTheLastSamples(t *testing.T) {
	w := NewWindow(1024)
	if p50, p99 := w.Percentiles(); p50 != 0 || p99 != 0 {
		t.Fatalf("empty: %v %v", p50, p99)
	}
	// 100 samples 1..100 ms in shuffled order.
	for i := 0; i < 100; i++ {
		w.Add(time.Duration((i*37)%100+1) * time.Millisecond)
	}
	if p50, p99 := w.Percentiles(); p50 != 50*time.Millisecond || p99 != 99*time.Millisecond {
		t.Fatalf("p50=%v p99=%v, want 50ms and 99ms", p50, p99)
	}
	// Only the last 1024 count: the slow samples roll out.
	for i := 0; i < 1000; i++ {
		w.Add(time.Second)
	}
	for i := 0; i < 1024; i++ {
		w.Add(time.Millisecond)
	}
	if _, p99 := w.Percentiles(); p99 != time.Millisecond {
		t.Fatalf("p99 = %v after the slow samples rolled out, want 1ms", p99)
	}
	if !slices.Equal([]float64{Millis(1500 * time.Microsecond)}, []float64{1.5}) {
		t.Fatal("Millis(1.5ms) != 1.5")
	}
}

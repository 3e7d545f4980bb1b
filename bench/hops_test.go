package bench

import (
	"context"
	"path/filepath"
	"testing"
)

func TestHopsSuite(t *testing.T) {
	before := goroutines()
	rep, err := Hops(context.Background(), HopsConfig{N: 30, Warmup: 5})
	if err != nil {
		t.Fatal(err)
	}
	for _, kib := range []float64{4, 8} {
		tcp, ok := rep.Find(SeriesRawTCP, kib)
		if !ok {
			t.Fatalf("no raw-tcp row at %v KiB", kib)
		}
		for _, s := range HopSeries {
			row, ok := rep.Find(s, kib)
			if !ok || row.N != 30 {
				t.Fatalf("series %s at %v KiB: %+v", s, kib, row)
			}
			// Every hop carries at least the payload there and back.
			if w := row.Extra["wire_B"]; w < 2*kib*1024 {
				t.Errorf("%s %v KiB: %v bytes on the wire per hop, less than the payload both ways", s, kib, w)
			}
			if s != SeriesRawTCP && row.P50 <= tcp.P50/2 {
				t.Errorf("%s p50 %.1f µs is far below raw TCP's %.1f µs: the timing is broken", s, row.P50, tcp.P50)
			}
		}
		// Raw TCP sends exactly a 4-byte length and the payload each way.
		if w := tcp.Extra["wire_B"]; w != 2*(4+kib*1024) {
			t.Errorf("raw-tcp wire bytes %v, want %v", w, 2*(4+kib*1024))
		}
	}
	path := filepath.Join(t.TempDir(), "hops.svg")
	if err := rep.Plot(path); err != nil {
		t.Fatal(err)
	}
	CheckSVGSeries(t, path, HopSeries...)
	checkGoroutines(t, before)
}

package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
)

func TestSummarizePercentiles(t *testing.T) {
	s := make([]float64, 100)
	for i := range s {
		s[i] = float64(100 - i) // 100..1, unsorted
	}
	p50, p99, mean, n := Summarize(s)
	if p50 != 50 || p99 != 99 || mean != 50.5 || n != 100 {
		t.Fatalf("got p50=%v p99=%v mean=%v n=%d", p50, p99, mean, n)
	}
}

func TestTCPEchoBaselineAndPlot(t *testing.T) {
	e, err := StartTCPEcho()
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	r := NewReport("hops", "payload KiB", "µs", "raw loopback TCP round trip")
	for _, kib := range []int{4, 8} {
		s, err := TCPRoundTrips(context.Background(), e.Addr(), kib<<10, 50)
		if err != nil {
			t.Fatal(err)
		}
		r.Add("raw-tcp", float64(kib), s, nil)
		r.Add("other", float64(kib), s, map[string]float64{"bytes": float64(kib << 10)})
	}
	var tbl bytes.Buffer
	if err := r.WriteTable(&tbl); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(tbl.String(), "raw-tcp") {
		t.Fatalf("table lacks the series:\n%s", tbl.String())
	}
	var js bytes.Buffer
	if err := r.WriteJSON(&js); err != nil {
		t.Fatal(err)
	}
	var back Report
	if err := json.Unmarshal(js.Bytes(), &back); err != nil || len(back.Rows) != 4 {
		t.Fatalf("json round trip: %v, %d rows", err, len(back.Rows))
	}
	path := filepath.Join(t.TempDir(), "x.svg")
	if err := r.Plot(path); err != nil {
		t.Fatal(err)
	}
	CheckSVGSeries(t, path, "raw-tcp", "other")
}

// CheckSVGSeries fails t unless path is an SVG naming every series.
func CheckSVGSeries(t *testing.T, path string, series ...string) {
	t.Helper()
	if err := CheckSVG(path, series...); err != nil {
		t.Fatal(err)
	}
}

func TestCheckSVGRejects(t *testing.T) {
	dir := t.TempDir()
	r := NewReport("hops", "payload KiB", "µs", "x")
	r.Add("direct", 4, []float64{1, 2, 3}, nil)
	svg := filepath.Join(dir, "a.svg")
	if err := r.Plot(svg); err != nil {
		t.Fatal(err)
	}
	if err := CheckSVG(svg, "direct"); err != nil {
		t.Fatal(err)
	}
	if err := CheckSVG(svg, "direct", "relay-tunnel"); err == nil || !strings.Contains(err.Error(), "relay-tunnel") {
		t.Errorf("a chart without relay-tunnel passed: %v", err)
	}
	png := filepath.Join(dir, "a.png")
	if err := r.Plot(png); err != nil {
		t.Fatal(err)
	}
	if err := CheckSVG(png, "direct"); err == nil {
		t.Error("a PNG passed as SVG")
	}
	if err := r.Plot(filepath.Join(dir, "a.gif")); err == nil {
		t.Error("a .gif chart was accepted")
	}
}

func TestPlotLogYWithZeroFallsBackToLinear(t *testing.T) {
	r := NewReport("hops", "payload KiB", "µs", "x")
	r.LogY = true
	r.Add("direct", 4, []float64{0, 0, 0}, nil)
	r.Add("direct", 8, []float64{5}, nil)
	path := filepath.Join(t.TempDir(), "z.svg")
	if err := r.Plot(path); err != nil {
		t.Fatal(err)
	}
	CheckSVGSeries(t, path, "direct")
}

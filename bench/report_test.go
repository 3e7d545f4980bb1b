package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/xml"
	"io"
	"os"
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

// CheckSVGSeries parses path as XML and checks it is an SVG naming every series.
func CheckSVGSeries(t *testing.T, path string, series ...string) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	dec := xml.NewDecoder(bytes.NewReader(data))
	var root string
	var text strings.Builder
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("%s is not valid XML: %v", path, err)
		}
		switch v := tok.(type) {
		case xml.StartElement:
			if root == "" {
				root = v.Name.Local
			}
		case xml.CharData:
			text.Write(v)
		}
	}
	if root != "svg" {
		t.Fatalf("%s: root element %q, want svg", path, root)
	}
	for _, s := range series {
		if !strings.Contains(text.String(), s) {
			t.Errorf("%s: series %q not named in the chart", path, s)
		}
	}
}

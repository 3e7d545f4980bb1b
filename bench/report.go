// Package bench holds meshgpu's latency suites. Each suite measures its own
// baseline in the same run (memory bandwidth, raw loopback TCP, one-node
// decode) and reports rows that print as a table, encode as JSON and plot as
// an SVG or PNG chart.
package bench

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"sort"
	"strings"
	"time"

	"meshgpu/internal/latency"
)

// Row is one measurement: a series (what was measured) at one x value.
type Row struct {
	Series string             `json:"series"`
	X      float64            `json:"x"`
	P50    float64            `json:"p50"`
	P99    float64            `json:"p99"`
	Mean   float64            `json:"mean"`
	N      int                `json:"n"`
	Extra  map[string]float64 `json:"extra,omitempty"`
}

// Report is a suite's result.
type Report struct {
	Suite    string    `json:"suite"`
	Date     time.Time `json:"date"`
	Host     string    `json:"host"`
	XLabel   string    `json:"x_label"`
	Unit     string    `json:"unit"`
	Baseline string    `json:"baseline"`
	Notes    []string  `json:"notes,omitempty"`
	// LogY plots the y axis on a log scale (series or tails that span
	// orders of magnitude).
	LogY bool `json:"-"`
	// PlotExtra, when set, is the Extra column the chart plots instead of
	// p50 (e.g. "tok_s": a speed-up shows as a higher line), labelled
	// PlotLabel.
	PlotExtra string `json:"-"`
	PlotLabel string `json:"-"`
	Rows      []Row  `json:"rows"`
}

// NewReport starts a report stamped with the date and host.
func NewReport(suite, xLabel, unit, baseline string) *Report {
	host, _ := os.Hostname()
	return &Report{
		Suite: suite, Date: time.Now().UTC(), XLabel: xLabel, Unit: unit, Baseline: baseline,
		Host: fmt.Sprintf("%s (%s/%s, %d CPUs)", host, runtime.GOOS, runtime.GOARCH, runtime.NumCPU()),
	}
}

// Add appends a row computed from samples (in the report's unit).
func (r *Report) Add(series string, x float64, samples []float64, extra map[string]float64) Row {
	row := Row{Series: series, X: x, Extra: extra}
	row.P50, row.P99, row.Mean, row.N = Summarize(samples)
	r.Rows = append(r.Rows, row)
	return row
}

// Summarize returns the 50th and 99th percentiles (nearest rank,
// internal/latency), the mean and the count.
func Summarize(samples []float64) (p50, p99, mean float64, n int) {
	if len(samples) == 0 {
		return 0, 0, 0, 0
	}
	s := append([]float64(nil), samples...)
	sort.Float64s(s)
	var sum float64
	for _, v := range s {
		sum += v
	}
	return latency.Percentile(s, 0.50), latency.Percentile(s, 0.99), sum / float64(len(s)), len(s)
}

// Find returns the row of series at x.
func (r *Report) Find(series string, x float64) (Row, bool) {
	for _, row := range r.Rows {
		if row.Series == series && row.X == x {
			return row, true
		}
	}
	return Row{}, false
}

// Series lists the series names in first-seen order.
func (r *Report) Series() []string {
	var names []string
	seen := map[string]bool{}
	for _, row := range r.Rows {
		if !seen[row.Series] {
			seen[row.Series] = true
			names = append(names, row.Series)
		}
	}
	return names
}

// WriteTable prints the report as an aligned text table.
func (r *Report) WriteTable(w io.Writer) error { return r.WriteTableWidth(w, 0) }

// WriteTableWidth writes the table in pieces of at most width columns
// (0: one piece however wide): the first piece holds the series, x and
// the percentiles, each further one the series, x and the next extra
// columns, so every figure stays next to its row's name. Notes are
// wrapped at width too.
func (r *Report) WriteTableWidth(w io.Writer, width int) error {
	bw := &errWriter{w: w}
	fmt.Fprintln(bw, wrapWords(fmt.Sprintf("suite %s  (%s, %s)", r.Suite, r.Host, r.Date.Format("2006-01-02 15:04 MST")), width))
	fmt.Fprintln(bw, wrapWords("baseline: "+r.Baseline, width))
	extraKeys := map[string]bool{}
	for _, row := range r.Rows {
		for k := range row.Extra {
			extraKeys[k] = true
		}
	}
	keys := make([]string, 0, len(extraKeys))
	for k := range extraKeys {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	head := []string{"series", r.XLabel, "p50 " + r.Unit, "p99 " + r.Unit, "mean " + r.Unit, "n"}
	head = append(head, keys...)
	table := [][]string{head}
	for _, row := range r.Rows {
		cells := []string{row.Series, trimFloat(row.X), trimFloat(row.P50), trimFloat(row.P99), trimFloat(row.Mean), fmt.Sprint(row.N)}
		for _, k := range keys {
			if v, ok := row.Extra[k]; ok {
				cells = append(cells, trimFloat(v))
			} else {
				cells = append(cells, "-")
			}
		}
		table = append(table, cells)
	}
	colw := make([]int, len(head))
	for _, cells := range table {
		for i, c := range cells {
			colw[i] = max(colw[i], len(c))
		}
	}
	const gap = 2
	span := func(cols []int) int {
		n := 0
		for _, c := range cols {
			n += colw[c] + gap
		}
		return n
	}
	// Pieces: {series, x, p50, p99, mean, n, extras...}, then {series, x, extras...}.
	var pieces [][]int
	cur := []int{0, 1, 2, 3, 4, 5}
	for c := 6; c < len(head); c++ {
		if width > 0 && span(cur)+colw[c]+gap > width && len(cur) > 2 {
			pieces = append(pieces, cur)
			cur = []int{0, 1}
		}
		cur = append(cur, c)
	}
	pieces = append(pieces, cur)
	for pi, cols := range pieces {
		if pi > 0 {
			fmt.Fprintln(bw)
		}
		for _, cells := range table {
			var line strings.Builder
			for _, c := range cols {
				line.WriteString(strings.Repeat(" ", colw[c]+gap-len(cells[c])))
				line.WriteString(cells[c])
			}
			fmt.Fprintln(bw, line.String())
		}
	}
	for _, n := range r.Notes {
		fmt.Fprintln(bw, wrapWords("note: "+n, width))
	}
	return bw.err
}

// errWriter keeps the first write error.
type errWriter struct {
	w   io.Writer
	err error
}

func (e *errWriter) Write(p []byte) (int, error) {
	if e.err != nil {
		return 0, e.err
	}
	n, err := e.w.Write(p)
	e.err = err
	return n, err
}

// wrapWords wraps s at width (0: not at all), continuation lines indented
// by two spaces.
func wrapWords(s string, width int) string {
	if width <= 0 || len(s) <= width {
		return s
	}
	var b strings.Builder
	col := 0
	for i, word := range strings.Fields(s) {
		if i > 0 {
			if col+1+len(word) > width {
				b.WriteString("\n  ")
				col = 2
			} else {
				b.WriteByte(' ')
				col++
			}
		}
		b.WriteString(word)
		col += len(word)
	}
	return b.String()
}

// WriteJSON writes the report as indented JSON.
func (r *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

func trimFloat(v float64) string {
	switch {
	case v == math.Trunc(v) && math.Abs(v) < 1e15:
		return fmt.Sprintf("%.0f", v)
	case v >= 1000 || v <= -1000:
		return fmt.Sprintf("%.0f", v)
	case v >= 10 || v <= -10:
		return fmt.Sprintf("%.1f", v)
	case v >= 0.1 || v <= -0.1:
		return fmt.Sprintf("%.3f", v)
	}
	return fmt.Sprintf("%.3g", v)
}

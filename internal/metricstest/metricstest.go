// Package metricstest scrapes a server's /metrics in tests, runs promlint
// over it and reads series values.
package metricstest

import (
	"bytes"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Scrape GETs url (a /metrics endpoint), fails the test on any promlint
// problem, and returns the metric families by name.
func Scrape(t testing.TB, hc *http.Client, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := hc.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("GET %s: %d %v", url, resp.StatusCode, err)
	}
	problems, err := promlint.New(bytes.NewReader(b)).Lint()
	if err != nil {
		t.Fatalf("promlint %s: %v", url, err)
	}
	for _, p := range problems {
		t.Errorf("promlint %s: %s: %s", url, p.Metric, p.Text)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(b))
	if err != nil {
		t.Fatalf("parse %s: %v", url, err)
	}
	return fams
}

// Value is the sum over the series of family name whose labels include
// every label of match ("k=v"); histograms give their sample count. ok is
// false when the family is absent.
func Value(fams map[string]*dto.MetricFamily, name string, match ...string) (v float64, ok bool) {
	f := fams[name]
	if f == nil {
		return 0, false
	}
	for _, m := range f.Metric {
		if !hasLabels(m, match) {
			continue
		}
		switch {
		case m.Counter != nil:
			v += m.Counter.GetValue()
		case m.Gauge != nil:
			v += m.Gauge.GetValue()
		case m.Histogram != nil:
			v += float64(m.Histogram.GetSampleCount())
		case m.Untyped != nil:
			v += m.Untyped.GetValue()
		}
	}
	return v, true
}

func hasLabels(m *dto.Metric, match []string) bool {
	for _, kv := range match {
		k, want, _ := strings.Cut(kv, "=")
		found := false
		for _, l := range m.Label {
			if l.GetName() == k && l.GetValue() == want {
				found = true
			}
		}
		if !found {
			return false
		}
	}
	return true
}

package main

import (
	"bytes"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"
)

// A load reports 0 first (engine.Options.Progress), so the bar starts
// empty and its rate counts from the start of the load: 64 MiB in 200 ms
// shows hundreds of MB/s, not the TB/s of a bar that began at the first
// tensor's report.
func TestProgressBarStartsEmptyWithASaneRate(t *testing.T) {
	var buf bytes.Buffer
	p := &progress{what: "loading", tty: &buf, log: slog.New(slog.NewTextHandler(io.Discard, nil)), now: time.Now}
	const total = 64 << 20
	p.Update(0, total)
	time.Sleep(200 * time.Millisecond)
	p.Update(total*2/5, total) // the embeddings: 40% in one report
	p.Update(total, total)
	p.Finish()
	got := buf.String()
	first := strings.Index(got, "%")
	if first < 0 || !strings.HasSuffix(strings.TrimSpace(got[:first]), " 0") && !strings.Contains(got[:first+1], " 0%") {
		t.Errorf("the bar does not start at 0%%: %q", got)
	}
	for _, bad := range []string{"TB/s", "GB/s", "PB/s"} {
		if strings.Contains(got, bad) {
			t.Errorf("rate in %s: %q", bad, got)
		}
	}
	if !strings.Contains(got, "MB/s") {
		t.Errorf("no MB/s rate: %q", got)
	}
}

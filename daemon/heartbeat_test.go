package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/native"
)

// The heartbeat carries real figures on every node of a two-node mesh: the
// tail's hop latency is that of the hops it served, the head's that of the
// hops it sent. Each hop the head sent contains one the tail served, so the
// head's percentiles are at least the tail's; both are above zero, and the
// rates count the tokens.
func TestHeartbeatCarriesHopLatency(t *testing.T) {
	dir := testenv.GoCoder(t)
	testenv.CheckGoroutines(t)
	be, err := native.Open("cpu", native.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	start := func(first, last int, peers []string) *Node {
		id, err := identity.LoadOrCreate(filepath.Join(t.TempDir(), "k"))
		if err != nil {
			t.Fatal(err)
		}
		n, err := Start(context.Background(), Config{ModelDir: dir, Backend: be, Identity: id, First: first, Last: last,
			Peers: peers, MaxSessions: 2, MaxContext: 64, Logger: log})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { n.Close() })
		return n
	}
	tail := start(3, 5, nil)
	head := start(0, 2, []string{tail.URL()})

	const tokens = 6
	body, _ := json.Marshal(map[string]any{"prompt": "func main() {", "max_tokens": tokens, "ignore_eos": true})
	hc := &http.Client{Timeout: 60 * time.Second, Transport: &http.Transport{}}
	defer hc.Transport.(*http.Transport).CloseIdleConnections()
	resp, err := hc.Post(head.URL()+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("completion: %d %s", resp.StatusCode, b)
	}

	hs, _ := head.heartbeatStats()
	ts, _ := tail.heartbeatStats()
	if ts.HopP50Ms <= 0 || ts.HopP99Ms < ts.HopP50Ms {
		t.Errorf("tail heartbeat hop latency p50=%v p99=%v, want served-hop figures above zero", ts.HopP50Ms, ts.HopP99Ms)
	}
	if hs.HopP50Ms < ts.HopP50Ms || hs.HopP99Ms < ts.HopP99Ms {
		t.Errorf("head heartbeat hop latency p50=%v p99=%v, want at least the tail's p50=%v p99=%v (each sent hop contains a served one)",
			hs.HopP50Ms, hs.HopP99Ms, ts.HopP50Ms, ts.HopP99Ms)
	}
	if ts.RPM1 != tokens || hs.RPM1 != tokens || hs.TokensPerSec <= 0 {
		t.Errorf("rates: tail rpm1=%v head rpm1=%v head tokens/s=%v; want %d hops, %d tokens in the last minute",
			ts.RPM1, hs.RPM1, hs.TokensPerSec, tokens, tokens)
	}
}

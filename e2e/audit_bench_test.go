package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"meshgpu/daemon"
	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/native"
	"meshgpu/tracker"
)

// BenchmarkAuditOverhead measures the throughput of a 3-node mesh (a head
// holding 0-2 and two tails holding 3-5, in this process) through one
// tracker with audits at the default rate against audits off, in the same
// run: rounds alternate the two modes (tracker.Server.SetAuditRate; off
// also drops the logprobs audits make generations carry), each round two
// concurrent clients of chatsPerRound chats of 32 tokens; an audited round
// ends when its audits have. Rates: 1e-9 (no audit, but generations carry
// the logprobs audits need: that cost alone), the default, and 0.25 (what
// an audit costs). Reported: tokens/s of each mode, their ratio, and the
// audits run (logged).
//
//	go test ./e2e -run '^$' -bench AuditOverhead -benchtime 1x
func BenchmarkAuditOverhead(b *testing.B) {
	dir := testenv.GoCoder(b)
	be, err := native.Open("cpu", native.Options{Threads: 1})
	if err != nil {
		b.Fatal(err)
	}
	defer be.Close()
	tr := tracker.NewServer(tracker.Config{Logger: quietLogger(), HeartbeatTimeout: time.Minute, Endpoints: tracker.AddrPolicy{AllowLoopback: true},
		Audit: tracker.AuditConfig{Rate: tracker.DefaultAuditRate}})
	ts := httptest.NewServer(tr.Handler())
	defer ts.Close()
	ctx, cancel := context.WithCancel(context.Background())
	audits := make(chan struct{})
	go func() { defer close(audits); tr.RunAudits(ctx) }()
	defer func() { cancel(); <-audits }()
	for _, r := range [][2]int{{0, 2}, {3, 5}, {3, 5}} {
		id, err := identity.New()
		if err != nil {
			b.Fatal(err)
		}
		n, err := daemon.Start(context.Background(), daemon.Config{ModelDir: dir, Backend: be, Identity: id,
			First: r[0], Last: r[1], HopDType: "bf16", MaxSessions: 8, MaxContext: 512,
			TrackerURL: ts.URL, HeartbeatInterval: time.Second, Logger: quietLogger()})
		if err != nil {
			b.Fatal(err)
		}
		defer n.Close()
	}
	hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}, Timeout: time.Minute}
	defer hc.CloseIdleConnections()
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := hc.Get(ts.URL + "/v1/models")
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if strings.Contains(string(body), "gocoder-6m") {
				break
			}
		}
		if time.Now().After(deadline) {
			b.Fatal("the tracker never listed the model")
		}
		time.Sleep(50 * time.Millisecond)
	}
	const maxTokens, chatsPerRound, rounds, clients = 32, 20, 16, 2
	// drain waits until every queued audit has ended, so an audited
	// round pays for its audits.
	drain := func() {
		for end := time.Now().Add(time.Minute); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
			resp, err := hc.Get(ts.URL + "/metrics")
			if err != nil {
				b.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			queued, ended := 0.0, 0.0
			for _, l := range strings.Split(string(body), "\n") {
				var v float64
				if rest, ok := strings.CutPrefix(l, "meshgpu_tracker_audits_queued_total "); ok {
					fmt.Sscan(rest, &v)
					queued = v
				} else if strings.HasPrefix(l, "meshgpu_tracker_audits_total{") && !strings.Contains(l, `"dropped"`) {
					fmt.Sscan(l[strings.LastIndex(l, " ")+1:], &v)
					ended += v
				}
			}
			if ended >= queued {
				return
			}
		}
		b.Fatal("audits did not drain within a minute")
	}
	chat := func(i int) int {
		body, _ := json.Marshal(map[string]any{"model": "gocoder-6m", "max_tokens": maxTokens, "ignore_eos": true, "temperature": 0.7, "seed": i,
			"messages": []map[string]string{{"role": "user", "content": fmt.Sprintf("Write Go function %d that merges two sorted slices.", i)}}})
		resp, err := hc.Post(ts.URL+"/v1/chat/completions", "application/json", bytes.NewReader(body))
		if err != nil {
			b.Error(err) // not Fatal: clients are goroutines
			return 0
		}
		defer resp.Body.Close()
		var out struct {
			Usage struct {
				CompletionTokens int `json:"completion_tokens"`
			} `json:"usage"`
		}
		if resp.StatusCode != 200 || json.NewDecoder(resp.Body).Decode(&out) != nil {
			b.Errorf("chat %d: HTTP %d", i, resp.StatusCode)
		}
		return out.Usage.CompletionTokens
	}
	round := func(base int) (tokens int, took time.Duration) {
		start := time.Now()
		got := make(chan int, clients)
		for c := range clients {
			go func() {
				n := 0
				for i := range chatsPerRound / clients {
					n += chat(base + c*1000 + i)
				}
				got <- n
			}()
		}
		for range clients {
			tokens += <-got
		}
		drain()
		return tokens, time.Since(start)
	}
	for _, rate := range []float64{1e-9, tracker.DefaultAuditRate, 0.25} {
		b.Run(fmt.Sprintf("rate=%g", rate), func(b *testing.B) {
			for b.Loop() {
				var tok [2]int
				var dur [2]time.Duration
				for r := range rounds {
					for k := range 2 {
						mode := (r + k) % 2 // alternate which mode goes first
						tr.SetAuditRate([]float64{0, rate}[mode])
						n, d := round(r*10000 + mode*100000)
						tok[mode] += n
						dur[mode] += d
					}
				}
				off := float64(tok[0]) / dur[0].Seconds()
				on := float64(tok[1]) / dur[1].Seconds()
				b.ReportMetric(off, "tok/s-off")
				b.ReportMetric(on, "tok/s-audited")
				b.ReportMetric(on/off, "audited/off")
			}
		})
	}
	resp, err := hc.Get(ts.URL + "/metrics")
	if err != nil {
		b.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	for _, l := range strings.Split(string(body), "\n") {
		if strings.HasPrefix(l, "meshgpu_tracker_audits_total") {
			b.Log(l)
		}
	}
}

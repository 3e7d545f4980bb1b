package node

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"sync"
	"testing"
	"time"

	"meshgpu/engine"
	"meshgpu/internal/metricstest"
	"meshgpu/internal/testenv"
	"meshgpu/native"
	"meshgpu/openai"
	"meshgpu/wire"
)

func loadGocoder(t *testing.T, first, last int) (*engine.Model, native.Backend) {
	t.Helper()
	be, err := native.Open("cpu", native.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.Close() })
	m, err := engine.Load(testenv.GoCoder(t), engine.Options{Backend: be, First: first, Last: last, MaxContext: 256})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m, be
}

// More requests than session slots wait in the queue and all finish with
// the answer a lone request gets; without the queue the extra ones got 429.
func TestAdmissionQueuesMoreRequestsThanSlots(t *testing.T) {
	testenv.CheckGoroutines(t)
	m, be := loadGocoder(t, 0, -1)
	u := startNode(t, &Server{Model: m, Backend: be, MaxSessions: 2})
	c := &http.Client{Timeout: 60 * time.Second}
	defer c.CloseIdleConnections()
	body := map[string]any{"prompt": "func main() {", "max_tokens": 48, "temperature": 0, "ignore_eos": true}
	want, _ := postOK(t, c, u+"/v1/completions", body)

	const n = 8
	var wg sync.WaitGroup
	got := make([]string, n)
	status := make([]int, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := postJSON(context.Background(), c, u+"/v1/completions", body)
			if err != nil {
				t.Error(err)
				return
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			status[i] = resp.StatusCode
			var out openai.Completion
			if json.Unmarshal(b, &out) == nil && len(out.Choices) == 1 && out.Choices[0].Text != nil {
				got[i] = *out.Choices[0].Text
			} else {
				got[i] = string(b)
			}
		}()
	}
	wg.Wait()
	for i := range got {
		if status[i] != 200 || got[i] != *want.Choices[0].Text {
			t.Errorf("request %d of %d over 2 slots: %d %q, want 200 %q", i, n, status[i], got[i], *want.Choices[0].Text)
		}
	}
	after := metricstest.Scrape(t, c, u+"/metrics")
	f := after["meshgpu_node_queue_wait_seconds"]
	if f == nil || len(f.Metric) != 1 || f.Metric[0].Histogram.GetSampleCount() != n+1 || f.Metric[0].Histogram.GetSampleSum() <= 0 {
		t.Errorf("queue wait histogram %v: want %d samples, some waiting (the test did not load the node)", f, n+1)
	}
}

// A full queue answers 429 queue_full at once, a wait past --queue-wait
// 429 queue_timeout, both with Retry-After; a freed slot admits again.
func TestAdmissionRejectsOnlyWhenQueueFullOrWaitExpired(t *testing.T) {
	testenv.CheckGoroutines(t)
	m, be := loadGocoder(t, 0, 2)
	arrived := make(chan struct{}, 8)
	release := make(chan struct{})
	stall, _ := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		select {
		case <-release:
		case <-r.Context().Done():
		}
		writeError(w, &apiError{Status: 500, Type: "internal_error", Message: "tail gone"})
	}))
	head := &Server{Model: m, Backend: be, MaxSessions: 1, MaxQueue: 1, QueueWait: 700 * time.Millisecond,
		Route: []wire.Hop{{Endpoint: stall, StartLayer: 3, EndLayer: 5}}}
	u := startNode(t, head)
	c := &http.Client{Timeout: 60 * time.Second}
	defer c.CloseIdleConnections()
	body := map[string]any{"prompt": "x", "max_tokens": 4}
	post := func() (int, string, string) {
		resp, err := postJSON(context.Background(), c, u+"/v1/completions", body)
		if err != nil {
			t.Error(err)
			return 0, "", ""
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		we, _ := wire.DecodeError(resp.StatusCode, b)
		typ := ""
		if we != nil {
			typ = we.Type
		}
		return resp.StatusCode, typ, resp.Header.Get("Retry-After")
	}
	done := make(chan struct{})
	go func() { defer close(done); post() }() // holds the only slot in its hop
	<-arrived
	type answer struct {
		status     int
		typ, retry string
	}
	queued := make(chan answer, 1)
	go func() { s, ty, ra := post(); queued <- answer{s, ty, ra} }()
	for deadline := time.Now().Add(5 * time.Second); head.Stats().Queued != 1; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the second request is not queued")
		}
	}
	if s, ty, ra := post(); s != 429 || ty != wire.TypeQueueFull || ra == "" {
		t.Errorf("with the slot taken and the queue full: %d %s Retry-After %q, want 429 %s with Retry-After", s, ty, ra, wire.TypeQueueFull)
	}
	if a := <-queued; a.status != 429 || a.typ != wire.TypeQueueTimeout || a.retry == "" {
		t.Errorf("queued past --queue-wait: %+v, want 429 %s with Retry-After", a, wire.TypeQueueTimeout)
	}
	close(release)
	<-done
	if s, ty, _ := post(); s == 429 {
		t.Errorf("after the slot came free: %d %s, want admitted", s, ty)
	}
	if st := head.Stats(); st.Running != 0 || st.Queued != 0 {
		t.Errorf("after every request: running %d queued %d", st.Running, st.Queued)
	}
}

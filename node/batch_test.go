package node

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"meshgpu/internal/metricstest"
	"meshgpu/internal/testenv"
	"meshgpu/openai"
	"meshgpu/wire"
)

// streamIDs streams a greedy completion and returns its token ids (safe
// from any goroutine).
func streamIDs(c *http.Client, url string, prompt []int32, n int) ([]int32, error) {
	resp, err := postJSON(context.Background(), c, url+"/v1/completions", map[string]any{
		"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": true, "stream": true})
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		return nil, fmt.Errorf("HTTP %d", resp.StatusCode)
	}
	sr := openai.NewSSEReader(resp.Body, 1<<20)
	var ids []int32
	for {
		ev, err := sr.Next()
		if err != nil {
			return ids, fmt.Errorf("stream ended without [DONE]: %v", err)
		}
		if ev == openai.SSEDone {
			return ids, nil
		}
		var ch struct {
			Meshgpu *struct{ Token *int32 } `json:"meshgpu"`
			Error   *wire.Error             `json:"error"`
		}
		if err := json.Unmarshal([]byte(ev), &ch); err != nil {
			return ids, err
		}
		if ch.Error != nil {
			return ids, ch.Error
		}
		if ch.Meshgpu != nil && ch.Meshgpu.Token != nil {
			ids = append(ids, *ch.Meshgpu.Token)
		}
	}
}

// Batched output equals unbatched output: every golden prompt through the
// split mesh (head 0-2, f32 hops, chain through 2-4 and 4-5, each node with
// its scheduler) gives the ids of one whole model in one process (checked
// against HF transformers elsewhere) when 1, 3 or 8 sessions run at once,
// and the nodes did run sessions together in one forward call.
func TestBatchedSessionsMatchOneAtATime(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startGocoderMesh(t)
	c := &http.Client{Timeout: 120 * time.Second}
	defer c.CloseIdleConnections()
	const n = 24
	want := make([][]int32, len(g.golden))
	for i, gen := range g.golden {
		want[i] = g.reference(t, gen.PromptIDs, n).IDs
	}
	round := func(sessions int) {
		got := make([][]int32, sessions)
		errs := make([]error, sessions)
		var wg sync.WaitGroup
		for k := 0; k < sessions; k++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				got[k], errs[k] = streamIDs(c, g.f32URL, g.golden[k%len(g.golden)].PromptIDs, n)
			}()
		}
		wg.Wait()
		for k := range got {
			p := k % len(g.golden)
			if errs[k] != nil || !slices.Equal(got[k], want[p]) {
				t.Errorf("%d sessions at once, session %d (golden prompt %d): %v ids %v\nwant %v", sessions, k, p, errs[k], got[k], want[p])
			}
		}
	}
	// The tail's scheduler put sessions together (a call with more than one).
	batched := func() (calls, alone uint64, steps float64) {
		fams := metricstest.Scrape(t, c, g.tail+"/metrics")
		f := fams["meshgpu_node_batch_sessions"]
		if f == nil || len(f.Metric) != 1 {
			t.Fatal("no meshgpu_node_batch_sessions histogram on the tail")
		}
		h := f.Metric[0].Histogram
		for _, b := range h.Bucket {
			if b.GetUpperBound() == 1 {
				alone = b.GetCumulativeCount()
			}
		}
		return h.GetSampleCount(), alone, h.GetSampleSum()
	}
	for _, sessions := range []int{1, 3, 8} {
		round(sessions)
	}
	// On a loaded machine eight streams can still arrive one by one for a
	// while; a few more rounds of eight must batch some steps.
	calls, alone, steps := batched()
	for try := 0; try < 4 && calls > 0 && alone == calls; try++ {
		round(8)
		calls, alone, steps = batched()
	}
	t.Logf("tail: %d forward calls, %d with one session, %.0f session-steps", calls, alone, steps)
	if calls == 0 || alone == calls {
		t.Errorf("the tail ran %d calls, %d of them with one session: the sessions were never batched", calls, alone)
	}
}

package relay

import (
	"context"
	"io"
	"net/http"
	"sync"
	"testing"
	"time"

	"meshgpu/internal/testenv"
)

// A sender with more hops in flight than the relay's per-sender limit waits
// its 429s out: every hop is answered, none fails; the relay still never
// has more than the limit in flight from it.
func TestClientWaitsOutThePerSenderLimit(t *testing.T) {
	testenv.CheckGoroutines(t)
	var mu sync.Mutex
	inflight, peak := 0, 0
	slow := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		inflight++
		peak = max(peak, inflight)
		mu.Unlock()
		time.Sleep(10 * time.Millisecond)
		mu.Lock()
		inflight--
		mu.Unlock()
		TransformHandler(11).ServeHTTP(w, r)
	})
	const limit, hops = 2, 24
	tb := newTestbed(t, slow, &Server{MaxInflightPerPeer: limit}, nil)
	c := &Client{}
	defer c.Close()
	payload := bf16Payload(256)
	var wg sync.WaitGroup
	status := make([]int, hops)
	for i := 0; i < hops; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			resp, err := c.Do(ctx, tb.relayAddr(), hopReq(t, payload, 1))
			if err != nil {
				t.Errorf("hop %d: %v", i, err)
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			status[i] = resp.StatusCode
		}()
	}
	wg.Wait()
	for i, st := range status {
		if st != 200 {
			t.Errorf("hop %d of %d over a limit of %d: status %d, want 200", i, hops, limit, st)
		}
	}
	mu.Lock() // the handler's writes reach this goroutine over sockets, which the race detector does not see
	got := peak
	mu.Unlock()
	if got > limit {
		t.Errorf("the node saw %d hops at once from one sender, over the relay's limit of %d", got, limit)
	}
	if metricValue(t, tb.relay, "meshgpu_relay_requests_total", "path=tunnel", "result=rate_limited") == 0 {
		t.Error("the relay never limited the sender: the test did not exceed the limit")
	}
}

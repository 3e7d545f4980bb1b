package tracker

import (
	"strings"
	"sync"
	"testing"
	"time"

	"meshgpu/internal/testenv"
)

// Two replicas of near-equal measured speed (1.00 and 1.10 x 10 us per
// layer: a tiny model's compute, where the RPM load term is negligible)
// share concurrent streams: each gets within 2x of the other's share. With
// the load term alone the faster one took every stream.
func TestConcurrentStreamsShareEqualReplicas(t *testing.T) {
	testenv.CheckGoroutines(t)
	m := newProxyMesh(t, Config{})
	a := &fakeHead{t: t, delay: 5 * time.Millisecond}
	b := &fakeHead{t: t, delay: 5 * time.Millisecond}
	ha, hb := startHead(t, a), startHead(t, b)
	m.node(t, ha.URL, 0, 5, 0.010)
	m.node(t, hb.URL, 0, 5, 0.011)
	const n = 32
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := m.hc.Post(m.tracker.URL+"/v1/chat/completions", "application/json", strings.NewReader(chatBody))
			if err != nil {
				t.Error(err)
				return
			}
			defer resp.Body.Close()
			if res := readStream(t, resp.Body, true); !res.done || res.errored != "" {
				t.Errorf("stream %d: %+v", i, res)
			}
		}()
		time.Sleep(time.Millisecond) // arrivals, not one instant
	}
	wg.Wait()
	na, nb := len(a.Calls()), len(b.Calls())
	if na+nb != n || na > 2*nb || nb > 2*na {
		t.Fatalf("of %d concurrent streams the replicas got %d and %d: want each within 2x of the other", n, na, nb)
	}
}

// A heartbeat's running and queued requests count as load: a replica
// reporting work in flight loses the next routes to an idle one, although
// it is faster.
func TestHeartbeatLoadSteersRoutes(t *testing.T) {
	m := newProxyMesh(t, Config{})
	c := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: m.hc, Clock: m.clk.Now}
	mustRegister(t, c, reg("http://127.0.0.1:7001", 0, 5, 6, 0.010))
	idle := m.node(t, "http://127.0.0.1:7002", 0, 5, 0.011)
	m.clk.Add(time.Second)
	if _, err := c.Heartbeat(t.Context(), Heartbeat{Stats: NodeStats{Running: 3, Queued: 2}}); err != nil {
		t.Fatal(err)
	}
	for seed := uint64(0); seed < 20; seed++ {
		r, err := m.srv.reg.Route(t.Context(), "gocoder-6m", seed)
		if err != nil {
			t.Fatal(err)
		}
		if r.Hops[0].PeerID != idle {
			t.Fatalf("seed %d routed to %s (5 requests in flight) instead of the idle %s", seed, r.Hops[0].PeerID, idle)
		}
	}
}

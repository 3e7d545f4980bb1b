package tracker

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"meshgpu/internal/testenv"
	"meshgpu/tracker/route"
)

func TestRegisterHeartbeatAndExpiry(t *testing.T) {
	testenv.CheckGoroutines(t)
	clk := newClock()
	srv, ts := startTracker(t, Config{Clock: clk.Now, HeartbeatTimeout: 15 * time.Second})
	hc := httpClient(t)
	c := &Client{URL: ts.URL, Identity: newIdentity(t), HTTP: hc, Clock: clk.Now}
	ctx := context.Background()
	mustRegister(t, c, reg("http://127.0.0.1:7001", 0, 5, 6, 1.5))

	clk.Add(10 * time.Second)
	stats := NodeStats{RPM1: 120, RPM5: 60, TokensPerSec: 2, HopP50Ms: 3, HopP99Ms: 9, Sessions: 1}
	if _, err := c.Heartbeat(ctx, Heartbeat{Stats: stats, FreeMemory: 1 << 30, MsPerLayer: 0.75}); err != nil {
		t.Fatal(err)
	}
	var nodes struct{ Nodes []NodeRecord }
	getJSON(t, hc, ts.URL+"/nodes", &nodes)
	if len(nodes.Nodes) != 1 || nodes.Nodes[0].Stats != stats || nodes.Nodes[0].MsPerLayer != 0.75 {
		t.Fatalf("nodes after heartbeat: %+v", nodes.Nodes)
	}
	// Memory figures and keys stay in the tracker (GET /nodes is public).
	if nodes.Nodes[0].FreeMemory != 0 || nodes.Nodes[0].PublicKey != "" {
		t.Fatalf("/nodes shows a node's memory or key: %+v", nodes.Nodes[0])
	}
	if rec, ok, _ := srv.Registry().Store().Get(ctx, c.Identity.PeerID); !ok || rec.FreeMemory != 1<<30 {
		t.Fatalf("record after heartbeat: %+v", rec)
	}
	// 10 s after the heartbeat: alive. 16 s: expired.
	clk.Add(10 * time.Second)
	if n, _ := srv.Registry().Nodes(ctx); len(n) != 1 {
		t.Fatalf("node expired early: %d live", len(n))
	}
	clk.Add(6 * time.Second)
	if n, _ := srv.Registry().Nodes(ctx); len(n) != 0 {
		t.Fatalf("node did not expire: %d live", len(n))
	}
	_, err := c.Heartbeat(ctx, Heartbeat{Stats: stats})
	if !IsNotRegistered(err) {
		t.Fatalf("heartbeat after expiry: %v, want 404", err)
	}
}

// postRaw posts body and returns status and decoded error.
func postRaw(t *testing.T, hc *http.Client, url string, body []byte) (int, map[string]any) {
	t.Helper()
	resp, err := hc.Post(url, "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Fatalf("POST %s: content type %q, body %s", url, ct, b)
	}
	var out map[string]any
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatalf("POST %s: body is not JSON: %s", url, b)
	}
	return resp.StatusCode, out
}

func TestBadInputIsRefusedAndChangesNothing(t *testing.T) {
	testenv.CheckGoroutines(t)
	clk := newClock()
	store := &MemStore{}
	_, ts := startTracker(t, Config{Clock: clk.Now, Store: store})
	hc := httpClient(t)
	good := &Client{URL: ts.URL, Identity: newIdentity(t), HTTP: hc, Clock: clk.Now}
	mustRegister(t, good, reg("http://127.0.0.1:7001", 0, 2, 6, 1))
	before, _ := store.List(context.Background())

	other := newIdentity(t)
	signed := func(kind string, msg signable) []byte {
		b, err := Sign(other, kind, clk.Now(), msg)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	impossible := reg("http://127.0.0.1:7002", 4, 9, 6, 1) // last layer 9 of 6
	backwards := reg("http://127.0.0.1:7002", 3, 2, 6, 1)
	validB := reg("http://127.0.0.1:7002", 3, 5, 6, 1)
	forged := func() []byte {
		// other's key and signature, good's peer id.
		r := validB
		b := signed(KindRegister, &r)
		var m map[string]any
		json.Unmarshal(b, &m)
		m["peer_id"] = good.Identity.PeerID
		canon, _ := Canonical(mustJSON(m))
		m["signature"] = fmt.Sprintf("%x", other.Sign(append([]byte(SignaturePrefix), canon...)))
		return mustJSON(m)
	}()
	tampered := func() []byte {
		r := validB
		b := signed(KindRegister, &r)
		return bytes.Replace(b, []byte(`"layers":[3,5]`), []byte(`"layers":[0,5]`), 1)
	}()
	stale := func() []byte {
		r := validB
		b, _ := Sign(other, KindRegister, clk.Now().Add(-3*time.Minute), &r)
		return b
	}()
	goodHB := func() []byte {
		b, _ := Sign(good.Identity, KindHeartbeat, clk.Now().Add(time.Millisecond), &Heartbeat{Stats: NodeStats{RPM1: 5}})
		return b
	}()
	cases := []struct {
		name, path string
		body       []byte
		status     int
	}{
		{"impossible layer range", "/register", signed(KindRegister, &impossible), 400},
		{"first after last", "/register", signed(KindRegister, &backwards), 400},
		{"heartbeat from unknown peer", "/heartbeat", signed(KindHeartbeat, &Heartbeat{}), 404},
		{"forged peer id", "/register", forged, 401},
		{"tampered body", "/register", tampered, 401},
		{"stale timestamp", "/register", stale, 401},
		{"register signature used for heartbeat", "/heartbeat", signed(KindRegister, &validB), 400},
		{"not JSON", "/register", []byte("{not json"), 400},
		{"JSON array", "/register", []byte("[1,2]"), 400},
		{"JSON null", "/heartbeat", []byte("null"), 400},
		{"wrong types", "/register", []byte(`{"kind":"register","layers":"0-5","num_layers":"six"}`), 400},
		{"huge body", "/register", bytes.Repeat([]byte(" "), 100<<10), 413},
		{"no endpoint", "/register", signed(KindRegister, &Registration{Model: "m", NumLayers: 6, Layers: [2]int{0, 1}}), 400},
		{"bad endpoint scheme", "/register", signed(KindRegister, &Registration{Endpoint: "ftp://x", Model: "m", NumLayers: 6}), 400},
		{"assign with zero bytes per layer", "/assign", signed(KindAssign, &AssignRequest{Model: "m", NumLayers: 6, MemoryBudget: 1 << 30}), 400},
	}
	for _, tc := range cases {
		status, body := postRaw(t, hc, ts.URL+tc.path, tc.body)
		e, _ := body["error"].(map[string]any)
		if status != tc.status || e == nil || e["message"] == "" || e["type"] == "" {
			t.Errorf("%s: status %d body %v, want %d with error message and type", tc.name, status, body, tc.status)
		}
		after, _ := store.List(context.Background())
		if !reflect.DeepEqual(before, after) {
			t.Fatalf("%s changed the store:\nbefore %+v\nafter  %+v", tc.name, before, after)
		}
	}
	// A good heartbeat replayed: the first applies, the copy is refused.
	if status, body := postRaw(t, hc, ts.URL+"/heartbeat", goodHB); status != 200 {
		t.Fatalf("good heartbeat: %d %v", status, body)
	}
	before, _ = store.List(context.Background())
	if status, _ := postRaw(t, hc, ts.URL+"/heartbeat", goodHB); status != 401 {
		t.Fatalf("replayed heartbeat: %d, want 401", status)
	}
	after, _ := store.List(context.Background())
	if !reflect.DeepEqual(before, after) {
		t.Fatal("replayed heartbeat changed the store")
	}
	// Unknown paths and models answer JSON errors too.
	var e map[string]any
	if st := getJSON(t, hc, ts.URL+"/map?model=nope", &e); st != 404 || e["error"] == nil {
		t.Fatalf("unknown model map: %d %v", st, e)
	}
	if st := getJSON(t, hc, ts.URL+"/nowhere", &e); st != 404 || e["error"] == nil {
		t.Fatalf("unknown path: %d %v", st, e)
	}
}

func ptr[T any](v T) *T { return &v }

func mustJSON(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}

func TestMapRouteAssignAndRebalanceOverHTTP(t *testing.T) {
	testenv.CheckGoroutines(t)
	clk := newClock()
	_, ts := startTracker(t, Config{Clock: clk.Now})
	hc := httpClient(t)
	var clients []*Client
	add := func(r Registration) *Client {
		c := &Client{URL: ts.URL, Identity: newIdentity(t), HTTP: hc, Clock: clk.Now}
		mustRegister(t, c, r)
		clients = append(clients, c)
		return c
	}
	// Layers 0-2 three times, 3-4 once, 5 nobody: a gap.
	a := add(reg("http://127.0.0.1:7001", 0, 2, 6, 1))
	add(reg("http://127.0.0.1:7002", 0, 2, 6, 1))
	add(reg("http://127.0.0.1:7003", 0, 2, 6, 1))
	add(reg("http://127.0.0.1:7004", 3, 4, 6, 2))

	var m AvailabilityMap
	if st := getJSON(t, hc, ts.URL+"/map?model=gocoder-6m", &m); st != 200 {
		t.Fatalf("map: %d", st)
	}
	if m.Covered || m.Layers[0].Replicas != 3 || m.Layers[3].Replicas != 1 || m.Layers[5].Replicas != 0 || m.Layers[3].Throughput != 500 {
		t.Fatalf("map %+v", m)
	}
	var e map[string]any
	if st := getJSON(t, hc, ts.URL+"/route?model=gocoder-6m", &e); st != 503 {
		t.Fatalf("route with a gap: %d %v, want 503", st, e)
	}

	// A joiner with room for 3 layers (1 GiB each) is sent to the gap.
	joiner := &Client{URL: ts.URL, Identity: newIdentity(t), HTTP: hc, Clock: clk.Now}
	as, err := joiner.Assign(context.Background(), AssignRequest{Model: "gocoder-6m", NumLayers: 6, MemoryBudget: 3 << 30, Footprint: Footprint{BytesPerLayer: 1 << 30}})
	if err != nil || as.Last != 5 || as.NewlyCovered != 1 {
		t.Fatalf("assign: %+v %v, want a range ending at layer 5", as, err)
	}

	// Before the joiner registers, a heartbeat from an over-replicated
	// node is told to move into the gap (one order at a time).
	hb, err := a.Heartbeat(context.Background(), Heartbeat{})
	if err != nil || hb.Move == nil || hb.Move.Last != 5 {
		t.Fatalf("heartbeat: %+v %v, want a move ending at 5", hb, err)
	}
	hb2, err := clients[1].Heartbeat(context.Background(), Heartbeat{})
	if err != nil || hb2.Move != nil {
		t.Fatalf("second node also told to move: %+v %v", hb2, err)
	}
	// a follows the order: it registers with the new range.
	mustRegister(t, a, reg("http://127.0.0.1:7001", hb.Move.First, hb.Move.Last, 6, 1))
	getJSON(t, hc, ts.URL+"/map?model=gocoder-6m", &m)
	if !m.Covered {
		t.Fatalf("still uncovered after the move: %+v", m)
	}
	var rt route.Route
	if st := getJSON(t, hc, ts.URL+"/route?model=gocoder-6m&seed=1", &rt); st != 200 {
		t.Fatalf("route: %d", st)
	}
	if err := route.Check(rt, 6, nil); err != nil || len(rt.Costs) != len(rt.Hops) || rt.TotalMs <= 0 {
		t.Fatalf("route %+v: %v", rt, err)
	}
	// Metrics use the server's own registry.
	resp, err := hc.Get(ts.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), "meshgpu_tracker_nodes 4") || !strings.Contains(string(b), `meshgpu_tracker_http_requests_total{code="200",path="/register"} 5`) {
		t.Fatalf("metrics:\n%s", b)
	}
}

// TestRestartRebuildsTheSameMap: 50 nodes join through /assign and
// /register; a fresh tracker receiving the same registrations in another
// order serves the same map and the same routes.
func TestRestartRebuildsTheSameMap(t *testing.T) {
	testenv.CheckGoroutines(t)
	clk := newClock()
	hc := httpClient(t)
	const layers = 32
	rng := rand.New(rand.NewPCG(5, 5))
	type joined struct {
		c   *Client
		reg Registration
	}
	var nodes []joined
	_, ts1 := startTracker(t, Config{Clock: clk.Now})
	for i := 0; i < 50; i++ {
		c := &Client{URL: ts1.URL, Identity: newIdentity(t), HTTP: hc, Clock: clk.Now}
		fp := Footprint{BytesPerLayer: 400 << 20, KVReservePerLayer: 100 << 20, EmbedBytes: 1 << 30, HeadBytes: 1 << 30}
		budget := int64(1+rng.IntN(12)) << 30
		ms := 0.2 + 4.8*rng.Float64()
		as, err := c.Assign(context.Background(), AssignRequest{Model: "gocoder-6m", NumLayers: layers, MemoryBudget: budget, Footprint: fp, MsPerLayer: ms})
		if err != nil {
			t.Fatal(err)
		}
		r := Registration{Endpoint: fmt.Sprintf("http://127.0.0.1:%d", 8000+i), Model: "gocoder-6m", NumLayers: layers,
			Layers: [2]int{as.First, as.Last}, MemoryBudget: budget, Footprint: fp, MsPerLayer: ms}
		mustRegister(t, c, r)
		nodes = append(nodes, joined{c, r})
	}
	snapshot := func(url string) (string, []string) {
		var m AvailabilityMap
		getJSON(t, hc, url+"/map?model=gocoder-6m", &m)
		if !m.Covered {
			t.Fatalf("not every layer covered after 50 joins: %+v", m)
		}
		var routes []string
		for seed := 0; seed < 10; seed++ {
			var rt route.Route
			getJSON(t, hc, fmt.Sprintf("%s/route?model=gocoder-6m&seed=%d", url, seed), &rt)
			routes = append(routes, string(mustJSON(rt)))
		}
		return string(mustJSON(m)), routes
	}
	map1, routes1 := snapshot(ts1.URL)

	_, ts2 := startTracker(t, Config{Clock: clk.Now}) // the restarted tracker: empty state
	rng.Shuffle(len(nodes), func(i, j int) { nodes[i], nodes[j] = nodes[j], nodes[i] })
	clk.Add(time.Second)
	for _, n := range nodes {
		n.c.URL = ts2.URL
		mustRegister(t, n.c, n.reg)
	}
	map2, routes2 := snapshot(ts2.URL)
	if map1 != map2 {
		t.Fatalf("map differs after restart:\n%s\n%s", map1, map2)
	}
	if !reflect.DeepEqual(routes1, routes2) {
		t.Fatal("routes differ after restart")
	}
}

func TestAnnouncerReRegistersAfterTrackerRestart(t *testing.T) {
	testenv.CheckGoroutines(t)
	var current atomic.Pointer[Server]
	current.Store(NewServer(Config{Endpoints: AddrPolicy{AllowLoopback: true}, SkipEndpointCheck: true}))
	_, ts := startTracker(t, Config{})
	ts.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { current.Load().Handler().ServeHTTP(w, r) })
	hc := httpClient(t)
	c := &Client{URL: ts.URL, Identity: newIdentity(t), HTTP: hc}
	moved := make(chan Range, 1)
	layers := [2]int{0, 5}
	an := &Announcer{
		Client: c, Interval: 10 * time.Millisecond,
		Registration: func() Registration { return reg("http://127.0.0.1:7001", layers[0], layers[1], 6, 1) },
		Stats:        func() (NodeStats, int64) { return NodeStats{RPM1: 7}, 1 << 30 },
		OnMove:       func(r Range) { moved <- r },
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- an.Run(ctx) }()
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				cancel()
				t.Fatalf("timed out waiting for %s", what)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	hasStats := func() bool {
		n, _ := current.Load().Registry().Nodes(context.Background())
		return len(n) == 1 && n[0].Stats.RPM1 == 7
	}
	waitFor("registration and heartbeat", hasStats)
	current.Store(NewServer(Config{Endpoints: AddrPolicy{AllowLoopback: true}, SkipEndpointCheck: true})) // restart: state gone
	waitFor("re-registration after restart", hasStats)
	cancel()
	if err := <-done; err != context.Canceled {
		t.Fatalf("Run returned %v", err)
	}
}

func TestJoinToken(t *testing.T) {
	testenv.CheckGoroutines(t)
	clk := newClock()
	store := &MemStore{}
	_, ts := startTracker(t, Config{Clock: clk.Now, Store: store, JoinToken: "s3cret"})
	c := &Client{URL: ts.URL, Identity: newIdentity(t), HTTP: httpClient(t), Clock: clk.Now}
	r := reg("http://127.0.0.1:7001", 0, 5, 6, 1)
	for _, tok := range []string{"", "wrong"} {
		r.JoinToken = tok
		_, err := c.Register(context.Background(), r)
		var se *StatusError
		if !errors.As(err, &se) || se.Status != 403 {
			t.Fatalf("join token %q: %v, want 403", tok, err)
		}
	}
	if n, _ := store.List(context.Background()); len(n) != 0 {
		t.Fatal("a registration without the join token was stored")
	}
	r.JoinToken = "s3cret"
	mustRegister(t, c, r)
}

// Concurrent proxied generations spread before any heartbeat reports load:
// with one generation in flight on a replica, new routes avoid it.
func TestInflightGenerationsSpreadRoutes(t *testing.T) {
	clk := newClock()
	g := NewRegistry(nil, clk.Now, time.Minute, 0, route.Config{})
	g.SetAdmission(AddrPolicy{AllowLoopback: true}, nil, nil)
	ctx := context.Background()
	var ids []string
	for i := 0; i < 2; i++ {
		id := newIdentity(t)
		body, _ := Sign(id, KindRegister, clk.Now(), ptr(reg(fmt.Sprintf("http://127.0.0.1:%d", 7001+i), 0, 5, 6, 1)))
		if _, err := g.Register(ctx, body); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id.PeerID)
	}
	heads := func() map[string]int {
		out := map[string]int{}
		for seed := uint64(0); seed < 40; seed++ {
			r, err := g.Route(ctx, "gocoder-6m", seed)
			if err != nil {
				t.Fatal(err)
			}
			out[r.Hops[0].PeerID]++
		}
		return out
	}
	if h := heads(); h[ids[0]] == 0 || h[ids[1]] == 0 {
		t.Fatalf("idle equal replicas should share requests by seed: %v", h)
	}
	busy, _ := g.Route(ctx, "gocoder-6m", 0)
	release := g.Acquire(busy)
	if h := heads(); h[busy.Hops[0].PeerID] != 0 {
		t.Fatalf("routes still use the busy replica %s: %v", busy.Hops[0].PeerID, h)
	}
	release()
	release() // idempotent
	if h := heads(); h[ids[0]] == 0 || h[ids[1]] == 0 {
		t.Fatalf("after release the replicas should share again: %v", h)
	}
}

// The mesh page and its assets carry the CSP; /api/mesh lists a node's
// hostile backend name as data (the browser test checks it stays text).
func TestMeshPageHeaders(t *testing.T) {
	testenv.CheckGoroutines(t)
	_, ts := startTracker(t, Config{})
	hc := httpClient(t)
	c := &Client{URL: ts.URL, Identity: newIdentity(t), HTTP: hc}
	r := reg("http://127.0.0.1:7001", 0, 5, 6, 1)
	r.Backend = "<script>x</script>"
	mustRegister(t, c, r)
	for _, path := range []string{"/", "/assets/mesh.js", "/assets/mesh.css"} {
		resp, err := hc.Get(ts.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.Contains(resp.Header.Get("Content-Security-Policy"), "script-src 'self'") || len(b) == 0 {
			t.Errorf("GET %s: %d, CSP %q, %d bytes", path, resp.StatusCode, resp.Header.Get("Content-Security-Policy"), len(b))
		}
		if strings.Contains(string(b), "innerHTML =") {
			t.Errorf("GET %s assigns innerHTML", path)
		}
	}
	var v MeshView
	getJSON(t, hc, ts.URL+"/api/mesh", &v)
	if len(v.Nodes) != 1 || v.Nodes[0].Backend != r.Backend || v.Nodes[0].Audit != "" || v.Nodes[0].Health != "ok" ||
		len(v.Models) != 1 || !v.Models[0].Covered {
		t.Fatalf("/api/mesh: %+v", v)
	}
}

package node

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"meshgpu/internal/testenv"
	"meshgpu/native"
	"meshgpu/wire"
)

const (
	fkLayers = 6
	fkHidden = 8
	fkVocab  = 64
)

// fakeMesh starts three nodes over fake stacks with overlapping ranges
// 0-2, 2-4, 4-5 and returns them with their URLs.
func fakeMesh(t *testing.T, tweak func(*Server)) ([]*Server, []string) {
	ranges := [][2]int{{0, 2}, {2, 4}, {4, 5}}
	var srvs []*Server
	var urls []string
	for i, r := range ranges {
		s := &Server{StackForTesting: newFakeStack(r[0], r[1], fkLayers, fkHidden, fkVocab), PeerID: fmt.Sprintf("peer-%d", i)}
		if tweak != nil {
			tweak(s)
		}
		urls = append(urls, startNode(t, s))
		srvs = append(srvs, s)
	}
	return srvs, urls
}

// wantToken is what the fake stacks must give when each of the 6 layers
// runs exactly once.
func wantToken(t int32) int32 { return (t + fkLayers) % fkVocab }

func sendToken(t testing.TB, h hopReq, c *http.Client, url string) wire.TokenReply {
	t.Helper()
	status, _, b := h.send(t, c, url)
	if status != 200 {
		t.Fatalf("hop: %d %s", status, b)
	}
	var r wire.TokenReply
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatalf("token JSON %q: %v", b, err)
	}
	return r
}

// A chain over overlapping shards runs every layer once, for prefill and
// decode, in f32 and bf16; DELETE then frees the session on every node.
func TestChainOverlappingShards(t *testing.T) {
	testenv.CheckGoroutines(t)
	_, urls := fakeMesh(t, nil)
	c := &http.Client{}
	defer c.CloseIdleConnections()
	route := []wire.Hop{{Endpoint: urls[1], StartLayer: 3, EndLayer: 4}, {Endpoint: urls[2], StartLayer: 5, EndLayer: 5}}
	for _, dt := range []native.DType{native.F32, native.BF16} {
		id := "chain-" + dt.String()
		// Prefill 3 tokens, the last is 9: the next token comes from it.
		h := hopReq{session: id, n: 3, hidden: fkHidden, dtype: dt, start: 0, end: 2, pos: 0, route: route,
			tokens: []int32{4, 2, 9}, sampling: `{"temperature":0,"step":0}`}
		if got := sendToken(t, h, c, urls[0]).Token; got != wantToken(9) {
			t.Fatalf("%s prefill: token %d, want %d", dt, got, wantToken(9))
		}
		for step := 1; step < 5; step++ {
			in := int32(10 + step)
			h = hopReq{session: id, n: 1, hidden: fkHidden, dtype: dt, start: 0, end: 2, pos: 2 + step, route: route,
				tokens: []int32{in}, sampling: fmt.Sprintf(`{"temperature":0,"step":%d}`, step)}
			if got := sendToken(t, h, c, urls[0]).Token; got != wantToken(in) {
				t.Fatalf("%s step %d: token %d, want %d", dt, step, got, wantToken(in))
			}
		}
		for _, u := range urls {
			if n := sessionsOn(t, c, u); n != 1 {
				t.Fatalf("%s holds %d sessions, want 1", u, n)
			}
			req, _ := http.NewRequest(http.MethodDelete, u+"/sessions/"+id, nil)
			resp, err := c.Do(req)
			if err != nil || resp.StatusCode != 200 {
				t.Fatalf("DELETE on %s: %v %v", u, err, resp)
			}
			resp.Body.Close()
			// Idempotent: a second DELETE is a 404 JSON.
			resp, err = c.Do(req.Clone(context.Background()))
			if err != nil || resp.StatusCode != 404 {
				t.Fatalf("second DELETE on %s: %v %v", u, err, resp)
			}
			resp.Body.Close()
		}
		waitSessions(t, c, urls...)
	}
	// Without a route, a middle node answers activations: 2 layers added.
	h := hopReq{session: "acts", n: 2, hidden: fkHidden, dtype: native.F32, start: 3, end: -1, pos: 0, tokens: []int32{7, 8}}
	status, hdr, body := h.send(t, c, urls[1])
	if status != 200 || hdr.Get(wire.HeaderShape) != "2,8" || hdr.Get(wire.HeaderEndLayer) != "4" || hdr.Get(wire.HeaderDType) != "f32" {
		t.Fatalf("activations: %d %v", status, hdr)
	}
	if got := get(body, native.F32, fkHidden); got != 8+2 {
		t.Fatalf("row 1 after layers 3-4 = %v, want 10", got)
	}
}

// Each malformed hop gets a 4xx JSON error naming what is wrong, while a
// healthy session on the same node keeps producing the right tokens.
func TestBadHopsWhileHealthySessionRuns(t *testing.T) {
	testenv.CheckGoroutines(t)
	_, urls := fakeMesh(t, func(s *Server) { s.MaxBodyBytes = 1024 })
	c := &http.Client{}
	defer c.CloseIdleConnections()
	route := []wire.Hop{{Endpoint: urls[1], StartLayer: 3, EndLayer: 4}, {Endpoint: urls[2], StartLayer: 5, EndLayer: 5}}

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	healthy := make(chan error, 1)
	wg.Add(1)
	go func() {
		defer wg.Done()
		pos := 0
		for step := 0; ctx.Err() == nil; step++ {
			in := int32(step % 50)
			h := hopReq{session: "healthy", n: 1, hidden: fkHidden, dtype: native.BF16, start: 0, end: 2, pos: pos,
				route: route, tokens: []int32{in}}
			status, _, b := h.send(t, c, urls[0])
			if status != 200 {
				healthy <- fmt.Errorf("healthy step %d: %d %s", step, status, b)
				return
			}
			var r wire.TokenReply
			json.Unmarshal(b, &r)
			if r.Token != wantToken(in) {
				healthy <- fmt.Errorf("healthy step %d: token %d, want %d", step, r.Token, wantToken(in))
				return
			}
			// Stay inside the fake node's 256-token context however
			// fast the loop runs: a hop at position 0 starts over.
			pos = (pos + 1) % 200
		}
		healthy <- nil
	}()

	ok := hopReq{session: "bad", n: 1, hidden: fkHidden, dtype: native.BF16, start: 2, end: -1, pos: 0}
	cases := []struct {
		name   string
		h      hopReq
		status int
		names  string // the message must contain it
	}{
		{"wrong shape", with(ok, func(h *hopReq) { h.header = map[string]string{wire.HeaderShape: "1,9"} }), 400, wire.HeaderShape},
		{"shape not numbers", with(ok, func(h *hopReq) { h.header = map[string]string{wire.HeaderShape: "a,b"} }), 400, wire.HeaderShape},
		{"missing shape", with(ok, func(h *hopReq) { h.header = map[string]string{wire.HeaderShape: ""} }), 400, wire.HeaderShape},
		{"byte count short", with(ok, func(h *hopReq) { h.body = make([]byte, fkHidden*2-1) }), 400, wire.HeaderShape},
		{"byte count long", with(ok, func(h *hopReq) { h.body = make([]byte, fkHidden*2+2) }), 400, wire.HeaderShape},
		{"start layer below range", with(ok, func(h *hopReq) { h.start = 1 }), 400, wire.HeaderStartLayer},
		{"start layer above range", with(ok, func(h *hopReq) { h.start = 5 }), 400, wire.HeaderStartLayer},
		{"start layer not a number", with(ok, func(h *hopReq) { h.header = map[string]string{wire.HeaderStartLayer: "two"} }), 400, wire.HeaderStartLayer},
		{"end before start", with(ok, func(h *hopReq) { h.start, h.end = 4, 3 }), 400, wire.HeaderEndLayer},
		{"bad dtype", with(ok, func(h *hopReq) { h.header = map[string]string{wire.HeaderDType: "int8"} }), 400, wire.HeaderDType},
		{"bad position", with(ok, func(h *hopReq) { h.header = map[string]string{wire.HeaderPosition: "-1"} }), 400, wire.HeaderPosition},
		{"bad session id", with(ok, func(h *hopReq) { h.session = "a/b" }), 400, wire.HeaderSession},
		{"unknown session at position > 0", with(ok, func(h *hopReq) { h.session, h.pos = "nobody", 5 }), 404, "position 5"},
		{"hostile route: not JSON", with(ok, func(h *hopReq) { h.header = map[string]string{wire.HeaderRoute: `[{"endpoint":`} }), 400, wire.HeaderRoute},
		{"hostile route: huge", with(ok, func(h *hopReq) {
			h.header = map[string]string{wire.HeaderRoute: "[" + strings.Repeat(`{"endpoint":"http://a","start_layer":5,"end_layer":5},`, 400) + "{}]"}
		}), 400, wire.HeaderRoute},
		{"hostile route: file URL", with(ok, func(h *hopReq) {
			h.header = map[string]string{wire.HeaderRoute: `[{"endpoint":"file:///etc/passwd","start_layer":5,"end_layer":5}]`}
		}), 400, wire.HeaderRoute},
		{"hostile route: gap", with(ok, func(h *hopReq) {
			h.end = 3
			h.header = map[string]string{wire.HeaderRoute: `[{"endpoint":"http://127.0.0.1:1","start_layer":5,"end_layer":5}]`}
		}), 400, wire.HeaderRoute},
		{"hostile route: past the model", with(ok, func(h *hopReq) {
			h.end = 3
			h.header = map[string]string{wire.HeaderRoute: `[{"endpoint":"http://127.0.0.1:1","start_layer":4,"end_layer":99}]`}
		}), 400, wire.HeaderRoute},
		{"hostile route: deep nesting", with(ok, func(h *hopReq) {
			h.header = map[string]string{wire.HeaderRoute: strings.Repeat("[", 5000)}
		}), 400, wire.HeaderRoute},
		{"hostile sampling", with(ok, func(h *hopReq) { h.header = map[string]string{wire.HeaderSampling: `{"step":-4}`} }), 400, wire.HeaderSampling},
		{"bad deadline", with(ok, func(h *hopReq) { h.header = map[string]string{wire.HeaderHopDeadline: "soon"} }), 400, wire.HeaderHopDeadline},
		{"past deadline", with(ok, func(h *hopReq) { h.header = map[string]string{wire.HeaderHopDeadline: "1000"} }), 504, "deadline"},
		{"body over the limit", with(ok, func(h *hopReq) { h.n = 100; h.body = make([]byte, 100*fkHidden*2) }), 413, "limit"},
		{"context exceeded", with(ok, func(h *hopReq) { h.pos = 0; h.n = 300 }), 507, "context"},
	}
	for _, tc := range cases {
		status, hdr, b := tc.h.send(t, c, urls[1])
		if status != tc.status {
			t.Errorf("%s: status %d, want %d: %s", tc.name, status, tc.status, b)
			continue
		}
		e := decodeError(t, status, hdr, b)
		if !strings.Contains(e.Message, tc.names) {
			t.Errorf("%s: message %q does not name %q", tc.name, e.Message, tc.names)
		}
		if e.Hop != "peer-1" {
			t.Errorf("%s: hop %q, want peer-1", tc.name, e.Hop)
		}
	}
	// Position beyond the session's length is a 409; below it is a redo.
	first := hopReq{session: "pos", n: 2, hidden: fkHidden, dtype: native.BF16, start: 2, end: -1, pos: 0}
	if st, _, b := first.send(t, c, urls[1]); st != 200 {
		t.Fatalf("pos setup: %d %s", st, b)
	}
	gap := with(first, func(h *hopReq) { h.pos, h.n = 3, 1 })
	if st, hdr, b := gap.send(t, c, urls[1]); st != 409 {
		t.Errorf("position gap: %d %s", st, b)
	} else if e := decodeError(t, st, hdr, b); !strings.Contains(e.Message, wire.HeaderPosition) {
		t.Errorf("409 does not name %s: %q", wire.HeaderPosition, e.Message)
	}
	redo := with(first, func(h *hopReq) { h.pos, h.n = 1, 1 })
	if st, _, b := redo.send(t, c, urls[1]); st != 200 {
		t.Errorf("redo at a lower position: %d %s", st, b)
	}

	time.Sleep(50 * time.Millisecond) // let the healthy session run alongside
	cancel()
	wg.Wait()
	if err := <-healthy; err != nil {
		t.Fatal(err)
	}
}

func with(h hopReq, f func(*hopReq)) hopReq {
	h.end = -1
	f(&h)
	return h
}

// Session capacity gives 429; the TTL reaper frees idle sessions.
func TestSessionLimits(t *testing.T) {
	testenv.CheckGoroutines(t)
	s := &Server{StackForTesting: newFakeStack(0, 5, fkLayers, fkHidden, fkVocab), MaxSessions: 2, SessionTTL: 200 * time.Millisecond}
	u := startNode(t, s)
	c := &http.Client{}
	defer c.CloseIdleConnections()
	for i := 0; i < 3; i++ {
		h := hopReq{session: fmt.Sprintf("s%d", i), n: 1, hidden: fkHidden, dtype: native.F32, start: 0, end: -1}
		st, hdr, b := h.send(t, c, u)
		if i < 2 && st != 200 {
			t.Fatalf("session %d: %d %s", i, st, b)
		}
		if i == 2 {
			if st != 429 {
				t.Fatalf("third session: %d %s, want 429", st, b)
			}
			decodeError(t, st, hdr, b)
		}
	}
	waitSessions(t, c, u) // the reaper frees both within a few TTLs

	// No memory for another KV cache: 507, and the slot is not leaked.
	s.StackForTesting.(*fakeStack).oom = true
	h := hopReq{session: "oom", n: 1, hidden: fkHidden, dtype: native.F32, start: 0, end: -1}
	if st, hdr, b := h.send(t, c, u); st != 507 {
		t.Fatalf("KV cache out of memory: %d %s, want 507", st, b)
	} else if e := decodeError(t, st, hdr, b); e.Type != "kv_cache_full" {
		t.Fatalf("507 type %q", e.Type)
	}
	s.StackForTesting.(*fakeStack).oom = false
	if n := sessionsOn(t, c, u); n != 0 {
		t.Fatalf("%d sessions after a failed allocation", n)
	}
	var st Stats
	getJSON(t, c, u+"/stats", &st)
	if st.HopsOK != 2 || st.HopsFailed != 2 || st.TokensGenerated != 2 {
		t.Errorf("stats %+v: want 2 ok, 2 failed, 2 tokens", st)
	}
	resp, err := c.Get(u + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	var sb strings.Builder
	buf := make([]byte, 1<<16)
	for {
		n, err := resp.Body.Read(buf)
		sb.Write(buf[:n])
		if err != nil {
			break
		}
	}
	resp.Body.Close()
	for _, m := range []string{`meshgpu_node_hops_total{result="ok"} 2`, `meshgpu_node_hops_total{result="too_many_sessions"} 1`,
		"meshgpu_node_hop_latency_seconds_bucket", "meshgpu_node_active_sessions 0", "meshgpu_node_tokens_generated_total 2"} {
		if !strings.Contains(sb.String(), m) {
			t.Errorf("/metrics lacks %q", m)
		}
	}
}

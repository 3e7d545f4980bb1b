package node

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"meshgpu/engine"
	"meshgpu/internal/testenv"
	"meshgpu/native"
	"meshgpu/sample"
	"meshgpu/wire"
)

// headPipeline makes a pipeline on a fake head (layers 0-2) over route.
func headPipeline(t *testing.T, head *Server, id string, route []wire.Hop) *pipeline {
	t.Helper()
	head.Handler()
	sess, ae := head.sessions.get(id, 0)
	if ae != nil {
		t.Fatal(ae)
	}
	t.Cleanup(func() { head.sessions.remove(id) })
	return &pipeline{s: head, sess: sess, id: id, headEnd: 2, route: route, params: sample.Params{}, dtype: native.BF16}
}

// A hop to a node that hangs fails with a 504 naming that node, after one
// retry, within two hop timeouts.
func TestHangingHopTimesOut(t *testing.T) {
	testenv.CheckGoroutines(t)
	var attempts atomic.Int32
	hang, _ := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		attempts.Add(1)
		io.Copy(io.Discard, r.Body) // then the server notices the caller hanging up
		<-r.Context().Done()        // never answers
	}))
	const timeout = 300 * time.Millisecond
	mid := &Server{StackForTesting: newFakeStack(2, 4, fkLayers, fkHidden, fkVocab), PeerID: "mid", HopTimeout: timeout}
	midURL := startNode(t, mid)
	head := &Server{StackForTesting: newFakeStack(0, 2, fkLayers, fkHidden, fkVocab), PeerID: "head", HopTimeout: timeout, Logger: quietLogger()}
	t.Cleanup(func() { head.Close() })
	p := headPipeline(t, head, "hang", []wire.Hop{{Endpoint: midURL, StartLayer: 3, EndLayer: 4}, {Endpoint: hang, StartLayer: 5, EndLayer: 5}})

	start := time.Now()
	_, _, ae := p.step(context.Background(), 0, []int32{1, 2}, 0)
	took := time.Since(start)
	if ae == nil {
		t.Fatal("hop to a hanging node succeeded")
	}
	if ae.Status != http.StatusGatewayTimeout || ae.Hop != hang || ae.Type != "hop_timeout" {
		t.Fatalf("error %d %s hop %q: %s; want 504 hop_timeout naming %s", ae.Status, ae.Type, ae.Hop, ae.Message, hang)
	}
	if took > 2*timeout+500*time.Millisecond {
		t.Fatalf("took %v, more than two hop timeouts of %v", took, timeout)
	}
	if n := attempts.Load(); n != 2 {
		t.Errorf("the hanging node saw %d attempts, want 2 (one retry)", n)
	}
}

// A node that dies mid-generation makes the next step fail with a 502 that
// names it; the steps before were right.
func TestNodeDiesMidGeneration(t *testing.T) {
	testenv.CheckGoroutines(t)
	mid := &Server{StackForTesting: newFakeStack(2, 4, fkLayers, fkHidden, fkVocab), PeerID: "mid"}
	midURL := startNode(t, mid)
	tail := &Server{StackForTesting: newFakeStack(4, 5, fkLayers, fkHidden, fkVocab), PeerID: "tail", Logger: quietLogger()}
	tailURL, stopTail := serve(t, tail.Handler())
	t.Cleanup(func() { tail.Close() })
	head := &Server{StackForTesting: newFakeStack(0, 2, fkLayers, fkHidden, fkVocab), PeerID: "head", Logger: quietLogger()}
	t.Cleanup(func() { head.Close() })
	p := headPipeline(t, head, "dies", []wire.Hop{{Endpoint: midURL, StartLayer: 3, EndLayer: 4}, {Endpoint: tailURL, StartLayer: 5, EndLayer: 5}})

	ctx := context.Background()
	id, _, ae := p.step(ctx, 0, []int32{3, 4, 5}, 0)
	if ae != nil || id != wantToken(5) {
		t.Fatalf("prefill: %d %v", id, ae)
	}
	for step := 1; step < 4; step++ {
		next, _, ae := p.step(ctx, 2+step, []int32{id}, step)
		if ae != nil || next != wantToken(id) {
			t.Fatalf("step %d: %d %v, want %d", step, next, ae, wantToken(id))
		}
		id = next
	}
	stopTail()
	tail.Close() // a dead node's hop connections die with it
	start := time.Now()
	_, _, ae = p.step(ctx, 6, []int32{id}, 4)
	if ae == nil || ae.Status != http.StatusBadGateway || ae.Hop != tailURL {
		t.Fatalf("after the tail died: %+v, want a 502 naming %s", ae, tailURL)
	}
	if time.Since(start) > 5*time.Second {
		t.Fatalf("failing took %v", time.Since(start))
	}
	// The first hop itself gone: the error names it.
	p.route = []wire.Hop{{Endpoint: tailURL, StartLayer: 3, EndLayer: 5}}
	if _, _, ae = p.step(ctx, 0, []int32{1}, 0); ae == nil || ae.Status != http.StatusBadGateway || ae.Hop != tailURL {
		t.Fatalf("dead first hop: %+v", ae)
	}
}

// A retried hop (same position) is a redo on the receiver: the session
// truncates, so the token is neither skipped nor duplicated.
func TestRetryIsIdempotent(t *testing.T) {
	testenv.CheckGoroutines(t)
	var fail atomic.Bool
	tail := &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab), PeerID: "tail"}
	tailH := tail.Handler()
	// The proxy runs the hop on the tail, then reports a failure once: the
	// tail's KV cache already holds the position when the retry arrives.
	flaky, _ := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if fail.CompareAndSwap(true, false) {
			rec := &discardWriter{h: http.Header{}}
			tailH.ServeHTTP(rec, r)
			http.Error(w, `{"error":{"message":"injected","type":"server_error"}}`, 500)
			return
		}
		tailH.ServeHTTP(w, r)
	}))
	t.Cleanup(func() { tail.Close() })
	head := &Server{StackForTesting: newFakeStack(0, 2, fkLayers, fkHidden, fkVocab), PeerID: "head", Logger: quietLogger()}
	t.Cleanup(func() { head.Close() })
	p := headPipeline(t, head, "retry", []wire.Hop{{Endpoint: flaky, StartLayer: 3, EndLayer: 5}})
	id, _, ae := p.step(context.Background(), 0, []int32{7}, 0)
	if ae != nil {
		t.Fatal(ae)
	}
	fail.Store(true)
	for step := 1; step < 4; step++ {
		next, _, ae := p.step(context.Background(), step, []int32{id}, step)
		if ae != nil || next != wantToken(id) {
			t.Fatalf("step %d: %d %v", step, next, ae)
		}
		id = next
	}
	tail.Handler()
	var kvLen int
	tail.sessions.mu.Lock()
	for _, s := range tail.sessions.m {
		kvLen = s.kv.Len()
	}
	tail.sessions.mu.Unlock()
	if kvLen != 4 {
		t.Fatalf("tail session holds %d positions after 4 steps with one retry, want 4", kvLen)
	}
}

type discardWriter struct{ h http.Header }

func (d *discardWriter) Header() http.Header         { return d.h }
func (d *discardWriter) Write(b []byte) (int, error) { return len(b), nil }
func (d *discardWriter) WriteHeader(int)             {}

// fakeRelay carries hops to the node registered under each relay address,
// as relay.Client would; broken makes every call fail.
type fakeRelay struct {
	nodes  map[string]string // relay_addr -> node base URL
	calls  atomic.Int32
	broken bool
}

func (f *fakeRelay) Do(ctx context.Context, relayAddr string, req *http.Request) (*http.Response, error) {
	f.calls.Add(1)
	if f.broken {
		return nil, fmt.Errorf("relay %s: connection refused", relayAddr)
	}
	base, ok := f.nodes[relayAddr]
	if !ok {
		return nil, fmt.Errorf("relay: peer of %s not connected", relayAddr)
	}
	u, _ := url.Parse(base + req.URL.Path)
	out := req.Clone(ctx)
	out.URL, out.Host, out.RequestURI = u, u.Host, ""
	return http.DefaultTransport.RoundTrip(out)
}

// Hops with a relay_addr go through the node's RelayDoer (also from a
// middle node in chain mode); when the relay fails, the retry goes direct.
func TestRelayHops(t *testing.T) {
	testenv.CheckGoroutines(t)
	tail := &Server{StackForTesting: newFakeStack(4, 5, fkLayers, fkHidden, fkVocab), PeerID: "tail"}
	tailURL := startNode(t, tail)
	relay := &fakeRelay{nodes: map[string]string{"ws://relay.test/rpc/tail": tailURL}}
	mid := &Server{StackForTesting: newFakeStack(2, 4, fkLayers, fkHidden, fkVocab), PeerID: "mid", Relay: relay}
	midURL := startNode(t, mid)
	relay.nodes["ws://relay.test/rpc/mid"] = midURL
	head := &Server{StackForTesting: newFakeStack(0, 2, fkLayers, fkHidden, fkVocab), PeerID: "head", Relay: relay, Logger: quietLogger()}
	t.Cleanup(func() { head.Close() })
	defer http.DefaultTransport.(*http.Transport).CloseIdleConnections()

	// Relay-only nodes: no endpoints at all.
	p := headPipeline(t, head, "relayed", []wire.Hop{
		{RelayAddr: "ws://relay.test/rpc/mid", PeerID: "mid", StartLayer: 3, EndLayer: 4},
		{RelayAddr: "ws://relay.test/rpc/tail", PeerID: "tail", StartLayer: 5, EndLayer: 5}})
	id, _, ae := p.step(context.Background(), 0, []int32{11}, 0)
	if ae != nil || id != wantToken(11) {
		t.Fatalf("relayed step: %d %v", id, ae)
	}
	if n := relay.calls.Load(); n != 2 {
		t.Fatalf("relay carried %d hops, want 2", n)
	}
	// A broken relay: the retry goes to the endpoint.
	relay.broken = true
	p2 := headPipeline(t, head, "fallback", []wire.Hop{
		{Endpoint: midURL, RelayAddr: "ws://relay.test/rpc/mid", PeerID: "mid", StartLayer: 3, EndLayer: 4},
		{Endpoint: tailURL, StartLayer: 5, EndLayer: 5}})
	if id, _, ae = p2.step(context.Background(), 0, []int32{12}, 0); ae != nil || id != wantToken(12) {
		t.Fatalf("fallback step: %d %v", id, ae)
	}
	// Relay-only and the relay is down: a 502 naming the peer.
	if _, _, ae = p.step(context.Background(), 1, []int32{id}, 1); ae == nil || ae.Status != 502 || ae.Hop != "mid" {
		t.Fatalf("relay down: %+v", ae)
	}
	// Wrong methods are JSON 405s.
	resp, err := http.Get(midURL + "/forward")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 405 {
		t.Fatalf("GET /forward: %d %s", resp.StatusCode, b)
	}
	decodeError(t, resp.StatusCode, resp.Header, b)
}

// A caller that sends the headers and then trickles nothing gets a 408
// within the hop timeout instead of holding a buffer forever.
func TestSlowBodyTimesOut(t *testing.T) {
	testenv.CheckGoroutines(t)
	s := &Server{StackForTesting: newFakeStack(0, 5, fkLayers, fkHidden, fkVocab), HopTimeout: 300 * time.Millisecond}
	u := startNode(t, s)
	expectSlowBody408(t, u, fmt.Sprintf("POST /forward HTTP/1.1\r\nHost: x\r\n%s: s\r\n%s: 1,%d\r\n%s: f32\r\n%s: 0\r\n%s: 0\r\nContent-Length: %d\r\n\r\nabc",
		wire.HeaderSession, wire.HeaderShape, fkHidden, wire.HeaderDType, wire.HeaderStartLayer, wire.HeaderPosition, fkHidden*4))
}

// expectSlowBody408 sends request (headers and part of a body) and never
// the rest; the node must answer 408 with a JSON error within 2 s.
func expectSlowBody408(t *testing.T, url, request string) {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	io.WriteString(conn, request)
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	start := time.Now()
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("no answer to a trickled body within 5 s: %v", err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestTimeout || time.Since(start) > 2*time.Second {
		t.Fatalf("slow body: %d after %v: %s", resp.StatusCode, time.Since(start), b)
	}
	decodeError(t, resp.StatusCode, resp.Header, b)
}

// A client that sends an OpenAI request's headers and then trickles its body
// gets a 408 within the hop timeout instead of holding a handler forever.
func TestSlowOpenAIBodyTimesOut(t *testing.T) {
	testenv.CheckGoroutines(t)
	dir := testenv.GoCoder(t)
	be, err := native.Open("cpu", native.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.Close() })
	m, err := engine.Load(dir, engine.Options{Backend: be, First: 0, Last: -1, MaxContext: 64})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	u := startNode(t, &Server{Model: m, Backend: be, HopTimeout: 300 * time.Millisecond})
	expectSlowBody408(t, u, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
}

// A hop answered with a redirect is a bad hop (502 naming it), never a
// request re-sent to wherever the redirect points.
func TestHopRedirectIsNotFollowed(t *testing.T) {
	testenv.CheckGoroutines(t)
	var elsewhere atomic.Int32
	other, _ := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		elsewhere.Add(1)
		http.Error(w, "should not be reached", http.StatusTeapot)
	}))
	for _, code := range []int{http.StatusFound, http.StatusTemporaryRedirect} {
		redirect, _ := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Location", other+"/forward")
			w.WriteHeader(code)
			io.WriteString(w, `{"error":{"message":"moved","type":"moved"}}`)
		}))
		head := &Server{StackForTesting: newFakeStack(0, 2, fkLayers, fkHidden, fkVocab), PeerID: "head", Logger: quietLogger()}
		t.Cleanup(func() { head.Close() })
		p := headPipeline(t, head, fmt.Sprintf("redirect-%d", code), []wire.Hop{{Endpoint: redirect, StartLayer: 3, EndLayer: 5}})
		_, _, ae := p.step(context.Background(), 0, []int32{1}, 0)
		if ae == nil || ae.Status != http.StatusBadGateway || ae.Hop != redirect {
			t.Errorf("hop answered %d: %+v, want a 502 naming %s", code, ae, redirect)
		}
	}
	if n := elsewhere.Load(); n != 0 {
		t.Errorf("the redirect target got %d requests, want none", n)
	}
}

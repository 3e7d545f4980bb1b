package tracker

import (
	"encoding/base64"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"meshgpu/internal/testenv"
	"meshgpu/ticket"
	"meshgpu/wire"
)

// A head whose queue is full (429) is waited out, not banned: with one
// head and one attempt allowed, the stream still completes once it admits,
// and the next request is routed to it again.
func TestProxyWaitsOutABusyHeadWithoutBanning(t *testing.T) {
	testenv.CheckGoroutines(t)
	want := reference(t, "/v1/chat/completions", chatBody, true)
	m := newProxyMesh(t, Config{MaxAttempts: 1})
	var calls atomic.Int32
	head := &fakeHead{t: t, fail: func(headCall) (int, string, string) {
		if calls.Add(1) <= 3 {
			return 0, "429", ""
		}
		return -1, "", ""
	}}
	h := startHead(t, head)
	m.node(t, h.URL, 0, 5, 1)
	got := readStream(t, m.post(t, "/v1/chat/completions", chatBody).Body, true)
	if !got.done || got.errored != "" || got.text != want.text {
		t.Fatalf("after three 429s: %+v, want %q", got, want.text)
	}
	again := readStream(t, m.post(t, "/v1/chat/completions", chatBody).Body, true)
	if !again.done || again.errored != "" || len(head.Calls()) != 5 {
		t.Fatalf("next request: %+v after %d head calls: the busy head was banned", again, len(head.Calls()))
	}
}

// A busy hop reported mid-stream (the tail's sessions are full) is waited
// out and the generation resumes after the tokens it has; the only tail is
// not banned.
func TestProxyResumesAfterABusyHopWithoutBanning(t *testing.T) {
	testenv.CheckGoroutines(t)
	want := reference(t, "/v1/chat/completions", chatBody, true)
	m := newProxyMesh(t, Config{MaxAttempts: 1})
	var tailURL string
	var busy atomic.Int32
	head := &fakeHead{t: t, fail: func(c headCall) (int, string, string) {
		if busy.Add(1) == 1 {
			return 3, "busy-event", tailURL
		}
		return -1, "", ""
	}}
	h := startHead(t, head)
	m.node(t, h.URL, 0, 2, 1)
	tailURL = "http://127.0.0.1:1"
	m.node(t, tailURL, 3, 5, 1)
	got := readStream(t, m.post(t, "/v1/chat/completions", chatBody).Body, true)
	if !got.done || got.errored != "" || got.text != want.text {
		t.Fatalf("after a busy tail: %+v, want %q", got, want.text)
	}
	calls := head.Calls()
	if len(calls) != 2 || len(calls[1].continueIDs) != 3 || len(calls[1].route) != 1 || calls[1].route[0].Endpoint != tailURL {
		t.Fatalf("head calls %+v: want a resume after 3 tokens through the same tail", calls)
	}
	if again := readStream(t, m.post(t, "/v1/chat/completions", chatBody).Body, true); !again.done || again.errored != "" {
		t.Fatalf("next request %+v: the busy tail was banned", again)
	}
}

// Of two replicas, a busy one is routed around at once (no wait), and stays
// routable: it is not banned.
func TestProxyRoutesAroundABusyReplica(t *testing.T) {
	testenv.CheckGoroutines(t)
	m := newProxyMesh(t, Config{MaxAttempts: 1})
	var busyCalls atomic.Int32
	busy := &fakeHead{t: t, fail: func(headCall) (int, string, string) {
		if busyCalls.Add(1) == 1 {
			return 0, "429", ""
		}
		return -1, "", ""
	}}
	spare := &fakeHead{t: t}
	hb, hs := startHead(t, busy), startHead(t, spare)
	m.node(t, hb.URL, 0, 5, 1) // faster: routed first
	m.node(t, hs.URL, 0, 5, 5)
	start := time.Now()
	got := readStream(t, m.post(t, "/v1/chat/completions", chatBody).Body, true)
	if !got.done || got.errored != "" || len(spare.Calls()) != 1 {
		t.Fatalf("busy replica: %+v, spare called %d times", got, len(spare.Calls()))
	}
	if d := time.Since(start); d > defaultBusyRetry {
		t.Errorf("routing around the busy replica took %v: it waited instead", d)
	}
	time.Sleep(defaultBusyRetry)
	// The spare is measured now and the busy one not, so routes tie
	// (measure.go): a banned replica would get none of these.
	for i := 0; i < 20 && len(busy.Calls()) < 2; i++ {
		readStream(t, m.post(t, "/v1/chat/completions", chatBody).Body, true)
	}
	if n := len(busy.Calls()); n != 2 {
		t.Errorf("the once-busy faster replica got %d requests, want 2: it was banned", n)
	}
}

// A head that stays busy past BusyWait: the client gets 429 with
// Retry-After, and the head is still not banned.
func TestProxyAnswers429WhenBusyPastTheWait(t *testing.T) {
	testenv.CheckGoroutines(t)
	m := newProxyMesh(t, Config{BusyWait: 500 * time.Millisecond})
	head := &fakeHead{t: t, fail: func(headCall) (int, string, string) { return 0, "429", "" }}
	h := startHead(t, head)
	m.node(t, h.URL, 0, 5, 1)
	resp := m.post(t, "/v1/chat/completions", chatBody)
	if resp.StatusCode != 429 || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("always busy: %d Retry-After %q, want 429 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	n := len(head.Calls())
	if n < 2 {
		t.Fatalf("the busy head was asked %d times within the wait", n)
	}
	bans, err := m.srv.reg.Store().Bans(t.Context(), m.clk.Now())
	if err != nil || len(bans) != 0 {
		t.Fatalf("bans after back-pressure: %v %v", bans, err)
	}
}

// A route that fails frees its session on every node after the head: a
// head that died cannot, and the tail would hold the KV cache until its
// TTL. The session id is the one of the route ticket the dying head was
// sent, and the DELETE carries the tracker's release of it: the nodes own
// sessions, and a ticketed one is freed only with its key or its ticket
// issuer's release (node/tickets.go, authorizeDelete).
func TestProxyFreesAFailedRoutesSessions(t *testing.T) {
	testenv.CheckGoroutines(t)
	m := newProxyMesh(t, Config{})
	type del struct{ path, release string }
	deleted := make(chan del, 4)
	tail := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodDelete {
			deleted <- del{r.URL.Path, r.Header.Get(wire.HeaderSessionRelease)}
		}
		w.WriteHeader(404)
	}))
	t.Cleanup(tail.Close)
	dying := &fakeHead{t: t, fail: func(headCall) (int, string, string) { return 3, "abort", "" }}
	spare := &fakeHead{t: t}
	hd, hs := startHead(t, dying), startHead(t, spare)
	m.node(t, hd.URL, 0, 2, 1) // faster: routed first
	m.node(t, hs.URL, 0, 2, 2)
	m.node(t, tail.URL, 3, 5, 1)
	got := readStream(t, m.post(t, "/v1/chat/completions", chatBody).Body, true)
	if !got.done || got.errored != "" {
		t.Fatalf("failover stream %+v", got)
	}
	calls := dying.Calls()
	if len(calls) != 1 || calls[0].ticket == "" {
		t.Fatalf("dying head calls %+v, want one with a ticket", calls)
	}
	raw, err := ticket.FromString(calls[0].ticket)
	if err != nil {
		t.Fatal(err)
	}
	tk, err := ticket.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case d := <-deleted:
		sig, _ := base64.RawURLEncoding.DecodeString(d.release)
		if d.path != "/sessions/"+tk.SessionID || !ticket.VerifyRelease(tk.SessionID, raw, sig) {
			t.Fatalf("the tail was asked to delete %s with release %q, want /sessions/%s with the tracker's release of the failed attempt's ticket", d.path, d.release, tk.SessionID)
		}
	default:
		t.Fatal("the failed route's session was not freed on the tail")
	}
}

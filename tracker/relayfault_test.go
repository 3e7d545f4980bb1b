package tracker

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"meshgpu/relay"
)

// failingRelay stands in for relay.Client: every request fails with err.
type failingRelay struct{ err error }

func (r failingRelay) Do(context.Context, string, *http.Request) (*http.Response, error) {
	return nil, r.err
}

// relayHead registers a relay-only node of layers 0-5.
func (m *proxyMesh) relayHead(t *testing.T) string {
	t.Helper()
	c := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: m.hc, Clock: m.clk.Now}
	r := reg("", 0, 5, 6, 1)
	r.RelayAddr = "ws://127.0.0.1:1/rpc/" + c.Identity.PeerID
	mustRegister(t, c, r)
	return c.Identity.PeerID
}

func (m *proxyMesh) banned(t *testing.T, peer string) bool {
	t.Helper()
	bans, err := m.srv.reg.store.Bans(context.Background(), m.clk.Now())
	if err != nil {
		t.Fatal(err)
	}
	_, ok := bans[peer]
	return ok
}

// Only the relay client's path error is the relay's fault: a relay-only
// head whose requests fail otherwise (a reset, EOF, a crash) is banned like
// any failing head, so one that always fails cannot stay routed.
func TestRelayOnlyHeadOrdinaryErrorIsBanned(t *testing.T) {
	for _, tc := range []struct {
		name   string
		err    error
		banned bool
	}{
		{"reset", errors.New("read: connection reset by peer"), true},
		{"eof", io.ErrUnexpectedEOF, true},
		{"path", &relay.PathError{Relay: "ws://127.0.0.1:1", Peer: "p", Err: errors.New("relay not connected")}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := newProxyMesh(t, Config{Relay: failingRelay{tc.err}, MaxAttempts: 1})
			head := m.relayHead(t)
			r := m.post(t, "/v1/chat/completions", strings.Replace(chatBody, `"stream":true`, `"stream":false`, 1))
			io.Copy(io.Discard, r.Body)
			if r.StatusCode == 200 {
				t.Fatalf("chat through a failing relay: 200")
			}
			if got := m.banned(t, head); got != tc.banned {
				t.Fatalf("head banned %v after a %s error; want %v", got, tc.name, tc.banned)
			}
		})
	}
}

// A head cannot label its own failures (or a direct hop's) as relay
// outages: relay_unreachable is believed only for a relay-only hop of the
// route after the head; naming an unknown peer, the head itself or a
// direct peer bans the hop so named (the head for an unknown name).
func TestRelayUnreachableBlamingNoRelayOnlyHopIsBanned(t *testing.T) {
	for _, tc := range []struct{ name, blame string }{
		{"unknown", "head"}, {"self", "head"}, {"direct", "tail"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := newProxyMesh(t, Config{MaxAttempts: 1})
			var hop string
			h := startHead(t, &fakeHead{t: t, fail: func(headCall) (int, string, string) { return 3, "relay-event", hop }})
			headID := m.node(t, h.URL, 0, 2, 1)
			tailID := m.node(t, "http://127.0.0.1:4", 3, 5, 1)
			hop = map[string]string{"unknown": "12D3KooWnobody", "self": h.URL, "direct": "http://127.0.0.1:4"}[tc.name]
			got := readStream(t, m.post(t, "/v1/chat/completions", chatBody).Body, true)
			if got.done {
				t.Fatalf("stream finished despite the failure")
			}
			want := map[string]string{"head": headID, "tail": tailID}[tc.blame]
			if !m.banned(t, want) {
				t.Fatalf("relay_unreachable naming %q: %s not banned", hop, tc.blame)
			}
		})
	}
}

// The relay coming back clears only what the outage caused: a node with
// an endpoint was routed directly meanwhile, so a flapping relay_down does
// not end its ban; a relay-only node keeps a ban from before the outage.
func TestRelayBackKeepsBansTheOutageDidNotCause(t *testing.T) {
	m := newProxyMesh(t, Config{})
	ctx := context.Background()
	direct := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: m.hc, Clock: m.clk.Now}
	r := reg("http://127.0.0.1:4", 0, 5, 6, 1)
	r.RelayAddr = "ws://127.0.0.1:1/rpc/" + direct.Identity.PeerID
	mustRegister(t, direct, r)
	only := m.relayOnly(t, 0, 5)
	for _, c := range []*Client{direct, only} {
		if err := m.srv.reg.Ban(ctx, c.Identity.PeerID, time.Hour); err != nil {
			t.Fatal(err)
		}
	}
	m.clk.Add(time.Second)
	for _, down := range []bool{true, false} {
		for _, c := range []*Client{direct, only} {
			if _, err := c.Heartbeat(ctx, Heartbeat{RelayDown: down}); err != nil {
				t.Fatal(err)
			}
		}
		m.clk.Add(time.Second)
	}
	if !m.banned(t, direct.Identity.PeerID) || !m.banned(t, only.Identity.PeerID) {
		t.Fatalf("bans after a relay flap: direct %v, relay-only %v; want both kept",
			m.banned(t, direct.Identity.PeerID), m.banned(t, only.Identity.PeerID))
	}
	// A ban the relay-only node got during an outage ends with it.
	only.Heartbeat(ctx, Heartbeat{RelayDown: true})
	m.clk.Add(time.Second)
	only2 := only.Identity.PeerID
	m.srv.reg.Ban(ctx, only2, 2*time.Hour)
	m.clk.Add(time.Second)
	if _, err := only.Heartbeat(ctx, Heartbeat{}); err != nil {
		t.Fatal(err)
	}
	if m.banned(t, only2) {
		t.Fatalf("a ban from during the outage survived the relay coming back")
	}
}

// A draining head's 503 shutting_down is no failure: the tracker routes
// to another head without banning the leaving one.
func TestShuttingDownHeadIsNotBanned(t *testing.T) {
	want := reference(t, "/v1/chat/completions", chatBody, true)
	m := newProxyMesh(t, Config{})
	leaving := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(503)
		io.WriteString(w, `{"error":{"message":"the node is shutting down","type":"shutting_down"}}`)
	}))
	t.Cleanup(leaving.Close)
	leavingID := m.node(t, leaving.URL, 0, 5, 1)
	m.node(t, startHead(t, &fakeHead{t: t}).URL, 0, 5, 50) // slower: the leaving head is tried first
	got := readStream(t, m.post(t, "/v1/chat/completions", chatBody).Body, true)
	if !got.done || got.text != want.text {
		t.Fatalf("stream: %+v, want %q", got, want.text)
	}
	if m.banned(t, leavingID) {
		t.Fatalf("the draining head was banned")
	}
}

// /map does not count a relay-only node whose relay is down: the model is
// not covered while chats would get 503 relay_unavailable.
func TestMapSkipsRelayDownRelayOnlyNodes(t *testing.T) {
	m := newProxyMesh(t, Config{})
	m.node(t, "http://127.0.0.1:3", 0, 2, 1)
	tail := m.relayOnly(t, 3, 5)
	ctx := context.Background()
	if am, err := m.srv.reg.Map(ctx, "gocoder-6m"); err != nil || !am.Covered {
		t.Fatalf("map with the relay up: %+v %v; want covered", am, err)
	}
	if _, err := tail.Heartbeat(ctx, Heartbeat{RelayDown: true}); err != nil {
		t.Fatal(err)
	}
	am, err := m.srv.reg.Map(ctx, "gocoder-6m")
	if err != nil || am.Covered || am.Layers[4].Replicas != 0 {
		t.Fatalf("map with the relay down: %+v %v; want not covered, layer 4 without replicas", am, err)
	}
}

// relay_unavailable is the answer only when the relay outage makes the
// gap: with layers missing elsewhere it is the ordinary no-route answer.
func TestNoRouteNamesTheRelayOnlyWhenItMakesTheGap(t *testing.T) {
	m := newProxyMesh(t, Config{})
	ctx := context.Background()
	tail := m.relayOnly(t, 3, 5) // nothing holds layers 0-2
	if _, err := tail.Heartbeat(ctx, Heartbeat{RelayDown: true}); err != nil {
		t.Fatal(err)
	}
	_, err := m.srv.reg.Route(ctx, "gocoder-6m", 1)
	var ae *apiError
	if !errors.As(err, &ae) || ae.Type == "relay_unavailable" {
		t.Fatalf("no route with layers 0-2 missing: %v; want no relay_unavailable", err)
	}
	m.node(t, "http://127.0.0.1:3", 0, 2, 1)
	_, err = m.srv.reg.Route(ctx, "gocoder-6m", 1)
	if !errors.As(err, &ae) || ae.Type != "relay_unavailable" {
		t.Fatalf("no route with only the relay-down node missing: %v; want relay_unavailable", err)
	}
}

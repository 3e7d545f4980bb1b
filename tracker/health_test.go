package tracker

import (
	"context"
	"encoding/json"
	"io"
	"strings"
	"testing"
	"time"

	"meshgpu/internal/testenv"
	"meshgpu/wire"
)

// relayOnly registers a relay-only node of layers first-last of 6.
func (m *proxyMesh) relayOnly(t *testing.T, first, last int) *Client {
	t.Helper()
	c := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: m.hc, Clock: m.clk.Now}
	r := reg("", first, last, 6, 1)
	r.RelayAddr = "ws://127.0.0.1:1/rpc/" + c.Identity.PeerID
	mustRegister(t, c, r)
	return c
}

// A relay-only node whose heartbeat says its relay connection is down
// leaves routes at once: with nothing else holding its layers the tracker
// answers 503 relay_unavailable naming the relay, in milliseconds. The
// heartbeat saying it is back routes to it again, and ends a ban it got
// meanwhile (the outage was the path's, not the node's).
func TestRelayDownLeavesRoutesAndComesBackUnbanned(t *testing.T) {
	testenv.CheckGoroutines(t)
	m := newProxyMesh(t, Config{})
	h := startHead(t, &fakeHead{t: t})
	headID := m.node(t, h.URL, 0, 2, 1)
	tail := m.relayOnly(t, 3, 5)
	ctx := context.Background()
	if _, err := m.srv.reg.Route(ctx, "gocoder-6m", 1); err != nil {
		t.Fatalf("route before the outage: %v", err)
	}

	resp, err := tail.Heartbeat(ctx, Heartbeat{RelayDown: true})
	if err != nil || resp.Routable == nil || *resp.Routable || !strings.Contains(resp.NotRoutable, "ws://127.0.0.1:1") {
		t.Fatalf("heartbeat with the relay down: %+v %v; want routable false naming the relay", resp, err)
	}
	start := time.Now()
	r := m.post(t, "/v1/chat/completions", strings.Replace(chatBody, `"stream":true`, `"stream":false`, 1))
	b, _ := io.ReadAll(r.Body)
	took := time.Since(start)
	var e wire.ErrorBody
	json.Unmarshal(b, &e)
	if r.StatusCode != 503 || e.Error == nil || e.Error.Type != wire.TypeRelayUnavailable || !strings.Contains(e.Error.Message, "relay ws://127.0.0.1:1") ||
		!strings.Contains(e.Error.Message, tail.Identity.PeerID) || took > time.Second {
		t.Fatalf("chat during the outage: %d %s after %v; want 503 %s naming the relay and the node at once", r.StatusCode, b, took, wire.TypeRelayUnavailable)
	}
	var nodes struct{ Nodes []PublicNode }
	getJSON(t, m.hc, m.tracker.URL+"/nodes", &nodes)
	if len(nodes.Nodes) != 2 {
		t.Fatalf("nodes %+v: the cut-off node stays registered", nodes.Nodes)
	}
	for _, n := range nodes.Nodes {
		if n.RelayDown != (n.PeerID == tail.Identity.PeerID) {
			t.Fatalf("/nodes relay_down of %s: %v", n.PeerID, n.RelayDown)
		}
	}
	// The head is live, but nothing routes through it while layers 3-5
	// have no reachable node: its /ready says so.
	ok, why, _ := m.srv.reg.Routable(ctx, headID)
	if ok || !strings.Contains(why, "3-5") {
		t.Fatalf("head routable %v (%q) while its tail is cut off; want false naming layers 3-5", ok, why)
	}

	if err := m.srv.reg.Ban(ctx, tail.Identity.PeerID, time.Hour); err != nil {
		t.Fatal(err)
	}
	resp, err = tail.Heartbeat(ctx, Heartbeat{})
	if err != nil || resp.Routable == nil || !*resp.Routable {
		t.Fatalf("heartbeat with the relay back: %+v %v; want routable", resp, err)
	}
	if rt, err := m.srv.reg.Route(ctx, "gocoder-6m", 1); err != nil || len(rt.Hops) != 2 || rt.Hops[1].PeerID != tail.Identity.PeerID {
		t.Fatalf("route after the relay came back: %+v %v; want it through the node again, unbanned", rt, err)
	}
}

// A node with an endpoint and a relay address whose relay is down is
// still routed, without the relay address: the head reaches it directly.
func TestRelayDownNodeWithEndpointIsReachedDirectly(t *testing.T) {
	m := newProxyMesh(t, Config{})
	m.node(t, "http://127.0.0.1:3", 0, 2, 1)
	c := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: m.hc, Clock: m.clk.Now}
	r := reg("http://127.0.0.1:4", 3, 5, 6, 1)
	r.RelayAddr = "ws://127.0.0.1:1/rpc/" + c.Identity.PeerID
	r.RelayDown = true
	mustRegister(t, c, r)
	rt, err := m.srv.reg.Route(context.Background(), "gocoder-6m", 1)
	if err != nil || len(rt.Hops) != 2 || rt.Hops[1].RelayAddr != "" || rt.Hops[1].Endpoint != "http://127.0.0.1:4" {
		t.Fatalf("route %+v %v: want the node by its endpoint only", rt, err)
	}
}

// A head that reports relay_unreachable for a hop is not a failure of that
// hop's node: the tracker routes around it without a ban, and with no other
// node for its layers answers at once with the head's error naming the relay.
func TestProxyRelayPathFailureIsNotABan(t *testing.T) {
	testenv.CheckGoroutines(t)
	want := reference(t, "/v1/chat/completions", chatBody, true)
	m := newProxyMesh(t, Config{})
	var cut string
	head := &fakeHead{t: t, fail: func(c headCall) (int, string, string) {
		for _, h := range c.route {
			if h.PeerID == cut {
				return 3, "relay-event", h.RelayAddr
			}
		}
		return -1, "", ""
	}}
	m.node(t, startHead(t, head).URL, 0, 2, 1)
	cut = m.relayOnly(t, 3, 5).Identity.PeerID
	// Alone on layers 3-5: the client hears about the relay, fast.
	start := time.Now()
	got := readStream(t, m.post(t, "/v1/chat/completions", chatBody).Body, true)
	if got.done || !strings.Contains(got.errored, "ws://127.0.0.1:1") || time.Since(start) > 2*time.Second {
		t.Fatalf("stream with the only tail cut off: %+v after %v; want an error event naming the relay", got, time.Since(start))
	}
	bans, _ := m.srv.reg.store.Bans(context.Background(), m.clk.Now())
	if len(bans) != 0 {
		t.Fatalf("bans after a relay path failure: %v", bans)
	}
	// With a direct spare the stream completes on it, still without a ban.
	m.node(t, "http://127.0.0.1:2", 3, 5, 50) // slower: routes prefer the cut-off node first
	got = readStream(t, m.post(t, "/v1/chat/completions", chatBody).Body, true)
	if !got.done || got.text != want.text {
		t.Fatalf("stream with a spare: %+v, want %q", got, want.text)
	}
	if bans, _ := m.srv.reg.store.Bans(context.Background(), m.clk.Now()); len(bans) != 0 {
		t.Fatalf("bans after routing around a relay path failure: %v", bans)
	}
}

// POST /deregister takes a node out of /nodes and routes at once; a
// replayed goodbye does not remove the node once it registered again.
func TestDeregisterLeavesAtOnce(t *testing.T) {
	m := newProxyMesh(t, Config{})
	c := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: m.hc, Clock: m.clk.Now}
	mustRegister(t, c, reg("http://127.0.0.1:3", 0, 5, 6, 1))
	old, err := Sign(c.Identity, KindDeregister, m.clk.Now().Add(time.Millisecond), &Deregistration{})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Deregister(context.Background()); err != nil {
		t.Fatalf("deregister: %v", err)
	}
	var nodes struct{ Nodes []PublicNode }
	getJSON(t, m.hc, m.tracker.URL+"/nodes", &nodes)
	if len(nodes.Nodes) != 0 {
		t.Fatalf("nodes after deregistering: %+v", nodes.Nodes)
	}
	m.clk.Add(time.Second)
	mustRegister(t, c, reg("http://127.0.0.1:3", 0, 5, 6, 1))
	resp, err := m.hc.Post(m.tracker.URL+"/deregister", "application/json", strings.NewReader(string(old)))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	getJSON(t, m.hc, m.tracker.URL+"/nodes", &nodes)
	if resp.StatusCode != 401 || len(nodes.Nodes) != 1 {
		t.Fatalf("replayed goodbye: %d, %d nodes; want 401 and the node kept", resp.StatusCode, len(nodes.Nodes))
	}
}

// Registration and heartbeat answers say whether the tracker routes
// through the node: a head alone is registered but not routable (its
// layers 3-5 have no node); once a tail registers it is.
func TestAnswersSayWhetherTheNodeIsRoutable(t *testing.T) {
	m := newProxyMesh(t, Config{})
	head := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: m.hc, Clock: m.clk.Now}
	ans, err := head.register(context.Background(), reg("http://127.0.0.1:3", 0, 2, 6, 1))
	if err != nil || ans.Routable == nil || *ans.Routable || !strings.Contains(ans.NotRoutable, "layers 3-5") {
		t.Fatalf("register answer of a lone head: %+v %v", ans, err)
	}
	m.node(t, "http://127.0.0.1:4", 3, 5, 1)
	hb, err := head.Heartbeat(context.Background(), Heartbeat{})
	if err != nil || hb.Routable == nil || !*hb.Routable {
		t.Fatalf("heartbeat answer with the tail: %+v %v", hb, err)
	}
}

package tracker

import (
	"crypto/ed25519"
	"errors"
	"testing"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/ticket"
	"meshgpu/tracker/route"
	"meshgpu/wire"
)

// A ticket issued for a planned route verifies under the tracker's key
// only, names the route's head, and lets each node find exactly its next hop.
func TestIssueTicketForRoute(t *testing.T) {
	tr, other := newIdentity(t), newIdentity(t)
	rt := route.Route{Hops: []wire.Hop{
		{PeerID: "mg-head", Endpoint: "http://127.0.0.1:7001", StartLayer: 0, EndLayer: 1},
		{PeerID: "mg-mid", Endpoint: "http://127.0.0.1:7002", StartLayer: 2, EndLayer: 3},
		{PeerID: "mg-tail", RelayAddr: "ws://127.0.0.1:7200/rpc/mg-tail", StartLayer: 4, EndLayer: 5},
	}}
	now := time.Now()
	raw, err := IssueTicket(tr.Private, rt, "sess-9", now, 0)
	if err != nil {
		t.Fatal(err)
	}
	tk, err := ticket.Verify(raw, ticket.NewTrusted(tr.Public), now)
	if err != nil {
		t.Fatal(err)
	}
	if tk.Head != "mg-head" || tk.CheckSession("sess-9") != nil || !tk.Expiry.After(now) {
		t.Fatalf("ticket %+v", tk)
	}
	if !tk.IsNextHop("mg-mid", 1) || !tk.IsNextHop("mg-tail", 3) {
		t.Fatalf("next hops do not follow the route: %+v", tk.Hops)
	}
	if _, ok := tk.NextHop(5); ok {
		t.Fatal("the tail has a next hop")
	}
	if _, err := ticket.Verify(raw, ticket.NewTrusted(ed25519.PublicKey(other.Public)), now); !errors.Is(err, ticket.ErrUntrustedIssuer) {
		t.Fatalf("verified under another tracker's key: %v", err)
	}
	if _, err := IssueTicket(tr.Private, route.Route{Hops: rt.Hops[:1]}, "s", now, 0); err == nil {
		t.Fatal("a ticket without hops after the head was issued")
	}
}

// The proxy sends every attempt's head a ticket for exactly the route it
// sends, signed with the key the tracker publishes, for a fresh session
// id: the failover attempt gets its own.
func TestProxySendsTheRouteTicket(t *testing.T) {
	testenv.CheckGoroutines(t)
	m := newProxyMesh(t, Config{TokenTimeout: 300 * time.Millisecond})
	dying := &fakeHead{t: t, fail: func(headCall) (int, string, string) { return 2, "abort", "" }}
	spare := &fakeHead{t: t}
	hd, hs := startHead(t, dying), startHead(t, spare)
	dyingID := m.node(t, hd.URL, 0, 2, 1)
	spareID := m.node(t, hs.URL, 0, 2, 2)
	tailID := m.node(t, "http://127.0.0.1:9", 3, 5, 1)
	if res := readStream(t, m.post(t, "/v1/chat/completions", chatBody).Body, true); !res.done {
		t.Fatalf("stream: %+v", res)
	}
	var trackers []TrackerInfo
	var list struct{ Trackers []TrackerInfo }
	getJSON(t, m.hc, m.tracker.URL+"/trackers", &list)
	trackers = list.Trackers
	if len(trackers) != 1 || trackers[0].PublicKey == "" {
		t.Fatalf("GET /trackers: %+v, want the tracker with its ticket key", trackers)
	}
	pub, err := identity.ParsePublicHex(trackers[0].PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	sessions := map[string]bool{}
	for _, c := range []struct {
		head string
		call []headCall
	}{{dyingID, dying.Calls()}, {spareID, spare.Calls()}} {
		if len(c.call) != 1 {
			t.Fatalf("head %s called %d times", c.head, len(c.call))
		}
		raw, err := ticket.FromString(c.call[0].ticket)
		if err != nil {
			t.Fatalf("head %s: ticket %q: %v", c.head, c.call[0].ticket, err)
		}
		tk, err := ticket.Verify(raw, ticket.NewTrusted(pub), m.clk.Now())
		if err != nil {
			t.Fatalf("head %s: %v", c.head, err)
		}
		route := c.call[0].route
		if tk.Head != c.head || len(tk.Hops) != 1 || len(route) != 1 || tk.Hops[0].PeerID != tailID ||
			tk.Hops[0].PeerID != route[0].PeerID || tk.Hops[0].Endpoint != route[0].Endpoint || tk.Hops[0].First != 3 || tk.Hops[0].Last != 5 {
			t.Fatalf("head %s: ticket %+v for route %+v", c.head, tk, route)
		}
		if sessions[tk.SessionID] {
			t.Fatalf("session id %s reused across attempts", tk.SessionID)
		}
		sessions[tk.SessionID] = true
	}
}

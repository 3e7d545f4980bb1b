package tracker

import (
	"crypto/ed25519"
	"errors"
	"testing"
	"time"

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

package tracker

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/ticket"
	"meshgpu/wire"
)

// v3 is what a node of this version says at registration; head adds that
// it wants direct replies.
var (
	v3     = Replies{TicketVersion: ticket.Version}
	v3head = Replies{TicketVersion: ticket.Version, DirectReplies: true}
)

// registerAs registers id as a node of endpoint for layers first-last of 6
// with what it says about direct replies; the answer's error, if any.
func (m *proxyMesh) registerAs(id *identity.Identity, endpoint string, first, last int, r Replies) error {
	c := &Client{URL: m.tracker.URL, Identity: id, HTTP: m.hc, Clock: m.clk.Now}
	g := reg(endpoint, first, last, 6, 1)
	g.Replies = r
	_, err := c.Register(context.Background(), g)
	return err
}

// ticketOf verifies a head call's ticket under the mesh tracker's key.
func (m *proxyMesh) ticketOf(t *testing.T, c headCall) *ticket.Ticket {
	t.Helper()
	var list struct{ Trackers []TrackerInfo }
	getJSON(t, m.hc, m.tracker.URL+"/trackers", &list)
	if len(list.Trackers) != 1 {
		t.Fatalf("GET /trackers: %+v", list.Trackers)
	}
	pub, err := identity.ParsePublicHex(list.Trackers[0].PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := ticket.FromString(c.ticket)
	if err != nil {
		t.Fatal(err)
	}
	tk, err := ticket.Verify(raw, ticket.NewTrusted(pub), m.clk.Now())
	if err != nil {
		t.Fatal(err)
	}
	return tk
}

// lastCall is the head's latest request; it fails the test without one.
func lastCall(t *testing.T, h *fakeHead) headCall {
	t.Helper()
	calls := h.Calls()
	if len(calls) == 0 {
		t.Fatal("the head was not called")
	}
	return calls[len(calls)-1]
}

// The tracker's ticket names the head's registered endpoint (version 3)
// only when the head asked for direct replies and every node on the
// route reads version 3: one node registered without it (an older node)
// and the ticket is one every node reads, naming no head address.
func TestTicketNamesTheHeadOnlyWhenEveryNodeReadsIt(t *testing.T) {
	testenv.CheckGoroutines(t)
	m := newProxyMesh(t, Config{})
	head := &fakeHead{t: t}
	hs := startHead(t, head)
	headID, midID, tailID := newIdentity(t), newIdentity(t), newIdentity(t)
	for _, c := range []struct {
		name            string
		head, mid, tail Replies
		want            string // the head endpoint the ticket names
	}{
		{"all read version 3, the head asks", v3head, v3, v3, hs.URL},
		{"an older middle node", v3head, Replies{}, v3, ""},
		{"an older tail", v3head, v3, Replies{}, ""},
		{"a middle node that reads version 2", v3head, Replies{TicketVersion: 2}, v3, ""},
		{"the head does not ask", v3, v3, v3, ""},
		{"an older head", Replies{DirectReplies: true}, v3, v3, ""},
	} {
		m.clk.Add(time.Second) // a newer timestamp for each registration
		for _, n := range []struct {
			id          *identity.Identity
			ep          string
			first, last int
			r           Replies
		}{{headID, hs.URL, 0, 1, c.head}, {midID, "http://127.0.0.1:9", 2, 3, c.mid}, {tailID, "http://127.0.0.1:10", 4, 5, c.tail}} {
			if err := m.registerAs(n.id, n.ep, n.first, n.last, n.r); err != nil {
				t.Fatalf("%s: register: %v", c.name, err)
			}
		}
		if res := readStream(t, m.post(t, "/v1/chat/completions", chatBody).Body, true); !res.done {
			t.Fatalf("%s: stream %+v", c.name, res)
		}
		tk := m.ticketOf(t, lastCall(t, head))
		if tk.HeadEndpoint != c.want || tk.HeadRelay != "" || tk.Head != headID.PeerID || len(tk.Hops) != 2 {
			t.Errorf("%s: ticket names head %s at %q (relay %q), want %q", c.name, tk.Head, tk.HeadEndpoint, tk.HeadRelay, c.want)
		}
	}
}

// A registrant cannot make the tracker's tickets name another node's
// address as its own: the head address a ticket names is the head's own
// registered one, and an address registered to a live node is refused to
// anyone else (unless the challenge proves it answers there). Without
// that refusal the attacker, routed as a head, would have the tail send
// every answer of its sessions to the victim.
func TestRegistrantCannotClaimAnotherHeadsEndpoint(t *testing.T) {
	testenv.CheckGoroutines(t)
	m := newProxyMesh(t, Config{})
	victim := &fakeHead{t: t}
	vs := startHead(t, victim)
	victimID, attacker := newIdentity(t), newIdentity(t)
	if err := m.registerAs(victimID, vs.URL, 0, 2, v3head); err != nil {
		t.Fatal(err)
	}
	if err := m.registerAs(newIdentity(t), "http://127.0.0.1:9", 3, 5, v3); err != nil {
		t.Fatal(err)
	}
	err := m.registerAs(attacker, vs.URL, 0, 2, v3head)
	if !IsConflict(err) {
		t.Fatalf("a registration claiming the victim's endpoint: %v, want 409", err)
	}
	// Whichever head a request is routed to, a ticket naming the victim's
	// endpoint names the victim as the head.
	for i := 0; i < 8; i++ {
		if res := readStream(t, m.post(t, "/v1/chat/completions", chatBody).Body, true); !res.done {
			t.Fatalf("stream %+v", res)
		}
	}
	for _, c := range victim.Calls() {
		if tk := m.ticketOf(t, c); tk.HeadEndpoint == vs.URL && tk.Head != victimID.PeerID {
			t.Fatalf("a ticket names the victim's endpoint as the address of head %s", tk.Head)
		}
	}
}

// A client cannot choose where the tail sends its replies: whatever
// route, ticket or address its request carries, the head gets the
// tracker's route and a ticket naming the head's registered endpoint.
func TestClientCannotInjectAHeadEndpoint(t *testing.T) {
	testenv.CheckGoroutines(t)
	m := newProxyMesh(t, Config{})
	head := &fakeHead{t: t}
	hs := startHead(t, head)
	headID, evilID := newIdentity(t), newIdentity(t)
	if err := m.registerAs(headID, hs.URL, 0, 2, v3head); err != nil {
		t.Fatal(err)
	}
	tailID := newIdentity(t)
	if err := m.registerAs(tailID, "http://127.0.0.1:9", 3, 5, v3); err != nil {
		t.Fatal(err)
	}
	const evil = "http://127.0.0.1:1"
	forged, err := ticket.Sign(ticket.Ticket{SessionID: "s", Head: headID.PeerID, HeadEndpoint: evil, IssuedAt: m.clk.Now(), Expiry: m.clk.Now().Add(time.Minute),
		Hops: []ticket.Hop{{PeerID: evilID.PeerID, Endpoint: evil, First: 3, Last: 5}}}, evilID.Private)
	if err != nil {
		t.Fatal(err)
	}
	body := strings.Replace(chatBody, `"stream":true`, `"stream":true,"meshgpu":{"head_endpoint":"`+evil+`","reply_endpoint":"`+evil+`"}`, 1)
	req, _ := http.NewRequest(http.MethodPost, m.tracker.URL+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(wire.HeaderTicket, ticket.String(forged))
	req.Header.Set(wire.HeaderRoute, `[{"peer_id":"`+evilID.PeerID+`","endpoint":"`+evil+`","start_layer":3,"end_layer":5}]`)
	resp, err := m.hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if res := readStream(t, resp.Body, true); !res.done {
		t.Fatalf("stream %+v", res)
	}
	c := lastCall(t, head)
	tk := m.ticketOf(t, c) // the tracker's key, not the forger's
	if tk.HeadEndpoint != hs.URL || len(tk.Hops) != 1 || tk.Hops[0].PeerID != tailID.PeerID ||
		len(c.route) != 1 || c.route[0].PeerID != tailID.PeerID {
		t.Fatalf("the head got route %+v and a ticket naming %q with hops %+v; want the tracker's route and the head's own endpoint", c.route, tk.HeadEndpoint, tk.Hops)
	}
}

// A ticket_version outside 0-255 is refused with a clear 400, and nothing
// is stored.
func TestRegistrationRefusesABadTicketVersion(t *testing.T) {
	testenv.CheckGoroutines(t)
	m := newProxyMesh(t, Config{})
	id := newIdentity(t)
	for _, v := range []int{-1, 256, 1 << 40} {
		m.clk.Add(time.Second)
		err := m.registerAs(id, "http://127.0.0.1:9", 0, 5, Replies{TicketVersion: v})
		var se *StatusError
		if !errors.As(err, &se) || se.Status != http.StatusBadRequest || !strings.Contains(se.Message, "ticket_version") {
			t.Fatalf("ticket_version %d: %v, want 400 naming ticket_version", v, err)
		}
	}
	nodes, err := m.srv.Registry().Nodes(context.Background())
	if err != nil || len(nodes) != 0 {
		t.Fatalf("registry after refused registrations: %v %v", nodes, err)
	}
}

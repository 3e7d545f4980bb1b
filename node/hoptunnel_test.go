package node

import (
	"bytes"
	"context"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/relay"
	"meshgpu/ticket"
	"meshgpu/wire"
)

// tunnelTail serves tail through a real relay on 127.0.0.1, bridged by
// tunnel; hops reports whether the bridge serves Hop frames (a node of
// protocol version 1 does not). It returns the hop's relay_addr.
func tunnelTail(t testing.TB, tail *Server, hops bool) (relayAddr string, client *relay.Client) {
	t.Helper()
	if tail.Logger == nil {
		tail.Logger = quietLogger()
	}
	rs := &relay.Server{Logger: quietLogger()}
	u, _ := serve(t, rs.Handler())
	t.Cleanup(func() { rs.Close() })
	base := "ws" + strings.TrimPrefix(u, "http")
	id, err := identity.New()
	if err != nil {
		t.Fatal(err)
	}
	b := &relay.Bridge{RelayURL: base, Identity: id, Handler: tail.Handler(), Logger: quietLogger(),
		MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond}
	if hops {
		b.HopServer = tail
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- b.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done; tail.Close() })
	for deadline := time.Now().Add(10 * time.Second); !b.Connected(); time.Sleep(2 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("bridge did not connect")
		}
	}
	client = &relay.Client{Logger: quietLogger()}
	t.Cleanup(func() { client.Close() })
	return base + "/rpc/" + id.PeerID, client
}

// Through the relay tunnel, a chain's hops travel as Hop frames bound once
// per session, and give the same tokens as POST /forward to an old node
// behind the same relay.
func TestHopFramesThroughTheRelayTunnel(t *testing.T) {
	testenv.CheckGoroutines(t)
	run := func(hops bool) ([]int32, *Server) {
		head, headID := fakeHead(t)
		tail := &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab), PeerID: "tail", TrustedHeads: []string{headID.PeerID}}
		addr, rc := tunnelTail(t, tail, hops)
		head.Relay = rc
		p, _ := ticketedPipeline(t, head, []wire.Hop{{RelayAddr: addr, StartLayer: 3, EndLayer: 5, PeerID: "tail"}})
		ids, ae := sixSteps(p)
		if ae != nil {
			t.Fatalf("hop frames %v: %v", hops, ae)
		}
		return ids, tail
	}
	frames, tail := run(true)
	// Bound once: the tail tells the tunnel's senders apart by the source
	// peer id the relay names.
	if n := tail.metrics.bindingsN.Load(); n != 1 {
		t.Errorf("the tail got %d bindings for one session of 6 steps, want 1", n)
	}
	old, oldTail := run(false)
	if n := oldTail.metrics.bindingsN.Load(); n != 0 {
		t.Errorf("an old tail got %d bindings", n)
	}
	want := sixStepsWant()
	if len(frames) != len(want) || len(old) != len(want) || !equalIDs(frames, want, len(want)) || !equalIDs(old, want, len(want)) {
		t.Fatalf("frames %v, POST /forward %v, want %v", frames, old, want)
	}
}

// Go heap bytes per 8 KiB hop (request and activations answer), counted
// over every in-process party (client, relay, node): the payload is never
// copied onto the heap, on the direct connection or through the tunnel
// (POST /forward through the relay allocated 6.2x the payload).
func TestHopAllocationsPerHop(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts differ under the race detector")
	}
	testenv.CheckGoroutines(t)
	const hidden = 4096 // one bf16 row: 8 KiB
	payload := bytes.Repeat([]byte{0x80, 0x3f}, hidden)
	back := make([]byte, len(payload))
	into := func(n int) ([]byte, func(), error) { return back[:n], nil, nil }
	newTail := func() *Server {
		st := newFakeStack(3, 4, fkLayers, hidden, fkVocab)
		st.noop = true
		return &Server{StackForTesting: st, PeerID: "tail", Logger: quietLogger()}
	}

	direct := newTail()
	dURL := startNode(t, direct)
	hc := &HopClient{Logger: quietLogger()}
	t.Cleanup(func() { hc.Close() })
	// Through the tunnel the session is bound once too, under its ticket.
	headID := newID(t)
	tunnel := newTail()
	tunnel.TrustedHeads = []string{headID.PeerID}
	addr, rc := tunnelTail(t, tunnel, true)
	now := time.Now()
	raw, err := ticket.Sign(ticket.Ticket{SessionID: "t", Head: headID.PeerID, IssuedAt: now, Expiry: now.Add(time.Hour),
		Hops: []ticket.Hop{{PeerID: "tail", RelayAddr: addr, First: 3, Last: 4}}}, headID.Private)
	if err != nil {
		t.Fatal(err)
	}
	pass, _ := ticket.Pass{Ticket: raw, Keys: [][]byte{make([]byte, ticket.KeySize)}}.Encode()

	paths := map[string]func(pos int) (*wire.HopReply, error){
		"direct": func(pos int) (*wire.HopReply, error) {
			return hc.Do(context.Background(), dURL, allocHead("d", pos, hidden), payload, into)
		},
		"tunnel": func(pos int) (*wire.HopReply, error) {
			h := allocHead("t", pos, hidden)
			if h.Binding != nil {
				h.Binding.Ticket = pass
			}
			return rc.DoHop(context.Background(), addr, h, payload, into)
		},
	}
	for name, hop := range paths {
		pos := 0
		one := func() {
			rep, err := hop(pos)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			if rep.Status != http.StatusOK || !bytes.Equal(rep.Payload, payload) {
				t.Fatalf("%s: status %d, %d bytes back: %s", name, rep.Status, len(rep.Payload), rep.Body)
			}
			rep.ReleaseBuffer()
			pos = (pos + 1) % 200
		}
		for i := 0; i < 20; i++ {
			one() // connections, pools and bindings warm
		}
		best := testenv.HeapBytesPerRun(200, one)
		t.Logf("%s: %d heap bytes per %d-byte hop", name, best, len(payload))
		if best >= int64(len(payload)) {
			t.Errorf("%s: %d heap bytes per hop of %d bytes: the payload is copied onto the heap", name, best, len(payload))
		}
	}
}

func allocHead(session string, pos, hidden int) *wire.HopHead {
	h := &wire.HopHead{Session: session, Position: pos, NTokens: 1, Hidden: hidden, DType: wire.DTypeBF16,
		Deadline: time.Now().Add(10 * time.Second)}
	if pos == 0 {
		h.Binding = &wire.Binding{StartLayer: 3, EndLayer: 4}
	}
	return h
}

// A verify pass crosses the relay tunnel as a Hop frame and its tokens
// reply comes back through it (and as POST /forward to an old node behind
// the relay): the same accepted draft and corrected token either way. It
// runs under the route ticket like a plain hop: without one the tail,
// which takes only tickets, refuses it before running any layer.
func TestVerifyPassThroughTheRelayTunnel(t *testing.T) {
	testenv.CheckGoroutines(t)
	for _, hops := range []bool{true, false} {
		head, headID := fakeHead(t)
		tail := &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab), PeerID: "tail", TrustedHeads: []string{headID.PeerID}}
		addr, rc := tunnelTail(t, tail, hops)
		head.Relay = rc
		route := []wire.Hop{{RelayAddr: addr, StartLayer: 3, EndLayer: 5, PeerID: "tail"}}
		bare := headPipeline(t, head, "verify-unticketed", route)
		if _, ae := bare.pass(context.Background(), 0, []int32{10, 16, 99}, 0, true); ae == nil || ae.Type != "ticket_required" {
			t.Fatalf("hop frames %v: an unticketed verify pass got %+v, want 403 ticket_required", hops, ae)
		}
		p, _ := ticketedPipeline(t, head, route)
		// six layers add 6: row tokens 10, 16, 99 peak at 16, 22, 105 mod 64
		toks, ae := p.pass(context.Background(), 0, []int32{10, 16, 99}, 0, true)
		if ae != nil {
			t.Fatalf("hop frames %v: %v", hops, ae)
		}
		if len(toks) != 2 || toks[0].Token != 16 || toks[1].Token != 22 {
			t.Errorf("hop frames %v: %+v, want the accepted 16 and the corrected 22", hops, toks)
		}
	}
}

// Through the relay tunnel a session is bound once per sender: the peer
// that bound it sends unbound hops after, but another peer on the same
// relay (a stranger who learned the session id) gets 428
// binding_required, runs nothing, and the owner's stream goes on.
func TestTunnelUnboundHopsOnlyFromTheSenderThatBound(t *testing.T) {
	testenv.CheckGoroutines(t)
	const hidden = 64
	payload := bytes.Repeat([]byte{0x80, 0x3f}, hidden)
	st := newFakeStack(3, 4, fkLayers, hidden, fkVocab)
	st.noop = true
	headID := newID(t)
	tail := &Server{StackForTesting: st, PeerID: "tail", TrustedHeads: []string{headID.PeerID}, Logger: quietLogger()}
	addr, owner := tunnelTail(t, tail, true)
	stranger := &relay.Client{Logger: quietLogger()}
	t.Cleanup(func() { stranger.Close() })
	now := time.Now()
	raw, err := ticket.Sign(ticket.Ticket{SessionID: "s", Head: headID.PeerID, IssuedAt: now, Expiry: now.Add(time.Hour),
		Hops: []ticket.Hop{{PeerID: "tail", RelayAddr: addr, First: 3, Last: 4}}}, headID.Private)
	if err != nil {
		t.Fatal(err)
	}
	keys, _ := ticket.NewKeys(1)
	pass, _ := ticket.Pass{Ticket: raw, Keys: keys}.Encode()
	hop := func(c *relay.Client, pos int, bind bool) int {
		h := &wire.HopHead{Session: "s", Position: pos, NTokens: 1, Hidden: hidden, DType: wire.DTypeBF16, Deadline: time.Now().Add(10 * time.Second)}
		if bind {
			h.Binding = &wire.Binding{StartLayer: 3, EndLayer: 4, Ticket: pass}
		}
		rep, err := c.DoHop(context.Background(), addr, h, payload, nil)
		if err != nil {
			t.Fatalf("hop at %d: %v", pos, err)
		}
		defer rep.ReleaseBuffer()
		return rep.Status
	}
	if st := hop(owner, 0, true); st != http.StatusOK {
		t.Fatalf("the owner's binding hop: %d", st)
	}
	if st := hop(owner, 1, false); st != http.StatusOK {
		t.Fatalf("the owner's unbound hop: %d, want 200 (bound once per sender)", st)
	}
	if st := hop(stranger, 2, false); st != http.StatusPreconditionRequired {
		t.Fatalf("a stranger's unbound hop through the same relay: %d, want 428", st)
	}
	if st := hop(owner, 2, false); st != http.StatusOK {
		t.Fatalf("the owner's hop after the stranger's: %d", st)
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.forwards != 3 {
		t.Fatalf("the tail ran %d forward calls, want the owner's 3 (the stranger's hop ran)", st.forwards)
	}
}

// A hop to a relay-only peer whose relay is down fails once the relay
// client's reconnect wait is over, as relay_unreachable naming the relay,
// and is not retried (a second wait would only delay the tracker's
// failover): the head answers within about one wait, not two hop timeouts.
func TestHopThroughADownRelayFailsFastNamingIt(t *testing.T) {
	testenv.CheckGoroutines(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	base := "ws://" + ln.Addr().String()
	ln.Close() // nothing listens there now: connection refused
	head, _ := fakeHead(t)
	rc := &relay.Client{Logger: quietLogger(), ReconnectWait: 300 * time.Millisecond}
	t.Cleanup(func() { rc.Close() })
	head.Relay = rc
	p, _ := ticketedPipeline(t, head, []wire.Hop{{RelayAddr: base + "/rpc/mg-tail", StartLayer: 3, EndLayer: 5, PeerID: "tail"}})
	start := time.Now()
	_, ae := sixSteps(p)
	took := time.Since(start)
	if ae == nil || ae.Type != wire.TypeRelayUnreachable || !strings.Contains(ae.Message, base) || ae.Hop != "tail" {
		t.Fatalf("hop through a down relay: %+v; want %s naming %s and the hop", ae, wire.TypeRelayUnreachable, base)
	}
	if took > 2*time.Second {
		t.Fatalf("the hop failed after %v; want about one reconnect wait (300ms), no retry", took)
	}
}

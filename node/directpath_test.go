package node

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"meshgpu/hopmux"
	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/relay"
	"meshgpu/wire"
)

// directRelay is a real relay on 127.0.0.1 whose UDP observation port
// shares its TCP port, as `meshgpu relay` runs it.
func directRelay(t *testing.T) string {
	t.Helper()
	rs := &relay.Server{Logger: quietLogger()}
	u, _ := serve(t, rs.Handler())
	t.Cleanup(func() { rs.Close() })
	pc, err := net.ListenPacket("udp", strings.TrimPrefix(u, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { (&relay.Observer{}).Serve(pc); close(done) }()
	t.Cleanup(func() { pc.Close(); <-done })
	return "ws" + strings.TrimPrefix(u, "http")
}

// bridgeTail serves tail (peer id id's) through the relay at base, with
// direct paths on; it returns its relay_addr.
func bridgeTail(t *testing.T, base string, tail *Server, id *identity.Identity) string {
	t.Helper()
	b := &relay.Bridge{RelayURL: base, Identity: id, Handler: tail.Handler(), HopServer: tail, Logger: quietLogger(),
		MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- b.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	for deadline := time.Now().Add(10 * time.Second); !b.Connected(); time.Sleep(2 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("bridge did not connect")
		}
	}
	return base + "/rpc/" + id.PeerID
}

func startDirect(t *testing.T, d *DirectPaths) *DirectPaths {
	t.Helper()
	d.Listen, d.Logger = "127.0.0.1:0", quietLogger()
	if err := d.Start(); err != nil {
		t.Fatal(err)
	}
	return d
}

func waitPaths(t *testing.T, d *DirectPaths, n int) {
	t.Helper()
	for deadline := time.Now().Add(15 * time.Second); d.Paths() != n; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d direct paths after 15 s, want %d", d.Paths(), n)
		}
	}
}

// relayedPair is a relay-only tail with direct paths on, bridged to a real
// relay on 127.0.0.1, and a fake head sending it hops through that relay
// (with no direct paths of its own unless a test gives it some).
type relayedPair struct {
	addr string // the tail's relay_addr
	tail *Server
	head *Server
	rc   *relay.Client // the head's
	hop  wire.Hop
}

func newRelayedPair(t *testing.T) *relayedPair {
	t.Helper()
	base := directRelay(t)
	head, headID := fakeHead(t)
	tailID := newID(t)
	tail := &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab), PeerID: tailID.PeerID, Identity: tailID,
		TrustedHeads: []string{headID.PeerID}, Logger: quietLogger()}
	tail.Direct = startDirect(t, &DirectPaths{Identity: tailID, RelayURL: base, HopServer: tail})
	t.Cleanup(func() { tail.Close(); tail.Direct.Close() })
	addr := bridgeTail(t, base, tail, tailID)
	rc := &relay.Client{Identity: headID, Logger: quietLogger()}
	t.Cleanup(func() { rc.Close() })
	head.Relay = rc
	return &relayedPair{addr: addr, tail: tail, head: head, rc: rc,
		hop: wire.Hop{RelayAddr: addr, StartLayer: 3, EndLayer: 5, PeerID: tailID.PeerID}}
}

// A relay-only tail's hops move onto a punched path once it is proven (TCP
// when its punch works, as on loopback; QUIC when the head punches only
// QUIC), give the same tokens, and go back to the relay at once when it dies.
func TestHopsMoveToTheDirectPathAndBack(t *testing.T) {
	for _, tc := range []struct {
		path     string
		quicOnly bool
	}{{"direct-tcp", false}, {"direct", true}} {
		t.Run(tc.path, func(t *testing.T) { testHopsMoveToTheDirectPathAndBack(t, tc.path, tc.quicOnly) })
	}
}

func testHopsMoveToTheDirectPathAndBack(t *testing.T, path string, quicOnly bool) {
	testenv.CheckGoroutines(t)
	pair := newRelayedPair(t)
	head, tail, hop, tailID := pair.head, pair.tail, pair.hop, pair.tail.Identity
	head.Direct = startDirect(t, &DirectPaths{Identity: head.Identity, Relay: pair.rc, HopServer: head, QUICOnly: quicOnly})
	t.Cleanup(func() { head.Direct.Close() })

	want := sixStepsWant()
	run := func(what string) {
		t.Helper()
		p, _ := ticketedPipeline(t, head, []wire.Hop{hop})
		ids, ae := sixSteps(p)
		if ae != nil || !equalIDs(ids, want, len(want)) {
			t.Fatalf("%s: %v %v, want %v", what, ids, ae, want)
		}
	}
	sent := func(path string) float64 {
		return testutil.ToFloat64(head.metrics.sent.WithLabelValues(tailID.PeerID, path))
	}
	run("first session, through the relay while the path is punched")
	waitPaths(t, head.Direct, 1)
	relayed := sent("relay")
	run("second session, on the direct path")
	if d := sent(path); d < 6 || sent("relay") != relayed {
		t.Fatalf("second session: %v hops on %s, %v more relayed; want all 6 on %s", d, path, sent("relay")-relayed, path)
	}
	if got := testutil.ToFloat64(head.Direct.m.successes); got != 1 {
		t.Fatalf("%v punches succeeded, want 1", got)
	}
	// The head's /metrics page: hops by next peer and path, punches.
	page := scrape(t, head)
	for _, want := range []string{
		fmt.Sprintf(`meshgpu_node_peer_hops_total{path=%q,peer=%q} %v`, path, tailID.PeerID, sent(path)),
		fmt.Sprintf(`meshgpu_node_peer_hops_total{path="relay",peer=%q} %v`, tailID.PeerID, relayed),
		"meshgpu_node_punch_attempts_total 1\n", "meshgpu_node_punch_successes_total 1\n", "meshgpu_node_direct_paths 1\n",
	} {
		if !strings.Contains(page, want) {
			t.Fatalf("the head's /metrics lacks %q:\n%s", want, page)
		}
	}
	// The path dies (the tail's socket goes, or its punched connections):
	// the next session completes through the relay, the hop that found the
	// path dead retried there.
	if quicOnly {
		tail.Direct.tr.Conn.Close()
	} else {
		tail.Direct.tcpLn.Close()
		tail.Direct.closeTCPConns()
	}
	p, _ := ticketedPipeline(t, head, []wire.Hop{hop})
	ids, ae := sixSteps(p)
	if ae != nil || !equalIDs(ids, want, len(want)) {
		t.Fatalf("after the path died: %v %v, want %v", ids, ae, want)
	}
	if sent("relay") < relayed+6 {
		t.Fatalf("after the path died %v hops went through the relay, want 6", sent("relay")-relayed)
	}
}

// A candidate that answers with another key than the peer id the route
// names gets no hop (pinned TLS, as on TCP), and a dialer that was not
// introduced through the relay, or shows another key, gets no path.
func TestDirectPathRefusesAnotherPeersKey(t *testing.T) {
	testenv.CheckGoroutines(t)
	victim, imp, dialer := impostorExpecting(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	qc, err := dialer.tr.Dial(ctx, imp.Addr(), dialer.clientTLS(victim.PeerID), dialer.quicConfig())
	if err == nil {
		qc.CloseWithError(0, "")
		t.Fatal("a path to the victim's peer id was proven by the impostor's key")
	}
	if !strings.Contains(err.Error(), "not the expected peer id") {
		t.Fatalf("refused for another reason: %v", err)
	}
	// A dialer the node did not expect is refused by the node.
	qc, err = imp.tr.Dial(ctx, dialer.Addr(), imp.clientTLS(dialer.Identity.PeerID), imp.quicConfig())
	if err == nil {
		// TLS 1.3: the client learns of the refusal on its first read.
		st, serr := qc.OpenStreamSync(ctx)
		if serr == nil {
			st.Write([]byte{1})
			st.SetReadDeadline(time.Now().Add(time.Second))
			_, err = st.Read(make([]byte, 1))
		}
		qc.CloseWithError(0, "")
	}
	if err == nil || !strings.Contains(err.Error(), "bad certificate") {
		t.Fatalf("an unintroduced dialer was let in: %v", err)
	}
}

// The punched TCP path is pinned as the QUIC one: a listener on a punched
// candidate that answers with another key than the route's peer id gets
// no hop, and a dialer the node was not introduced to gets no path.
func TestPunchedTCPRefusesAnotherPeersKey(t *testing.T) {
	if !tcpPunchSupported {
		t.Skip("punched TCP paths are Linux only")
	}
	testenv.CheckGoroutines(t)
	victim, imp, dialer := impostorExpecting(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := dialer.dialTCP(ctx, nil, imp.tcpLn.Addr().(*net.TCPAddr).AddrPort(), victim.PeerID)
	if err == nil {
		c.Close()
		t.Fatal("a punched TCP path to the victim's peer id was proven by the impostor's key")
	}
	if !strings.Contains(err.Error(), "not the expected peer id") {
		t.Fatalf("refused for another reason: %v", err)
	}
	// A dialer the node did not expect is refused by the node (TLS 1.3:
	// the client learns of it on its first read).
	c, err = imp.dialTCP(ctx, nil, dialer.tcpLn.Addr().(*net.TCPAddr).AddrPort(), dialer.Identity.PeerID)
	if err == nil {
		c.Write(hopmux.Frame(hopmux.FramePing, make([]byte, 8)))
		c.SetReadDeadline(time.Now().Add(2 * time.Second))
		_, err = c.Read(make([]byte, 1))
		c.Close()
	}
	if err == nil || !strings.Contains(err.Error(), "bad certificate") {
		t.Fatalf("an unintroduced dialer was let in: %v", err)
	}
}

// impostorExpecting is a victim's identity, an impostor's direct paths
// expecting the dialer's (so only the pin can refuse the impostor), and
// the dialer's.
func impostorExpecting(t *testing.T) (victim *identity.Identity, imp, dialer *DirectPaths) {
	victim = newID(t)
	imp = startDirect(t, &DirectPaths{Identity: newID(t), HopServer: refuseAll{}})
	t.Cleanup(func() { imp.Close() })
	dialer = startDirect(t, &DirectPaths{Identity: newID(t), HopServer: refuseAll{}})
	t.Cleanup(func() { dialer.Close() })
	imp.mu.Lock()
	imp.expect[identity.PeerID(dialer.Identity.Public)] = time.Now().Add(time.Minute)
	imp.mu.Unlock()
	return victim, imp, dialer
}

type refuseAll struct{}

func (refuseAll) AcceptHop(ctx context.Context, h *wire.HopHead) hopmux.Hop {
	return hopmux.Refuse(&wire.HopReply{Status: 503, Kind: wire.ReplyError, Body: []byte(`{"error":{"message":"no","type":"busy"}}`)})
}

// scrape is the text of s's /metrics page, served on 127.0.0.1.
func scrape(t *testing.T, s *Server) string {
	t.Helper()
	u, _ := serve(t, s.Handler())
	resp, err := http.Get(u + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

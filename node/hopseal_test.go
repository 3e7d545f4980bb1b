package node

import (
	"bytes"
	"context"
	"encoding/binary"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"meshgpu/internal/testenv"
	"meshgpu/relay"
	"meshgpu/ticket"
)

// recorder keeps every byte the relay reads from its connections: all it
// forwards passes through them.
type recorder struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

type recordingListener struct {
	net.Listener
	r *recorder
}

func (l recordingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &recordingConn{Conn: c, r: l.r}, nil
}

type recordingConn struct {
	net.Conn
	r *recorder
}

func (c *recordingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.r.mu.Lock()
	c.r.buf.Write(p[:n])
	c.r.mu.Unlock()
	return n, err
}

// leaks reports the first 32-byte window of secret (at 16-byte steps)
// found in what the relay read, or -1.
func (r *recorder) leaks(secret []byte) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i := 0; i+32 <= len(secret); i += 16 {
		if bytes.Contains(r.buf.Bytes(), secret[i:i+32]) {
			return i
		}
	}
	return -1
}

// A relay that records every byte it forwards sees none of a relayed hop:
// not its activations, not the reply's (the tail echoes them), not its
// session id or route ticket. The hop is sealed to the tail's peer id
// (relay/seal.go) and still gives the tail's answer.
func TestRelayedHopsSealedEndToEnd(t *testing.T) {
	testenv.CheckGoroutines(t)
	rec := &recorder{}
	rs := &relay.Server{Logger: quietLogger()}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: rs.Handler(), ReadHeaderTimeout: 5 * time.Second}
	done := make(chan struct{})
	go func() { defer close(done); hs.Serve(recordingListener{ln, rec}) }()
	t.Cleanup(func() { rs.Close(); hs.Close(); <-done })
	base := "ws://" + ln.Addr().String()

	const hidden = 4096
	st := newFakeStack(3, 4, fkLayers, hidden, fkVocab)
	st.noop = true // the reply's activations are the hop's
	headID, tailID := newID(t), newID(t)
	tail := &Server{StackForTesting: st, PeerID: tailID.PeerID, Identity: tailID, TrustedHeads: []string{headID.PeerID}, Logger: quietLogger()}
	b := &relay.Bridge{RelayURL: base, Identity: tailID, Handler: tail.Handler(), HopServer: tail, Logger: quietLogger(),
		MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	bdone := make(chan error, 1)
	go func() { bdone <- b.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-bdone; tail.Close() })
	for deadline := time.Now().Add(10 * time.Second); !b.Connected(); time.Sleep(2 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("bridge did not connect")
		}
	}
	rc := &relay.Client{Identity: headID, Logger: quietLogger()}
	t.Cleanup(func() { rc.Close() })
	addr := base + "/rpc/" + tailID.PeerID

	// Finite bf16 values of random bits: no window repeats by chance.
	rng := rand.New(rand.NewPCG(7, 8))
	payload := make([]byte, 2*hidden)
	for i := 0; i < hidden; i++ {
		binary.LittleEndian.PutUint16(payload[2*i:], uint16(rng.UintN(2))<<15|uint16(100+rng.UintN(40))<<7|uint16(rng.UintN(128)))
	}
	const session = "sealed-session-0123456789"
	now := time.Now()
	raw, err := ticket.Sign(ticket.Ticket{SessionID: session, Head: headID.PeerID, IssuedAt: now, Expiry: now.Add(time.Hour),
		Hops: []ticket.Hop{{PeerID: tailID.PeerID, RelayAddr: addr, First: 3, Last: 4}}}, headID.Private)
	if err != nil {
		t.Fatal(err)
	}
	pass, _ := ticket.Pass{Ticket: raw, Keys: [][]byte{bytes.Repeat([]byte{0x5a}, ticket.KeySize)}}.Encode()
	for pos := 0; pos < 3; pos++ {
		h := allocHead(session, pos, hidden)
		if h.Binding != nil {
			h.Binding.Ticket = pass
		}
		rep, err := rc.DoHop(context.Background(), addr, h, payload, nil)
		if err != nil {
			t.Fatalf("relayed hop %d: %v", pos, err)
		}
		if rep.Status != http.StatusOK || !bytes.Equal(rep.Payload, payload) {
			t.Fatalf("relayed hop %d: status %d, %d bytes back: %s", pos, rep.Status, len(rep.Payload), rep.Body)
		}
	}
	if i := rec.leaks(payload); i >= 0 {
		t.Fatalf("the relay read the hop's activations in the clear (bytes %d-%d)", i, i+32)
	}
	// The ticket's peer ids and relay address are public; its signature
	// (the last 64 bytes) travels only inside the binding.
	if i := rec.leaks(raw[len(raw)-64:]); i >= 0 {
		t.Fatal("the relay read the route ticket in the clear")
	}
	rec.mu.Lock()
	sawSession := strings.Contains(rec.buf.String(), session)
	total := rec.buf.Len()
	rec.mu.Unlock()
	if sawSession || total < 3*len(payload) {
		t.Fatalf("session id seen %v, %d bytes recorded for three hops of %d", sawSession, total, len(payload))
	}
}

package relay

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"meshgpu/hopmux"
	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/wire"
)

// echoHops is a hopmux.Handler that answers a hop with its own
// activations; with held set, it holds each hop until its context ends and
// reports that on held.
type echoHops struct {
	held chan error
}

func (e *echoHops) AcceptHop(_ context.Context, h *wire.HopHead) hopmux.Hop {
	buf := make([]byte, h.PayloadLen())
	return hopmux.Accept(buf, func(ctx context.Context, ok bool) *wire.HopReply {
		if !ok {
			return nil
		}
		if e.held != nil {
			<-ctx.Done()
			e.held <- ctx.Err()
			return &wire.HopReply{Status: http.StatusGatewayTimeout, Kind: wire.ReplyError, Body: []byte(`{"error":{"message":"held","type":"timeout"}}`)}
		}
		return &wire.HopReply{Status: http.StatusOK, Kind: wire.ReplyActivations, EndLayer: 3,
			NTokens: h.NTokens, Hidden: h.Hidden, DType: h.DType, Payload: buf}
	})
}

// hopTo sends one bf16 hop of payload through c and checks that the echo
// comes back byte for byte.
func hopTo(ctx context.Context, c *Client, addr string, payload []byte) error {
	h := &wire.HopHead{Session: "s", NTokens: 1, Hidden: len(payload) / 2, DType: wire.DTypeBF16}
	if len(payload) > 1<<16 {
		h.NTokens, h.Hidden = len(payload)/(2<<13), 1<<13
	}
	rep, err := c.DoHop(ctx, addr, h, payload, nil)
	if err != nil {
		return err
	}
	defer rep.ReleaseBuffer()
	if rep.Status != http.StatusOK || !bytes.Equal(rep.Payload, payload) {
		return errors.New("the echo differs from the hop sent")
	}
	return nil
}

// A frame the socket takes only part of is finished by the writer
// goroutine before any frame queued after it: the reader sees both whole,
// in order. A borrowed body (the relay's read buffer) is copied before
// writeFast returns, since the buffer is read into again right after.
func TestFastWriteLeavesTheRestToTheWriterFirst(t *testing.T) {
	for _, borrowed := range []bool{false, true} {
		t.Run(fmt.Sprintf("borrowed=%v", borrowed), func(t *testing.T) { testFastWriteRest(t, borrowed) })
	}
}

func testFastWriteRest(t *testing.T, borrowed bool) {
	testenv.CheckGoroutines(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		accepted <- c
	}()
	out, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	in := <-accepted
	if in == nil {
		t.Fatal("accept failed")
	}
	defer in.Close()
	c := newRawConn(out, nil, 4, 5*time.Second)
	if c.fast == nil {
		t.Skip("no non-blocking writev on this platform")
	}
	done := make(chan struct{})
	go func() { defer close(done); c.writeLoop() }()
	defer func() { c.close(errors.New("test over")); <-done }()

	first := bytes.Repeat([]byte("0123456789abcdef"), 1<<18) // 4 MiB: more than an unread socket holds
	sent := bytes.Clone(first)
	second := bytes.Repeat([]byte("second frame "), 1000)
	var finished atomic.Int32
	if !c.writeFast(outMsg{head: []byte("HEAD"), body: first, done: func() { finished.Add(1) }, borrowed: borrowed}) {
		t.Fatal("writeFast wrote nothing on an empty socket")
	}
	// A frame written whole is finished before writeFast returns; a rest
	// cannot be, while nothing reads.
	partial := finished.Load() == 0
	if borrowed {
		for i := range first {
			first[i] = 'X' // the read buffer is filled with the next frames
		}
	}
	if borrowed {
		// Passed on as the relay does (passOn): queued behind the rest,
		// so copied first, before its buffer is read into again.
		f := getRelayedFrame()
		f.head = append(f.head[:0], "NEXT"...)
		b := bytes.Clone(second)
		if !passOn(c, f, passBody{b: b}, true) {
			t.Fatal("passing the second frame on failed")
		}
		for i := range b {
			b[i] = 'Y'
		}
	} else if !c.send(outMsg{head: []byte("NEXT"), body: second}) {
		t.Fatal("queueing the second frame failed")
	}
	want := append(append(append([]byte("HEAD"), sent...), "NEXT"...), second...)
	got := make([]byte, len(want))
	in.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(in, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("the frames arrived cut, mixed, out of order or changed")
	}
	waitFor(t, "first frame finished", 5*time.Second, func() bool { return finished.Load() == 1 })
	if !partial {
		t.Log("the socket took the whole frame at once: the rest path was not exercised")
	}
}

// The attacker: a peer that registers for hop frames and never reads its
// socket. Hops to it fill its socket and queue, then are refused or fail
// with its connection; meanwhile hops from the same sender tunnel to a
// healthy node are answered at once. A relay that wrote hops inline and
// blocking from the sender's read loop would hold them all up to the write
// timeout.
func TestStalledHopTargetDoesNotDelayOtherHops(t *testing.T) {
	testenv.CheckGoroutines(t)
	const writeTimeout = 3 * time.Second
	tb := newTestbed(t, nil, &Server{SendQueue: 64, WriteTimeout: writeTimeout, MaxInflightPerPeer: 32},
		func(b *Bridge) { b.HopServer = &echoHops{} })
	id, _ := identity.New()
	o := dialOpts{base: tb.relayBase, id: id, maxFrame: hopmux.DefaultMaxFrame, pingInterval: time.Second, reqTimeout: time.Second,
		handler: TransformHandler(11), hops: &echoHops{}, maxInflight: 4}
	dctx, dcancel := context.WithTimeout(context.Background(), 5*time.Second)
	stalled, err := dialTunnel(dctx, o) // never run: nothing reads its socket
	dcancel()
	if err != nil {
		t.Fatal(err)
	}
	defer stalled.c.close(errors.New("test over"))
	waitFor(t, "stalled peer registered", 5*time.Second, func() bool { return tb.relay.hasPeer(id.PeerID) })
	tb.relay.mu.Lock()
	target := tb.relay.peers[id.PeerID]
	tb.relay.mu.Unlock()

	c := &Client{BusyWait: -1, ReconnectWait: -1}
	defer c.Close()
	if err := hopTo(context.Background(), c, tb.relayAddr(), bf16Payload(1024)); err != nil {
		t.Fatalf("healthy hop before the attack: %v", err)
	}
	// 1 MiB a hop, 24 of them: more than an unread loopback socket holds,
	// within the sender's in-flight limit (which leaves room for its hops
	// to the healthy node) and the queues (so its answers are not
	// dropped with it).
	// The stalled peer answers the hop key exchange (seal.go), then never
	// reads again.
	sealed := make(chan error, 1)
	go func() {
		dl := time.Now().Add(10 * time.Second)
		for {
			typ, p, err := stalled.c.readNow(hopmux.DefaultMaxFrame, dl)
			if err != nil {
				sealed <- err
				return
			}
			if typ != hopmux.FrameRequest {
				continue
			}
			q, err := hopmux.ParseTunnelRequest(p)
			if err != nil || q.Path != wire.HopSealPath {
				sealed <- fmt.Errorf("first request %q: %v", q.Path, err)
				return
			}
			accept, _, err := acceptSeal(id, q.Peer, q.Body)
			if err != nil {
				sealed <- err
				return
			}
			a := hopmux.TunnelResponse{ID: q.ID, Status: http.StatusOK, Body: accept}
			head, _ := a.AppendHead(nil)
			sealed <- stalled.c.writeNow(append(head, accept...), dl)
			return
		}
	}()
	big := bf16Payload(1 << 19)
	var wg sync.WaitGroup
	var failed atomic.Int64
	for range 24 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			if hopTo(ctx, c, tb.relayBase+"/rpc/"+id.PeerID, big) != nil {
				failed.Add(1)
			}
		}()
	}
	if err := <-sealed; err != nil {
		t.Fatalf("the stalled peer's key exchange: %v", err)
	}
	// 8 MiB passed on: the stalled peer's socket is full, and its writer
	// stuck. A read loop that waited on that socket would never get here.
	waitFor(t, "8 hops passed on to the stalled peer", 10*time.Second, func() bool {
		target.mu.Lock()
		defer target.mu.Unlock()
		return len(target.pending) >= 8
	})
	for i := range 5 {
		t0 := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := hopTo(ctx, c, tb.relayAddr(), bf16Payload(2048))
		cancel()
		if d := time.Since(t0); err != nil || d > writeTimeout/3 {
			t.Fatalf("healthy hop %d while a peer stalls: %v after %v", i, err, d)
		}
	}
	wg.Wait()
	if failed.Load() != 24 {
		t.Fatalf("%d of 24 hops to the stalled peer failed, want all", failed.Load())
	}
	waitFor(t, "stalled peer dropped", 10*time.Second, func() bool { return !tb.relay.hasPeer(id.PeerID) })
	if got := metricValue(t, tb.relay, "meshgpu_relay_slow_peer_drops_total"); got != 1 {
		t.Fatalf("slow drops = %v, want 1", got)
	}
	if !tb.bridge.Connected() {
		t.Fatal("the healthy bridge was dropped")
	}
}

// A peer that takes a hop and never answers costs its sender an in-flight
// slot only until the relay's request timeout: the sender hears 504, and
// the slot is free again.
func TestUnansweredHopTimesOutAtTheRelay(t *testing.T) {
	testenv.CheckGoroutines(t)
	held := make(chan error, 4)
	tb := newTestbed(t, nil, &Server{RequestTimeout: 300 * time.Millisecond, MaxInflightPerPeer: 1},
		func(b *Bridge) { b.HopServer = &echoHops{held: held} })
	c := &Client{BusyWait: -1, ReconnectWait: -1}
	defer c.Close()
	for i := range 2 { // the second only gets its slot if the first was released
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		t0 := time.Now()
		err := hopTo(ctx, c, tb.relayAddr(), bf16Payload(64))
		cancel()
		var re *RelayError
		if !errors.As(err, &re) || re.Code != http.StatusGatewayTimeout {
			t.Fatalf("hop %d to a node that never answers: %v, want the relay's 504", i, err)
		}
		if d := time.Since(t0); d > 5*time.Second {
			t.Fatalf("hop %d: 504 after %v, for a request timeout of 300ms", i, d)
		}
		select {
		case <-held: // the relay's Cancel reached the node's hop
		case <-time.After(5 * time.Second):
			t.Fatalf("hop %d: the node's hop was not cancelled after the relay gave up", i)
		}
	}
	if got := metricValue(t, tb.relay, "meshgpu_relay_requests_total", "path=tunnel", "result=timeout"); got != 2 {
		t.Fatalf("timeouts counted: %v, want 2", got)
	}
}

// A hop the node holds past the bridge's request timeout is cancelled by
// the bridge itself, with no Cancel from the relay (whose own timeout is
// far longer) nor from the sender.
func TestBridgeEndsHopsPastItsRequestTimeout(t *testing.T) {
	testenv.CheckGoroutines(t)
	held := make(chan error, 1)
	tb := newTestbed(t, nil, nil, func(b *Bridge) {
		b.HopServer = &echoHops{held: held}
		b.RequestTimeout = 200 * time.Millisecond
	})
	c := &Client{BusyWait: -1, ReconnectWait: -1}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	go hopTo(ctx, c, tb.relayAddr(), bf16Payload(64))
	select {
	case err := <-held:
		if err == nil {
			t.Fatal("held hop's context ended without an error")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the bridge did not end a hop held past its 200ms request timeout")
	}
	cancel()
}

package relay

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"meshgpu/hopmux"
	"meshgpu/internal/testenv"
	"meshgpu/wire"
)

// The malicious relay of these tests is a real relay whose connection to
// the sender passes through a tamperConn: every frame each way goes
// through the test's hooks, which alter, drop or add frames, as a relay
// rewriting its own buffers would (it names the sender as the source of
// the frames it adds). The target is an honest bridge.

// injected is the first stream and request id the malicious relay uses
// for frames of its own; their answers never reach the sender.
const injected = 1 << 62

// malice holds the hooks and what the relay saw.
type malice struct {
	mu      sync.Mutex
	in, out func(f []byte) [][]byte // nil: pass; f is the tester's to keep
	conn    *tamperConn             // the sender's current connection
	hello   []byte                  // the sender's first hello (a Request frame)
	sealIDs map[uint64]bool         // the ids of the sender's hellos
	refuse  atomic.Bool             // new connections reach a relay without /tunnel
}

func (m *malice) hooks(in, out func(f []byte) [][]byte) {
	m.mu.Lock()
	m.in, m.out = in, out
	m.mu.Unlock()
}

func (m *malice) seals() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.sealIDs)
}

func (m *malice) isSeal(id uint64) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.sealIDs[id]
}

// passOut records the sender's hellos, then applies the out hook.
func (m *malice) passOut(f []byte) [][]byte {
	if hopmux.FrameType(f[0]) == hopmux.FrameRequest {
		if q, err := hopmux.ParseTunnelRequest(f[hopmux.FrameHeaderLen:]); err == nil && q.Path == wire.HopSealPath && q.ID < injected {
			m.mu.Lock()
			if m.hello == nil {
				m.hello = bytes.Clone(f)
			}
			m.sealIDs[q.ID] = true
			m.mu.Unlock()
		}
	}
	m.mu.Lock()
	out := m.out
	m.mu.Unlock()
	if out == nil {
		return [][]byte{f}
	}
	return out(f)
}

func (m *malice) passIn(f []byte) [][]byte {
	m.mu.Lock()
	in := m.in
	m.mu.Unlock()
	if in == nil {
		return [][]byte{f}
	}
	return in(f)
}

// inject writes frame to the relay on the sender's connection.
func (m *malice) inject(t *testing.T, frame []byte) {
	t.Helper()
	m.mu.Lock()
	c := m.conn
	m.mu.Unlock()
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if _, err := c.Conn.Write(frame); err != nil {
		t.Fatalf("injecting a frame: %v", err)
	}
}

// tamperConn is the sender's connection as the relay handles it.
type tamperConn struct {
	net.Conn
	m *malice

	wmu   sync.Mutex
	wbuf  []byte
	wHead bool // the HTTP upgrade request is through

	rbuf, ready []byte
	rHead       bool
	rerr        error
}

// nextUnit is the HTTP head (until head is set) or the frame at the
// start of b, nil until b holds all of it.
func nextUnit(b []byte, head bool) []byte {
	if !head {
		if i := bytes.Index(b, []byte("\r\n\r\n")); i >= 0 {
			return b[:i+4]
		}
		return nil
	}
	if len(b) < hopmux.FrameHeaderLen {
		return nil
	}
	n := hopmux.FrameHeaderLen + int(binary.BigEndian.Uint32(b[1:]))
	if len(b) < n {
		return nil
	}
	return b[:n]
}

func (c *tamperConn) Write(p []byte) (int, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.wbuf = append(c.wbuf, p...)
	for u := nextUnit(c.wbuf, c.wHead); u != nil; u = nextUnit(c.wbuf, c.wHead) {
		out := [][]byte{u}
		if c.wHead {
			out = c.m.passOut(bytes.Clone(u))
		}
		c.wHead = true
		for _, f := range out {
			if _, err := c.Conn.Write(f); err != nil {
				return 0, err
			}
		}
		c.wbuf = append(c.wbuf[:0], c.wbuf[len(u):]...)
	}
	return len(p), nil
}

func (c *tamperConn) Read(p []byte) (int, error) {
	for len(c.ready) == 0 {
		if c.rerr != nil {
			return 0, c.rerr
		}
		buf := make([]byte, 64<<10)
		n, err := c.Conn.Read(buf)
		c.rbuf = append(c.rbuf, buf[:n]...)
		c.rerr = err
		for u := nextUnit(c.rbuf, c.rHead); u != nil; u = nextUnit(c.rbuf, c.rHead) {
			in := [][]byte{u}
			if c.rHead {
				in = c.m.passIn(bytes.Clone(u))
			}
			c.rHead = true
			for _, f := range in {
				c.ready = append(c.ready, f...)
			}
			c.rbuf = append(c.rbuf[:0], c.rbuf[len(u):]...)
		}
	}
	n := copy(p, c.ready)
	c.ready = c.ready[n:]
	return n, nil
}

// countHops echoes hops (echoHops) and counts those it took.
type countHops struct {
	echoHops
	n atomic.Int32
}

func (h *countHops) AcceptHop(ctx context.Context, hh *wire.HopHead) hopmux.Hop {
	h.n.Add(1)
	return h.echoHops.AcceptHop(ctx, hh)
}

type maliceBed struct {
	*testbed
	m       *malice
	c       *Client
	hops    *countHops
	payload []byte
	noTun   atomic.Int32 // requests the relay without /tunnel saw
	rpc     atomic.Int32 // of them, to /rpc (POST /forward in the clear)
}

func newMaliceBed(t *testing.T) *maliceBed {
	testenv.CheckGoroutines(t)
	b := &maliceBed{m: &malice{sealIDs: map[uint64]bool{}}, hops: &countHops{}, payload: bf16Payload(512)}
	b.testbed = newTestbed(t, nil, nil, func(br *Bridge) { br.HopServer = b.hops })
	// After the attack starts, the relay answers /tunnel 404 (as an older
	// relay would), hoping for POST /forward over /rpc.
	old := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.noTun.Add(1)
		if strings.HasPrefix(r.URL.Path, "/rpc/") {
			b.rpc.Add(1)
		}
		writeHTTPError(w, http.StatusNotFound, "not_found", "no such path")
	}))
	t.Cleanup(old.Close)
	relayAddr := b.relayLn.Addr().String()
	b.c = &Client{BusyWait: -1, ReconnectWait: -1, NetDialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
		var d net.Dialer
		if b.m.refuse.Load() {
			return d.DialContext(ctx, network, strings.TrimPrefix(old.URL, "http://"))
		}
		nc, err := d.DialContext(ctx, network, relayAddr)
		if err != nil {
			return nil, err
		}
		tc := &tamperConn{Conn: nc, m: b.m}
		b.m.mu.Lock()
		b.m.conn = tc
		b.m.mu.Unlock()
		return tc, nil
	}}
	t.Cleanup(func() { b.c.Close() })
	return b
}

func (b *maliceBed) hop() (*wire.HopReply, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return b.hopCtx(ctx)
}

func (b *maliceBed) hopCtx(ctx context.Context) (*wire.HopReply, error) {
	h := &wire.HopHead{Session: "s", NTokens: 1, Hidden: len(b.payload) / 2, DType: wire.DTypeBF16}
	return b.c.DoHop(ctx, b.relayAddr(), h, b.payload, nil)
}

// honestHop sends a hop that must come back echoed.
func (b *maliceBed) honestHop(t *testing.T) {
	t.Helper()
	rep, err := b.hop()
	if err != nil {
		t.Fatalf("hop through the honest relay: %v", err)
	}
	defer rep.ReleaseBuffer()
	if rep.Status != http.StatusOK || !bytes.Equal(rep.Payload, b.payload) {
		t.Fatalf("hop through the honest relay: status %d %s", rep.Status, rep.Body)
	}
}

// wantPathError: the hop failed as the relay path's, which a node reports
// as relay_unreachable (routed around, the peer not banned), and not as
// "no hop frames", which would send the hop in the clear.
func wantPathError(t *testing.T, rep *wire.HopReply, err error) {
	t.Helper()
	var pe *PathError
	switch {
	case err == nil:
		t.Fatalf("the hop was answered %d %s: the peer is blamed for what the relay did", rep.Status, rep.Body)
	case errors.Is(err, wire.ErrHopFramesUnsupported):
		t.Fatalf("%v: the sender falls back to plain POST /forward", err)
	case !errors.As(err, &pe):
		t.Fatalf("%v: not a *PathError, so the peer is reported hop_unreachable and banned", err)
	}
}

func isHopReply(f []byte) bool { return hopmux.FrameType(f[0]) == hopmux.FrameHopReply }
func streamOf(f []byte) uint64 { return binary.BigEndian.Uint64(f[hopmux.FrameHeaderLen:]) }
func sealedReply(f []byte) bool {
	return isHopReply(f) && f[hopmux.FrameHeaderLen+10] == wire.ReplySealed
}

// sealedHop reports a sealed Hop frame of the sender.
func sealedHop(f []byte) bool {
	if hopmux.FrameType(f[0]) != hopmux.FrameHop || streamOf(f) >= injected {
		return false
	}
	at := hopmux.FrameHeaderLen + 9 + int(f[hopmux.FrameHeaderLen+8])
	return binary.BigEndian.Uint32(f[at:]) == wire.SealedHopMark
}

// plainReply is a HopReply frame answering stream with rep.
func plainReply(t *testing.T, stream uint64, rep *wire.HopReply) []byte {
	f, err := hopmux.AppendHopReplyFrame(nil, stream, rep)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// The relay alters what it carries so that the hop fails; each way must
// end with the hop failed as the relay path's (the node routes around the
// relay without banning the honest peer), never with the peer's error,
// never with a fallback to plain hops.
func TestMaliciousRelayBlamesNoPeer(t *testing.T) {
	t.Run("flipped sealed reply", func(t *testing.T) {
		b := newMaliceBed(t)
		b.honestHop(t)
		b.m.hooks(func(f []byte) [][]byte {
			if sealedReply(f) {
				f[len(f)-1] ^= 1
			}
			return [][]byte{f}
		}, nil)
		rep, err := b.hop()
		wantPathError(t, rep, err)
	})
	t.Run("truncated sealed reply", func(t *testing.T) {
		// 11 bytes of reply head and 2 of seal prefix: the tunnel ends; the
		// hop waiting for it must fail, not wait forever.
		b := newMaliceBed(t)
		b.honestHop(t)
		b.m.hooks(func(f []byte) [][]byte {
			if sealedReply(f) {
				body := f[hopmux.FrameHeaderLen : hopmux.FrameHeaderLen+13]
				return [][]byte{append(hopmux.AppendHeader(nil, hopmux.FrameHopReply, len(body)), body...)}
			}
			return [][]byte{f}
		}, nil)
		done := make(chan error, 1)
		go func() {
			_, err := b.hop()
			done <- err
		}()
		select {
		case err := <-done:
			if err == nil {
				t.Fatal("a truncated sealed reply answered the hop")
			}
		case <-time.After(20 * time.Second):
			t.Fatal("the hop still waits 20 s after a truncated sealed reply (its waiter was never answered)")
		}
	})
	t.Run("unsealed reply", func(t *testing.T) {
		b := newMaliceBed(t)
		b.honestHop(t)
		b.m.hooks(func(f []byte) [][]byte {
			if sealedReply(f) {
				return [][]byte{plainReply(t, streamOf(f), hopmux.ErrorReply(http.StatusBadGateway, "bad_hop_response", "the tail lied"))}
			}
			return [][]byte{f}
		}, nil)
		rep, err := b.hop()
		wantPathError(t, rep, err)
	})
	t.Run("seal_unknown every time", func(t *testing.T) {
		b := newMaliceBed(t)
		b.honestHop(t)
		b.m.hooks(func(f []byte) [][]byte {
			if sealedReply(f) {
				return [][]byte{plainReply(t, streamOf(f), hopmux.ErrorReply(http.StatusUnauthorized, wire.TypeSealUnknown, "unknown hop key"))}
			}
			return [][]byte{f}
		}, nil)
		rep, err := b.hop()
		wantPathError(t, rep, err)
		if n := b.m.seals(); n != 2 {
			t.Fatalf("%d key exchanges; want 2 (one again after the first seal_unknown)", n)
		}
	})
	t.Run("403 to the key exchange", func(t *testing.T) {
		b := newMaliceBed(t)
		b.m.hooks(func(f []byte) [][]byte {
			if hopmux.FrameType(f[0]) != hopmux.FrameResponse {
				return [][]byte{f}
			}
			a, err := hopmux.ParseTunnelResponse(f[hopmux.FrameHeaderLen:])
			if err != nil || !b.m.isSeal(a.ID) {
				return [][]byte{f}
			}
			a.Status, a.Body = http.StatusForbidden, []byte(`{"error":{"message":"hello refused","type":"seal_refused"}}`)
			head, _ := a.AppendHead(nil)
			return [][]byte{append(head, a.Body...)}
		}, nil)
		rep, err := b.hop()
		wantPathError(t, rep, err)
	})
	t.Run("404 at /tunnel after a sealed hop", func(t *testing.T) {
		b := newMaliceBed(t)
		b.honestHop(t)
		b.m.refuse.Store(true)
		b.m.mu.Lock()
		b.m.conn.Close()
		b.m.mu.Unlock()
		// The first hop redials and is told there is no tunnel; the second
		// finds the relay marked as having none.
		for i := 0; i < 2; i++ {
			rep, err := b.hop()
			wantPathError(t, rep, err)
		}
		if b.noTun.Load() == 0 || b.rpc.Load() != 0 {
			t.Fatalf("the relay without /tunnel saw %d requests, %d to /rpc", b.noTun.Load(), b.rpc.Load())
		}
	})
	t.Run("harvested bad_seal", func(t *testing.T) {
		// The relay sends a garbage frame with a real hop's key id and
		// counter, passes the target's answer to it off as the real hop's
		// and drops the real answer.
		b := newMaliceBed(t)
		b.honestHop(t)
		var real atomic.Uint64
		b.m.hooks(func(f []byte) [][]byte {
			switch {
			case !isHopReply(f):
			case streamOf(f) == injected:
				binary.BigEndian.PutUint64(f[hopmux.FrameHeaderLen:], real.Load())
			case streamOf(f) == real.Load():
				return nil
			}
			return [][]byte{f}
		}, func(f []byte) [][]byte {
			if !sealedHop(f) {
				return [][]byte{f}
			}
			real.Store(streamOf(f))
			forged := bytes.Clone(f)
			binary.BigEndian.PutUint64(forged[hopmux.FrameHeaderLen:], injected)
			forged[len(forged)-1] ^= 1
			return [][]byte{f, forged}
		})
		rep, err := b.hop()
		wantPathError(t, rep, err)
	})
	t.Run("old peer answers 404 to the key exchange", func(t *testing.T) {
		// Trust on first contact, as for POST /forward: a peer that never
		// sealed and has no /hop/seal takes plain hops, and is not blamed.
		b := newMaliceBed(t)
		b.m.hooks(func(f []byte) [][]byte {
			if hopmux.FrameType(f[0]) != hopmux.FrameResponse {
				return [][]byte{f}
			}
			a, err := hopmux.ParseTunnelResponse(f[hopmux.FrameHeaderLen:])
			if err != nil || !b.m.isSeal(a.ID) {
				return [][]byte{f}
			}
			a.Status, a.Body = http.StatusNotFound, []byte("404 page not found\n")
			head, _ := a.AppendHead(nil)
			return [][]byte{append(head, a.Body...)}
		}, nil)
		if _, err := b.hop(); !errors.Is(err, wire.ErrHopFramesUnsupported) {
			t.Fatalf("hop to an old peer: %v; want wire.ErrHopFramesUnsupported (POST /forward next)", err)
		}
		if st, _, _ := doHop(t, b.c, b.relayAddr(), b.payload, 0); st != http.StatusOK {
			t.Fatalf("POST /forward to the old peer: %d", st)
		}
	})
}

// Hellos carry nothing fresh, so the relay can replay one as often as it
// likes: each replaces only the pending keys of its sender, and the keys
// in use stay (before: each took a slot of 1024 and a random one was
// evicted, so the honest sender's keys went, and with them its hops).
func TestReplayedHellosEvictNoKeys(t *testing.T) {
	b := newMaliceBed(t)
	b.honestHop(t)
	answered := make(chan struct{}, 1)
	b.m.hooks(func(f []byte) [][]byte {
		var id uint64
		switch hopmux.FrameType(f[0]) {
		case hopmux.FrameResponse:
			a, _ := hopmux.ParseTunnelResponse(f[hopmux.FrameHeaderLen:])
			id = a.ID
		case hopmux.FrameError:
			e, _ := hopmux.ParseTunnelError(f[hopmux.FrameHeaderLen:])
			id = e.ID
		}
		if id >= injected {
			answered <- struct{}{}
			return nil
		}
		return [][]byte{f}
	}, nil)
	b.m.mu.Lock()
	hello := b.m.hello
	b.m.mu.Unlock()
	q, err := hopmux.ParseTunnelRequest(hello[hopmux.FrameHeaderLen:])
	if err != nil {
		t.Fatal(err)
	}
	replays := 4 * maxSealPeers
	if raceEnabled {
		replays = maxSealPeers + 64
	}
	for i := range replays {
		q.ID = injected + uint64(i)
		head, _ := q.AppendHead(nil)
		b.m.inject(t, append(head, q.Body...))
		select {
		case <-answered:
		case <-time.After(10 * time.Second):
			t.Fatalf("replayed hello %d not answered", i)
		}
	}
	for range 3 {
		b.honestHop(t)
	}
	if n := b.m.seals(); n != 1 {
		t.Fatalf("the sender exchanged keys %d times; want once (its keys were evicted)", n)
	}
}

// The relay injects a plain Hop frame in the name of a sender that seals
// its hops (it saw tickets in clear elsewhere): the target refuses it.
func TestPlainHopInASealingPeersNameRefused(t *testing.T) {
	b := newMaliceBed(t)
	b.honestHop(t)
	served := b.hops.n.Load()
	got := make(chan []byte, 1)
	b.m.hooks(func(f []byte) [][]byte {
		if isHopReply(f) && streamOf(f) == injected {
			got <- f
			return nil
		}
		return [][]byte{f}
	}, nil)
	h := &wire.HopHead{Session: "injected", NTokens: 1, Hidden: len(b.payload) / 2, DType: wire.DTypeBF16}
	head, err := hopmux.AppendHopFrame(nil, injected, b.bridge.Identity.PeerID, h, len(b.payload))
	if err != nil {
		t.Fatal(err)
	}
	b.m.inject(t, append(head, b.payload...))
	var f []byte
	select {
	case f = <-got:
	case <-time.After(10 * time.Second):
		t.Fatal("no answer to the injected hop")
	}
	_, rep, err := hopmux.ReadHopReply(bytes.NewReader(f[hopmux.FrameHeaderLen:]), len(f)-hopmux.FrameHeaderLen, nil)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Status != http.StatusForbidden || b.hops.n.Load() != served {
		t.Fatalf("the injected plain hop was answered %d %s; the target took %d hops, want %d", rep.Status, rep.Body, b.hops.n.Load(), served)
	}
	b.honestHop(t)
}

// The relay withholds the answer to a key exchange: a second hop to the
// same peer still ends at its own deadline, not at the first one's.
func TestWithheldKeyExchangeKeepsEachHopsDeadline(t *testing.T) {
	b := newMaliceBed(t)
	b.m.hooks(func(f []byte) [][]byte {
		if hopmux.FrameType(f[0]) == hopmux.FrameResponse {
			if a, err := hopmux.ParseTunnelResponse(f[hopmux.FrameHeaderLen:]); err == nil && b.m.isSeal(a.ID) {
				return nil
			}
		}
		return [][]byte{f}
	}, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	first := make(chan error, 1)
	go func() { _, err := b.hopCtx(ctx); first <- err }()
	waitFor(t, "the first hop's key exchange", 10*time.Second, func() bool { return b.m.seals() == 1 })
	const own = 200 * time.Millisecond
	start := time.Now()
	sctx, scancel := context.WithTimeout(context.Background(), own)
	_, err := b.hopCtx(sctx)
	scancel()
	took := time.Since(start)
	cancel()
	<-first
	if !errors.Is(err, context.DeadlineExceeded) || took > 5*time.Second {
		t.Fatalf("the second hop ended after %v with %v; want its own deadline (%v)", took, err, own)
	}
}

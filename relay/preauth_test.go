package relay

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"meshgpu/hopmux"
	"meshgpu/internal/testenv"
	"meshgpu/wire"
)

// totalAlloc is the bytes the process has allocated so far.
func totalAlloc() uint64 {
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.TotalAlloc
}

// unauthTunnel opens GET /tunnel upgraded to the raw tunnel from ip and reads
// the relay's challenge frame; the answer's status when it refused.
func unauthTunnel(t *testing.T, relayAddr, ip string) (net.Conn, *bufio.Reader, int) {
	t.Helper()
	c, err := testenv.DialerFrom(t, ip).Dial("tcp", relayAddr)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(c, "GET /tunnel HTTP/1.1\r\nHost: relay\r\nConnection: Upgrade\r\nUpgrade: %s\r\n\r\n", RawTunnelUpgrade)
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		c.Close()
		t.Fatalf("tunnel upgrade from %s: %v", ip, err)
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		b, _ := io.ReadAll(resp.Body)
		c.Close()
		if we, ok := wire.DecodeError(resp.StatusCode, b); !ok || we.Type == "" {
			t.Errorf("refused tunnel: HTTP %d without a JSON error: %q", resp.StatusCode, b)
		}
		return nil, nil, resp.StatusCode
	}
	if typ, _, err := hopmux.ReadFrame(br, 1<<10); err != nil || typ != hopmux.FrameServerChallenge {
		c.Close()
		t.Fatalf("tunnel from %s: first frame %v, %v; want the challenge", ip, typ, err)
	}
	return c, br, resp.StatusCode
}

// legitimateHop checks that the relay still carries a peer's hop.
func legitimateHop(t *testing.T, tb *testbed) {
	t.Helper()
	c := &Client{DisableTunnel: true}
	defer c.Close()
	in := bf16Payload(512)
	status, _, body := doHop(t, c, tb.relayAddr(), in, 6)
	if status != 200 || !bytes.Equal(body, refTransform(in)) {
		t.Fatalf("legitimate hop through the relay during the flood: HTTP %d, %d bytes", status, len(body))
	}
}

// Hello floods before authentication (the issue: 40 raw tunnels each
// declaring a 16 MiB ClientHello took a relay from 34 to 684 MB; a /ws
// registration could be an envelope's size): the relay refuses a hello
// over hopmux.MaxTunnelHello when its header arrives, without allocating
// what it declares, and keeps carrying a registered peer's hops.
func TestHelloFloodDoesNotGrowRelay(t *testing.T) {
	tb := newTestbed(t, nil, nil, nil)
	addr := strings.TrimPrefix(tb.relayBase, "ws://")
	legitimateHop(t, tb)

	const tunnels, declared = 40, 16 << 20
	big := []byte(`{"type":"register","peer_id":"mg-x","join_token":"` + strings.Repeat("a", 8<<20) + `"}`)
	chunk := make([]byte, 32<<10)
	before := totalAlloc()
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for i := range tunnels {
		ip := fmt.Sprintf("127.0.0.%d", 2+i%4) // 10 a source: under the per-source limit
		c, _, status := unauthTunnel(t, addr, ip)
		if c == nil {
			t.Fatalf("tunnel %d from %s: HTTP %d before its hello", i, ip, status)
		}
		conns = append(conns, c)
		// The header of a 16 MiB hello, and a first 32 KiB of it.
		c.SetWriteDeadline(time.Now().Add(5 * time.Second))
		c.Write(hopmux.AppendHeader(nil, hopmux.FrameClientHello, declared))
		c.Write(chunk)
	}
	// Four /ws registrations of 8 MiB each.
	for i := range 4 {
		d := websocket.Dialer{NetDialContext: testenv.DialerFrom(t, "127.0.0.6").DialContext}
		ws, _, err := d.Dial(tb.relayBase+"/ws", nil)
		if err != nil {
			t.Fatal(err)
		}
		defer ws.Close()
		ws.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, _, err := ws.ReadMessage(); err != nil {
			t.Fatalf("/ws %d: no challenge: %v", i, err)
		}
		ws.SetWriteDeadline(time.Now().Add(10 * time.Second))
		ws.WriteMessage(websocket.TextMessage, big) // may fail: the relay closes early
	}
	legitimateHop(t, tb)
	// Each flooding connection is closed by the relay at its hello, well
	// before the 10 s handshake timeout.
	for i, c := range conns {
		c.SetReadDeadline(time.Now().Add(3 * time.Second))
		_, err := io.Copy(io.Discard, c)
		if ne, ok := err.(net.Error); ok && ne.Timeout() {
			t.Errorf("tunnel %d: still open 3 s after declaring a %d-byte hello", i, declared)
		}
	}
	grown := totalAlloc() - before
	t.Logf("relay and test allocated %.1f MiB during the flood (%d MiB declared)", float64(grown)/(1<<20), (tunnels*declared+4*8<<20)>>20)
	if grown > 64<<20 {
		t.Errorf("allocated %.0f MiB during a flood declaring %d MiB of hellos; want a few MiB", float64(grown)/(1<<20), (tunnels*declared)>>20)
	}
}

// /rpc envelopes to a peer that is not connected (the issue: 30
// concurrent 15 MiB envelopes grew the relay by 1.45 GB, each read and
// decoded before the peer was looked up): the peer is looked up first and
// such a message is read only up to absentPeerMessage, so the connection is
// closed long before the envelope is in; a small one still gets its 404
// peer_not_connected envelope (TestADRClientGetsBF16HopThroughBridge), and
// the relay keeps carrying a registered peer's hops.
func TestRPCToAbsentPeerReadsNoEnvelope(t *testing.T) {
	tb := newTestbed(t, nil, nil, nil)
	const senders, size = 30, 15 << 20
	env := []byte(`{"request_id":"1","method":"POST","path":"/forward","body":"` + strings.Repeat("A", size) + `"}`)
	before := totalAlloc()
	var wg sync.WaitGroup
	answered := make([]bool, senders)
	var sources [3]*net.Dialer // dialed from the senders' goroutines; a skip must come before
	for k := range sources {
		sources[k] = testenv.DialerFrom(t, fmt.Sprintf("127.0.0.%d", 7+k))
	}
	for i := range senders {
		wg.Go(func() {
			d := websocket.Dialer{NetDialContext: sources[i%3].DialContext, HandshakeTimeout: 5 * time.Second}
			ws, _, err := d.Dial(tb.relayBase+"/rpc/mg-nobody", nil)
			if err != nil {
				t.Errorf("/rpc %d: %v", i, err)
				return
			}
			defer ws.Close()
			ws.SetWriteDeadline(time.Now().Add(20 * time.Second))
			ws.WriteMessage(websocket.TextMessage, env) // cut off by the relay
			ws.SetReadDeadline(time.Now().Add(20 * time.Second))
			_, msg, err := ws.ReadMessage()
			answered[i] = err == nil && bytes.Contains(msg, []byte(`"status":200`))
		})
	}
	legitimateHop(t, tb)
	wg.Wait()
	grown := totalAlloc() - before
	for i, ok := range answered {
		if ok {
			t.Errorf("/rpc %d to an absent peer was answered 200", i)
		}
	}
	t.Logf("allocated %.1f MiB during %d envelopes of %d MiB", float64(grown)/(1<<20), senders, size>>20)
	if grown > 64<<20 {
		t.Errorf("allocated %.0f MiB for %d envelopes to an absent peer; want none read", float64(grown)/(1<<20), senders)
	}
}

// Connections that never authenticate hold at most
// MaxUnauthenticatedPerSource slots of one source: silent raw tunnels
// after the challenge, and /rpc requests to a connected peer whose message
// never ends. The next from that source gets 429 rate_limited (JSON);
// another source (the registered peer's sender) is served; once the
// stalled ones go, the source is served again.
func TestUnauthenticatedConnectionsLimitedPerSource(t *testing.T) {
	tb := newTestbed(t, nil, &Server{MaxUnauthenticatedPerSource: 4}, nil)
	addr := strings.TrimPrefix(tb.relayBase, "ws://")

	var held []io.Closer
	for i := range 4 {
		c, _, status := unauthTunnel(t, addr, "127.0.0.8")
		if c == nil {
			t.Fatalf("tunnel %d: HTTP %d within the limit", i, status)
		}
		held = append(held, c)
	}
	if c, _, status := unauthTunnel(t, addr, "127.0.0.8"); c != nil || status != http.StatusTooManyRequests {
		if c != nil {
			c.Close()
		}
		t.Errorf("5th silent tunnel from one source: HTTP %d; want 429", status)
	}
	// /rpc to the real peer: a message started and never finished.
	d := websocket.Dialer{NetDialContext: testenv.DialerFrom(t, "127.0.0.9").DialContext, HandshakeTimeout: 5 * time.Second}
	for i := range 4 {
		ws, _, err := d.Dial(tb.relayAddr(), nil)
		if err != nil {
			t.Fatalf("/rpc %d within the limit: %v", i, err)
		}
		w, _ := ws.NextWriter(websocket.TextMessage)
		w.Write([]byte(`{"request_id":"1","method":"POST","path":"/forward","body":"` + strings.Repeat("A", 64<<10)))
		// w is never closed: the message has no end
		held = append(held, ws.NetConn())
	}
	ws, resp, err := d.Dial(tb.relayAddr(), nil)
	if err == nil {
		ws.Close()
		t.Errorf("5th unfinished /rpc from one source was upgraded; want 429")
	} else if resp == nil || resp.StatusCode != http.StatusTooManyRequests {
		t.Errorf("5th unfinished /rpc from one source: %v; want 429", err)
	} else if re := httpRelayError(resp).(*RelayError); re.Type != wire.TypeRateLimited {
		t.Errorf("5th unfinished /rpc: type %q, want %q", re.Type, wire.TypeRateLimited)
	}
	legitimateHop(t, tb) // from 127.0.0.1

	for _, c := range held {
		c.Close()
	}
	waitFor(t, "the stalled connections' slots to free", 5*time.Second, func() bool {
		tb.relay.mu.Lock()
		defer tb.relay.mu.Unlock()
		return tb.relay.unauthAll == 0
	})
	c, _, status := unauthTunnel(t, addr, "127.0.0.8")
	if c == nil {
		t.Fatalf("a tunnel after the stalled ones closed: HTTP %d", status)
	}
	c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ws, _, err = d.DialContext(ctx, tb.relayAddr(), nil)
	if err != nil {
		t.Fatalf("/rpc after the stalled ones closed: %v", err)
	}
	ws.Close()
}

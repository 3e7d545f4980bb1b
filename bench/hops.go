package bench

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"runtime"
	"strconv"
	"strings"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/wirecount"
	"meshgpu/node"
	"meshgpu/relay"
	"meshgpu/ticket"
	"meshgpu/wire"
)

// Hop series names (docs/performance.md, "Bench suites").
const (
	SeriesRawTCP      = "raw-tcp"
	SeriesDirect      = "direct"
	SeriesRelayRPC    = "relay-rpc"
	SeriesRelayTunnel = "relay-tunnel"
	// SeriesDirectTLS is direct over TLS pinned to the node's peer id
	// (node.ServeTLSAndPlain, identity.ClientTLSConfig), what nodes use by
	// default: the same hop connection as direct, encrypted.
	SeriesDirectTLS = "direct-tls"
)

// HopSeries lists the hops suite's series in table order.
var HopSeries = []string{SeriesRawTCP, SeriesDirect, SeriesRelayRPC, SeriesRelayTunnel, SeriesDirectTLS}

// HopsConfig sizes the hops suite.
type HopsConfig struct {
	N          int   // measured hops per series and payload (default 500)
	Warmup     int   // unmeasured hops first (default 50)
	PayloadKiB []int // bf16 payloads (default 4 and 8: one row of hidden 2048 and 4096)
	// RTT, when set, emulates a network link of this round-trip time on
	// every connection (client to node, client to relay, node to relay):
	// what each protocol's round trips cost over a WAN.
	RTT time.Duration
	// TLS serves the node and the relay over TLS (https, wss: a relay on the
	// internet, as ADR-0014 reaches it) and the raw baseline over TLS too.
	TLS    bool
	Logger *slog.Logger
}

// maxHopPayloadKiB keeps a hop within the relay's default 16 MiB frame
// (the /rpc envelope base64-encodes it) and a typo from allocating gigabytes.
const maxHopPayloadKiB = 4 << 10

// maxHopRTT bounds the emulated round-trip time (a hop over /rpc waits
// about five of them, and every series runs N+Warmup hops).
const maxHopRTT = 500 * time.Millisecond

// hopTimeout bounds one measured hop.
const hopTimeout = 10 * time.Second

// hopPositions is where the suite's sessions wrap: position 0 again
// truncates the KV cache (a node allows redoing lower positions).
const hopPositions = 4096

// Hops measures the latency one hop adds per token on loopback: a real
// node.Server (with a pass-through stack, so no compute) reached over its
// hop connection (plain and TLS), through a relay's per-request /rpc
// WebSocket and through the relay tunnel, against raw TCP round trips of
// the same bytes. The series are interleaved hop by hop, so a noisy
// neighbour slows all of them alike; relay-rpc, itself the noisiest, runs
// in a pass of its own after them.
func Hops(ctx context.Context, cfg HopsConfig) (*Report, error) {
	if cfg.N <= 0 {
		cfg.N = 500
	}
	if cfg.Warmup <= 0 {
		cfg.Warmup = 50
	}
	if len(cfg.PayloadKiB) == 0 {
		cfg.PayloadKiB = []int{4, 8}
	}
	if cfg.RTT < 0 || cfg.RTT > maxHopRTT {
		return nil, fmt.Errorf("--rtt %v: want 0 (plain loopback) to %v", cfg.RTT, maxHopRTT)
	}
	for _, k := range cfg.PayloadKiB {
		if k <= 0 || k > maxHopPayloadKiB {
			return nil, fmt.Errorf("payload %d KiB: want 1 to %d", k, maxHopPayloadKiB)
		}
		if _, _, err := payloadShape(k); err != nil {
			return nil, err
		}
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}

	lk, err := newLink(cfg.RTT, cfg.TLS)
	if err != nil {
		return nil, err
	}
	baseline := "raw loopback TCP round trip of the same bytes (length-prefixed echo)"
	if cfg.TLS {
		baseline = "raw loopback TLS round trip of the same bytes (length-prefixed echo on one kept-alive connection)"
	}
	rep := NewReport("hops", "payload KiB", "µs", baseline)
	rep.LogY = true
	if cfg.RTT > 0 {
		rep.Notes = append(rep.Notes, "round_trips: p50 over the link's RTT: how many round trips a hop waits for")
		rep.Notes = append(rep.Notes, fmt.Sprintf("link: every connection (client-node, client-relay, node-relay) crosses an emulated %v round trip (internal/linkdelay): connecting costs one RTT, each wait for an answer one more", cfg.RTT))
	}
	if cfg.TLS {
		rep.Notes = append(rep.Notes, "tls: the relay serves TLS 1.3 with an ECDSA P-256 certificate (wss) and the raw baseline runs over TLS; /rpc pays a handshake per hop, the tunnel one per connection; the node's own TLS is the direct-tls series")
	}
	rep.Notes = append(rep.Notes,
		"added_p50/added_p99: the series' percentile minus raw-tcp's at the same payload",
		"added_p50_direct: the series' p50 minus direct's (what the relay costs over HTTP straight to the node)",
		"p50_per_tunnel: relay-rpc's p50 divided by relay-tunnel's at the same payload",
		"added_p50_floor: a relayed series' p50 minus two raw-tcp p50s (a relayed hop crosses two links: its floor)",
		"wire_B: bytes on the client's sockets per hop, both directions (relay: client to relay only)",
		"direct-tls: direct over TLS 1.3 pinned to the node's peer id (its Ed25519 key, self-signed; the node serves TLS and plain on one port); added_p50_direct is what the encryption costs per hop, tls_per_plain its p50 over direct's",
		"every hop runs under a route ticket: direct, direct-tls and relay-tunnel bind once per session (one Ed25519 verify), relay-rpc carries the ticket on every hop",
		"the node runs node.Server with a pass-through stack: protocol cost only, no compute",
		"order: raw-tcp, direct, relay-tunnel and direct-tls interleaved hop by hop, then relay-rpc in a pass of its own (its per-hop WebSocket teardown and garbage slowed the series after it 2-3x; its added_* and p50_per_tunnel compare with the first pass); alloc_B from a second, untimed pass")

	rl, err := startRelay(log, lk)
	if err != nil {
		return nil, err
	}
	defer rl.Close()
	eln, err := lk.listen()
	if err != nil {
		return nil, err
	}
	echo := startEcho(eln)
	defer echo.Close()

	for _, kib := range cfg.PayloadKiB {
		if err := hopsAt(ctx, rep, rl, lk, echo.Addr(), kib, cfg, log); err != nil {
			return nil, fmt.Errorf("payload %d KiB: %w", kib, err)
		}
	}
	return rep, nil
}

func hopsAt(ctx context.Context, rep *Report, rl *benchRelay, lk link, echoAddr string, kib int, cfg HopsConfig, log *slog.Logger) error {
	size := kib << 10
	rows, hidden, _ := payloadShape(kib)
	// The node takes hops only under route tickets, as in a mesh: the
	// suite signs them as a static head would (node/tickets.go).
	headID, err := identity.New()
	if err != nil {
		return err
	}
	nd, err := startBenchNode(ctx, &node.Server{StackForTesting: newPassStack(2, 5, 8, hidden), TrustedHeads: []string{headID.PeerID}, Logger: log}, rl, lk, log)
	if err != nil {
		return err
	}
	defer nd.Close()
	relayAddr := rl.base + "/rpc/" + nd.id.PeerID
	passes := map[string][]byte{}
	for _, session := range []string{"bench-direct", "bench-rpc", "bench-tunnel", "bench-tls"} {
		if passes[session], err = benchPass(headID, nd.id.PeerID, nd.url, relayAddr, session); err != nil {
			return err
		}
	}
	bound := func(h *wire.HopHead) *wire.HopHead {
		if h.Binding != nil {
			h.Binding.Ticket = passes[h.Session]
		}
		return h
	}

	payload := make([]byte, size)
	for i := 0; i+1 < size; i += 2 {
		binary.LittleEndian.PutUint16(payload[i:], uint16(0x3f80+i%97)) // bf16 near 1.0
	}
	var wires [5]wirecount.Counter
	tcp, err := lk.dialEcho(ctx, echoAddr, payload, &wires[0])
	if err != nil {
		return err
	}
	defer tcp.Close()
	direct := &node.HopClient{TLSConfig: lk.client, Logger: log, NetDialContext: lk.dial(&wires[1])}
	defer direct.Close()
	rpc := &relay.Client{DisableTunnel: true, NetDialContext: lk.dial(&wires[2]), TLSConfig: lk.client, Logger: log}
	defer rpc.Close()
	tun := &relay.Client{NetDialContext: lk.dial(&wires[3]), TLSConfig: lk.client, Logger: log}
	defer tun.Close()
	pinned := &node.HopClient{TLSConfig: identity.ClientTLSConfig(nd.id.PeerID, nil), Logger: log, NetDialContext: lk.dial(&wires[4])}
	defer pinned.Close()
	tlsURL := "https://" + strings.TrimPrefix(nd.url, "http://")

	var pos [5]int
	// Replies land in one reused buffer, as a node's land in its host pool.
	back := make([]byte, len(payload))
	into := func(n int) ([]byte, func(), error) { return back[:n], nil, nil }
	hops := [5]func(context.Context) error{
		tcp.hop,
		func(ctx context.Context) error {
			rep, err := direct.Do(ctx, nd.url, bound(hopHead("bench-direct", pos[1], rows, hidden, pos[1] == 0)), payload, into)
			return checkHopReply(rep, err, payload)
		},
		func(ctx context.Context) error {
			req := forwardRequest(ctx, "http://node/forward", "bench-rpc", pos[2], rows, hidden, payload)
			req.Header.Set(wire.HeaderTicket, ticket.String(passes["bench-rpc"]))
			resp, err := rpc.Do(ctx, relayAddr, req)
			return checkForward(resp, err, payload)
		},
		func(ctx context.Context) error {
			rep, err := tun.DoHop(ctx, relayAddr, bound(hopHead("bench-tunnel", pos[3], rows, hidden, pos[3] == 0)), payload, into)
			return checkHopReply(rep, err, payload)
		},
		func(ctx context.Context) error {
			rep, err := pinned.Do(ctx, tlsURL, bound(hopHead("bench-tls", pos[4], rows, hidden, pos[4] == 0)), payload, into)
			return checkHopReply(rep, err, payload)
		},
	}
	run := func(s int, ms *runtime.MemStats) (time.Duration, uint64, error) {
		hctx, cancel := context.WithTimeout(ctx, hopTimeout)
		defer cancel()
		var a0 uint64
		if ms != nil {
			runtime.ReadMemStats(ms)
			a0 = ms.TotalAlloc
		}
		t0 := time.Now()
		err := hops[s](hctx)
		d := time.Since(t0)
		var alloc uint64
		if ms != nil {
			runtime.ReadMemStats(ms)
			alloc = ms.TotalAlloc - a0
		}
		if err != nil {
			return d, alloc, fmt.Errorf("%s hop: %w", HopSeries[s], err)
		}
		pos[s] = (pos[s] + rows) % hopPositions
		return d, alloc, nil
	}
	samples := make([][]float64, 5)
	for s := range samples {
		samples[s] = make([]float64, 0, cfg.N)
	}
	var wireB [5]int64
	// relay-rpc runs in a pass of its own: each of its hops dials and tears
	// down a WebSocket and allocates ~30x the payload, and what that leaves
	// running (the teardown, the collections) slowed whichever series came
	// next by 2-3x (docs/performance.md). The other series are interleaved
	// hop by hop.
	for _, pass := range [][]int{{0, 1, 3, 4}, {2}} {
		for i := -cfg.Warmup; i < cfg.N; i++ {
			if i == 0 {
				for _, s := range pass {
					wires[s].Reset()
				}
			}
			for _, s := range pass {
				d, _, err := run(s, nil)
				if err != nil {
					return err
				}
				if i >= 0 {
					samples[s] = append(samples[s], float64(d.Nanoseconds())/1e3)
				}
			}
		}
		for _, s := range pass {
			wireB[s] = wires[s].Bytes()
		}
	}
	// Heap bytes per hop come from a second, untimed pass of the same N
	// hops: runtime.ReadMemStats stops the world, and read around every
	// timed hop it tripled direct's p50 (docs/performance.md).
	var allocs [5]uint64 // Go heap bytes allocated by N hops, all servers together
	var ms runtime.MemStats
	for range cfg.N {
		for s := range hops {
			_, a, err := run(s, &ms)
			if err != nil {
				return err
			}
			allocs[s] += a
		}
	}
	var p50s, p99s [5]float64
	for s := range samples {
		p50s[s], p99s[s], _, _ = Summarize(samples[s])
	}
	for s, name := range HopSeries {
		extra := map[string]float64{
			"added_p50": p50s[s] - p50s[0],
			"added_p99": p99s[s] - p99s[0],
			"wire_B":    float64(wireB[s]) / float64(cfg.N),
			"alloc_B":   float64(allocs[s]) / float64(cfg.N),
		}
		if s != 0 {
			extra["added_p50_direct"] = p50s[s] - p50s[1]
		}
		if name == SeriesRelayRPC && p50s[3] > 0 {
			extra["p50_per_tunnel"] = p50s[2] / p50s[3]
		}
		if name == SeriesDirectTLS && p50s[1] > 0 {
			extra["tls_per_plain"] = p50s[4] / p50s[1]
		}
		if name == SeriesRelayRPC || name == SeriesRelayTunnel {
			extra["added_p50_floor"] = p50s[s] - 2*p50s[0]
		}
		if cfg.RTT > 0 {
			extra["round_trips"] = p50s[s] / float64(cfg.RTT.Microseconds())
		}
		rep.Add(name, float64(kib), samples[s], extra)
	}
	return nil
}

// payloadShape is the bf16 activation shape of a payload: one row up to
// 16 KiB (hidden 8192), rows of hidden 8192 (a prefill) above.
func payloadShape(kib int) (rows, hidden int, err error) {
	const maxRowKiB = 16
	if kib <= maxRowKiB {
		return 1, kib << 9, nil
	}
	if kib%maxRowKiB != 0 {
		return 0, 0, fmt.Errorf("payload %d KiB: above %d KiB use a multiple of %d KiB (rows of hidden 8192)", kib, maxRowKiB, maxRowKiB)
	}
	return kib / maxRowKiB, maxRowKiB << 9, nil
}

// hopHead is the suite's hop: layers 2.. of the pass-through stack, bound
// on the session's first hop (position 0, also after a wrap).
func hopHead(session string, pos, rows, hidden int, bind bool) *wire.HopHead {
	h := &wire.HopHead{Session: session, Position: pos, NTokens: rows, Hidden: hidden, DType: wire.DTypeBF16,
		Deadline: time.Now().Add(hopTimeout)}
	if bind {
		h.Binding = &wire.Binding{StartLayer: 2, EndLayer: 5}
	}
	return h
}

// checkHopReply: a 200 activations reply equal to what was sent.
func checkHopReply(rep *wire.HopReply, err error, want []byte) error {
	if err != nil {
		return err
	}
	defer rep.ReleaseBuffer()
	if rep.Status != http.StatusOK || rep.Kind != wire.ReplyActivations {
		return fmt.Errorf("node answered %d (kind %d): %.300s", rep.Status, rep.Kind, rep.Body)
	}
	if !bytes.Equal(rep.Payload, want) {
		return fmt.Errorf("node answered %d bytes that differ from the %d sent through a pass-through stack", len(rep.Payload), len(want))
	}
	return nil
}

func forwardRequest(ctx context.Context, url, session string, pos, rows, hidden int, payload []byte) *http.Request {
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(payload))
	req.Header.Set(wire.HeaderSession, session)
	req.Header.Set(wire.HeaderShape, strconv.Itoa(rows)+","+strconv.Itoa(hidden))
	req.Header.Set(wire.HeaderDType, "bf16")
	req.Header.Set(wire.HeaderStartLayer, "2")
	req.Header.Set(wire.HeaderPosition, strconv.Itoa(pos))
	req.Header.Set("Content-Type", "application/octet-stream")
	return req
}

// checkForward reads a hop's answer: it must be 200 with the activations the
// pass-through stack handed back, byte for byte.
func checkForward(resp *http.Response, err error, want []byte) error {
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, int64(len(want))+4096))
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("node answered %d: %.300s", resp.StatusCode, b)
	}
	if !bytes.Equal(b, want) {
		return fmt.Errorf("node answered %d bytes that differ from the %d sent through a pass-through stack", len(b), len(want))
	}
	return nil
}

// benchRelay is a relay.Server on 127.0.0.1 (wss:// over a TLS link).
type benchRelay struct {
	srv  *relay.Server
	hs   *http.Server
	base string // ws://127.0.0.1:port
	done chan struct{}
}

func startRelay(log *slog.Logger, lk link) (*benchRelay, error) {
	ln, err := lk.listen()
	if err != nil {
		return nil, err
	}
	r := &benchRelay{srv: &relay.Server{Logger: log}, base: lk.scheme("ws") + "://" + ln.Addr().String(), done: make(chan struct{})}
	r.hs = &http.Server{Handler: r.srv.Handler(), ReadHeaderTimeout: 5 * time.Second}
	go func() { defer close(r.done); r.hs.Serve(ln) }()
	return r, nil
}

func (r *benchRelay) Close() {
	r.srv.Close()
	r.hs.Close()
	<-r.done
}

// benchNode is a node.Server on 127.0.0.1, also bridged to a relay when one
// is given.
type benchNode struct {
	srv    *node.Server
	hs     *http.Server
	url    string
	id     *identity.Identity
	done   chan struct{}
	cancel context.CancelFunc
	bridge chan error
}

func startBenchNode(ctx context.Context, srv *node.Server, rl *benchRelay, lk link, log *slog.Logger) (*benchNode, error) {
	id, err := identity.New()
	if err != nil {
		return nil, err
	}
	if srv.PeerID == "" {
		srv.PeerID = id.PeerID
	}
	// The node serves plain HTTP and TLS with its own key on one port, as
	// a mesh node does (over --tls the relay alone keeps its CA-style certificate).
	ln, err := link{rtt: lk.rtt}.listen()
	if err != nil {
		return nil, err
	}
	tc, err := id.ServerTLSConfig(time.Now())
	if err != nil {
		ln.Close()
		return nil, err
	}
	ln = node.ServeTLSAndPlain(ln, tc)
	n := &benchNode{srv: srv, url: "http://" + ln.Addr().String(), id: id, done: make(chan struct{})}
	n.hs = &http.Server{Handler: srv.Handler(), ReadHeaderTimeout: 5 * time.Second}
	go func() { defer close(n.done); n.hs.Serve(ln) }()
	if rl == nil {
		return n, nil
	}
	b := &relay.Bridge{RelayURL: rl.base, Identity: id, Handler: srv.Handler(), HopServer: srv, Logger: log,
		NetDialContext: lk.dial(nil), TLSConfig: lk.client, MinBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond}
	bctx, cancel := context.WithCancel(context.Background())
	n.cancel, n.bridge = cancel, make(chan error, 1)
	go func() { n.bridge <- b.Run(bctx) }()
	deadline := time.Now().Add(10 * time.Second)
	for !b.Connected() {
		if time.Now().After(deadline) || ctx.Err() != nil {
			n.Close()
			return nil, errors.New("node bridge did not connect to the relay within 10s")
		}
		time.Sleep(2 * time.Millisecond)
	}
	return n, nil
}

// Close stops the bridge and the HTTP server, then frees the node's sessions.
func (n *benchNode) Close() {
	if n.cancel != nil {
		n.cancel()
		<-n.bridge
	}
	n.hs.Close()
	<-n.done
	n.srv.Close()
}

// echoConn is one kept-alive connection to a TCPEcho.
type echoConn struct {
	c         net.Conn
	msg, back []byte
}

func newEchoConn(c net.Conn, payload []byte) *echoConn {
	msg := binary.BigEndian.AppendUint32(make([]byte, 0, 4+len(payload)), uint32(len(payload)))
	msg = append(msg, payload...)
	return &echoConn{c: c, msg: msg, back: make([]byte, len(msg))}
}

func (e *echoConn) hop(ctx context.Context) error {
	dl, ok := ctx.Deadline()
	if !ok {
		dl = time.Now().Add(10 * time.Second)
	}
	e.c.SetDeadline(dl)
	if _, err := e.c.Write(e.msg); err != nil {
		return err
	}
	if _, err := io.ReadFull(e.c, e.back); err != nil {
		return fmt.Errorf("tcp echo: %w", err)
	}
	return nil
}

func (e *echoConn) Close() error { return e.c.Close() }

// benchPass is the route ticket pass of session: the node (peer, at
// endpoint and relayAddr) at layers 2-5, signed by head, with one session key.
func benchPass(head *identity.Identity, peer, endpoint, relayAddr, session string) ([]byte, error) {
	now := time.Now()
	raw, err := ticket.Sign(ticket.Ticket{SessionID: session, Head: head.PeerID, IssuedAt: now, Expiry: now.Add(ticket.MaxLifetime),
		Hops: []ticket.Hop{{PeerID: peer, Endpoint: endpoint, RelayAddr: relayAddr, First: 2, Last: 5}}}, head.Private)
	if err != nil {
		return nil, err
	}
	keys, err := ticket.NewKeys(1)
	if err != nil {
		return nil, err
	}
	return ticket.Pass{Ticket: raw, Keys: keys}.Encode()
}

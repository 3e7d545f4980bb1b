package bench

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sort"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/latency"
	"meshgpu/node"
	"meshgpu/relay"
	"meshgpu/wire"
)

// NAT hop series (docs/performance.md, "Direct paths through NAT").
const (
	// SeriesTCPTLS: a hop over TCP with TLS pinned to the tail's peer id,
	// what two public nodes use.
	SeriesTCPTLS = "tcp-tls"
	// SeriesDirectTCP: the punched TCP path between the two NATed nodes
	// (node.DirectPaths; pinned TLS as tcp-tls).
	SeriesDirectTCP = "direct-tcp"
	// SeriesDirectQUIC: the punched QUIC path between the two NATed nodes
	// (node.DirectPaths).
	SeriesDirectQUIC = "direct-quic"
	// SeriesRelayed: through the relay tunnel, the fallback.
	SeriesRelayed = "relayed"
)

// NATHopSeries lists NATHops' series in table order.
var NATHopSeries = []string{SeriesTCPTLS, SeriesDirectTCP, SeriesDirectQUIC, SeriesRelayed}

// Place runs f where one part of NATHops lives (a network namespace): the
// sockets f makes are made there, and keep working anywhere afterwards.
type Place func(f func() error) error

// NATHopsConfig places NATHops' parts: the relay on the public side, the
// head and the tail behind two NATs.
type NATHopsConfig struct {
	N, Warmup  int // measured and unmeasured hops per series (default 500, 50)
	PayloadKiB int // bf16 payload (default 4: one row of hidden 2048)
	Relay      Place
	Head, Tail Place
	// RelayIP is the relay's address on the public side; it listens on
	// RelayIP:0 over TCP and observes on the same UDP port.
	RelayIP string
	// TailTCP is the tail's TCP listen address, one the head reaches
	// without NAT: SeriesTCPTLS is a hop between two public nodes over the
	// same links and routers as the punched path.
	TailTCP string
	Logger  *slog.Logger
}

// NATHops times one hop's round trip from a head to a tail through a
// pass-through node.Server (no compute) over three paths, interleaved hop by
// hop after the direct paths are punched: pinned TLS over TCP, the punched
// TCP path, the punched QUIC path, and the relay tunnel.
func NATHops(ctx context.Context, cfg NATHopsConfig) (*Report, error) {
	if cfg.N <= 0 {
		cfg.N = 500
	}
	if cfg.Warmup <= 0 {
		cfg.Warmup = 50
	}
	if cfg.PayloadKiB <= 0 {
		cfg.PayloadKiB = 4
	}
	rows, hidden, err := payloadShape(cfg.PayloadKiB)
	if err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	dialIn := func(p Place) func(context.Context, string, string) (net.Conn, error) {
		return func(ctx context.Context, network, addr string) (c net.Conn, err error) {
			err = p(func() error { c, err = (&net.Dialer{}).DialContext(ctx, network, addr); return err })
			return c, err
		}
	}
	headID, err := identity.New()
	if err != nil {
		return nil, err
	}
	tailID, err := identity.New()
	if err != nil {
		return nil, err
	}

	// The relay, observing on its TCP port's UDP twin, as `meshgpu relay` does.
	var rln net.Listener
	var obs net.PacketConn
	if err := cfg.Relay(func() (err error) {
		if rln, err = net.Listen("tcp", net.JoinHostPort(cfg.RelayIP, "0")); err != nil {
			return err
		}
		obs, err = net.ListenPacket("udp", rln.Addr().String())
		return err
	}); err != nil {
		return nil, fmt.Errorf("relay: %w", err)
	}
	rs := &relay.Server{Logger: log}
	rhs := &http.Server{Handler: rs.Handler(), ReadHeaderTimeout: 5 * time.Second}
	done := make(chan struct{}, 2)
	go func() { rhs.Serve(rln); done <- struct{}{} }()
	go func() { (&relay.Observer{}).Serve(obs); done <- struct{}{} }()
	defer func() { rs.Close(); rhs.Close(); obs.Close(); <-done; <-done }()
	relayBase := "ws://" + rln.Addr().String()
	relayAddr := relayBase + "/rpc/" + tailID.PeerID

	// The tail: TLS and plain on one TCP port, bridged to the relay,
	// direct paths on.
	tail := &node.Server{StackForTesting: newPassStack(2, 5, 8, hidden), PeerID: tailID.PeerID, Identity: tailID,
		TrustedHeads: []string{headID.PeerID}, Logger: log}
	defer tail.Close()
	tail.Direct = &node.DirectPaths{Identity: tailID, RelayURL: relayBase, HopServer: tail, Listen: "0.0.0.0:0", Place: cfg.Tail, Logger: log}
	var tln net.Listener
	if err := cfg.Tail(func() (err error) {
		if err = tail.Direct.Start(); err != nil {
			return err
		}
		tln, err = net.Listen("tcp", cfg.TailTCP)
		return err
	}); err != nil {
		return nil, fmt.Errorf("tail: %w", err)
	}
	defer tail.Direct.Close()
	tc, err := tailID.ServerTLSConfig(time.Now())
	if err != nil {
		tln.Close()
		return nil, err
	}
	ths := &http.Server{Handler: tail.Handler(), ReadHeaderTimeout: 5 * time.Second}
	go func() { ths.Serve(node.ServeTLSAndPlain(tln, tc)); done <- struct{}{} }()
	defer func() { ths.Close(); <-done }()
	bctx, bcancel := context.WithCancel(ctx)
	br := &relay.Bridge{RelayURL: relayBase, Identity: tailID, Handler: tail.Handler(), HopServer: tail, Logger: log,
		NetDialContext: dialIn(cfg.Tail), MinBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond}
	go func() { br.Run(bctx); done <- struct{}{} }()
	defer func() { bcancel(); <-done }()
	for deadline := time.Now().Add(10 * time.Second); !br.Connected(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			return nil, errors.New("the tail's bridge did not connect to the relay within 10 s")
		}
	}

	// The head: a relay client and direct paths, dialing from its home.
	rc := &relay.Client{Identity: headID, NetDialContext: dialIn(cfg.Head), Logger: log}
	defer rc.Close()
	// It serves no hops: no peer offers it a path, so none may dial it.
	// One DirectPaths punches TCP (and keeps the TCP path), one only QUIC.
	hd := &node.DirectPaths{Identity: headID, Relay: rc, Listen: "0.0.0.0:0", Place: cfg.Head, Logger: log}
	if err := cfg.Head(hd.Start); err != nil {
		return nil, fmt.Errorf("head: %w", err)
	}
	defer hd.Close()
	hq := &node.DirectPaths{Identity: headID, Relay: rc, Listen: "0.0.0.0:0", QUICOnly: true, Logger: log}
	if err := cfg.Head(hq.Start); err != nil {
		return nil, fmt.Errorf("head: %w", err)
	}
	defer hq.Close()
	pinned := &node.HopClient{TLSConfig: identity.ClientTLSConfig(tailID.PeerID, nil), NetDialContext: dialIn(cfg.Head), Logger: log}
	defer pinned.Close()
	tlsURL := "https://" + tln.Addr().String()

	sessions := []string{"nat-tcp", "nat-ptcp", "nat-quic", "nat-relay"}
	passes := map[string][]byte{}
	for _, s := range sessions {
		if passes[s], err = benchPass(headID, tailID.PeerID, tlsURL, relayAddr, s); err != nil {
			return nil, err
		}
	}
	size := cfg.PayloadKiB << 10
	payload := make([]byte, size)
	for i := 0; i+1 < size; i += 2 {
		binary.LittleEndian.PutUint16(payload[i:], uint16(0x3f80+i%97)) // bf16 near 1.0
	}
	back := make([]byte, len(payload))
	into := func(n int) ([]byte, func(), error) { return back[:n], nil, nil }
	var pos [4]int
	head := func(s int) *wire.HopHead {
		h := hopHead(sessions[s], pos[s], rows, hidden, pos[s] == 0)
		if h.Binding != nil {
			h.Binding.Ticket = passes[sessions[s]]
		}
		return h
	}
	hops := [4]func(context.Context) error{
		func(ctx context.Context) error {
			rep, err := pinned.Do(ctx, tlsURL, head(0), payload, into)
			return checkHopReply(rep, err, payload)
		},
		func(ctx context.Context) error {
			rep, err := hd.DoHop(ctx, tailID.PeerID, relayAddr, head(1), payload, into)
			return checkHopReply(rep, err, payload)
		},
		func(ctx context.Context) error {
			rep, err := hq.DoHop(ctx, tailID.PeerID, relayAddr, head(2), payload, into)
			return checkHopReply(rep, err, payload)
		},
		func(ctx context.Context) error {
			rep, err := rc.DoHop(ctx, relayAddr, head(3), payload, into)
			return checkHopReply(rep, err, payload)
		},
	}
	// Punch, the TCP path first, then QUIC: the first DoHop starts it; the
	// path is proven within about punchDelay plus the handshakes.
	var punchTimes [4]time.Duration
	for _, s := range []int{1, 2} {
		if s == 2 {
			// The tail answers one offer per peer at a time, and punches
			// for 4 s after answering (a refused offer waits 40 s).
			time.Sleep(5 * time.Second)
		}
		punched := time.Now()
		for deadline := punched.Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			hctx, cancel := context.WithTimeout(ctx, hopTimeout)
			err := hops[s](hctx)
			cancel()
			if err == nil {
				break
			}
			if !errors.Is(err, node.ErrNoDirectPath) || time.Now().After(deadline) {
				return nil, fmt.Errorf("no %s path between the NATed head and tail: %w", NATHopSeries[s], err)
			}
		}
		pos[s] = (pos[s] + rows) % hopPositions
		punchTimes[s] = time.Since(punched)
	}
	if k := hd.Path(tailID.PeerID); k != SeriesDirectTCP {
		return nil, fmt.Errorf("the TCP punch gave a %q path, not %s", k, SeriesDirectTCP)
	}

	samples := make([][]float64, len(hops))
	for i := -cfg.Warmup; i < cfg.N; i++ {
		for s, hop := range hops {
			hctx, cancel := context.WithTimeout(ctx, hopTimeout)
			t0 := time.Now()
			err := hop(hctx)
			d := time.Since(t0)
			cancel()
			if err != nil {
				return nil, fmt.Errorf("%s hop: %w", NATHopSeries[s], err)
			}
			pos[s] = (pos[s] + rows) % hopPositions
			if i >= 0 {
				samples[s] = append(samples[s], float64(d.Nanoseconds())/1e3)
			}
		}
	}

	rep := NewReport("nat-hops", "payload KiB", "µs", "a hop over TCP with TLS pinned to the peer id between two public nodes (tcp-tls)")
	rep.Notes = append(rep.Notes,
		"head and tail behind two NATs; tcp-tls crosses the same links and routers untranslated (the homes' addresses routed, TCP not masqueraded): two public nodes",
		"direct-tcp: the punched TCP path (node.DirectPaths: TCP through both NATs after a low-TTL SYN, pinned TLS 1.3 both ways)",
		"direct-quic: the punched QUIC path (node.DirectPaths, pinned TLS 1.3 both ways); relayed: the relay tunnel on the public side",
		"series interleaved hop by hop; each hop one frame each way through a pass-through node.Server (no compute)",
		"p90, per_tcp_p50, per_tcp_p90: the series' 90th percentile, and its p50 and p90 over tcp-tls's",
		fmt.Sprintf("the TCP path was punched in %v, the QUIC one in %v (the first direct hop after start)",
			punchTimes[1].Round(time.Millisecond), punchTimes[2].Round(time.Millisecond)))
	var p50s, p90s [4]float64
	for s := range samples {
		sorted := append([]float64(nil), samples[s]...)
		sort.Float64s(sorted)
		p50s[s], p90s[s] = latency.Percentile(sorted, 0.5), latency.Percentile(sorted, 0.9)
	}
	for s, name := range NATHopSeries {
		rep.Add(name, float64(cfg.PayloadKiB), samples[s], map[string]float64{
			"p90": p90s[s], "per_tcp_p50": p50s[s] / p50s[0], "per_tcp_p90": p90s[s] / p90s[0]})
	}
	return rep, nil
}

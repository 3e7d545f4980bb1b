package node

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/quic-go/quic-go"

	"meshgpu/hopmux"
	"meshgpu/identity"
	"meshgpu/wire"
)

// Direct paths to peers reached through the relay (docs/relay.md, "Direct
// paths"). Each punch tries a TCP path too (node/directtcp.go); hops take it
// when it works, else the QUIC path, else they stay on the relay. A node with a relay holds one UDP socket, its path socket,
// carrying QUIC and the packets of wire/path.go. To send hops to a
// relay-only peer it learns its public address from the relay's
// observation port, offers its candidates to the peer through the relay
// tunnel (POST wire.PunchPath) and dials the peer's candidates over QUIC
// while the peer punches towards ours. The peer's punches also show the
// address its NAT really uses towards us, which we dial too: a public
// node reaches a node behind any NAT that way (connection reversal: the
// NATed side opens the path). Both ends show their identity certificate:
// the dialer pins the peer id the route names, the listener takes only
// peers that offered through the relay just before. Once the handshake
// is done the session's next hops go over a QUIC stream carrying hop
// frames exactly as a GET /hop connection does; hops in flight stay where
// they are. When the path dies (QUIC's idle timeout after a NAT rebinding)
// its hops fail over to the relay at once and the next hop punches again.

const (
	// directKeepAlive and directIdleTimeout: a path silent for the idle
	// timeout is dead (its NAT mapping is gone) and hops go back to the relay.
	directKeepAlive   = time.Second
	directIdleTimeout = 4 * time.Second
	// punchTimeout bounds one upgrade: observation, offer, handshakes.
	punchTimeout = 8 * time.Second
	// punchInterval and punchFor: how often and how long the answering
	// side punches towards each of the offer's candidates.
	punchInterval = 100 * time.Millisecond
	punchFor      = 3 * time.Second
	// punchesPerOffer is what one offer makes this node send to each of
	// its candidates: lowTTLPunches, then one per punchInterval.
	lowTTLPunches   = 2
	punchesPerOffer = lowTTLPunches + int(punchFor/punchInterval)
	// punchTTL is the hop limit of the first punches: they open this
	// node's NAT towards the dialer but die on the way, before the
	// dialer's NAT. A punch reaching a NAT before its own node's packet
	// has left makes Linux conntrack keep that tuple for the NAT itself,
	// and the node's packet then goes out from another port. The full
	// punches, which show a public dialer our real address, wait
	// punchDelay, past the dialer's first packets.
	punchTTL   = 2
	punchDelay = time.Second
	// punchRetry is the wait after a failed punch (symmetric NATs on both
	// sides), doubling up to punchRetryMax; repunchAfter the wait after a
	// proven path died. punchRetry outlasts Linux's UDP conntrack timeout
	// for unanswered flows (30 s): after a rebinding, a NAT keeps the
	// packets our old path sent to the new mapping as a flow of its own,
	// which moves the peer's punches to another port until it expires.
	punchRetry    = 40 * time.Second
	punchRetryMax = 10 * time.Minute
	repunchAfter  = time.Second
	// maxPunching bounds the offers answered at once (one per peer), so a
	// peer on the relay cannot turn nodes into a flood of punches.
	maxPunching = 8
	// expectFor is how long an offer lets its peer's handshake in.
	expectFor = 30 * time.Second
	// maxDirectConns bounds the direct paths a node serves.
	maxDirectConns = 256
	// maxDirectPeers bounds the peers remembered (paths, expectations).
	maxDirectPeers = 4096
)

// DirectPaths moves hops to relay-only peers onto direct TCP or QUIC paths. Set
// the fields, call Start, give it to the node's Servers (Server.Direct),
// and Close it after them.
type DirectPaths struct {
	Identity *identity.Identity
	// Relay carries offers (the node's relay client).
	Relay RelayDoer
	// RelayURL is the node's own relay (ws(s)://host:port): its
	// observation port tells this node its public address when it answers
	// an offer.
	RelayURL string
	// HopServer serves the hops arriving on direct paths.
	HopServer hopmux.Handler
	// Listen is the path socket's UDP address (default ":0"); the TCP
	// punch port listens on its host too.
	Listen string
	// QUICOnly punches no TCP paths, and answers offers without one
	// (benchmarks time the QUIC path on its own).
	QUICOnly bool
	// Place, when set, runs the functions that make this node's sockets
	// after Start (punched TCP dials and observations) where it wants them
	// made (a benchmark's network namespace).
	Place  func(func() error) error
	Logger *slog.Logger

	tr     *quic.Transport
	ln     *quic.Listener
	cert   tls.Certificate
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	m      *pathMetrics

	mu       sync.Mutex
	closed   bool
	out      map[string]*directPath // by peer id: paths this node sends hops on
	expect   map[string]time.Time   // peers that offered, until when they may dial
	punching map[string]bool        // peers whose offer is being answered
	waits    map[wire.PathID]chan netip.AddrPort
	inConns  int
	tcpLn    net.Listener          // the TCP punch port, when TCP paths are on
	tcpIn    map[net.Conn]struct{} // the punched connections it serves
}

// directPath is this node's path to one peer: proven, being punched, or
// waiting for its next try.
type directPath struct {
	c         *hopConn
	kind      string // the hops' path label: "direct-tcp" or "direct" (QUIC)
	upgrading bool
	retryAt   time.Time
	backoff   time.Duration
}

type pathMetrics struct {
	attempts, successes, lost prometheus.Counter
	paths                     prometheus.GaugeFunc
}

// Start opens the path socket and serves direct paths until Close.
func (d *DirectPaths) Start() error {
	if d.Logger == nil {
		d.Logger = slog.Default()
	}
	listen := d.Listen
	if listen == "" {
		listen = ":0"
	}
	ua, err := net.ResolveUDPAddr("udp", listen)
	if err != nil {
		return fmt.Errorf("direct paths: %w", err)
	}
	pc, err := net.ListenUDP("udp", ua)
	if err != nil {
		return fmt.Errorf("direct paths: %w", err)
	}
	if d.cert, err = d.Identity.Certificate(time.Now()); err != nil {
		pc.Close()
		return err
	}
	d.tr = &quic.Transport{Conn: pc}
	if d.ln, err = d.tr.Listen(d.serverTLS(wire.HopQUICProto), d.quicConfig()); err != nil {
		d.tr.Close()
		return fmt.Errorf("direct paths: %w", err)
	}
	if tcpPunchSupported && !d.QUICOnly {
		if err := d.startTCP(listen); err != nil {
			d.ln.Close()
			d.tr.Close()
			return err
		}
	}
	d.out, d.expect, d.punching, d.waits = map[string]*directPath{}, map[string]time.Time{}, map[string]bool{}, map[wire.PathID]chan netip.AddrPort{}
	d.ctx, d.cancel = context.WithCancel(context.Background())
	d.m = &pathMetrics{
		attempts: prometheus.NewCounter(prometheus.CounterOpts{Name: "meshgpu_node_punch_attempts_total",
			Help: "Direct paths to relay-only peers this node tried to punch."}),
		successes: prometheus.NewCounter(prometheus.CounterOpts{Name: "meshgpu_node_punch_successes_total",
			Help: "Punches that gave a proven direct path (a pinned TLS handshake over punched TCP or QUIC)."}),
		lost: prometheus.NewCounter(prometheus.CounterOpts{Name: "meshgpu_node_direct_paths_lost_total",
			Help: "Proven direct paths that died (their hops went back to the relay)."}),
		paths: prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "meshgpu_node_direct_paths",
			Help: "Proven direct paths this node sends hops on now."}, func() float64 { return float64(d.Paths()) }),
	}
	d.wg.Add(2)
	go func() { defer d.wg.Done(); d.acceptLoop() }()
	go func() { defer d.wg.Done(); d.readPackets() }()
	if d.tcpOn() {
		d.wg.Add(1)
		go func() { defer d.wg.Done(); d.tcpAcceptLoop() }()
		d.Logger.Info("direct paths on", "udp", pc.LocalAddr().String(), "tcp", d.tcpLn.Addr().String())
		return nil
	}
	d.Logger.Info("direct paths on", "udp", pc.LocalAddr().String())
	return nil
}

// Addr is the path socket's local address.
func (d *DirectPaths) Addr() net.Addr { return d.tr.Conn.LocalAddr() }

// Collectors are the punch metrics, for a Server's registry.
func (d *DirectPaths) Collectors() []prometheus.Collector {
	return []prometheus.Collector{d.m.attempts, d.m.successes, d.m.lost, d.m.paths}
}

// Paths counts the proven paths this node sends hops on.
func (d *DirectPaths) Paths() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := 0
	for _, p := range d.out {
		if p.c != nil && p.c.alive() {
			n++
		}
	}
	return n
}

// Path is the label of the proven path to peerID ("direct-tcp" or
// "direct", QUIC), or "" when its hops go through the relay.
func (d *DirectPaths) Path(peerID string) string {
	d.mu.Lock()
	defer d.mu.Unlock()
	if p := d.out[peerID]; p != nil && p.c != nil && p.c.alive() {
		return p.kind
	}
	return ""
}

// Close ends every path and waits for their goroutines.
func (d *DirectPaths) Close() error {
	d.mu.Lock()
	d.closed = true
	d.mu.Unlock()
	d.cancel()
	d.ln.Close()
	if d.tcpOn() {
		d.tcpLn.Close()
		d.closeTCPConns()
	}
	err := d.tr.Close()
	d.tr.Conn.Close()
	d.wg.Wait()
	return err
}

func (d *DirectPaths) quicConfig() *quic.Config {
	return &quic.Config{HandshakeIdleTimeout: punchTimeout / 2, MaxIdleTimeout: directIdleTimeout, KeepAlivePeriod: directKeepAlive,
		MaxIncomingStreams: 4, MaxIncomingUniStreams: -1}
}

// verifyDialer lets in the identity certificate of a peer that offered a
// path through the relay within expectFor: a node behind NAT with no
// listener stays reachable only by peers the relay introduced.
func (d *DirectPaths) verifyDialer(cs tls.ConnectionState) error {
	if len(cs.PeerCertificates) != 1 {
		return errors.New("direct path: the dialer shows no identity certificate")
	}
	pub, ok := cs.PeerCertificates[0].PublicKey.(ed25519.PublicKey)
	if !ok {
		return errors.New("direct path: the dialer's key is not Ed25519")
	}
	peer := identity.PeerID(pub)
	if err := identity.VerifyPeerCertificate(cs.PeerCertificates, peer, time.Now()); err != nil {
		return err
	}
	d.mu.Lock()
	until, ok := d.expect[peer]
	d.mu.Unlock()
	if !ok || time.Now().After(until) {
		return fmt.Errorf("direct path: %s offered no path through the relay", peer)
	}
	return nil
}

// serverTLS is a direct path listener's TLS (QUIC or punched TCP, by
// ALPN proto): the identity certificate, and only introduced dialers.
func (d *DirectPaths) serverTLS(proto string) *tls.Config {
	return &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{d.cert}, NextProtos: []string{proto},
		ClientAuth: tls.RequireAnyClientCert, VerifyConnection: d.verifyDialer}
}

func (d *DirectPaths) clientTLS(peerID string) *tls.Config {
	return d.clientTLSFor(peerID, wire.HopQUICProto)
}

// clientTLSFor is a dialer's TLS to peerID: pinned to its key, showing ours.
func (d *DirectPaths) clientTLSFor(peerID, proto string) *tls.Config {
	cfg := identity.ClientTLSConfig(peerID, nil)
	cfg.Certificates = []tls.Certificate{d.cert}
	cfg.NextProtos = []string{proto}
	cfg.ServerName = "meshgpu.invalid" // no name is checked: the key is pinned
	return cfg
}

// ---- serving ----

func (d *DirectPaths) acceptLoop() {
	for {
		qc, err := d.ln.Accept(d.ctx)
		if err != nil {
			return
		}
		d.mu.Lock()
		if d.closed || d.inConns >= maxDirectConns {
			d.mu.Unlock()
			qc.CloseWithError(0x10, "too many direct paths")
			continue
		}
		d.inConns++
		d.wg.Add(1)
		d.mu.Unlock()
		go func() {
			defer d.wg.Done()
			d.serveConn(qc)
			d.mu.Lock()
			d.inConns--
			d.mu.Unlock()
		}()
	}
}

// serveConn serves the hop streams of one direct path (at most
// MaxIncomingStreams at once) until it closes.
func (d *DirectPaths) serveConn(qc *quic.Conn) {
	defer qc.CloseWithError(0, "")
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		st, err := qc.AcceptStream(d.ctx)
		if err != nil {
			return
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			sc := &streamConn{Stream: st, qc: qc}
			err := serveHopFrames(d.HopServer, sc, bufio.NewReaderSize(sc, hopConnBuffer), hopmux.DefaultMaxFrame, hopIdleTimeout)
			d.Logger.Debug("direct hop stream closed", "remote", qc.RemoteAddr().String(), "cause", err)
		}()
	}
}

// streamConn is a QUIC stream as the net.Conn the hop frame code takes.
type streamConn struct {
	*quic.Stream
	qc   *quic.Conn
	wbuf []byte // WriteBuffers' frame
}

func (s *streamConn) LocalAddr() net.Addr  { return s.qc.LocalAddr() }
func (s *streamConn) RemoteAddr() net.Addr { return s.qc.RemoteAddr() }

// WriteBuffers writes a frame's head and payload as one stream write
// (hopmux.BuffersWriter): two writes could wake quic-go's sender for a packet
// holding the head alone. The frame writer's lock serialises calls.
func (s *streamConn) WriteBuffers(bufs *net.Buffers) (int64, error) {
	s.wbuf = s.wbuf[:0]
	for _, b := range *bufs {
		s.wbuf = append(s.wbuf, b...)
	}
	*bufs = nil
	n, err := s.Stream.Write(s.wbuf)
	return int64(n), err
}

// Close ends both directions: the connection cannot be used again.
func (s *streamConn) Close() error {
	s.Stream.CancelRead(0)
	return s.Stream.Close()
}

// ServeHTTP answers a punch offer (POST wire.PunchPath) from the peer the
// relay names: this node's candidates, and punches towards the offer's.
func (d *DirectPaths) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	peer, ok := strings.CutPrefix(r.RemoteAddr, "relay:")
	if !ok || !wire.ValidSessionID(peer) {
		writeError(w, &apiError{Status: http.StatusForbidden, Type: "forbidden", Message: "punch offers come through the relay, from a peer it names"})
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, wire.MaxPunchBody+1))
	if err != nil {
		return
	}
	if len(body) > wire.MaxPunchBody {
		writeError(w, &apiError{Status: http.StatusRequestEntityTooLarge, Type: "too_large", Message: fmt.Sprintf("a punch offer is at most %d bytes", wire.MaxPunchBody)})
		return
	}
	var off wire.PunchOffer
	var nonce wire.PathID
	if err := json.Unmarshal(body, &off); err != nil {
		writeError(w, &apiError{Status: http.StatusBadRequest, Type: wire.TypeInvalidRequest, Message: "punch offer: " + err.Error()})
		return
	}
	if n, err := hex.Decode(nonce[:], []byte(off.Nonce)); err != nil || n != len(nonce) || len(off.Nonce) != 2*len(nonce) {
		writeError(w, &apiError{Status: http.StatusBadRequest, Type: wire.TypeInvalidRequest, Message: "punch offer: nonce must be 32 hex digits"})
		return
	}
	theirs, err := wire.ParseCandidates(off.Candidates)
	var theirsTCP []netip.AddrPort
	if err == nil && len(off.TCP) > 0 {
		theirsTCP, err = wire.ParseCandidates(off.TCP)
	}
	if err == nil && len(theirsTCP) > 1 {
		// An offerer sends its one observed TCP mapping; each candidate
		// costs a SYN socket and a slot shared with QUIC for punchTimeout.
		err = fmt.Errorf("%d TCP candidates; at most 1", len(theirsTCP))
	}
	if err != nil {
		writeError(w, &apiError{Status: http.StatusBadRequest, Type: wire.TypeInvalidRequest, Message: "punch offer: " + err.Error()})
		return
	}
	now := time.Now()
	d.mu.Lock()
	for p := range d.expect {
		if len(d.expect) < maxDirectPeers {
			break
		}
		delete(d.expect, p) // bounded: a forgotten peer offers again
	}
	if d.closed || d.punching[peer] || len(d.punching) >= maxPunching {
		d.mu.Unlock()
		w.Header().Set("Retry-After", "1")
		writeError(w, &apiError{Status: http.StatusTooManyRequests, Type: "rate_limited", Message: "this node answers punch offers one per peer, a few at a time"})
		return
	}
	d.punching[peer] = true
	d.expect[peer] = now.Add(expectFor)
	d.wg.Add(1)
	d.mu.Unlock()
	pkt := wire.AppendPathPunch(nil, nonce)
	for range lowTTLPunches {
		for _, a := range theirs {
			sendLowTTL(d.tr.Conn, pkt, a)
		}
	}
	go func() {
		defer d.wg.Done()
		d.punch(nonce, theirs)
		d.mu.Lock()
		delete(d.punching, peer)
		d.mu.Unlock()
	}()
	mine := d.candidates(r.Context(), relayUDP(d.RelayURL))
	tcp := d.openTCPTowards(r.Context(), theirsTCP) // before the answer: the dialer's SYN follows it
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(wire.PunchAnswer{Candidates: mine, TCP: tcp})
}

// punch sends the offer's nonce to each of its candidates for punchFor
// (after punchDelay; the low-TTL ones went first):
// each packet opens this node's NAT towards it, and shows the dialer the
// address the NAT uses.
func (d *DirectPaths) punch(nonce wire.PathID, to []netip.AddrPort) {
	pkt := wire.AppendPathPunch(nil, nonce)
	select {
	case <-d.ctx.Done():
		return
	case <-time.After(punchDelay):
	}
	t := time.NewTicker(punchInterval)
	defer t.Stop()
	for range punchesPerOffer - lowTTLPunches { // a count, not a clock
		for _, a := range to {
			d.tr.WriteTo(pkt, net.UDPAddrFromAddrPort(a))
		}
		select {
		case <-d.ctx.Done():
			return
		case <-t.C:
		}
	}
}

// readPackets takes the path packets off the socket (QUIC has the rest):
// the relay's observations and peers' punches, for whoever waits on their id.
func (d *DirectPaths) readPackets() {
	buf := make([]byte, 1500)
	for {
		n, from, err := d.tr.ReadNonQUICPacket(d.ctx, buf)
		if err != nil {
			return
		}
		kind, id, addr, err := wire.ParsePathPacket(buf[:n])
		ua, ok := from.(*net.UDPAddr)
		if err != nil || !ok {
			continue
		}
		switch kind {
		case wire.PathObserved:
		case wire.PathPunch:
			addr = ua.AddrPort()
		default:
			continue
		}
		d.mu.Lock()
		ch := d.waits[id]
		d.mu.Unlock()
		if ch != nil {
			select {
			case ch <- netip.AddrPortFrom(addr.Addr().Unmap(), addr.Port()):
			default: // the waiter has enough
			}
		}
	}
}

func (d *DirectPaths) wait(id wire.PathID) chan netip.AddrPort {
	ch := make(chan netip.AddrPort, 4)
	d.mu.Lock()
	d.waits[id] = ch
	d.mu.Unlock()
	return ch
}

func (d *DirectPaths) unwait(id wire.PathID) {
	d.mu.Lock()
	delete(d.waits, id)
	d.mu.Unlock()
}

// observe asks the relay's observation port which address this node's
// path socket has on the internet.
func (d *DirectPaths) observe(ctx context.Context, relay string) (netip.AddrPort, error) {
	var ua *net.UDPAddr
	if ips, err := net.DefaultResolver.LookupNetIP(ctx, "ip", hostOnly(relay)); err == nil && len(ips) > 0 {
		ua, _ = net.ResolveUDPAddr("udp", net.JoinHostPort(ips[0].Unmap().String(), portOnly(relay)))
	}
	if ua == nil {
		return netip.AddrPort{}, fmt.Errorf("relay observation port %q does not resolve", relay)
	}
	var id wire.PathID
	rand.Read(id[:])
	ch := d.wait(id)
	defer d.unwait(id)
	probe := wire.AppendPathProbe(nil, id)
	for try := 0; try < 4; try++ {
		d.tr.WriteTo(probe, ua)
		select {
		case a := <-ch:
			return a, nil
		case <-time.After(250 * time.Millisecond):
		case <-ctx.Done():
			return netip.AddrPort{}, ctx.Err()
		}
	}
	return netip.AddrPort{}, fmt.Errorf("relay %s: no answer on its observation port", relay)
}

// candidates are this node's addresses for a peer to dial: the one the
// relay observes first, then the socket's local ones (a peer on the same
// network).
func (d *DirectPaths) candidates(ctx context.Context, relay string) []string {
	var out []string
	if relay != "" {
		if a, err := d.observe(ctx, relay); err == nil {
			out = append(out, a.String())
		} else {
			d.Logger.Debug("no observed address", "error", err)
		}
	}
	la, _ := d.tr.Conn.LocalAddr().(*net.UDPAddr)
	if la == nil {
		return out
	}
	var ips []net.IP
	if !la.IP.IsUnspecified() {
		ips = []net.IP{la.IP}
	} else if addrs, err := net.InterfaceAddrs(); err == nil {
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok {
				ips = append(ips, n.IP)
			}
		}
	}
	for _, ip := range ips {
		if len(out) >= wire.MaxPunchCandidates {
			break
		}
		if ip.IsLoopback() || ip.IsLinkLocalUnicast() || ip.IsUnspecified() {
			continue
		}
		if c := net.JoinHostPort(ip.String(), fmt.Sprint(la.Port)); !contains(out, c) {
			out = append(out, c)
		}
	}
	return out
}

func contains(xs []string, x string) bool {
	for _, v := range xs {
		if v == x {
			return true
		}
	}
	return false
}

// relayUDP is the observation port of a relay URL (ws(s)://host:port, or a
// relay_addr ws://host:port/rpc/PEER): the same host and port, over UDP.
func relayUDP(relayURL string) string {
	u, err := url.Parse(relayURL)
	if err != nil || u.Host == "" {
		return ""
	}
	if u.Port() != "" {
		return u.Host
	}
	port := "80"
	if u.Scheme == "wss" || u.Scheme == "https" {
		port = "443"
	}
	return net.JoinHostPort(u.Hostname(), port)
}

func hostOnly(hp string) string { h, _, _ := net.SplitHostPort(hp); return h }
func portOnly(hp string) string { _, p, _ := net.SplitHostPort(hp); return p }

// ---- sending ----

// conn returns the proven direct path to peerID, or nil: the hop goes
// through the relay. With no path (and no punch waiting out a failure) it
// starts one through relayAddr in the background, so the upgrade falls
// between hops.
func (d *DirectPaths) conn(peerID, relayAddr string) (*hopConn, string) {
	if d == nil || !wire.ValidSessionID(peerID) || relayAddr == "" {
		return nil, ""
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, ""
	}
	p := d.out[peerID]
	if p == nil {
		for k, v := range d.out {
			if len(d.out) < maxDirectPeers {
				break
			}
			if v.c == nil && !v.upgrading {
				delete(d.out, k)
			}
		}
		p = &directPath{}
		d.out[peerID] = p
	}
	if p.c != nil && p.c.alive() {
		return p.c, p.kind
	}
	if !p.upgrading && time.Now().After(p.retryAt) {
		p.upgrading = true
		d.wg.Add(1)
		go func() { defer d.wg.Done(); d.upgrade(peerID, relayAddr, p) }()
	}
	return nil, ""
}

// upgrade punches a path to peerID and, once proven, keeps it for the
// peer's hops until it dies.
func (d *DirectPaths) upgrade(peerID, relayAddr string, p *directPath) {
	d.m.attempts.Inc()
	ctx, cancel := context.WithTimeout(d.ctx, punchTimeout)
	pp, err := d.open(ctx, peerID, relayAddr)
	cancel()
	d.mu.Lock()
	p.upgrading = false
	if err != nil {
		p.backoff = min(max(2*p.backoff, punchRetry), punchRetryMax)
		p.retryAt = time.Now().Add(p.backoff)
		d.mu.Unlock()
		d.Logger.Info("no direct path; hops stay on the relay", "peer", peerID, "retry_in", p.backoff, "error", err)
		return
	}
	hc := pp.hc
	p.backoff, p.c, p.kind = 0, hc, pp.kind
	d.mu.Unlock()
	d.m.successes.Inc()
	d.Logger.Info("direct path proven; hops move off the relay", "peer", peerID, "path", pp.kind, "remote", pp.remote)
	select {
	case <-pp.dead:
	case <-hc.closed:
	case <-d.ctx.Done():
	}
	hc.close(errors.New("direct path closed"))
	pp.close()
	d.mu.Lock()
	if p.c == hc {
		p.c, p.retryAt = nil, time.Now().Add(repunchAfter)
	}
	closed := d.closed
	d.mu.Unlock()
	if !closed {
		d.m.lost.Inc()
		d.Logger.Info("direct path lost; hops go through the relay until it is punched again", "peer", peerID, "path", pp.kind, "cause", pp.cause())
	}
}

// ErrNoDirectPath: no proven direct path to the peer yet (DoHop started
// punching one, or waits out a failed punch); the hop goes through the relay.
var ErrNoDirectPath = errors.New("no proven direct path to the peer")

// DoHop sends one hop on the proven direct path to peerID (whose relay_addr
// is relayAddr), as relay.Client.DoHop sends it through the relay, or
// returns ErrNoDirectPath. For callers outside a node (bench), which time
// the path; a node's own hops take it in hopAttempt.
func (d *DirectPaths) DoHop(ctx context.Context, peerID, relayAddr string, h *wire.HopHead, payload []byte, into hopmux.ReplyBuffer) (*wire.HopReply, error) {
	c, _ := d.conn(peerID, relayAddr)
	if c == nil {
		return nil, ErrNoDirectPath
	}
	return c.roundTrip(ctx, h, payload, into)
}

type dialResult struct {
	qc  *quic.Conn
	err error
}

// provenPath is a path open proved: its hop connection, and what ends it.
type provenPath struct {
	hc     *hopConn
	kind   string // the hops' path label
	remote string
	dead   <-chan struct{} // closed when the transport dies (nil: hc's own end)
	close  func()
	cause  func() error
}

// open offers a path to peerID through the relay and dials the peer's
// candidates, and the addresses its punches come from, until one
// handshake proves the peer's key: the punched TCP path when the peer
// answers a TCP candidate and the dial to it proves the key, else the
// first QUIC path.
func (d *DirectPaths) open(ctx context.Context, peerID, relayAddr string) (*provenPath, error) {
	var nonce wire.PathID
	rand.Read(nonce[:])
	seen := d.wait(nonce)
	defer d.unwait(nonce)
	tcpCand, tcpLocal, hold := d.tcpOffer(ctx, relayUDP(relayAddr))
	if hold != nil {
		defer hold.Close()
	}
	off, _ := json.Marshal(wire.PunchOffer{Nonce: hex.EncodeToString(nonce[:]), Candidates: d.candidates(ctx, relayUDP(relayAddr)), TCP: tcpCand})
	req, err := http.NewRequestWithContext(identity.WithPeerID(ctx, peerID), http.MethodPost, "http://"+peerID+wire.PunchPath, bytes.NewReader(off))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := d.Relay.Do(ctx, relayAddr, req)
	if err != nil {
		return nil, fmt.Errorf("offer through the relay: %w", err)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, wire.MaxPunchBody+1))
	resp.Body.Close()
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("the peer refused the offer: %s %s", resp.Status, wire.Truncate(string(body), 200))
	}
	var ans wire.PunchAnswer
	if len(body) > wire.MaxPunchBody || json.Unmarshal(body, &ans) != nil {
		return nil, errors.New("the peer's answer is not a punch answer")
	}
	theirs, err := wire.ParseCandidates(ans.Candidates)
	if err != nil {
		return nil, fmt.Errorf("the peer's answer: %w", err)
	}
	dctx, dcancel := context.WithCancel(ctx)
	var tcpRes chan tcpDialResult // the punched TCP dial, when the peer answered a candidate
	if tcp, err := wire.ParseCandidates(ans.TCP); tcpLocal != nil && err == nil {
		tcpRes = make(chan tcpDialResult, 1)
		go func() { c, err := d.dialTCP(dctx, tcpLocal, tcp[0], peerID); tcpRes <- tcpDialResult{c, err} }()
	}
	results := make(chan dialResult, 2*wire.MaxPunchCandidates)
	dialed := map[netip.AddrPort]bool{}
	pending := 0
	dial := func(a netip.AddrPort) {
		if dialed[a] || len(dialed) >= 2*wire.MaxPunchCandidates {
			return
		}
		dialed[a] = true
		pending++
		go func() {
			qc, err := d.tr.Dial(dctx, net.UDPAddrFromAddrPort(a), d.clientTLS(peerID), d.quicConfig())
			results <- dialResult{qc, err}
		}()
	}
	for _, a := range theirs {
		dial(a)
	}
	var qc *quic.Conn
	var tc *tls.Conn
	var last, lastTCP error
	// Until the TCP dial has ended, or failed and QUIC has ended too.
	for tc == nil && (tcpRes != nil || (qc == nil && pending > 0)) {
		select {
		case a := <-seen:
			if qc == nil {
				dial(a)
			}
		case r := <-results:
			pending--
			switch {
			case r.err != nil:
				last = r.err
			case qc == nil:
				qc = r.qc
			default:
				r.qc.CloseWithError(0, "")
			}
		case r := <-tcpRes:
			tcpRes, tc, lastTCP = nil, r.c, r.err
			if r.err != nil {
				d.Logger.Debug("no punched TCP path", "peer", peerID, "error", r.err)
			}
		}
	}
	dcancel()
	for ; pending > 0; pending-- { // the other dials end with dctx
		if r := <-results; r.qc != nil {
			r.qc.CloseWithError(0, "")
		}
	}
	if tc != nil {
		if qc != nil {
			qc.CloseWithError(0, "")
		}
		hc := newHopClientConn(tc, bufio.NewReaderSize(tc, hopConnBuffer), hopmux.DefaultMaxFrame)
		return d.started(&provenPath{hc: hc, kind: "direct-tcp", remote: tc.RemoteAddr().String(),
			close: func() { tc.Close() }, cause: func() error { return errors.New("the punched TCP connection closed") }})
	}
	if qc == nil {
		return nil, fmt.Errorf("no candidate answered as %s: %w (TCP: %v)", peerID, last, lastTCP)
	}
	st, err := qc.OpenStreamSync(ctx)
	if err != nil {
		qc.CloseWithError(0, "")
		return nil, err
	}
	sc := &streamConn{Stream: st, qc: qc}
	hc := newHopClientConn(sc, bufio.NewReaderSize(sc, hopConnBuffer), hopmux.DefaultMaxFrame)
	return d.started(&provenPath{hc: hc, kind: "direct", remote: qc.RemoteAddr().String(), dead: qc.Context().Done(),
		close: func() { qc.CloseWithError(0, "") }, cause: func() error { return context.Cause(qc.Context()) }})
}

// started runs a proven path's hop connection until it closes or the node does.
func (d *DirectPaths) started(pp *provenPath) (*provenPath, error) {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		pp.hc.close(errHopConnClosed)
		pp.close()
		return nil, errHopConnClosed
	}
	d.wg.Add(2)
	d.mu.Unlock()
	pp.hc.start(d.ctx, &d.wg)
	return pp, nil
}

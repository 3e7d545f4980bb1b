package node

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"meshgpu/hopmux"
	"meshgpu/internal/boundmap"
	"meshgpu/wire"
)

// Direct hops over one persistent connection per peer (protocol version
// 2): GET /hop upgrades a keep-alive HTTP connection to hop frames (layouts
// in hopmux/doc.go), multiplexed by stream id. A peer that answers anything
// but 101 gets POST /forward for a while.

const (
	// hopPingInterval keeps a quiet connection alive; the server drops a
	// connection silent for hopIdleTimeout.
	hopPingInterval = 15 * time.Second
	hopIdleTimeout  = 4 * hopPingInterval
	// hopWriteTimeout bounds one frame write; a peer slower than that is dropped.
	hopWriteTimeout = 10 * time.Second
	// hopV1Retry is how long a peer that refused the upgrade gets POST /forward.
	hopV1Retry = time.Minute
	// hopConnBuffer is the read buffer of a hop connection.
	hopConnBuffer = 64 << 10
	// hopMaxStreams bounds a client connection's hops in flight.
	hopMaxStreams = 1024
)

var errHopConnClosed = errors.New("hop connection closed")

// ---- server side ----

// HopConns owns the hop connections a node serves (GET /hop upgrades):
// each is served by the upgrade's handler goroutine until it closes. The
// zero value is ready; Close drops them and waits for their hops.
type HopConns struct {
	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup
}

// Serve upgrades GET /hop to hop frames and hands every Hop to hs.
func (hc *HopConns) Serve(w http.ResponseWriter, r *http.Request, hs hopmux.Handler, log *slog.Logger) {
	if !headerHasToken(r.Header, "Connection", "upgrade") || !strings.EqualFold(r.Header.Get("Upgrade"), wire.HopUpgrade) {
		w.Header().Set("Upgrade", wire.HopUpgrade)
		writeError(w, &apiError{Status: http.StatusUpgradeRequired, Type: "upgrade_required",
			Message: "GET /hop upgrades to hop frames: send Connection: Upgrade and Upgrade: " + wire.HopUpgrade})
		return
	}
	hj, ok := w.(http.Hijacker)
	if !ok {
		writeError(w, &apiError{Status: http.StatusNotImplemented, Type: "not_supported", Message: "this transport cannot upgrade to hop frames"})
		return
	}
	c, brw, err := hj.Hijack()
	if err != nil {
		return
	}
	if !hc.track(c) {
		c.Close()
		return
	}
	defer hc.untrack(c)
	c.SetWriteDeadline(time.Now().Add(hopWriteTimeout))
	fmt.Fprintf(brw, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: %s\r\n%s: %d\r\n\r\n",
		wire.HopUpgrade, wire.HeaderMaxFrame, hopmux.DefaultMaxFrame)
	if err := brw.Flush(); err != nil {
		c.Close()
		return
	}
	br := brw.Reader
	if br.Size() < hopConnBuffer {
		br = bufio.NewReaderSize(io.MultiReader(io.LimitReader(br, int64(br.Buffered())), c), hopConnBuffer)
	}
	err = serveHopFrames(hs, c, br, hopmux.DefaultMaxFrame, hopIdleTimeout)
	if log != nil {
		log.Debug("hop connection closed", "remote", c.RemoteAddr().String(), "cause", err)
	}
}

func (hc *HopConns) track(c net.Conn) bool {
	hc.mu.Lock()
	defer hc.mu.Unlock()
	if hc.closed {
		return false
	}
	if hc.conns == nil {
		hc.conns = map[net.Conn]struct{}{}
	}
	hc.conns[c] = struct{}{}
	hc.wg.Add(1)
	return true
}

func (hc *HopConns) untrack(c net.Conn) {
	hc.mu.Lock()
	delete(hc.conns, c)
	hc.mu.Unlock()
	hc.wg.Done()
}

// Close closes every connection, refuses new ones, and waits for their
// handlers (and the hops they run) to return.
func (hc *HopConns) Close() {
	hc.mu.Lock()
	hc.closed = true
	for c := range hc.conns {
		c.Close()
	}
	hc.mu.Unlock()
	hc.wg.Wait()
}

func headerHasToken(h http.Header, name, token string) bool {
	for _, v := range h.Values(name) {
		for _, t := range strings.Split(v, ",") {
			if strings.EqualFold(strings.TrimSpace(t), token) {
				return true
			}
		}
	}
	return false
}

// serveHopFrames serves the hop frames br (c's reader) brings to hs
// (hopmux: the goroutine that read a hop runs it while another reads on)
// until the connection fails, goes silent for idle, or a peer sends a
// malformed frame. It closes c and waits for its hops before returning.
func serveHopFrames(hs hopmux.Handler, c net.Conn, br *bufio.Reader, maxFrame int, idle time.Duration) error {
	hc := newHopConn(c, br, maxFrame, hs)
	// Hops on this connection carry its token: a session bound over it takes
	// unbound hops only from it (node/tickets.go).
	hc.m.Context = wire.WithHopSender(context.Background(), &wire.HopSender{Remote: c.RemoteAddr().String()})
	hc.m.Start()
	// At hopMaxStreams hops running nobody reads (Cancel and Ping wait);
	// AcceptHop refuses hops past the node's in-flight limit well before.
	return hc.serve(idle, hopMaxStreams)
}

// ---- client side ----

// hopPeers holds this node's hop connections, one per peer endpoint.
type hopPeers struct {
	log    *slog.Logger
	tlsCfg func() *tls.Config // client TLS settings for https peers
	// pin, when set, is the TLS config accepting exactly peerID's key
	// (node/hoptls.go): hops to a known peer id go over TLS.
	pin    func(peerID string) *tls.Config
	dialFn func(ctx context.Context, network, addr string) (net.Conn, error)
	ctx    context.Context // ends when the server closes
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	peers  map[string]*hopPeer
	// spokeTLS holds the peer ids that completed a pinned TLS handshake:
	// such a peer is never sent plain hops, whatever answers at its
	// address later (no downgrade by an attacker answering plain HTTP).
	spokeTLS boundmap.Map[string, struct{}]
	closed   bool
}

// hopPeer is one endpoint: its live connection, or since when it refused
// the upgrade.
type hopPeer struct {
	mu      sync.Mutex // serialises dialing
	c       *hopConn
	v1Since time.Time
	// plainSince: an http:// peer answered TLS with plain HTTP (it serves
	// no TLS); plain hops until hopV1Retry has passed.
	plainSince time.Time
}

func newHopPeers(log *slog.Logger, tlsCfg func() *tls.Config) *hopPeers {
	p := &hopPeers{log: log, tlsCfg: tlsCfg, peers: map[string]*hopPeer{},
		spokeTLS: boundmap.Map[string, struct{}]{Max: maxSpokeTLS}}
	p.ctx, p.cancel = context.WithCancel(context.Background())
	return p
}

// close drops every connection and waits for their goroutines.
func (p *hopPeers) close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.cancel()
	p.wg.Wait()
}

// do sends one hop to endpoint over its hop connection (dialing it if
// needed) and waits for the reply; wire.ErrHopFramesUnsupported means the
// peer wants POST /forward.
func (p *hopPeers) do(ctx context.Context, endpoint string, h *wire.HopHead, payload []byte, into hopmux.ReplyBuffer) (*wire.HopReply, error) {
	return p.doPeer(ctx, endpoint, "", h, payload, into)
}

// doPeer is do to the node whose peer id is peerID ("": unknown, no pinning).
func (p *hopPeers) doPeer(ctx context.Context, endpoint, peerID string, h *wire.HopHead, payload []byte, into hopmux.ReplyBuffer) (*wire.HopReply, error) {
	c, err := p.conn(ctx, strings.TrimRight(endpoint, "/"), peerID)
	if err != nil {
		return nil, err
	}
	return c.roundTrip(ctx, h, payload, into)
}

func (p *hopPeers) conn(ctx context.Context, base, peerID string) (*hopConn, error) {
	if p.pin == nil {
		peerID = "" // no pinning: one connection per endpoint
	}
	key := base + " " + peerID
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, errHopConnClosed
	}
	hp := p.peers[key]
	if hp == nil {
		if len(p.peers) >= 4096 { // forget refusals and dead peers before growing without bound
			for k, v := range p.peers {
				if v.mu.TryLock() {
					if v.c == nil || !v.c.alive() {
						delete(p.peers, k)
					}
					v.mu.Unlock()
				}
			}
		}
		hp = &hopPeer{}
		p.peers[key] = hp
	}
	p.mu.Unlock()
	hp.mu.Lock()
	defer hp.mu.Unlock()
	if hp.c != nil && hp.c.alive() {
		return hp.c, nil
	}
	if !hp.v1Since.IsZero() && time.Since(hp.v1Since) < hopV1Retry {
		return nil, wire.ErrHopFramesUnsupported
	}
	spoke := p.spokeTLSBefore(peerID)
	tlsPin := peerID != "" && (spoke || hp.plainSince.IsZero() || time.Since(hp.plainSince) >= hopV1Retry)
	c, err := p.dial(ctx, base, peerID, tlsPin)
	if tlsPin && notTLS(err) && strings.HasPrefix(base, "http://") && !spoke {
		// The peer serves no TLS; another key would have failed the handshake.
		p.log.Debug("peer serves no TLS; plain hops", "peer", base)
		hp.plainSince = time.Now()
		c, err = p.dial(ctx, base, peerID, false)
	} else if tlsPin && err == nil {
		p.sawTLS(peerID)
	}
	if errors.Is(err, wire.ErrHopFramesUnsupported) {
		hp.v1Since = time.Now()
		p.log.Debug("peer does not speak hop frames; using POST /forward", "peer", base, "reason", err)
	}
	if err != nil {
		return nil, err
	}
	hp.c, hp.v1Since = c, time.Time{}
	return c, nil
}

func (p *hopPeers) spokeTLSBefore(peerID string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	_, ok := p.spokeTLS.Get(peerID)
	return peerID != "" && ok
}

// maxSpokeTLS bounds spokeTLS: past it one peer is forgotten at a time
// (and may be probed once more).
const maxSpokeTLS = 1 << 16

func (p *hopPeers) sawTLS(peerID string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.spokeTLS.Put(peerID, struct{}{})
}

// dial connects to base and upgrades the connection to hop frames.
func (p *hopPeers) dial(ctx context.Context, base, peerID string, tlsPin bool) (*hopConn, error) {
	u, err := url.Parse(base)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("endpoint %q is not an http(s) URL", wire.Truncate(base, 80))
	}
	addr := u.Host
	if u.Port() == "" {
		addr = net.JoinHostPort(u.Hostname(), map[string]string{"http": "80", "https": "443"}[u.Scheme])
	}
	dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	dial := p.dialFn
	if dial == nil {
		dial = (&net.Dialer{KeepAlive: 30 * time.Second}).DialContext
	}
	nc, err := dial(dctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			nc.Close()
		}
	}()
	if dl, has := dctx.Deadline(); has {
		nc.SetDeadline(dl)
	}
	if u.Scheme == "https" || tlsPin {
		var cfg *tls.Config
		if peerID != "" && p.pin != nil {
			cfg = p.pin(peerID)
			// Ask for the identity certificate where the node also serves
			// an operator's one (SplitTLS); older nodes ignore it.
			cfg.NextProtos = []string{wire.HopTLSProto, "http/1.1"}
		} else {
			cfg = p.tlsCfg()
			cfg.NextProtos = []string{"http/1.1"}
		}
		cfg.ServerName = u.Hostname()
		tc := tls.Client(nc, cfg)
		if err := tc.HandshakeContext(dctx); err != nil {
			return nil, err
		}
		nc = tc
	}
	if _, err := fmt.Fprintf(nc, "GET %s HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: %s\r\n\r\n", wire.HopPath, u.Host, wire.HopUpgrade); err != nil {
		return nil, err
	}
	br := bufio.NewReaderSize(nc, hopConnBuffer)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusSwitchingProtocols || !strings.EqualFold(resp.Header.Get("Upgrade"), wire.HopUpgrade) {
		resp.Body.Close()
		return nil, fmt.Errorf("%w: GET %s answered %s", wire.ErrHopFramesUnsupported, wire.HopPath, resp.Status)
	}
	maxFrame := hopmux.DefaultMaxFrame
	if m, err := strconv.Atoi(resp.Header.Get(wire.HeaderMaxFrame)); err == nil && m > 0 && m < maxFrame {
		maxFrame = m
	}
	nc.SetDeadline(time.Time{})
	c := newHopClientConn(nc, br, maxFrame)
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, errHopConnClosed
	}
	p.wg.Add(2)
	p.mu.Unlock()
	ok = true
	c.start(p.ctx, &p.wg)
	return c, nil
}

// newHopClientConn makes the client end of a hop connection over nc (a
// TCP or TLS connection after GET /hop, or a direct path's QUIC stream),
// read through br.
func newHopClientConn(nc net.Conn, br *bufio.Reader, maxFrame int) *hopConn {
	c := newHopConn(nc, br, maxFrame, nil)
	c.m.MaxFrame, c.m.MaxWaiting = maxFrame, hopMaxStreams
	c.m.Start()
	return c
}

// start runs c's reader and pinger until c closes or ctx ends; the caller
// has added 2 to wg for them.
func (c *hopConn) start(ctx context.Context, wg *sync.WaitGroup) {
	stop := context.AfterFunc(ctx, func() { c.close(errHopConnClosed) })
	go func() { defer wg.Done(); defer stop(); c.serve(3*hopPingInterval, 1) }()
	go func() { defer wg.Done(); c.keepalive() }()
}

// tlsConfig is the server's client TLS settings (its HTTPClient's, when
// that has an http.Transport), else the system roots.
func (s *Server) tlsConfig() *tls.Config {
	if hc := s.HTTPClient; hc != nil {
		if t, ok := hc.Transport.(*http.Transport); ok && t.TLSClientConfig != nil {
			return t.TLSClientConfig.Clone()
		}
	}
	return &tls.Config{}
}

// HopClient sends hops as hop frames over one persistent connection per
// node (what a node's own hops use; exported for clients and benchmarks
// that are not nodes). The zero value is ready; Close drops its
// connections.
type HopClient struct {
	// TLSConfig is used for https endpoints; nil trusts the system roots.
	TLSConfig *tls.Config
	Logger    *slog.Logger
	// NetDialContext dials TCP; nil uses the default dialer.
	NetDialContext func(ctx context.Context, network, addr string) (net.Conn, error)

	once sync.Once
	p    *hopPeers
}

// Do sends one hop to the node at endpoint and waits for its reply; an
// activations reply is read into the buffer into lends (nil: Go memory).
// wire.ErrHopFramesUnsupported means the node speaks only POST /forward.
func (c *HopClient) Do(ctx context.Context, endpoint string, h *wire.HopHead, payload []byte, into hopmux.ReplyBuffer) (*wire.HopReply, error) {
	c.init()
	return c.p.do(ctx, endpoint, h, payload, into)
}

func (c *HopClient) init() {
	c.once.Do(func() {
		log := c.Logger
		if log == nil {
			log = slog.Default()
		}
		c.p = newHopPeers(log, func() *tls.Config {
			if c.TLSConfig != nil {
				return c.TLSConfig.Clone()
			}
			return &tls.Config{}
		})
		c.p.dialFn = c.NetDialContext
	})
}

// Close drops the client's connections and waits for their goroutines.
func (c *HopClient) Close() error {
	c.init()
	c.p.close()
	return nil
}

// hopConn is one hop connection (GET /hop, or a direct path's QUIC
// stream) on a hopmux.Conn, which reads and writes it (hopmux.Stream): a
// server's end serves hops, a client's end sends them and pings.
type hopConn struct {
	s      hopmux.Stream
	m      hopmux.Conn
	closed chan struct{}
}

func newHopConn(nc net.Conn, br *bufio.Reader, maxFrame int, hs hopmux.Handler) *hopConn {
	c := &hopConn{s: hopmux.Stream{Conn: nc, R: br, MaxFrame: maxFrame, WriteTimeout: hopWriteTimeout}, closed: make(chan struct{})}
	c.m = hopmux.Conn{Handler: hs, Lost: errHopConnClosed, Write: c.s.Write,
		OnClose: func(error) { close(c.closed); nc.Close() },
	}
	return c
}

func (c *hopConn) alive() bool {
	select {
	case <-c.closed:
		return false
	default:
		return true
	}
}

// close ends the connection once and fails the hops waiting on it.
func (c *hopConn) close(err error) { c.m.Close(err) }

// roundTrip sends one hop and waits for its reply or ctx.
func (c *hopConn) roundTrip(ctx context.Context, h *wire.HopHead, payload []byte, into hopmux.ReplyBuffer) (*wire.HopReply, error) {
	return c.m.RoundTrip(ctx, "", h, payload, into)
}

// serve serves the connection until it fails, goes silent for idle, or a
// malformed frame arrives.
func (c *hopConn) serve(idle time.Duration, limit int) error {
	return c.m.ServeStream(&c.s, idle, limit)
}

// keepalive pings until the connection closes, so the peer's idle
// timeout never drops a connection between sessions.
func (c *hopConn) keepalive() {
	t := time.NewTicker(hopPingInterval)
	defer t.Stop()
	for {
		select {
		case <-c.closed:
			return
		case <-t.C:
			if err := c.m.Write(hopmux.Frame(hopmux.FramePing, make([]byte, 8)), nil, nil); err != nil {
				c.close(err)
				return
			}
		}
	}
}

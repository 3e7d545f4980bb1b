package relay

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/gorilla/websocket"

	"meshgpu/identity"
	"meshgpu/internal/boundmap"
	"meshgpu/internal/frameloop"
	"meshgpu/wire"
)

// errTunnelUnsupported means the relay has no /tunnel or speaks another
// version; callers fall back to /ws or /rpc.
var errTunnelUnsupported = errors.New("relay does not support tunnel protocol version 1")

// errRelayLost fails requests in flight when the relay connection drops.
var errRelayLost = errors.New("relay connection lost")

// RelayError is a failure reported by the relay itself (peer not connected,
// limited, timed out, registration refused), not an answer from the node.
type RelayError struct {
	Code    int    // HTTP-like status
	Type    string // e.g. peer_not_connected, rate_limited
	Message string
}

func (e *RelayError) Error() string {
	if e.Type != "" {
		return fmt.Sprintf("relay: %s (%d %s)", e.Message, e.Code, e.Type)
	}
	return fmt.Sprintf("relay: %s (%d)", e.Message, e.Code)
}

// relayErrorType names tunnel Error codes, which carry no type string.
func relayErrorType(code int) string {
	switch code {
	case http.StatusNotFound:
		return "peer_not_connected"
	case http.StatusTooManyRequests:
		return "rate_limited"
	case http.StatusGatewayTimeout:
		return "timeout"
	case http.StatusServiceUnavailable:
		return "peer_busy"
	case http.StatusBadGateway:
		return "peer_error"
	case http.StatusUnauthorized, http.StatusForbidden:
		return "unauthorized"
	}
	return "relay_error"
}

// relayBase turns a relay URL (ws, wss, http or https; with or without a
// /rpc/{peer} suffix) into the ws(s)://host[/prefix] base.
func relayBase(raw string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return "", fmt.Errorf("relay URL %q: %w", raw, err)
	}
	switch u.Scheme {
	case "ws", "wss":
	case "http":
		u.Scheme = "ws"
	case "https":
		u.Scheme = "wss"
	default:
		return "", fmt.Errorf("relay URL %q must start with ws://, wss://, http:// or https://", raw)
	}
	if u.Host == "" {
		return "", fmt.Errorf("relay URL %q has no host", raw)
	}
	if i := strings.Index(u.Path, "/rpc/"); i >= 0 {
		u.Path = u.Path[:i]
	}
	u.Path = strings.TrimSuffix(u.Path, "/")
	u.RawQuery, u.Fragment, u.RawPath = "", "", ""
	return u.String(), nil
}

// splitRelayAddr splits a hop's relay_addr ws://relay/rpc/{peer_id}.
func splitRelayAddr(addr string) (base, peer string, err error) {
	u, err := url.Parse(addr)
	if err != nil {
		return "", "", fmt.Errorf("relay_addr %q: %w", addr, err)
	}
	i := strings.LastIndex(u.Path, "/rpc/")
	if i < 0 {
		return "", "", fmt.Errorf("relay_addr %q must end in /rpc/{peer_id}", addr)
	}
	peer = u.Path[i+len("/rpc/"):]
	if !validPeerID(peer) {
		return "", "", fmt.Errorf("relay_addr %q: bad peer id", addr)
	}
	base, err = relayBase(addr)
	return base, peer, err
}

// dialOpts configures one tunnel connection from a node.
type dialOpts struct {
	base         string
	id           *identity.Identity
	joinToken    string
	handler      http.Handler   // nil: this connection only sends requests
	hops         wire.HopServer // serves Hop frames; nil: Request frames only
	wsTunnel     bool           // WebSocket tunnel even where the raw one is offered
	maxInflight  int
	reqTimeout   time.Duration
	maxFrame     int
	pingInterval time.Duration
	netDial      func(ctx context.Context, network, addr string) (net.Conn, error)
	tlsConfig    *tls.Config
	log          *slog.Logger
}

func (o *dialOpts) dialer() *websocket.Dialer {
	return &websocket.Dialer{
		NetDialContext:   o.netDial,
		TLSClientConfig:  o.tlsConfig,
		HandshakeTimeout: handshakeTimeout,
		ReadBufferSize:   32 << 10,
		WriteBufferSize:  32 << 10,
	}
}

// tconn is a node's end of a tunnel: it sends requests (roundTrip) and,
// with a handler, serves requests the relay routes to it.
type tconn struct {
	base   string
	c      *wsConn
	o      dialOpts
	sem    chan struct{}
	ctx    context.Context // cancelled when the connection ends
	cancel context.CancelFunc
	wg     sync.WaitGroup // writer, pinger and request goroutines
	done   chan struct{}  // closed when run returns
	// sendMax is the largest frame payload this end sends: the smaller of
	// its own limit and the relay's (ServerInfo), since the relay closes
	// the whole tunnel on a frame over its limit.
	sendMax int
	// ping is the keepalive period: the smaller of its own and the relay's
	// (ServerInfo), so the relay's idle timeout never drops a quiet tunnel.
	ping time.Duration
	// relayHops: the relay forwards Hop frames (ServerInfo features).
	relayHops bool
	scratch   []byte // read loop only: Hop heads
	// senders are the hop senders of this tunnel by the source peer id the
	// relay names (read loop only): a session bound by one takes unbound
	// hops only from it (wire.HopSender).
	senders boundmap.Map[string, *wire.HopSender]

	mu      sync.Mutex
	dead    error
	nextID  uint64
	waiting map[uint64]chan tresult
	streams map[uint64]*streamBody // streamed answers being received
	serving map[uint64]served
	hopWait map[uint64]*tunnelHopWaiter // Hop frames sent, by stream id

	// Keys of sealed hops (seal.go): sealOut by the peer this end sends
	// hops to, sealIn by the peer whose hops it serves. sealSem bounds the
	// key exchanges served at once, apart from the requests' sem.
	sealMu  sync.Mutex
	sealOut boundmap.Map[string, *sealSlot]
	sealIn  boundmap.Map[string, *peerSeal]
	sealSem chan struct{}
}

// sealSlot holds the keys for one target, or the exchange making them.
type sealSlot struct {
	k *sealKeys
	x *sealExchange // in flight; nil when none
}

// sealExchange is one key exchange in flight: done closes when k or err
// is set. Hops to the same peer wait for it, each within its own context.
type sealExchange struct {
	done chan struct{}
	k    *sealKeys
	err  error
}

// peerSeal is what one peer seals its hops to this end with: cur, the
// keys a frame last opened under, and next, the newest exchange's, which
// replace cur once a frame opens under them. A hello carries nothing
// fresh (the relay can replay it), so it only ever replaces next: keys in
// use are never evicted by one.
type peerSeal struct {
	cur, next *sealKeys
	used      time.Time // when a frame last opened, or next was made
}

func (ps *peerSeal) keys(id [wire.SealKeyIDLen]byte) *sealKeys {
	switch {
	case ps.cur != nil && ps.cur.id == id:
		return ps.cur
	case ps.next != nil && ps.next.id == id:
		return ps.next
	}
	return nil
}

// A tunnel holds the keys of up to maxSealPeers peers each way. A peer's
// keys it serves go only once unused for sealIdle (sealPendingIdle when no
// frame ever opened under them: an honest sender uses them at once); when
// none may go, a new peer's hello is answered 429. Keys it sends with go
// any time (the next hop exchanges again).
const (
	maxSealPeers     = 1024
	sealIdle         = 2 * time.Minute
	sealPendingIdle  = 10 * time.Second
	maxSealExchanges = 4
)

func sealInEvictable(_ string, ps *peerSeal) bool {
	idle := time.Since(ps.used)
	return idle > sealIdle || ps.cur == nil && idle > sealPendingIdle
}

// served is a request or hop being served: cancel ends it; by, when set,
// is when reapHops does (a hop's context has no timer of its own).
type served struct {
	cancel context.CancelFunc
	by     time.Time
}

// tunnelHopWaiter is a hop sent and waiting for its reply. Waiters are
// pooled: one that saw its hop through is used again.
type tunnelHopWaiter struct {
	ch      chan hopResult // buffered 1
	into    wire.ReplyBuffer
	written chan struct{} // buffered 1: the frame is written or dropped
	wrote   func()        // sends on written (made once, not per hop)
	head    []byte        // the frame's head, until written
	keys    *sealKeys     // the hop's keys: its reply must be sealed with them
	ctr     uint64        // the hop's counter, which its reply names
}

var hopWaiters = sync.Pool{New: func() any {
	w := &tunnelHopWaiter{ch: make(chan hopResult, 1), written: make(chan struct{}, 1), head: make([]byte, 0, 256)}
	w.wrote = func() { w.written <- struct{}{} }
	return w
}}

type hopResult struct {
	rep *wire.HopReply
	err error
}

type tresult struct {
	resp   wire.TunnelResponse
	err    error
	stream *streamBody // set for a streamed answer (ResponseStart)
}

// errRawUnsupported: the relay answered the raw upgrade with anything
// but 101 (an older relay); the WebSocket tunnel is tried next.
var errRawUnsupported = errors.New("relay does not offer the raw tunnel")

// dialRaw opens the raw tunnel: GET /tunnel upgraded to a plain stream of
// frames (RawTunnelUpgrade), over TLS for wss:// relays.
func dialRaw(ctx context.Context, o dialOpts) (*wsConn, error) {
	u, err := url.Parse(o.base)
	if err != nil {
		return nil, err
	}
	addr := u.Host
	if u.Port() == "" {
		addr = net.JoinHostPort(u.Hostname(), map[string]string{"ws": "80", "wss": "443"}[u.Scheme])
	}
	dial := o.netDial
	if dial == nil {
		dial = (&net.Dialer{KeepAlive: 30 * time.Second}).DialContext
	}
	dctx, cancel := context.WithTimeout(ctx, handshakeTimeout)
	defer cancel()
	nc, err := dial(dctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("relay %s: %w", o.base, err)
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
	if u.Scheme == "wss" {
		cfg := &tls.Config{}
		if o.tlsConfig != nil {
			cfg = o.tlsConfig.Clone()
		}
		if cfg.ServerName == "" {
			cfg.ServerName = u.Hostname()
		}
		cfg.NextProtos = []string{"http/1.1"}
		tc := tls.Client(nc, cfg)
		if err := tc.HandshakeContext(dctx); err != nil {
			return nil, fmt.Errorf("relay %s: %w", o.base, err)
		}
		nc = tc
	}
	if _, err := fmt.Fprintf(nc, "GET %s/tunnel HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: %s\r\n\r\n", u.Path, u.Host, RawTunnelUpgrade); err != nil {
		return nil, fmt.Errorf("relay %s: %w", o.base, err)
	}
	br := bufio.NewReaderSize(nc, 64<<10)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return nil, fmt.Errorf("relay %s: %w", o.base, err)
	}
	if resp.StatusCode != http.StatusSwitchingProtocols || !strings.EqualFold(resp.Header.Get("Upgrade"), RawTunnelUpgrade) {
		resp.Body.Close()
		return nil, fmt.Errorf("%w: GET /tunnel answered %s", errRawUnsupported, resp.Status)
	}
	ok = true
	return newRawConn(nc, br, DefaultSendQueue, DefaultWriteTimeout), nil
}

// dialTunnel connects and registers: the raw tunnel where the relay offers
// it, else the WebSocket one. The caller must call run.
func dialTunnel(ctx context.Context, o dialOpts) (*tconn, error) {
	var c *wsConn
	if !o.wsTunnel {
		rc, err := dialRaw(ctx, o)
		switch {
		case err == nil:
			c = rc
		case !errors.Is(err, errRawUnsupported):
			return nil, err
		}
	}
	if c == nil {
		ws, resp, err := o.dialer().DialContext(ctx, o.base+"/tunnel", nil)
		if err != nil {
			if resp != nil && (resp.StatusCode == http.StatusNotFound || resp.StatusCode == http.StatusMethodNotAllowed ||
				resp.StatusCode == http.StatusUpgradeRequired || resp.StatusCode == http.StatusNotImplemented) {
				return nil, fmt.Errorf("%w (GET /tunnel: %s)", errTunnelUnsupported, resp.Status)
			}
			return nil, fmt.Errorf("relay %s: %w", o.base, err)
		}
		ws.SetReadLimit(int64(o.maxFrame) + 64<<10)
		c = newWSConn(ws, DefaultSendQueue, DefaultWriteTimeout, websocket.BinaryMessage)
	}
	fail := func(err error) (*tconn, error) {
		c.close(err)
		return nil, err
	}
	dl := time.Now().Add(handshakeTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(dl) {
		dl = d
	}
	typ, p, err := c.readNow(o.maxFrame, dl)
	if err != nil {
		return fail(fmt.Errorf("relay %s: tunnel handshake: %w", o.base, err))
	}
	if typ != wire.FrameServerChallenge {
		return fail(fmt.Errorf("%w: first frame was %v", errTunnelUnsupported, typ))
	}
	ch, err := wire.ParseTunnelChallenge(p)
	if err != nil || ch.Version != wire.TunnelVersion {
		return fail(fmt.Errorf("%w: relay speaks version %d", errTunnelUnsupported, ch.Version))
	}
	h := wire.TunnelHello{Version: wire.TunnelVersion, PeerID: o.id.PeerID, PublicKey: o.id.Public,
		Signature: o.id.Sign(ChallengeMessage(hex.EncodeToString(ch.Nonce[:]), o.id.PeerID)), JoinToken: o.joinToken}
	if o.handler != nil {
		h.Flags |= wire.FlagAcceptsRequests
		if o.hops != nil {
			h.Flags |= wire.FlagHopFrames
		}
	}
	hp, err := h.Append(nil)
	if err != nil {
		return fail(err)
	}
	if err := c.writeNow(wire.Frame(wire.FrameClientHello, hp), dl); err != nil {
		return fail(fmt.Errorf("relay %s: tunnel handshake: %w", o.base, err))
	}
	typ, p, err = c.readNow(o.maxFrame, dl)
	if err != nil {
		return fail(fmt.Errorf("relay %s: tunnel handshake: %w", o.base, err))
	}
	switch typ {
	case wire.FrameServerInfo:
	case wire.FrameError:
		e, _ := wire.ParseTunnelError(p)
		if e.Code == http.StatusUpgradeRequired {
			return fail(fmt.Errorf("%w: %s", errTunnelUnsupported, e.Message))
		}
		return fail(&RelayError{Code: int(e.Code), Type: relayErrorType(int(e.Code)), Message: e.Message})
	default:
		return fail(fmt.Errorf("relay %s: unexpected %v during handshake", o.base, typ))
	}
	info, err := wire.ParseTunnelInfo(p)
	if err != nil {
		return fail(fmt.Errorf("relay %s: malformed ServerInfo", o.base))
	}
	c.clearWriteDeadline()
	t := &tconn{
		base:    o.base,
		c:       c,
		o:       o,
		sem:     make(chan struct{}, max(o.maxInflight, 1)),
		done:    make(chan struct{}),
		sendMax: o.maxFrame,
		ping:    o.pingInterval,
		waiting: map[uint64]chan tresult{},
		streams: map[uint64]*streamBody{},
		serving: map[uint64]served{},
		hopWait: map[uint64]*tunnelHopWaiter{},
		scratch: make([]byte, 4<<10),
		senders: boundmap.Map[string, *wire.HopSender]{Max: maxHopSenders},
		sealOut: boundmap.Map[string, *sealSlot]{Max: maxSealPeers},
		sealIn:  boundmap.Map[string, *peerSeal]{Max: maxSealPeers, Evictable: sealInEvictable},
		sealSem: make(chan struct{}, maxSealExchanges),

		relayHops: info.Features&wire.FeatureHopFrames != 0,
	}
	if m := int64(info.MaxFrame); m > 0 && m < int64(t.sendMax) {
		t.sendMax = int(m)
	}
	if p := time.Duration(info.PingIntervalMs) * time.Millisecond; p > 0 && p < t.ping {
		t.ping = max(p, minPingInterval)
	}
	t.ctx, t.cancel = context.WithCancel(context.Background())
	return t, nil
}

// fits reports whether a frame of head (frame header included) and body
// is within the relay's limit.
func (t *tconn) fits(head, body []byte) bool {
	return len(head)-wire.FrameHeaderLen+len(body) <= t.sendMax
}

func (t *tconn) tooLarge(what string, head, body []byte) string {
	return fmt.Sprintf("%s of %d bytes exceeds the relay's maximum frame of %d bytes", what, len(head)-wire.FrameHeaderLen+len(body), t.sendMax)
}

// alive reports whether the connection can take new requests.
func (t *tconn) alive() bool {
	select {
	case <-t.c.closed:
		return false
	default:
		return true
	}
}

// run reads frames until the connection ends or ctx is done, then fails
// what is in flight and waits for the connection's goroutines.
func (t *tconn) run(ctx context.Context) error {
	defer close(t.done)
	stop := context.AfterFunc(ctx, func() { t.c.close(context.Canceled) })
	defer stop()
	t.wg.Add(2)
	go func() { defer t.wg.Done(); t.c.writeLoop() }()
	go func() { defer t.wg.Done(); keepalive(t.c, t.ping) }()
	if t.o.hops != nil && t.o.handler != nil {
		t.wg.Add(1)
		go func() { defer t.wg.Done(); t.reapHops() }()
	}
	err := t.shutdown(t.readLoop())
	t.wg.Wait()
	return err
}

// shutdown ends the tunnel once: closes the connection, cancels the hops
// and requests it serves, and fails the ones it sent. It returns why the
// tunnel ended (the first cause).
func (t *tconn) shutdown(err error) error {
	if c := t.c.cause(); c != nil {
		err = c
	}
	t.c.close(err)
	t.cancel()
	t.mu.Lock()
	if t.dead != nil {
		err = t.dead
		t.mu.Unlock()
		return err
	}
	t.dead = err
	waiting := t.waiting
	t.waiting = map[uint64]chan tresult{}
	streams := t.streams
	t.streams = map[uint64]*streamBody{}
	hopWait := t.hopWait
	t.hopWait = map[uint64]*tunnelHopWaiter{}
	t.mu.Unlock()
	for _, ch := range waiting {
		ch <- tresult{err: fmt.Errorf("%w: %v", errRelayLost, err)}
	}
	for _, w := range hopWait {
		w.ch <- hopResult{err: fmt.Errorf("%w: %v", errRelayLost, err)}
	}
	for _, sb := range streams {
		sb.finish(fmt.Errorf("%w: %v", errRelayLost, err))
	}
	return err
}

// reapHops cancels the hops served past the request timeout, until the
// tunnel ends. A hop's context has no timer of its own (a runtime timer
// per hop costs more than its work on the tunnel); this one ticker holds
// the timeout to within an eighth of it.
func (t *tconn) reapHops() {
	tk := time.NewTicker(max(t.o.reqTimeout/8, time.Millisecond))
	defer tk.Stop()
	var late []context.CancelFunc
	for {
		select {
		case <-t.ctx.Done():
			return
		case now := <-tk.C:
			t.mu.Lock()
			for _, sv := range t.serving {
				if !sv.by.IsZero() && now.After(sv.by) {
					late = append(late, sv.cancel)
				}
			}
			t.mu.Unlock()
			for _, cancel := range late {
				cancel()
			}
			clear(late)
			late = late[:0]
		}
	}
}

// minPingInterval bounds how often a relay's advertisement makes a node ping.
const minPingInterval = 10 * time.Millisecond

// keepalive pings every interval; the peer's pongs (and any message)
// extend the read deadline, so a dead relay is noticed within 3 intervals.
func keepalive(c *wsConn, interval time.Duration) {
	tk := time.NewTicker(interval)
	defer tk.Stop()
	for {
		select {
		case <-c.closed:
			return
		case <-tk.C:
			if err := c.ping(interval); err != nil {
				c.close(fmt.Errorf("ping: %w", err))
				return
			}
		}
	}
}

func (t *tconn) readLoop() error {
	idle := 3 * t.ping
	if ws := t.c.ws; ws != nil {
		ws.SetPongHandler(func(string) error { ws.SetReadDeadline(time.Now().Add(idle)); return nil })
	}
	var r io.Reader // the message being read (a WebSocket's), or the raw stream
	next := func() (func(), error) {
		for {
			if r == nil {
				var err error
				if r, err = t.c.frames(idle); err != nil {
					return nil, err
				}
			}
			t.c.extendRead(idle)
			typ, n, err := wire.ReadFrameHeader(r, t.o.maxFrame)
			if err == io.EOF && !t.c.endOfFrames() {
				r = nil // the end of one WebSocket message
				continue
			}
			if err != nil {
				return nil, err
			}
			return t.readFrame(r, typ, n)
		}
	}
	// Hops run on the goroutine that read them while another reads on
	// (frameloop); at most cap(t.sem) run, so one more can always read.
	return frameloop.Serve(func() (func(), error) {
		work, err := next()
		if err != nil {
			t.shutdown(err) // the hops in flight end with the tunnel
		}
		return work, err
	}, cap(t.sem)+1)
}

// readFrame reads one frame of type typ and n bytes from r and acts on it;
// a Hop frame returns the work that runs it.
func (t *tconn) readFrame(r io.Reader, typ wire.FrameType, n int) (func(), error) {
	// Hop frames are read straight into the buffers they belong in.
	switch typ {
	case wire.FrameHop:
		return t.serveHop(r, n)
	case wire.FrameHopReply:
		return nil, t.readHopReply(r, n)
	}
	if typ > wire.FrameHopReply {
		// A frame type this version does not know: skipped unread.
		return nil, wire.Discard(r, n)
	}
	p, err := readPayload(r, n)
	if err != nil {
		return nil, err
	}
	switch typ {
	case wire.FrameRequest:
		q, err := wire.ParseTunnelRequest(p)
		if err != nil {
			return nil, fmt.Errorf("malformed Request frame: %w", err)
		}
		t.serve(q)
	case wire.FrameResponse:
		a, err := wire.ParseTunnelResponse(p)
		if err != nil {
			return nil, fmt.Errorf("malformed Response frame: %w", err)
		}
		t.deliver(a.ID, tresult{resp: a})
	case wire.FrameError:
		e, err := wire.ParseTunnelError(p)
		if err != nil {
			return nil, fmt.Errorf("malformed Error frame: %w", err)
		}
		re := &RelayError{Code: int(e.Code), Type: relayErrorType(int(e.Code)), Message: e.Message}
		if e.ID == 0 {
			return nil, re
		}
		if w := t.takeHopWaiter(e.ID); w != nil {
			var err error = re
			if e.Code == http.StatusUpgradeRequired || e.Code == http.StatusNotImplemented {
				err = fmt.Errorf("%w: %s", wire.ErrHopFramesUnsupported, e.Message)
			}
			w.ch <- hopResult{err: err}
		} else if sb := t.takeStream(e.ID); sb != nil {
			sb.finish(re) // the stream broke after its head
		} else {
			t.deliver(e.ID, tresult{err: re})
		}
	case wire.FrameResponseStart:
		a, err := wire.ParseTunnelResponse(p)
		if err != nil {
			return nil, fmt.Errorf("malformed ResponseStart frame: %w", err)
		}
		sb := newStreamBody(t, a.ID, t.o.maxFrame)
		sb.push(a.Body)
		t.mu.Lock()
		ch := t.waiting[a.ID]
		delete(t.waiting, a.ID)
		if ch != nil {
			t.streams[a.ID] = sb
		}
		t.mu.Unlock()
		if ch != nil {
			ch <- tresult{resp: a, stream: sb}
		}
	case wire.FrameResponseData:
		id, data, err := wire.ParseData(p)
		if err != nil {
			return nil, fmt.Errorf("malformed ResponseData frame: %w", err)
		}
		t.mu.Lock()
		sb := t.streams[id]
		t.mu.Unlock()
		if sb != nil {
			sb.push(data)
		}
	case wire.FrameResponseEnd:
		if id, err := wire.ParseID(p); err == nil {
			if sb := t.takeStream(id); sb != nil {
				sb.finish(nil)
			}
		}
	case wire.FrameCancel:
		if id, err := wire.ParseID(p); err == nil {
			t.mu.Lock()
			sv, ok := t.serving[id]
			delete(t.serving, id)
			t.mu.Unlock()
			if ok {
				sv.cancel()
			}
		}
	case wire.FramePing:
		t.c.send(outMsg{head: wire.Frame(wire.FramePong, p)})
	default:
		// Pong and unknown frame types are skipped.
	}
	return nil, nil
}

// readPayload reads a frame's payload of n bytes into a new slice.
func readPayload(r io.Reader, n int) ([]byte, error) {
	p := make([]byte, n)
	if _, err := io.ReadFull(r, p); err != nil {
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			return nil, wire.ErrShortFrame
		}
		return nil, err
	}
	return p, nil
}

func (t *tconn) takeHopWaiter(id uint64) *tunnelHopWaiter {
	t.mu.Lock()
	defer t.mu.Unlock()
	w := t.hopWait[id]
	delete(t.hopWait, id)
	return w
}

// serveHop reads a Hop frame of n bytes from r, its payload straight into
// the buffer the hop server lends, and returns the work that runs it (up to
// cap(t.sem) at once; nil when it was answered already). A malformed head
// is an error: the tunnel closes.
func (t *tconn) serveHop(r io.Reader, n int) (func(), error) {
	rt, rest, err := wire.ReadHopRoute(r, n)
	if err != nil {
		return nil, fmt.Errorf("malformed Hop frame: %w", err)
	}
	var lb [4]byte
	if rest < len(lb) {
		return nil, fmt.Errorf("malformed Hop frame: %w", wire.ErrShortFrame)
	}
	if _, err := io.ReadFull(r, lb[:]); err != nil {
		return nil, err
	}
	if binary.BigEndian.Uint32(lb[:]) != wire.SealedHopMark {
		t.sealMu.Lock()
		_, sealing := t.sealIn.Get(rt.Peer)
		t.sealMu.Unlock()
		if sealing {
			// This peer seals its hops: a plain one in its name is the
			// relay's own.
			if err := wire.Discard(r, rest-len(lb)); err != nil {
				return nil, err
			}
			t.sendHopReply(rt.Stream, errReply(http.StatusForbidden, "seal_required", "this peer seals its hops; a plain one in its name is refused"))
			return nil, nil
		}
		// A plain hop (a sender of an older version): it chose to be read.
		return t.serveHopBody(rt, io.MultiReader(bytes.NewReader(lb[:]), r), rest, nil, 0)
	}
	var sp [wire.SealPrefixLen]byte
	clen := rest - len(lb) - len(sp)
	if clen < wire.SealOverhead {
		return nil, fmt.Errorf("malformed sealed Hop frame: %w", wire.ErrShortFrame)
	}
	if _, err := io.ReadFull(r, sp[:]); err != nil {
		return nil, err
	}
	ctr := binary.BigEndian.Uint64(sp[wire.SealKeyIDLen:])
	t.sealMu.Lock()
	var k *sealKeys
	ps, _ := t.sealIn.Get(rt.Peer)
	if ps != nil {
		k = ps.keys([wire.SealKeyIDLen]byte(sp[:wire.SealKeyIDLen]))
	}
	t.sealMu.Unlock()
	if k == nil || k.peer != rt.Peer {
		if err := wire.Discard(r, clen); err != nil {
			return nil, err
		}
		t.sendHopReply(rt.Stream, errReply(http.StatusUnauthorized, wire.TypeSealUnknown, "unknown hop key: exchange keys again"))
		return nil, nil
	}
	buf := sealBuf(clen)
	defer putSealBuf(buf) // the head is parsed and the payload copied before serveHopBody returns
	if _, err := io.ReadFull(r, *buf); err != nil {
		return nil, err
	}
	plain, err := k.open(ctr, *buf)
	if err != nil {
		// Unsealed: the frame did not authenticate, so neither its counter
		// nor its stream is the sender's, and a reply sealed to them would
		// be one the relay could pass off as the answer to a real hop.
		t.sendHopReply(rt.Stream, errReply(http.StatusBadRequest, "bad_seal", err.Error()))
		return nil, nil
	}
	t.sealMu.Lock()
	if ps.next == k {
		ps.cur, ps.next = k, nil
	}
	ps.used = time.Now()
	t.sealMu.Unlock()
	return t.serveHopBody(rt, bytes.NewReader(plain), len(plain), k, ctr)
}

// errReply is an error HopReply with the one error body of meshgpu.
func errReply(code int, typ, msg string) *wire.HopReply {
	b, _ := json.Marshal(errorBody(typ, msg, ""))
	return &wire.HopReply{Status: code, Kind: wire.ReplyError, Body: b}
}

// serveHopBody serves a Hop whose head and payload (rest bytes) r reads,
// answering sealed with k (the hop's counter ctr) when it came sealed.
func (t *tconn) serveHopBody(rt wire.HopRoute, r io.Reader, rest int, k *sealKeys, ctr uint64) (func(), error) {
	reply := func(rep *wire.HopReply) {
		if k != nil {
			t.sendSealedHopReply(rt.Stream, k, ctr, rep)
		} else {
			t.sendHopReply(rt.Stream, rep)
		}
	}
	h, pl, err := wire.ReadHopHead(r, rest, t.scratch, 0)
	if err != nil {
		if k != nil { // the tunnel's framing is intact; the peer's head is not
			reply(errReply(http.StatusBadRequest, "invalid_header", "malformed Hop head: "+err.Error()))
			return nil, nil
		}
		return nil, fmt.Errorf("malformed Hop frame: %w", err)
	}
	refuse := func(code int, typ, msg string) (func(), error) {
		if err := wire.Discard(r, pl); err != nil {
			return nil, err
		}
		reply(errReply(code, typ, msg))
		return nil, nil
	}
	if t.o.hops == nil || t.o.handler == nil {
		return refuse(http.StatusNotImplemented, "not_supported", "this connection does not serve hop frames")
	}
	if int64(pl) != h.PayloadLen() {
		return refuse(http.StatusBadRequest, "invalid_header", fmt.Sprintf("body is %d bytes but shape %d,%d needs %d", pl, h.NTokens, h.Hidden, h.PayloadLen()))
	}
	select {
	case t.sem <- struct{}{}:
	default:
		return refuse(http.StatusTooManyRequests, "overloaded", fmt.Sprintf("node busy: %d requests in flight", cap(t.sem)))
	}
	// Cancelled by a Cancel frame, the tunnel's end, or reapHops once the
	// request timeout has passed.
	ctx, cancel := context.WithCancel(t.ctx)
	done := func() {
		cancel()
		<-t.sem
	}
	if hs := t.sender(rt.Peer, h.Binding != nil); hs != nil {
		ctx = wire.WithHopSender(ctx, hs)
	}
	buf, serve, refused := t.o.hops.AcceptHop(ctx, h)
	if refused != nil {
		done()
		if err := wire.Discard(r, pl); err != nil {
			return nil, err
		}
		reply(refused)
		return nil, nil
	}
	if _, err := io.ReadFull(r, buf); err != nil {
		serve(ctx, false)
		done()
		return nil, fmt.Errorf("reading a hop payload: %w", err)
	}
	by := time.Now().Add(t.o.reqTimeout)
	t.mu.Lock()
	t.serving[rt.Stream] = served{cancel: cancel, by: by}
	t.mu.Unlock()
	return func() {
		defer done()
		rep := serve(ctx, true)
		t.mu.Lock()
		_, wanted := t.serving[rt.Stream]
		delete(t.serving, rt.Stream)
		t.mu.Unlock()
		if !wanted || ctx.Err() != nil {
			rep.ReleaseBuffer() // cancelled: the relay no longer waits for it
			return
		}
		reply(rep)
	}, nil
}

// sendSealedHopReply queues rep sealed with k, naming the hop's counter
// ctr; rep's buffer is released once copied into the sealed one.
func (t *tconn) sendSealedHopReply(stream uint64, k *sealKeys, ctr uint64, rep *wire.HopReply) {
	head, err := wire.AppendHopReplyFrame(make([]byte, 0, 64+len(rep.Body)), stream, rep)
	if err != nil {
		rep.ReleaseBuffer()
		t.c.send(errFrame(stream, http.StatusBadGateway, err.Error()))
		return
	}
	const pre = wire.FrameHeaderLen + 8 // frame header and stream id
	plain := 8 + len(head) - pre + len(rep.Payload)
	buf := sealBuf(plain + wire.SealOverhead)
	binary.BigEndian.PutUint64(*buf, ctr)
	copy((*buf)[8+copy((*buf)[8:], head[pre:]):], rep.Payload)
	rep.ReleaseBuffer()
	c, body := k.seal(*buf, plain)
	*buf = body
	head = binary.BigEndian.AppendUint16(head[:pre], 0)
	head = append(head, wire.ReplySealed)
	head = append(head, k.id[:]...)
	head = binary.BigEndian.AppendUint64(head, c)
	binary.BigEndian.PutUint32(head[1:], uint32(len(head)-wire.FrameHeaderLen+len(body)))
	if !t.fits(head, body) {
		putSealBuf(buf)
		t.c.send(errFrame(stream, http.StatusBadGateway, t.tooLarge("hop reply", head, body)))
		return
	}
	t.c.sendNow(outMsg{head: head, body: body, done: func() { putSealBuf(buf) }})
}

// serveSeal answers a hop key exchange from peer (seal.go) and keeps the
// keys for the hops it will send.
func (t *tconn) serveSeal(peer string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hello, err := io.ReadAll(io.LimitReader(r.Body, 1<<10))
		if err != nil {
			return
		}
		accept, k, err := acceptSeal(t.o.id, peer, hello)
		if err != nil {
			writeHTTPError(w, http.StatusForbidden, "seal_refused", err.Error())
			return
		}
		t.sealMu.Lock()
		ps, ok := t.sealIn.Get(peer)
		if ok {
			ps.next = k // one exchange per peer pending; cur stays until k opens a frame
			if ps.cur == nil {
				ps.used = time.Now()
			}
		} else {
			ok = t.sealIn.Put(peer, &peerSeal{next: k, used: time.Now()})
		}
		t.sealMu.Unlock()
		if !ok {
			writeHTTPError(w, http.StatusTooManyRequests, wire.TypeOverloaded,
				fmt.Sprintf("this node holds the hop keys of %d peers, all in use", maxSealPeers))
			return
		}
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Write(accept)
	})
}

// maxHopSenders bounds a tunnel's senders; past it one is forgotten (its
// sessions answer 428 once and are bound again).
const maxHopSenders = 4096

// sender is the HopSender of the peer the relay names as a hop's source;
// a peer becomes one by sending a binding (a stranger's unbound hops add
// nothing). nil when the relay names no source: every hop then binds.
func (t *tconn) sender(peer string, binding bool) *wire.HopSender {
	if peer == "" {
		return nil
	}
	hs, _ := t.senders.Get(peer)
	if hs == nil && binding {
		hs = &wire.HopSender{Remote: "peer " + wire.Truncate(peer, 80) + " through the relay"}
		t.senders.Put(peer, hs)
	}
	return hs
}

// sendHopReply queues a HopReply written from rep's own buffer, which is
// released once written.
func (t *tconn) sendHopReply(stream uint64, rep *wire.HopReply) {
	head, err := wire.AppendHopReplyFrame(make([]byte, 0, 64+len(rep.Body)), stream, rep)
	if err == nil && !t.fits(head, rep.Payload) {
		err = errors.New(t.tooLarge("hop reply", head, rep.Payload))
	}
	if err != nil {
		rep.ReleaseBuffer()
		t.c.send(errFrame(stream, http.StatusBadGateway, err.Error()))
		return
	}
	t.c.sendNow(outMsg{head: head, body: rep.Payload, done: rep.ReleaseBuffer})
}

// readHopReply reads a HopReply of n bytes, activations into the buffer
// its waiter lends, and hands it over. The waiter is taken first: a
// caller giving up meanwhile then waits for this reply instead of reusing
// a buffer being read into. The reply to a sealed hop must be sealed with
// its keys and name its counter; anything else fails the hop as the relay
// path's fault (errSealPath: the relay could have written it, so the peer
// is not blamed), the plain seal_unknown making the sender exchange keys
// again first. A reply that fails that check leaves the tunnel's framing
// intact: the tunnel stays.
func (t *tconn) readHopReply(r io.Reader, n int) error {
	var pre [11]byte // stream id u64 | status u16 | kind u8
	if n < len(pre) {
		return fmt.Errorf("malformed HopReply frame: %w", wire.ErrShortFrame)
	}
	if _, err := io.ReadFull(r, pre[:]); err != nil {
		return err
	}
	w := t.takeHopWaiter(binary.BigEndian.Uint64(pre[:]))
	var into func(uint64) wire.ReplyBuffer
	if w != nil {
		into = func(uint64) wire.ReplyBuffer {
			if w.into != nil {
				return w.into
			}
			return wire.HeapBuffer
		}
	} else {
		into = func(uint64) wire.ReplyBuffer { return nil } // nobody waits: skipped unread
	}
	fail := func(err error) error {
		if w != nil {
			w.ch <- hopResult{err: err}
		}
		return nil
	}
	if pre[10] != wire.ReplySealed {
		_, rep, err := wire.ReadHopReply(io.MultiReader(bytes.NewReader(pre[:]), r), n, into)
		if err != nil {
			err = fmt.Errorf("malformed HopReply frame: %w", err)
			fail(fmt.Errorf("%w: %v", errRelayLost, err))
			return err
		}
		switch {
		case w == nil:
			rep.ReleaseBuffer() // late or unknown: dropped
		case w.keys != nil && rep.Kind == wire.ReplyError && isSealUnknown(rep):
			fail(errSealUnknown)
		case w.keys != nil:
			rep.ReleaseBuffer()
			fail(fmt.Errorf("%w: the reply to a sealed hop was not sealed (status %d)", errSealPath, rep.Status))
		default:
			w.ch <- hopResult{rep: rep}
		}
		return nil
	}
	var sp [wire.SealPrefixLen]byte
	if n < len(pre)+len(sp)+wire.SealOverhead {
		return fmt.Errorf("malformed HopReply frame: %w", wire.ErrShortFrame)
	}
	if _, err := io.ReadFull(r, sp[:]); err != nil {
		return err
	}
	clen := n - len(pre) - len(sp)
	if w == nil || w.keys == nil || [wire.SealKeyIDLen]byte(sp[:wire.SealKeyIDLen]) != w.keys.id {
		if err := wire.Discard(r, clen); err != nil {
			return err
		}
		return fail(errSealOpen)
	}
	buf := sealBuf(clen)
	defer putSealBuf(buf)
	if _, err := io.ReadFull(r, *buf); err != nil {
		fail(fmt.Errorf("%w: %v", errRelayLost, err))
		return err
	}
	plain, err := w.keys.open(binary.BigEndian.Uint64(sp[wire.SealKeyIDLen:]), *buf)
	if err != nil {
		return fail(err)
	}
	if len(plain) < 8 || binary.BigEndian.Uint64(plain) != w.ctr {
		return fail(fmt.Errorf("%w: a sealed reply answers another hop", errSealPath))
	}
	_, rep, err := wire.ReadHopReply(io.MultiReader(bytes.NewReader(pre[:8]), bytes.NewReader(plain[8:])), len(plain), into)
	if err != nil {
		return fail(fmt.Errorf("malformed sealed HopReply: %w", err))
	}
	w.ch <- hopResult{rep: rep}
	return nil
}

func isSealUnknown(rep *wire.HopReply) bool {
	e, ok := wire.DecodeError(rep.Status, rep.Body)
	return ok && e.Type == wire.TypeSealUnknown
}

// sealTo returns the keys for hops to peer, exchanging them through the
// relay first if needed (seal.go); hops to one peer share one exchange,
// each waiting within its own ctx. A peer whose tunnel serves no Hop
// frames (501), or an older one that has no /hop/seal (404, 405), gives
// wire.ErrHopFramesUnsupported; a busy one *sealBusy; an exchange that
// fails otherwise is the relay path's fault (errSealPath).
func (t *tconn) sealTo(ctx context.Context, peer string) (*sealKeys, error) {
	for {
		t.sealMu.Lock()
		sl, _ := t.sealOut.Get(peer)
		if sl == nil {
			sl = &sealSlot{}
			t.sealOut.Put(peer, sl)
		}
		if k := sl.k; k != nil {
			t.sealMu.Unlock()
			return k, nil
		}
		x := sl.x
		if x == nil {
			x = &sealExchange{done: make(chan struct{})}
			sl.x = x
			t.sealMu.Unlock()
			x.k, x.err = t.exchangeSeal(ctx, peer)
			t.sealMu.Lock()
			sl.x, sl.k = nil, x.k
			t.sealMu.Unlock()
			close(x.done)
			return x.k, x.err
		}
		t.sealMu.Unlock()
		select {
		case <-x.done:
			if x.err == nil || ctx.Err() != nil || !errors.Is(x.err, context.Canceled) && !errors.Is(x.err, context.DeadlineExceeded) {
				return x.k, x.err
			}
			// its sender gave up waiting; this hop exchanges on its own time
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// sealBusy is a busy answer to the key exchange: the peer holds as many
// peers' keys as it may, or serves its maximum of exchanges. The hop is
// answered as back-pressure, as a busy peer's hop is.
type sealBusy struct{ msg string }

func (e *sealBusy) Error() string { return "relay: hop key exchange: " + e.msg }

// exchangeSeal runs one key exchange with peer through the relay.
func (t *tconn) exchangeSeal(ctx context.Context, peer string) (*sealKeys, error) {
	eph, hello, err := newSealHello(t.o.id, peer)
	if err != nil {
		return nil, err
	}
	resp, sb, err := t.roundTrip(ctx, peer, http.MethodPost, wire.HopSealPath, nil, hello)
	var re *RelayError
	switch {
	case errors.As(err, &re) && (re.Code == http.StatusNotImplemented || re.Code == http.StatusUpgradeRequired):
		return nil, fmt.Errorf("%w: %s", wire.ErrHopFramesUnsupported, re.Message)
	case errors.As(err, &re) && busy(re):
		return nil, &sealBusy{msg: re.Message}
	case err != nil:
		return nil, err
	case sb != nil:
		sb.Close()
		return nil, fmt.Errorf("%w: the hop key exchange was answered with a stream", errSealPath)
	}
	msg := wire.Truncate(string(resp.Body), 200)
	if e, ok := wire.DecodeError(int(resp.Status), resp.Body); ok {
		msg = wire.Truncate(e.Message, 200)
	}
	switch resp.Status {
	case http.StatusOK:
	case http.StatusNotFound, http.StatusMethodNotAllowed:
		// An older node's mux: it takes plain hops (trust on first
		// contact, as POST /forward); DoHop refuses this for a peer that
		// sealed before.
		return nil, fmt.Errorf("%w: POST %s answered %d", wire.ErrHopFramesUnsupported, wire.HopSealPath, resp.Status)
	case http.StatusTooManyRequests:
		return nil, &sealBusy{msg: msg}
	default:
		// An honest peer refuses only a hello the relay altered or named
		// the wrong source for.
		return nil, fmt.Errorf("%w: peer %s refused the hop key exchange: %d %s", errSealPath, wire.Truncate(peer, 80), resp.Status, msg)
	}
	k, err := finishSeal(t.o.id, peer, eph, resp.Body)
	if err != nil {
		return nil, fmt.Errorf("%w: hop key exchange with %s: %v", errSealPath, wire.Truncate(peer, 80), err)
	}
	return k, nil
}

// forgetSeal drops k, the keys for peer, after the peer said it no longer
// knows them.
func (t *tconn) forgetSeal(peer string, k *sealKeys) {
	t.sealMu.Lock()
	defer t.sealMu.Unlock()
	if sl, _ := t.sealOut.Get(peer); sl != nil && sl.k == k {
		sl.k = nil
	}
}

// hopRoundTrip sends one Hop frame to peer through the relay, sealed to
// peer (seal.go), and waits for its reply or ctx. It returns only once
// payload is no longer read (sealed into a buffer of its own, or the
// tunnel closed), so the caller may reuse the buffer.
func (t *tconn) hopRoundTrip(ctx context.Context, peer string, h *wire.HopHead, payload []byte, into wire.ReplyBuffer) (*wire.HopReply, error) {
	for try := 0; ; try++ {
		k, err := t.sealTo(ctx, peer)
		var sb *sealBusy
		if errors.As(err, &sb) {
			return errReply(http.StatusTooManyRequests, wire.TypeOverloaded, sb.Error()), nil
		}
		if err != nil {
			return nil, err
		}
		rep, err := t.sealedRoundTrip(ctx, peer, k, h, payload, into)
		if errors.Is(err, errSealUnknown) && try == 0 {
			t.forgetSeal(peer, k) // the peer's tunnel restarted: exchange again
			continue
		}
		return rep, err
	}
}

// sealedRoundTrip is one try of hopRoundTrip with keys k. The frame is
// sealed before its waiter is listed: a reply read for its stream id,
// forged or not, then finds the waiter's keys and counter set.
func (t *tconn) sealedRoundTrip(ctx context.Context, peer string, k *sealKeys, h *wire.HopHead, payload []byte, into wire.ReplyBuffer) (*wire.HopReply, error) {
	w := hopWaiters.Get().(*tunnelHopWaiter)
	w.into, w.keys = into, k
	release := func() {
		w.into, w.keys = nil, nil
		hopWaiters.Put(w)
	}
	head, err := wire.AppendHopFrame(w.head[:0], 0, peer, h, len(payload)) // stream id set once listed
	if err != nil {
		release()
		return nil, err
	}
	// Everything after the routing prefix is sealed, in a buffer of its
	// own: head b32 and payload.
	route := wire.FrameHeaderLen + 9 + len(peer)
	plain := len(head) - route + len(payload)
	sealed := sealBuf(plain + wire.SealOverhead)
	copy((*sealed)[copy(*sealed, head[route:]):], payload)
	var body []byte
	w.ctr, body = k.seal(*sealed, plain)
	*sealed = body
	head = binary.BigEndian.AppendUint32(head[:route], wire.SealedHopMark)
	head = append(head, k.id[:]...)
	head = binary.BigEndian.AppendUint64(head, w.ctr)
	binary.BigEndian.PutUint32(head[1:], uint32(len(head)-wire.FrameHeaderLen+len(body)))
	if !t.fits(head, body) {
		putSealBuf(sealed)
		release()
		return nil, errors.New("relay: " + t.tooLarge("hop", head, body))
	}
	w.head = head
	t.mu.Lock()
	if t.dead != nil {
		t.mu.Unlock()
		putSealBuf(sealed)
		release()
		return nil, fmt.Errorf("%w: %v", errRelayLost, t.dead)
	}
	t.nextID++
	id := t.nextID
	binary.BigEndian.PutUint64(head[wire.FrameHeaderLen:], id)
	t.hopWait[id] = w
	t.mu.Unlock()
	if !t.c.sendNow(outMsg{head: head, body: *sealed, done: w.wrote}) {
		t.takeHopWaiter(id)
		return nil, fmt.Errorf("%w: %v", errRelayLost, t.c.cause()) // w not reused: written may yet be signalled
	}
	select {
	case r := <-w.ch:
		<-w.written
		putSealBuf(sealed)
		w.into, w.keys = nil, nil
		hopWaiters.Put(w) // out of hopWait, both channels drained
		return r.rep, r.err
	case <-ctx.Done():
		if t.takeHopWaiter(id) == nil {
			r := <-w.ch // the reader is handing the reply over
			r.rep.ReleaseBuffer()
		}
		t.c.send(outMsg{head: wire.Frame(wire.FrameCancel, wire.AppendID(nil, id))})
		<-w.written
		putSealBuf(sealed)
		return nil, ctx.Err()
	}
}

func (t *tconn) takeStream(id uint64) *streamBody {
	t.mu.Lock()
	defer t.mu.Unlock()
	sb := t.streams[id]
	delete(t.streams, id)
	return sb
}

func (t *tconn) deliver(id uint64, r tresult) {
	t.mu.Lock()
	ch := t.waiting[id]
	delete(t.waiting, id)
	t.mu.Unlock()
	if ch != nil {
		ch <- r // buffered 1
	}
}

// serve runs a relayed request through the handler in its own goroutine,
// up to maxInflight at once; beyond that it answers 429 at once.
func (t *tconn) serve(q wire.TunnelRequest) {
	if t.o.handler == nil {
		t.c.send(errFrame(q.ID, http.StatusNotImplemented, "this connection does not serve requests"))
		return
	}
	handler, sem := t.o.handler, t.sem
	if q.Path == wire.HopSealPath {
		if t.o.hops == nil || q.Method != http.MethodPost || q.Peer == "" {
			t.c.send(errFrame(q.ID, http.StatusNotImplemented, "this connection does not serve hop frames"))
			return
		}
		// Hellos have slots of their own: replayed ones take no request's.
		handler, sem = t.serveSeal(q.Peer), t.sealSem
	}
	select {
	case sem <- struct{}{}:
	default:
		t.c.send(errFrame(q.ID, http.StatusTooManyRequests, fmt.Sprintf("node busy: %d requests in flight", cap(sem))))
		return
	}
	ctx, cancel := context.WithTimeout(t.ctx, t.o.reqTimeout)
	t.mu.Lock()
	t.serving[q.ID] = served{cancel: cancel}
	t.mu.Unlock()
	wanted := func() bool {
		t.mu.Lock()
		defer t.mu.Unlock()
		_, ok := t.serving[q.ID]
		return ok
	}
	// A handler that flushes (SSE) streams: ResponseStart with what it wrote
	// so far, ResponseData per later flush, ResponseEnd when it returns.
	onFlush := func(r *recorder) {
		if !wanted() || r.broken != "" {
			return
		}
		data := r.body.Bytes()
		r.body = bytes.Buffer{} // the queued message owns the old bytes
		if !r.started {
			a := wire.TunnelResponse{ID: q.ID, Status: uint16(r.status), Header: r.header, Body: data}
			head, err := a.AppendHeadAs(nil, wire.FrameResponseStart)
			if err != nil {
				r.broken = "response not encodable: " + err.Error()
				return
			}
			r.started = true
			if !t.fits(head, data) {
				r.broken = t.tooLarge("streamed response chunk", head, data)
				return
			}
			t.c.send(outMsg{head: head, body: data})
		} else if len(data) > 0 {
			head := wire.DataHead(q.ID, len(data))
			if !t.fits(head, data) {
				r.broken = t.tooLarge("streamed response chunk", head, data)
				return
			}
			t.c.send(outMsg{head: head, body: data})
		}
	}
	t.wg.Add(1)
	go func() {
		defer t.wg.Done()
		defer func() { <-sem }()
		defer cancel()
		rec := serveLocal(ctx, handler, q.Method, q.Path, q.Header, q.Body, "relay:"+q.Peer, t.o.maxFrame, t.o.log, onFlush)
		if !wanted() {
			return // cancelled: the relay no longer waits for it
		}
		t.mu.Lock()
		delete(t.serving, q.ID)
		t.mu.Unlock()
		if rec.started {
			if rec.broken != "" {
				t.c.send(errFrame(q.ID, http.StatusBadGateway, rec.broken))
				return
			}
			if data := rec.body.Bytes(); len(data) > 0 {
				head := wire.DataHead(q.ID, len(data))
				if !t.fits(head, data) {
					t.c.send(errFrame(q.ID, http.StatusBadGateway, t.tooLarge("streamed response chunk", head, data)))
					return
				}
				t.c.send(outMsg{head: head, body: data})
			}
			t.c.send(outMsg{head: wire.Frame(wire.FrameResponseEnd, wire.AppendID(nil, q.ID))})
			return
		}
		a := wire.TunnelResponse{ID: q.ID, Status: uint16(rec.status), Header: rec.header, Body: rec.body.Bytes()}
		head, err := a.AppendHead(nil)
		if err != nil {
			t.c.send(errFrame(q.ID, http.StatusBadGateway, "response not encodable: "+err.Error()))
			return
		}
		if !t.fits(head, a.Body) {
			t.c.send(errFrame(q.ID, http.StatusBadGateway, t.tooLarge("response", head, a.Body)))
			return
		}
		t.c.send(outMsg{head: head, body: a.Body})
	}()
}

// roundTrip sends one request and waits for its answer or ctx.
// A streamed answer comes back with its head in Resp and the body in the
// returned streamBody.
func (t *tconn) roundTrip(ctx context.Context, peer, method, path string, h http.Header, body []byte) (wire.TunnelResponse, *streamBody, error) {
	t.mu.Lock()
	if t.dead != nil {
		t.mu.Unlock()
		return wire.TunnelResponse{}, nil, fmt.Errorf("%w: %v", errRelayLost, t.dead)
	}
	t.nextID++
	id := t.nextID
	ch := make(chan tresult, 1)
	t.waiting[id] = ch
	t.mu.Unlock()
	forget := func() {
		t.mu.Lock()
		delete(t.waiting, id)
		t.mu.Unlock()
	}
	q := wire.TunnelRequest{ID: id, Peer: peer, Method: method, Path: path, Header: h, Body: body}
	head, err := q.AppendHead(nil)
	if err != nil {
		forget()
		return wire.TunnelResponse{}, nil, err
	}
	if !t.fits(head, body) {
		forget()
		return wire.TunnelResponse{}, nil, errors.New("relay: " + t.tooLarge("hop", head, body))
	}
	if !t.c.send(outMsg{head: head, body: body}) {
		forget()
		return wire.TunnelResponse{}, nil, fmt.Errorf("%w: %v", errRelayLost, t.c.cause())
	}
	select {
	case r := <-ch:
		if r.stream != nil {
			r.stream.watch(ctx)
		}
		return r.resp, r.stream, r.err
	case <-ctx.Done():
		t.mu.Lock()
		_, still := t.waiting[id]
		delete(t.waiting, id)
		t.mu.Unlock()
		if !still {
			// Whoever took the waiter is handing over an answer; a streamed
			// one is registered on the tunnel and must be ended here.
			if r := <-ch; r.stream != nil {
				r.stream.abort(ctx.Err())
			}
		}
		t.c.send(outMsg{head: wire.Frame(wire.FrameCancel, wire.AppendID(nil, id))})
		return wire.TunnelResponse{}, nil, ctx.Err()
	}
}

// streamBody is the Body of a streamed answer: frames are queued by the
// read loop (never blocking it) and read by the caller. Unread data beyond
// limit, the caller's Close or its context ending cancel the request.
type streamBody struct {
	t     *tconn
	id    uint64
	limit int

	mu     sync.Mutex
	cond   *sync.Cond
	chunks [][]byte
	size   int
	err    error // io.EOF after ResponseEnd
	closed bool
	stop   func() bool
}

func newStreamBody(t *tconn, id uint64, limit int) *streamBody {
	sb := &streamBody{t: t, id: id, limit: limit}
	sb.cond = sync.NewCond(&sb.mu)
	return sb
}

func (b *streamBody) watch(ctx context.Context) {
	stop := context.AfterFunc(ctx, func() { b.abort(ctx.Err()) })
	b.mu.Lock()
	b.stop = stop
	b.mu.Unlock()
}

func (b *streamBody) push(p []byte) {
	if len(p) == 0 {
		return
	}
	b.mu.Lock()
	if b.err != nil || b.closed {
		b.mu.Unlock()
		return
	}
	if b.size+len(p) > b.limit {
		b.mu.Unlock()
		b.abort(errors.New("relay: streamed answer not read fast enough"))
		return
	}
	b.chunks = append(b.chunks, p)
	b.size += len(p)
	b.cond.Broadcast()
	b.mu.Unlock()
}

// finish ends the stream: nil for a complete answer.
func (b *streamBody) finish(err error) {
	if err == nil {
		err = io.EOF
	}
	b.mu.Lock()
	if b.err == nil {
		b.err = err
	}
	stop := b.stop
	b.cond.Broadcast()
	b.mu.Unlock()
	if stop != nil {
		stop()
	}
}

// abort ends the stream early and tells the other side.
func (b *streamBody) abort(err error) {
	if b.t.takeStream(b.id) != nil {
		b.t.c.send(outMsg{head: wire.Frame(wire.FrameCancel, wire.AppendID(nil, b.id))})
	}
	b.finish(err)
}

func (b *streamBody) Read(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for len(b.chunks) == 0 && b.err == nil && !b.closed {
		b.cond.Wait()
	}
	if b.closed {
		return 0, errors.New("relay: read on a closed body")
	}
	if len(b.chunks) > 0 {
		n := copy(p, b.chunks[0])
		if b.chunks[0] = b.chunks[0][n:]; len(b.chunks[0]) == 0 {
			b.chunks = b.chunks[1:]
		}
		b.size -= n
		return n, nil
	}
	return 0, b.err
}

func (b *streamBody) Close() error {
	b.mu.Lock()
	done := b.err != nil
	b.closed = true
	b.cond.Broadcast()
	b.mu.Unlock()
	if !done {
		b.abort(errors.New("body closed"))
	}
	return nil
}

// recorder is the in-process http.ResponseWriter for relayed requests.
type recorder struct {
	header      http.Header
	status      int
	wroteHeader bool
	body        bytes.Buffer
	limit       int
	overflow    bool
	onFlush     func(*recorder) // nil: Flush does nothing, the answer goes whole
	started     bool            // a streamed answer's head has been sent
	broken      string          // why a started stream must end in an Error
}

func (r *recorder) Header() http.Header { return r.header }

func (r *recorder) WriteHeader(code int) {
	if r.wroteHeader || code < 200 || code > 999 {
		return // informational and repeated headers are not relayed
	}
	r.status, r.wroteHeader = code, true
}

func (r *recorder) Write(p []byte) (int, error) {
	if !r.wroteHeader {
		r.WriteHeader(http.StatusOK)
	}
	if r.body.Len()+len(p) > r.limit {
		r.overflow = true
		if r.started {
			r.broken = "response chunk exceeds the maximum frame size"
		}
		return 0, errors.New("relay: response exceeds the maximum frame size")
	}
	return r.body.Write(p)
}

// Flush sends what the handler wrote so far when the connection streams
// (tunnel); on /ws the answer is sent whole at the end.
func (r *recorder) Flush() {
	if r.onFlush == nil {
		return
	}
	if !r.wroteHeader {
		r.WriteHeader(http.StatusOK)
	}
	r.onFlush(r)
}

// serveLocal calls h in-process, as direct HTTP would, and records the answer.
func serveLocal(ctx context.Context, h http.Handler, method, path string, header http.Header, body []byte, remote string, limit int, log *slog.Logger, onFlush func(*recorder)) (rec *recorder) {
	rec = &recorder{header: http.Header{}, limit: limit, onFlush: onFlush}
	fail := func(code int, typ, msg string) *recorder {
		if rec.started {
			rec.broken = msg
			return rec
		}
		r := &recorder{header: http.Header{"Content-Type": {"application/json"}}, limit: limit, status: code, wroteHeader: true}
		json.NewEncoder(&r.body).Encode(errorBody(typ, msg, ""))
		return r
	}
	if path == "" || path[0] != '/' {
		return fail(http.StatusBadRequest, "bad_request", "relayed request path must start with /")
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://relay"+path, bytes.NewReader(body))
	if err != nil {
		return fail(http.StatusBadRequest, "bad_request", "relayed request: "+err.Error())
	}
	if header == nil {
		header = http.Header{}
	}
	req.Header = header
	req.RequestURI = path
	req.RemoteAddr = remote
	req.ContentLength = int64(len(body))
	defer func() {
		if p := recover(); p != nil {
			if log != nil {
				log.Error("relayed request handler panicked", "path", path, "panic", p)
			}
			rec = fail(http.StatusInternalServerError, "internal_error", "handler failed")
		}
	}()
	h.ServeHTTP(rec, req)
	if rec.overflow {
		return fail(http.StatusBadGateway, "response_too_large", "response exceeds the relay's maximum frame size")
	}
	if !rec.wroteHeader {
		rec.status = http.StatusOK
	}
	return rec
}

package relay

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gorilla/websocket"

	"meshgpu/hopmux"
	"meshgpu/identity"
	"meshgpu/internal/boundmap"
	"meshgpu/wire"
)

// Client sends hops through relays: over one shared tunnel per relay when
// the relay offers it, else over ADR-0014's per-request /rpc WebSocket. The
// zero value is usable (an ephemeral identity signs the tunnel).
type Client struct {
	Identity *identity.Identity
	// JoinToken is presented to the relay JoinTokenRelay (ws://host:port,
	// the one the operator's flags name) and to no other: a relay address
	// that arrives in a route or a registration is dialed without it.
	JoinToken      string
	JoinTokenRelay string
	Logger         *slog.Logger
	// DisableTunnel forces /rpc.
	DisableTunnel bool
	// WebSocketTunnel keeps the tunnel on WebSocket even where the relay
	// offers the raw upgrade.
	WebSocketTunnel bool
	// DialTimeout bounds connecting to a relay (default 10s).
	DialTimeout time.Duration
	// MaxFrameBytes bounds an answer (default 16 MiB).
	MaxFrameBytes int
	// PingInterval is the tunnel keepalive period (default 15s).
	PingInterval time.Duration
	// Bridge, when set and connected by tunnel to the same relay, carries
	// this client's hops too: one connection per node and relay.
	Bridge *Bridge
	// NetDialContext dials TCP; nil uses the default dialer.
	NetDialContext func(ctx context.Context, network, addr string) (net.Conn, error)
	// TLSConfig is used for wss:// relays; nil trusts the system roots.
	TLSConfig *tls.Config
	// BusyWait bounds how long Do waits out back-pressure: the relay's
	// 429 rate_limited (this sender's in-flight limit), its 503 peer_busy
	// (the peer's send queue) and a relayed node's own 429. Do resends
	// with backoff within ctx and BusyWait, so a busy signal is waited
	// out, not reported as a failure. DefaultBusyWait when 0; negative:
	// return the *RelayError at once.
	BusyWait time.Duration
	// ReconnectWait bounds how long Do resends an idempotent request (GET,
	// HEAD, DELETE, and a hop, POST /forward, which its receiver treats as
	// a redo of its position) while the relay is unreachable or restarting
	// (dial refused, connection lost) or the peer has not reconnected to it
	// yet (404 peer_not_connected), within ctx. DefaultReconnectWait when
	// 0; negative: return the error at once.
	ReconnectWait time.Duration

	initOnce sync.Once
	id       *identity.Identity
	idErr    error
	ctx      context.Context
	cancel   context.CancelFunc
	wg       sync.WaitGroup

	// addrs caches splitRelayAddr (two URL parses) by relay_addr: a
	// session sends every hop to the same few.
	addrs    sync.Map // string -> relayTarget
	addrsLen atomic.Int64

	mu       sync.Mutex
	closed   bool
	tunnels  map[string]*tunnelSlot
	noTunnel map[string]time.Time            // relay base -> when it refused the tunnel
	noHops   boundmap.Map[string, time.Time] // peer id -> when the relay said it takes no Hop frames
	// sealed holds the peers that took a sealed hop from this client: a
	// relay claiming later that one takes no hop frames, or has no tunnel,
	// is not believed (the peer would be sent POST /forward, which the
	// relay reads).
	sealed boundmap.Map[string, struct{}]
}

// maxPeerMemory bounds what a Client remembers per peer (sealed, noHops);
// past it one peer is forgotten at a time.
const maxPeerMemory = 1 << 16

// relayTarget is a parsed relay_addr.
type relayTarget struct{ base, peer string }

// maxCachedAddrs bounds Client.addrs; beyond it the cache starts over.
const maxCachedAddrs = 4096

// target is splitRelayAddr(addr), cached.
func (c *Client) target(addr string) (base, peer string, err error) {
	if v, ok := c.addrs.Load(addr); ok {
		t := v.(relayTarget)
		return t.base, t.peer, nil
	}
	if base, peer, err = splitRelayAddr(addr); err != nil {
		return "", "", err // not cached: whoever sends bad addresses pays for them
	}
	if c.addrsLen.Add(1) > maxCachedAddrs {
		c.addrs.Clear()
		c.addrsLen.Store(1)
	}
	c.addrs.Store(addr, relayTarget{base, peer})
	return base, peer, nil
}

type tunnelSlot struct {
	mu sync.Mutex // serialises dialing
	t  *tconn
}

// DefaultBusyWait is Client.BusyWait's default: below a hop's default
// deadline (30 s), so a hop that waited still has time to run.
const DefaultBusyWait = 10 * time.Second

// DefaultReconnectWait is Client.ReconnectWait's default: a restarted
// relay is back, and its nodes' bridges reconnected, within a second or
// two; a hop's deadline (30 s by default) bounds the wait anyway.
const DefaultReconnectWait = 10 * time.Second

// Pauses between resends while a relay or its peer reconnects.
const (
	minReconnectBackoff = 20 * time.Millisecond
	maxReconnectBackoff = 250 * time.Millisecond
)

// busyBackoff is the first and the longest pause between resends of a
// request the relay answered busy: a slot frees when any of the sender's
// hops is answered, which takes milliseconds.
const (
	minBusyBackoff = time.Millisecond
	maxBusyBackoff = 32 * time.Millisecond
)

// noTunnelRetry is how long a relay that refused the tunnel is used via /rpc
// before the tunnel is tried again.
const noTunnelRetry = time.Minute

var errClientClosed = errors.New("relay client closed")

func (c *Client) init() {
	c.initOnce.Do(func() {
		c.id = c.Identity
		if c.id == nil {
			c.id, c.idErr = identity.New()
		}
		c.ctx, c.cancel = context.WithCancel(context.Background())
		c.tunnels = map[string]*tunnelSlot{}
		c.noTunnel = map[string]time.Time{}
		c.noHops = boundmap.Map[string, time.Time]{Max: maxPeerMemory}
		c.sealed = boundmap.Map[string, struct{}]{Max: maxPeerMemory}
	})
}

func (c *Client) maxFrame() int {
	if c.MaxFrameBytes > 0 {
		return c.MaxFrameBytes
	}
	return hopmux.DefaultMaxFrame
}

func (c *Client) log() *slog.Logger {
	if c.Logger != nil {
		return c.Logger
	}
	return slog.Default()
}

// tokenFor is the join token to present to the relay at base: JoinToken
// when base is JoinTokenRelay, else none.
func (c *Client) tokenFor(base string) string {
	if c.JoinToken == "" || c.JoinTokenRelay == "" {
		return ""
	}
	own, err := relayBase(c.JoinTokenRelay)
	if err != nil || own != base {
		return ""
	}
	return c.JoinToken
}

// Do sends req to the peer named by relayAddr (ws(s)://relay/rpc/{peer_id})
// and returns the node's answer. A failure of the relay or the connection
// is an error (a *RelayError when the relay says why); the caller falls back
// to direct HTTP if it can. The body is read whole before sending.
func (c *Client) Do(ctx context.Context, relayAddr string, req *http.Request) (*http.Response, error) {
	c.init()
	base, peer, err := c.target(relayAddr)
	if err != nil {
		return nil, err
	}
	var body []byte
	if req.Body != nil && req.Body != http.NoBody {
		n := req.ContentLength
		if n < 0 || n > int64(c.maxFrame()) {
			n = 0
		}
		buf := bytes.NewBuffer(make([]byte, 0, n))
		_, err := buf.ReadFrom(io.LimitReader(req.Body, int64(c.maxFrame())+1))
		req.Body.Close()
		if err != nil {
			return nil, fmt.Errorf("reading hop body: %w", err)
		}
		if buf.Len() > c.maxFrame() {
			return nil, fmt.Errorf("hop body exceeds the relay frame limit of %d bytes", c.maxFrame())
		}
		body = buf.Bytes()
	}
	method := req.Method
	if method == "" {
		method = http.MethodGet
	}
	path := req.URL.RequestURI()
	resp, err := resend(ctx, c, idempotent(method, path), base, peer, func() (*http.Response, error) {
		return c.do(ctx, base, peer, req, method, path, body)
	})
	return resp, pathError(ctx, base, peer, err)
}

// PathError is a request that failed on the way through a relay: the
// relay is down or unreachable, or the peer is not connected to it (after
// the client's ReconnectWait). The peer itself may be fine, so a caller
// routes around it rather than blaming it.
type PathError struct {
	Relay, Peer string
	Err         error
}

func (e *PathError) Error() string {
	return fmt.Sprintf("relay %s cannot reach %s: %v", e.Relay, e.Peer, e.Err)
}

func (e *PathError) Unwrap() error { return e.Err }

// RelayPath names the relay; callers that do not import this package
// find it with errors.As on interface{ RelayPath() string }.
func (e *PathError) RelayPath() string { return e.Relay }

// pathError wraps err in a *PathError when it is the relay path's fault:
// it is down, or it altered a sealed hop (errSealPath).
func pathError(ctx context.Context, base, peer string, err error) error {
	if err == nil || ctx.Err() != nil || !reconnecting(err) && !errors.Is(err, errSealPath) {
		return err
	}
	var op *net.OpError
	if errors.As(err, &op) && op.Timeout() {
		return err // slow, not down
	}
	return &PathError{Relay: base, Peer: peer, Err: err}
}

// resend runs try until it succeeds or fails for good. Back-pressure (the
// relay's 429 rate_limited and 503 peer_busy, a relayed node's 429) is
// waited out with jittered backoff for up to Client.BusyWait; when redo
// (the request is idempotent), so is a relay restart or a peer not
// reconnected yet, for up to Client.ReconnectWait. ctx bounds both.
func resend[T any](ctx context.Context, c *Client, redo bool, base, peer string, try func() (T, error)) (T, error) {
	wait := c.BusyWait
	if wait == 0 {
		wait = DefaultBusyWait
	}
	rwait := c.ReconnectWait
	if rwait == 0 {
		rwait = DefaultReconnectWait
	}
	start, backoff := time.Now(), minBusyBackoff
	for {
		v, err := try()
		if err == nil || ctx.Err() != nil {
			return v, err
		}
		var re *RelayError
		isBusy := errors.As(err, &re) && busy(re)
		switch {
		case isBusy:
			if wait < 0 || time.Since(start)+backoff > wait {
				return v, err
			}
		case redo && reconnecting(err):
			if rwait < 0 || time.Since(start)+backoff > rwait {
				return v, err
			}
			backoff = max(backoff, minReconnectBackoff)
			c.log().Debug("relay or peer unreachable; resending once it reconnects", "relay", base, "peer", peer, "error", err)
		default:
			return v, err
		}
		// full jitter keeps the waiting senders from resending in step
		t := time.NewTimer(backoff/2 + mrand.N(backoff/2+1))
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return v, err
		}
		if isBusy {
			backoff = min(2*backoff, maxBusyBackoff)
		} else {
			backoff = min(2*backoff, maxReconnectBackoff)
		}
	}
}

// idempotent: sending it twice does what sending it once does. A hop
// carries its position, and a receiver that already ran it redoes it.
func idempotent(method, path string) bool {
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodDelete:
		return true
	}
	p, _, _ := strings.Cut(path, "?")
	return method == http.MethodPost && p == "/forward"
}

// reconnecting reports an error that a relay restart or a peer's
// reconnection ends: the relay refused the connection or dropped it, or
// does not have the peer connected yet.
func reconnecting(err error) bool {
	var re *RelayError
	if errors.As(err, &re) {
		return re.Type == "peer_not_connected" || re.Type == "peer_disconnected"
	}
	var op *net.OpError
	return errors.Is(err, errRelayLost) || errors.As(err, &op) || errors.Is(err, io.ErrUnexpectedEOF) || websocket.IsUnexpectedCloseError(err)
}

// busy reports a relay error that is back-pressure, not a failure.
func busy(re *RelayError) bool {
	return wire.Backpressure(re.Code, re.Type)
}

// do is one try of Do.
func (c *Client) do(ctx context.Context, base, peer string, req *http.Request, method, path string, body []byte) (*http.Response, error) {
	if !c.DisableTunnel && !c.tunnelRefused(base) {
		t, err := c.tunnel(ctx, base)
		if err == nil {
			a, stream, err := t.roundTrip(ctx, peer, method, path, req.Header, body)
			if err != nil {
				return nil, err
			}
			resp := buildResponse(req, int(a.Status), a.Header, a.Body)
			if stream != nil {
				resp.Body, resp.ContentLength = stream, -1
			}
			return resp, nil
		}
		if !errors.Is(err, errTunnelUnsupported) {
			return nil, err
		}
		c.log().Info("relay has no tunnel; using /rpc", "relay", base, "reason", err)
		c.mu.Lock()
		c.noTunnel[base] = time.Now()
		c.mu.Unlock()
	}
	return c.doRPC(ctx, base, peer, req, method, path, body)
}

// DoHop sends one hop as a Hop frame through the relay's tunnel to the
// peer named by relayAddr, the payload written from its buffer in place;
// an activations reply is read into the buffer into lends. It returns
// wire.ErrHopFramesUnsupported when the relay has no tunnel, or it or the
// peer does not take Hop frames: the caller then sends POST /forward (Do).
func (c *Client) DoHop(ctx context.Context, relayAddr string, h *wire.HopHead, payload []byte, into hopmux.ReplyBuffer) (*wire.HopReply, error) {
	c.init()
	base, peer, err := c.target(relayAddr)
	if err != nil {
		return nil, err
	}
	var rep *wire.HopReply
	if c.DisableTunnel || c.tunnelRefused(base) {
		err = wire.ErrHopFramesUnsupported
	} else {
		// A hop is idempotent: its receiver redoes a position it already ran.
		rep, err = resend(ctx, c, true, base, peer, func() (*wire.HopReply, error) {
			return c.doHop(ctx, base, peer, h, payload, into)
		})
	}
	c.mu.Lock()
	_, sealed := c.sealed.Get(peer)
	switch {
	case err == nil && !sealed:
		c.sealed.Put(peer, struct{}{})
	case sealed && errors.Is(err, wire.ErrHopFramesUnsupported):
		// Whatever said so (the relay's /tunnel, its features, the
		// peer's answer it carries), only the relay gains by it.
		err = fmt.Errorf("%w: %s took sealed hops before; refusing to send it plain ones now (%v)", errSealPath, wire.Truncate(peer, 80), err)
	}
	c.mu.Unlock()
	return rep, pathError(ctx, base, peer, err)
}

// doHop is one try of DoHop.
func (c *Client) doHop(ctx context.Context, base, peer string, h *wire.HopHead, payload []byte, into hopmux.ReplyBuffer) (*wire.HopReply, error) {
	c.mu.Lock()
	at, no := c.noHops.Get(peer)
	c.mu.Unlock()
	if no && time.Since(at) < noTunnelRetry {
		return nil, wire.ErrHopFramesUnsupported
	}
	t, err := c.tunnel(ctx, base)
	if errors.Is(err, errTunnelUnsupported) {
		c.mu.Lock()
		c.noTunnel[base] = time.Now()
		c.mu.Unlock()
		return nil, wire.ErrHopFramesUnsupported
	}
	if err != nil {
		return nil, err
	}
	if !t.relayHops {
		return nil, wire.ErrHopFramesUnsupported
	}
	rep, err := t.hopRoundTrip(ctx, peer, h, payload, into)
	if errors.Is(err, wire.ErrHopFramesUnsupported) {
		c.mu.Lock()
		c.noHops.Put(peer, time.Now())
		c.mu.Unlock()
	}
	return rep, err
}

func (c *Client) tunnelRefused(base string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	at, ok := c.noTunnel[base]
	return ok && time.Since(at) < noTunnelRetry
}

// tunnel returns the live tunnel to base, dialing it if needed.
func (c *Client) tunnel(ctx context.Context, base string) (*tconn, error) {
	if b := c.Bridge; b != nil {
		if t := b.cur.Load(); t != nil && t.base == base && t.alive() {
			return t, nil
		}
	}
	if c.idErr != nil {
		return nil, c.idErr
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, errClientClosed
	}
	slot := c.tunnels[base]
	if slot == nil {
		slot = &tunnelSlot{}
		c.tunnels[base] = slot
	}
	c.mu.Unlock()
	slot.mu.Lock()
	defer slot.mu.Unlock()
	if slot.t != nil && slot.t.alive() {
		return slot.t, nil
	}
	dt := c.DialTimeout
	if dt <= 0 {
		dt = handshakeTimeout
	}
	dctx, cancel := context.WithTimeout(ctx, dt)
	defer cancel()
	ping := c.PingInterval
	if ping <= 0 {
		ping = DefaultPingInterval
	}
	t, err := dialTunnel(dctx, dialOpts{base: base, id: c.id, joinToken: c.tokenFor(base), maxFrame: c.maxFrame(), wsTunnel: c.WebSocketTunnel,
		pingInterval: ping, netDial: c.NetDialContext, tlsConfig: c.TLSConfig, reqTimeout: DefaultRequestTimeout, log: c.log()})
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		t.c.close(errClientClosed)
		return nil, errClientClosed
	}
	c.wg.Add(1)
	c.mu.Unlock()
	go func() {
		defer c.wg.Done()
		if err := t.run(c.ctx); err != nil && c.ctx.Err() == nil {
			c.log().Info("relay tunnel closed", "relay", base, "err", err)
		}
	}()
	slot.t = t
	return t, nil
}

// doRPC is ADR-0014's hop: one WebSocket, one JSON message each way.
func (c *Client) doRPC(ctx context.Context, base, peer string, req *http.Request, method, path string, body []byte) (*http.Response, error) {
	h := http.Header{}
	if tok := c.tokenFor(base); tok != "" {
		h.Set(JoinTokenHeader, tok)
	}
	// One message each way: a small read buffer, a pooled write buffer.
	d := websocket.Dialer{NetDialContext: c.NetDialContext, TLSClientConfig: c.TLSConfig, HandshakeTimeout: handshakeTimeout,
		WriteBufferSize: 32 << 10, WriteBufferPool: rpcWriteBuffers}
	ws, resp, err := d.DialContext(ctx, base+"/rpc/"+peer, h)
	if err != nil {
		if resp != nil {
			return nil, httpRelayError(resp)
		}
		return nil, fmt.Errorf("relay %s: %w", base, err)
	}
	defer ws.Close()
	stop := context.AfterFunc(ctx, func() { ws.Close() }) // cancellation unblocks reads
	defer stop()
	dl := time.Now().Add(DefaultRequestTimeout + 5*time.Second)
	if d, ok := ctx.Deadline(); ok {
		dl = d
	}
	ws.SetReadDeadline(dl)
	ws.SetWriteDeadline(dl)
	ws.SetReadLimit(int64(c.maxFrame())/3*4 + 64<<10)
	var rid [8]byte
	rand.Read(rid[:])
	reqID := hex.EncodeToString(rid[:])
	w, err := ws.NextWriter(websocket.TextMessage)
	if err != nil {
		return nil, c.ctxErr(ctx, base, err)
	}
	if err := writeEnvelope(w, &envelope{RequestID: reqID, Method: method, Path: path, Header: req.Header, Body: body}); err != nil {
		return nil, c.ctxErr(ctx, base, err)
	}
	if err := w.Close(); err != nil {
		return nil, c.ctxErr(ctx, base, err)
	}
	_, r, err := ws.NextReader()
	if err != nil {
		return nil, c.ctxErr(ctx, base, err)
	}
	msg, err := io.ReadAll(r)
	if err != nil {
		return nil, c.ctxErr(ctx, base, err)
	}
	e, err := parseEnvelope(msg)
	if err != nil {
		return nil, fmt.Errorf("relay %s: bad /rpc answer: %w", base, err)
	}
	if e.RequestID != reqID {
		return nil, fmt.Errorf("relay %s: /rpc answer for request %q, sent %q", base, e.RequestID, reqID)
	}
	if e.Status == 0 {
		return nil, fmt.Errorf("relay %s: /rpc answer without a status", base)
	}
	if typ := e.Header.Get(RelayErrorHeader); typ != "" {
		msg := ""
		if we, ok := wire.DecodeError(e.Status, e.Body); ok {
			msg = we.Message
		}
		return nil, &RelayError{Code: e.Status, Type: typ, Message: msg}
	}
	ws.WriteControl(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""), time.Now().Add(time.Second))
	if e.Header == nil {
		e.Header = http.Header{}
	}
	return buildResponse(req, e.Status, e.Header, e.Body), nil
}

func (c *Client) ctxErr(ctx context.Context, base string, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return fmt.Errorf("relay %s: %w", base, err)
}

// httpRelayError turns a refused upgrade (JSON error body) into a RelayError.
func httpRelayError(resp *http.Response) error {
	msg, typ := resp.Status, ""
	if resp.Body != nil {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		resp.Body.Close()
		if we, ok := wire.DecodeError(resp.StatusCode, b); ok {
			msg, typ = we.Message, we.Type
		}
	}
	return &RelayError{Code: resp.StatusCode, Type: typ, Message: msg}
}

func buildResponse(req *http.Request, status int, h http.Header, body []byte) *http.Response {
	if h == nil {
		h = http.Header{}
	}
	return &http.Response{
		Status:        fmt.Sprintf("%d %s", status, http.StatusText(status)),
		StatusCode:    status,
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        h,
		Body:          io.NopCloser(bytes.NewReader(body)),
		ContentLength: int64(len(body)),
		Request:       req,
	}
}

// Close drops the client's tunnels and waits for their goroutines.
func (c *Client) Close() error {
	c.init()
	c.mu.Lock()
	c.closed = true
	c.mu.Unlock()
	c.cancel()
	c.wg.Wait()
	return nil
}

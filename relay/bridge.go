package relay

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gorilla/websocket"

	"meshgpu/hopmux"
	"meshgpu/identity"
)

// Bridge connects a node outbound to a relay and serves relayed requests
// with Handler, in-process, exactly as direct HTTP would (the seed's
// RelayHttpBridge). It prefers /tunnel and falls back to /ws when the relay
// does not offer it.
type Bridge struct {
	// RelayURL is the relay base, ws://host:port (http:// also accepted).
	RelayURL  string
	Identity  *identity.Identity
	JoinToken string
	Handler   http.Handler
	// HopServer, when set, serves Hop frames (protocol version 2) straight
	// from the tunnel: no HTTP request is built for them (node.Server and
	// daemon.Node implement it). Requests still go to Handler.
	HopServer hopmux.Handler
	Logger    *slog.Logger

	// MaxInflight caps requests served at once; more get 429 (default 64).
	MaxInflight int
	// RequestTimeout bounds one relayed request (default 60s).
	RequestTimeout time.Duration
	// DialTimeout bounds connecting and registering (default 10s).
	DialTimeout time.Duration
	// PingInterval is the keepalive period; the relay is presumed dead
	// after 3 silent intervals (default 15s).
	PingInterval time.Duration
	// MaxFrameBytes bounds one message (default 16 MiB).
	MaxFrameBytes int
	// MinBackoff and MaxBackoff bound the reconnect delay (100ms, 15s);
	// each delay is drawn at random from its upper half (jitter).
	MinBackoff, MaxBackoff time.Duration
	// DisableTunnel makes the bridge use /ws only.
	DisableTunnel bool
	// WebSocketTunnel keeps the tunnel on WebSocket even where the relay
	// offers the raw upgrade (RawTunnelUpgrade), e.g. behind a proxy that
	// passes only WebSockets.
	WebSocketTunnel bool
	// NetDialContext dials TCP; nil uses the default dialer.
	NetDialContext func(ctx context.Context, network, addr string) (net.Conn, error)
	// TLSConfig is used for wss:// relays; nil trusts the system roots.
	TLSConfig *tls.Config
	// OnState, when set, is called when the bridge connects (true) or
	// loses the relay (false), from the bridge's goroutine; it must not
	// block. A node tells its tracker at once (its heartbeat's relay_down).
	OnState func(connected bool)

	connected atomic.Bool
	mode      atomic.Value // "tunnel" or "ws"
	cur       atomic.Pointer[tconn]
}

func (b *Bridge) setConnected(v bool) {
	if b.connected.Swap(v) != v && b.OnState != nil {
		b.OnState(v)
	}
}

// Connected reports whether the bridge is registered with the relay now.
func (b *Bridge) Connected() bool { return b.connected.Load() }

// Mode is "tunnel" or "ws" while connected, "" otherwise.
func (b *Bridge) Mode() string {
	if !b.Connected() {
		return ""
	}
	m, _ := b.mode.Load().(string)
	return m
}

func (b *Bridge) logger() *slog.Logger {
	l := b.Logger
	if l == nil {
		l = slog.Default()
	}
	return l.With("component", "relay-bridge")
}

func (b *Bridge) opts(base string, log *slog.Logger) dialOpts {
	o := dialOpts{base: base, id: b.Identity, joinToken: b.JoinToken, handler: b.Handler, hops: b.HopServer, wsTunnel: b.WebSocketTunnel,
		maxInflight: b.MaxInflight, reqTimeout: b.RequestTimeout, maxFrame: b.MaxFrameBytes,
		pingInterval: b.PingInterval, netDial: b.NetDialContext, tlsConfig: b.TLSConfig, log: log}
	if o.maxInflight <= 0 {
		o.maxInflight = 64
	}
	if o.reqTimeout <= 0 {
		o.reqTimeout = DefaultRequestTimeout
	}
	if o.maxFrame <= 0 {
		o.maxFrame = hopmux.DefaultMaxFrame
	}
	if o.pingInterval <= 0 {
		o.pingInterval = DefaultPingInterval
	}
	return o
}

// Run connects and serves until ctx is done, reconnecting with exponential
// backoff and jitter. It returns nil when ctx ends, or an error at once for
// a configuration the relay will never accept (bad URL, refused identity or
// join token).
func (b *Bridge) Run(ctx context.Context) error {
	if b.Identity == nil || b.Handler == nil {
		return errors.New("relay bridge needs an Identity and a Handler")
	}
	base, err := relayBase(b.RelayURL)
	if err != nil {
		return err
	}
	log := b.logger().With("relay", base, "peer_id", b.Identity.PeerID)
	o := b.opts(base, log)
	minB, maxB := b.MinBackoff, b.MaxBackoff
	if minB <= 0 {
		minB = 100 * time.Millisecond
	}
	if maxB < minB {
		maxB = max(15*time.Second, minB)
	}
	backoff := minB
	for {
		start := time.Now()
		err := b.session(ctx, o, log)
		b.setConnected(false)
		if ctx.Err() != nil {
			return nil
		}
		var re *RelayError
		if errors.As(err, &re) && (re.Code == http.StatusUnauthorized || re.Code == http.StatusForbidden || re.Code == http.StatusBadRequest) {
			return fmt.Errorf("relay %s refused this node: %s", base, re.Message)
		}
		if time.Since(start) > 30*time.Second {
			backoff = minB // it was up a while: a fresh failure
		}
		delay := backoff/2 + rand.N(backoff/2+1)
		log.Warn("relay connection ended; reconnecting", "err", err, "in", delay.Round(time.Millisecond))
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(delay):
		}
		backoff = min(2*backoff, maxB)
	}
}

// session runs one connection: tunnel first, /ws when the relay has none.
func (b *Bridge) session(ctx context.Context, o dialOpts, log *slog.Logger) error {
	if !b.DisableTunnel {
		dctx, cancel := context.WithTimeout(ctx, b.dialTimeout())
		t, err := dialTunnel(dctx, o)
		cancel()
		if err == nil {
			b.mode.Store("tunnel")
			b.cur.Store(t)
			b.setConnected(true)
			log.Info("connected to relay", "mode", "tunnel")
			err = t.run(ctx)
			b.setConnected(false)
			b.cur.CompareAndSwap(t, nil)
			return err
		}
		if !errors.Is(err, errTunnelUnsupported) {
			return err
		}
		log.Info("relay has no tunnel; using /ws", "reason", err)
	}
	return b.wsSession(ctx, o, log)
}

func (b *Bridge) dialTimeout() time.Duration {
	if b.DialTimeout > 0 {
		return b.DialTimeout
	}
	return handshakeTimeout
}

// wsSession is the ADR-0010 JSON connection: challenge, register, then
// relay-http-request envelopes in and relay-http-response envelopes out.
func (b *Bridge) wsSession(ctx context.Context, o dialOpts, log *slog.Logger) error {
	dctx, cancel := context.WithTimeout(ctx, b.dialTimeout())
	defer cancel()
	ws, _, err := o.dialer().DialContext(dctx, o.base+"/ws", nil)
	if err != nil {
		return fmt.Errorf("relay %s: %w", o.base, err)
	}
	maxMsg := int64(o.maxFrame)/3*4 + 64<<10
	ws.SetReadLimit(maxMsg)
	dl, _ := dctx.Deadline()
	ws.SetReadDeadline(dl)
	ws.SetWriteDeadline(dl)
	var ch wsHello
	if err := ws.ReadJSON(&ch); err != nil || ch.Type != "challenge" {
		ws.Close()
		return fmt.Errorf("relay %s: expected a challenge on /ws: %v", o.base, err)
	}
	reg := wsHello{Type: "register", PeerID: o.id.PeerID, PublicKey: o.id.PublicHex(),
		Signature: hex.EncodeToString(o.id.Sign(ChallengeMessage(ch.Nonce, o.id.PeerID))), JoinToken: o.joinToken}
	if err := ws.WriteJSON(reg); err != nil {
		ws.Close()
		return fmt.Errorf("relay %s: %w", o.base, err)
	}
	var ans wsHello
	if err := ws.ReadJSON(&ans); err != nil {
		ws.Close()
		return fmt.Errorf("relay %s: registration: %w", o.base, err)
	}
	if ans.Type != "registered" {
		ws.Close()
		return &RelayError{Code: http.StatusUnauthorized, Type: "unauthorized", Message: ans.Message}
	}
	ws.SetWriteDeadline(time.Time{})
	c := newWSConn(ws, DefaultSendQueue, DefaultWriteTimeout, websocket.TextMessage)
	b.mode.Store("ws")
	b.setConnected(true)
	log.Info("connected to relay", "mode", "ws")

	sctx, scancel := context.WithCancel(ctx)
	defer scancel()
	stop := context.AfterFunc(ctx, func() { c.close(context.Canceled) })
	defer stop()
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); c.writeLoop() }()
	go func() { defer wg.Done(); keepalive(c, o.pingInterval) }()
	sem := make(chan struct{}, o.maxInflight)
	idle := 3 * o.pingInterval
	ws.SetPongHandler(func(string) error { ws.SetReadDeadline(time.Now().Add(idle)); return nil })
	var buf bytes.Buffer
	var rerr error
	for {
		ws.SetReadDeadline(time.Now().Add(idle))
		_, r, err := ws.NextReader()
		if err != nil {
			rerr = err
			break
		}
		buf.Reset()
		if _, err := buf.ReadFrom(r); err != nil {
			rerr = err
			break
		}
		e, err := parseEnvelope(buf.Bytes())
		if err != nil {
			rerr = fmt.Errorf("malformed message from relay: %w", err)
			break
		}
		if e.Type != typeHTTPRequest {
			continue
		}
		select {
		case sem <- struct{}{}:
		default:
			body, _ := json.Marshal(errorBody("rate_limited", "node busy: "+strconv.Itoa(o.maxInflight)+" requests in flight", o.id.PeerID))
			c.send(outMsg{env: &envelope{Type: typeHTTPResponse, RequestID: e.RequestID, Status: http.StatusTooManyRequests,
				Header: http.Header{"Content-Type": {"application/json"}}, Body: body, Text: true}})
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			rctx, cancel := context.WithTimeout(sctx, o.reqTimeout)
			defer cancel()
			rec := serveLocal(rctx, o.handler, e.Method, e.Path, e.Header, e.Body, "relay", o.maxFrame, log, nil)
			body := rec.body.Bytes()
			out := &envelope{Type: typeHTTPResponse, RequestID: e.RequestID, Status: rec.status,
				Header: rec.header, Body: body, Text: textBody(rec.header, body)}
			// The relay closes the connection on a message over its limit,
			// failing every request on it: this one fails alone instead.
			if ok, n := envelopeFits(out, ans.MaxBytes); !ok {
				msg := fmt.Sprintf("response of %d bytes as a relay message exceeds the relay's limit of %d bytes", n, ans.MaxBytes)
				eb, _ := json.Marshal(errorBody("response_too_large", msg, o.id.PeerID))
				out = &envelope{Type: typeHTTPResponse, RequestID: e.RequestID, Status: http.StatusBadGateway,
					Header: http.Header{"Content-Type": {"application/json"}}, Body: eb, Text: true}
			}
			c.send(outMsg{env: out})
		}()
	}
	if cause := c.cause(); cause != nil {
		rerr = cause
	}
	c.close(rerr)
	scancel()
	b.setConnected(false)
	wg.Wait()
	return rerr
}

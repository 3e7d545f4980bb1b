package relay

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/gorilla/websocket"

	"meshgpu/hopmux"
	"meshgpu/identity"
	"meshgpu/internal/boundmap"
	"meshgpu/wire"
)

// dialOpts configures one tunnel connection from a node.
type dialOpts struct {
	base         string
	id           *identity.Identity
	joinToken    string
	handler      http.Handler   // nil: this connection only sends requests
	hops         hopmux.Handler // serves Hop frames; nil: Request frames only
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
	if typ != hopmux.FrameServerChallenge {
		return fail(fmt.Errorf("%w: first frame was %v", errTunnelUnsupported, typ))
	}
	ch, err := hopmux.ParseTunnelChallenge(p)
	if err != nil || ch.Version != hopmux.TunnelVersion {
		return fail(fmt.Errorf("%w: relay speaks version %d", errTunnelUnsupported, ch.Version))
	}
	h := hopmux.TunnelHello{Version: hopmux.TunnelVersion, PeerID: o.id.PeerID, PublicKey: o.id.Public,
		Signature: o.id.Sign(ChallengeMessage(hex.EncodeToString(ch.Nonce[:]), o.id.PeerID)), JoinToken: o.joinToken}
	if o.handler != nil {
		h.Flags |= hopmux.FlagAcceptsRequests
		if o.hops != nil {
			h.Flags |= hopmux.FlagHopFrames
		}
	}
	hp, err := h.Append(nil)
	if err != nil {
		return fail(err)
	}
	if err := c.writeNow(hopmux.Frame(hopmux.FrameClientHello, hp), dl); err != nil {
		return fail(fmt.Errorf("relay %s: tunnel handshake: %w", o.base, err))
	}
	typ, p, err = c.readNow(o.maxFrame, dl)
	if err != nil {
		return fail(fmt.Errorf("relay %s: tunnel handshake: %w", o.base, err))
	}
	switch typ {
	case hopmux.FrameServerInfo:
	case hopmux.FrameError:
		e, _ := hopmux.ParseTunnelError(p)
		if e.Code == http.StatusUpgradeRequired {
			return fail(fmt.Errorf("%w: %s", errTunnelUnsupported, e.Message))
		}
		return fail(&RelayError{Code: int(e.Code), Type: relayErrorType(int(e.Code)), Message: e.Message})
	default:
		return fail(fmt.Errorf("relay %s: unexpected %v during handshake", o.base, typ))
	}
	info, err := hopmux.ParseTunnelInfo(p)
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
		serving: map[uint64]context.CancelFunc{},
		senders: boundmap.Map[string, *wire.HopSender]{Max: maxHopSenders},
		sealOut: boundmap.Map[string, *sealSlot]{Max: maxSealPeers},
		sealIn:  boundmap.Map[string, *peerSeal]{Max: maxSealPeers, Evictable: sealInEvictable},
		sealSem: make(chan struct{}, maxSealExchanges),

		relayHops: info.Features&hopmux.FeatureHopFrames != 0,
	}
	if m := int64(info.MaxFrame); m > 0 && m < int64(t.sendMax) {
		t.sendMax = int(m)
	}
	if p := time.Duration(info.PingIntervalMs) * time.Millisecond; p > 0 && p < t.ping {
		t.ping = max(p, minPingInterval)
	}
	t.ctx, t.cancel = context.WithCancel(context.Background())
	t.mux = hopmux.Conn{Write: t.writeFrame, Sender: t.sender, Slots: t.sem, Lost: errRelayLost,
		Reply: t.sendHopReply, WriteSealed: t.writeSealedHop, OpenHop: t.openHop, OpenReply: t.openHopReply, CheckPlain: checkPlainReply,
		OnCancel: t.cancelRequest, OnClose: func(err error) { t.shutdown(err) }}
	if o.hops != nil && o.handler != nil {
		// A hop's context has no timer of its own: the mux's reaper holds
		// the request timeout.
		t.mux.Handler, t.mux.Timeout = o.hops, o.reqTimeout
	}
	t.mux.Start()
	return t, nil
}

// Package daemon starts a complete meshgpu node with one function call: the
// model shard, its hop/OpenAI server, an optional relay bridge (so a node
// behind NAT, or with no listener at all, is reachable through a relay), and
// an optional tracker announcer (registration, heartbeats with rolling
// stats, auto-sharding and moves). `meshgpu run`, `meshgpu demo`, the bench
// mesh suite and the end-to-end tests all start nodes through it.
package daemon

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"meshgpu/engine"
	"meshgpu/identity"
	"meshgpu/internal/apiauth"
	"meshgpu/model"
	"meshgpu/native"
	"meshgpu/node"
	"meshgpu/relay"
	"meshgpu/ticket"
	"meshgpu/tracker"
	"meshgpu/tracker/rpm"
	"meshgpu/wire"
)

// Relay modes (--relay-mode).
const (
	RelayAuto   = "auto"   // tunnel when the relay offers it, else /ws and /rpc
	RelayTunnel = "tunnel" // the same transport as auto; a fallback is logged as a warning
	RelayRPC    = "rpc"    // no tunnel: the bridge uses /ws and the hop client ADR-0014's /rpc
)

// DefaultHeaderTimeout bounds a request's headers, and the TLS handshake
// before them, on a node's port (Config.HeaderTimeout): a silent or
// trickling client is cut off after it.
const DefaultHeaderTimeout = 10 * time.Second

// DefaultMoveGrace is how long the old range keeps serving after a move.
const DefaultMoveGrace = 2 * time.Minute

// DefaultDrainGrace is how long a stopping node (SIGTERM) waits for its
// sessions to finish after leaving the tracker (`meshgpu run --drain-timeout`):
// under Kubernetes' default 30 s termination grace.
const DefaultDrainGrace = 20 * time.Second

// relayReconnectWait bounds how long a hop through a relay waits for the
// relay or its peer to come back (relay.Client.ReconnectWait): a relay
// restart is ridden out, a longer outage fails the hop with
// relay_unreachable quickly enough for the tracker to answer the client
// within seconds.
const relayReconnectWait = 3 * time.Second

// relayMaxBackoff caps the bridge's reconnect delay, so a node is back
// within seconds of its relay.
const relayMaxBackoff = 5 * time.Second

// Config describes a node. ModelDir, Backend and Identity are required;
// every other field has a working default.
type Config struct {
	ModelDir string
	// Backend holds the stacks; the caller owns it and closes it after Close.
	Backend native.Backend
	// LoadProgress, when set, is told the bytes of tensors loaded so far of
	// each range the node loads (engine.Options.Progress).
	LoadProgress func(done, total int64)
	Identity     *identity.Identity
	// ModelName is the model's id in /health, /v1/models and the tracker
	// (default: the base name of ModelDir).
	ModelName string
	// ChatTemplateFile, when set, is a Jinja chat template that replaces the
	// model's own on the head (--chat-template-file), e.g. one that renders
	// tools.
	ChatTemplateFile string

	// First..Last are the layers to hold (Last < 0: the model's last layer).
	// Ignored with Auto.
	First, Last int
	// Auto asks the tracker which layers to load (ADR-0011); it needs
	// TrackerURL.
	Auto bool
	// MemoryBudget bounds weights plus KV reserve for Auto (0: the backend's
	// free memory less a 10% margin).
	MemoryBudget int64

	// Listen is the TCP address of the HTTP server (default 127.0.0.1:0).
	Listen string
	// Listener, when set, is the socket to serve on, already bound (the
	// CLI binds --listen before it loads anything, so a port in use fails
	// at once); the node closes it. Listen is then ignored.
	Listener net.Listener
	// NoListen opens no inbound socket; the node is reachable only through
	// the relay (RelayURL is required).
	NoListen bool
	// Advertise is the endpoint the tracker hands out (default: http:// +
	// the listener's address).
	Advertise string

	// RelayURL is a relay's base URL, ws(s)://host:port.
	RelayURL       string
	RelayJoinToken string
	RelayMode      string // auto (default), tunnel or rpc
	// NoDirectPaths keeps every hop to a relay-only peer on the relay; by
	// default a node with a relay punches direct paths to them
	// (node.DirectPaths: punched TCP where it works, else QUIC on a UDP
	// socket at PathListen, default ":0").
	NoDirectPaths bool
	PathListen    string
	// DirectReplies makes the route tickets of the sessions this node
	// heads name its hop endpoint and relay address, so the tail answers
	// it directly as well as along the chain (docs/protocol.md, Direct
	// replies). As a static head (--peer, --route) it signs them so
	// (node.Server.ReplyEndpoint), and every node on the route must read
	// ticket version 3; with a tracker it asks at registration, and the
	// tracker names them only on routes whose nodes all read version 3.
	DirectReplies bool
	// ticketVersion, when not 0, is the route-ticket version the node
	// registers as the newest it reads instead of ticket.Version: tests
	// play an older node with it.
	ticketVersion int

	// TrackerURL is the tracker's base URL, http(s)://host:port.
	TrackerURL string
	// TrackerFallbacks are more trackers of the same mesh: the node moves
	// to the next when its tracker stops answering (tracker.Client).
	TrackerFallbacks []string
	TrackerJoinToken string
	// HeartbeatInterval defaults to tracker.DefaultHeartbeatInterval.
	HeartbeatInterval time.Duration
	// MoveGrace bounds how long the old range keeps serving its sessions
	// after a move (DefaultMoveGrace when 0).
	MoveGrace time.Duration

	// node.Server settings (see node.Server).
	Route []wire.Hop
	Peers []string
	// TrustHeads are peer ids of static-mesh heads whose route tickets this
	// node takes (--trust-head); its trackers' keys are trusted too.
	TrustHeads []string
	// NoHopTLS serves and sends hops without TLS (--hop-tls=false).
	NoHopTLS bool
	// APICertificate, when set, is served to TLS clients of the node's
	// port that are not hop connections (`--tls-cert`/`--tls-key`: the
	// OpenAI API over https); hop connections keep the identity
	// certificate pinned to the peer id (node.SplitTLS). Plain HTTP stays
	// served on the same port.
	APICertificate   *tls.Certificate
	HopDType         string
	MaxSessions      int
	MaxQueue         int
	QueueWait        time.Duration
	MaxBatch         int
	PrefillChunk     int
	SessionTTL       time.Duration
	HopTimeout       time.Duration
	MaxContext       int
	MaxInflightBytes int64
	APIAuth          apiauth.Config // the head's OpenAI endpoints
	// Speculative decoding on a head (node.Server.Speculate); the caller
	// owns DraftModel and closes it after Close.
	Speculate    wire.SpeculateMode
	DraftModel   *engine.Model
	SpeculateMax int
	// SpeculateInFlight bounds the verify passes one stream keeps in
	// flight (node.Server.SpeculateInFlight).
	SpeculateInFlight int

	// HeaderTimeout bounds, on the node's port, a request's headers and
	// (through the TLS/plain sniffer) the TLS handshake before them:
	// DefaultHeaderTimeout when 0.
	HeaderTimeout time.Duration

	Logger *slog.Logger
}

// Node is a running node. Close stops it.
type Node struct {
	cfg     Config
	log     *slog.Logger
	mcfg    *model.Config
	name    string
	id      *identity.Identity
	budget  int64
	fp      tracker.Footprint
	variant wire.Variant // the weights held, computed at start-up
	ms      float64      // compute ms per layer, measured at start-up

	ln       net.Listener
	hs       *http.Server
	endpoint string // the API's URL (plain HTTP unless --advertise says https)
	// hopEndpoint is the endpoint registered with the tracker: endpoint
	// as https:// when the node serves hop TLS.
	hopEndpoint string
	relayAddr   string
	bridge      *relay.Bridge
	relayc      *relay.Client
	direct      *node.DirectPaths // nil: hops to relay-only peers stay on the relay
	trackc      *tracker.Client
	announcer   *tracker.Announcer
	wake        chan struct{} // a heartbeat now: the relay connection changed
	stopAnn     context.CancelFunc
	annDone     <-chan struct{} // closed when the announcer has returned
	draining    atomic.Bool
	stats       *rpm.Stats

	mu       sync.Mutex
	cur      *shard
	retiring []*shard
	base     node.Stats // counters of retired shards, so heartbeat totals never go back

	hops   node.HopConns // GET /hop connections; every Hop goes to its shard
	shards node.Shards   // the servers of cur and retiring (publish), for hops and requests

	serveErr chan error
	cancel   context.CancelFunc
	wg       sync.WaitGroup
	closed   sync.Once
}

// Start loads the node's layers and starts serving. ctx bounds start-up
// only (loading, assignment, the first registration); Close stops the node.
// In order: the node's parts (newNode), the port (bind), the layers
// (chooseLayers, loadShard), then the services (serve, startServices).
func Start(ctx context.Context, cfg Config) (*Node, error) {
	if err := cfg.check(); err != nil {
		return nil, err
	}
	n, err := newNode(cfg)
	if err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			n.shutdown()
		}
	}()
	// Bind before loading: a port in use fails now, not after the load.
	if err := n.bind(); err != nil {
		return nil, err
	}
	first, last, err := n.chooseLayers(ctx)
	if err != nil {
		return nil, err
	}
	sh, err := n.loadShard(first, last)
	if err != nil {
		return nil, err
	}
	n.mu.Lock()
	n.cur = sh
	n.publish()
	n.mu.Unlock()
	// The counters start at zero now: the baseline, so work done before the
	// first heartbeat counts in it.
	n.stats.RecordTotals(0, 0)
	if n.ms == 0 {
		if n.ms, err = measureMsPerLayer(sh.model.Stack, first); err != nil {
			return nil, err
		}
	}
	svcCtx, cancel := context.WithCancel(context.Background())
	n.cancel = cancel
	n.serve()
	if err := n.startServices(ctx, svcCtx); err != nil {
		return nil, err
	}
	n.wg.Add(1)
	go n.retirer(svcCtx)
	ok = true
	return n, nil
}

// newNode makes the node's parts from its configuration: the model's
// name, variant and memory budget, and the tracker, relay and direct-path
// clients. The direct paths' sockets (UDP for QUIC, the TCP punch
// port) are the only things it opens.
func newNode(cfg Config) (*Node, error) {
	mcfg, err := model.LoadConfig(cfg.ModelDir)
	if err != nil {
		return nil, fmt.Errorf("model: %w", err)
	}
	n := &Node{cfg: cfg, log: cfg.Logger, mcfg: mcfg, id: cfg.Identity, stats: rpm.New(nil), serveErr: make(chan error, 1),
		wake: make(chan struct{}, 1)}
	if n.log == nil {
		n.log = slog.Default()
	}
	n.name = cfg.ModelName
	if n.name == "" {
		n.name = model.DefaultName(cfg.ModelDir)
	}
	if n.variant, n.fp, err = n.weights(); err != nil {
		return nil, err
	}
	n.budget = cfg.MemoryBudget
	if n.budget <= 0 {
		free, _, err := cfg.Backend.Memory()
		if err != nil {
			return nil, fmt.Errorf("backend %s memory: %w", cfg.Backend.Name(), err)
		}
		n.budget = int64(free - free/10)
	}
	if cfg.TrackerURL != "" {
		// The HTTP timeout bounds how long a silent tracker holds the node
		// before it moves to the next one.
		n.trackc = &tracker.Client{URL: strings.TrimRight(cfg.TrackerURL, "/"), Fallbacks: cfg.TrackerFallbacks, Identity: cfg.Identity,
			HTTP: &http.Client{Timeout: trackerTimeout(cfg.HeartbeatInterval)}, Logger: n.log.With("service", "tracker")}
	}
	if cfg.RelayURL != "" {
		base := strings.TrimRight(cfg.RelayURL, "/")
		n.relayAddr = wsURL(base) + "/rpc/" + cfg.Identity.PeerID
		n.bridge = &relay.Bridge{RelayURL: base, Identity: cfg.Identity, JoinToken: cfg.RelayJoinToken,
			Logger: n.log.With("service", "relay-bridge"), DisableTunnel: cfg.RelayMode == RelayRPC,
			Handler: http.HandlerFunc(n.serveHTTP), HopServer: &n.shards, MaxBackoff: relayMaxBackoff,
			OnState: func(bool) { n.heartbeatNow() }}
	}
	// Every node can send hops to relay-only peers; with a bridge the hops
	// share its tunnel.
	n.relayc = &relay.Client{Identity: cfg.Identity, JoinToken: cfg.RelayJoinToken, JoinTokenRelay: cfg.RelayURL, Bridge: n.bridge,
		DisableTunnel: cfg.RelayMode == RelayRPC, ReconnectWait: relayReconnectWait, Logger: n.log.With("service", "relay-client")}
	if cfg.RelayURL != "" && !cfg.NoDirectPaths && cfg.RelayMode != RelayRPC {
		n.direct = &node.DirectPaths{Identity: cfg.Identity, Relay: n.relayc, RelayURL: cfg.RelayURL, HopServer: &n.shards,
			Listen: cfg.PathListen, Logger: n.log.With("service", "direct-paths")}
		if err := n.direct.Start(); err != nil {
			return nil, err
		}
	}
	return n, nil
}

// bind takes the API's port (or closes the one given with NoListen),
// wraps it in hop TLS pinned to the peer id and API TLS as configured,
// and sets the endpoints the node advertises.
func (n *Node) bind() error {
	cfg := n.cfg
	var err error
	if cfg.NoListen {
		if cfg.Listener != nil {
			cfg.Listener.Close()
		}
	} else {
		if n.ln = cfg.Listener; n.ln == nil {
			listen := cfg.Listen
			if listen == "" {
				listen = "127.0.0.1:0"
			}
			if n.ln, err = net.Listen("tcp", listen); err != nil {
				return fmt.Errorf("listen %s: %w", listen, err)
			}
		}
		var api *tls.Config
		if cfg.APICertificate != nil {
			api = &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{*cfg.APICertificate}, NextProtos: []string{"http/1.1"}}
		}
		switch {
		case !cfg.NoHopTLS:
			// TLS and plain HTTP on one port: hops to this node's peer id
			// go over TLS pinned to its key (node/hoptls.go).
			tc, err := cfg.Identity.ServerTLSConfig(time.Now())
			if err != nil {
				return err
			}
			if api != nil {
				tc = node.SplitTLS(tc, api)
			}
			n.ln = node.ServeTLSAndPlain(n.ln, tc)
		case api != nil:
			n.ln = node.ServeTLSAndPlain(n.ln, api)
		}
		n.endpoint = strings.TrimRight(cfg.Advertise, "/")
		if n.endpoint == "" {
			n.endpoint = "http://" + n.ln.Addr().String()
			if a, ok := n.ln.Addr().(*net.TCPAddr); ok && a.IP.IsUnspecified() && n.trackc != nil {
				n.log.Warn("listening on all interfaces without an advertised endpoint: peers cannot reach "+n.endpoint+
					"; pass --advertise http://ADDRESS:PORT with an address they can reach", "endpoint", n.endpoint)
			}
		}
		n.hopEndpoint = n.endpoint
		if !cfg.NoHopTLS {
			// The port serves TLS pinned to the peer id: registered as
			// https, peers and the tracker never fall back to plain for it
			// (an attacker answering the handshake with plain HTTP would
			// otherwise downgrade the hops).
			n.hopEndpoint = httpsOf(n.endpoint)
		}
	}
	return nil
}

// chooseLayers is the layer range to load: the configured one, or with
// Auto the tracker's assignment (after measuring this node's speed).
func (n *Node) chooseLayers(ctx context.Context) (first, last int, err error) {
	cfg := n.cfg
	first, last = cfg.First, cfg.Last
	if last < 0 {
		last = n.mcfg.NumLayers - 1
	}
	if cfg.Auto {
		if n.ms, err = n.probeMsPerLayer(); err != nil {
			return 0, 0, err
		}
		a, err := n.assign(ctx, tracker.AssignRequest{Model: n.name, Variant: n.variant, NumLayers: n.mcfg.NumLayers,
			MemoryBudget: n.budget, Footprint: n.fp, MsPerLayer: n.ms, JoinToken: cfg.TrackerJoinToken})
		if err != nil {
			return 0, 0, fmt.Errorf("asking the tracker %s for layers: %w", cfg.TrackerURL, err)
		}
		first, last = a.First, a.Last
		n.log.Info("tracker assigned layers", "layers", fmt.Sprintf("%d-%d", first, last), "budget", n.budget,
			"newly_covered", a.NewlyCovered, "gain", a.Gain)
	} else if first < 0 || first > last || last >= n.mcfg.NumLayers {
		return 0, 0, fmt.Errorf("layers %d-%d: the model has layers 0-%d", first, last, n.mcfg.NumLayers-1)
	}
	return first, last, nil
}

// serve starts the HTTP server on the bound port (none with NoListen).
func (n *Node) serve() {
	cfg := n.cfg
	if !cfg.NoListen {
		n.hs = &http.Server{
			Handler:           http.HandlerFunc(n.serveHTTP),
			ReadHeaderTimeout: cmp.Or(cfg.HeaderTimeout, DefaultHeaderTimeout),
			IdleTimeout:       2 * time.Minute,
			MaxHeaderBytes:    1 << 20,
			ErrorLog:          slog.NewLogLogger(n.log.Handler(), slog.LevelWarn),
			// No WriteTimeout: completions stream for as long as they generate.
		}
		n.wg.Add(1)
		go func() {
			defer n.wg.Done()
			if err := n.hs.Serve(n.ln); !errors.Is(err, http.ErrServerClosed) {
				n.fail(fmt.Errorf("serving on %s: %w", n.ln.Addr(), err))
			}
		}()
	}
}

// startServices connects to the relay (waiting until it knows this
// node, so no hop is routed to nowhere), registers with the tracker and
// starts the announcer; ctx bounds the waiting, svcCtx the services.
func (n *Node) startServices(ctx, svcCtx context.Context) error {
	cfg := n.cfg
	if n.bridge != nil {
		n.goService(svcCtx, "relay-bridge", n.bridge.Run)
		// Registering before the relay knows us would route hops to nowhere.
		if err := n.waitRelay(ctx, 10*time.Second); err != nil {
			return err
		}
		if cfg.RelayMode == RelayTunnel && n.bridge.Mode() != "tunnel" {
			n.log.Warn("relay offers no tunnel; serving over /ws", "relay", cfg.RelayURL)
		}
	}
	if n.trackc != nil {
		// A refusal (bad token, impossible range) is fatal; an unreachable
		// tracker is not: the announcer keeps trying, so nodes and tracker
		// may start in any order.
		rctx, rcancel := context.WithTimeout(ctx, 10*time.Second)
		_, err := n.trackc.Register(rctx, n.registration())
		rcancel()
		switch {
		case err == nil:
		case !retryable(err):
			return fmt.Errorf("registering with the tracker %s: %w", cfg.TrackerURL, err)
		case ctx.Err() != nil:
			return ctx.Err()
		case tracker.IsConflict(err):
			// Another registration holds what this one claims (an older
			// tracker refusing a layer count a squatter registered first,
			// an address another node still holds): that can end, so the
			// node serves and the announcer retries with backoff.
			n.log.Warn("the tracker refuses this registration for now (conflict); retrying in the background with backoff", "tracker", cfg.TrackerURL, "error", err)
		default:
			n.log.Warn("tracker not reachable yet; registering in the background", "tracker", cfg.TrackerURL, "error", err)
		}
		n.announcer = &tracker.Announcer{Client: n.trackc, Interval: cfg.HeartbeatInterval, Registration: n.registration,
			Stats: n.heartbeatStats, OnMove: n.move, RelayDown: n.relayDown, Wake: n.wake, Logger: n.log.With("service", "tracker")}
		annCtx, stopAnn := context.WithCancel(svcCtx)
		n.stopAnn = stopAnn
		annDone := make(chan struct{})
		n.annDone = annDone
		n.goService(annCtx, "tracker-announcer", func(ctx context.Context) error {
			defer close(annDone)
			return n.announcer.Run(ctx)
		})
	}
	return nil
}

// retryable says whether a tracker's refusal can end by itself: 408, 409
// (a conflict with another registration), 429 (rates, per-source caps),
// 5xx (a full tracker) and no answer at all; other 4xx are this node's
// configuration (a bad token, an impossible range) and stop it.
func retryable(err error) bool {
	var se *tracker.StatusError
	if !errors.As(err, &se) {
		return true
	}
	return se.Status == 408 || se.Status == 409 || se.Status == 429 || se.Status >= 500
}

// assign asks the tracker for a range, retrying with backoff (capped at
// 30 s) while the refusal can end and ctx lasts; an unreachable tracker is
// an error at once, as a node with --auto cannot start without it.
func (n *Node) assign(ctx context.Context, req tracker.AssignRequest) (tracker.AssignResponse, error) {
	wait := time.Second
	for {
		a, err := n.trackc.Assign(ctx, req)
		var se *tracker.StatusError
		if err == nil || !errors.As(err, &se) || !retryable(err) {
			return a, err
		}
		n.log.Warn("the tracker refuses to assign layers for now; retrying", "status", se.Status, "error", err, "retry_in", wait)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return a, fmt.Errorf("%w (gave up: %w)", err, ctx.Err())
		case <-t.C:
		}
		wait = min(2*wait, 30*time.Second)
	}
}

func (cfg *Config) check() error {
	switch {
	case cfg.ModelDir == "":
		return errors.New("no model directory")
	case cfg.Backend == nil:
		return errors.New("no backend")
	case cfg.Identity == nil:
		return errors.New("no identity")
	case cfg.Auto && cfg.TrackerURL == "":
		return errors.New("auto-sharding needs a tracker URL")
	case cfg.NoListen && cfg.RelayURL == "":
		return errors.New("a node with no listener needs a relay URL to be reachable")
	case cfg.NoListen && cfg.Advertise != "":
		return errors.New("a node with no listener has no endpoint to advertise")
	case cfg.MemoryBudget < 0:
		return errors.New("memory budget must not be negative")
	}
	switch cfg.RelayMode {
	case "":
		cfg.RelayMode = RelayAuto
	case RelayAuto, RelayTunnel, RelayRPC:
	default:
		return fmt.Errorf("relay mode %q: want auto, tunnel or rpc", cfg.RelayMode)
	}
	urls := []struct{ name, v string }{{"relay", cfg.RelayURL}, {"tracker", cfg.TrackerURL}, {"advertise", cfg.Advertise}}
	for _, u := range cfg.TrackerFallbacks {
		urls = append(urls, struct{ name, v string }{"tracker", u})
	}
	for _, u := range urls {
		if u.v == "" {
			continue
		}
		p, err := url.Parse(u.v)
		if err != nil || p.Host == "" {
			return fmt.Errorf("%s URL %q: want scheme://host:port", u.name, u.v)
		}
		ok := p.Scheme == "http" || p.Scheme == "https"
		if u.name == "relay" {
			ok = ok || p.Scheme == "ws" || p.Scheme == "wss"
		}
		if !ok {
			return fmt.Errorf("%s URL %q: unsupported scheme %q", u.name, u.v, p.Scheme)
		}
	}
	return nil
}

// httpsOf is endpoint (an http:// or https:// URL, Config.check) with the
// https scheme.
func httpsOf(endpoint string) string {
	u, err := url.Parse(endpoint)
	if err != nil {
		return endpoint
	}
	u.Scheme = "https"
	return u.String()
}

// trackerTimeout bounds one tracker request: twice the heartbeat interval,
// between 2 and 10 seconds.
func trackerTimeout(interval time.Duration) time.Duration {
	if interval <= 0 {
		interval = 5 * time.Second
	}
	return min(max(2*interval, 2*time.Second), 10*time.Second)
}

// wsURL turns an http(s) relay base into ws(s), as relay_addr must be.
func wsURL(base string) string {
	if s, ok := strings.CutPrefix(base, "http://"); ok {
		return "ws://" + s
	}
	if s, ok := strings.CutPrefix(base, "https://"); ok {
		return "wss://" + s
	}
	return base
}

func (n *Node) goService(ctx context.Context, name string, run func(context.Context) error) {
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		if err := run(ctx); err != nil && ctx.Err() == nil {
			n.log.Error("service stopped", "service", name, "error", err)
			n.fail(fmt.Errorf("%s: %w", name, err))
		}
	}()
}

// fail reports a fatal error on Err without blocking (the first one wins).
func (n *Node) fail(err error) {
	select {
	case n.serveErr <- err:
	default:
	}
}

func (n *Node) waitRelay(ctx context.Context, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for !n.bridge.Connected() {
		if time.Now().After(deadline) {
			return fmt.Errorf("relay %s: not connected after %v", n.cfg.RelayURL, limit)
		}
		select {
		case err := <-n.serveErr:
			return err
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	return nil
}

func (n *Node) maxSessions() int {
	if n.cfg.MaxSessions > 0 {
		return n.cfg.MaxSessions
	}
	return node.DefaultMaxSessions
}

func (n *Node) maxContext() int {
	c := n.cfg.MaxContext
	if c <= 0 || c > engine.DefaultMaxContext {
		c = engine.DefaultMaxContext
	}
	if n.mcfg.MaxPositions > 0 && c > n.mcfg.MaxPositions {
		c = n.mcfg.MaxPositions
	}
	return c
}

// URL is the node's HTTP base URL ("" when it does not listen).
func (n *Node) URL() string { return n.endpoint }

// HopEndpoint is the endpoint the node registers with its tracker: URL
// with https:// when it serves hop TLS (pinned to its peer id), "" with
// no listener.
func (n *Node) HopEndpoint() string { return n.hopEndpoint }

// PeerID is the node's identity.
func (n *Node) PeerID() string { return n.id.PeerID }

// Variant is the weights the node holds, as it registers them.
func (n *Node) Variant() wire.Variant { return n.variant }

// RelayAddr is the node's per-request relay URL ("" without a relay).
func (n *Node) RelayAddr() string { return n.relayAddr }

// Layers is the range the node serves new sessions with (-1, -1 once
// closed).
func (n *Node) Layers() (first, last int) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cur == nil {
		return -1, -1
	}
	return n.cur.first, n.cur.last
}

// Err delivers a fatal serving error (the listener failed, the relay refused
// the node's identity); nil is never sent.
func (n *Node) Err() <-chan error { return n.serveErr }

// Close stops the node: the listener (in-flight requests get up to 10 s),
// the relay bridge and tracker announcer, then every shard. It does not
// close the backend.
func (n *Node) Close() error {
	n.shutdown()
	return nil
}

func (n *Node) shutdown() {
	n.closed.Do(func() {
		if n.hs == nil && n.ln != nil {
			n.ln.Close() // bound, but start-up failed before serving
		}
		if n.hs != nil {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			if err := n.hs.Shutdown(ctx); err != nil {
				n.hs.Close()
			}
			cancel()
		}
		n.hops.Close()
		if n.cancel != nil {
			n.cancel()
		}
		n.wg.Wait()
		if n.direct != nil {
			n.direct.Close()
		}
		n.relayc.Close()
		n.mu.Lock()
		shards := append([]*shard{n.cur}, n.retiring...)
		n.cur, n.retiring = nil, nil
		n.publish()
		n.mu.Unlock()
		for _, s := range shards {
			if s != nil {
				s.close()
			}
		}
	})
}

// registration is what the announcer sends: called before every
// (re-)registration, so a move is reported with its new range.
func (n *Node) registration() tracker.Registration {
	first, last := n.Layers()
	var free int64
	if f, _, err := n.cfg.Backend.Memory(); err == nil {
		free = int64(f)
	}
	return tracker.Registration{Endpoint: n.hopEndpoint, RelayAddr: n.relayAddr, Model: n.name, Variant: n.variant,
		NumLayers: n.mcfg.NumLayers, Layers: [2]int{first, last}, Backend: n.cfg.Backend.Name(),
		Hidden: n.mcfg.Hidden, MemoryBudget: n.budget, FreeMemory: free, Footprint: n.fp,
		MsPerLayer: n.ms, JoinToken: n.cfg.TrackerJoinToken, RelayDown: n.relayDown(),
		Replies: tracker.Replies{TicketVersion: cmp.Or(n.cfg.ticketVersion, ticket.Version), DirectReplies: n.cfg.DirectReplies}}
}

// relayDown: the node has a relay and is not connected to it now.
func (n *Node) relayDown() bool { return n.bridge != nil && !n.bridge.Connected() }

// heartbeatNow asks the announcer for a heartbeat at once (no-op without
// a tracker, or when one is asked for already).
func (n *Node) heartbeatNow() {
	select {
	case n.wake <- struct{}{}:
	default:
	}
}

// Stats sums the counters of every shard this node has served with.
func (n *Node) Stats() node.Stats {
	n.mu.Lock()
	st := n.base
	shards := append([]*shard{n.cur}, n.retiring...)
	n.mu.Unlock()
	for _, s := range shards {
		if s == nil {
			continue
		}
		addStats(&st, s.srv.Stats())
	}
	return st
}

func addStats(st *node.Stats, s node.Stats) {
	st.Sessions += s.Sessions
	st.HopsOK += s.HopsOK
	st.HopsFailed += s.HopsFailed
	st.TokensGenerated += s.TokensGenerated
	st.Requests += s.Requests
	st.Running += s.Running
	st.Queued += s.Queued
	st.HopsInFlight += s.HopsInFlight
	st.SpecDrafted += s.SpecDrafted
	st.SpecAccepted += s.SpecAccepted
	st.SpecPasses += s.SpecPasses
	st.DirectReplies += s.DirectReplies
	st.DirectChainFirst += s.DirectChainFirst
	// Percentiles: the current shard's (it serves the new traffic).
	if st.HopP50Ms == 0 {
		st.HopP50Ms, st.HopP99Ms = s.HopP50Ms, s.HopP99Ms
		st.ComputeP50Ms, st.ComputeP99Ms = s.ComputeP50Ms, s.ComputeP99Ms
	}
}

// heartbeatStats feeds the rolling windows from the node's cumulative
// counters: one unit of work is one step of this node's layers (a hop
// served, or on a head a token it drove through the pipeline). The hop
// latency percentiles are the node's /stats ones (node.Stats).
func (n *Node) heartbeatStats() (tracker.NodeStats, int64) {
	st := n.Stats()
	work := st.HopsOK + st.HopsFailed
	if first, _ := n.Layers(); first == 0 {
		work += st.TokensGenerated
	}
	n.stats.RecordTotals(work, st.TokensGenerated)
	snap := n.stats.Snapshot()
	var free int64
	if f, _, err := n.cfg.Backend.Memory(); err == nil {
		free = int64(f)
	}
	return tracker.NodeStats{RPM1: snap.RPM1, RPM5: snap.RPM5, TokensPerSec: snap.TokensPerSec,
		HopP50Ms: st.HopP50Ms, HopP99Ms: st.HopP99Ms, Sessions: st.Sessions,
		Running: st.Running, Queued: st.Queued, HopsInFlight: st.HopsInFlight}, free
}

// BridgeMode is how the relay bridge is connected now: "tunnel", "ws", or
// "" (no relay, or not connected).
func (n *Node) BridgeMode() string {
	if n.bridge == nil {
		return ""
	}
	return n.bridge.Mode()
}

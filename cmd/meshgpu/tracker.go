package main

import (
	"context"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"

	"meshgpu/identity"
	"meshgpu/relay"
	"meshgpu/tracker"
)

func init() {
	register(&cli.Command{
		Name:  "tracker",
		Usage: "run the control plane: registry, availability map, assignment, routing, OpenAI proxy",
		Flags: append([]cli.Flag{
			&cli.StringFlag{Name: "listen", Value: tracker.DefaultListen, Usage: "address to serve the tracker API on", EnvVars: legacyEnvVars("tracker", "listen")},
			&cli.DurationFlag{Name: "heartbeat-timeout", Value: tracker.DefaultHeartbeatTimeout, Usage: "forget nodes silent for this long", EnvVars: legacyEnvVars("tracker", "heartbeat-timeout")},
			&cli.DurationFlag{Name: "ban-duration", Value: tracker.DefaultBanDuration, Usage: "keep a node that failed a request out of routes for this long", EnvVars: legacyEnvVars("tracker", "ban-duration")},
			&cli.DurationFlag{Name: "token-timeout", Value: tracker.DefaultTokenTimeout, Usage: "longest wait between two streamed tokens before failing over", EnvVars: legacyEnvVars("tracker", "token-timeout")},
			&cli.StringFlag{Name: "join-token", Usage: "require this token in node registrations (empty: open mesh)", EnvVars: legacyEnvVars("tracker", "join-token")},
			&cli.StringFlag{Name: "relay-join-token", Usage: "join token of the --relay relay, used to reach relay-only head nodes through it (never sent to another relay)", EnvVars: legacyEnvVars("tracker", "relay-join-token")},
			&cli.StringFlag{Name: "relay", Usage: "the relay (ws://host:port) --relay-join-token belongs to; relays named by registrants are reached without a token", EnvVars: cmdEnvVars("tracker", "relay")},
			&cli.IntFlag{Name: "max-attempts", Value: tracker.DefaultMaxAttempts, Usage: "routes tried per proxied request", EnvVars: legacyEnvVars("tracker", "max-attempts")},
			&cli.DurationFlag{Name: "page-refresh", Value: tracker.DefaultPageRefresh, Usage: "how often the mesh page at / updates itself", EnvVars: cmdEnvVars("tracker", "page-refresh")},
			&cli.StringFlag{Name: "store", Value: "memory", Usage: "where the mesh state lives: memory (this process), or etcd://HOST:PORT[,HOST:PORT...] shared by several trackers of one mesh", EnvVars: cmdEnvVars("tracker", "store")},
			&cli.StringFlag{Name: "etcd-prefix", Value: "/meshgpu/", Usage: "key prefix of this mesh in etcd (one per mesh)", EnvVars: cmdEnvVars("tracker", "etcd-prefix")},
			&cli.StringFlag{Name: "key", Usage: "tracker identity key file, created when missing (default: a new identity each start)", EnvVars: cmdEnvVars("tracker", "key")},
			&cli.BoolFlag{Name: "allow-loopback-endpoints", Usage: "accept nodes registering loopback addresses (default: when --listen is a loopback address)", EnvVars: cmdEnvVars("tracker", "allow-loopback-endpoints")},
			&cli.BoolFlag{Name: "allow-private-endpoints", Usage: "accept nodes registering private addresses (10/8, 172.16/12, 192.168/16, 100.64/10, fc00::/7): a LAN mesh; link-local and metadata addresses are always refused", EnvVars: cmdEnvVars("tracker", "allow-private-endpoints")},
			&cli.Float64Flag{Name: "audit-rate", Value: tracker.DefaultAuditRate, Usage: "fraction of proxied generations whose work is audited against another replica (0: none)", EnvVars: cmdEnvVars("tracker", "audit-rate")},
			&cli.Float64Flag{Name: "audit-tolerance", Value: tracker.DefaultAuditTolerance, Usage: "largest logprob difference (nats) an audit accepts between two routes (docs/security.md has the calibration)", EnvVars: cmdEnvVars("tracker", "audit-tolerance")},
			&cli.BoolFlag{Name: "audit-probation", Value: true, Usage: "keep a new node out of real traffic until an audit of its work passes (when another replica of its layers exists)", EnvVars: cmdEnvVars("tracker", "audit-probation")},
			&cli.StringSliceFlag{Name: "audit-trusted", Usage: "peer id of a node whose audit answer is believed alone (repeatable)", EnvVars: cmdEnvVars("tracker", "audit-trusted")},
			&cli.DurationFlag{Name: "audit-ban", Value: tracker.DefaultAuditBan, Usage: "how long a first failed audit keeps a node out; each further failure doubles it", EnvVars: cmdEnvVars("tracker", "audit-ban")},
			&cli.IntFlag{Name: "max-nodes", Value: tracker.DefaultMaxNodes, Usage: "live nodes this tracker holds; registrations beyond get 503", EnvVars: cmdEnvVars("tracker", "max-nodes")},
			&cli.IntFlag{Name: "max-nodes-per-source", Value: tracker.DefaultMaxNodesPerSource, Usage: "live nodes registered from one address (IPv6: one /64); beyond: 429 (default: no cap of its own when --listen is a loopback address)", EnvVars: cmdEnvVars("tracker", "max-nodes-per-source")},
			&cli.IntFlag{Name: "max-models", Value: tracker.DefaultMaxModels, Usage: "distinct model names this tracker serves; a new one beyond gets 503", EnvVars: cmdEnvVars("tracker", "max-models")},
			&cli.IntFlag{Name: "max-models-per-source", Value: tracker.DefaultMaxModelsPerSource, Usage: "distinct models the nodes of one address serve (default: no cap of its own when --listen is a loopback address)", EnvVars: cmdEnvVars("tracker", "max-models-per-source")},
			&cli.IntFlag{Name: "max-layers-per-source", Value: tracker.DefaultMaxLayersPerSource, Usage: "layers of the model variants the nodes of one address serve, all together (default: no cap of its own when --listen is a loopback address)", EnvVars: cmdEnvVars("tracker", "max-layers-per-source")},
			&cli.IntFlag{Name: "max-tracker-layers", Value: tracker.DefaultMaxTrackerLayers, Usage: "layers of all model variants together (bounds the per-layer state and metrics)", EnvVars: cmdEnvVars("tracker", "max-tracker-layers")},
			&cli.StringFlag{Name: "advertise", Usage: "URL nodes reach this tracker at, published to them (default: http:// + the --listen address)", EnvVars: cmdEnvVars("tracker", "advertise")},
		}, append(apiTLSFlags("tracker", "serves https:// (the API, the page and the node endpoints)"), apiAuthFlags()...)...),
		Action: runTracker,
	})
}

func runTracker(c *cli.Context) error {
	if c.Duration("heartbeat-timeout") <= 0 || c.Duration("ban-duration") <= 0 || c.Duration("token-timeout") <= 0 {
		return errors.New("--heartbeat-timeout, --ban-duration and --token-timeout must be positive")
	}
	if c.Int("max-attempts") < 1 {
		return errors.New("--max-attempts must be at least 1")
	}
	if r := c.Float64("audit-rate"); !(r >= 0 && r <= 1) || !(c.Float64("audit-tolerance") > 0) || c.Duration("audit-ban") <= 0 {
		return errors.New("--audit-rate must be 0 to 1; --audit-tolerance and --audit-ban must be positive")
	}
	endpoints, err := etcdEndpoints(c.String("store"))
	if err != nil {
		return err
	}
	auth, err := apiAuthConfig(c)
	if err != nil {
		return err
	}
	var id *identity.Identity
	if k := c.String("key"); k != "" {
		if id, err = identity.LoadOrCreate(k); err != nil {
			return fmt.Errorf("--key %s: %w", k, err)
		}
	} else if id, err = identity.New(); err != nil {
		return err
	}
	if err := checkBaseURL("advertise", c.String("advertise")); err != nil {
		return err
	}
	cert, err := apiCertificate(c)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", c.String("listen"))
	if err != nil {
		return listenError(c.String("listen"), "127.0.0.1:7101", err)
	}
	defer ln.Close()
	scheme := "http"
	if cert != nil {
		scheme = "https"
		ln = tls.NewListener(ln, &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{*cert}, NextProtos: []string{"http/1.1"}})
	}
	self := tracker.TrackerInfo{PeerID: id.PeerID, PublicKey: hex.EncodeToString(id.Public), URL: strings.TrimRight(c.String("advertise"), "/")}
	if self.URL == "" {
		self.URL = scheme + "://" + ln.Addr().String()
	}
	policy := tracker.AddrPolicy{AllowLoopback: isLoopback(ln.Addr()), AllowPrivate: c.Bool("allow-private-endpoints")}
	if c.IsSet("allow-loopback-endpoints") {
		policy.AllowLoopback = c.Bool("allow-loopback-endpoints")
	}
	var store tracker.Store
	if endpoints != nil {
		ctx, cancel := context.WithTimeout(c.Context, 10*time.Second)
		es, err := tracker.OpenEtcd(ctx, tracker.EtcdConfig{Endpoints: endpoints, Prefix: c.String("etcd-prefix"),
			TTL: c.Duration("heartbeat-timeout"), Self: self, Logger: slog.Default()})
		cancel()
		if err != nil {
			return fmt.Errorf("--store %s: %w", c.String("store"), err)
		}
		defer es.Close()
		store = es
	}
	// Relay-only heads are reached through their relay (tunnel, or /rpc).
	if c.String("relay-join-token") != "" && c.String("relay") == "" {
		return errors.New("--relay-join-token needs --relay: the relay the token belongs to (it is sent to no other)")
	}
	rc := &relay.Client{JoinToken: c.String("relay-join-token"), JoinTokenRelay: c.String("relay"), Logger: slog.Default()}
	defer rc.Close()
	srv := tracker.NewServer(tracker.Config{
		Store:            store,
		Self:             self,
		TicketKey:        id.Private,
		Relay:            rc,
		JoinToken:        c.String("join-token"),
		HeartbeatTimeout: c.Duration("heartbeat-timeout"),
		BanDuration:      c.Duration("ban-duration"),
		TokenTimeout:     c.Duration("token-timeout"),
		MaxAttempts:      c.Int("max-attempts"),
		PageRefresh:      c.Duration("page-refresh"),
		APIAuth:          auth,
		Endpoints:        policy,
		Limits:           trackerLimits(c, isLoopback(ln.Addr())),
		Logger:           slog.Default(),
		Audit: tracker.AuditConfig{Rate: c.Float64("audit-rate"), Tolerance: c.Float64("audit-tolerance"),
			Probation: c.Bool("audit-probation"), Trusted: c.StringSlice("audit-trusted"), Ban: c.Duration("audit-ban")},
	})
	hs := &http.Server{
		Handler:           srv.Handler(),
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    64 << 10,
	}
	ctx, stop := signal.NotifyContext(c.Context, syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	auditCtx, stopAudits := context.WithCancel(ctx)
	audits := make(chan struct{})
	go func() { defer close(audits); srv.RunAudits(auditCtx) }()
	defer func() { stopAudits(); <-audits }()
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	slog.Info("tracker listening", "addr", ln.Addr().String(), "url", self.URL, "peer_id", id.PeerID, "store", c.String("store"))
	select {
	case err := <-errc:
		return fmt.Errorf("tracker: %w", err)
	case <-ctx.Done():
	}
	shutdown, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := hs.Shutdown(shutdown); err != nil {
		hs.Close()
	}
	<-errc
	return nil
}

// etcdEndpoints reads --store: nil for memory, else the etcd members.
func etcdEndpoints(v string) ([]string, error) {
	if v == "memory" || v == "" {
		return nil, nil
	}
	rest, ok := strings.CutPrefix(v, "etcd://")
	var out []string
	for _, hp := range strings.Split(rest, ",") {
		if _, port, err := net.SplitHostPort(hp); !ok || err != nil || port == "" {
			return nil, fmt.Errorf("--store %q: want memory or etcd://HOST:PORT[,HOST:PORT...]", v)
		}
		out = append(out, hp)
	}
	return out, nil
}

// isLoopback reports a listener only this machine can reach: its nodes
// can only be local too, so loopback endpoints are the expected ones.
func isLoopback(a net.Addr) bool {
	ta, ok := a.(*net.TCPAddr)
	return ok && ta.IP.IsLoopback()
}

// trackerLimits reads the registration caps. A tracker listening on
// loopback is reached only from its own machine, whose nodes all share one
// source address: the per-source caps then default to the tracker-wide ones.
func trackerLimits(c *cli.Context, loopback bool) tracker.Limits {
	l := tracker.Limits{MaxNodes: c.Int("max-nodes"), MaxNodesPerSource: c.Int("max-nodes-per-source"), MaxModels: c.Int("max-models"),
		MaxModelsPerSource: c.Int("max-models-per-source"), MaxTrackerLayers: c.Int("max-tracker-layers"), MaxLayersPerSource: c.Int("max-layers-per-source")}
	if loopback && !c.IsSet("max-nodes-per-source") {
		l.MaxNodesPerSource = l.MaxNodes
	}
	if loopback && !c.IsSet("max-models-per-source") {
		l.MaxModelsPerSource = l.MaxModels
	}
	if loopback && !c.IsSet("max-layers-per-source") {
		l.MaxLayersPerSource = l.MaxTrackerLayers
	}
	return l
}

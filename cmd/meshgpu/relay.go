package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os/signal"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"

	"meshgpu/hopmux"
	"meshgpu/relay"
)

func init() {
	register(&cli.Command{
		Name:  "relay",
		Usage: "run the public relay that lets nodes behind NAT serve hops (/ws, /rpc/{peer_id}, /tunnel)",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "listen", Value: relay.DefaultListen, Usage: "address to listen on (use 0.0.0.0:PORT to serve the internet)", EnvVars: legacyEnvVars("relay", "listen")},
			&cli.StringFlag{Name: "tls-cert", Usage: "TLS certificate file (PEM); with --tls-key serves wss://", EnvVars: legacyEnvVars("relay", "tls-cert")},
			&cli.StringFlag{Name: "tls-key", Usage: "TLS private key file (PEM)", EnvVars: legacyEnvVars("relay", "tls-key")},
			&cli.StringFlag{Name: "join-token", Usage: "require this token from every node and client (private mesh)", EnvVars: legacyEnvVars("relay", "join-token")},
			&cli.IntFlag{Name: "max-frame-bytes", Value: hopmux.DefaultMaxFrame, Usage: "largest tunnel frame payload; larger messages close their connection", EnvVars: legacyEnvVars("relay", "max-frame-bytes")},
			&cli.IntFlag{Name: "max-inflight-per-peer", Value: relay.DefaultMaxInflightPerPeer, Usage: "requests one sender may have waiting; more get 429", EnvVars: legacyEnvVars("relay", "max-inflight-per-peer")},
			&cli.DurationFlag{Name: "request-timeout", Value: relay.DefaultRequestTimeout, Usage: "how long the relay waits for a node's answer", EnvVars: legacyEnvVars("relay", "request-timeout")},
			&cli.DurationFlag{Name: "idle-timeout", Value: relay.DefaultIdleTimeout, Usage: "close connections silent this long (tunnel nodes ping at a third of it, at most every 15s)", EnvVars: legacyEnvVars("relay", "idle-timeout")},
			&cli.BoolFlag{Name: "observe", Value: true, Usage: "answer nodes' path probes on UDP at the --listen address (STUN-style) and GET /observe on TCP, so nodes behind NAT can punch direct paths", EnvVars: legacyEnvVars("relay", "observe")},
			&cli.DurationFlag{Name: "shutdown-timeout", Value: 10 * time.Second, Usage: "how long a graceful shutdown may take", EnvVars: legacyEnvVars("relay", "shutdown-timeout")},
		},
		Action: runRelay,
	})
}

func runRelay(c *cli.Context) error {
	cert, key := c.String("tls-cert"), c.String("tls-key")
	if (cert == "") != (key == "") {
		return errors.New("--tls-cert and --tls-key go together; give both or neither")
	}
	if c.Int("max-frame-bytes") < 1024 || c.Int("max-frame-bytes") > 1<<30 {
		return fmt.Errorf("--max-frame-bytes must be between 1024 and %d, not %d", 1<<30, c.Int("max-frame-bytes"))
	}
	if c.Int("max-inflight-per-peer") < 1 {
		return fmt.Errorf("--max-inflight-per-peer must be at least 1, not %d", c.Int("max-inflight-per-peer"))
	}
	for _, f := range []string{"request-timeout", "idle-timeout", "shutdown-timeout"} {
		if c.Duration(f) <= 0 {
			return fmt.Errorf("--%s must be positive", f)
		}
	}
	log := slog.Default().With("component", "relay")
	s := &relay.Server{
		JoinToken:          c.String("join-token"),
		Logger:             slog.Default(),
		MaxFrameBytes:      c.Int("max-frame-bytes"),
		MaxInflightPerPeer: c.Int("max-inflight-per-peer"),
		RequestTimeout:     c.Duration("request-timeout"),
		IdleTimeout:        c.Duration("idle-timeout"),
	}
	ln, err := net.Listen("tcp", c.String("listen"))
	if err != nil {
		return listenError(c.String("listen"), "0.0.0.0:7010", err)
	}
	s.NoObserve = !c.Bool("observe") // GET /observe, the TCP twin of the UDP port
	handler := s.Handler()           // makes s.Registry
	if c.Bool("observe") {
		// The observation port shares the TCP port's number: one address
		// to open in a firewall, and nodes find it from the relay's URL.
		pc, err := net.ListenPacket("udp", ln.Addr().String())
		if err != nil {
			ln.Close()
			return fmt.Errorf("--observe: UDP %s: %w (pass --observe=false to run without direct paths)", ln.Addr(), err)
		}
		defer pc.Close()
		obs := &relay.Observer{Logger: log, Registry: s.Registry}
		go obs.Serve(pc)
		log.Info("observing path probes", "udp", pc.LocalAddr().String())
	}
	srv := &http.Server{
		Handler:           handler,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          slog.NewLogLogger(slog.Default().Handler(), slog.LevelWarn),
	}
	ctx, stop := signal.NotifyContext(c.Context, syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	scheme := "ws"
	if cert != "" {
		scheme = "wss"
	}
	errc := make(chan error, 1)
	go func() {
		if cert != "" {
			errc <- srv.ServeTLS(ln, cert, key)
		} else {
			errc <- srv.Serve(ln)
		}
	}()
	log.Info("relay listening", "addr", ln.Addr().String(), "url", scheme+"://"+ln.Addr().String(),
		"join_token", s.JoinToken != "", "max_frame_bytes", s.MaxFrameBytes, "max_inflight_per_peer", s.MaxInflightPerPeer)
	select {
	case err := <-errc:
		s.Close()
		if errors.Is(err, http.ErrServerClosed) {
			return nil
		}
		return fmt.Errorf("relay server: %w", err)
	case <-ctx.Done():
	}
	log.Info("shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), c.Duration("shutdown-timeout"))
	defer cancel()
	// Stop accepting, then drop the hijacked WebSockets (Shutdown does not
	// track them): nodes reconnect to the next relay with backoff.
	shutErr := srv.Shutdown(sctx)
	s.Close()
	<-errc
	if shutErr != nil && !errors.Is(shutErr, context.DeadlineExceeded) {
		return fmt.Errorf("shutdown: %w", shutErr)
	}
	return nil
}

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

	"meshgpu/relay"
	"meshgpu/tracker"
)

func init() {
	register(&cli.Command{
		Name:  "tracker",
		Usage: "run the control plane: registry, availability map, assignment, routing, OpenAI proxy",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "listen", Value: tracker.DefaultListen, Usage: "address to serve the tracker API on", EnvVars: legacyEnvVars("tracker", "listen")},
			&cli.DurationFlag{Name: "heartbeat-timeout", Value: tracker.DefaultHeartbeatTimeout, Usage: "forget nodes silent for this long", EnvVars: legacyEnvVars("tracker", "heartbeat-timeout")},
			&cli.DurationFlag{Name: "ban-duration", Value: tracker.DefaultBanDuration, Usage: "keep a node that failed a request out of routes for this long", EnvVars: legacyEnvVars("tracker", "ban-duration")},
			&cli.DurationFlag{Name: "token-timeout", Value: tracker.DefaultTokenTimeout, Usage: "longest wait between two streamed tokens before failing over", EnvVars: legacyEnvVars("tracker", "token-timeout")},
			&cli.StringFlag{Name: "join-token", Usage: "require this token in node registrations (empty: open mesh)", EnvVars: legacyEnvVars("tracker", "join-token")},
			&cli.StringFlag{Name: "relay-join-token", Usage: "join token for relays, used to reach relay-only head nodes", EnvVars: legacyEnvVars("tracker", "relay-join-token")},
			&cli.IntFlag{Name: "max-attempts", Value: tracker.DefaultMaxAttempts, Usage: "routes tried per proxied request", EnvVars: legacyEnvVars("tracker", "max-attempts")},
		},
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
	// Relay-only heads are reached through their relay (tunnel, or /rpc).
	rc := &relay.Client{JoinToken: c.String("relay-join-token"), Logger: slog.Default()}
	defer rc.Close()
	srv := tracker.NewServer(tracker.Config{
		Relay:            rc,
		JoinToken:        c.String("join-token"),
		HeartbeatTimeout: c.Duration("heartbeat-timeout"),
		BanDuration:      c.Duration("ban-duration"),
		TokenTimeout:     c.Duration("token-timeout"),
		MaxAttempts:      c.Int("max-attempts"),
		Logger:           slog.Default(),
	})
	ln, err := net.Listen("tcp", c.String("listen"))
	if err != nil {
		return fmt.Errorf("--listen %s: %w", c.String("listen"), err)
	}
	hs := &http.Server{
		Handler:           srv.Handler(),
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    64 << 10,
	}
	ctx, stop := signal.NotifyContext(c.Context, syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	slog.Info("tracker listening", "addr", ln.Addr().String())
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

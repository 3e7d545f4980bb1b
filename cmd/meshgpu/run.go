package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"

	"meshgpu/engine"
	"meshgpu/identity"
	"meshgpu/model"
	"meshgpu/native"
	"meshgpu/node"
	"meshgpu/relay"
)

// The relay client is what a node sends relayed hops with.
var _ node.RelayDoer = (*relay.Client)(nil)

func init() {
	register(&cli.Command{
		Name:  "run",
		Usage: "serve a shard of a model: hops, sessions, and on a head node (layer 0) the OpenAI API",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "model", Required: true, Usage: "Hugging Face model directory", EnvVars: envVars("model")},
			&cli.StringFlag{Name: "layers", Usage: "layers to hold, e.g. 0-11 (default: all)", EnvVars: envVars("layers")},
			&cli.StringFlag{Name: "listen", Value: "127.0.0.1:7001", Usage: "address to serve on", EnvVars: envVars("listen")},
			&cli.StringFlag{Name: "backend", Value: "auto", Usage: "cpu, cuda or auto", EnvVars: envVars("backend")},
			&cli.StringFlag{Name: "cuda-lib", Usage: "path of libmeshgpu_cuda.so", EnvVars: envVars("cuda-lib")},
			&cli.IntFlag{Name: "threads", Usage: "CPU threads (0: all cores)", EnvVars: envVars("threads")},
			&cli.StringSliceFlag{Name: "peer", Usage: "base URL of a node holding later layers (repeatable; NAME=URL also accepted); the head builds its route from their /health", EnvVars: envVars("peer")},
			&cli.StringFlag{Name: "route", Usage: `hop list after this node's layers, JSON: [{"endpoint":"http://127.0.0.1:7002","start_layer":3,"end_layer":5}]`, EnvVars: envVars("route")},
			&cli.DurationFlag{Name: "hop-timeout", Value: 30 * time.Second, Usage: "deadline of one hop attempt (a failed hop is retried once)", EnvVars: envVars("hop-timeout")},
			&cli.IntFlag{Name: "max-sessions", Value: 64, Usage: "sessions (KV caches) held at once; more get 429", EnvVars: envVars("max-sessions")},
			&cli.DurationFlag{Name: "session-ttl", Value: 10 * time.Minute, Usage: "free a session idle for this long", EnvVars: envVars("session-ttl")},
			&cli.IntFlag{Name: "max-context", Usage: "tokens per session (0: the model's, at most 4096)", EnvVars: envVars("max-context")},
			&cli.StringFlag{Name: "hop-dtype", Value: "bf16", Usage: "activation dtype on hops this head sends: bf16 or f32", EnvVars: envVars("hop-dtype")},
			&cli.StringFlag{Name: "key", Usage: "identity key file (default ~/.meshgpu/node.key; created when missing)", EnvVars: envVars("key")},
		},
		Action: runNode,
	})
}

// service is a background part of a node that lives as long as its HTTP
// server (the relay bridge, the tracker announcer): started after the
// listener is up, cancelled on shutdown, waited for before the model closes.
type service struct {
	name string
	run  func(ctx context.Context) error
}

func runNode(c *cli.Context) error {
	dir := c.String("model")
	hopDType := strings.ToLower(c.String("hop-dtype"))
	if hopDType != "bf16" && hopDType != "f32" {
		return fmt.Errorf("--hop-dtype must be bf16 or f32, not %q", c.String("hop-dtype"))
	}
	if c.Duration("hop-timeout") <= 0 || c.Duration("session-ttl") <= 0 {
		return errors.New("--hop-timeout and --session-ttl must be positive")
	}
	if c.Int("max-sessions") < 1 || c.Int("max-context") < 0 || c.Int("threads") < 0 {
		return errors.New("--max-sessions must be at least 1; --max-context and --threads must not be negative")
	}
	cfg, err := model.LoadConfig(dir)
	if err != nil {
		return fmt.Errorf("--model: %w", err)
	}
	first, last := 0, cfg.NumLayers-1
	if s := c.String("layers"); s != "" {
		if first, last, err = model.ParseLayers(s, cfg.NumLayers); err != nil {
			return fmt.Errorf("--layers: %w", err)
		}
	}
	var route []node.Hop
	if s := c.String("route"); s != "" {
		if route, err = node.ParseRoute(s, cfg.NumLayers); err != nil {
			return fmt.Errorf("--route: %w", err)
		}
	}
	peers, err := peerURLs(c.StringSlice("peer"))
	if err != nil {
		return err
	}
	keyPath := c.String("key")
	if keyPath == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return fmt.Errorf("--key: no home directory to keep ~/.meshgpu/node.key in (%v); pass --key", err)
		}
		keyPath = filepath.Join(home, ".meshgpu", "node.key")
	}
	id, err := identity.LoadOrCreate(keyPath)
	if err != nil {
		return fmt.Errorf("--key %s: %w", keyPath, err)
	}

	be, err := native.Open(c.String("backend"), native.Options{CUDALib: c.String("cuda-lib"), Threads: c.Int("threads")})
	if err != nil {
		return fmt.Errorf("--backend %s: %w", c.String("backend"), err)
	}
	defer be.Close()
	loadStart := time.Now()
	m, err := engine.Load(dir, engine.Options{Backend: be, First: first, Last: last, MaxContext: c.Int("max-context")})
	if err != nil {
		return fmt.Errorf("loading %s layers %d-%d: %w", dir, first, last, err)
	}
	defer m.Close()
	slog.Info("model loaded", "model", dir, "layers", fmt.Sprintf("%d-%d", first, last), "of", cfg.NumLayers,
		"backend", be.Name(), "took", time.Since(loadStart).Round(time.Millisecond))

	srv := &node.Server{
		Model: m, Backend: be, PeerID: id.PeerID,
		Route: route, Peers: peers, HopDType: hopDType,
		MaxSessions: c.Int("max-sessions"), SessionTTL: c.Duration("session-ttl"),
		HopTimeout: c.Duration("hop-timeout"), MaxContext: c.Int("max-context"),
		Logger: slog.Default(),
	}
	defer srv.Close()

	ln, err := net.Listen("tcp", c.String("listen"))
	if err != nil {
		return fmt.Errorf("--listen %s: %w", c.String("listen"), err)
	}
	hs := &http.Server{
		Handler:           srv.Handler(),
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    1 << 20,
		ErrorLog:          slog.NewLogLogger(slog.Default().Handler(), slog.LevelWarn),
		// No WriteTimeout: completions stream for as long as they generate.
	}

	ctx, stop := signal.NotifyContext(c.Context, syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	// Services the integration adds (relay bridge with srv.Handler(),
	// tracker announcer with srv.Stats()) go here.
	var services []service

	serveErr := make(chan error, 1)
	go func() { serveErr <- hs.Serve(ln) }()
	slog.Info("listening on "+ln.Addr().String(), "peer_id", id.PeerID, "head", first == 0)

	svcCtx, cancelSvcs := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for _, s := range services {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := s.run(svcCtx); err != nil && svcCtx.Err() == nil {
				slog.Error("service stopped", "service", s.name, "error", err)
			}
		}()
	}

	var runErr error
	select {
	case <-ctx.Done():
		slog.Info("shutting down")
	case err := <-serveErr:
		runErr = fmt.Errorf("serving on %s: %w", ln.Addr(), err)
	}
	cancelSvcs()
	shutCtx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := hs.Shutdown(shutCtx); err != nil {
		hs.Close()
	}
	wg.Wait()
	return runErr
}

// peerURLs accepts URL or NAME=URL and checks each is an http(s) base URL.
func peerURLs(in []string) ([]string, error) {
	var out []string
	for _, p := range in {
		if name, u, ok := strings.Cut(p, "="); ok && !strings.Contains(name, "://") {
			p = u
		}
		p = strings.TrimRight(p, "/")
		if !strings.HasPrefix(p, "http://") && !strings.HasPrefix(p, "https://") {
			return nil, fmt.Errorf("--peer %q: want a base URL like http://127.0.0.1:7002", p)
		}
		out = append(out, p)
	}
	return out, nil
}

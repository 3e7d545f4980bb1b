package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"

	"meshgpu/daemon"
	"meshgpu/engine"
	"meshgpu/identity"
	"meshgpu/model"
	"meshgpu/model/chat"
	"meshgpu/native"
	"meshgpu/node"
	"meshgpu/relay"
	"meshgpu/tracker"
	"meshgpu/wire"
)

// The relay client is what a node sends relayed hops with.
var _ node.RelayDoer = (*relay.Client)(nil)

func init() {
	register(&cli.Command{
		Name:  "run",
		Usage: "serve a shard of a model: hops, sessions, and on a head node (layer 0) the OpenAI API",
		Flags: append([]cli.Flag{
			&cli.StringFlag{Name: "model", Required: true, Usage: "Hugging Face model directory or .gguf file; or from the hub: a repository id org/name, or a GGUF as org/name:Q4_K_M or org/name/file.gguf (HF_TOKEN for gated ones)", EnvVars: envVars("model")},
			&cli.StringFlag{Name: "chat-template-file", Usage: "Jinja chat template replacing the model's own on a head, e.g. one that renders tools (docs/examples/chatml-tools.jinja)", EnvVars: cmdEnvVars("run", "chat-template-file")},
			&cli.StringFlag{Name: "layers", Usage: "layers to hold, e.g. 0-11 (default: all)", EnvVars: legacyEnvVars("run", "layers")},
			&cli.StringFlag{Name: "listen", Value: node.DefaultListen, Usage: "address to serve on", EnvVars: legacyEnvVars("run", "listen")},
			&cli.StringFlag{Name: "backend", Value: "auto", Usage: "cpu, cuda or auto", EnvVars: envVars("backend")},
			&cli.StringFlag{Name: "cuda-lib", Usage: "path of libmeshgpu_cuda.so", EnvVars: envVars("cuda-lib")},
			&cli.IntFlag{Name: "threads", Usage: "CPU threads (0: all cores)", EnvVars: envVars("threads")},
			&cli.BoolFlag{Name: "hop-tls", Value: true, Usage: "serve TLS next to plain HTTP and send hops over TLS pinned to the peer id (false: plain hops, for a trusted LAN)", EnvVars: cmdEnvVars("run", "hop-tls")},
			&cli.StringSliceFlag{Name: "trust-head", Usage: "peer id of a static-mesh head whose route tickets this node takes (repeatable; the head prints its peer id at start); without it or a --tracker, hops are taken only from loopback", EnvVars: cmdEnvVars("run", "trust-head")},
			&cli.StringSliceFlag{Name: "peer", Usage: "base URL of a node holding later layers (repeatable; NAME=URL also accepted); the head builds its route from their /health", EnvVars: legacyEnvVars("run", "peer")},
			&cli.StringFlag{Name: "route", Usage: `hop list after this node's layers, JSON: [{"endpoint":"http://h:7002","start_layer":3,"end_layer":5}]`, EnvVars: legacyEnvVars("run", "route")},
			&cli.DurationFlag{Name: "hop-timeout", Value: node.DefaultHopTimeout, Usage: "deadline of one hop attempt (a failed hop is retried once)", EnvVars: legacyEnvVars("run", "hop-timeout")},
			&cli.StringFlag{Name: "max-inflight-bytes", Value: formatBytes(node.DefaultMaxInflightBytes), Usage: "activation buffers (pinned on CUDA) held at once for hops; a hop that finds none free before its deadline gets 503", EnvVars: legacyEnvVars("run", "max-inflight-bytes")},
			&cli.IntFlag{Name: "max-sessions", Value: node.DefaultMaxSessions, Usage: "sessions (KV caches) held at once; more get 429", EnvVars: legacyEnvVars("run", "max-sessions")},
			&cli.IntFlag{Name: "max-queue", Value: node.DefaultMaxQueue, Usage: "OpenAI requests that wait (FIFO) when every session slot generates; beyond it 429 with Retry-After (0: none wait)", EnvVars: legacyEnvVars("run", "max-queue")},
			&cli.DurationFlag{Name: "queue-wait", Value: node.DefaultQueueWait, Usage: "longest wait in the queue before 429 with Retry-After (keep it under the tracker's 60 s first-byte wait)", EnvVars: legacyEnvVars("run", "queue-wait")},
			&cli.IntFlag{Name: "max-batch", Value: 8, Usage: "most sessions in one forward call (continuous batching of decode steps and hops; 0: each step alone)", EnvVars: legacyEnvVars("run", "max-batch")},
			&cli.IntFlag{Name: "prefill-chunk", Value: 256, Usage: "most prompt tokens of one session per forward call, so a long prompt does not stall decoding sessions", EnvVars: legacyEnvVars("run", "prefill-chunk")},
			&cli.DurationFlag{Name: "session-ttl", Value: node.DefaultSessionTTL, Usage: "free a session idle for this long", EnvVars: legacyEnvVars("run", "session-ttl")},
			&cli.IntFlag{Name: "max-context", Usage: fmt.Sprintf("tokens per session (0: the model's, at most %d)", engine.DefaultMaxContext), EnvVars: legacyEnvVars("run", "max-context")},
			&cli.StringFlag{Name: "hop-dtype", Value: node.DefaultHopDType, Usage: "activation dtype on hops this head sends: bf16 or f32", EnvVars: legacyEnvVars("run", "hop-dtype")},
			&cli.StringFlag{Name: "speculate", Value: "off", Usage: "speculative decoding on a head: off, ngram (prompt lookup), ngram-tree (prompt lookup with branching drafts) or draft (--draft-model); a request's meshgpu.speculate overrides it", EnvVars: legacyEnvVars("run", "speculate")},
			&cli.StringFlag{Name: "draft-model", Usage: "model directory of the draft model for --speculate draft (same tokenizer and vocabulary; runs on this node's backend)", EnvVars: legacyEnvVars("run", "draft-model")},
			&cli.IntFlag{Name: "speculate-max", Value: node.DefaultSpeculateMax, Usage: "most draft tokens verified in one pass (the length adapts below it)", EnvVars: legacyEnvVars("run", "speculate-max")},
			&cli.IntFlag{Name: "speculate-inflight", Value: node.DefaultSpeculateInFlight, Usage: "most verify passes one stream keeps in flight, each drafted as if the earlier ones are accepted (the count adapts below it to the round time and acceptance; 1: one pass at a time)", EnvVars: cmdEnvVars("run", "speculate-inflight")},
			&cli.StringFlag{Name: "key", Usage: "identity key file (default ~/.meshgpu/node-PORT.key, node-relay.key with --no-listen; created when missing)", EnvVars: legacyEnvVars("run", "key")},
			&cli.StringFlag{Name: "relay", Usage: "relay base URL, ws://host:port: connect outbound and serve hops relayed to this node", EnvVars: legacyEnvVars("run", "relay")},
			&cli.StringFlag{Name: "relay-join-token", Usage: "join token of a private relay", EnvVars: legacyEnvVars("run", "relay-join-token")},
			&cli.StringFlag{Name: "relay-mode", Value: "auto", Usage: "auto (tunnel when offered), tunnel, or rpc (no tunnel: /ws bridge and ADR-0014 /rpc hops)", EnvVars: legacyEnvVars("run", "relay-mode")},
			&cli.BoolFlag{Name: "no-listen", Usage: "open no inbound socket: reachable only through --relay (and by peers the relay introduces, on direct paths)", EnvVars: legacyEnvVars("run", "no-listen")},
			&cli.BoolFlag{Name: "direct-replies", Usage: "have the last node of the routes this node heads send each token straight back here too (N one-way delays a token instead of 2(N-1)): as the head of a static mesh (--peer, --route) its route tickets name this node's endpoint and relay, and every node on the route must run a version that reads ticket version 3; with --tracker the tracker names them on the routes whose nodes all read it, and chain replies elsewhere", EnvVars: cmdEnvVars("run", "direct-replies")},
			&cli.BoolFlag{Name: "direct-paths", Value: true, Usage: "with --relay: punch direct QUIC paths to relay-only peers through NAT, the relay staying the fallback", EnvVars: legacyEnvVars("run", "direct-paths")},
			&cli.StringFlag{Name: "path-listen", Value: ":0", Usage: "UDP address of the direct-path socket", EnvVars: legacyEnvVars("run", "path-listen")},
			&cli.StringFlag{Name: "advertise", Usage: "endpoint the tracker hands out (default: the --listen address; registered as https:// unless --hop-tls=false)", EnvVars: legacyEnvVars("run", "advertise")},
			&cli.StringSliceFlag{Name: "tracker", Usage: "tracker base URL, http://host:port: register and heartbeat (repeatable or a comma list: trackers of one mesh, the next used when one stops answering)", EnvVars: legacyEnvVars("run", "tracker")},
			&cli.StringFlag{Name: "tracker-join-token", Usage: "join token of a private tracker", EnvVars: legacyEnvVars("run", "tracker-join-token")},
			&cli.DurationFlag{Name: "heartbeat-interval", Value: tracker.DefaultHeartbeatInterval, Usage: "tracker heartbeat period", EnvVars: legacyEnvVars("run", "heartbeat-interval")},
			&cli.BoolFlag{Name: "auto", Usage: "ask the tracker which layers to load (needs --tracker; not with --layers)", EnvVars: legacyEnvVars("run", "auto")},
			&cli.StringFlag{Name: "memory-budget", Usage: "memory for weights and KV reserve with --auto, e.g. 20GiB (default: the backend's free memory less 10%)", EnvVars: legacyEnvVars("run", "memory-budget")},
			&cli.DurationFlag{Name: "drain-timeout", Value: daemon.DefaultDrainGrace, Usage: "on SIGTERM/SIGINT: leave the tracker at once, then wait this long for running sessions before stopping (a second signal stops at once)", EnvVars: cmdEnvVars("run", "drain-timeout")},
			&cli.DurationFlag{Name: "move-grace", Value: daemon.DefaultMoveGrace, Usage: "after the tracker moves this node, how long the old layers keep serving their sessions", EnvVars: legacyEnvVars("run", "move-grace")},
		}, append(backendFlags(), append(apiTLSFlags("run", "a head serves its OpenAI API over https too (hops keep their own TLS, pinned to peer ids)"), apiAuthFlags()...)...)...),
		Action: runNode,
	})
}

// runNode is `meshgpu run`: flags, then the model and the node's parts,
// then serving until a signal (draining first) or the node fails.
func runNode(c *cli.Context) error {
	f, err := parseRunFlags(c)
	if err != nil {
		return err
	}
	cfg := f.cfg
	// Bind first: a port in use fails now, in one line, before the key
	// lock, any download and the minutes of loading.
	if !cfg.NoListen {
		if cfg.Listener, err = net.Listen("tcp", cfg.Listen); err != nil {
			return listenError(cfg.Listen, "127.0.0.1:7002", err)
		}
		defer cfg.Listener.Close() // the node owns it once started; closing twice is harmless
	}
	if err := resolveRunModel(c, f.draftDir, &cfg); err != nil {
		return err
	}
	id, releaseKey, err := identity.Acquire(f.keyPath)
	if err != nil {
		return keyError(f.keyPath, c.IsSet("key"), err)
	}
	defer releaseKey()
	cfg.Identity = id
	warnUnreachablePeers(c.Context, cfg.Peers)

	be, err := native.Open(c.String("backend"), f.backend)
	if err != nil {
		return fmt.Errorf("--backend %s: %w", c.String("backend"), err)
	}
	defer be.Close()
	cfg.Backend = be
	if f.draftDir != "" {
		if cfg.DraftModel, err = engine.Load(f.draftDir, engine.Options{Backend: be, Last: -1, MaxContext: cfg.MaxContext}); err != nil {
			return fmt.Errorf("--draft-model: %w", err)
		}
		defer cfg.DraftModel.Close()
	}

	ctx, stop := signal.NotifyContext(c.Context, syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	prog := newProgress("loading " + filepath.Base(filepath.Clean(cfg.ModelDir)))
	cfg.LoadProgress = prog.Update
	n, err := daemon.Start(ctx, cfg)
	prog.Finish()
	if err != nil {
		if ctx.Err() != nil {
			return nil // interrupted during start-up
		}
		return err
	}
	defer n.Close()
	first, last := n.Layers()
	if u := n.URL(); u != "" {
		slog.Info("listening on "+strings.TrimPrefix(u, "http://"), "peer_id", id.PeerID, "head", first == 0,
			"layers", fmt.Sprintf("%d-%d", first, last), "backend", be.Name(), "relay_addr", n.RelayAddr(), "api_tls", cfg.APICertificate != nil)
	} else {
		slog.Info("serving through the relay only", "relay_addr", n.RelayAddr(), "peer_id", id.PeerID, "head", first == 0,
			"layers", fmt.Sprintf("%d-%d", first, last), "backend", be.Name())
	}
	return serveNode(ctx, stop, n, c.Duration("drain-timeout"))
}

// serveNode serves until a signal, then drains for up to grace (a second
// signal ends the drain at once), or until the node fails.
func serveNode(ctx context.Context, stop context.CancelFunc, n *daemon.Node, grace time.Duration) error {
	var runErr error
	select {
	case <-ctx.Done():
		stop()
		slog.Info("shutting down: draining first", "grace", grace)
		dctx, dstop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
		n.Drain(dctx, grace)
		dstop()
	case err := <-n.Err():
		runErr = err
	}
	n.Close()
	return runErr
}

// runFlags are `meshgpu run`'s flags, checked: the node's configuration
// without what needs the model, the key, the backend or the port.
type runFlags struct {
	cfg      daemon.Config
	backend  native.Options
	keyPath  string
	draftDir string
}

// parseRunFlags checks every flag that can be checked alone, so that a
// mistake fails in one line before any bind, download or load.
func parseRunFlags(c *cli.Context) (*runFlags, error) {
	auth, err := apiAuthConfig(c)
	if err != nil {
		return nil, err
	}
	hopDType := strings.ToLower(c.String("hop-dtype"))
	if hopDType != "bf16" && hopDType != "f32" {
		return nil, fmt.Errorf("--hop-dtype must be bf16 or f32, not %q", c.String("hop-dtype"))
	}
	if c.Duration("hop-timeout") <= 0 || c.Duration("session-ttl") <= 0 {
		return nil, errors.New("--hop-timeout and --session-ttl must be positive")
	}
	if c.Int("max-sessions") < 1 || c.Int("max-context") < 0 || c.Int("threads") < 0 {
		return nil, errors.New("--max-sessions must be at least 1; --max-context and --threads must not be negative")
	}
	if c.Int("max-queue") < 0 || c.Duration("queue-wait") <= 0 {
		return nil, errors.New("--max-queue must not be negative and --queue-wait must be positive")
	}
	if c.Int("max-batch") < 0 || c.Int("prefill-chunk") < 1 {
		return nil, errors.New("--max-batch must not be negative (0: no batching) and --prefill-chunk must be at least 1")
	}
	if c.Duration("heartbeat-interval") < 0 || c.Duration("move-grace") < 0 || c.Duration("drain-timeout") < 0 {
		return nil, errors.New("--heartbeat-interval, --move-grace and --drain-timeout must not be negative")
	}
	if c.Bool("no-listen") && (c.IsSet("tls-cert") || c.IsSet("tls-key")) {
		return nil, errors.New("--no-listen serves no API to put TLS on: drop --tls-cert and --tls-key (the relay's own wss:// carries TLS)")
	}
	apiCert, err := apiCertificate(c)
	if err != nil {
		return nil, err
	}
	if f := c.String("chat-template-file"); f != "" {
		// Compile it now: a typo fails before minutes of loading.
		if _, err := chat.LoadFile(f, nil); err != nil {
			return nil, fmt.Errorf("--chat-template-file: %w", err)
		}
	}
	beOpts, err := backendOptions(c)
	if err != nil {
		return nil, err
	}
	spec, specErr := wire.ParseSpeculateMode(strings.ToLower(c.String("speculate")))
	switch {
	case specErr != nil:
		return nil, fmt.Errorf("--%v", specErr)
	case spec == wire.SpeculateDraft && c.String("draft-model") == "":
		return nil, errors.New("--speculate draft needs --draft-model DIR (a model with the same tokenizer)")
	case spec != wire.SpeculateDraft && c.IsSet("draft-model"):
		return nil, errors.New("--draft-model is only used with --speculate draft")
	case c.Int("speculate-max") < 1 || c.Int("speculate-max") > node.MaxSpeculateDrafts:
		return nil, fmt.Errorf("--speculate-max must be 1 to %d", node.MaxSpeculateDrafts)
	case c.Int("speculate-inflight") < 1 || c.Int("speculate-inflight") > node.MaxSpeculateInFlight:
		return nil, fmt.Errorf("--speculate-inflight must be 1 to %d", node.MaxSpeculateInFlight)
	}
	auto := c.Bool("auto")
	switch {
	case auto && len(c.StringSlice("tracker")) == 0:
		return nil, errors.New("--auto needs --tracker URL: the tracker assigns the layers")
	case auto && c.IsSet("layers"):
		return nil, errors.New("--layers is not allowed with --auto: the tracker assigns the layers")
	case !auto && c.IsSet("memory-budget"):
		return nil, errors.New("--memory-budget is only used with --auto")
	case c.Bool("no-listen") && c.String("relay") == "":
		return nil, errors.New("--no-listen needs --relay URL: the node is then reachable only through the relay")
	case c.Bool("no-listen") && (c.IsSet("listen") || c.IsSet("advertise")):
		return nil, errors.New("--no-listen opens no socket: drop --listen and --advertise")
	case len(c.StringSlice("tracker")) > 0 && (len(c.StringSlice("peer")) > 0 || c.IsSet("route")):
		// A static route's tickets are signed by this head, and nodes that
		// joined a tracker take only the tracker's (403 issuer not trusted).
		return nil, fmt.Errorf("--%s is refused with --tracker: the tracker routes this head and signs its routes; drop --%[1]s and send chats to the tracker, or drop --tracker for a static mesh whose peers run with --trust-head", staticFlag(c))
	}
	for _, f := range []string{"relay", "advertise"} {
		if err := checkBaseURL(f, c.String(f)); err != nil {
			return nil, err
		}
	}
	var trackers []string
	for _, u := range c.StringSlice("tracker") {
		if err := checkBaseURL("tracker", u); err != nil {
			return nil, err
		}
		trackers = append(trackers, strings.TrimRight(u, "/"))
	}
	var budget int64
	if s := c.String("memory-budget"); s != "" {
		if budget, err = parseBytes(s); err != nil {
			return nil, fmt.Errorf("--memory-budget: %w", err)
		}
	}
	inflight, err := parseBytes(c.String("max-inflight-bytes"))
	if err != nil || inflight <= 0 {
		return nil, fmt.Errorf("--max-inflight-bytes: want a size such as 1GiB, not %q", c.String("max-inflight-bytes"))
	}
	trustHeads, err := peerIDs("trust-head", c.StringSlice("trust-head"))
	if err != nil {
		return nil, err
	}
	peers, err := peerURLs(c.StringSlice("peer"))
	if err != nil {
		return nil, err
	}
	mode := strings.ToLower(c.String("relay-mode"))
	if mode != daemon.RelayAuto && mode != daemon.RelayTunnel && mode != daemon.RelayRPC {
		return nil, fmt.Errorf("--relay-mode must be auto, tunnel or rpc, not %q", c.String("relay-mode"))
	}
	trackerURL := ""
	if len(trackers) > 0 {
		trackerURL = trackers[0]
	}
	keyPath := c.String("key")
	if keyPath == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return nil, fmt.Errorf("--key: no home directory to keep ~/.meshgpu keys in (%v); pass --key", err)
		}
		keyPath = filepath.Join(home, ".meshgpu", defaultKeyName(c.String("listen"), c.Bool("no-listen")))
	}
	f := &runFlags{backend: beOpts, keyPath: keyPath}
	if spec == wire.SpeculateDraft {
		f.draftDir = c.String("draft-model")
	}
	f.cfg = daemon.Config{
		ChatTemplateFile: c.String("chat-template-file"), Auto: auto, MemoryBudget: budget,
		Listen: c.String("listen"), NoListen: c.Bool("no-listen"), Advertise: c.String("advertise"),
		RelayURL: c.String("relay"), RelayJoinToken: c.String("relay-join-token"), RelayMode: mode,
		NoDirectPaths: !c.Bool("direct-paths"), PathListen: c.String("path-listen"), DirectReplies: c.Bool("direct-replies"),
		TrackerURL: trackerURL, TrackerFallbacks: trackers[min(1, len(trackers)):], TrackerJoinToken: c.String("tracker-join-token"),
		HeartbeatInterval: c.Duration("heartbeat-interval"), MoveGrace: c.Duration("move-grace"),
		Peers: peers, TrustHeads: trustHeads, NoHopTLS: !c.Bool("hop-tls"), HopDType: hopDType,
		MaxSessions: c.Int("max-sessions"), MaxQueue: queueFlag(c.Int("max-queue")), QueueWait: c.Duration("queue-wait"),
		MaxBatch: batchFlag(c.Int("max-batch")), PrefillChunk: c.Int("prefill-chunk"), SessionTTL: c.Duration("session-ttl"), MaxInflightBytes: inflight,
		HopTimeout: c.Duration("hop-timeout"), MaxContext: c.Int("max-context"),
		Speculate: spec, SpeculateMax: c.Int("speculate-max"), SpeculateInFlight: c.Int("speculate-inflight"),
		APIAuth: auth, APICertificate: apiCert, Logger: slog.Default(),
	}
	return f, nil
}

// resolveRunModel finds (or downloads) the model and sets what needs its
// configuration: the directory, the layers, the static route; it checks a
// head's speculation and the draft model's tokenizer against it.
func resolveRunModel(c *cli.Context, draftDir string, cfg *daemon.Config) error {
	// With --auto the tracker picks the layers later: fetch every shard.
	dir, err := modelDir(c.Context, c.String("model"), c.String("layers"))
	if err != nil {
		return err
	}
	mcfg, err := model.LoadConfig(dir)
	if err != nil {
		return fmt.Errorf("--model: %w", err)
	}
	cfg.ModelDir, cfg.First, cfg.Last = dir, 0, mcfg.NumLayers-1
	if s := c.String("layers"); s != "" {
		if cfg.First, cfg.Last, err = model.ParseLayers(s, mcfg.NumLayers); err != nil {
			return fmt.Errorf("--layers: %w", err)
		}
	}
	if cfg.Speculate != wire.SpeculateOff && !cfg.Auto && cfg.First != 0 {
		return fmt.Errorf("--speculate is for a head (its layers start at 0); this node holds layers %d-%d", cfg.First, cfg.Last)
	}
	if draftDir != "" {
		dcfg, err := model.LoadConfig(draftDir)
		if err != nil {
			return fmt.Errorf("--draft-model: %w", err)
		}
		if dcfg.Vocab != mcfg.Vocab {
			return fmt.Errorf("--draft-model %s has a vocabulary of %d tokens, --model's has %d: a draft model needs the same tokenizer", draftDir, dcfg.Vocab, mcfg.Vocab)
		}
	}
	if s := c.String("route"); s != "" {
		if cfg.Route, err = wire.ParseRoute(s, mcfg.NumLayers); err != nil {
			return fmt.Errorf("--route: %w", err)
		}
	}
	return nil
}

// staticFlag names the static-route flag given: peer or route.
func staticFlag(c *cli.Context) string {
	if len(c.StringSlice("peer")) > 0 {
		return "peer"
	}
	return "route"
}

// listenError says what to do about a --listen address that cannot be
// bound; example is a free address to suggest.
func listenError(addr, example string, err error) error {
	if errors.Is(err, syscall.EADDRINUSE) {
		return fmt.Errorf("--listen %s: the address is in use (another meshgpu process?); stop it or pick a free port, e.g. --listen %s", addr, example)
	}
	if errors.Is(err, syscall.EADDRNOTAVAIL) {
		return fmt.Errorf("--listen %s: this machine has no such address; use one of its own, or 0.0.0.0:PORT for all of them", addr)
	}
	return fmt.Errorf("--listen %s: %w", addr, err)
}

// keyError says what to do about an identity key that cannot be taken.
func keyError(path string, explicit bool, err error) error {
	if !errors.Is(err, identity.ErrInUse) {
		return fmt.Errorf("--key %s: %w", path, err)
	}
	if explicit {
		return fmt.Errorf("--key %s is in use by another meshgpu process on this machine: stop it, or give this node its own --key file", path)
	}
	return fmt.Errorf("the default key %s is in use by another meshgpu process (the default key is per --listen port, and the relay-only node's is shared): stop that process, or pass --key with a file of this node's own", path)
}

// warnUnreachablePeers asks each --peer for /health (2 s each, all at once)
// and logs the ones that do not answer: a typo would otherwise show only at
// the first request.
func warnUnreachablePeers(ctx context.Context, peers []string) {
	if len(peers) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	hc := &http.Client{Transport: &http.Transport{}}
	defer hc.CloseIdleConnections()
	var wg sync.WaitGroup
	for _, p := range peers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, p+"/health", nil)
			if err != nil {
				return
			}
			resp, err := hc.Do(req)
			if err != nil {
				slog.Warn("--peer does not answer; requests that need its layers will fail until it does", "peer", p, "err", err)
				return
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				slog.Warn("--peer answers /health with an error", "peer", p, "status", resp.StatusCode)
			}
		}()
	}
	wg.Wait()
}

// checkBaseURL checks an optional scheme://host[:port] flag; the error
// shows the value as it should have been written.
func checkBaseURL(flag, v string) error {
	if v == "" {
		return nil
	}
	scheme, schemes := "http", "http or https"
	if flag == "relay" {
		scheme, schemes = "ws", "ws, wss, http or https"
	}
	u, err := url.Parse(v)
	okScheme := err == nil && (u.Scheme == "http" || u.Scheme == "https")
	if flag == "relay" {
		okScheme = okScheme || (err == nil && (u.Scheme == "ws" || u.Scheme == "wss"))
	}
	switch {
	case !strings.Contains(v, "://"):
		return fmt.Errorf("--%s %q has no scheme: write --%s %s://%s", flag, v, flag, scheme, strings.TrimRight(v, "/"))
	case err != nil || !okScheme:
		return fmt.Errorf("--%s %q: the scheme must be %s, e.g. --%s %s://127.0.0.1:7000", flag, v, schemes, flag, scheme)
	case u.Host == "" || (u.Path != "" && u.Path != "/"):
		return fmt.Errorf("--%s %q: want a base URL with no path, e.g. --%s %s://%s", flag, v, flag, u.Scheme, cmpOr(u.Host, "127.0.0.1:7000"))
	}
	return nil
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// parseBytes reads a byte count: 1048576, 512MiB, 20GiB, 1.5GB, 800M.
func parseBytes(s string) (int64, error) {
	t := strings.TrimSpace(s)
	i := strings.IndexFunc(t, func(r rune) bool { return (r < '0' || r > '9') && r != '.' })
	num, unit := t, ""
	if i >= 0 {
		num, unit = t[:i], strings.ToLower(strings.TrimSpace(t[i:]))
	}
	v, err := strconv.ParseFloat(num, 64)
	mult, ok := map[string]float64{"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 1e3, "m": 1 << 20, "mib": 1 << 20, "mb": 1e6,
		"g": 1 << 30, "gib": 1 << 30, "gb": 1e9, "t": 1 << 40, "tib": 1 << 40, "tb": 1e12}[unit]
	if err != nil || !ok || v <= 0 || v*mult >= math.MaxInt64 {
		return 0, fmt.Errorf("%q: want a positive size like 20GiB, 512MiB or 1073741824", s)
	}
	return int64(v * mult), nil
}

// formatBytes writes n the way parseBytes reads it, in the largest binary
// unit that divides it.
func formatBytes(n int64) string {
	for _, u := range []struct {
		name  string
		shift uint
	}{{"TiB", 40}, {"GiB", 30}, {"MiB", 20}, {"KiB", 10}} {
		if n > 0 && n%(1<<u.shift) == 0 {
			return strconv.FormatInt(n>>u.shift, 10) + u.name
		}
	}
	return strconv.FormatInt(n, 10)
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

// defaultKeyName gives each node on a machine its own identity by default:
// one key per listen port (node-7001.key), node-relay.key for a node that
// listens nowhere. A key is locked while a node uses it.
func defaultKeyName(listen string, noListen bool) string {
	if noListen {
		return "node-relay.key"
	}
	if _, port, err := net.SplitHostPort(listen); err == nil && port != "" && port != "0" {
		return "node-" + port + ".key"
	}
	return "node.key"
}

// peerIDs checks a list of peer ids ("mg-" and 32 base32 characters).
func peerIDs(flag string, ids []string) ([]string, error) {
	var out []string
	for _, v := range ids {
		for _, id := range strings.Split(v, ",") {
			id = strings.TrimSpace(id)
			if id == "" {
				continue
			}
			if !strings.HasPrefix(id, identity.PeerIDPrefix) || len(id) != len(identity.PeerIDPrefix)+32 {
				return nil, fmt.Errorf("--%s %q: want a peer id such as mg-abcdefghijklmnopqrstuvwxyz234567 (the head's log shows it)", flag, id)
			}
			out = append(out, id)
		}
	}
	return out, nil
}

// queueFlag maps --max-queue to node.Server.MaxQueue, whose 0 is the default.
func queueFlag(n int) int {
	if n == 0 {
		return -1 // no queue
	}
	return n
}

// batchFlag maps --max-batch to node.Server.MaxBatch, whose 0 is the default.
func batchFlag(n int) int {
	if n == 0 {
		return -1 // each step alone
	}
	return n
}

// Package node is the mesh node: the hop server (hop frames over GET /hop
// and the relay tunnel, and POST /forward for older peers), per-session KV
// caches, and on a head node (one that holds layer 0) the OpenAI API and
// the pipeline driver that sends every token through the remaining hops.
// Wire format: docs/protocol.md; types and frame layouts: package wire.
package node

import (
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"meshgpu/engine"
	"meshgpu/identity"
	"meshgpu/internal/apiauth"
	"meshgpu/internal/latency"
	"meshgpu/native"
	"meshgpu/wire"
)

// Defaults of the Server's limits; `meshgpu run`'s flags default to them.
const (
	DefaultListen           = "127.0.0.1:7001" // `meshgpu run --listen`
	DefaultHopDType         = "bf16"
	DefaultMaxSessions      = 64
	DefaultSessionTTL       = 10 * time.Minute
	DefaultMaxBodyBytes     = 64 << 20
	DefaultHopTimeout       = 30 * time.Second
	DefaultMaxRequestBytes  = 4 << 20
	DefaultMaxInflightBytes = 1 << 30
	DefaultMaxQueue         = 1024
	DefaultQueueWait        = 30 * time.Second
)

// RelayDoer sends a hop through a relay (relay.Client implements it).
type RelayDoer interface {
	Do(ctx context.Context, relayAddr string, req *http.Request) (*http.Response, error)
}

// Server serves one shard of a model. The zero value of every field but
// Model is sensible; set fields before the first call to Handler and do not
// change them afterwards.
type Server struct {
	Model   *engine.Model
	Backend native.Backend // for /health's backend and free_memory; optional
	PeerID  string
	// Identity signs the answer to a tracker's identity challenge
	// (GET /identity); nil: the node cannot prove who it is.
	Identity *identity.Identity
	// ModelName is the id in /health and /v1/models; default: base name of Model.Dir.
	ModelName string
	// Variant is the weights this node holds (model.VariantOf), shown in
	// /v1/models; zero: not shown.
	Variant wire.Variant

	// Route is the hop list after the head's layers (--route). When empty,
	// Peers (base URLs, --peer) are asked for /health and the route is
	// built from them on first use. X-Meshnet-Route on a request wins.
	Route []wire.Hop
	Peers []string
	// TicketIssuers returns the keys whose route tickets this node takes
	// (its trackers', learned over the --tracker connection); TrustedHeads
	// are peer ids of heads whose tickets for their own sessions it takes
	// (--trust-head). With neither, hops are taken only from loopback
	// (node/tickets.go).
	TicketIssuers func() []ed25519.PublicKey
	TrustedHeads  []string
	// RefreshIssuers asks the tracker for its list again (at most once a
	// second), when a ticket's issuer is not in it; nil: never.
	RefreshIssuers func(context.Context)
	// HopDType is the dtype of activations the head sends: "bf16" (DefaultHopDType) or "f32".
	HopDType string
	// Speculate is the head's speculative decoding (off by default): ngram
	// drafts by prompt lookup, draft with DraftModel (a whole model with the
	// same vocabulary, on the head's backend). A request's
	// "meshgpu":{"speculate":...} overrides it. SpeculateMax bounds the
	// drafts of one pass (default DefaultSpeculateMax).
	Speculate    wire.SpeculateMode
	DraftModel   *engine.Model
	SpeculateMax int
	// SpeculateInFlight bounds the verify passes one stream keeps in
	// flight (node/inflight.go; default DefaultSpeculateInFlight, at most
	// MaxSpeculateInFlight); 1 sends each pass after the last returned.
	SpeculateInFlight int
	// inFlightFixed (tests) keeps exactly this many passes in flight.
	inFlightFixed int

	MaxSessions int // DefaultMaxSessions when 0; more gets 429
	// MaxQueue is how many OpenAI requests may wait for one of the head's
	// MaxSessions generation slots (FIFO); DefaultMaxQueue when 0, none
	// when negative. A request beyond it, or one that waited QueueWait
	// (DefaultQueueWait when 0), gets 429 with Retry-After. The tracker
	// waits 60 s for a head's first byte: keep QueueWait below it.
	MaxQueue  int
	QueueWait time.Duration
	// MaxBatch is the most sessions one forward call of this node's
	// scheduler runs (continuous batching, package sched); default 8,
	// negative: no scheduler, each step alone. PrefillChunk is the most
	// prompt rows of one session per call (default 256).
	MaxBatch        int
	PrefillChunk    int
	SessionTTL      time.Duration // idle sessions are freed after it; DefaultSessionTTL when 0
	MaxBodyBytes    int64         // hop body limit, DefaultMaxBodyBytes when 0; more gets 413
	HopTimeout      time.Duration // one attempt of one hop, downstream included; DefaultHopTimeout when 0
	MaxContext      int           // tokens per session; default and cap: the stack's (engine.DefaultMaxContext when it has none)
	MaxRequestBytes int64         // OpenAI request body limit; DefaultMaxRequestBytes when 0
	// MaxInflightHops bounds hops served at once, POST /forward and hop
	// frames together (each may hold a body buffer); more get 429.
	// Default (DefaultSpeculateInFlight+1)×MaxSessions+8: a session's
	// passes in flight are served (or wait their turn) at once.
	MaxInflightHops int
	// MaxInflightBytes bounds the host memory of activation buffers (hop
	// bodies and the head's per-step buffers), lent and kept for reuse,
	// counted in power-of-two size classes of at least 4 KiB. They come
	// from Backend.AllocHost (pinned on CUDA; Go memory when Backend is
	// nil). A hop that finds no room before its deadline gets 503 "busy";
	// one that could never fit gets 413. DefaultMaxInflightBytes when 0.
	MaxInflightBytes int64

	Logger   *slog.Logger
	Registry *prometheus.Registry // nil: a new one, served on /metrics
	Relay    RelayDoer            // nil: hops with only a relay_addr fail
	// Direct, when set (and started), moves hops to relay-only peers onto
	// direct QUIC paths once punched, the relay staying the fallback
	// (node/directpath.go), and answers peers' punch offers.
	Direct *DirectPaths
	// APIAuth guards the head's OpenAI endpoints (API keys, CORS); zero: open.
	APIAuth apiauth.Config
	// HTTPClient sends direct POST /forward hops (and lends its TLS
	// settings and dialer to hop connections); nil: a keep-alive client
	// owned by the server.
	HTTPClient *http.Client
	// ReplyEndpoint and ReplyRelay are how the route's last node reaches
	// this head (its --advertise URL, its relay address): the tickets it
	// signs name them, and the tail then sends each answer straight here
	// as well as back along the chain (node/directreply.go). They make the
	// tickets version 3, which nodes before it refuse: leave both empty
	// while the route has such nodes. NoDirectReplies turns direct replies
	// off both ways (a head waits for chain answers only, a tail sends none).
	ReplyEndpoint   string
	ReplyRelay      string
	NoDirectReplies bool
	// DisableHopFrames makes the node speak protocol version 1 only: it
	// neither serves GET /hop nor sends hop frames (POST /forward both ways).
	DisableHopFrames bool
	// NoHopTLS sends hops in the clear (--hop-tls=false, a LAN); by
	// default a hop to a peer id goes over TLS pinned to it where the peer
	// serves TLS (node/hoptls.go).
	NoHopTLS bool

	// SampleOnHost samples every token in Go from the logits the backend
	// hands over, as with a backend without the ends (native.Ends), rather
	// than in the backend (node/backendsample.go): for comparing the two.
	SampleOnHost bool

	// StackForTesting replaces Model.Stack on the hop path so tests and
	// benchmarks can measure the protocol without compute. Never set it in
	// production: the server then has no tokenizer and no OpenAI API.
	StackForTesting native.Stack

	once      sync.Once
	initErr   error
	handler   http.Handler
	stack     native.Stack
	cfg       native.StackConfig
	sessions  *sessionTable
	metrics   *metrics
	client    *http.Client
	transport *http.Transport
	started   time.Time
	stop      chan struct{}
	wg        sync.WaitGroup
	closeOnce sync.Once
	held      hold // Hold, Release, Drain (node/shards.go)
	bgMu      sync.Mutex
	bgClosed  bool
	bg        sync.WaitGroup // background's goroutines

	inflight    chan struct{} // one slot per running hop handler
	admit       *admission    // the head's generation slots and their queue
	batch       batchers      // the stack's one scheduler
	hosts       *hostPool     // activation buffers, bounded by MaxInflightBytes
	routeMu     sync.Mutex
	cachedRoute []wire.Hop
	peers       *hopPeers     // hop connections to peers (nil: POST /forward only)
	replies     replyWaiters  // the head's passes waiting for direct replies
	replyPushes chan struct{} // a slot per direct reply the tail is sending
	hopConns    HopConns      // served hop connections
	constraints constraints   // response_format: vocabulary trie and schemas
	refreshMu   sync.Mutex
	refreshed   time.Time // the last RefreshIssuers
}

func (s *Server) init() {
	if s.StackForTesting != nil {
		s.stack = s.StackForTesting
	} else if s.Model != nil && s.Model.Stack != nil {
		s.stack = s.Model.Stack
	} else {
		s.initErr = errors.New("node.Server needs a Model with a Stack")
	}
	if s.initErr == nil {
		s.initErr = s.checkSpeculation()
	}
	if s.initErr != nil {
		s.handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			writeError(w, &apiError{Status: 503, Type: "not_ready", Message: s.initErr.Error()})
		})
		return
	}
	s.cfg = s.stack.Config()
	if s.Logger == nil {
		s.Logger = slog.Default()
	}
	if s.MaxSessions <= 0 {
		s.MaxSessions = DefaultMaxSessions
	}
	if s.SessionTTL <= 0 {
		s.SessionTTL = DefaultSessionTTL
	}
	if s.MaxBodyBytes <= 0 {
		s.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if s.HopTimeout <= 0 {
		s.HopTimeout = DefaultHopTimeout
	}
	if s.MaxInflightHops <= 0 {
		s.MaxInflightHops = (DefaultSpeculateInFlight+1)*s.MaxSessions + 8
	}
	s.inflight = make(chan struct{}, s.MaxInflightHops)
	if s.MaxQueue == 0 {
		s.MaxQueue = DefaultMaxQueue
	}
	if s.QueueWait <= 0 {
		s.QueueWait = DefaultQueueWait
	}
	s.admit = newAdmission(s.MaxSessions, s.MaxQueue, s.QueueWait)
	if s.MaxInflightBytes <= 0 {
		s.MaxInflightBytes = DefaultMaxInflightBytes
	}
	s.hosts = newHostPool(s.Backend, s.MaxInflightBytes)
	if s.MaxRequestBytes <= 0 {
		s.MaxRequestBytes = DefaultMaxRequestBytes
	}
	if s.MaxContext <= 0 || (s.cfg.MaxContext > 0 && s.MaxContext > s.cfg.MaxContext) {
		s.MaxContext = s.cfg.MaxContext
	}
	if s.MaxContext <= 0 {
		s.MaxContext = engine.DefaultMaxContext
	}
	if s.ModelName == "" && s.Model != nil {
		s.ModelName = filepath.Base(s.Model.Dir)
	}
	if s.Registry == nil {
		s.Registry = prometheus.NewRegistry()
	}
	if s.HTTPClient != nil {
		s.client = s.HTTPClient
		if t, ok := s.HTTPClient.Transport.(*http.Transport); ok {
			c := *s.HTTPClient
			c.Transport = &identity.PinnedTransport{Base: t}
			s.client = &c
		}
	} else {
		s.transport = &http.Transport{
			DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConns:        256,
			MaxIdleConnsPerHost: 64,
			IdleConnTimeout:     90 * time.Second,
			DisableCompression:  true, // activations do not compress; gzip costs latency
			ForceAttemptHTTP2:   false,
		}
		// A hop is never redirected: re-sending activations (and the
		// route) wherever a node points would let it aim our hops anywhere.
		// https peers are reached pinned to the peer id of the hop.
		s.client = &http.Client{Transport: &identity.PinnedTransport{Base: s.transport},
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	}
	s.sessions = newSessionTable(s.MaxSessions, s.SessionTTL, s.MaxContext, s.stack.NewSession)
	s.metrics = newMetrics(s.Registry, func() float64 { return float64(s.sessions.len()) })
	s.metrics.registerHostPool(s.Registry, s.hosts)
	if s.Direct != nil {
		for _, c := range s.Direct.Collectors() {
			s.Registry.Register(c) // a second shard of one node shares them
		}
	}
	s.started = time.Now()
	s.stop = make(chan struct{})
	s.wg.Add(1)
	go s.reaper()

	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", s.handleHealth)
	mux.HandleFunc("GET /ready", s.handleReady)
	mux.HandleFunc("GET "+identity.ProofPath, s.handleIdentity)
	mux.HandleFunc("GET /stats", s.handleStats)
	mux.Handle("GET /metrics", promhttp.HandlerFor(s.Registry, promhttp.HandlerOpts{}))
	mux.HandleFunc("POST /forward", s.handleForward)
	mux.HandleFunc("POST "+wire.DirectReplyPath, s.handleDirectReply)
	s.replyPushes = make(chan struct{}, maxReplyPushes)
	if !s.DisableHopFrames {
		s.peers = newHopPeers(s.Logger, s.tlsConfig)
		if !s.NoHopTLS {
			s.peers.pin = pinnedTLS
		}
		if s.HTTPClient != nil {
			if t, ok := s.HTTPClient.Transport.(*http.Transport); ok {
				s.peers.dialFn = t.DialContext // e.g. a benchmark's emulated WAN link
			}
		}
		mux.HandleFunc("GET "+wire.HopPath, func(w http.ResponseWriter, r *http.Request) { s.hopConns.Serve(w, r, s, s.Logger) })
		mux.Handle(wire.HopPath, methodNotAllowed("GET"))
	}
	mux.HandleFunc("DELETE /sessions/{id}", s.handleDeleteSession)
	if s.Direct != nil && !s.DisableHopFrames {
		mux.Handle("POST "+wire.PunchPath, s.Direct)
	}
	if s.isHead() {
		mux.HandleFunc("POST /v1/completions", s.handleCompletions)
		mux.HandleFunc("POST /v1/chat/completions", s.handleChatCompletions)
		mux.HandleFunc("GET /v1/models", s.handleModels)
		mux.HandleFunc("GET /v1/models/{id...}", s.handleModel)
	}
	for path, allow := range map[string]string{"/forward": "POST", "/sessions/{id}": "DELETE", "/health": "GET", "/ready": "GET", "/stats": "GET", "/metrics": "GET"} {
		mux.Handle(path, methodNotAllowed(allow))
	}
	if s.isHead() {
		for path, allow := range map[string]string{"/v1/completions": "POST", "/v1/chat/completions": "POST", "/v1/models": "GET"} {
			mux.Handle(path, methodNotAllowed(allow))
		}
	}
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, &apiError{Status: http.StatusNotFound, Type: "not_found",
			Message: fmt.Sprintf("no route %s %s on this node", r.Method, r.URL.Path)})
	})
	s.handler = apiauth.Middleware(s.APIAuth, mux)
}

func methodNotAllowed(allow string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Allow", allow)
		writeError(w, &apiError{Status: http.StatusMethodNotAllowed, Type: "method_not_allowed",
			Message: fmt.Sprintf("%s %s: use %s", r.Method, r.URL.Path, allow)})
	})
}

// isHead: holds layer 0 with embeddings and has a tokenizer to serve OpenAI.
func (s *Server) isHead() bool {
	return s.cfg.First == 0 && s.cfg.HasEmbed && s.Model != nil && s.Model.Tokenizer != nil && s.StackForTesting == nil
}

// Handler returns the node's HTTP API. The relay bridge serves the same
// handler for relayed hops.
func (s *Server) Handler() http.Handler {
	s.once.Do(s.init)
	return s.handler
}

// Close stops the reaper, frees every session, idle connection and host
// buffer (one still lent to a running hop is freed when it comes back). It
// does not close the Model or the Backend.
func (s *Server) Close() error {
	s.once.Do(s.init)
	if s.initErr != nil {
		return nil
	}
	s.closeOnce.Do(func() {
		close(s.stop)
		s.wg.Wait()
		s.bgMu.Lock()
		s.bgClosed = true
		s.bgMu.Unlock()
		s.bg.Wait()
		if s.peers != nil {
			s.peers.close()
		}
		s.hopConns.Close()
		s.closeBatchers()
		s.sessions.closeAll()
		s.hosts.close()
		if s.transport != nil {
			s.transport.CloseIdleConnections()
		}
	})
	return nil
}

// background runs f, which must end on its own deadline, on a goroutine
// that Close waits for; once the server is closing it runs f in the caller.
func (s *Server) background(f func()) {
	s.bgMu.Lock()
	defer s.bgMu.Unlock()
	if s.bgClosed {
		f()
		return
	}
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		f()
	}()
}

func (s *Server) reaper() {
	defer s.wg.Done()
	every := s.SessionTTL / 4
	if every < 100*time.Millisecond {
		every = 100 * time.Millisecond
	}
	if every > 30*time.Second {
		every = 30 * time.Second
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
			if n := s.sessions.reap(); n > 0 {
				s.Logger.Info("freed idle sessions", "count", n, "ttl", s.SessionTTL)
			}
		}
	}
}

// Health is GET /health.
type Health struct {
	PeerID     string `json:"peer_id"`
	Model      string `json:"model"`
	Layers     [2]int `json:"layers"`
	NumLayers  int    `json:"num_layers"`
	Backend    string `json:"backend"`
	FreeMemory uint64 `json:"free_memory"`
	Sessions   int    `json:"sessions"`
	Hidden     int    `json:"hidden"`
}

func (s *Server) health() Health {
	h := Health{PeerID: s.PeerID, Model: s.ModelName, Layers: [2]int{s.cfg.First, s.cfg.Last},
		NumLayers: s.cfg.NumLayers, Sessions: s.sessions.len(), Hidden: s.cfg.Hidden}
	if s.Backend != nil {
		h.Backend = s.Backend.Name()
		if free, _, err := s.Backend.Memory(); err == nil {
			h.FreeMemory = free
		}
	}
	return h
}

func (s *Server) handleHealth(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, s.health())
}

// handleReady is the readiness probe (GET /ready): 200 when this node can
// serve, 503 with the reason when not. /health stays the liveness probe
// (200 while the process serves hops), as peers read it for the layers.
// A head is ready when it has a route for the layers it does not hold:
// --route, or --peer nodes that cover them. A head that relies on the
// tracker's X-Meshnet-Route has none of its own and reports not ready for
// direct clients; the tracker's /health and /v1/models say what it covers.
func (s *Server) handleReady(w http.ResponseWriter, r *http.Request) {
	if s.isHead() {
		// within a Kubernetes probe's default 1 s timeout
		ctx, cancel := context.WithTimeout(r.Context(), 900*time.Millisecond)
		defer cancel()
		if _, _, ae := s.planRoute(ctx, http.Header{}); ae != nil {
			writeError(w, &apiError{Status: http.StatusServiceUnavailable, Type: "not_ready", Message: ae.Message})
			return
		}
	}
	writeJSON(w, http.StatusOK, map[string]any{"status": "ready", "model": s.ModelName, "layers": [2]int{s.cfg.First, s.cfg.Last}})
}

// Stats returns the counters of /stats (for heartbeats).
func (s *Server) Stats() Stats {
	s.once.Do(s.init)
	if s.initErr != nil {
		return Stats{PeerID: s.PeerID}
	}
	st := Stats{PeerID: s.PeerID, UptimeSeconds: time.Since(s.started).Seconds(), Sessions: s.sessions.len(),
		HopsOK: s.metrics.hopsOK.Load(), HopsFailed: s.metrics.hopsErr.Load(),
		TokensGenerated: s.metrics.tokensN.Load(), Requests: s.metrics.requestsN.Load(),
		SpecDrafted: s.metrics.specDraftedN.Load(), SpecAccepted: s.metrics.specAcceptedN.Load(), SpecPasses: s.metrics.specPassesN.Load(),
		DirectReplies: s.metrics.directN.Load(), DirectChainFirst: s.metrics.chainFirstN.Load(),
		Running: int(s.admit.running.Load()), Queued: int(s.admit.queued.Load()), HopsInFlight: len(s.inflight)}
	hop50, hop99 := s.metrics.hopWindow.Percentiles()
	comp50, comp99 := s.metrics.compWindow.Percentiles()
	st.HopP50Ms, st.HopP99Ms = latency.Millis(hop50), latency.Millis(hop99)
	st.ComputeP50Ms, st.ComputeP99Ms = latency.Millis(comp50), latency.Millis(comp99)
	return st
}

func (s *Server) handleStats(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, s.Stats())
}

func (s *Server) handleDeleteSession(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if !wire.ValidSessionID(id) {
		writeError(w, &apiError{Status: 400, Type: "invalid_session", Message: "session id must be 1-128 characters of [A-Za-z0-9._:-]"})
		return
	}
	if ae := s.authorizeDelete(r, id); ae != nil {
		writeError(w, ae)
		return
	}
	if !s.sessions.remove(id) {
		writeError(w, &apiError{Status: http.StatusNotFound, Type: "unknown_session", Message: fmt.Sprintf("session %q is not on this node", id)})
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"deleted": id})
}

// shardInfo is this node's range and limits for hop validation.
func (s *Server) shardInfo() shardInfo {
	return shardInfo{first: s.cfg.First, last: s.cfg.Last, numLayers: s.cfg.NumLayers,
		hidden: s.cfg.Hidden, hasHead: s.cfg.HasHead, maxContext: s.MaxContext}
}

// hopDType is the dtype the head sends on hops.
func (s *Server) hopDType() native.DType {
	if s.HopDType == "f32" {
		return native.F32
	}
	return native.BF16
}

// hostBuffer lends n bytes of activation buffer from the node's host pool,
// waiting until deadline at most.
func (s *Server) hostBuffer(ctx context.Context, n int, deadline time.Time) (*hostBuf, *apiError) {
	if b := s.hosts.tryGet(n); b != nil { // most hops: no wait, so no timer
		return b, nil
	}
	wctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	b, err := s.hosts.get(wctx, n)
	switch {
	case err == nil:
		return b, nil
	case errors.Is(err, errPoolLimit):
		return nil, &apiError{Status: http.StatusRequestEntityTooLarge, Type: "body_too_large",
			Message: fmt.Sprintf("activations of %d bytes do not fit this node's host buffer limit of %d bytes", n, s.MaxInflightBytes)}
	case errors.Is(err, errPoolClosed):
		return nil, &apiError{Status: http.StatusServiceUnavailable, Type: "shutting_down", Message: "this node is shutting down"}
	case errors.Is(ctx.Err(), context.Canceled):
		return nil, &apiError{Status: 499, Type: "canceled", Message: "request canceled while waiting for a host buffer"}
	case errors.Is(err, context.DeadlineExceeded):
		allocated, lent := s.hosts.usage()
		return nil, &apiError{Status: http.StatusServiceUnavailable, Type: "busy",
			Message: fmt.Sprintf("no host buffer of %d bytes came free in time (%d of %d bytes lent, %d allocated); retry later", n, lent, s.MaxInflightBytes, allocated)}
	}
	return nil, &apiError{Status: http.StatusServiceUnavailable, Type: "busy", Message: err.Error()}
}

// HasSession reports whether this server holds session id (a node swapping
// in a new layer range keeps routing that session's hops to the old one).
func (s *Server) HasSession(id string) bool {
	s.once.Do(s.init)
	if s.initErr != nil {
		return false
	}
	s.sessions.mu.Lock()
	defer s.sessions.mu.Unlock()
	_, ok := s.sessions.m[id]
	return ok
}

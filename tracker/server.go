package tracker

import (
	"context"
	"crypto/ed25519"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"meshgpu/internal/apiauth"
	"meshgpu/internal/bodydeadline"
	"meshgpu/internal/buildinfo"
	"meshgpu/openai"
	"meshgpu/tracker/page"
	"meshgpu/tracker/route"
	"meshgpu/wire"
)

// RelayDoer sends a request to a relay-only node (relay.Client fits).
type RelayDoer interface {
	Do(ctx context.Context, relayAddr string, req *http.Request) (*http.Response, error)
}

// Defaults of the tracker's settings; `meshgpu tracker`'s flags default to them.
const (
	DefaultListen            = "127.0.0.1:7100" // `meshgpu tracker --listen`
	DefaultHeartbeatTimeout  = 15 * time.Second
	DefaultHeartbeatInterval = 5 * time.Second // the Announcer's; a third of DefaultHeartbeatTimeout
	DefaultMaxClockSkew      = 2 * time.Minute
	DefaultMaxAttempts       = 4
	DefaultBanDuration       = 30 * time.Second
	DefaultFirstByte         = 60 * time.Second
	DefaultTokenTimeout      = 30 * time.Second
	DefaultBusyWait          = 30 * time.Second
	DefaultBusyBackoffMax    = time.Minute
	DefaultMaxBodyBytes      = 4 << 20
	DefaultPageRefresh       = 2 * time.Second // the mesh page's polling period
)

// Config configures a Server. The zero value works: in-memory store,
// DefaultHeartbeatTimeout, default cost model, no relay.
type Config struct {
	Store Store // default: a MemStore listing Self
	// Self is this tracker as its store publishes it to nodes (identity
	// and URL); optional.
	Self             TrackerInfo
	HeartbeatTimeout time.Duration    // DefaultHeartbeatTimeout when 0
	MaxClockSkew     time.Duration    // accepted signed-timestamp age, DefaultMaxClockSkew when 0
	Clock            func() time.Time // default time.Now
	Logger           *slog.Logger     // default slog.Default()
	Route            route.Config
	// JoinToken, when set, is required in registrations and assignment
	// requests (heartbeats need a registration first).
	JoinToken string
	// PageRefresh is how often the mesh page at GET / polls (default 2s).
	PageRefresh time.Duration
	// InflightRPM is the load one proxied generation adds to each node of
	// its route until heartbeats report it (hops/min, default 600).
	InflightRPM float64

	// Proxy settings.
	HTTPClient   *http.Client  // to heads; default: a client without overall timeout
	Relay        RelayDoer     // for relay-only heads; nil: a route whose head is relay-only fails and that head is banned for a while
	MaxAttempts  int           // routes tried per request, DefaultMaxAttempts when 0
	BanDuration  time.Duration // DefaultBanDuration when 0
	FirstByte    time.Duration // wait for the head's response headers, DefaultFirstByte when 0
	TokenTimeout time.Duration // longest gap between stream events, DefaultTokenTimeout when 0
	// BusyWait bounds the time one generation spends waiting out
	// back-pressure (429, 503 busy: a full queue, a relay's limit) before
	// the client gets the 429; DefaultBusyWait when 0. Busy is never a ban.
	BusyWait     time.Duration
	MaxBodyBytes int64 // client request bodies, DefaultMaxBodyBytes when 0
	// BusyBackoffMax caps how long a node that keeps answering busy
	// without finishing a generation is avoided (tracker/busy.go);
	// DefaultBusyBackoffMax when 0.
	BusyBackoffMax time.Duration

	// APIAuth guards the OpenAI endpoints (API keys, CORS); zero: open.
	APIAuth apiauth.Config

	// TicketKey signs the route ticket of every proxied session; nodes
	// trust its public key, Self.PublicKey, which they learn from the
	// trackers list of their heartbeat answers. Nil: a key made at start
	// (a one-tracker mesh; Self.PublicKey is set to it when empty).
	TicketKey ed25519.PrivateKey
	// TicketTTL is a ticket's lifetime, DefaultTicketTTL when 0.
	TicketTTL time.Duration
	// BodyTimeout bounds the arrival of any request body (then 408 and the
	// connection is closed); bodydeadline.Default when 0.
	BodyTimeout time.Duration

	// Admission of registrants (docs/security.md).
	// Endpoints is which addresses they may name (zero: public only).
	Endpoints AddrPolicy
	// SkipEndpointCheck turns the identity challenge off: registrations
	// are then routed to without the endpoint proving who answers there
	// (tests with fake nodes only).
	SkipEndpointCheck bool
	// ChallengeTimeout bounds one identity challenge (DefaultChallengeTimeout when 0).
	ChallengeTimeout time.Duration
	// RegisterPerIP/RegisterIPBurst limit registrations and assignment
	// requests per source address, RegisterPerKey/RegisterKeyBurst
	// registrations per peer id (per second; defaults when 0). The limits
	// are this process's: each tracker of a mesh limits what reaches it.
	RegisterPerIP    float64
	RegisterIPBurst  int
	RegisterPerKey   float64
	RegisterKeyBurst int

	// Limits caps the nodes, models and layers registrations may add
	// (tracker/limits.go); zero fields: defaults.
	Limits Limits

	// Audit configures audits of nodes' work (tracker/audit.go); zero: off.
	Audit AuditConfig
}

// Server is the tracker's HTTP API.
type Server struct {
	cfg    Config
	reg    *Registry
	log    *slog.Logger
	ipRate *limiter // registrations and assignments per source address

	seq atomic.Uint64 // per-request route seeds and ids

	metrics   *prometheus.Registry
	requests  *prometheus.CounterVec
	routeTime prometheus.Histogram
	failovers prometheus.Counter
	busy      prometheus.Counter
	proxied   *prometheus.CounterVec

	audit *auditor // nil when audits are off
	// backoff avoids nodes that answer busy without progress (busy.go).
	backoff *busyBackoff
}

// NewServer builds a server from cfg.
func NewServer(cfg Config) *Server {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	if cfg.HTTPClient == nil {
		// Heads are reached only at admitted addresses, checked at connect
		// time too (a name may resolve elsewhere since it registered).
		cfg.HTTPClient = cfg.Endpoints.HTTPClient(0)
	}
	if cfg.ChallengeTimeout <= 0 {
		cfg.ChallengeTimeout = DefaultChallengeTimeout
	}
	if cfg.RegisterPerIP <= 0 {
		cfg.RegisterPerIP = DefaultRegisterPerIP
	}
	if cfg.RegisterIPBurst <= 0 {
		cfg.RegisterIPBurst = DefaultRegisterIPBurst
	}
	if cfg.RegisterPerKey <= 0 {
		cfg.RegisterPerKey = DefaultRegisterPerKey
	}
	if cfg.RegisterKeyBurst <= 0 {
		cfg.RegisterKeyBurst = DefaultRegisterKeyBurst
	}
	if cfg.MaxAttempts <= 0 {
		cfg.MaxAttempts = DefaultMaxAttempts
	}
	if cfg.BanDuration <= 0 {
		cfg.BanDuration = DefaultBanDuration
	}
	if cfg.FirstByte <= 0 {
		cfg.FirstByte = DefaultFirstByte
	}
	if cfg.TokenTimeout <= 0 {
		cfg.TokenTimeout = DefaultTokenTimeout
	}
	if cfg.BusyWait <= 0 {
		cfg.BusyWait = DefaultBusyWait
	}
	if cfg.BusyBackoffMax <= 0 {
		cfg.BusyBackoffMax = DefaultBusyBackoffMax
	}
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if cfg.PageRefresh <= 0 {
		cfg.PageRefresh = DefaultPageRefresh
	}
	cfg.TicketKey, cfg.Self = ticketKey(cfg.TicketKey, cfg.Self, cfg.Logger)
	if cfg.Store == nil {
		cfg.Store = NewMemStore(cfg.Self)
	}
	s := &Server{
		cfg: cfg,
		reg: NewRegistry(cfg.Store, cfg.Clock, cfg.HeartbeatTimeout, cfg.MaxClockSkew, cfg.Route),
		log: cfg.Logger,

		backoff: newBusyBackoff(cfg.BusyBackoffMax),
	}
	s.reg.SetJoinToken(cfg.JoinToken)
	s.reg.SetLimits(cfg.Limits)
	s.ipRate = newLimiter(cfg.RegisterPerIP, cfg.RegisterIPBurst)
	var ch *challenger
	if !cfg.SkipEndpointCheck {
		ch = &challenger{self: cfg.Self.PeerID, policy: cfg.Endpoints, http: cfg.Endpoints.httpClient(cfg.ChallengeTimeout, false),
			relay: cfg.Relay, timeout: cfg.ChallengeTimeout}
	}
	s.reg.SetAdmission(cfg.Endpoints, newLimiter(cfg.RegisterPerKey, cfg.RegisterKeyBurst), ch)
	if cfg.InflightRPM > 0 {
		s.reg.SetInflightRPM(cfg.InflightRPM)
	}
	s.metrics = prometheus.NewRegistry()
	s.requests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "meshgpu_tracker_http_requests_total", Help: "Tracker HTTP requests by route and status code.",
	}, []string{"path", "code"})
	s.routeTime = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "meshgpu_tracker_route_seconds", Help: "Time to compute one route.",
		Buckets: prometheus.ExponentialBuckets(1e-5, 4, 10),
	})
	s.failovers = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "meshgpu_tracker_proxy_failovers_total", Help: "Proxied generations resumed on a new route after a failure.",
	})
	s.busy = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "meshgpu_tracker_proxy_backpressure_total", Help: "Busy answers (429, 503 busy) from heads and hops, waited out or routed around; never bans.",
	})
	s.proxied = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "meshgpu_tracker_proxy_requests_total", Help: "Proxied OpenAI requests by outcome.",
	}, []string{"outcome"})
	nodes := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "meshgpu_tracker_nodes", Help: "Live registered nodes.",
	}, func() float64 {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		n, err := s.reg.Nodes(ctx)
		if err != nil {
			return -1
		}
		return float64(len(n))
	})
	s.metrics.MustRegister(s.requests, s.routeTime, s.failovers, s.busy, s.proxied, nodes, &coverageCollector{s: s})
	if cfg.Audit.enabled() {
		s.audit = newAuditor(s, cfg.Audit)
		s.reg.probation, s.reg.trusted = cfg.Audit.Probation, s.audit.trusted
		s.metrics.MustRegister(s.audit.collectors()...)
	}
	buildinfo.Register(s.metrics, "meshgpu")
	return s
}

// Registry exposes the server's state (for tests and embedding).
func (s *Server) Registry() *Registry { return s.reg }

// Handler returns the HTTP API.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	handle := func(pattern, path string, h http.HandlerFunc) {
		mux.Handle(pattern, s.count(path, h))
	}
	handle("POST /register", "/register", s.limitIP(s.postSigned(s.register)))
	handle("POST /heartbeat", "/heartbeat", s.postSigned(func(ctx context.Context, b []byte) (any, error) { return s.reg.Heartbeat(ctx, b) }))
	handle("POST /deregister", "/deregister", s.limitIP(s.postSigned(func(ctx context.Context, b []byte) (any, error) { return s.reg.Deregister(ctx, b) })))
	handle("POST /assign", "/assign", s.limitIP(s.postSigned(func(ctx context.Context, b []byte) (any, error) { return s.reg.Assign(ctx, b) })))
	handle("GET /nodes", "/nodes", func(w http.ResponseWriter, r *http.Request) {
		nodes, err := s.reg.Nodes(r.Context())
		if err != nil {
			s.writeError(w, err)
			return
		}
		statuses, err := s.reg.store.Statuses(r.Context())
		if err != nil {
			s.writeError(w, err)
			return
		}
		writeJSON(w, 200, map[string]any{"nodes": s.publicNodes(nodes, statuses)})
	})
	handle("GET /map", "/map", func(w http.ResponseWriter, r *http.Request) {
		model, err := s.defaultModel(r.Context(), r.URL.Query().Get("model"))
		if err != nil {
			s.writeError(w, err)
			return
		}
		m, err := s.reg.Map(r.Context(), model)
		if err != nil {
			s.writeError(w, err)
			return
		}
		writeJSON(w, 200, m)
	})
	handle("GET /route", "/route", func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		seed := s.seq.Add(1)
		if v := q.Get("seed"); v != "" {
			n, err := strconv.ParseUint(v, 10, 64)
			if err != nil {
				s.writeError(w, errf(400, "invalid_request_error", "seed must be an unsigned integer"))
				return
			}
			seed = n
		}
		var variant *string
		if q.Has("variant") {
			v := q.Get("variant")
			variant = &v
		}
		rt, err := s.route(r.Context(), q.Get("model"), variant, seed, nil)
		if err != nil {
			s.writeError(w, err)
			return
		}
		writeJSON(w, 200, rt)
	})
	handle("GET /trackers", "/trackers", func(w http.ResponseWriter, r *http.Request) {
		trackers, err := s.meshTrackers(r.Context())
		if err != nil {
			s.writeError(w, err)
			return
		}
		writeJSON(w, 200, map[string]any{"trackers": trackers})
	})
	handle("GET /health", "/health", func(w http.ResponseWriter, r *http.Request) {
		nodes, err := s.reg.Nodes(r.Context())
		if err != nil {
			s.writeError(w, err)
			return
		}
		models, _ := s.coveredModels(r.Context())
		writeJSON(w, 200, map[string]any{"status": "ok", "nodes": len(nodes), "models": models})
	})
	mux.Handle("GET /metrics", promhttp.HandlerFor(s.metrics, promhttp.HandlerOpts{}))
	handle("POST /v1/chat/completions", "/v1/chat/completions", s.proxy("/v1/chat/completions"))
	handle("POST /v1/completions", "/v1/completions", s.proxy("/v1/completions"))
	handle("GET /v1/models", "/v1/models", s.listModels)
	pg := page.Handler()
	mux.Handle("GET /{$}", s.count("/", pg.ServeHTTP))
	mux.Handle("GET /assets/", s.count("/assets", pg.ServeHTTP))
	handle("GET /api/mesh", "/api/mesh", func(w http.ResponseWriter, r *http.Request) {
		offset, limit, err := pageArgs(r, DefaultMeshPage, MaxMeshPage)
		if err != nil {
			s.writeError(w, err)
			return
		}
		v, err := s.meshView(r.Context(), offset, limit)
		if err != nil {
			s.writeError(w, err)
			return
		}
		writeJSON(w, 200, v)
	})
	handle("GET /v1/models/{id...}", "/v1/models/{id}", s.getModel)
	mux.Handle("/", s.count("other", func(w http.ResponseWriter, r *http.Request) {
		s.writeError(w, errf(404, "not_found_error", "%s %s is not a tracker endpoint", r.Method, r.URL.Path))
	}))
	return apiauth.Middleware(s.cfg.APIAuth, bodydeadline.Middleware(s.cfg.BodyTimeout, mux))
}

// defaultModel resolves an empty model name to the only model served.
func (s *Server) defaultModel(ctx context.Context, model string) (string, error) {
	if model != "" {
		return model, nil
	}
	models, err := s.reg.Models(ctx)
	if err != nil {
		return "", err
	}
	switch len(models) {
	case 0:
		return "", errf(404, "not_found_error", "no live node is registered")
	case 1:
		return models[0], nil
	}
	return "", errf(400, "invalid_request_error", "name the model (?model= or \"model\"); serving %v", models)
}

// coveredModels lists the models whose every layer some live node holds:
// the ones a request can be routed for.
func (s *Server) coveredModels(ctx context.Context) ([]string, error) {
	maps, err := s.reg.Maps(ctx, "")
	if err != nil {
		return nil, err
	}
	out := []string{}
	for _, am := range maps {
		if am.Covered {
			out = append(out, am.Model)
		}
	}
	return out, nil
}

// servedModel resolves a request's model: "" is the only covered model; an
// unknown one is 404 model_not_found, as on a head; a registered one whose
// layers are not all covered is 503.
func (s *Server) servedModel(ctx context.Context, model string) (string, error) {
	covered, err := s.coveredModels(ctx)
	if err != nil {
		return "", err
	}
	if model == "" {
		if len(covered) == 1 {
			return covered[0], nil
		}
		if len(covered) == 0 {
			return "", errf(503, wire.TypeUnavailable, "no model is served: no live nodes cover every layer of one")
		}
		return "", wire.Invalid("model", "name the model; serving %v", covered)
	}
	for _, m := range covered {
		if m == model {
			return m, nil
		}
	}
	known, err := s.reg.Models(ctx)
	if err != nil {
		return "", err
	}
	if len(known) == 0 {
		// Not "does not exist": nothing has joined yet.
		e := openai.ModelNotFound(model)
		e.Message = fmt.Sprintf("no node serves %q yet: no node has registered with this tracker (start nodes with --tracker pointing here; GET /nodes lists them)", model)
		return "", e
	}
	for _, m := range known {
		if m == model {
			// A relay outage (which relay, no ban; /map does not count
			// the nodes behind it) or a tied layer count (shape.go)
			// making the gap is said as such.
			var ae *apiError
			if _, err := s.reg.Route(ctx, model, 0); errors.As(err, &ae) && (ae.Type == wire.TypeRelayUnavailable || ae.Type == typeShapeTie) {
				return "", ae
			}
			return "", errf(503, wire.TypeUnavailable, "model %s is registered but no live nodes cover all its layers (see /map?model=%s)", model, model)
		}
	}
	return "", openai.ModelNotFound(model)
}

// route picks a route for model, within variant (a fingerprint) when it
// is not nil.
func (s *Server) route(ctx context.Context, model string, variant *string, seed uint64, avoid func(peerID string) bool) (route.Route, error) {
	model, err := s.defaultModel(ctx, model)
	if err != nil {
		return route.Route{}, err
	}
	start := time.Now()
	r, err := s.reg.RouteVariant(ctx, model, variant, seed, avoid)
	s.routeTime.Observe(time.Since(start).Seconds())
	return r, err
}

// statusRecorder captures the status for the request counter.
type statusRecorder struct {
	http.ResponseWriter
	code int
}

func (r *statusRecorder) WriteHeader(code int) {
	if r.code == 0 {
		r.code = code
	}
	r.ResponseWriter.WriteHeader(code)
}

func (r *statusRecorder) Write(b []byte) (int, error) {
	if r.code == 0 {
		r.code = 200
	}
	return r.ResponseWriter.Write(b)
}

func (r *statusRecorder) Flush() {
	if f, ok := r.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

func (s *Server) count(path string, h http.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := &statusRecorder{ResponseWriter: w}
		h(rec, r)
		if rec.code == 0 {
			rec.code = 200
		}
		s.requests.WithLabelValues(path, strconv.Itoa(rec.code)).Inc()
	})
}

// limitIP refuses a source address over its registration rate (before the
// signature is even checked: a flood of fresh identities costs nothing to
// make). The address is the connection's: a tracker behind a proxy sees
// the proxy's.
func (s *Server) limitIP(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if !s.ipRate.allow(sourceKey(r.RemoteAddr), time.Now()) {
			w.Header().Set("Retry-After", "1")
			s.writeError(w, errf(429, "rate_limit_error", "too many registrations from %s; slow down", sourceKey(r.RemoteAddr)))
			return
		}
		h(w, r.WithContext(withSource(r.Context(), r.RemoteAddr)))
	}
}

// PublicNode is a node as GET /nodes lists it: what a client or operator
// needs to see the mesh, without the node's key or memory figures.
// Endpoints stay: GET /route hands them out anyway, and they are only
// ever used after the node proved itself at them.
type PublicNode struct {
	PeerID    string       `json:"peer_id"`
	Model     string       `json:"model"`
	Variant   wire.Variant `json:"variant,omitzero"`
	NumLayers int          `json:"num_layers"`
	Layers    [2]int       `json:"layers"`
	Backend   string       `json:"backend"`
	Endpoint  string       `json:"endpoint,omitempty"`
	RelayAddr string       `json:"relay_addr,omitempty"`
	// Reachability is how peers reach the node: "public" (its endpoint),
	// "relay" (only through its relay, where peers punch direct paths to
	// it: docs/relay.md, "Direct paths").
	Reachability string       `json:"reachability"`
	MsPerLayer   float64      `json:"ms_per_layer"`
	Stats        NodeStats    `json:"stats"`
	Verified     string       `json:"verified,omitempty"`
	Audit        string       `json:"audit,omitempty"`        // NodeStatus.Audit
	AuditDetail  string       `json:"audit_detail,omitempty"` // its evidence
	Dispute      *DisputeView `json:"dispute,omitempty"`      // while Audit is disputed
	// MeasuredMsPerLayer is this tracker's timing of the node, which
	// routing uses instead of MsPerLayer (its own claim) once there is one.
	MeasuredMsPerLayer float64   `json:"measured_ms_per_layer,omitempty"`
	RelayDown          bool      `json:"relay_down,omitempty"` // its relay connection is down
	RegisteredAt       time.Time `json:"registered_at"`
	LastHeartbeat      time.Time `json:"last_heartbeat"`
}

// DisputeView is the traffic through a disputed node: the other node, and
// this tracker's requests run on both (served: they agreed; refused: 503
// audit_dispute).
type DisputeView struct {
	With    string `json:"with"`
	Served  int64  `json:"served"`
	Refused int64  `json:"refused"`
}

func (s *Server) publicNodes(recs []NodeRecord, statuses map[string]NodeStatus) []PublicNode {
	out := make([]PublicNode, 0, len(recs))
	for _, r := range recs {
		st := statuses[r.PeerID]
		out = append(out, PublicNode{PeerID: r.PeerID, Model: r.Model, Variant: r.Variant, NumLayers: r.NumLayers, Layers: r.Layers, Backend: r.Backend,
			Endpoint: r.Endpoint, RelayAddr: r.RelayAddr, MsPerLayer: r.MsPerLayer, Stats: r.Stats, Verified: r.Verified,
			Audit: st.Audit, AuditDetail: st.Detail, Dispute: s.disputeView(r.PeerID, st), MeasuredMsPerLayer: s.reg.measuredMs(r.PeerID),
			RelayDown: r.RelayDown, RegisteredAt: r.RegisteredAt, LastHeartbeat: r.LastSeen, Reachability: reachability(r.Endpoint)})
	}
	return out
}

func (s *Server) disputeView(peer string, st NodeStatus) *DisputeView {
	if st.Audit != AuditDisputed || s.audit == nil {
		return nil
	}
	c := s.audit.disputeCount(peer)
	return &DisputeView{With: st.With, Served: c.served.Load(), Refused: c.refused.Load()}
}

// postSigned reads a bounded body and answers do's result as JSON.
func (s *Server) postSigned(do func(context.Context, []byte) (any, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 64<<10))
		if err != nil {
			s.writeError(w, errf(bodydeadline.Status(err), "invalid_request_error", "body larger than 64 KiB, too slow or unreadable: %v", err))
			return
		}
		out, err := do(r.Context(), body)
		if err != nil {
			s.writeError(w, err)
			return
		}
		writeJSON(w, 200, out)
	}
}

func (s *Server) writeError(w http.ResponseWriter, err error) {
	var ae *apiError
	if !errors.As(err, &ae) {
		s.log.Error("tracker internal error", "err", err)
		ae = errf(500, "server_error", "%v", err)
	}
	wire.WriteError(w, ae)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// modelInfo is a model's /v1/models entry; created is when its first live
// node registered. Its meshgpu field lists the variants that serve it
// (those covering every layer), the way vLLM and llama-server add their
// own fields to an entry; the id stays the model's name, the one requests
// give.
func (s *Server) modelInfo(ctx context.Context, model string) openai.Model {
	m := openai.Model{ID: model, Object: "model", OwnedBy: "meshnet"}
	if nodes, err := s.reg.Nodes(ctx); err == nil {
		for _, n := range nodes {
			if n.Model == model && (m.Created == 0 || n.RegisteredAt.Unix() < m.Created) {
				m.Created = n.RegisteredAt.Unix()
			}
		}
	}
	if am, err := s.reg.Map(ctx, model); err == nil {
		ext := &openai.ModelMeshgpu{Variants: []wire.Variant{}}
		for _, v := range am.Variants {
			if v.Covered && !v.IsZero() {
				ext.Variants = append(ext.Variants, v.Variant)
			}
		}
		if len(ext.Variants) > 0 {
			m.Meshgpu = ext
		}
	}
	return m
}

func (s *Server) listModels(w http.ResponseWriter, r *http.Request) {
	w.Header().Set(openai.HeaderRequestID, openai.RequestID(r))
	models, err := s.coveredModels(r.Context())
	if err != nil {
		s.writeError(w, err)
		return
	}
	list := openai.ModelList{Object: "list", Data: []openai.Model{}}
	for _, m := range models {
		list.Data = append(list.Data, s.modelInfo(r.Context(), m))
	}
	writeJSON(w, 200, list)
}

func (s *Server) getModel(w http.ResponseWriter, r *http.Request) {
	w.Header().Set(openai.HeaderRequestID, openai.RequestID(r))
	model, err := s.servedModel(r.Context(), r.PathValue("id"))
	if err != nil {
		s.writeError(w, err)
		return
	}
	writeJSON(w, 200, s.modelInfo(r.Context(), model))
}

// coverageCollector exports, per registered model, how many live nodes
// hold each layer (meshgpu_tracker_layer_replicas) and whether every layer
// has one (meshgpu_tracker_model_covered). Per-layer series are only for
// models with a proven node (proven), and every family stops at
// maxSeriesPerMetric: a flood of registrations once made 307,208 series.
type coverageCollector struct{ s *Server }

// maxSeriesPerMetric bounds each per-model family (Limits bound the
// models and layers already; this keeps a scrape small whatever they are).
const maxSeriesPerMetric = 4096

var (
	layerReplicasDesc = prometheus.NewDesc("meshgpu_tracker_layer_replicas",
		"Live nodes holding the layer, per model with a proven node.", []string{"model", "layer"}, nil)
	modelCoveredDesc = prometheus.NewDesc("meshgpu_tracker_model_covered",
		"1 when live nodes cover every layer of the model, else 0.", []string{"model"}, nil)
	layersCoveredDesc = prometheus.NewDesc("meshgpu_tracker_model_layers_covered",
		"Layers of the model held by at least one live node.", []string{"model"}, nil)
)

func (c *coverageCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- layerReplicasDesc
	ch <- modelCoveredDesc
	ch <- layersCoveredDesc
}

func (c *coverageCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	maps, err := c.s.reg.Maps(ctx, "")
	if err != nil {
		return
	}
	proven, err := c.s.reg.provenModels(ctx)
	if err != nil {
		return
	}
	perLayer := 0
	for i, am := range maps {
		if i == maxSeriesPerMetric {
			break
		}
		m := am.Model
		covered, n := 0.0, 0
		if am.Covered {
			covered = 1
		}
		for i, l := range am.Layers {
			if proven[m] && perLayer < maxSeriesPerMetric {
				ch <- prometheus.MustNewConstMetric(layerReplicasDesc, prometheus.GaugeValue, float64(l.Replicas), m, strconv.Itoa(i))
				perLayer++
			}
			if l.Replicas > 0 {
				n++
			}
		}
		ch <- prometheus.MustNewConstMetric(modelCoveredDesc, prometheus.GaugeValue, covered, m)
		ch <- prometheus.MustNewConstMetric(layersCoveredDesc, prometheus.GaugeValue, float64(n), m)
	}
}

// MeshView is GET /api/mesh: what the mesh page shows.
type MeshView struct {
	Now       time.Time         `json:"now"`
	RefreshMs int64             `json:"refresh_ms"`
	Models    []AvailabilityMap `json:"models"`
	Nodes     []NodeView        `json:"nodes"` // one page, in peer id order
	// NodesTotal counts every live node; NextOffset, when not 0, is the
	// ?offset= of the next page.
	NodesTotal int           `json:"nodes_total"`
	NextOffset int           `json:"next_offset,omitempty"`
	Trackers   []TrackerInfo `json:"trackers"`
}

// NodeView is one node on the mesh page.
type NodeView struct {
	PeerID        string       `json:"peer_id"`
	Model         string       `json:"model"`
	Variant       wire.Variant `json:"variant,omitzero"`
	Layers        [2]int       `json:"layers"`
	Backend       string       `json:"backend"`
	TokensPerSec  float64      `json:"tokens_per_sec"`
	RPM1          float64      `json:"rpm1"`
	Sessions      int          `json:"sessions"`
	Health        string       `json:"health"` // ok, banned, audit failed
	Audit         string       `json:"audit"`  // NodeStatus.Audit ("": not audited)
	Dispute       *DisputeView `json:"dispute,omitempty"`
	LastHeartbeat time.Time    `json:"last_heartbeat"`
}

// Paging of GET /api/mesh's nodes: the page polls it every 2 s, and 300
// flood registrations once made it 39 MB.
const (
	DefaultMeshPage = 200
	MaxMeshPage     = 1000
)

func (s *Server) meshView(ctx context.Context, offset, limit int) (MeshView, error) {
	v := MeshView{Now: s.cfg.Clock(), RefreshMs: s.cfg.PageRefresh.Milliseconds(), Models: []AvailabilityMap{}, Nodes: []NodeView{}}
	nodes, err := s.reg.Nodes(ctx)
	if err != nil {
		return v, err
	}
	bans, err := s.reg.store.Bans(ctx, v.Now)
	if err != nil {
		return v, err
	}
	statuses, err := s.reg.store.Statuses(ctx)
	if err != nil {
		return v, err
	}
	if v.Trackers, err = s.reg.store.Trackers(ctx); err != nil {
		return v, err
	}
	v.NodesTotal = len(nodes)
	if offset < len(nodes) {
		end := min(len(nodes), offset+limit)
		if end < len(nodes) {
			v.NextOffset = end
		}
		nodes = nodes[offset:end]
	} else {
		nodes = nil
	}
	for _, n := range nodes {
		nv := NodeView{PeerID: n.PeerID, Model: n.Model, Variant: n.Variant, Layers: n.Layers, Backend: n.Backend, TokensPerSec: n.Stats.TokensPerSec,
			RPM1: n.Stats.RPM1, Sessions: n.Stats.Sessions, Health: "ok", Audit: statuses[n.PeerID].Audit,
			Dispute: s.disputeView(n.PeerID, statuses[n.PeerID]), LastHeartbeat: n.LastSeen}
		if _, banned := bans[n.PeerID]; banned {
			nv.Health = "banned"
		}
		if nv.Audit == AuditFailed && v.Now.Before(statuses[n.PeerID].Until) {
			nv.Health = "audit failed"
		}
		v.Nodes = append(v.Nodes, nv)
	}
	maps, err := s.reg.Maps(ctx, "")
	if err != nil {
		return v, err
	}
	for _, am := range maps {
		// The page shows counts per layer and per variant: the per-layer
		// node lists (GET /map has them) would grow with nodes x layers.
		for i := range am.Layers {
			am.Layers[i].Nodes = nil
		}
		for i := range am.Variants {
			am.Variants[i].Layers = nil
		}
		v.Models = append(v.Models, am)
	}
	return v, nil
}

// pageArgs reads ?offset= and ?limit= (defaults 0 and def, limit at most
// max).
func pageArgs(r *http.Request, def, most int) (offset, limit int, err error) {
	q := r.URL.Query()
	offset, limit = 0, def
	if v := q.Get("offset"); v != "" {
		if offset, err = strconv.Atoi(v); err != nil || offset < 0 {
			return 0, 0, errf(400, "invalid_request_error", "offset must be a non-negative integer")
		}
	}
	if v := q.Get("limit"); v != "" {
		if limit, err = strconv.Atoi(v); err != nil || limit < 1 || limit > most {
			return 0, 0, errf(400, "invalid_request_error", "limit must be an integer from 1 to %d", most)
		}
	}
	return offset, limit, nil
}

// reachability is a node's PublicNode.Reachability.
func reachability(endpoint string) string {
	if endpoint != "" {
		return "public"
	}
	return "relay"
}

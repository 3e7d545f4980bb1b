package node

import (
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the node's Prometheus series (registered on the server's own
// registry) and the in-process counters behind /stats.
type metrics struct {
	hops       *prometheus.CounterVec // by result: ok or the error type
	tokens     prometheus.Counter
	hopLat     prometheus.Histogram
	compLat    prometheus.Histogram
	errors     *prometheus.CounterVec // by type
	requests   *prometheus.CounterVec // OpenAI requests by endpoint and result
	bindings   prometheus.Counter     // Hop frames that carried a session binding
	hopWindow  latencyWindow
	compWindow latencyWindow

	hopsOK, hopsErr, tokensN, requestsN, bindingsN atomic.Int64
}

func newMetrics(reg prometheus.Registerer, sessions func() float64) *metrics {
	buckets := []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30}
	m := &metrics{
		hops: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "meshgpu_node_hops_total",
			Help: "Hops served (POST /forward) by result: ok or the error type."}, []string{"result"}),
		tokens: prometheus.NewCounter(prometheus.CounterOpts{Name: "meshgpu_node_tokens_generated_total",
			Help: "Tokens sampled on this node (last-hop decode and head generation)."}),
		hopLat: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "meshgpu_node_hop_latency_seconds",
			Help: "Time to serve one hop, including downstream hops in chain mode.", Buckets: buckets}),
		compLat: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "meshgpu_node_compute_latency_seconds",
			Help: "Time in the backend (embed, layers, logits) per hop or step.", Buckets: buckets}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "meshgpu_node_errors_total",
			Help: "Errors returned by type."}, []string{"type"}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "meshgpu_node_openai_requests_total",
			Help: "OpenAI API requests by endpoint and result."}, []string{"endpoint", "result"}),
		bindings: prometheus.NewCounter(prometheus.CounterOpts{Name: "meshgpu_node_session_bindings_total",
			Help: "Hop frames that carried a session binding (a session's first hop, a failover, a 428 binding_required)."}),
	}
	m.hopWindow.init(1024)
	m.compWindow.init(1024)
	reg.MustRegister(m.hops, m.bindings, m.tokens, m.hopLat, m.compLat, m.errors, m.requests,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "meshgpu_node_active_sessions",
			Help: "Sessions (KV caches) held on this node."}, sessions))
	return m
}

func (m *metrics) bindingReceived() {
	m.bindings.Inc()
	m.bindingsN.Add(1)
}

func (m *metrics) hopDone(result string, d time.Duration) {
	m.hops.WithLabelValues(result).Inc()
	if result == "ok" {
		m.hopsOK.Add(1)
		m.hopLat.Observe(d.Seconds())
		m.hopWindow.add(d)
	} else {
		m.hopsErr.Add(1)
		m.errors.WithLabelValues(result).Inc()
	}
}

func (m *metrics) computeDone(d time.Duration) {
	m.compLat.Observe(d.Seconds())
	m.compWindow.add(d)
}

func (m *metrics) tokenGenerated() {
	m.tokens.Inc()
	m.tokensN.Add(1)
}

func (m *metrics) requestDone(endpoint, result string) {
	m.requests.WithLabelValues(endpoint, result).Inc()
	m.requestsN.Add(1)
	if result != "ok" {
		m.errors.WithLabelValues(result).Inc()
	}
}

// latencyWindow keeps the last n samples for /stats percentiles.
type latencyWindow struct {
	mu   sync.Mutex
	buf  []time.Duration
	next int
	full bool
}

func (w *latencyWindow) init(n int) { w.buf = make([]time.Duration, n) }

func (w *latencyWindow) add(d time.Duration) {
	w.mu.Lock()
	w.buf[w.next] = d
	w.next++
	if w.next == len(w.buf) {
		w.next, w.full = 0, true
	}
	w.mu.Unlock()
}

// percentiles returns p50 and p99 in milliseconds (0 without samples).
func (w *latencyWindow) percentiles() (p50, p99 float64) {
	w.mu.Lock()
	n := w.next
	if w.full {
		n = len(w.buf)
	}
	s := append([]time.Duration(nil), w.buf[:n]...)
	w.mu.Unlock()
	if len(s) == 0 {
		return 0, 0
	}
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	at := func(q float64) float64 {
		i := int(q * float64(len(s)-1))
		return float64(s[i]) / float64(time.Millisecond)
	}
	return at(0.50), at(0.99)
}

// Stats is GET /stats: counts since start and latency percentiles over the
// last 1024 samples. The tracker heartbeat can send it as is.
type Stats struct {
	PeerID          string  `json:"peer_id"`
	UptimeSeconds   float64 `json:"uptime_s"`
	Sessions        int     `json:"sessions"`
	HopsOK          int64   `json:"hops_ok"`
	HopsFailed      int64   `json:"hops_failed"`
	TokensGenerated int64   `json:"tokens_generated"`
	Requests        int64   `json:"requests"`
	HopP50Ms        float64 `json:"hop_latency_p50_ms"`
	HopP99Ms        float64 `json:"hop_latency_p99_ms"`
	ComputeP50Ms    float64 `json:"compute_latency_p50_ms"`
	ComputeP99Ms    float64 `json:"compute_latency_p99_ms"`
}

// registerHostPool exports the activation buffers' host memory.
func (m *metrics) registerHostPool(reg prometheus.Registerer, p *hostPool) {
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "meshgpu_node_host_buffer_bytes",
			Help: "Host memory (pinned on CUDA) held for activation buffers, lent or kept for reuse."},
			func() float64 { a, _ := p.usage(); return float64(a) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "meshgpu_node_host_buffer_lent_bytes",
			Help: "Host buffer bytes lent to running hops and generation steps."},
			func() float64 { _, l := p.usage(); return float64(l) }))
}

package node

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"meshgpu/internal/buildinfo"
	"meshgpu/internal/latency"
	"meshgpu/wire"
)

// latencySamples is how many recent samples the /stats percentiles use.
const latencySamples = 1024

// metrics are the node's Prometheus series (registered on the server's own
// registry) and the in-process counters behind /stats.
type metrics struct {
	hops     *prometheus.CounterVec // by result: ok or the error type
	tokens   prometheus.Counter
	hopLat   prometheus.Histogram
	compLat  prometheus.Histogram
	errors   *prometheus.CounterVec // by type
	requests *prometheus.CounterVec // OpenAI requests by endpoint and result
	bindings prometheus.Counter     // Hop frames that carried a session binding
	// nonFinite counts hops refused for NaN/Inf activations; the error
	// names the sender, whom the head and tracker route around.
	nonFinite prometheus.Counter
	// badAnswers counts token answers from the next hop refused for
	// values no sampler sends (NaN logprobs, ids outside the vocabulary).
	badAnswers prometheus.Counter
	// What vLLM and llama-server users chart, for the OpenAI API of a head.
	ttft       prometheus.Histogram
	itl        prometheus.Histogram
	reqLat     *prometheus.HistogramVec
	promptToks prometheus.Counter
	genToks    prometheus.Counter
	running    prometheus.Gauge
	waiting    prometheus.Gauge
	queueWait  prometheus.Histogram
	// the scheduler's forward calls: sessions and rows in each
	batchSessions prometheus.Histogram
	batchRows     prometheus.Histogram
	hopWindow     *latency.Window // hops served, or sent by a head (Stats.HopP50Ms)
	compWindow    *latency.Window
	// speculative decoding on the head, by mode
	specDrafted  *prometheus.CounterVec
	specAccepted *prometheus.CounterVec
	specPass     *prometheus.HistogramVec // tokens generated per verify pass
	specDraft    *prometheus.HistogramVec // seconds spent drafting per pass
	// passes in flight (node/inflight.go): sent and not consumed, and
	// dropped after a rollback
	specInFlight prometheus.Gauge
	specDropped  prometheus.Counter

	// sent counts hops sent by next peer and path (direct TCP, direct
	// QUIC through NAT, relay); peerLabels bounds its peer label values.
	// direct replies (node/directreply.go): the head's passes by which
	// answer came first, replies it refused by reason, the tail's sends
	directReplies, directRefusals, directSends *prometheus.CounterVec

	sent       *prometheus.CounterVec
	peerLabels sync.Map // peer id -> struct{}
	peerCount  atomic.Int64

	hopsOK, hopsErr, tokensN, requestsN, bindingsN atomic.Int64
	specDraftedN, specAcceptedN, specPassesN       atomic.Int64
	directN, chainFirstN                           atomic.Int64
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
		nonFinite: prometheus.NewCounter(prometheus.CounterOpts{Name: "meshgpu_node_hops_non_finite_total",
			Help: "Hops refused (422) because their activations held NaN, Inf or magnitudes of 2^20 or more, which no model produces."}),
		badAnswers: prometheus.NewCounter(prometheus.CounterOpts{Name: "meshgpu_node_hop_answers_refused_total",
			Help: "Token answers of the next hop refused (502 naming it): NaN, infinite or positive logprobs, ids outside the vocabulary."}),
		specDrafted: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "meshgpu_node_speculative_draft_tokens_total",
			Help: "Draft tokens the head proposed for verification, by speculation mode."}, []string{"mode"}),
		specAccepted: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "meshgpu_node_speculative_accepted_tokens_total",
			Help: "Draft tokens the last node accepted, by speculation mode (acceptance rate: this over draft tokens)."}, []string{"mode"}),
		specPass: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "meshgpu_node_speculative_pass_tokens",
			Help:    "Tokens generated by one speculative pass (accepted drafts plus one), by speculation mode.",
			Buckets: []float64{1, 2, 3, 4, 6, 8, 12, 16, 32, 64}}, []string{"mode"}),
		specDraft: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "meshgpu_node_speculative_draft_seconds",
			Help: "Time the head spent drafting for one pass, by speculation mode.", Buckets: buckets}, []string{"mode"}),
		specInFlight: prometheus.NewGauge(prometheus.GaugeOpts{Name: "meshgpu_node_speculative_passes_in_flight",
			Help: "Verify passes the head has sent and not yet consumed, over all its streams (--speculate-inflight)."}),
		specDropped: prometheus.NewCounter(prometheus.CounterOpts{Name: "meshgpu_node_speculative_dropped_passes_total",
			Help: "Passes in flight dropped because an earlier pass was not accepted in full (rollbacks)."}),
		ttft: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "meshgpu_node_time_to_first_token_seconds",
			Help: "Time from an OpenAI request's arrival to its first sampled token.", Buckets: buckets}),
		itl: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "meshgpu_node_inter_token_latency_seconds",
			Help: "Time between two sampled tokens of one generation.", Buckets: buckets}),
		reqLat: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "meshgpu_node_request_duration_seconds",
			Help:    "Time to answer an OpenAI request, from arrival to the last byte.",
			Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300}}, []string{"endpoint"}),
		promptToks: prometheus.NewCounter(prometheus.CounterOpts{Name: "meshgpu_node_prompt_tokens_total",
			Help: "Prompt tokens of finished OpenAI requests."}),
		genToks: prometheus.NewCounter(prometheus.CounterOpts{Name: "meshgpu_node_generation_tokens_total",
			Help: "Completion tokens of finished OpenAI requests."}),
		running: prometheus.NewGauge(prometheus.GaugeOpts{Name: "meshgpu_node_requests_running",
			Help: "OpenAI requests generating now."}),
		waiting: prometheus.NewGauge(prometheus.GaugeOpts{Name: "meshgpu_node_requests_waiting",
			Help: "OpenAI requests accepted and not generating yet: the admission queue (--max-queue) and route planning."}),
		batchSessions: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "meshgpu_node_batch_sessions",
			Help:    "Sessions in one forward call of the node's scheduler (--max-batch).",
			Buckets: []float64{1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64}}),
		batchRows: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "meshgpu_node_batch_rows",
			Help:    "Rows (tokens) in one forward call of the node's scheduler: decode steps and prompt chunks (--prefill-chunk).",
			Buckets: []float64{1, 2, 4, 8, 16, 32, 64, 128, 256, 512}}),
		queueWait: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "meshgpu_node_queue_wait_seconds",
			Help:    "Time an admitted OpenAI request waited for a generation slot (0 when one was free).",
			Buckets: []float64{0, .001, .01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60}}),
	}
	m.sent = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "meshgpu_node_peer_hops_total",
		Help: "Hops this node sent, by next peer and path: tcp (its endpoint), direct (QUIC through NAT), relay."}, []string{"peer", "path"})
	reg.MustRegister(m.sent)
	m.directReplies = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "meshgpu_node_direct_replies_total",
		Help: "Passes this head sent expecting a direct reply, by which answer came first: direct (the tail's, straight to the head) or chain_first."}, []string{"first"})
	m.directRefusals = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "meshgpu_node_direct_replies_refused_total",
		Help: "Direct replies this head refused, by reason: unknown (no pass waits for it: late, replayed, another session), bad_mac, malformed, waiters_full, chain_disagrees (the chain answer differed from an accepted direct reply)."}, []string{"reason"})
	m.directSends = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "meshgpu_node_direct_replies_sent_total",
		Help: "Direct replies this node, a route's last, sent to heads, by result: ok, failed, skipped (too many in flight)."}, []string{"result"})
	reg.MustRegister(m.directReplies, m.directRefusals, m.directSends)
	buildinfo.Register(reg, "meshgpu")
	reg.MustRegister(m.specDrafted, m.specAccepted, m.specPass, m.specDraft, m.specInFlight, m.specDropped)
	reg.MustRegister(m.ttft, m.itl, m.reqLat, m.promptToks, m.genToks, m.running, m.waiting, m.queueWait, m.batchSessions, m.batchRows)
	m.hopWindow, m.compWindow = latency.NewWindow(latencySamples), latency.NewWindow(latencySamples)
	reg.MustRegister(m.hops, m.bindings, m.nonFinite, m.badAnswers, m.tokens, m.hopLat, m.compLat, m.errors, m.requests,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "meshgpu_node_active_sessions",
			Help: "Sessions (KV caches) held on this node."}, sessions))
	return m
}

func (m *metrics) nonFiniteHop() { m.nonFinite.Inc() }

// maxPeerLabels bounds the peer label of meshgpu_node_peer_hops_total;
// later peers count as "other".
const maxPeerLabels = 256

// hopPath counts one hop sent to peer over path.
func (m *metrics) hopPath(peer, path string) {
	if peer == "" {
		peer = "unknown"
	} else if _, ok := m.peerLabels.Load(peer); !ok {
		if m.peerCount.Add(1) > maxPeerLabels {
			m.peerCount.Add(-1)
			peer = "other"
		} else if _, dup := m.peerLabels.LoadOrStore(peer, struct{}{}); dup {
			m.peerCount.Add(-1)
		}
	}
	m.sent.WithLabelValues(peer, path).Inc()
}

func (m *metrics) badAnswer() { m.badAnswers.Inc() }

func (m *metrics) directReply(first string) {
	m.directReplies.WithLabelValues(first).Inc()
	if first == "direct" {
		m.directN.Add(1)
	} else {
		m.chainFirstN.Add(1)
	}
}
func (m *metrics) directRefused(why string) { m.directRefusals.WithLabelValues(why).Inc() }
func (m *metrics) directSent(result string) { m.directSends.WithLabelValues(result).Inc() }

// speculated records one speculative pass: drafts proposed (0: none
// found, the pass ran plainly), tokens it generated, time spent drafting.
func (m *metrics) speculated(mode wire.SpeculateMode, drafts, tokens int, cost time.Duration) {
	md := string(mode)
	m.specDraft.WithLabelValues(md).Observe(cost.Seconds())
	if drafts == 0 {
		return
	}
	m.specDraftedN.Add(int64(drafts))
	m.specAcceptedN.Add(int64(tokens - 1))
	m.specPassesN.Add(1)
	m.specDrafted.WithLabelValues(md).Add(float64(drafts))
	m.specAccepted.WithLabelValues(md).Add(float64(tokens - 1))
	m.specPass.WithLabelValues(md).Observe(float64(tokens))
}

// inFlight moves the passes-in-flight gauge by delta.
func (m *metrics) inFlight(delta int) { m.specInFlight.Add(float64(delta)) }

func (m *metrics) passesDropped(n int) { m.specDropped.Add(float64(n)) }

func (m *metrics) bindingReceived() {
	m.bindings.Inc()
	m.bindingsN.Add(1)
}

func (m *metrics) hopDone(result string, d time.Duration) {
	m.hops.WithLabelValues(result).Inc()
	if result == "ok" {
		m.hopsOK.Add(1)
		m.hopLat.Observe(d.Seconds())
		m.hopWindow.Add(d)
	} else {
		m.hopsErr.Add(1)
		m.errors.WithLabelValues(result).Inc()
	}
}

func (m *metrics) computeDone(d time.Duration) {
	m.compLat.Observe(d.Seconds())
	m.compWindow.Add(d)
}

// hopSent records a hop a head sent and got its answer to, downstream
// included: on a head, the hop latency its heartbeat reports.
func (m *metrics) hopSent(d time.Duration) { m.hopWindow.Add(d) }

func (m *metrics) tokenGenerated() {
	m.tokens.Inc()
	m.tokensN.Add(1)
}

func (m *metrics) firstToken(d time.Duration) { m.ttft.Observe(d.Seconds()) }
func (m *metrics) interToken(d time.Duration) { m.itl.Observe(d.Seconds()) }

func (m *metrics) tokensCounted(prompt, completion int) {
	m.promptToks.Add(float64(prompt))
	m.genToks.Add(float64(completion))
}

func (m *metrics) requestDone(endpoint, result string) {
	m.requests.WithLabelValues(endpoint, result).Inc()
	m.requestsN.Add(1)
	if result != "ok" {
		m.errors.WithLabelValues(result).Inc()
	}
}

// Stats is GET /stats: counts since start and latency percentiles (nearest
// rank, internal/latency) over the last 1024 samples. The hop percentiles
// are of the hops this node served (POST /forward, downstream hops included
// in chain mode) and, on a head, of the hops it sent; the tracker heartbeat
// carries them.
type Stats struct {
	PeerID          string  `json:"peer_id"`
	UptimeSeconds   float64 `json:"uptime_s"`
	Sessions        int     `json:"sessions"`
	HopsOK          int64   `json:"hops_ok"`
	HopsFailed      int64   `json:"hops_failed"`
	TokensGenerated int64   `json:"tokens_generated"`
	Requests        int64   `json:"requests"`
	// Load now, for the tracker's routing: OpenAI requests generating and
	// queued on a head, hops being served.
	Running      int     `json:"running"`
	Queued       int     `json:"queued"`
	HopsInFlight int     `json:"hops_in_flight"`
	HopP50Ms     float64 `json:"hop_latency_p50_ms"`
	HopP99Ms     float64 `json:"hop_latency_p99_ms"`
	ComputeP50Ms float64 `json:"compute_latency_p50_ms"`
	ComputeP99Ms float64 `json:"compute_latency_p99_ms"`
	// Speculative decoding on a head: draft tokens sent for verification,
	// those accepted, and the verify passes.
	SpecDrafted  int64 `json:"speculative_draft_tokens,omitempty"`
	SpecAccepted int64 `json:"speculative_accepted_tokens,omitempty"`
	SpecPasses   int64 `json:"speculative_passes,omitempty"`
	// Direct replies on a head: passes whose answer came straight from the
	// tail first, and those whose chain answer came first.
	DirectReplies    int64 `json:"direct_replies,omitempty"`
	DirectChainFirst int64 `json:"direct_chain_first,omitempty"`
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

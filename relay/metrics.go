package relay

import "github.com/prometheus/client_golang/prometheus"

// metrics are registered on the Server's own registry so several relays can
// run in one process (tests).
type metrics struct {
	peers         *prometheus.GaugeVec   // kind: ws, tunnel
	bytes         *prometheus.CounterVec // direction: in, out
	requests      *prometheus.CounterVec // path: rpc, tunnel; result: ok or the relay error type (peer_not_connected, rate_limited, timeout, ...)
	latency       *prometheus.HistogramVec
	unknown       prometheus.Counter
	oversize      prometheus.Counter
	slowDrops     prometheus.Counter
	authFailures  prometheus.Counter
	replacedConns prometheus.Counter
	unauthRefused *prometheus.CounterVec // limit: source, relay
	tcpObserved   *prometheus.CounterVec // result: answered, limited (GET /observe)

	// Children resolved once, not per frame (WithLabelValues hashes the
	// values and takes a lock).
	bytesIn, bytesOut prometheus.Counter
	okRequests        map[string]prometheus.Counter  // by entry path
	latencyBy         map[string]prometheus.Observer // by entry path
}

// entries are the requests' entry paths (the path label).
var entries = []string{"rpc", "tunnel"}

// request counts one finished request and its latency.
func (m *metrics) request(entry, result string, seconds float64) {
	if c, ok := m.okRequests[entry]; ok && result == "ok" {
		c.Inc()
	} else {
		m.requests.WithLabelValues(entry, result).Inc()
	}
	if o, ok := m.latencyBy[entry]; ok {
		o.Observe(seconds)
	} else {
		m.latency.WithLabelValues(entry).Observe(seconds)
	}
}

func newMetrics(reg *prometheus.Registry) *metrics {
	m := &metrics{
		peers: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "meshgpu_relay_peers", Help: "Registered peers by connection kind.",
		}, []string{"kind"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshgpu_relay_bytes_total", Help: "WebSocket message bytes by direction.",
		}, []string{"direction"}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshgpu_relay_requests_total", Help: "Relayed requests by entry path and result.",
		}, []string{"path", "result"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "meshgpu_relay_request_duration_seconds",
			Help:    "Time from a relayed request's arrival to its answer, by entry path.",
			Buckets: prometheus.ExponentialBuckets(50e-6, 2, 18),
		}, []string{"path"}),
		unknown: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshgpu_relay_unknown_responses_total", Help: "Responses whose request id was unknown (dropped).",
		}),
		oversize: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshgpu_relay_oversize_closes_total", Help: "Connections closed for an oversized message or frame.",
		}),
		slowDrops: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshgpu_relay_slow_peer_drops_total", Help: "Connections dropped because their send queue was full.",
		}),
		authFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshgpu_relay_auth_failures_total", Help: "Registrations refused (bad signature, wrong peer id, join token).",
		}),
		replacedConns: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshgpu_relay_replaced_connections_total", Help: "Peer connections replaced by a newer connection with the same key.",
		}),
		unauthRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshgpu_relay_unauthenticated_refused_total", Help: "Connections refused before authentication: over the per-source or the relay's limit of unauthenticated connections.",
		}, []string{"limit"}),
	}
	m.tcpObserved = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "meshgpu_relay_tcp_observations_total",
		Help: "TCP path observations (GET /observe) by result (answered, limited)."}, []string{"result"})
	reg.MustRegister(m.tcpObserved, m.peers, m.bytes, m.requests, m.latency, m.unknown, m.oversize, m.slowDrops, m.authFailures, m.replacedConns, m.unauthRefused)
	m.bytesIn, m.bytesOut = m.bytes.WithLabelValues("in"), m.bytes.WithLabelValues("out")
	m.okRequests, m.latencyBy = map[string]prometheus.Counter{}, map[string]prometheus.Observer{}
	for _, e := range entries {
		m.okRequests[e] = m.requests.WithLabelValues(e, "ok")
		m.latencyBy[e] = m.latency.WithLabelValues(e)
	}
	return m
}

package tracker

import (
	"time"

	"meshgpu/tracker/route"
)

// Routing on what the tracker measured (issue 26): a node's
// self-reported ms_per_layer is a hint, bounded, used only until the
// tracker has timed it; then the tracker's own figure replaces it. The
// figure is the time per token per layer of the sessions the tracker
// proxied (and its audits' sessions) through the node: the route's decode
// time after the first token, over the route's layers, averaged
// (exponentially) over sessions. A route's time is its slowest parts', so
// every node of the route is charged the route's per-layer pace; replicas
// of one range are told apart by the routes they are on. An unmeasured
// node counts as fast as the fastest measured node of its variant and no
// faster: it is tried (ties spread requests) but cannot buy traffic with
// a claim.

const (
	measureAlpha   = 0.3     // weight of a new session in the average
	maxMeasured    = 1 << 14 // nodes whose speed is kept
	minHintMsLayer = 0.05    // a hint never claims less than this before measurement
)

type measured struct {
	msPerLayer float64
	sessions   int
}

// observe records a session's decode pace on rt: tokens tokens after the
// first one in d.
func (g *Registry) observe(rt route.Route, tokens int, d time.Duration) {
	layers := 0
	for _, h := range rt.Hops {
		layers += h.EndLayer - h.StartLayer + 1
	}
	if tokens <= 0 || d <= 0 || layers <= 0 {
		return
	}
	ms := float64(d) / float64(time.Millisecond) / float64(tokens) / float64(layers)
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.speeds == nil {
		g.speeds = map[string]*measured{}
	}
	for _, h := range rt.Hops {
		m := g.speeds[h.PeerID]
		switch {
		case m != nil:
			m.msPerLayer += measureAlpha * (ms - m.msPerLayer)
			m.sessions++
		case len(g.speeds) < maxMeasured:
			g.speeds[h.PeerID] = &measured{msPerLayer: ms, sessions: 1}
		}
	}
}

// measuredMs is the tracker's figure for a node (0: not measured).
func (g *Registry) measuredMs(peer string) float64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	if m := g.speeds[peer]; m != nil {
		return m.msPerLayer
	}
	return 0
}

// applyMeasured replaces the nodes' MsPerLayer by what routing may believe:
// the measured figure, else the hint bounded below, and never below the
// fastest measured node of the same variant. Caller holds g.mu.
func (g *Registry) applyMeasured(nodes []route.Node) {
	fastest := map[string]float64{}
	for _, n := range nodes {
		if m := g.speeds[n.PeerID]; m != nil {
			fp := n.Variant.Fingerprint
			if f, ok := fastest[fp]; !ok || m.msPerLayer < f {
				fastest[fp] = m.msPerLayer
			}
		}
	}
	for i := range nodes {
		if m := g.speeds[nodes[i].PeerID]; m != nil {
			nodes[i].MsPerLayer = m.msPerLayer
			continue
		}
		if f, ok := fastest[nodes[i].Variant.Fingerprint]; ok {
			nodes[i].MsPerLayer = f
		} else if nodes[i].MsPerLayer > 0 {
			nodes[i].MsPerLayer = max(nodes[i].MsPerLayer, minHintMsLayer)
		}
	}
}

package tracker

import (
	"time"

	"meshgpu/tracker/route"
)

// Routing on what the tracker measured (issue 26): a node's
// self-reported ms_per_layer is a hint, bounded, used only until the
// tracker has timed it; then the tracker's own figure replaces it. The
// figure is the time per token per layer of the sessions the tracker
// proxied (and its audits' sessions) through the node: from sending the
// request to the route's last token, over its tokens and layers (a head
// that holds its tokens back and bursts them gains nothing), averaged
// (exponentially) over sessions, never below minMeasuredMsLayer. A route's
// time is its slowest parts', so every node of the route is charged the
// route's per-layer pace; replicas of one range are told apart by the
// routes they are on. An unmeasured node counts as fast as the fastest
// measured node of its variant (it is tried, ties spread requests, and a
// claim buys nothing); where none of its variant is measured, the hints
// rank them, each bounded below by minHintMsLayer. Figures are forgotten
// measureTTL after the node's last measured session, and one route in
// exploreEvery prefers the replicas measured slower, so a node measured
// slow once (or busy then) is measured again.

const (
	measureAlpha       = 0.3     // weight of a new session in the average
	maxMeasured        = 1 << 14 // nodes whose speed is kept (the least recently measured go first)
	minHintMsLayer     = 0.05    // a hint never claims less than this before measurement
	minMeasuredMsLayer = 0.01    // nor a measurement (a clock step or an empty answer)
	measureTTL         = 10 * time.Minute
	exploreEvery       = 20
)

type measured struct {
	msPerLayer float64
	sessions   int
	seen       time.Time // the last session measured
}

// observe records a session's pace on rt: tokens tokens in d, from the
// request's sending to the last token.
func (g *Registry) observe(rt route.Route, tokens int, d time.Duration) {
	layers := 0
	for _, h := range rt.Hops {
		layers += h.EndLayer - h.StartLayer + 1
	}
	if tokens <= 0 || d <= 0 || layers <= 0 {
		return
	}
	ms := max(float64(d)/float64(time.Millisecond)/float64(tokens)/float64(layers), minMeasuredMsLayer)
	now := g.clock()
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.speeds == nil {
		g.speeds = map[string]*measured{}
	}
	for _, h := range rt.Hops {
		m := g.speeds[h.PeerID]
		if m != nil && now.Sub(m.seen) > measureTTL {
			m = nil // forgotten: start again
		}
		if m != nil {
			m.msPerLayer += measureAlpha * (ms - m.msPerLayer)
			m.sessions++
			m.seen = now
			continue
		}
		if _, ok := g.speeds[h.PeerID]; !ok && len(g.speeds) >= maxMeasured {
			g.evictMeasured(now)
		}
		g.speeds[h.PeerID] = &measured{msPerLayer: ms, sessions: 1, seen: now}
	}
}

// evictMeasured makes room: the expired figures go, else the least
// recently measured one. Caller holds g.mu.
func (g *Registry) evictMeasured(now time.Time) {
	oldest, at := "", now
	for id, m := range g.speeds {
		if now.Sub(m.seen) > measureTTL {
			delete(g.speeds, id)
			continue
		}
		if m.seen.Before(at) || oldest == "" {
			oldest, at = id, m.seen
		}
	}
	if len(g.speeds) >= maxMeasured {
		delete(g.speeds, oldest)
	}
}

// measuredMs is the tracker's figure for a node (0: not measured, or
// forgotten).
func (g *Registry) measuredMs(peer string) float64 {
	now := g.clock()
	g.mu.Lock()
	defer g.mu.Unlock()
	if m := g.current(peer, now); m != nil {
		return m.msPerLayer
	}
	return 0
}

// current is peer's unexpired figure. Caller holds g.mu.
func (g *Registry) current(peer string, now time.Time) *measured {
	if m := g.speeds[peer]; m != nil && now.Sub(m.seen) <= measureTTL {
		return m
	}
	return nil
}

// applyMeasured replaces the nodes' MsPerLayer by what routing may believe:
// the measured figure, else the hint bounded below, and never below the
// fastest measured node of the same variant; on one call in exploreEvery
// the replicas measured slower than their variant's fastest come first
// (they are measured again).
// Caller holds g.mu.
func (g *Registry) applyMeasured(nodes []route.Node) {
	now := g.clock()
	g.routed++
	explore := g.routed%exploreEvery == 0
	fastest := map[string]float64{}
	for _, n := range nodes {
		if m := g.current(n.PeerID, now); m != nil {
			fp := n.Variant.Fingerprint
			if f, ok := fastest[fp]; !ok || m.msPerLayer < f {
				fastest[fp] = m.msPerLayer
			}
		}
	}
	for i := range nodes {
		if m := g.current(nodes[i].PeerID, now); m != nil {
			nodes[i].MsPerLayer = m.msPerLayer
			if f := fastest[nodes[i].Variant.Fingerprint]; explore && m.msPerLayer > f {
				nodes[i].MsPerLayer = f / 2 // the slower replicas' turn
			}
			continue
		}
		if f, ok := fastest[nodes[i].Variant.Fingerprint]; ok {
			nodes[i].MsPerLayer = f
		} else if nodes[i].MsPerLayer > 0 {
			nodes[i].MsPerLayer = max(nodes[i].MsPerLayer, minHintMsLayer)
		}
	}
}

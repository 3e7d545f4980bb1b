// Package route is the tracker's pure planning: the availability map of a
// model's layers, the assignment of a layer range to a joining node, and the
// cheapest chain of nodes covering every layer once (ADR-0011, ADR-0013).
// Nothing here does I/O or reads a clock, so simulations are deterministic.
package route

import (
	"cmp"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"sort"

	"meshgpu/wire"
)

// Node is what planning knows about one serving node.
type Node struct {
	PeerID    string
	Endpoint  string // http://host:port, empty for relay-only nodes
	RelayAddr string // ws(s)://relay/rpc/{peer_id}, optional
	First     int    // first layer held (inclusive)
	Last      int    // last layer held (inclusive)
	// MsPerLayer is the node's measured compute time for one layer of one
	// decode step; 0 means unknown (Config.DefaultMsPerLayer).
	MsPerLayer float64
	// RPM1 is the hops per minute the node served over the last minute.
	RPM1 float64
	// InFlight is the generations (or hops) at the node now: the tracker's
	// own count and what the last heartbeat reported running and queued.
	// Each one's step runs before or beside a new one's, so a hop waits
	// about InFlight x its compute time: the term that spreads concurrent
	// load over equal replicas, whatever RPM1 says.
	InFlight float64
	// RTTMs is the network round trip to the node; 0 means unknown
	// (Config.DirectRTTMs, or Config.RelayRTTMs for relay-only nodes).
	RTTMs float64
	// Variant is the weights the node holds; a route runs on nodes of one
	// variant only (the fingerprint decides, the label is for people).
	Variant wire.Variant
	// NumLayers is the layer count of the node's variant (each variant has
	// its own, as its config says); 0: the count Find is given.
	NumLayers int
}

// Layers is the number of layers the node holds.
func (n Node) Layers() int { return n.Last - n.First + 1 }

// Config holds the cost model's constants. The zero value uses defaults.
type Config struct {
	DefaultMsPerLayer float64 // default 1
	DirectRTTMs       float64 // default 1
	RelayRTTMs        float64 // default 10
	// MaxUtilization caps the load factor 1/(1-u); default 0.9 (factor 10).
	MaxUtilization float64
}

func (c Config) withDefaults() Config {
	if c.DefaultMsPerLayer <= 0 {
		c.DefaultMsPerLayer = 1
	}
	if c.DirectRTTMs <= 0 {
		c.DirectRTTMs = 1
	}
	if c.RelayRTTMs <= 0 {
		c.RelayRTTMs = 10
	}
	if c.MaxUtilization <= 0 || c.MaxUtilization >= 1 {
		c.MaxUtilization = 0.9
	}
	return c
}

func (c Config) msPerLayer(n Node) float64 {
	if n.MsPerLayer > 0 {
		return n.MsPerLayer
	}
	return c.DefaultMsPerLayer
}

func (c Config) rtt(n Node) float64 {
	switch {
	case n.RTTMs > 0:
		return n.RTTMs
	case n.Endpoint == "" && n.RelayAddr != "":
		return c.RelayRTTMs
	default:
		return c.DirectRTTMs
	}
}

// loadFactor is the expected slowdown of a node from its load: with
// utilization u = RPM1 / capacity, where capacity is the hops per minute the
// node can serve running its whole range, a queue makes a hop take
// 1/(1-u) times its compute time (M/M/1), capped at MaxUtilization.
func (c Config) loadFactor(n Node) float64 {
	capacity := 60000 / (c.msPerLayer(n) * float64(n.Layers()))
	u := min(n.RPM1/capacity, c.MaxUtilization)
	if u < 0 {
		u = 0
	}
	return 1 / (1 - u)
}

// Throughput is a node's layer rate in layers per second, the weight it
// adds to the coverage of each layer it holds.
func (c Config) Throughput(n Node) float64 { return 1000 / c.withDefaults().msPerLayer(n) }

// Validate checks a node's range against a model of numLayers layers.
func (n Node) Validate(numLayers int) error {
	if numLayers <= 0 {
		return fmt.Errorf("model has %d layers", numLayers)
	}
	if n.First < 0 || n.Last < n.First || n.Last >= numLayers {
		return fmt.Errorf("layer range %d-%d is impossible for a model of %d layers (want 0 <= first <= last <= %d)", n.First, n.Last, numLayers, numLayers-1)
	}
	return nil
}

// HopCost is the expected time of one hop, in milliseconds.
type HopCost struct {
	ComputeMs float64 `json:"compute_ms"` // layers x ms per layer
	NetworkMs float64 `json:"network_ms"` // round trip estimate
	LoadMs    float64 `json:"load_ms"`    // queueing: RPM vs capacity, and the work in flight at the node
}

// Total is the hop's expected time.
func (h HopCost) Total() float64 { return h.ComputeMs + h.NetworkMs + h.LoadMs }

// Route is a chain covering layers 0..L-1 exactly once; Hops[0] is the
// head. Every hop's node is of Variant.
type Route struct {
	Hops    []wire.Hop   `json:"hops"`
	Costs   []HopCost    `json:"costs"`
	TotalMs float64      `json:"total_ms"`
	Variant wire.Variant `json:"variant,omitzero"`
	// DirectReplies: the route's ticket names the head's address (its
	// hop's endpoint and relay, the ones it registered and is reached at),
	// so the tail sends its answers straight to the head. The registry
	// sets it when every node on the route can read such a ticket.
	DirectReplies bool `json:"direct_replies,omitempty"`
}

// Options are per-request choices.
type Options struct {
	// Seed breaks ties between equally cheap routes, so requests with
	// different seeds spread over equal replicas deterministically.
	Seed uint64
	// Exclude reports nodes not to use (banned); nil excludes none.
	Exclude func(peerID string) bool
	// Variant, when not nil, is the fingerprint of the only variant to
	// route over (a generation that has streamed tokens stays on its
	// weights); nil routes over each variant and returns the cheapest.
	Variant *string
}

// ErrNoRoute means the usable nodes do not cover every layer.
var ErrNoRoute = errors.New("no route: the available nodes do not cover every layer")

// Find returns the cheapest route over nodes for a model of numLayers
// layers (or each variant's Node.NumLayers), within one variant: nodes holding different weights never share
// a route. Without Options.Variant each variant is routed on its own and
// the cheapest route wins (equal costs: the seed decides, as between
// replicas). Within a variant it is a shortest path over layer boundaries
// 0..L: from boundary b any node holding layer b may run layers b..e-1 for
// any e-1 within its range (entering mid-range through
// X-Meshnet-Start-Layer), at cost (e-b) x ms/layer x load factor + RTT.
// The graph is a DAG in boundary order, so one forward pass finds the
// optimum; the head therefore always holds layer 0.
func Find(nodes []Node, numLayers int, opt Options, cfg Config) (Route, error) {
	if numLayers <= 0 {
		return Route{}, fmt.Errorf("model has %d layers", numLayers)
	}
	cfg = cfg.withDefaults()
	var best Route
	var bestKey uint64
	found := false
	for _, group := range ByVariant(nodes, opt.Variant) {
		r, key, ok := find(group, cmp.Or(group[0].NumLayers, numLayers), opt, cfg)
		if !ok {
			continue
		}
		eps := 1e-9 * max(1, r.TotalMs)
		if !found || r.TotalMs < best.TotalMs-eps || (r.TotalMs <= best.TotalMs+eps && key < bestKey) {
			best, bestKey, found = r, key, true
		}
	}
	if !found {
		return Route{}, ErrNoRoute
	}
	return best, nil
}

// ByVariant splits nodes by variant fingerprint, in fingerprint order
// (only the nodes of *only when it is not nil). A mesh of one variant is
// returned as it is, without copying.
func ByVariant(nodes []Node, only *string) [][]Node {
	if len(nodes) == 0 {
		return nil
	}
	one := true
	for i := range nodes {
		if nodes[i].Variant.Fingerprint != nodes[0].Variant.Fingerprint {
			one = false
			break
		}
	}
	if one && (only == nil || len(nodes) == 0 || nodes[0].Variant.Fingerprint == *only) {
		return [][]Node{nodes}
	}
	groups := map[string][]Node{}
	for _, n := range nodes {
		if only == nil || n.Variant.Fingerprint == *only {
			groups[n.Variant.Fingerprint] = append(groups[n.Variant.Fingerprint], n)
		}
	}
	keys := make([]string, 0, len(groups))
	for k := range groups {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	out := make([][]Node, len(keys))
	for i, k := range keys {
		out[i] = groups[k]
	}
	return out
}

// find is the shortest path over nodes (all of one variant); it returns
// the route, its tie-breaking key and whether one exists.
func find(nodes []Node, numLayers int, opt Options, cfg Config) (Route, uint64, bool) {
	type edgeCost struct{ perLayer, load, queue, rtt float64 }
	costs := make([]edgeCost, len(nodes))
	keys := make([]uint64, len(nodes))
	cover := make([][]int, numLayers) // cover[b]: usable nodes holding layer b
	for i, n := range nodes {
		if n.Validate(numLayers) != nil || (opt.Exclude != nil && opt.Exclude(n.PeerID)) {
			continue
		}
		ms := cfg.msPerLayer(n)
		costs[i] = edgeCost{perLayer: ms, load: ms * (cfg.loadFactor(n) - 1), queue: max(n.InFlight, 0) * ms * float64(n.Layers()), rtt: cfg.rtt(n)}
		keys[i] = tieKey(opt.Seed, n.PeerID)
		for b := n.First; b <= n.Last; b++ {
			cover[b] = append(cover[b], i)
		}
	}
	inf := math.Inf(1)
	dist := make([]float64, numLayers+1)
	pathKey := make([]uint64, numLayers+1) // tie-breaker of the best path so far
	prevB := make([]int, numLayers+1)
	prevN := make([]int, numLayers+1)
	for i := range dist {
		dist[i] = inf
	}
	dist[0] = 0
	for b := 0; b < numLayers; b++ {
		if math.IsInf(dist[b], 1) {
			continue
		}
		for _, i := range cover[b] {
			c := costs[i]
			k := mix(pathKey[b], keys[i])
			for e := b + 1; e <= nodes[i].Last+1; e++ {
				d := dist[b] + float64(e-b)*(c.perLayer+c.load) + c.queue + c.rtt
				eps := 1e-9 * max(1, d)
				if d < dist[e]-eps || (d <= dist[e]+eps && k < pathKey[e]) {
					dist[e], pathKey[e], prevB[e], prevN[e] = d, k, b, i
				}
			}
		}
	}
	if math.IsInf(dist[numLayers], 1) {
		return Route{}, 0, false
	}
	r := Route{Variant: nodes[0].Variant}
	for e := numLayers; e > 0; e = prevB[e] {
		b, n := prevB[e], nodes[prevN[e]]
		c := costs[prevN[e]]
		layers := float64(e - b)
		r.Hops = append(r.Hops, wire.Hop{PeerID: n.PeerID, Endpoint: n.Endpoint, RelayAddr: n.RelayAddr, StartLayer: b, EndLayer: e - 1})
		r.Costs = append(r.Costs, HopCost{ComputeMs: layers * c.perLayer, NetworkMs: c.rtt, LoadMs: layers*c.load + c.queue})
	}
	for i, j := 0, len(r.Hops)-1; i < j; i, j = i+1, j-1 {
		r.Hops[i], r.Hops[j] = r.Hops[j], r.Hops[i]
		r.Costs[i], r.Costs[j] = r.Costs[j], r.Costs[i]
	}
	r.TotalMs = dist[numLayers]
	return r, pathKey[numLayers], true
}

func tieKey(seed uint64, peerID string) uint64 {
	h := fnv.New64a()
	var b [8]byte
	for i := range b {
		b[i] = byte(seed >> (8 * i))
	}
	h.Write(b[:])
	h.Write([]byte(peerID))
	return h.Sum64()
}

// mix combines a path's key with the next node's key (splitmix64 finalizer).
func mix(a, b uint64) uint64 {
	z := a ^ (b + 0x9e3779b97f4a7c15 + (a << 6) + (a >> 2))
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// Check verifies that r covers layers 0..numLayers-1 exactly once, in
// order, each hop inside its node's range and of the route's variant: the
// tests' guard on every route the planner returns.
func Check(r Route, numLayers int, nodes map[string]Node) error {
	next := 0
	for i, h := range r.Hops {
		if h.StartLayer != next {
			return fmt.Errorf("hop %d starts at layer %d, want %d", i, h.StartLayer, next)
		}
		if h.EndLayer < h.StartLayer {
			return fmt.Errorf("hop %d has end %d before start %d", i, h.EndLayer, h.StartLayer)
		}
		if n, ok := nodes[h.PeerID]; ok && (h.StartLayer < n.First || h.EndLayer > n.Last) {
			return fmt.Errorf("hop %d runs %d-%d outside %s's range %d-%d", i, h.StartLayer, h.EndLayer, h.PeerID, n.First, n.Last)
		} else if !ok && nodes != nil {
			return fmt.Errorf("hop %d names unknown node %s", i, h.PeerID)
		} else if ok && !n.Variant.Same(r.Variant) {
			return fmt.Errorf("hop %d runs on %s of variant %v in a route of variant %v", i, h.PeerID, n.Variant, r.Variant)
		}
		next = h.EndLayer + 1
	}
	if next != numLayers {
		return fmt.Errorf("route ends at layer %d, want %d", next-1, numLayers-1)
	}
	return nil
}

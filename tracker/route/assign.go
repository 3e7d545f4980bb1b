package route

import (
	"errors"
	"fmt"
	"math"
	"sort"
)

// NodeRef is one node in a layer's coverage.
type NodeRef struct {
	PeerID     string  `json:"peer_id"`
	Throughput float64 `json:"throughput"` // layers per second
}

// LayerCoverage is one entry of the availability map.
type LayerCoverage struct {
	Layer      int       `json:"layer"`
	Replicas   int       `json:"replicas"`
	Throughput float64   `json:"throughput"` // sum over the nodes, layers per second
	Nodes      []NodeRef `json:"nodes"`
}

// Coverage is the availability map: for each layer, the nodes holding it
// and their throughput. Nodes with impossible ranges are skipped.
func Coverage(nodes []Node, numLayers int, cfg Config) []LayerCoverage {
	m := make([]LayerCoverage, max(numLayers, 0))
	for l := range m {
		m[l] = LayerCoverage{Layer: l, Nodes: []NodeRef{}}
	}
	for _, n := range nodes {
		if n.Validate(numLayers) != nil {
			continue
		}
		w := cfg.Throughput(n)
		for l := n.First; l <= n.Last; l++ {
			m[l].Replicas++
			m[l].Throughput += w
			m[l].Nodes = append(m[l].Nodes, NodeRef{PeerID: n.PeerID, Throughput: w})
		}
	}
	return m
}

// Footprint is what a joining node can hold.
type Footprint struct {
	Budget            int64 // bytes the node may use for the model
	BytesPerLayer     int64 // weights of one transformer layer (the largest, when LayerBytes differ)
	KVReservePerLayer int64 // KV cache reserved per layer held
	EmbedBytes        int64 // extra when the range includes layer 0
	HeadBytes         int64 // extra (final norm + LM head) when it includes the last layer
	// LayerBytes, when it has an entry per layer, is each layer's weights
	// as stored (a quantized file's layers differ) and replaces
	// BytesPerLayer.
	LayerBytes []int64
}

// layer is the weights of layer l.
func (f Footprint) layer(l, numLayers int) int64 {
	if len(f.LayerBytes) == numLayers {
		return f.LayerBytes[l]
	}
	return f.BytesPerLayer
}

// Bytes is the memory the range first..last needs.
func (f Footprint) Bytes(first, last, numLayers int) int64 {
	var b int64
	for l := first; l <= last; l++ {
		b = addSat(b, addSat(f.layer(l, numLayers), f.KVReservePerLayer))
	}
	if first == 0 {
		b = addSat(b, f.EmbedBytes)
	}
	if last == numLayers-1 {
		b = addSat(b, f.HeadBytes)
	}
	return b
}

// addSat adds non-negative byte counts, stopping at the largest int64: a
// node's figures are its claims and must not wrap around to fit.
func addSat(a, b int64) int64 {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}

// MaxFootprintBytes bounds every figure of a footprint (1 PiB), so sums
// over a model's layers stay far from overflow.
const MaxFootprintBytes = 1 << 50

// Validate rejects footprints that cannot describe a real node.
func (f Footprint) Validate() error {
	if f.Budget <= 0 || f.BytesPerLayer <= 0 || f.KVReservePerLayer < 0 || f.EmbedBytes < 0 || f.HeadBytes < 0 {
		return errors.New("memory budget and bytes per layer must be positive, reserves non-negative")
	}
	figures := append([]int64{f.Budget, f.BytesPerLayer, f.KVReservePerLayer, f.EmbedBytes, f.HeadBytes}, f.LayerBytes...)
	for _, b := range figures {
		if b < 0 || b > MaxFootprintBytes {
			return fmt.Errorf("memory figures must be between 0 and %d bytes", int64(MaxFootprintBytes))
		}
	}
	return nil
}

// Assignment is the range chosen for a node and why.
type Assignment struct {
	First int `json:"first"`
	Last  int `json:"last"`
	// NewlyCovered is how many layers of the range had no replica.
	NewlyCovered int `json:"newly_covered"`
	// Gain is the throughput-weighted improvement of the covered layers:
	// sum over the range's covered layers of ln(1 + w/T[l]), where w is the
	// node's throughput and T[l] the layer's current throughput.
	Gain float64 `json:"gain"`
}

// ErrDoesNotFit means the budget cannot hold even one layer.
var ErrDoesNotFit = errors.New("memory budget cannot hold a single layer with its KV reserve")

// Assign picks the contiguous range for a node with footprint fp and
// per-layer time msPerLayer (0: unknown), given the nodes already serving.
//
// For every start layer the candidate is the longest range that fits the
// budget. Candidates are ranked first by NewlyCovered (uncovered layers
// come first: a model with a gap serves nobody), then by Gain, which is the
// increase of sum_l ln(T[l]) over the layers already covered (proportional
// fairness: adding w to a weak layer gains more than to a strong one, and a
// faster node gains more everywhere), then by the lower start layer.
func Assign(nodes []Node, numLayers int, fp Footprint, msPerLayer float64, cfg Config) (Assignment, error) {
	if numLayers <= 0 {
		return Assignment{}, fmt.Errorf("model has %d layers", numLayers)
	}
	if err := fp.Validate(); err != nil {
		return Assignment{}, err
	}
	if len(fp.LayerBytes) != 0 && len(fp.LayerBytes) != numLayers {
		return Assignment{}, fmt.Errorf("layer bytes has %d entries for a model of %d layers", len(fp.LayerBytes), numLayers)
	}
	cov := Coverage(nodes, numLayers, cfg)
	w := cfg.Throughput(Node{MsPerLayer: msPerLayer})
	// Prefix sums make each candidate O(1): uncovered[l] counts the
	// uncovered layers below l, gain[l] sums ln(1 + w/T) below l.
	uncovered := make([]int, numLayers+1)
	gain := make([]float64, numLayers+1)
	for l, c := range cov {
		uncovered[l+1], gain[l+1] = uncovered[l], gain[l]
		if c.Throughput <= 0 {
			uncovered[l+1]++
		} else {
			gain[l+1] += math.Log1p(w / c.Throughput)
		}
	}
	// need[l] is the bytes of layers 0..l-1 with their KV reserve, so a
	// range's weights are a difference and its longest fit a search.
	need := make([]int64, numLayers+1)
	for l := range numLayers {
		need[l+1] = addSat(need[l], addSat(fp.layer(l, numLayers), fp.KVReservePerLayer))
	}
	best := Assignment{First: -1}
	for s := 0; s < numLayers; s++ {
		room := fp.Budget
		if s == 0 {
			room -= fp.EmbedBytes
		}
		// The longest range from s that fits; one reaching the last layer
		// also pays the head, and if that misfits it stops one layer short.
		e := s - 1 + sort.Search(numLayers-s, func(k int) bool { return need[s+k+1]-need[s] > room })
		if e == numLayers-1 && fp.Bytes(s, e, numLayers) > fp.Budget {
			e--
		}
		if e < s {
			continue
		}
		a := Assignment{First: s, Last: e, NewlyCovered: uncovered[e+1] - uncovered[s], Gain: gain[e+1] - gain[s]}
		if best.First < 0 || a.NewlyCovered > best.NewlyCovered ||
			(a.NewlyCovered == best.NewlyCovered && a.Gain > best.Gain+1e-9) {
			best = a
		}
	}
	if best.First < 0 {
		return Assignment{}, ErrDoesNotFit
	}
	return best, nil
}

// Rebalance decides whether node nodes[mover] should move: only when some
// layer has no replica, and every layer the mover holds keeps at least
// minReplicas-1 others without it (default minReplicas 3). It returns the
// new range and true when moving covers at least one uncovered layer.
func Rebalance(nodes []Node, mover int, numLayers int, fp Footprint, minReplicas int, cfg Config) (Assignment, bool) {
	if mover < 0 || mover >= len(nodes) || numLayers <= 0 {
		return Assignment{}, false
	}
	if minReplicas <= 0 {
		minReplicas = 3
	}
	cov := Coverage(nodes, numLayers, cfg)
	gap := false
	for _, c := range cov {
		if c.Replicas == 0 {
			gap = true
			break
		}
	}
	m := nodes[mover]
	if !gap || m.Validate(numLayers) != nil {
		return Assignment{}, false
	}
	for l := m.First; l <= m.Last; l++ {
		if cov[l].Replicas < minReplicas {
			return Assignment{}, false
		}
	}
	others := make([]Node, 0, len(nodes)-1)
	others = append(others, nodes[:mover]...)
	others = append(others, nodes[mover+1:]...)
	a, err := Assign(others, numLayers, fp, m.MsPerLayer, cfg)
	if err != nil || a.NewlyCovered == 0 {
		return Assignment{}, false
	}
	return a, true
}

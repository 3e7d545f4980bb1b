package tracker

import (
	"cmp"
	"context"
	"fmt"
	"time"
)

// A model's shape (its layer count) is not decided by whoever registers
// first: a registration claiming 7 layers of a model whose honest nodes
// have 8, made before them (right after a tracker restart), used to make
// every honest node's registration a 409.
//
// The layer count belongs to a variant: the fingerprint hashes the model's
// config, layer count included (model.VariantOf), so two fingerprints of
// one model name never contradict each other; each is routed with its
// own count. Within one fingerprint two counts cannot both be true: one
// side lies about its weights. Neither is refused; the count the proven
// side holds is routed and the other gives way (stays registered,
// heartbeats, is told why it is not routable), so a squatter cannot lock
// the name. See electShapes for who counts as proven.

// shapeKey is a model's variant, the unit a layer count belongs to.
type shapeKey struct{ model, fingerprint string }

func keyOf(r *NodeRecord) shapeKey { return shapeKey{r.Model, r.Variant.Fingerprint} }

// electShapes returns, per model variant whose live nodes disagree on the
// layer count, the count routed; a variant whose nodes agree is absent
// (the common case costs one pass and no allocation beyond the map).
// The count wins that has, in order: more proven nodes (a passing or
// trusted audit record: replicas or the operator vouched for their
// work), more distinct source addresses (identities are free, addresses
// are bounded by MaxNodesPerSource), more nodes, the earliest registration
// (a serving mesh is not flipped by one newcomer).
func (g *Registry) electShapes(nodes []NodeRecord, statuses func() map[string]NodeStatus) map[shapeKey]int {
	first := map[shapeKey]int{}
	var conflicts map[shapeKey]bool
	var last shapeKey
	lastN := -1
	for i := range nodes {
		k := keyOf(&nodes[i])
		if k == last && nodes[i].NumLayers == lastN {
			continue // the usual mesh: one variant, one count, no map lookup
		}
		last, lastN = k, nodes[i].NumLayers
		if n, ok := first[k]; !ok {
			first[k] = nodes[i].NumLayers
		} else if n != nodes[i].NumLayers {
			if conflicts == nil {
				conflicts = map[shapeKey]bool{}
			}
			conflicts[k] = true
		}
	}
	if conflicts == nil {
		return nil
	}
	st := statuses()
	type score struct {
		proven, nodes int
		sources       map[string]bool
		earliest      time.Time
	}
	scores := map[shapeKey]map[int]*score{}
	for i := range nodes {
		r := &nodes[i]
		k := keyOf(r)
		if !conflicts[k] {
			continue
		}
		if scores[k] == nil {
			scores[k] = map[int]*score{}
		}
		s := scores[k][r.NumLayers]
		if s == nil {
			s = &score{sources: map[string]bool{}, earliest: r.RegisteredAt}
			scores[k][r.NumLayers] = s
		}
		if a := st[r.PeerID].Audit; g.trusted[r.PeerID] || a == AuditPassed || a == AuditTrusted {
			s.proven++
		}
		s.nodes++
		s.sources[r.Source] = true
		if r.RegisteredAt.Before(s.earliest) {
			s.earliest = r.RegisteredAt
		}
	}
	out := make(map[shapeKey]int, len(scores))
	for k, byCount := range scores {
		best, bs := 0, (*score)(nil)
		for n, s := range byCount {
			if bs == nil {
				best, bs = n, s
				continue
			}
			c := cmp.Or(cmp.Compare(s.proven, bs.proven), cmp.Compare(len(s.sources), len(bs.sources)), cmp.Compare(s.nodes, bs.nodes),
				bs.earliest.Compare(s.earliest), cmp.Compare(best, n)) // last: the smaller count, so the order of a map does not decide
			if c > 0 {
				best, bs = n, s
			}
		}
		out[k] = best
	}
	return out
}

// shaped returns nodes without those giving way to their variant's
// elected layer count (a copy only when some do). Every reader that
// routes, maps, assigns or audits goes through it.
func (g *Registry) shaped(nodes []NodeRecord, statuses func() map[string]NodeStatus) []NodeRecord {
	won := g.electShapes(nodes, statuses)
	if won == nil {
		return nodes
	}
	out := make([]NodeRecord, 0, len(nodes))
	for _, r := range nodes {
		if n, ok := won[keyOf(&r)]; !ok || n == r.NumLayers {
			out = append(out, r)
		}
	}
	return out
}

// givesWay says why rec is not routed because of its layer count ("" when
// it is not giving way).
func (g *Registry) givesWay(nodes []NodeRecord, rec NodeRecord, statuses func() map[string]NodeStatus) string {
	if n, ok := g.electShapes(nodes, statuses)[keyOf(&rec)]; ok && n != rec.NumLayers {
		return fmt.Sprintf("other nodes of model %s, variant %s, hold it with %d layers, not %d (the fingerprint hashes the layer count: one side's weights are not what it says); this node is kept registered but not routed",
			rec.Model, rec.Variant, n, rec.NumLayers)
	}
	return ""
}

// statusesOf reads the audit statuses once, when electShapes needs them (a
// store error elects without proofs: other reads report it).
func (g *Registry) statusesOf(ctx context.Context) func() map[string]NodeStatus {
	var st map[string]NodeStatus
	return func() map[string]NodeStatus {
		if st == nil {
			st, _ = g.store.Statuses(ctx)
			if st == nil {
				st = map[string]NodeStatus{}
			}
		}
		return st
	}
}

// shapeCounts notices, in one pass and without allocating for a mesh of
// one variant, whether two records of one variant disagree on the count.
type shapeCounts struct {
	fp0      string
	n0       int // 0: nothing added yet
	others   map[string]int
	conflict bool
}

func (c *shapeCounts) add(r *NodeRecord) {
	fp, n := r.Variant.Fingerprint, r.NumLayers
	switch {
	case c.n0 == 0:
		c.fp0, c.n0 = fp, n
	case fp == c.fp0:
		c.conflict = c.conflict || n != c.n0
	default:
		if c.others == nil {
			c.others = map[string]int{}
		}
		if m, ok := c.others[fp]; !ok {
			c.others[fp] = n
		} else if m != n {
			c.conflict = true
		}
	}
}

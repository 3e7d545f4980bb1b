package tracker

import (
	"cmp"
	"context"
	"fmt"
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
// the name. See electShapes for who counts as proven; when neither side
// is ahead, neither is routed (registering first wins nothing).

// shapeKey is a model's variant, the unit a layer count belongs to.
type shapeKey struct{ model, fingerprint string }

func keyOf(r *NodeRecord) shapeKey { return shapeKey{r.Model, r.Variant.Fingerprint} }

// electShapes returns, per model variant whose live nodes disagree on the
// layer count, the count routed; a variant whose nodes agree is absent
// (the common case costs one pass and no allocation beyond the map).
// keep, when not nil, says which of nodes count (the others are ignored).
// The count wins that has, in order: more proven nodes (a passing or
// trusted audit record: replicas or the operator vouched for their
// work), more distinct source addresses (identities are free, addresses
// are bounded by MaxNodesPerSource), more nodes. When two counts tie on
// all three the variant elects 0: neither is routed. The tracker cannot
// tell the liar from the honest side then (registrations carry a hash of
// the config, not the config), and the earliest registration, which
// used to win, is whoever registers first after a restart.
func (g *Registry) electShapes(nodes []NodeRecord, keep func(*NodeRecord) bool, statuses func() map[string]NodeStatus) map[shapeKey]int {
	first := map[shapeKey]int{}
	var conflicts map[shapeKey]bool
	var last shapeKey
	lastN := -1
	for i := range nodes {
		if keep != nil && !keep(&nodes[i]) {
			continue
		}
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
	}
	scores := map[shapeKey]map[int]*score{}
	for i := range nodes {
		r := &nodes[i]
		k := keyOf(r)
		if !conflicts[k] || keep != nil && !keep(r) {
			continue
		}
		if scores[k] == nil {
			scores[k] = map[int]*score{}
		}
		s := scores[k][r.NumLayers]
		if s == nil {
			s = &score{sources: map[string]bool{}}
			scores[k][r.NumLayers] = s
		}
		if a := st[r.PeerID].Audit; g.trusted[r.PeerID] || a == AuditPassed || a == AuditTrusted {
			s.proven++
		}
		s.nodes++
		s.sources[r.Source] = true
	}
	out := make(map[shapeKey]int, len(scores))
	for k, byCount := range scores {
		best, bs, tied := 0, (*score)(nil), false
		for n, s := range byCount {
			if bs == nil {
				best, bs = n, s
				continue
			}
			switch c := cmp.Or(cmp.Compare(s.proven, bs.proven), cmp.Compare(len(s.sources), len(bs.sources)), cmp.Compare(s.nodes, bs.nodes)); {
			case c > 0:
				best, bs, tied = n, s, false
			case c == 0:
				tied = true
			}
		}
		if tied {
			best = 0
		}
		out[k] = best
	}
	return out
}

// shaped returns nodes without those giving way to their variant's
// elected layer count (a copy only when some do). Every reader that
// routes, maps, assigns or audits goes through it.
func (g *Registry) shaped(nodes []NodeRecord, statuses func() map[string]NodeStatus) []NodeRecord {
	won := g.electShapes(nodes, nil, statuses)
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
	n, ok := g.electShapes(nodes, nil, statuses)[keyOf(&rec)]
	if ok && n == 0 {
		return shapeTie(rec.Model, rec.Variant.String())
	}
	if ok && n != rec.NumLayers {
		return fmt.Sprintf("other nodes of model %s, variant %s, hold it with %d layers, not %d (the fingerprint hashes the layer count: one side's weights are not what it says); this node is kept registered but not routed",
			rec.Model, rec.Variant, n, rec.NumLayers)
	}
	return ""
}

// typeShapeTie is the error type of a route refused because the model's
// layer count ties.
const typeShapeTie = "layer_count_tied"

// shapeTie says why no node of a variant whose layer count is tied is routed.
func shapeTie(model, variant string) string {
	return fmt.Sprintf("the nodes of model %s, variant %s, disagree on its layer count and neither side has more proven nodes, source addresses or nodes: neither is routed (the fingerprint hashes the layer count: one side's weights are not what it says) until one side is ahead (more nodes or addresses, a passed audit on record, the operator's --audit-trusted)",
		model, variant)
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

package route

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// simNode is a simulated joiner: a memory budget and a speed.
type simNode struct {
	id         string
	budget     int64
	msPerLayer float64
}

func simPopulation(n int, seed uint64) []simNode {
	rng := rand.New(rand.NewPCG(seed, 99))
	pop := make([]simNode, n)
	for i := range pop {
		pop[i] = simNode{
			id:         fmt.Sprintf("mg-sim%04d", i),
			budget:     int64(2+rng.IntN(23)) * gib / 2, // 1 to 12 GiB
			msPerLayer: 0.2 + rng.Float64()*4.8,         // 0.2 to 5 ms
		}
	}
	return pop
}

// simFootprint is an 8B-like layer: 0.4 GiB weights, 0.1 GiB KV reserve,
// 1 GiB embeddings and 1 GiB LM head.
func simFootprint(budget int64) Footprint {
	return Footprint{Budget: budget, BytesPerLayer: 2 * gib / 5, KVReservePerLayer: gib / 10, EmbedBytes: gib, HeadBytes: gib}
}

// simulateJoins lets n seeded nodes join one by one through Assign.
func simulateJoins(tb testing.TB, n, numLayers int, seed uint64) []Node {
	tb.Helper()
	var nodes []Node
	for _, s := range simPopulation(n, seed) {
		a, err := Assign(nodes, numLayers, simFootprint(s.budget), s.msPerLayer, Config{})
		if err != nil {
			tb.Fatalf("%s: %v", s.id, err)
		}
		if got := simFootprint(s.budget).Bytes(a.First, a.Last, numLayers); got > s.budget {
			tb.Fatalf("%s assigned %d-%d needing %d bytes over its budget %d", s.id, a.First, a.Last, got, s.budget)
		}
		nodes = append(nodes, Node{PeerID: s.id, Endpoint: "http://" + s.id, First: a.First, Last: a.Last, MsPerLayer: s.msPerLayer})
	}
	return nodes
}

func TestSimulation(t *testing.T) {
	for _, tc := range []struct{ nodes, layers int }{{50, 32}, {500, 80}} {
		t.Run(fmt.Sprintf("%dnodes_%dlayers", tc.nodes, tc.layers), func(t *testing.T) {
			nodes := simulateJoins(t, tc.nodes, tc.layers, uint64(tc.nodes))
			byID := map[string]Node{}
			var popMs float64
			for _, n := range nodes {
				byID[n.PeerID] = n
				popMs += n.MsPerLayer
			}
			popMs /= float64(len(nodes))

			// Enough total memory (1-12 GiB each): every layer is covered.
			for _, c := range Coverage(nodes, tc.layers, Config{}) {
				if c.Replicas == 0 {
					t.Fatalf("layer %d uncovered after %d joins", c.Layer, tc.nodes)
				}
			}

			// Idle mesh: every route is valid, and the layers it runs are on
			// faster nodes than the population's mean.
			var routeMs, routeLayers float64
			for seed := uint64(0); seed < 50; seed++ {
				r, err := Find(nodes, tc.layers, Options{Seed: seed}, Config{})
				if err != nil {
					t.Fatal(err)
				}
				if err := Check(r, tc.layers, byID); err != nil {
					t.Fatal(err)
				}
				for _, h := range r.Hops {
					n := float64(h.EndLayer - h.StartLayer + 1)
					routeMs += n * byID[h.PeerID].MsPerLayer
					routeLayers += n
				}
			}
			if mean := routeMs / routeLayers; !(mean < popMs) {
				t.Fatalf("routes run layers at %.3f ms/layer, population mean %.3f: faster nodes not preferred", mean, popMs)
			}

			// Rising load: each routed request adds hops per minute to its
			// nodes; routes must spread to other replicas.
			idleHeads := distinctHeads(t, nodes, tc.layers, false, byID)
			loadedHeads := distinctHeads(t, nodes, tc.layers, true, byID)
			if loadedHeads <= idleHeads || loadedHeads < 3 {
				t.Fatalf("distinct heads over 300 requests: %d idle, %d under load; want the loaded count higher and >= 3", idleHeads, loadedHeads)
			}
		})
	}
}

// distinctHeads routes 300 requests and counts the distinct head nodes;
// with load, each request adds 600 hops per minute (10 tokens/s) to every
// node on its route.
func distinctHeads(t *testing.T, nodes []Node, numLayers int, load bool, byID map[string]Node) int {
	t.Helper()
	nodes = append([]Node(nil), nodes...)
	index := map[string]int{}
	for i, n := range nodes {
		index[n.PeerID] = i
	}
	heads := map[string]bool{}
	hops := map[string]bool{}
	for req := 0; req < 300; req++ {
		r, err := Find(nodes, numLayers, Options{Seed: 12345}, Config{})
		if err != nil {
			t.Fatal(err)
		}
		if err := Check(r, numLayers, byID); err != nil {
			t.Fatal(err)
		}
		heads[r.Hops[0].PeerID] = true
		for _, h := range r.Hops {
			hops[h.PeerID] = true
			if load {
				nodes[index[h.PeerID]].RPM1 += 600
			}
		}
	}
	t.Logf("load=%v: %d distinct heads, %d distinct hop nodes", load, len(heads), len(hops))
	return len(heads)
}

func TestSimulationIsDeterministic(t *testing.T) {
	a := simulateJoins(t, 50, 32, 3)
	b := simulateJoins(t, 50, 32, 3)
	if fmt.Sprint(a) != fmt.Sprint(b) {
		t.Fatal("the same seed produced different assignments")
	}
}

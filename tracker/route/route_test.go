package route

import (
	"fmt"
	"math"
	"math/rand/v2"
	"meshgpu/wire"
	"testing"
)

// bruteForce enumerates every chain covering 0..L-1 (each hop a span inside
// one node's range, each layer once) and returns the least cost, as an
// independent reference for Find's dynamic programme.
func bruteForce(nodes []Node, numLayers int, cfg Config) float64 {
	cfg = cfg.withDefaults()
	best := math.Inf(1)
	var walk func(b int, cost float64)
	walk = func(b int, cost float64) {
		if b == numLayers {
			best = min(best, cost)
			return
		}
		for _, n := range nodes {
			if n.First > b || n.Last < b {
				continue
			}
			ms := cfg.msPerLayer(n) * cfg.loadFactor(n)
			for e := b; e <= n.Last; e++ {
				walk(e+1, cost+float64(e-b+1)*ms+cfg.rtt(n))
			}
		}
	}
	walk(0, 0)
	return best
}

func TestFindMatchesBruteForceOnRandomSmallMeshes(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for trial := 0; trial < 300; trial++ {
		L := 1 + rng.IntN(7)
		var nodes []Node
		for i := 0; i < 1+rng.IntN(5); i++ {
			a, b := rng.IntN(L), rng.IntN(L)
			nodes = append(nodes, Node{
				PeerID: fmt.Sprintf("n%d", i), First: min(a, b), Last: max(a, b),
				MsPerLayer: 0.5 + rng.Float64()*4, RPM1: rng.Float64() * 3000, RTTMs: rng.Float64() * 5,
			})
		}
		want := bruteForce(nodes, L, Config{})
		r, err := Find(nodes, L, Options{Seed: uint64(trial)}, Config{})
		if math.IsInf(want, 1) {
			if err != ErrNoRoute {
				t.Fatalf("trial %d: no chain exists but Find returned %v, %v", trial, r, err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("trial %d: %v (brute force found %v)", trial, err, want)
		}
		if math.Abs(r.TotalMs-want) > 1e-9*want {
			t.Fatalf("trial %d: Find cost %v, brute force %v; nodes %+v route %+v", trial, r.TotalMs, want, nodes, r)
		}
		byID := map[string]Node{}
		for _, n := range nodes {
			byID[n.PeerID] = n
		}
		if err := Check(r, L, byID); err != nil {
			t.Fatalf("trial %d: %v", trial, err)
		}
		var sum float64
		for _, c := range r.Costs {
			sum += c.Total()
		}
		if math.Abs(sum-r.TotalMs) > 1e-9*max(1, sum) {
			t.Fatalf("trial %d: cost breakdown sums to %v, total %v", trial, sum, r.TotalMs)
		}
	}
}

func TestFindEntersAFasterNodeMidRange(t *testing.T) {
	// ADR-0012's example: A holds 0-13, B holds 10-23 and is twice as fast,
	// so B is entered at layer 10, not 14.
	nodes := []Node{
		{PeerID: "A", Endpoint: "http://a", First: 0, Last: 13, MsPerLayer: 2, RTTMs: 1},
		{PeerID: "B", Endpoint: "http://b", First: 10, Last: 23, MsPerLayer: 1, RTTMs: 1},
	}
	r, err := Find(nodes, 24, Options{}, Config{})
	if err != nil {
		t.Fatal(err)
	}
	want := []wire.Hop{
		{PeerID: "A", Endpoint: "http://a", StartLayer: 0, EndLayer: 9},
		{PeerID: "B", Endpoint: "http://b", StartLayer: 10, EndLayer: 23},
	}
	if fmt.Sprint(r.Hops) != fmt.Sprint(want) {
		t.Fatalf("hops %+v, want %+v", r.Hops, want)
	}
	// 10 layers x 2 ms + 14 layers x 1 ms + two round trips.
	if r.TotalMs != 36 {
		t.Fatalf("total %v ms, want 36", r.TotalMs)
	}
	// Banning B leaves layers 14-23 uncovered.
	if _, err := Find(nodes, 24, Options{Exclude: func(id string) bool { return id == "B" }}, Config{}); err != ErrNoRoute {
		t.Fatalf("with B banned: %v, want ErrNoRoute", err)
	}
}

func TestFindNeedsLayerZero(t *testing.T) {
	nodes := []Node{{PeerID: "x", First: 1, Last: 5}}
	if _, err := Find(nodes, 6, Options{}, Config{}); err != ErrNoRoute {
		t.Fatalf("got %v, want ErrNoRoute: no node can be the head", err)
	}
}

func TestTiesSpreadOverEqualReplicas(t *testing.T) {
	var nodes []Node
	for i := 0; i < 4; i++ {
		nodes = append(nodes, Node{PeerID: fmt.Sprintf("r%d", i), First: 0, Last: 7, MsPerLayer: 1})
	}
	heads := map[string]int{}
	for seed := uint64(0); seed < 200; seed++ {
		r, err := Find(nodes, 8, Options{Seed: seed}, Config{})
		if err != nil {
			t.Fatal(err)
		}
		if len(r.Hops) != 1 {
			t.Fatalf("equal replicas should not be split: %+v", r.Hops)
		}
		heads[r.Hops[0].PeerID]++
		again, _ := Find(nodes, 8, Options{Seed: seed}, Config{})
		if again.Hops[0].PeerID != r.Hops[0].PeerID {
			t.Fatal("the same seed picked a different replica")
		}
	}
	for _, n := range nodes {
		if heads[n.PeerID] < 20 {
			t.Fatalf("replica %s got %d of 200 requests: ties do not spread (%v)", n.PeerID, heads[n.PeerID], heads)
		}
	}
}

func TestLoadPenaltyShiftsTraffic(t *testing.T) {
	fast := Node{PeerID: "fast", First: 0, Last: 9, MsPerLayer: 1}
	slow := Node{PeerID: "slow", First: 0, Last: 9, MsPerLayer: 1.5}
	r, _ := Find([]Node{fast, slow}, 10, Options{}, Config{})
	if r.Hops[0].PeerID != "fast" {
		t.Fatalf("idle: picked %s, want fast", r.Hops[0].PeerID)
	}
	// fast's capacity is 60000/(1 ms x 10 layers) = 6000 hops/min; at
	// 4800 rpm (u=0.8) its 10 ms become 50 ms, worse than slow's 15 ms.
	fast.RPM1 = 4800
	r, _ = Find([]Node{fast, slow}, 10, Options{}, Config{})
	if r.Hops[0].PeerID != "slow" {
		t.Fatalf("loaded: picked %s, want slow", r.Hops[0].PeerID)
	}
	if got := r.TotalMs; got != 16 {
		t.Fatalf("total %v, want 15 ms compute + 1 ms default RTT", got)
	}
}

func BenchmarkFind500Nodes80Layers(b *testing.B) {
	nodes := simulateJoins(b, 500, 80, 7)
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		if _, err := Find(nodes, 80, Options{Seed: uint64(i)}, Config{}); err != nil {
			b.Fatal(err)
		}
	}
}

package route

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

const gib = 1 << 30

func TestAssignFillsTheModelInOrderFromEmpty(t *testing.T) {
	fp := Footprint{Budget: 10 * gib, BytesPerLayer: gib, KVReservePerLayer: 0, EmbedBytes: 2 * gib, HeadBytes: 2 * gib}
	// Empty mesh: from layer 0 the embeddings take 2 GiB and only 8 layers
	// fit; from layer 1, 10 fit, which covers more.
	a, err := Assign(nil, 30, fp, 1, Config{})
	if err != nil {
		t.Fatal(err)
	}
	if a.First != 1 || a.Last != 10 || a.NewlyCovered != 10 {
		t.Fatalf("got %+v, want 1-10 with 10 newly covered", a)
	}
	// The next joiner covers the most uncovered layers: 11-20 (10), not
	// 0-7 (1 new).
	a, _ = Assign([]Node{{PeerID: "a", First: 1, Last: 10}}, 30, fp, 1, Config{})
	if a.First != 11 || a.Last != 20 {
		t.Fatalf("got %+v, want 11-20", a)
	}
	// Layers 0-7 and 20-29 covered: the gap 8-19 (12 layers) is filled
	// from its start with the 10 layers that fit mid-model.
	nodes := []Node{{PeerID: "a", First: 0, Last: 7}, {PeerID: "b", First: 20, Last: 29}}
	a, _ = Assign(nodes, 30, fp, 1, Config{})
	if a.First != 8 || a.Last != 17 || a.NewlyCovered != 10 {
		t.Fatalf("got %+v, want 8-17", a)
	}
	// Only 28-29 uncovered: a range reaching the last layer pays the head
	// bytes, so it holds 8 layers (22-29, 2 new) and still beats the 10-layer
	// 19-28 (1 new).
	nodes = append(nodes, Node{PeerID: "c", First: 8, Last: 27})
	nodes[1] = Node{PeerID: "b", First: 20, Last: 27}
	a, _ = Assign(nodes, 30, fp, 1, Config{})
	if a.Last != 29 || a.NewlyCovered != 2 || fp.Bytes(a.First, a.Last, 30) > fp.Budget {
		t.Fatalf("got %+v, want a range ending at 29 that fits", a)
	}
	if a.Last-a.First+1 != 8 {
		t.Fatalf("got %d layers, want 8 (10 GiB minus 2 GiB head)", a.Last-a.First+1)
	}
}

func TestAssignPrefersTheWeakestLayers(t *testing.T) {
	// Every layer covered; 10-19 only by a slow node, the rest by fast ones.
	nodes := []Node{
		{PeerID: "a", First: 0, Last: 9, MsPerLayer: 1},
		{PeerID: "a2", First: 0, Last: 9, MsPerLayer: 1},
		{PeerID: "b", First: 10, Last: 19, MsPerLayer: 4},
		{PeerID: "c", First: 20, Last: 29, MsPerLayer: 1},
	}
	fp := Footprint{Budget: 10 * gib, BytesPerLayer: gib}
	a, err := Assign(nodes, 30, fp, 1, Config{})
	if err != nil {
		t.Fatal(err)
	}
	if a.First != 10 || a.Last != 19 || a.NewlyCovered != 0 {
		t.Fatalf("got %+v, want 10-19", a)
	}
	// A faster joiner gains more on the same layers.
	slow, _ := Assign(nodes, 30, fp, 4, Config{})
	if !(a.Gain > slow.Gain) {
		t.Fatalf("fast gain %v should exceed slow gain %v", a.Gain, slow.Gain)
	}
	if _, err := Assign(nodes, 30, Footprint{Budget: gib / 2, BytesPerLayer: gib}, 1, Config{}); err != ErrDoesNotFit {
		t.Fatalf("tiny budget: %v, want ErrDoesNotFit", err)
	}
	if _, err := Assign(nodes, 30, Footprint{Budget: gib}, 1, Config{}); err == nil {
		t.Fatal("zero bytes per layer accepted")
	}
}

func TestRebalanceMovesAnOverReplicatedNodeIntoAGap(t *testing.T) {
	fp := Footprint{Budget: 10 * gib, BytesPerLayer: gib}
	nodes := []Node{
		{PeerID: "a1", First: 0, Last: 9},
		{PeerID: "a2", First: 0, Last: 9},
		{PeerID: "a3", First: 0, Last: 9},
		{PeerID: "b", First: 10, Last: 19},
	}
	a, ok := Rebalance(nodes, 0, 30, fp, 3, Config{})
	if !ok || a.First != 20 || a.Last != 29 {
		t.Fatalf("got %+v %v, want a move to 20-29", a, ok)
	}
	// b is the only replica of 10-19: it must stay.
	if a, ok := Rebalance(nodes, 3, 30, fp, 3, Config{}); ok {
		t.Fatalf("sole replica told to move to %+v", a)
	}
	// With the gap filled nobody moves.
	nodes = append(nodes, Node{PeerID: "c", First: 20, Last: 29})
	if a, ok := Rebalance(nodes, 0, 30, fp, 3, Config{}); ok {
		t.Fatalf("no gap, yet told to move to %+v", a)
	}
}

// naiveAssign is the ranking of Assign's doc comment written directly:
// grow each start's range layer by layer while it fits, sum its score.
func naiveAssign(nodes []Node, numLayers int, fp Footprint, ms float64) (Assignment, bool) {
	cov := Coverage(nodes, numLayers, Config{})
	w := Config{}.Throughput(Node{MsPerLayer: ms})
	best, found := Assignment{}, false
	for s := 0; s < numLayers; s++ {
		e := s - 1
		for e+1 < numLayers && fp.Bytes(s, e+1, numLayers) <= fp.Budget {
			e++
		}
		if e < s {
			continue
		}
		a := Assignment{First: s, Last: e}
		for l := s; l <= e; l++ {
			if cov[l].Throughput == 0 {
				a.NewlyCovered++
			} else {
				a.Gain += math.Log1p(w / cov[l].Throughput)
			}
		}
		if !found || a.NewlyCovered > best.NewlyCovered || (a.NewlyCovered == best.NewlyCovered && a.Gain > best.Gain+1e-9) {
			best, found = a, true
		}
	}
	return best, found
}

func TestAssignMatchesTheNaiveRanking(t *testing.T) {
	rng := rand.New(rand.NewPCG(4, 4))
	for trial := 0; trial < 500; trial++ {
		L := 1 + rng.IntN(24)
		var nodes []Node
		for i := 0; i < rng.IntN(6); i++ {
			a, b := rng.IntN(L), rng.IntN(L)
			nodes = append(nodes, Node{PeerID: fmt.Sprint(i), First: min(a, b), Last: max(a, b), MsPerLayer: 0.5 + 3*rng.Float64()})
		}
		fp := Footprint{Budget: int64(1 + rng.IntN(40)), BytesPerLayer: int64(1 + rng.IntN(3)), KVReservePerLayer: int64(rng.IntN(2)),
			EmbedBytes: int64(rng.IntN(6)), HeadBytes: int64(rng.IntN(6))}
		ms := 0.5 + 3*rng.Float64()
		want, ok := naiveAssign(nodes, L, fp, ms)
		got, err := Assign(nodes, L, fp, ms, Config{})
		if !ok {
			if err != ErrDoesNotFit {
				t.Fatalf("trial %d: nothing fits, Assign gave %+v %v", trial, got, err)
			}
			continue
		}
		if err != nil || got.First != want.First || got.Last != want.Last || got.NewlyCovered != want.NewlyCovered || math.Abs(got.Gain-want.Gain) > 1e-9 {
			t.Fatalf("trial %d: Assign %+v %v, naive %+v (L=%d fp=%+v nodes=%+v)", trial, got, err, want, L, fp, nodes)
		}
	}
}

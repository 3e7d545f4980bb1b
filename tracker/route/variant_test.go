package route

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"meshgpu/wire"
)

func variant(label string) wire.Variant {
	return wire.Variant{Label: label, Fingerprint: strings.Repeat(fmt.Sprintf("%x", len(label)%16), 64)}
}

// On random meshes of up to three variants, every route runs on one
// variant (Check), and costs what the cheapest variant's own best chain
// costs (brute force per variant); where only chains mixing variants
// exist there is no route. A pinned variant routes over that variant or
// not at all.
func TestFindNeverMixesVariants(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	variants := []wire.Variant{{}, variant("bf16"), variant("Q4_K_M")}
	mixedOnly := 0
	for trial := 0; trial < 400; trial++ {
		L := 1 + rng.IntN(6)
		var nodes []Node
		byID := map[string]Node{}
		for i := 0; i < 1+rng.IntN(7); i++ {
			a, b := rng.IntN(L), rng.IntN(L)
			n := Node{PeerID: fmt.Sprintf("n%d", i), First: min(a, b), Last: max(a, b),
				MsPerLayer: 0.5 + rng.Float64()*4, RTTMs: rng.Float64() * 5, Variant: variants[rng.IntN(len(variants))]}
			nodes = append(nodes, n)
			byID[n.PeerID] = n
		}
		want := math.Inf(1)
		var wantVariant wire.Variant
		for _, g := range ByVariant(nodes, nil) {
			if c := bruteForce(g, L, Config{}); c < want {
				want, wantVariant = c, g[0].Variant
			}
		}
		r, err := Find(nodes, L, Options{Seed: uint64(trial)}, Config{})
		if math.IsInf(want, 1) {
			if err != ErrNoRoute {
				t.Fatalf("trial %d: no variant covers the model but Find returned %+v, %v", trial, r, err)
			}
			if !math.IsInf(bruteForce(nodes, L, Config{}), 1) {
				mixedOnly++
			}
			continue
		}
		if err != nil {
			t.Fatalf("trial %d: %v (brute force found %v)", trial, err, want)
		}
		if err := Check(r, L, byID); err != nil {
			t.Fatalf("trial %d: %v; nodes %+v", trial, err, nodes)
		}
		if math.Abs(r.TotalMs-want) > 1e-9*want {
			t.Fatalf("trial %d: cost %v, the cheapest variant's best chain %v", trial, r.TotalMs, want)
		}
		if r.Variant.Fingerprint != wantVariant.Fingerprint && math.Abs(bruteForceVariant(nodes, L, r.Variant)-want) > 1e-9*want {
			t.Fatalf("trial %d: route of variant %v, cheapest is %v", trial, r.Variant, wantVariant)
		}
		for _, v := range variants {
			fp := v.Fingerprint
			pinned, err := Find(nodes, L, Options{Seed: uint64(trial), Variant: &fp}, Config{})
			c := bruteForceVariant(nodes, L, v)
			if math.IsInf(c, 1) != (err == ErrNoRoute) {
				t.Fatalf("trial %d: pinned to %v: %v, brute force %v", trial, v, err, c)
			}
			if err == nil && (pinned.Variant.Fingerprint != fp || Check(pinned, L, byID) != nil || math.Abs(pinned.TotalMs-c) > 1e-9*c) {
				t.Fatalf("trial %d: pinned to %v: %+v, brute force %v", trial, v, pinned, c)
			}
		}
	}
	if mixedOnly < 20 {
		t.Fatalf("only %d meshes were covered by mixed chains alone: the test does not exercise the rule", mixedOnly)
	}
}

func bruteForceVariant(nodes []Node, L int, v wire.Variant) float64 {
	fp := v.Fingerprint
	groups := ByVariant(nodes, &fp)
	if len(groups) == 0 {
		return math.Inf(1)
	}
	return bruteForce(groups[0], L, Config{})
}

// Two variants that each cover the model at equal cost share the requests
// (the seed decides, as between replicas of one variant); none mixes.
func TestEqualVariantsShareRequests(t *testing.T) {
	a, b := variant("bf16"), variant("f32")
	nodes := []Node{
		{PeerID: "a-head", First: 0, Last: 2, MsPerLayer: 1, Variant: a},
		{PeerID: "a-tail", First: 3, Last: 5, MsPerLayer: 1, Variant: a},
		{PeerID: "b-head", First: 0, Last: 2, MsPerLayer: 1, Variant: b},
		{PeerID: "b-tail", First: 3, Last: 5, MsPerLayer: 1, Variant: b},
	}
	byID := map[string]Node{}
	for _, n := range nodes {
		byID[n.PeerID] = n
	}
	count := map[string]int{}
	for seed := range uint64(200) {
		r, err := Find(nodes, 6, Options{Seed: seed}, Config{})
		if err != nil {
			t.Fatal(err)
		}
		if err := Check(r, 6, byID); err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		count[r.Variant.Label]++
	}
	if count["bf16"] < 60 || count["f32"] < 60 {
		t.Fatalf("variants chosen %v of 200: equal variants should share", count)
	}
	// Check itself refuses a route whose hops mix variants.
	mixed := Route{Variant: a, Hops: []wire.Hop{{PeerID: "a-head", StartLayer: 0, EndLayer: 2}, {PeerID: "b-tail", StartLayer: 3, EndLayer: 5}}}
	if err := Check(mixed, 6, byID); err == nil {
		t.Fatal("Check accepted a route mixing variants")
	}
}

// With per-layer sizes (a quantized file's layers differ) the range is
// the longest that fits those sizes, not a uniform estimate, and the
// ranking is still the naive one.
func TestAssignUsesPerLayerBytes(t *testing.T) {
	// Layers 0-1 are large (4), the rest small (1); budget 6, head 2. A
	// uniform estimate of 4 per layer would give one layer anywhere; the
	// real sizes give the four small layers with the head, then 1-3.
	fp := Footprint{Budget: 6, BytesPerLayer: 4, HeadBytes: 2, LayerBytes: []int64{4, 4, 1, 1, 1, 1}}
	a, err := Assign(nil, 6, fp, 1, Config{})
	if err != nil || a.First != 2 || a.Last != 5 {
		t.Fatalf("empty mesh: %+v %v, want 2-5", a, err)
	}
	a, err = Assign([]Node{{PeerID: "x", First: 2, Last: 5}}, 6, fp, 1, Config{})
	if err != nil || a.First != 1 || a.Last != 3 {
		t.Fatalf("after 2-5: %+v %v, want 1-3", a, err)
	}
	if _, err := Assign(nil, 5, fp, 1, Config{}); err == nil {
		t.Fatal("layer bytes for 6 layers accepted for a model of 5")
	}
	if err := (Footprint{Budget: 1, BytesPerLayer: 1, LayerBytes: []int64{-1}}).Validate(); err == nil {
		t.Fatal("negative layer bytes accepted")
	}
	if err := (Footprint{Budget: 1, BytesPerLayer: 1 << 62}).Validate(); err == nil {
		t.Fatal("a figure beyond MaxFootprintBytes accepted")
	}

	rng := rand.New(rand.NewPCG(5, 5))
	for trial := 0; trial < 500; trial++ {
		L := 1 + rng.IntN(16)
		var nodes []Node
		for i := 0; i < rng.IntN(5); i++ {
			x, y := rng.IntN(L), rng.IntN(L)
			nodes = append(nodes, Node{PeerID: fmt.Sprint(i), First: min(x, y), Last: max(x, y), MsPerLayer: 0.5 + 3*rng.Float64()})
		}
		fp := Footprint{Budget: int64(1 + rng.IntN(40)), BytesPerLayer: 3, KVReservePerLayer: int64(rng.IntN(2)),
			EmbedBytes: int64(rng.IntN(6)), HeadBytes: int64(rng.IntN(6)), LayerBytes: make([]int64, L)}
		for l := range fp.LayerBytes {
			fp.LayerBytes[l] = int64(rng.IntN(4))
		}
		want, ok := naiveAssign(nodes, L, fp, 1)
		got, err := Assign(nodes, L, fp, 1, Config{})
		if !ok {
			if err != ErrDoesNotFit {
				t.Fatalf("trial %d: nothing fits, Assign gave %+v %v", trial, got, err)
			}
			continue
		}
		if err != nil || got.First != want.First || got.Last != want.Last || got.NewlyCovered != want.NewlyCovered {
			t.Fatalf("trial %d: Assign %+v %v, naive %+v (fp %+v)", trial, got, err, want, fp)
		}
	}
}

package node

import (
	"meshgpu/wire"
	"strings"
	"testing"
)

func peer(u string, first, last int) peerInfo {
	return peerInfo{endpoint: u, h: Health{Layers: [2]int{first, last}, PeerID: "p-" + u}}
}

// The route from --peer nodes enters overlapping shards mid-range, takes
// the furthest-reaching peer, and names a missing layer.
func TestChainRoute(t *testing.T) {
	r, err := chainRoute(2, 12, []peerInfo{peer("a", 2, 5), peer("b", 3, 8), peer("c", 6, 11), peer("d", 9, 11)})
	if err != nil {
		t.Fatal(err)
	}
	want := []wire.Hop{{Endpoint: "b", StartLayer: 3, EndLayer: 8, PeerID: "p-b"}, {Endpoint: "c", StartLayer: 9, EndLayer: 11, PeerID: "p-c"}}
	if len(r) != len(want) || r[0] != want[0] || r[1] != want[1] {
		t.Fatalf("route %+v, want %+v", r, want)
	}
	if err := checkCoverage(2, r, 12); err != nil {
		t.Fatal(err)
	}
	if _, err := chainRoute(2, 12, []peerInfo{peer("a", 3, 6), peer("c", 8, 11)}); err == nil || !strings.Contains(err.Error(), "layer 7") {
		t.Fatalf("gap: %v", err)
	}
	if r, err := chainRoute(11, 12, nil); err != nil || len(r) != 0 {
		t.Fatalf("head holding every layer: %v %v", r, err)
	}
}

func TestCheckCoverage(t *testing.T) {
	for _, tc := range []struct {
		headEnd int
		route   []wire.Hop
		ok      bool
	}{
		{5, nil, true},
		{2, nil, false},
		{2, []wire.Hop{{StartLayer: 3, EndLayer: 5}}, true},
		{2, []wire.Hop{{StartLayer: 2, EndLayer: 5}}, false}, // layer 2 twice
		{2, []wire.Hop{{StartLayer: 4, EndLayer: 5}}, false}, // layer 3 skipped
		{2, []wire.Hop{{StartLayer: 3, EndLayer: 4}}, false}, // layer 5 missing
	} {
		if err := checkCoverage(tc.headEnd, tc.route, 6); (err == nil) != tc.ok {
			t.Errorf("head 0-%d route %+v: %v", tc.headEnd, tc.route, err)
		}
	}
}

func FuzzParseRoute(f *testing.F) {
	f.Add(`[{"endpoint":"http://127.0.0.1:7002","start_layer":3,"end_layer":5}]`)
	f.Add(`[{"relay_addr":"ws://r/rpc/x","start_layer":1,"end_layer":1},{"endpoint":"https://h","start_layer":2,"end_layer":3}]`)
	f.Add(`[[[[`)
	f.Fuzz(func(t *testing.T, s string) {
		hops, err := wire.ParseRoute(s, 6)
		if err != nil {
			return
		}
		for i, h := range hops {
			if h.Endpoint == "" && h.RelayAddr == "" || h.StartLayer > h.EndLayer || h.EndLayer >= 6 ||
				i > 0 && h.StartLayer != hops[i-1].EndLayer+1 {
				t.Fatalf("accepted a bad route %q", s)
			}
		}
	})
}

package tracker

import (
	"testing"

	"meshgpu/internal/testenv"
)

// /nodes tells each node's reachability (issue 29): "public" for a node
// with an endpoint, "relay" for one reached only through its relay (where
// peers punch direct paths to it).
func TestNodesShowReachability(t *testing.T) {
	testenv.CheckGoroutines(t)
	m := newProxyMesh(t, Config{})
	h := startHead(t, &fakeHead{t: t})
	public := m.node(t, h.URL, 0, 2, 1)
	behindNAT := m.relayOnly(t, 3, 5).Identity.PeerID
	var nodes struct {
		Nodes []struct {
			PeerID       string `json:"peer_id"`
			Reachability string `json:"reachability"`
		}
	}
	getJSON(t, m.hc, m.tracker.URL+"/nodes", &nodes)
	want := map[string]string{public: "public", behindNAT: "relay"}
	if len(nodes.Nodes) != len(want) {
		t.Fatalf("/nodes lists %d nodes, want %d", len(nodes.Nodes), len(want))
	}
	for _, n := range nodes.Nodes {
		if n.Reachability != want[n.PeerID] {
			t.Fatalf("/nodes shows %s as %q, want %q", n.PeerID, n.Reachability, want[n.PeerID])
		}
	}
}

package node

import (
	"encoding/json"
	"net/http"
	"net/url"
	"testing"

	"meshgpu/identity"
)

// GET /identity answers a challenge with a proof the tracker verifies: the
// node's peer id, the challenge it was given and the layers it serves.
func TestIdentityChallenge(t *testing.T) {
	id, err := identity.New()
	if err != nil {
		t.Fatal(err)
	}
	base := startNode(t, &Server{StackForTesting: newFakeStack(2, 4, 6, 8, 16), PeerID: id.PeerID, Identity: id, ModelName: "m"})
	q := url.Values{"nonce": {"0123456789abcdef0123"}, "endpoint": {base}, "tracker": {"mg-tracker"}}
	resp, err := http.Get(base + identity.ProofPath + "?" + q.Encode())
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var p identity.Proof
	if err := json.NewDecoder(resp.Body).Decode(&p); err != nil || resp.StatusCode != 200 {
		t.Fatalf("status %d: %v", resp.StatusCode, err)
	}
	if err := identity.VerifyProof(p, id.PeerID, q.Get("nonce"), base, "mg-tracker"); err != nil {
		t.Fatal(err)
	}
	if p.Layers != [2]int{2, 4} || p.Model != "m" {
		t.Fatalf("proof says %s layers %v, the node serves m 2-4", p.Model, p.Layers)
	}
	for _, bad := range []url.Values{{"nonce": {"short"}}, {"nonce": {"0123456789abcdef\nx"}}} {
		r, err := http.Get(base + identity.ProofPath + "?" + bad.Encode())
		if err != nil {
			t.Fatal(err)
		}
		r.Body.Close()
		if r.StatusCode != 400 {
			t.Errorf("challenge %v: %d, want 400", bad, r.StatusCode)
		}
	}
}

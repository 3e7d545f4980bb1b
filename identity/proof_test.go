package identity

import "testing"

func TestProof(t *testing.T) {
	id, other := mustNew(t), mustNew(t)
	p, err := id.Prove("n1", "http://127.0.0.1:7001", "mg-tracker", "m", [2]int{0, 2})
	if err != nil {
		t.Fatal(err)
	}
	if err := VerifyProof(p, id.PeerID, "n1", "http://127.0.0.1:7001", "mg-tracker"); err != nil {
		t.Fatal(err)
	}
	for name, check := range map[string]func() error{
		"another peer":     func() error { return VerifyProof(p, other.PeerID, "n1", "http://127.0.0.1:7001", "mg-tracker") },
		"another nonce":    func() error { return VerifyProof(p, id.PeerID, "n2", "http://127.0.0.1:7001", "mg-tracker") },
		"another endpoint": func() error { return VerifyProof(p, id.PeerID, "n1", "http://127.0.0.1:7002", "mg-tracker") },
		"another tracker":  func() error { return VerifyProof(p, id.PeerID, "n1", "http://127.0.0.1:7001", "mg-other") },
		"changed layers": func() error {
			q := p
			q.Layers[1] = 5
			return VerifyProof(q, id.PeerID, "n1", "http://127.0.0.1:7001", "mg-tracker")
		},
		"changed model": func() error {
			q := p
			q.Model = "n"
			return VerifyProof(q, id.PeerID, "n1", "http://127.0.0.1:7001", "mg-tracker")
		},
	} {
		if check() == nil {
			t.Errorf("%s: proof accepted", name)
		}
	}
	if _, err := id.Prove("n\n1", "e", "t", "m", [2]int{}); err == nil {
		t.Fatal("a nonce with a line break was signed")
	}
}

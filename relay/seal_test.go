package relay

import (
	"bytes"
	"crypto/ecdh"
	"crypto/rand"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/boundmap"
	"meshgpu/wire"
)

// The relay carries the key exchange, so it plays the man in the middle:
// answering the hello itself with its own key, or with the target's public
// key next to its own ephemeral key (it cannot sign for the target), is
// refused; the honest exchange gives both ends one key pair. A sealed frame
// the relay alters, replays, or moves to another key fails to open.
func TestSealRefusesARelayInTheMiddle(t *testing.T) {
	newID := func() *identity.Identity {
		id, err := identity.New()
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	a, b, mitm := newID(), newID(), newID()

	eph, hello, err := newSealHello(a, b.PeerID)
	if err != nil {
		t.Fatal(err)
	}
	// The relay's own key answering for b: it signs the accept a expects.
	h, _ := wire.ParseSealHello(hello)
	relayEph, err := ecdh.X25519().GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	var forged wire.SealAccept
	copy(forged.PublicKey[:], mitm.Public)
	copy(forged.Ephemeral[:], relayEph.PublicKey().Bytes())
	copy(forged.Signature[:], mitm.Sign(acceptMessage(a.PeerID, h.Ephemeral[:], forged.Ephemeral[:], forged.KeyID[:])))
	own := forged.Append(nil)
	if _, err := finishSeal(a, b.PeerID, eph, own); !errors.Is(err, identity.ErrWrongPeer) {
		t.Fatalf("an accept signed by the relay's key: %v, want ErrWrongPeer", err)
	}
	// b's public key with the relay's ephemeral key and signature.
	m, _ := wire.ParseSealAccept(own)
	copy(m.PublicKey[:], b.Public)
	if _, err := finishSeal(a, b.PeerID, eph, m.Append(nil)); !errors.Is(err, identity.ErrWrongPeer) {
		t.Fatalf("b's key with the relay's ephemeral key: %v, want ErrWrongPeer", err)
	}
	// A hello b did not get from a (the relay names itself as the source).
	if _, _, err := acceptSeal(b, mitm.PeerID, hello); err == nil {
		t.Fatal("b accepted a's hello as the relay's")
	}

	accept, kb, err := acceptSeal(b, a.PeerID, hello)
	if err != nil {
		t.Fatal(err)
	}
	ka, err := finishSeal(a, b.PeerID, eph, accept)
	if err != nil {
		t.Fatal(err)
	}
	msg := []byte("activations of one hop")
	seal := func(k *sealKeys) (uint64, []byte) {
		buf := make([]byte, len(msg)+wire.SealOverhead)
		copy(buf, msg)
		return k.seal(buf, len(msg))
	}
	c, sealed := seal(ka)
	keep := append([]byte(nil), sealed...)
	if p, err := kb.open(c, sealed); err != nil || string(p) != string(msg) {
		t.Fatalf("b opens a's frame: %q %v", p, err)
	}
	if _, err := kb.open(c, append([]byte(nil), keep...)); !errors.Is(err, errSealReplay) {
		t.Fatalf("a replayed frame: %v, want errSealReplay", err)
	}
	c, sealed = seal(ka)
	sealed[3] ^= 1
	if _, err := kb.open(c, sealed); !errors.Is(err, errSealOpen) {
		t.Fatalf("an altered frame: %v, want errSealOpen", err)
	}
	c, sealed = seal(ka)
	if _, err := kb.open(c+1, sealed); !errors.Is(err, errSealOpen) {
		t.Fatalf("a frame under another counter: %v, want errSealOpen", err)
	}
	if _, err := ka.open(c, sealed); !errors.Is(err, errSealOpen) {
		t.Fatalf("a's own frame reflected back to it: %v, want errSealOpen", err)
	}
	c, sealed = seal(kb)
	if p, err := ka.open(c, sealed); err != nil || string(p) != string(msg) {
		t.Fatalf("a opens b's reply: %q %v", p, err)
	}
}

// The replay window takes each counter once, late ones within the window.
func TestReplayWindow(t *testing.T) {
	var w replayWindow
	for _, c := range []uint64{1, 3, 2, 5000, 5000 - wire.SealWindow + 1} {
		if !w.take(c) {
			t.Fatalf("counter %d refused", c)
		}
	}
	for _, c := range []uint64{0, 1, 2, 3, 5000, 5000 - wire.SealWindow, 5000 - wire.SealWindow + 1} {
		if w.take(c) {
			t.Fatalf("counter %d taken twice or too late", c)
		}
	}
}

// Any peer may exchange keys (identities are free), but the keys of peers
// in use are never evicted for a newcomer's: a full tunnel answers the
// newcomer's hello 429 until some keys have gone unused for sealIdle.
func TestSealKeysInUseAreNotEvicted(t *testing.T) {
	target, err := identity.New()
	if err != nil {
		t.Fatal(err)
	}
	tc := &tconn{o: dialOpts{id: target}, sealIn: boundmap.Map[string, *peerSeal]{Max: maxSealPeers, Evictable: sealInEvictable}}
	hello := func() (string, int) {
		id, err := identity.New()
		if err != nil {
			t.Fatal(err)
		}
		_, h, err := newSealHello(id, target.PeerID)
		if err != nil {
			t.Fatal(err)
		}
		rec := httptest.NewRecorder()
		tc.serveSeal(id.PeerID).ServeHTTP(rec, httptest.NewRequest(http.MethodPost, wire.HopSealPath, bytes.NewReader(h)))
		return id.PeerID, rec.Code
	}
	var peers []string
	for range maxSealPeers {
		p, code := hello()
		if code != http.StatusOK {
			t.Fatalf("hello %d answered %d", len(peers), code)
		}
		ps, _ := tc.sealIn.Get(p)
		ps.cur, ps.next = ps.next, nil // a frame opened under it
		peers = append(peers, p)
	}
	if _, code := hello(); code != http.StatusTooManyRequests {
		t.Fatalf("a newcomer's hello to a tunnel full of keys in use answered %d, want 429", code)
	}
	for _, p := range peers {
		if _, ok := tc.sealIn.Get(p); !ok {
			t.Fatal("a key in use was evicted")
		}
	}
	idle, _ := tc.sealIn.Get(peers[7])
	idle.used = time.Now().Add(-sealIdle - time.Second)
	if p, code := hello(); code != http.StatusOK {
		t.Fatalf("hello after a key went idle answered %d", code)
	} else if _, ok := tc.sealIn.Get(p); !ok {
		t.Fatal("the newcomer's keys were not kept")
	}
	if _, ok := tc.sealIn.Get(peers[7]); ok || tc.sealIn.Len() != maxSealPeers {
		t.Fatalf("the idle key stayed, or the table holds %d", tc.sealIn.Len())
	}
}

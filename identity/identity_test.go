package identity

import (
	"os"
	"path/filepath"
	"testing"
)

func TestLoadOrCreatePersistsWith0600(t *testing.T) {
	path := filepath.Join(t.TempDir(), "keys", "node.key")
	a, err := LoadOrCreate(path)
	if err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v, want 0600", st.Mode().Perm())
	}
	b, err := LoadOrCreate(path)
	if err != nil {
		t.Fatal(err)
	}
	if a.PeerID != b.PeerID {
		t.Fatalf("peer id changed across loads: %s vs %s", a.PeerID, b.PeerID)
	}
	if err := os.Chmod(path, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadOrCreate(path); err == nil {
		t.Fatal("a world-readable key file was accepted")
	}
}

func TestVerifyRejectsForeignPeerID(t *testing.T) {
	a, _ := New()
	b, _ := New()
	msg := []byte("challenge")
	if err := Verify(a.PeerID, a.Public, msg, a.Sign(msg)); err != nil {
		t.Fatalf("own signature rejected: %v", err)
	}
	// b claims a's id with its own key: the id does not derive from b's key.
	if err := Verify(a.PeerID, b.Public, msg, b.Sign(msg)); err == nil {
		t.Fatal("foreign peer id accepted")
	}
	// a's key but a signature over another message.
	if err := Verify(a.PeerID, a.Public, msg, a.Sign([]byte("other"))); err == nil {
		t.Fatal("wrong signature accepted")
	}
}

func TestConcurrentCreateAgrees(t *testing.T) {
	path := filepath.Join(t.TempDir(), "node.key")
	ids := make(chan string, 8)
	errs := make(chan error, 8)
	for i := 0; i < 8; i++ {
		go func() {
			id, err := LoadOrCreate(path)
			if err != nil {
				errs <- err
				return
			}
			ids <- id.PeerID
		}()
	}
	var first string
	for i := 0; i < 8; i++ {
		select {
		case err := <-errs:
			t.Fatal(err)
		case id := <-ids:
			if first == "" {
				first = id
			} else if id != first {
				t.Fatalf("racing creators got different keys: %s vs %s", first, id)
			}
		}
	}
}

func TestAcquireRefusesAKeyInUse(t *testing.T) {
	path := filepath.Join(t.TempDir(), "node.key")
	_, release, err := Acquire(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := Acquire(path); err == nil {
		t.Fatal("a key held by another node was acquired twice")
	}
	release()
	_, release2, err := Acquire(path)
	if err != nil {
		t.Fatalf("after release: %v", err)
	}
	release2()
}

// Package identity is a node's Ed25519 key and the peer id derived from it.
// The relay and the tracker accept a peer id only with a signature by the key
// it was derived from, so nobody can register another node's id.
package identity

import (
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base32"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// Identity is a node's key pair and peer id.
type Identity struct {
	Private ed25519.PrivateKey
	Public  ed25519.PublicKey
	PeerID  string
}

// PeerIDPrefix starts every peer id, so ids are recognisable in logs.
const PeerIDPrefix = "mg-"

var b32 = base32.StdEncoding.WithPadding(base32.NoPadding)

// PeerID derives the peer id of a public key: "mg-" and the lower-case
// base32 of the first 20 bytes of its SHA-256.
func PeerID(pub ed25519.PublicKey) string {
	sum := sha256.Sum256(pub)
	return PeerIDPrefix + strings.ToLower(b32.EncodeToString(sum[:20]))
}

// New makes a fresh identity.
func New() (*Identity, error) {
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, err
	}
	return &Identity{Private: priv, Public: pub, PeerID: PeerID(pub)}, nil
}

const pemType = "MESHGPU ED25519 PRIVATE KEY"

// LoadOrCreate reads the key at path, or creates one there (mode 0600) when
// the file does not exist. A key file readable by others is refused. Two
// processes creating the same file at once end up with the same key: the
// file appears whole (written aside, then linked into place) or not at all.
func LoadOrCreate(path string) (*Identity, error) {
	if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
		if err := create(path); err != nil {
			return nil, err
		}
	}
	return load(path)
}

func create(path string) error {
	id, err := New()
	if err != nil {
		return err
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("identity: %w", err)
	}
	tmp, err := os.CreateTemp(dir, ".key-*")
	if err != nil {
		return fmt.Errorf("identity: %w", err)
	}
	defer os.Remove(tmp.Name())
	block := pem.EncodeToMemory(&pem.Block{Type: pemType, Bytes: id.Private.Seed()})
	if _, err := tmp.Write(block); err != nil {
		tmp.Close()
		return fmt.Errorf("identity: writing %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("identity: writing %s: %w", path, err)
	}
	// CreateTemp made the file 0600. Link fails when another process won
	// the race; its key is then the one to use.
	if err := os.Link(tmp.Name(), path); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("identity: %w", err)
	}
	return nil
}

func load(path string) (*Identity, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("identity: %w", err)
	}
	st, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("identity: %w", err)
	}
	if st.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("identity: key file %s has mode %v; run chmod 600 on it", path, st.Mode().Perm())
	}
	block, _ := pem.Decode(data)
	if block == nil || block.Type != pemType || len(block.Bytes) != ed25519.SeedSize {
		return nil, fmt.Errorf("identity: %s is not a meshgpu key file", path)
	}
	priv := ed25519.NewKeyFromSeed(block.Bytes)
	pub := priv.Public().(ed25519.PublicKey)
	return &Identity{Private: priv, Public: pub, PeerID: PeerID(pub)}, nil
}

// Sign signs msg with the identity's key.
func (id *Identity) Sign(msg []byte) []byte { return ed25519.Sign(id.Private, msg) }

// PublicHex is the public key as hex, the form carried in JSON.
func (id *Identity) PublicHex() string { return hex.EncodeToString(id.Public) }

// Verify checks that peerID belongs to pub and that sig signs msg with it.
func Verify(peerID string, pub ed25519.PublicKey, msg, sig []byte) error {
	if len(pub) != ed25519.PublicKeySize {
		return errors.New("public key has the wrong size")
	}
	if PeerID(pub) != peerID {
		return fmt.Errorf("peer id %q does not belong to the presented key", peerID)
	}
	if !ed25519.Verify(pub, msg, sig) {
		return errors.New("signature does not verify")
	}
	return nil
}

// ParsePublicHex decodes a hex public key.
func ParsePublicHex(s string) (ed25519.PublicKey, error) {
	b, err := hex.DecodeString(s)
	if err != nil || len(b) != ed25519.PublicKeySize {
		return nil, errors.New("public key must be 64 hex digits")
	}
	return ed25519.PublicKey(b), nil
}

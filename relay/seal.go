package relay

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/ecdh"
	"crypto/ed25519"
	"crypto/hkdf"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"meshgpu/identity"
	"meshgpu/wire"
)

// Relayed hops are sealed end to end to the next hop's peer id (wire/seal.go,
// docs/security.md): a signed X25519 exchange per pair of peers on a
// tunnel, then AES-256-GCM per frame with a counter nonce. The relay sees
// frame lengths, stream and key ids and counters; it cannot read a hop's
// head or activations, alter them, replay them, or stand in for the
// target (its key does not hash to the peer id the sender addressed).

// errSealPath marks a sealed hop's failure that the relay can cause: a
// reply that is not sealed, fails authentication or answers another hop,
// an exchange refused or signed by another key. The sender cannot tell it
// from the peer's, so it is the path's (PathError): routed around, the
// peer not banned.
var errSealPath = errors.New("relay: a sealed hop failed on the relay path")

var (
	errSealUnknown = fmt.Errorf("%w: the peer does not know this hop key", errSealPath)
	errSealOpen    = fmt.Errorf("%w: sealed hop frame failed authentication", errSealPath)
	errSealReplay  = fmt.Errorf("%w: sealed hop frame replayed", errSealPath)
)

// sealKeys are one pair of peers' keys, as one end holds them: send seals
// what it sends, recv opens what it receives.
type sealKeys struct {
	id   [wire.SealKeyIDLen]byte
	peer string // the other end's peer id
	send cipher.AEAD
	recv cipher.AEAD
	next atomic.Uint64 // the last send counter used

	mu  sync.Mutex
	win replayWindow
}

// replayWindow takes each counter once, up to wire.SealWindow behind the
// newest (frames may be queued out of counter order by concurrent senders).
type replayWindow struct {
	top  uint64
	bits [wire.SealWindow / 64]uint64
}

func (w *replayWindow) take(c uint64) bool {
	const n = wire.SealWindow
	switch {
	case c == 0:
		return false
	case c > w.top:
		if d := c - w.top; d >= n {
			clear(w.bits[:])
		} else {
			for i := w.top + 1; i <= c; i++ {
				w.bits[(i%n)/64] &^= 1 << (i % 64)
			}
		}
		w.top = c
	case w.top-c >= n:
		return false
	}
	bit := &w.bits[(c%n)/64]
	if *bit&(1<<(c%64)) != 0 {
		return false
	}
	*bit |= 1 << (c % 64)
	return true
}

func nonceOf(c uint64) []byte {
	var n [12]byte
	binary.BigEndian.PutUint64(n[4:], c)
	return n[:]
}

// seal appends, to buf's first plain bytes, their AEAD in place; it
// returns the counter and the sealed bytes (buf needs wire.SealOverhead
// spare capacity).
func (k *sealKeys) seal(buf []byte, plain int) (uint64, []byte) {
	c := k.reserve()
	return c, k.sealAt(c, buf, plain)
}

// reserve takes the next send counter, for one frame sealAt seals later.
func (k *sealKeys) reserve() uint64 { return k.next.Add(1) }

// sealAt is seal under counter c, taken with reserve (each once).
func (k *sealKeys) sealAt(c uint64, buf []byte, plain int) []byte {
	return k.send.Seal(buf[:0], nonceOf(c), buf[:plain], k.id[:])
}

// open authenticates and decrypts sealed in place, taking its counter.
func (k *sealKeys) open(c uint64, sealed []byte) ([]byte, error) {
	p, err := k.recv.Open(sealed[:0], nonceOf(c), sealed, k.id[:])
	if err != nil {
		return nil, errSealOpen
	}
	k.mu.Lock()
	ok := k.win.take(c)
	k.mu.Unlock()
	if !ok {
		return nil, errSealReplay
	}
	return p, nil
}

// sealBufs lends the buffers frames are sealed and opened in.
var sealBufs sync.Pool

func sealBuf(n int) *[]byte {
	if b, _ := sealBufs.Get().(*[]byte); b != nil && cap(*b) >= n {
		*b = (*b)[:n]
		return b
	}
	b := make([]byte, n, max(n, 4<<10))
	return &b
}

func putSealBuf(b *[]byte) {
	if cap(*b) <= 32<<20 {
		sealBufs.Put(b)
	}
}

func helloMessage(target string, eph []byte) []byte {
	return append([]byte(wire.SealHelloContext+target+"\x00"), eph...)
}

func acceptMessage(sender string, ephA, ephB []byte, keyID []byte) []byte {
	m := append([]byte(wire.SealAcceptContext+sender+"\x00"), ephA...)
	return append(append(m, ephB...), keyID...)
}

// newSealHello starts an exchange with target.
func newSealHello(id *identity.Identity, target string) (*ecdh.PrivateKey, []byte, error) {
	eph, err := ecdh.X25519().GenerateKey(rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	var m wire.SealHello
	copy(m.PublicKey[:], id.Public)
	copy(m.Ephemeral[:], eph.PublicKey().Bytes())
	copy(m.Signature[:], id.Sign(helloMessage(target, m.Ephemeral[:])))
	return eph, m.Append(nil), nil
}

// acceptSeal is the target's end: it checks that the hello is signed by
// the key of from (the peer id the relay names as its source) for this
// node, and answers with its own signed ephemeral key.
func acceptSeal(id *identity.Identity, from string, hello []byte) ([]byte, *sealKeys, error) {
	m, err := wire.ParseSealHello(hello)
	if err != nil {
		return nil, nil, err
	}
	pub := ed25519.PublicKey(m.PublicKey[:])
	if identity.PeerID(pub) != from {
		return nil, nil, fmt.Errorf("relay: seal hello key is not %s's, the peer the relay names", from)
	}
	if !ed25519.Verify(pub, helloMessage(id.PeerID, m.Ephemeral[:]), m.Signature[:]) {
		return nil, nil, errors.New("relay: seal hello signature does not verify")
	}
	peerEph, err := ecdh.X25519().NewPublicKey(m.Ephemeral[:])
	if err != nil {
		return nil, nil, err
	}
	eph, err := ecdh.X25519().GenerateKey(rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	var a wire.SealAccept
	copy(a.PublicKey[:], id.Public)
	copy(a.Ephemeral[:], eph.PublicKey().Bytes())
	if _, err := rand.Read(a.KeyID[:]); err != nil {
		return nil, nil, err
	}
	copy(a.Signature[:], id.Sign(acceptMessage(from, m.Ephemeral[:], a.Ephemeral[:], a.KeyID[:])))
	secret, err := eph.ECDH(peerEph)
	if err != nil {
		return nil, nil, err
	}
	k, err := deriveSeal(secret, from, id.PeerID, m.Ephemeral[:], a.Ephemeral[:], a.KeyID, false)
	if err != nil {
		return nil, nil, err
	}
	return a.Append(nil), k, nil
}

// finishSeal is the sender's end: the accept must be signed by the key of
// target, the peer id it addressed, over its own ephemeral key.
func finishSeal(id *identity.Identity, target string, eph *ecdh.PrivateKey, accept []byte) (*sealKeys, error) {
	a, err := wire.ParseSealAccept(accept)
	if err != nil {
		return nil, err
	}
	pub := ed25519.PublicKey(a.PublicKey[:])
	if got := identity.PeerID(pub); got != target {
		return nil, fmt.Errorf("%w: the seal accept is signed by %s, not %s", identity.ErrWrongPeer, got, target)
	}
	mine := eph.PublicKey().Bytes()
	if !ed25519.Verify(pub, acceptMessage(id.PeerID, mine, a.Ephemeral[:], a.KeyID[:]), a.Signature[:]) {
		return nil, fmt.Errorf("%w: the seal accept's signature does not verify", identity.ErrWrongPeer)
	}
	peerEph, err := ecdh.X25519().NewPublicKey(a.Ephemeral[:])
	if err != nil {
		return nil, err
	}
	secret, err := eph.ECDH(peerEph)
	if err != nil {
		return nil, err
	}
	return deriveSeal(secret, id.PeerID, target, mine, a.Ephemeral[:], a.KeyID, true)
}

// deriveSeal makes the two directions' keys; sender says which end this is.
func deriveSeal(secret []byte, from, to string, ephA, ephB []byte, keyID [wire.SealKeyIDLen]byte, sender bool) (*sealKeys, error) {
	info := "meshgpu-hop-seal-v1 keys\x00" + from + "\x00" + to + "\x00" + string(keyID[:])
	okm, err := hkdf.Key(sha256.New, secret, append(append([]byte{}, ephA...), ephB...), info, 64)
	if err != nil {
		return nil, err
	}
	aead := func(key []byte) (cipher.AEAD, error) {
		b, err := aes.NewCipher(key)
		if err != nil {
			return nil, err
		}
		return cipher.NewGCM(b)
	}
	ab, err := aead(okm[:32])
	if err != nil {
		return nil, err
	}
	ba, err := aead(okm[32:])
	if err != nil {
		return nil, err
	}
	k := &sealKeys{id: keyID, send: ba, recv: ab, peer: from}
	if sender {
		k.send, k.recv, k.peer = ab, ba, to
	}
	return k, nil
}

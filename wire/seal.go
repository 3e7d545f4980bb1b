package wire

import (
	"errors"
)

// Hops sealed end to end through the relay tunnel (docs/security.md,
// "Relayed hops sealed to the next hop's peer id"). The sender of a Hop
// frame first runs a key exchange with the target peer, a Request frame
// POST HopSealPath through the relay:
//
//	SealHello   version u8 | public key [32] | ephemeral X25519 [32] | signature [64]
//	SealAccept  version u8 | public key [32] | ephemeral X25519 [32] | key id [8] | signature [64]
//
// (the Request's body and the 200 Response's body). The hello's signature
// (Ed25519, by the sender's identity key) covers SealHelloContext, the
// target's peer id, 0 and the sender's ephemeral key; the accept's (by the
// target's key, which must hash to the peer id the sender addressed)
// covers SealAcceptContext, the sender's peer id, 0, both ephemeral keys
// and the key id. Both ends derive one AES-256-GCM key per direction with
// HKDF-SHA256 from the X25519 secret (package relay).
//
// A sealed Hop frame keeps its routing prefix (which the relay rewrites)
// and replaces the rest:
//
//	stream id u64 | peer id s8 | SealedHopMark u32 | key id [8] | counter u64 | sealed (rest)
//
// where sealed is the AEAD of the plain Hop frame's bytes after its peer
// id (head b32 and payload), under the nonce 0 u32 | counter u64. A
// sealed HopReply is
//
//	stream id u64 | status u16 (0) | kind u8 (ReplySealed) | key id [8] | counter u64 | sealed (rest)
//
// sealed over the hop's counter u64 (binding the reply to its hop, since
// the relay rewrites stream ids) and the plain reply's bytes after its
// stream id. Counters start at 1, never repeat per key and direction, and
// a receiver refuses one it has seen (a sliding window of SealWindow).
// A receiver that does not know a key id answers the plain error
// TypeSealUnknown; the sender exchanges keys again.
const (
	HopSealPath          = "/hop/seal"
	SealedHopMark uint32 = 0xffffffff // never a head length (MaxHopHead)
	ReplySealed   uint8  = 0xff
	SealKeyIDLen         = 8
	// SealOverhead is the AEAD tag a sealed frame adds to what it seals.
	SealOverhead = 16
	// SealPrefixLen is key id and counter.
	SealPrefixLen = SealKeyIDLen + 8
	// SealWindow is how far behind the newest counter a late one is
	// still taken (once).
	SealWindow = 1024

	SealHelloContext  = "meshgpu-hop-seal-v1 hello\x00"
	SealAcceptContext = "meshgpu-hop-seal-v1 accept\x00"
	// TypeSealUnknown: the key id is not (or no longer) known.
	TypeSealUnknown = "seal_unknown"
	sealVersion     = 1
)

// SealHello opens a key exchange.
type SealHello struct {
	PublicKey [32]byte // Ed25519, the sender's identity
	Ephemeral [32]byte // X25519
	Signature [64]byte
}

// SealAccept answers a SealHello.
type SealAccept struct {
	PublicKey [32]byte
	Ephemeral [32]byte
	KeyID     [SealKeyIDLen]byte
	Signature [64]byte
}

func (m *SealHello) Append(dst []byte) []byte {
	dst = append(dst, sealVersion)
	dst = append(dst, m.PublicKey[:]...)
	dst = append(dst, m.Ephemeral[:]...)
	return append(dst, m.Signature[:]...)
}

func ParseSealHello(p []byte) (SealHello, error) {
	var m SealHello
	if len(p) != 1+32+32+64 || p[0] != sealVersion {
		return m, errors.New("wire: malformed seal hello")
	}
	copy(m.PublicKey[:], p[1:])
	copy(m.Ephemeral[:], p[33:])
	copy(m.Signature[:], p[65:])
	return m, nil
}

func (m *SealAccept) Append(dst []byte) []byte {
	dst = append(dst, sealVersion)
	dst = append(dst, m.PublicKey[:]...)
	dst = append(dst, m.Ephemeral[:]...)
	dst = append(dst, m.KeyID[:]...)
	return append(dst, m.Signature[:]...)
}

func ParseSealAccept(p []byte) (SealAccept, error) {
	var m SealAccept
	if len(p) != 1+32+32+SealKeyIDLen+64 || p[0] != sealVersion {
		return m, errors.New("wire: malformed seal accept")
	}
	copy(m.PublicKey[:], p[1:])
	copy(m.Ephemeral[:], p[33:])
	copy(m.KeyID[:], p[65:])
	copy(m.Signature[:], p[65+SealKeyIDLen:])
	return m, nil
}

package ticket

import (
	"crypto/rand"
	"encoding/binary"
	"fmt"
)

// KeySize is the size of a per-hop session key.
const KeySize = 32

// Pass is what a session's binding carries to a hop (wire.Binding.Ticket):
// the signed route ticket and the session keys of this hop and every hop
// after it, in route order. A hop keeps Keys[0] as the session's owner key
// and passes the ticket with Keys[1:] down the route, so a node never learns
// the key of a hop before it: a node later on the route cannot act on an
// earlier node's session (a node earlier on the route feeds the later ones
// anyway). The head keeps every key to free the sessions.
//
// Encoding: u16 ticket length, the ticket, u8 key count, KeySize bytes per key.
type Pass struct {
	Ticket []byte
	Keys   [][]byte
}

// NewKeys returns n random session keys.
func NewKeys(n int) ([][]byte, error) {
	keys := make([][]byte, n)
	for i := range keys {
		keys[i] = make([]byte, KeySize)
		if _, err := rand.Read(keys[i]); err != nil {
			return nil, err
		}
	}
	return keys, nil
}

// Encode returns p's bytes.
func (p Pass) Encode() ([]byte, error) {
	if len(p.Ticket) > MaxSize || len(p.Ticket) > 0xffff || len(p.Keys) > MaxHops {
		return nil, fmt.Errorf("%w: pass of %d ticket bytes and %d keys", ErrTooLarge, len(p.Ticket), len(p.Keys))
	}
	b := make([]byte, 0, 3+len(p.Ticket)+KeySize*len(p.Keys))
	b = binary.BigEndian.AppendUint16(b, uint16(len(p.Ticket)))
	b = append(b, p.Ticket...)
	b = append(b, byte(len(p.Keys)))
	for _, k := range p.Keys {
		if len(k) != KeySize {
			return nil, fmt.Errorf("%w: session key of %d bytes", ErrMalformed, len(k))
		}
		b = append(b, k...)
	}
	return b, nil
}

// Rest is the pass for the hop after this one: the same ticket, the keys
// after the first.
func (p Pass) Rest() Pass {
	if len(p.Keys) == 0 {
		return p
	}
	return Pass{Ticket: p.Ticket, Keys: p.Keys[1:]}
}

// ParsePass decodes Encode's bytes; the slices alias b.
func ParsePass(b []byte) (Pass, error) {
	var p Pass
	if len(b) < 3 {
		return p, fmt.Errorf("%w: pass of %d bytes", ErrMalformed, len(b))
	}
	n := int(binary.BigEndian.Uint16(b))
	if n > MaxSize || len(b) < 2+n+1 {
		return p, fmt.Errorf("%w: pass ticket of %d bytes in %d", ErrMalformed, n, len(b))
	}
	p.Ticket = b[2 : 2+n]
	k := int(b[2+n])
	rest := b[3+n:]
	if k > MaxHops || len(rest) != k*KeySize {
		return p, fmt.Errorf("%w: %d session keys in %d bytes", ErrMalformed, k, len(rest))
	}
	for i := 0; i < k; i++ {
		p.Keys = append(p.Keys, rest[i*KeySize:(i+1)*KeySize])
	}
	return p, nil
}

// Covers reports whether session id is one of the ticket's sessions: the
// id itself when the ticket opens one, else "ID:N" for each choice N below
// Choices, N in canonical decimal (no sign, no leading zero), so a ticket
// opens at most Choices sessions on a hop.
func (t *Ticket) Covers(id string) bool {
	if t.Choices <= 1 {
		return id == t.SessionID
	}
	if len(id) <= len(t.SessionID)+1 || id[:len(t.SessionID)] != t.SessionID || id[len(t.SessionID)] != ':' {
		return false
	}
	n := id[len(t.SessionID)+1:]
	if len(n) > 1 && n[0] == '0' || len(n) > 4 {
		return false
	}
	k := 0
	for _, c := range n {
		if c < '0' || c > '9' {
			return false
		}
		k = k*10 + int(c-'0')
	}
	return k < t.Choices
}

// Index returns the index in Hops of peerID's hop starting at layer first.
func (t *Ticket) Index(peerID string, first int) (int, error) {
	for i, h := range t.Hops {
		if h.PeerID == peerID && h.First == first {
			return i, nil
		}
	}
	return -1, fmt.Errorf("%w: no hop of %q starts at layer %d", ErrNotOnRoute, peerID, first)
}

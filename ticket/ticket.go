// Package ticket is the signed route ticket of a session: which peers run
// which layers for it, who may drive it, until when, signed by an issuer
// (a tracker, or the head of a static mesh) that the nodes trust. A node
// runs a hop only under a ticket that verifies, and contacts only the next
// hop it names; docs/security.md says what that stops.
//
// Encoding (version 3), all integers big-endian, strings as a u16 length
// and that many bytes:
//
//	"MGRT" magic, u8 version
//	str session id, str head peer id
//	str head endpoint, str head relay addr (version 3 only: where the
//	    tail sends its replies straight to the head, node/directreply.go)
//	i64 issued-at, i64 expiry (unix milliseconds)
//	u16 choices (version 2 only: the sessions the ticket opens, see Covers)
//	u16 hop count, then per hop: str peer id, str endpoint, str relay addr,
//	    u16 first layer, u16 last layer (inclusive)
//	32 bytes issuer Ed25519 public key
//	64 bytes Ed25519 signature over SigningContext and every byte before it
//
// The encoding is canonical: one ticket has one encoding, Parse refuses
// trailing bytes and anything out of bounds, so the signed bytes are the
// ticket. Version 1 (no choices field) is a ticket of one session: Sign
// writes it for Choices 1, so nodes that read only version 1 take those
// tickets during a rolling upgrade (they would refuse a version 2 ticket,
// 403 invalid_ticket, and be banned), version 2 for more choices, and
// version 3 only when the ticket names how to reach the head (HeadEndpoint
// or HeadRelay): an issuer sets those only for routes whose nodes read
// version 3, as it chose version 1 for old nodes.
package ticket

import (
	"bytes"
	"crypto/ed25519"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"
)

// Version is the newest encoding version, which Sign writes when the
// ticket names how to reach the head; Parse reads it and versions 1 and 2.
const Version = 3

// SigningContext starts the signed message, so a ticket signature cannot be
// replayed as a signature of anything else the same key signs.
const SigningContext = "meshgpu-route-ticket-v1\x00"

var magic = []byte("MGRT")

// Bounds of a ticket; a longer field or more hops is malformed.
const (
	MaxSessionID = 128
	MaxPeerID    = 64
	MaxAddr      = 512
	MaxHops      = 64
	MaxLayer     = 4096
	// MaxChoices bounds the sessions one ticket opens.
	MaxChoices = 1024
	// MaxLifetime bounds expiry minus issue time.
	MaxLifetime = 24 * time.Hour
	// MaxSize bounds an encoded ticket (MaxHops hops at full size fit).
	MaxSize = 4 + 1 + 2*(2+MaxPeerID) + 2*(2+MaxAddr) + 2 + MaxSessionID + 16 + 2 + 2 + MaxHops*(3*2+MaxPeerID+2*MaxAddr+4) + ed25519.PublicKeySize + ed25519.SignatureSize
	// DefaultMaxSkew is the clock difference tolerated between issuer and
	// verifier, on both the issue time and the expiry.
	DefaultMaxSkew = 30 * time.Second
)

// Hop is one node of the route after the head: its peer id, how to reach
// it (an endpoint, a relay address, or both) and the layers it runs.
type Hop struct {
	PeerID    string `json:"peer_id"`
	Endpoint  string `json:"endpoint,omitempty"`
	RelayAddr string `json:"relay_addr,omitempty"`
	First     int    `json:"first"` // inclusive
	Last      int    `json:"last"`  // inclusive
}

// Ticket is a decoded route ticket.
type Ticket struct {
	SessionID string
	// Head is the peer id of the node that may drive the session (embed,
	// sample, send the hops).
	Head string
	// HeadEndpoint and HeadRelay say how the route's last node reaches the
	// head to send it replies directly (the head's --advertise URL, its
	// relay address); both empty: replies go back along the chain only.
	// Signed, so no node on the route can redirect them.
	HeadEndpoint string
	HeadRelay    string
	IssuedAt     time.Time // millisecond precision
	Expiry       time.Time
	// Choices is how many sessions the ticket opens on each hop: the
	// request's choices (n, times its prompts). One is the session id
	// itself; more are "ID:0" to "ID:Choices-1" (Covers). Sign takes 0 as 1.
	Choices int
	Hops    []Hop
	// Issuer is the key that signed it (filled by Sign and Parse).
	Issuer    ed25519.PublicKey
	Signature []byte
	// version is the encoding read (Parse) or written (Sign): a version 1
	// ticket re-encodes as it was signed.
	version byte
}

// Errors of Parse and Verify; wrapped with details.
var (
	ErrMalformed       = errors.New("ticket: malformed")
	ErrTooLarge        = errors.New("ticket: too large")
	ErrUntrustedIssuer = errors.New("ticket: issuer not trusted")
	ErrBadSignature    = errors.New("ticket: signature does not verify")
	ErrExpired         = errors.New("ticket: expired")
	ErrNotYetValid     = errors.New("ticket: issued in the future")
	ErrWrongSession    = errors.New("ticket: issued for another session")
	ErrNotOnRoute      = errors.New("ticket: peer is not on the route")
	ErrWrongHead       = errors.New("ticket: peer is not the session's head")
)

// validate checks the content bounds shared by Sign and Parse.
func (t *Ticket) validate() error {
	if t.SessionID == "" || len(t.SessionID) > MaxSessionID {
		return fmt.Errorf("%w: session id must be 1-%d bytes", ErrMalformed, MaxSessionID)
	}
	if err := checkPeerID("head", t.Head); err != nil {
		return err
	}
	if len(t.Hops) == 0 || len(t.Hops) > MaxHops {
		return fmt.Errorf("%w: %d hops, want 1-%d", ErrMalformed, len(t.Hops), MaxHops)
	}
	if t.Choices < 1 || t.Choices > MaxChoices || t.version < 2 && t.Choices != 1 {
		return fmt.Errorf("%w: %d choices, want 1-%d", ErrMalformed, t.Choices, MaxChoices)
	}
	if t.version < 3 && (t.HeadEndpoint != "" || t.HeadRelay != "") {
		return fmt.Errorf("%w: a version %d ticket cannot name the head's address", ErrMalformed, t.version)
	}
	if err := checkAddr(t.HeadEndpoint, "http://", "https://"); err != nil {
		return fmt.Errorf("%w: head endpoint: %v", ErrMalformed, err)
	}
	if err := checkAddr(t.HeadRelay, "ws://", "wss://"); err != nil {
		return fmt.Errorf("%w: head relay address: %v", ErrMalformed, err)
	}
	life := t.Expiry.Sub(t.IssuedAt)
	if life <= 0 || life > MaxLifetime {
		return fmt.Errorf("%w: lifetime %v outside (0, %v]", ErrMalformed, life, MaxLifetime)
	}
	for i, h := range t.Hops {
		if err := checkPeerID(fmt.Sprintf("hop %d", i), h.PeerID); err != nil {
			return err
		}
		if h.Endpoint == "" && h.RelayAddr == "" {
			return fmt.Errorf("%w: hop %d has neither endpoint nor relay address", ErrMalformed, i)
		}
		if err := checkAddr(h.Endpoint, "http://", "https://"); err != nil {
			return fmt.Errorf("%w: hop %d endpoint: %v", ErrMalformed, i, err)
		}
		if err := checkAddr(h.RelayAddr, "ws://", "wss://"); err != nil {
			return fmt.Errorf("%w: hop %d relay address: %v", ErrMalformed, i, err)
		}
		if h.First < 0 || h.Last < h.First || h.Last >= MaxLayer {
			return fmt.Errorf("%w: hop %d layers %d-%d", ErrMalformed, i, h.First, h.Last)
		}
		if i > 0 && h.First != t.Hops[i-1].Last+1 {
			return fmt.Errorf("%w: hop %d starts at layer %d, the previous one ended at %d", ErrMalformed, i, h.First, t.Hops[i-1].Last)
		}
	}
	return nil
}

func checkPeerID(what, id string) error {
	if id == "" || len(id) > MaxPeerID || !printable(id) {
		return fmt.Errorf("%w: %s peer id must be 1-%d printable ASCII bytes", ErrMalformed, what, MaxPeerID)
	}
	return nil
}

// checkAddr allows "" or a URL of one of the schemes, without query,
// fragment or user info: a ticket names a node, not a request.
func checkAddr(a string, schemes ...string) error {
	if a == "" {
		return nil
	}
	if len(a) > MaxAddr || !printable(a) {
		return fmt.Errorf("longer than %d bytes or not printable ASCII", MaxAddr)
	}
	ok := false
	for _, s := range schemes {
		ok = ok || strings.HasPrefix(a, s)
	}
	if !ok {
		return fmt.Errorf("%q must start with one of %v", a, schemes)
	}
	if strings.ContainsAny(a, "?#@ ") {
		return fmt.Errorf("%q has a query, fragment, user info or space", a)
	}
	return nil
}

func printable(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < 0x21 || s[i] > 0x7e {
			return false
		}
	}
	return true
}

// body encodes everything the signature covers.
func (t *Ticket) body() []byte {
	b := make([]byte, 0, 256)
	b = append(b, magic...)
	b = append(b, t.version)
	b = appendStr(b, t.SessionID)
	b = appendStr(b, t.Head)
	if t.version >= 3 {
		b = appendStr(b, t.HeadEndpoint)
		b = appendStr(b, t.HeadRelay)
	}
	b = binary.BigEndian.AppendUint64(b, uint64(t.IssuedAt.UnixMilli()))
	b = binary.BigEndian.AppendUint64(b, uint64(t.Expiry.UnixMilli()))
	if t.version >= 2 {
		b = binary.BigEndian.AppendUint16(b, uint16(t.Choices))
	}
	b = binary.BigEndian.AppendUint16(b, uint16(len(t.Hops)))
	for _, h := range t.Hops {
		b = appendStr(b, h.PeerID)
		b = appendStr(b, h.Endpoint)
		b = appendStr(b, h.RelayAddr)
		b = binary.BigEndian.AppendUint16(b, uint16(h.First))
		b = binary.BigEndian.AppendUint16(b, uint16(h.Last))
	}
	return append(b, t.Issuer...)
}

func appendStr(b []byte, s string) []byte {
	b = binary.BigEndian.AppendUint16(b, uint16(len(s)))
	return append(b, s...)
}

func signed(body []byte) []byte { return append([]byte(SigningContext), body...) }

// Sign checks t, sets its issuer and signature from key and returns the
// encoded ticket. Times are kept to the millisecond.
func Sign(t Ticket, key ed25519.PrivateKey) ([]byte, error) {
	if len(key) != ed25519.PrivateKeySize {
		return nil, errors.New("ticket: signing key has the wrong size")
	}
	t.IssuedAt, t.Expiry = time.UnixMilli(t.IssuedAt.UnixMilli()), time.UnixMilli(t.Expiry.UnixMilli())
	t.Issuer = key.Public().(ed25519.PublicKey)
	if t.Choices == 0 {
		t.Choices = 1
	}
	switch {
	case t.HeadEndpoint != "" || t.HeadRelay != "":
		t.version = Version
	case t.Choices == 1:
		t.version = 1 // the same ticket to new verifiers, and one old ones read
	default:
		t.version = 2
	}
	if err := t.validate(); err != nil {
		return nil, err
	}
	body := t.body()
	return append(body, ed25519.Sign(key, signed(body))...), nil
}

// reader decodes the fixed layout; the first short read sets err.
type reader struct {
	b   []byte
	err error
}

func (r *reader) take(n int) []byte {
	if r.err != nil {
		return nil
	}
	if len(r.b) < n {
		r.err = fmt.Errorf("%w: truncated", ErrMalformed)
		return nil
	}
	v := r.b[:n]
	r.b = r.b[n:]
	return v
}

func (r *reader) u16() int {
	v := r.take(2)
	if v == nil {
		return 0
	}
	return int(binary.BigEndian.Uint16(v))
}

func (r *reader) i64() int64 {
	v := r.take(8)
	if v == nil {
		return 0
	}
	return int64(binary.BigEndian.Uint64(v))
}

func (r *reader) str(max int) string {
	n := r.u16()
	if r.err == nil && n > max {
		r.err = fmt.Errorf("%w: a field of %d bytes (limit %d)", ErrMalformed, n, max)
	}
	return string(r.take(n))
}

// Parse decodes an encoded ticket without checking its signature, issuer
// or times (Verify does); it refuses anything not canonical.
func Parse(raw []byte) (*Ticket, error) {
	if len(raw) > MaxSize {
		return nil, fmt.Errorf("%w: %d bytes (limit %d)", ErrTooLarge, len(raw), MaxSize)
	}
	r := &reader{b: raw}
	if m := r.take(len(magic)); r.err == nil && !bytes.Equal(m, magic) {
		return nil, fmt.Errorf("%w: not a route ticket", ErrMalformed)
	}
	v := r.take(1)
	if r.err == nil && (v[0] < 1 || v[0] > Version) {
		return nil, fmt.Errorf("%w: version %d, this node reads 1 to %d", ErrMalformed, v[0], Version)
	}
	t := &Ticket{Choices: 1}
	if r.err == nil {
		t.version = v[0]
	}
	t.SessionID = r.str(MaxSessionID)
	t.Head = r.str(MaxPeerID)
	if t.version >= 3 {
		t.HeadEndpoint, t.HeadRelay = r.str(MaxAddr), r.str(MaxAddr)
	}
	t.IssuedAt = time.UnixMilli(r.i64())
	t.Expiry = time.UnixMilli(r.i64())
	if t.version >= 2 {
		t.Choices = r.u16()
	}
	n := r.u16()
	if r.err == nil && n > MaxHops {
		return nil, fmt.Errorf("%w: %d hops (limit %d)", ErrMalformed, n, MaxHops)
	}
	for i := 0; i < n && r.err == nil; i++ {
		h := Hop{PeerID: r.str(MaxPeerID), Endpoint: r.str(MaxAddr), RelayAddr: r.str(MaxAddr)}
		h.First, h.Last = r.u16(), r.u16()
		t.Hops = append(t.Hops, h)
	}
	t.Issuer = ed25519.PublicKey(bytes.Clone(r.take(ed25519.PublicKeySize)))
	t.Signature = bytes.Clone(r.take(ed25519.SignatureSize))
	if r.err != nil {
		return nil, r.err
	}
	if len(r.b) != 0 {
		return nil, fmt.Errorf("%w: %d trailing bytes", ErrMalformed, len(r.b))
	}
	if err := t.validate(); err != nil {
		return nil, err
	}
	return t, nil
}

// Encode returns the ticket's canonical bytes (with its signature).
func (t *Ticket) Encode() []byte { return append(t.body(), t.Signature...) }

// String is the ticket in unpadded base64url, the form carried in headers.
func String(raw []byte) string { return base64.RawURLEncoding.EncodeToString(raw) }

// FromString decodes String's form.
func FromString(s string) ([]byte, error) {
	if len(s) > base64.RawURLEncoding.EncodedLen(MaxSize) {
		return nil, fmt.Errorf("%w: %d characters", ErrTooLarge, len(s))
	}
	b, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil {
		return nil, fmt.Errorf("%w: not base64url: %v", ErrMalformed, err)
	}
	return b, nil
}

// Trusted is a set of issuer keys a node accepts tickets from. The zero
// value trusts nobody.
type Trusted struct {
	keys map[string]struct{}
	// MaxSkew is the tolerated clock difference (DefaultMaxSkew when 0).
	MaxSkew time.Duration
}

// NewTrusted trusts keys.
func NewTrusted(keys ...ed25519.PublicKey) *Trusted {
	t := &Trusted{}
	for _, k := range keys {
		t.Add(k)
	}
	return t
}

// Add trusts key (a key of the wrong size is ignored: it can never verify).
func (t *Trusted) Add(key ed25519.PublicKey) {
	if len(key) != ed25519.PublicKeySize {
		return
	}
	if t.keys == nil {
		t.keys = map[string]struct{}{}
	}
	t.keys[string(key)] = struct{}{}
}

// Has reports whether key is trusted.
func (t *Trusted) Has(key ed25519.PublicKey) bool {
	if t == nil {
		return false
	}
	_, ok := t.keys[string(key)]
	return ok
}

// Verify parses raw and checks that a trusted issuer signed it and that it
// is valid at now (within the skew). The caller still checks that it is the
// ticket of the session it is asked about (CheckSession) and its own place
// on it (NextHop, CheckHead).
func Verify(raw []byte, trusted *Trusted, now time.Time) (*Ticket, error) {
	t, err := Parse(raw)
	if err != nil {
		return nil, err
	}
	if !trusted.Has(t.Issuer) {
		return nil, ErrUntrustedIssuer
	}
	if !ed25519.Verify(t.Issuer, signed(raw[:len(raw)-ed25519.SignatureSize]), t.Signature) {
		return nil, ErrBadSignature
	}
	skew := trusted.MaxSkew
	if skew <= 0 {
		skew = DefaultMaxSkew
	}
	if t.IssuedAt.After(now.Add(skew)) {
		return nil, fmt.Errorf("%w: at %s", ErrNotYetValid, t.IssuedAt.UTC().Format(time.RFC3339))
	}
	if now.After(t.Expiry.Add(skew)) {
		return nil, fmt.Errorf("%w: at %s", ErrExpired, t.Expiry.UTC().Format(time.RFC3339))
	}
	return t, nil
}

// CheckSession refuses a ticket presented for another session than its own.
func (t *Ticket) CheckSession(id string) error {
	if t.SessionID != id {
		return fmt.Errorf("%w: %q, not %q", ErrWrongSession, t.SessionID, id)
	}
	return nil
}

// CheckHead refuses a peer that is not the ticket's head.
func (t *Ticket) CheckHead(peerID string) error {
	if t.Head != peerID {
		return fmt.Errorf("%w: %q", ErrWrongHead, peerID)
	}
	return nil
}

// HopOf returns the hop peerID runs starting at layer first.
func (t *Ticket) HopOf(peerID string, first int) (Hop, error) {
	for _, h := range t.Hops {
		if h.PeerID == peerID && h.First == first {
			return h, nil
		}
	}
	return Hop{}, fmt.Errorf("%w: no hop of %q starts at layer %d", ErrNotOnRoute, peerID, first)
}

// NextHop returns the hop after layer last, the only one a node that ran up
// to last may contact; ok is false when last is the end of the route.
func (t *Ticket) NextHop(last int) (Hop, bool) {
	for _, h := range t.Hops {
		if h.First == last+1 {
			return h, true
		}
	}
	return Hop{}, false
}

// IsNextHop reports whether peerID is the ticket's next hop after layer last.
func (t *Ticket) IsNextHop(peerID string, last int) bool {
	h, ok := t.NextHop(last)
	return ok && h.PeerID == peerID
}

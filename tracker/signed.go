package tracker

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"meshgpu/identity"
)

// SignaturePrefix starts every signed tracker message, so a signature made
// for the tracker cannot be replayed to another protocol that signs JSON.
const SignaturePrefix = "meshgpu-tracker-v1\n"

// Message kinds; a signed message is only accepted at its own endpoint.
const (
	KindRegister   = "register"
	KindHeartbeat  = "heartbeat"
	KindAssign     = "assign"
	KindDeregister = "deregister"
)

// Auth is the signed header every node-to-tracker message carries (its
// fields are promoted into the message's JSON object).
type Auth struct {
	Kind      string `json:"kind"`
	PeerID    string `json:"peer_id"`
	PublicKey string `json:"public_key"` // hex Ed25519 public key
	Timestamp int64  `json:"timestamp"`  // unix milliseconds
	Signature string `json:"signature"`  // hex Ed25519 signature
}

func (a *Auth) auth() *Auth { return a }

type signable interface{ auth() *Auth }

// Canonical returns the bytes a message's signature covers: the message
// decoded as generic JSON (numbers kept as written), "signature" set to "",
// re-encoded with object keys sorted by byte order at every level, no
// insignificant whitespace, and no HTML escaping (encoding/json with
// SetEscapeHTML(false), trailing newline removed). The verifier computes it
// from the received bytes, so fields unknown to it are covered too.
func Canonical(body []byte) ([]byte, error) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var obj map[string]any
	if err := dec.Decode(&obj); err != nil {
		return nil, fmt.Errorf("body is not a JSON object: %w", err)
	}
	if obj == nil {
		return nil, errors.New("body is not a JSON object: null")
	}
	if dec.More() {
		return nil, errors.New("body has trailing data after the JSON object")
	}
	obj["signature"] = ""
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(obj); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n")), nil
}

// Sign fills msg's Auth (kind, identity, timestamp now) and signs it; it
// returns the JSON body to send.
func Sign(id *identity.Identity, kind string, now time.Time, msg signable) ([]byte, error) {
	a := msg.auth()
	a.Kind, a.PeerID, a.PublicKey, a.Timestamp, a.Signature = kind, id.PeerID, id.PublicHex(), now.UnixMilli(), ""
	unsigned, err := json.Marshal(msg)
	if err != nil {
		return nil, err
	}
	canon, err := Canonical(unsigned)
	if err != nil {
		return nil, err
	}
	a.Signature = hex.EncodeToString(id.Sign(append([]byte(SignaturePrefix), canon...)))
	return json.Marshal(msg)
}

// authError is a rejected signature, key or timestamp.
type authError struct{ msg string }

func (e *authError) Error() string { return e.msg }

// verify checks body's signature, its kind and the freshness of its
// timestamp (within maxSkew of now either way), then decodes it into msg.
func verify(body []byte, kind string, now time.Time, maxSkew time.Duration, msg signable) error {
	canon, err := Canonical(body)
	if err != nil {
		return &badRequest{err.Error()}
	}
	if err := json.Unmarshal(body, msg); err != nil {
		return &badRequest{"body does not match the message: " + err.Error()}
	}
	a := msg.auth()
	if a.Kind != kind {
		return &badRequest{fmt.Sprintf("kind is %q, this endpoint takes %q", a.Kind, kind)}
	}
	pub, err := identity.ParsePublicHex(a.PublicKey)
	if err != nil {
		return &authError{err.Error()}
	}
	sig, err := hex.DecodeString(a.Signature)
	if err != nil || len(sig) != 64 {
		return &authError{"signature must be 128 hex digits"}
	}
	if err := identity.Verify(a.PeerID, pub, append([]byte(SignaturePrefix), canon...), sig); err != nil {
		return &authError{err.Error()}
	}
	ts := time.UnixMilli(a.Timestamp)
	if d := now.Sub(ts); d > maxSkew || d < -maxSkew {
		return &authError{fmt.Sprintf("timestamp %s is %v away from the tracker's clock (limit %v); check the node's clock", ts.UTC().Format(time.RFC3339), d.Round(time.Second), maxSkew)}
	}
	return nil
}

// badRequest is malformed input.
type badRequest struct{ msg string }

func (e *badRequest) Error() string { return e.msg }

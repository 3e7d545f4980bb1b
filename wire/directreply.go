package wire

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"fmt"
)

// DirectReplyPath is where the route's last node POSTs a hop's answer
// straight to the head (the ticket's head endpoint or relay), while the
// chain answer still travels back along the route (docs/protocol.md,
// Direct replies).
const DirectReplyPath = "/reply"

// MaxDirectReply bounds a direct reply's body: the answer of a verify hop
// of MaxVerifyRows rows with logprobs fits.
const MaxDirectReply = MaxReplyBody

// DirectReply is the body of POST DirectReplyPath. Answer is the hop's
// answer as JSON (a TokenReply, or a VerifyReply for a verify hop) and MAC
// is HMAC-SHA256 under the tail's session key of DirectReplyMAC's message:
// the head, which holds every hop's key, checks it against the key of the
// ticket's last hop.
type DirectReply struct {
	Session  string          `json:"session"`
	Position int             `json:"position"`
	Step     int             `json:"step"`
	Pass     uint32          `json:"pass,omitempty"` // the hop's PassOrder.Seq; 0: unordered
	Verify   bool            `json:"verify,omitempty"`
	Answer   json.RawMessage `json:"answer"`
	MAC      []byte          `json:"mac"`
}

// directReplyContext starts the MAC'd message, so the tag cannot be
// replayed as a MAC of anything else made with a session key.
const directReplyContext = "meshgpu-direct-reply-v2\x00"

// DirectReplyMAC is the tag of a reply under key: over the session, the
// position, the step, the pass number, the verify flag and the answer's
// bytes, each length prefixed or fixed size, so no two replies share a
// message.
func DirectReplyMAC(key []byte, r *DirectReply) []byte {
	m := hmac.New(sha256.New, key)
	var b []byte
	b = append(b, directReplyContext...)
	b = binary.BigEndian.AppendUint32(b, uint32(len(r.Session)))
	b = append(b, r.Session...)
	b = binary.BigEndian.AppendUint64(b, uint64(r.Position))
	b = binary.BigEndian.AppendUint64(b, uint64(r.Step))
	b = binary.BigEndian.AppendUint32(b, r.Pass)
	if r.Verify {
		b = append(b, 1)
	} else {
		b = append(b, 0)
	}
	b = binary.BigEndian.AppendUint32(b, uint32(len(r.Answer)))
	m.Write(b)
	m.Write(r.Answer)
	return m.Sum(nil)
}

// Tokens decodes the answer: one token, or a verify hop's accepted tokens
// plus one.
func (r *DirectReply) Tokens() ([]TokenReply, error) {
	if r.Verify {
		var v VerifyReply
		if err := json.Unmarshal(r.Answer, &v); err != nil {
			return nil, fmt.Errorf("verify answer: %v", err)
		}
		if len(v.Tokens) == 0 {
			return nil, fmt.Errorf("verify answer: no tokens")
		}
		return v.Tokens, nil
	}
	var t TokenReply
	if err := json.Unmarshal(r.Answer, &t); err != nil {
		return nil, fmt.Errorf("token answer: %v", err)
	}
	return []TokenReply{t}, nil
}

// The hop protocol's types and limits: the head and reply of a hop, the
// session binding, the dtypes, the upgrade. Their binary encoding in hop
// frames is package hopmux (hopmux/hopframe.go).

package wire

import (
	"context"
	"errors"
	"time"
)

// ProtocolVersion is the hop protocol: hop frames and session bindings
// (doc.go). Version 1 is POST /forward with X-Meshnet-* headers.
const ProtocolVersion = 2

// Upgrading a connection to hop frames: GET HopPath with "Connection:
// Upgrade" and "Upgrade: HopUpgrade". A node that speaks it answers 101
// with the same Upgrade token and HeaderMaxFrame, the largest frame payload
// it reads; anything else (an old node's 404) means POST /forward.
const (
	HopPath        = "/hop"
	HopUpgrade     = "meshgpu-hop/2"
	HeaderMaxFrame = "X-Meshnet-Max-Frame"
	// HopTLSProto is the ALPN protocol a node offers when it dials TLS
	// pinned to a peer id: a node serving an operator's certificate for
	// its API (--tls-cert) answers such a handshake with its identity
	// certificate instead (node.SplitTLS).
	HopTLSProto = "meshgpu-hop"
)

// Limits of hop frames, checked before anything is allocated for a field.
const (
	MaxHopHead      = 512 << 10 // the head of a Hop frame, tokens and binding included
	MaxBindingBytes = 60 << 10
	MaxTicketBytes  = 8 << 10
	// MaxReplyBody bounds a HopReply that is not activations (a token or
	// an error body).
	MaxReplyBody = 64 << 10
	// MaxHopSampling bounds a binding's sampling JSON: a response format
	// as large as a request may carry (MaxFormatBytes) plus the numbers.
	// Derived from the request's limit, so a request that passes
	// validation always fits its hop: a smaller field here made a valid
	// request fail at the hop, and the tracker blamed the next node.
	MaxHopSampling = MaxFormatBytes + 1<<10
)

// A binding with every field at its limit fits MaxBindingBytes (the array
// length is negative, a compile error, when it does not).
var _ [MaxBindingBytes - (5 + 3*2 + MaxRouteBytes + MaxHopSampling + MaxTicketBytes)]struct{}

// ErrHopEncode wraps a hop this node could not encode (a field over its
// wire limit): the sender's own problem, never the next hop's failure.
var ErrHopEncode = errors.New("wire: hop cannot be encoded")

// Hop activation dtypes on the wire.
const (
	DTypeBF16 uint8 = 1
	DTypeF32  uint8 = 2
)

// DTypeSize is the byte size of a wire dtype, 0 for an unknown one.
func DTypeSize(d uint8) int {
	switch d {
	case DTypeBF16:
		return 2
	case DTypeF32:
		return 4
	}
	return 0
}

// HopReply kinds.
const (
	ReplyActivations uint8 = 1
	ReplyToken       uint8 = 2
	ReplyError       uint8 = 3
)

// HopHead is what changes per token: the head of a Hop frame. Binding is
// set on the first hop of a session to a peer (and after a failover or a
// 428 binding_required), nil otherwise.
type HopHead struct {
	Session  string
	Position int
	NTokens  int
	Hidden   int
	DType    uint8
	Step     int
	Deadline time.Time // zero: none
	Tokens   []int32   // ids at this hop's positions, under a repetition penalty or Verify
	// Verify: a verify hop (flag hopmux.HopVerify, speculate.go); Tokens are the
	// last accepted token and the drafts.
	Verify bool
	// Pass orders the passes of a head that keeps several in flight
	// (flag hopmux.HopPassOrder, speculate.go); zero: unordered.
	Pass PassOrder
	// Parents: a verify hop's rows are a token tree (flag hopmux.HopTree,
	// tree.go); nil: a chain.
	Parents []int32
	// Keep: cache slots to move to Position-len(Keep).. before this hop
	// runs (flag hopmux.HopKeep, tree.go): the branch a tree hop accepted.
	Keep    []int32
	Binding *Binding
}

// PayloadLen is the byte count the head's shape and dtype need.
func (h *HopHead) PayloadLen() int64 {
	return int64(h.NTokens) * int64(h.Hidden) * int64(DTypeSize(h.DType))
}

// Binding is what stays fixed for a session on one node: the layers it
// runs, the route after it, the sampling parameters (read by the node with
// the last layer) and the session's signed route ticket (opaque here; a
// node that requires tickets checks it, node/tickets.go).
type Binding struct {
	StartLayer int
	EndLayer   int
	Route      []Hop
	Sampling   SamplingParams
	Ticket     []byte
}

// HopReply is the answer to a Hop. Payload (activations) is written from,
// or read into, the caller's buffer; Body is a token's or error's bytes.
type HopReply struct {
	Status   int
	Kind     uint8
	EndLayer int            // activations
	NTokens  int            // activations
	Hidden   int            // activations
	DType    uint8          // activations
	Token    int32          // token
	Logprob  float32        // token
	Logprobs *TokenLogprobs // token, when asked for
	Tokens   []TokenReply   // tokens (a verify hop's answer)
	Body     []byte         // error: the JSON error body
	Payload  []byte         // activations
	// Release, when set, returns Payload's buffer once the reply is sent
	// or used; it is no part of the frame.
	Release func()
}

// ReleaseBuffer calls a's Release once (a may be nil).
func (a *HopReply) ReleaseBuffer() {
	if a != nil && a.Release != nil {
		a.Release()
		a.Release = nil
	}
}

// ErrHopFramesUnsupported: the peer (or the relay on the way) does not
// speak hop frames; send POST /forward instead.
var ErrHopFramesUnsupported = errors.New("peer does not speak hop frames (protocol version 2)")

// HopSender says which connection, and which sender on it, a hop came
// over, for the hop server: a session bound by a hop from one HopSender
// takes unbound hops only from the same one (compared by pointer). A
// node's hop connection is one sender; a relay tunnel holds one per peer id
// the relay names as a hop's source (a relay could name another peer, but
// it also carries every binding in the clear, so it could rebind anyway).
// Remote names the sender in logs.
type HopSender struct{ Remote string }

type hopSenderKey struct{}

// WithHopSender returns ctx carrying s, for the hops the transport serves.
func WithHopSender(ctx context.Context, s *HopSender) context.Context {
	return context.WithValue(ctx, hopSenderKey{}, s)
}

// HopSenderOf is the HopSender ctx carries, or nil.
func HopSenderOf(ctx context.Context) *HopSender {
	s, _ := ctx.Value(hopSenderKey{}).(*HopSender)
	return s
}

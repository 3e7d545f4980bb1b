package wire

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
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

// Hop head flags.
const (
	// HopBound: the head carries the session's binding.
	HopBound uint8 = 0x01
)

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
	// Verify: a verify hop (flag HopVerify, speculate.go); Tokens are the
	// last accepted token and the drafts.
	Verify bool
	// Pass orders the passes of a head that keeps several in flight
	// (flag HopPassOrder, speculate.go); zero: unordered.
	Pass PassOrder
	// Parents: a verify hop's rows are a token tree (flag HopTree,
	// tree.go); nil: a chain.
	Parents []int32
	// Keep: cache slots to move to Position-len(Keep).. before this hop
	// runs (flag HopKeep, tree.go): the branch a tree hop accepted.
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

const bindingVersion = 1

// Append encodes b.
func (b *Binding) Append(dst []byte) ([]byte, error) {
	if b.StartLayer < 0 || b.StartLayer > MaxLayerIndex || b.EndLayer < b.StartLayer || b.EndLayer > MaxLayerIndex {
		return nil, fmt.Errorf("wire: binding layers %d-%d are not a range", b.StartLayer, b.EndLayer)
	}
	var route []byte
	if len(b.Route) > 0 {
		var err error
		if route, err = json.Marshal(b.Route); err != nil {
			return nil, err
		}
	}
	samp, err := json.Marshal(b.Sampling)
	if err != nil {
		return nil, err
	}
	if len(route) > MaxRouteBytes || len(samp) > MaxHopSampling || len(b.Ticket) > MaxTicketBytes {
		return nil, fmt.Errorf("%w: binding field over its limit (route %d of %d bytes, sampling %d of %d, ticket %d of %d)",
			ErrHopEncode, len(route), MaxRouteBytes, len(samp), MaxHopSampling, len(b.Ticket), MaxTicketBytes)
	}
	dst = append(dst, bindingVersion)
	dst = binary.BigEndian.AppendUint16(dst, uint16(b.StartLayer))
	dst = binary.BigEndian.AppendUint16(dst, uint16(b.EndLayer))
	dst = appendB16(dst, route)
	dst = appendB16(dst, samp)
	return appendB16(dst, b.Ticket), nil
}

// ParseBinding decodes and validates a binding: field limits, the route as
// ParseRoute checks it (numLayers > 0 also bounds the layers) and starting
// right after EndLayer, the sampling parameters in range. Ticket aliases p.
func ParseBinding(p []byte, numLayers int) (*Binding, error) {
	if len(p) > MaxBindingBytes {
		return nil, fmt.Errorf("binding of %d bytes, more than %d", len(p), MaxBindingBytes)
	}
	r := reader{b: p}
	v := r.u8()
	b := &Binding{StartLayer: int(r.u16()), EndLayer: int(r.u16())}
	route := r.b16()
	samp := r.b16()
	b.Ticket = r.b16()
	if r.err != nil {
		return nil, errors.New("truncated binding")
	}
	if v != bindingVersion {
		return nil, fmt.Errorf("binding version %d, want %d", v, bindingVersion)
	}
	if len(r.b) != 0 {
		return nil, errors.New("trailing bytes after the binding")
	}
	if b.EndLayer < b.StartLayer || b.EndLayer > MaxLayerIndex || (numLayers > 0 && b.EndLayer >= numLayers) {
		return nil, fmt.Errorf("layers %d-%d are not a range of the model", b.StartLayer, b.EndLayer)
	}
	if len(route) > MaxRouteBytes || len(samp) > MaxHopSampling || len(b.Ticket) > MaxTicketBytes {
		return nil, errors.New("binding field over its limit")
	}
	if len(route) > 0 {
		hops, err := ParseRoute(string(route), numLayers)
		if err != nil {
			return nil, fmt.Errorf("route: %v", err)
		}
		if len(hops) > 0 && hops[0].StartLayer != b.EndLayer+1 {
			return nil, fmt.Errorf("route: first hop starts at layer %d, but this hop ends at layer %d", hops[0].StartLayer, b.EndLayer)
		}
		if len(hops) > 0 {
			b.Route = hops
		}
	}
	if err := json.Unmarshal(samp, &b.Sampling); err != nil {
		return nil, fmt.Errorf("sampling: not a JSON object of sampling parameters: %v", err)
	}
	if err := b.Sampling.Validate(); err != nil {
		return nil, fmt.Errorf("sampling: %v", err)
	}
	return b, nil
}

// AppendHopFrame appends a whole Hop frame but its payload of payloadLen
// bytes, which the caller writes right after from its own buffer.
func AppendHopFrame(dst []byte, stream uint64, peer string, h *HopHead, payloadLen int) ([]byte, error) {
	if len(h.Session) > MaxSessionIDLen || h.Position < 0 || h.Position > MaxPosition || h.NTokens < 1 || h.NTokens > MaxHopTokens ||
		h.Hidden < 1 || h.Hidden > MaxHidden || DTypeSize(h.DType) == 0 || h.Step < 0 || h.Step > math.MaxUint32 || len(h.Tokens) > 0xffff {
		return nil, fmt.Errorf("%w: hop head out of range", ErrHopEncode)
	}
	start := len(dst)
	dst = AppendHeader(dst, FrameHop, 0)
	dst = binary.BigEndian.AppendUint64(dst, stream)
	var err error
	if dst, err = appendS8(dst, peer); err != nil {
		return nil, err
	}
	lenAt := len(dst)
	dst = append(dst, 0, 0, 0, 0)
	flags := uint8(0)
	if h.Binding != nil {
		flags |= HopBound
	}
	if h.Verify {
		if len(h.Tokens) != h.NTokens || h.NTokens > MaxVerifyRows {
			return nil, fmt.Errorf("%w: a verify hop needs one token per row, at most MaxVerifyRows", ErrHopEncode)
		}
		flags |= HopVerify
	}
	if h.Pass.Set() {
		if err := h.Pass.Check(); err != nil {
			return nil, fmt.Errorf("%w: %v", ErrHopEncode, err)
		}
		flags |= HopPassOrder
	}
	if h.Parents != nil {
		if !h.Verify || CheckTree(h.Parents, h.NTokens) != nil {
			return nil, fmt.Errorf("%w: a tree needs a verify hop and a valid parent per row", ErrHopEncode)
		}
		flags |= HopTree
	}
	if len(h.Keep) > 0 {
		if CheckKeep(h.Keep, h.Position) != nil {
			return nil, fmt.Errorf("%w: keep slots out of range", ErrHopEncode)
		}
		flags |= HopKeep
	}
	dst = append(dst, flags)
	dst, _ = appendS8(dst, h.Session)
	dst = binary.BigEndian.AppendUint32(dst, uint32(h.Position))
	dst = binary.BigEndian.AppendUint32(dst, uint32(h.NTokens))
	dst = binary.BigEndian.AppendUint32(dst, uint32(h.Hidden))
	dst = append(dst, h.DType)
	dst = binary.BigEndian.AppendUint32(dst, uint32(h.Step))
	var dl uint64
	if !h.Deadline.IsZero() {
		dl = uint64(max(h.Deadline.UnixMilli(), 1))
	}
	dst = binary.BigEndian.AppendUint64(dst, dl)
	dst = binary.BigEndian.AppendUint16(dst, uint16(len(h.Tokens)))
	for _, t := range h.Tokens {
		dst = binary.BigEndian.AppendUint32(dst, uint32(t))
	}
	if h.Pass.Set() {
		dst = binary.BigEndian.AppendUint32(dst, h.Pass.Seq)
		dst = binary.BigEndian.AppendUint32(dst, h.Pass.After)
	}
	if h.Parents != nil {
		dst = appendTree(dst, h.Parents)
	}
	if len(h.Keep) > 0 {
		dst = appendKeep(dst, h.Keep, h.Position)
	}
	if h.Binding != nil {
		bstart := len(dst)
		dst = append(dst, 0, 0)
		if dst, err = h.Binding.Append(dst); err != nil {
			return nil, err
		}
		n := len(dst) - bstart - 2
		if n > MaxBindingBytes {
			return nil, fmt.Errorf("%w: binding over its limit", ErrHopEncode)
		}
		binary.BigEndian.PutUint16(dst[bstart:], uint16(n))
	}
	headLen := len(dst) - lenAt - 4
	if headLen > MaxHopHead {
		return nil, fmt.Errorf("%w: hop head over its limit", ErrHopEncode)
	}
	binary.BigEndian.PutUint32(dst[lenAt:], uint32(headLen))
	binary.BigEndian.PutUint32(dst[start+1:], uint32(len(dst)-start-FrameHeaderLen+payloadLen))
	return dst, nil
}

// HopRoute is the routing prefix of a Hop frame, which the relay rewrites.
type HopRoute struct {
	Stream uint64
	Peer   string
}

// ReadHopRoute reads the routing prefix of a Hop frame whose payload of n
// bytes starts at r; it returns the bytes of the payload left.
func ReadHopRoute(r io.Reader, n int) (HopRoute, int, error) {
	var rt HopRoute
	var b [9]byte
	if n < 9 {
		return rt, 0, ErrShortFrame
	}
	if _, err := io.ReadFull(r, b[:]); err != nil {
		return rt, 0, shortErr(err)
	}
	rt.Stream = binary.BigEndian.Uint64(b[:])
	pl := int(b[8])
	if n < 9+pl {
		return rt, 0, ErrShortFrame
	}
	if pl > 0 {
		peer := make([]byte, pl)
		if _, err := io.ReadFull(r, peer); err != nil {
			return rt, 0, shortErr(err)
		}
		rt.Peer = string(peer)
	}
	return rt, n - 9 - pl, nil
}

// ReadHopHead reads the head of a Hop frame (after its routing prefix;
// rest is the frame's bytes left), validating every field before it is
// allocated for. scratch, when big enough, holds the encoded head (it
// must outlive nothing: the returned head copies what it keeps). It
// returns the head and the payload length that follows it. A malformed
// head is an error, after which the connection must close: its framing can
// no longer be trusted.
func ReadHopHead(r io.Reader, rest int, scratch []byte, numLayers int) (*HopHead, int, error) {
	var lb [4]byte
	if rest < 4 {
		return nil, 0, ErrShortFrame
	}
	if _, err := io.ReadFull(r, lb[:]); err != nil {
		return nil, 0, shortErr(err)
	}
	hl := int(binary.BigEndian.Uint32(lb[:]))
	if hl > MaxHopHead || hl > rest-4 {
		return nil, 0, fmt.Errorf("wire: hop head of %d bytes (limit %d, frame has %d)", hl, MaxHopHead, rest-4)
	}
	var p []byte
	if hl <= cap(scratch) {
		p = scratch[:hl]
	} else {
		p = make([]byte, hl)
	}
	if _, err := io.ReadFull(r, p); err != nil {
		return nil, 0, shortErr(err)
	}
	h, err := ParseHopHead(p, numLayers)
	if err != nil {
		return nil, 0, err
	}
	return h, rest - 4 - hl, nil
}

// ReadHop reads a Hop frame's route and head back to back (ReadHopRoute,
// then ReadHopHead): a plain frame, whose head follows its route. It
// returns the payload length that follows.
func ReadHop(r io.Reader, n int, scratch []byte, numLayers int) (HopRoute, *HopHead, int, error) {
	rt, rest, err := ReadHopRoute(r, n)
	if err != nil {
		return rt, nil, 0, err
	}
	h, pl, err := ReadHopHead(r, rest, scratch, numLayers)
	return rt, h, pl, err
}

// ParseHopHead decodes a Hop head (its b32 contents) and validates it.
func ParseHopHead(p []byte, numLayers int) (*HopHead, error) {
	r := reader{b: p}
	flags := r.u8()
	h := &HopHead{}
	sess := r.take(int(r.u8()))
	h.Position = int(r.u32())
	h.NTokens = int(r.u32())
	h.Hidden = int(r.u32())
	h.DType = r.u8()
	h.Step = int(r.u32())
	dl := r.u64()
	nt := int(r.u16())
	if r.err != nil {
		return nil, errors.New("wire: truncated hop head")
	}
	if !ValidSessionID(string(sess)) {
		return nil, fmt.Errorf("wire: session id: want 1-%d characters of [A-Za-z0-9._:-]", MaxSessionIDLen)
	}
	if h.Position > MaxPosition || h.NTokens < 1 || h.NTokens > MaxHopTokens || h.Hidden < 1 || h.Hidden > MaxHidden {
		return nil, fmt.Errorf("wire: hop shape %d,%d at position %d out of range", h.NTokens, h.Hidden, h.Position)
	}
	if DTypeSize(h.DType) == 0 {
		return nil, fmt.Errorf("wire: unknown dtype %d", h.DType)
	}
	if dl > math.MaxInt64/2 {
		return nil, errors.New("wire: deadline out of range")
	}
	if nt != 0 && nt != h.NTokens {
		return nil, fmt.Errorf("wire: %d token ids for %d rows", nt, h.NTokens)
	}
	if nt*4 > len(r.b) {
		return nil, errors.New("wire: truncated hop tokens")
	}
	if h.Verify = flags&HopVerify != 0; h.Verify && (nt != h.NTokens || h.NTokens > MaxVerifyRows) {
		return nil, fmt.Errorf("wire: verify hop of %d rows with %d token ids (one per row, at most %d)", h.NTokens, nt, MaxVerifyRows)
	}
	h.Session = string(sess)
	if dl != 0 {
		h.Deadline = time.UnixMilli(int64(dl))
	}
	if nt > 0 {
		h.Tokens = make([]int32, nt)
		for i := range h.Tokens {
			h.Tokens[i] = int32(r.u32())
		}
	}
	if flags&HopPassOrder != 0 {
		h.Pass = PassOrder{Seq: r.u32(), After: r.u32()}
		if r.err != nil {
			return nil, errors.New("wire: truncated pass order")
		}
		if err := h.Pass.Check(); err != nil {
			return nil, err
		}
	}
	if flags&HopTree != 0 {
		if !h.Verify {
			return nil, errors.New("wire: a tree on a hop that is not a verify hop")
		}
		var err error
		if h.Parents, err = r.tree(h.NTokens); err != nil {
			return nil, err
		}
	}
	if flags&HopKeep != 0 {
		var err error
		if h.Keep, err = r.keep(h.Position); err != nil {
			return nil, err
		}
	}
	if flags&HopBound != 0 {
		bp := r.b16()
		if r.err != nil {
			return nil, errors.New("wire: truncated binding")
		}
		b, err := ParseBinding(bp, numLayers)
		if err != nil {
			return nil, fmt.Errorf("wire: binding: %v", err)
		}
		b.Ticket = append([]byte(nil), b.Ticket...) // p is scratch
		h.Binding = b
	}
	if len(r.b) != 0 {
		return nil, errors.New("wire: trailing bytes in the hop head")
	}
	return h, nil
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

// AppendHopReplyFrame appends a whole HopReply frame but its payload
// (activations), which the caller writes right after.
func AppendHopReplyFrame(dst []byte, stream uint64, a *HopReply) ([]byte, error) {
	start := len(dst)
	dst = AppendHeader(dst, FrameHopReply, 0)
	dst = binary.BigEndian.AppendUint64(dst, stream)
	dst = binary.BigEndian.AppendUint16(dst, uint16(a.Status))
	dst = append(dst, a.Kind)
	payload := 0
	switch a.Kind {
	case ReplyActivations:
		if a.EndLayer < 0 || a.EndLayer > MaxLayerIndex || a.NTokens < 1 || a.Hidden < 1 || DTypeSize(a.DType) == 0 ||
			len(a.Payload) != a.NTokens*a.Hidden*DTypeSize(a.DType) {
			return nil, errors.New("wire: activations reply out of range")
		}
		dst = binary.BigEndian.AppendUint16(dst, uint16(a.EndLayer))
		dst = binary.BigEndian.AppendUint32(dst, uint32(a.NTokens))
		dst = binary.BigEndian.AppendUint32(dst, uint32(a.Hidden))
		dst = append(dst, a.DType)
		payload = len(a.Payload)
	case ReplyToken:
		dst = binary.BigEndian.AppendUint32(dst, uint32(a.Token))
		dst = binary.BigEndian.AppendUint32(dst, math.Float32bits(a.Logprob))
		if l := a.Logprobs; l != nil {
			if len(l.Top) > MaxTopLogprobs {
				return nil, errors.New("wire: token reply with too many top logprobs")
			}
			dst = binary.BigEndian.AppendUint32(dst, math.Float32bits(l.Logprob))
			dst = append(dst, uint8(len(l.Top)))
			for _, c := range l.Top {
				dst = binary.BigEndian.AppendUint32(dst, uint32(c.ID))
				dst = binary.BigEndian.AppendUint32(dst, math.Float32bits(c.Logprob))
			}
		}
	case ReplyTokens:
		var err error
		if dst, err = AppendTokens(dst, a.Tokens); err != nil {
			return nil, err
		}
	case ReplyError:
		if len(a.Body) > MaxReplyBody {
			return nil, errors.New("wire: error reply over its limit")
		}
		dst = append(dst, a.Body...)
	default:
		return nil, fmt.Errorf("wire: reply kind %d", a.Kind)
	}
	binary.BigEndian.PutUint32(dst[start+1:], uint32(len(dst)-start-FrameHeaderLen+payload))
	return dst, nil
}

// ReadHopReply reads a HopReply frame's payload of n bytes from r. The
// activations' payload goes into the buffer that into(stream) lends for
// its length (validated against the shape first). A nil into allocates;
// a nil lender means nobody waits for that stream: the payload is skipped
// unread and the reply has none. Any error leaves r mid-frame: close the
// connection.
func ReadHopReply(r io.Reader, n int, into func(stream uint64) ReplyBuffer) (uint64, *HopReply, error) {
	var b [11]byte
	if n < len(b) {
		return 0, nil, ErrShortFrame
	}
	if _, err := io.ReadFull(r, b[:]); err != nil {
		return 0, nil, shortErr(err)
	}
	stream := binary.BigEndian.Uint64(b[:])
	a := &HopReply{Status: int(binary.BigEndian.Uint16(b[8:])), Kind: b[10]}
	rest := n - len(b)
	switch a.Kind {
	case ReplyActivations:
		var m [11]byte
		if rest < len(m) {
			return stream, nil, ErrShortFrame
		}
		if _, err := io.ReadFull(r, m[:]); err != nil {
			return stream, nil, shortErr(err)
		}
		a.EndLayer = int(binary.BigEndian.Uint16(m[:]))
		a.NTokens = int(binary.BigEndian.Uint32(m[2:]))
		a.Hidden = int(binary.BigEndian.Uint32(m[6:]))
		a.DType = m[10]
		rest -= len(m)
		if a.NTokens < 1 || a.NTokens > MaxHopTokens || a.Hidden < 1 || a.Hidden > MaxHidden || DTypeSize(a.DType) == 0 ||
			int64(rest) != int64(a.NTokens)*int64(a.Hidden)*int64(DTypeSize(a.DType)) {
			return stream, nil, fmt.Errorf("wire: activations reply of %d bytes for shape %d,%d dtype %d", rest, a.NTokens, a.Hidden, a.DType)
		}
		var lend ReplyBuffer
		if into != nil {
			if lend = into(stream); lend == nil {
				return stream, a, Discard(r, rest)
			}
		}
		var buf []byte
		if lend != nil {
			var err error
			if buf, a.Release, err = lend(rest); err != nil {
				return stream, nil, err
			}
		} else {
			buf = make([]byte, rest)
		}
		if len(buf) != rest {
			a.ReleaseBuffer()
			return stream, nil, errors.New("wire: reply buffer of the wrong size")
		}
		if _, err := io.ReadFull(r, buf); err != nil {
			a.ReleaseBuffer()
			return stream, nil, shortErr(err)
		}
		a.Payload = buf
	case ReplyToken:
		// token and logprob, then optionally model logprob, n and n pairs
		if rest != 8 && (rest < 13 || (rest-13)%8 != 0 || (rest-13)/8 > MaxTopLogprobs) {
			return stream, nil, fmt.Errorf("wire: token reply of %d bytes", rest)
		}
		var t [13 + 8*MaxTopLogprobs]byte
		if _, err := io.ReadFull(r, t[:rest]); err != nil {
			return stream, nil, shortErr(err)
		}
		a.Token = int32(binary.BigEndian.Uint32(t[:]))
		a.Logprob = math.Float32frombits(binary.BigEndian.Uint32(t[4:]))
		if rest > 8 {
			n := int(t[12])
			if rest != 13+8*n {
				return stream, nil, fmt.Errorf("wire: token reply of %d bytes for %d top logprobs", rest, n)
			}
			l := &TokenLogprobs{Logprob: math.Float32frombits(binary.BigEndian.Uint32(t[8:]))}
			for i := 0; i < n; i++ {
				o := 13 + 8*i
				l.Top = append(l.Top, Candidate{ID: int32(binary.BigEndian.Uint32(t[o:])), Logprob: math.Float32frombits(binary.BigEndian.Uint32(t[o+4:]))})
			}
			a.Logprobs = l
		}
	case ReplyTokens:
		if rest > 2+8*MaxVerifyRows {
			return stream, nil, fmt.Errorf("wire: verify reply of %d bytes", rest)
		}
		b := make([]byte, rest)
		if _, err := io.ReadFull(r, b); err != nil {
			return stream, nil, shortErr(err)
		}
		var err error
		if a.Tokens, err = ParseTokens(b); err != nil {
			return stream, nil, err
		}
	case ReplyError:
		if rest > MaxReplyBody {
			return stream, nil, fmt.Errorf("wire: error reply of %d bytes", rest)
		}
		a.Body = make([]byte, rest)
		if _, err := io.ReadFull(r, a.Body); err != nil {
			return stream, nil, shortErr(err)
		}
	default:
		return stream, nil, fmt.Errorf("wire: reply kind %d", a.Kind)
	}
	return stream, a, nil
}

// Discard skips n bytes of r (an unknown frame's payload, or a refused
// hop's), without buffering them.
func Discard(r io.Reader, n int) error {
	_, err := io.CopyN(io.Discard, r, int64(n))
	return shortErr(err)
}

func appendB16(dst, b []byte) []byte {
	return append(binary.BigEndian.AppendUint16(dst, uint16(len(b))), b...)
}

func (r *reader) b16() []byte { return r.take(int(r.u16())) }

// ReplyBuffer lends the buffer an activations reply of n bytes is read
// into; release (which may be nil) returns it once the reply is used.
type ReplyBuffer func(n int) (buf []byte, release func(), err error)

// HeapBuffer is a ReplyBuffer of Go memory.
func HeapBuffer(n int) ([]byte, func(), error) { return make([]byte, n), nil, nil }

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

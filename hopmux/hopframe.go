// The Hop and HopReply frames' codec (layouts in doc.go): the head, the
// binding, trees, keeps and tokens replies as bytes, and the readers that
// check every field before they allocate for it.

package hopmux

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"time"

	"meshgpu/wire"
)

// Hop head flags.
const (
	// HopBound: the head carries the session's binding.
	HopBound uint8 = 0x01
	// HopVerify: a verify hop (wire/speculate.go): its token ids (always
	// present, one per row) are the last accepted token and then the
	// drafts, and the node with the last layer answers wire.ReplyTokens.
	HopVerify uint8 = 0x02
	// HopPassOrder: an ordered pass (wire.PassOrder): seq u32 | after u32
	// follow the tokens.
	HopPassOrder uint8 = 0x04
	// HopTree: a verify hop's rows are a tree (wire/tree.go); its parents
	// follow the tokens, one byte per row: the parent row + 1 (0 for the
	// root).
	HopTree uint8 = 0x08
	// HopKeep: before this hop, move cache slots; count u8, then count
	// bytes, each slot's offset from Position - count.
	HopKeep uint8 = 0x10
)

const bindingVersion = 1

// AppendBinding appends b's encoding (the b16 contents of a bound head).
func AppendBinding(dst []byte, b *wire.Binding) ([]byte, error) {
	if b.StartLayer < 0 || b.StartLayer > wire.MaxLayerIndex || b.EndLayer < b.StartLayer || b.EndLayer > wire.MaxLayerIndex {
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
	if len(route) > wire.MaxRouteBytes || len(samp) > wire.MaxHopSampling || len(b.Ticket) > wire.MaxTicketBytes {
		return nil, fmt.Errorf("%w: binding field over its limit (route %d of %d bytes, sampling %d of %d, ticket %d of %d)",
			wire.ErrHopEncode, len(route), wire.MaxRouteBytes, len(samp), wire.MaxHopSampling, len(b.Ticket), wire.MaxTicketBytes)
	}
	dst = append(dst, bindingVersion)
	dst = binary.BigEndian.AppendUint16(dst, uint16(b.StartLayer))
	dst = binary.BigEndian.AppendUint16(dst, uint16(b.EndLayer))
	dst = appendB16(dst, route)
	dst = appendB16(dst, samp)
	return appendB16(dst, b.Ticket), nil
}

// ParseBinding decodes and validates a binding: field limits, the route as
// wire.ParseRoute checks it (numLayers > 0 also bounds the layers) and starting
// right after EndLayer, the sampling parameters in range. Ticket aliases p.
func ParseBinding(p []byte, numLayers int) (*wire.Binding, error) {
	if len(p) > wire.MaxBindingBytes {
		return nil, fmt.Errorf("binding of %d bytes, more than %d", len(p), wire.MaxBindingBytes)
	}
	r := reader{b: p}
	v := r.u8()
	b := &wire.Binding{StartLayer: int(r.u16()), EndLayer: int(r.u16())}
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
	if b.EndLayer < b.StartLayer || b.EndLayer > wire.MaxLayerIndex || (numLayers > 0 && b.EndLayer >= numLayers) {
		return nil, fmt.Errorf("layers %d-%d are not a range of the model", b.StartLayer, b.EndLayer)
	}
	if len(route) > wire.MaxRouteBytes || len(samp) > wire.MaxHopSampling || len(b.Ticket) > wire.MaxTicketBytes {
		return nil, errors.New("binding field over its limit")
	}
	if len(route) > 0 {
		hops, err := wire.ParseRoute(string(route), numLayers)
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
func AppendHopFrame(dst []byte, stream uint64, peer string, h *wire.HopHead, payloadLen int) ([]byte, error) {
	if len(h.Session) > wire.MaxSessionIDLen || h.Position < 0 || h.Position > wire.MaxPosition || h.NTokens < 1 || h.NTokens > wire.MaxHopTokens ||
		h.Hidden < 1 || h.Hidden > wire.MaxHidden || wire.DTypeSize(h.DType) == 0 || h.Step < 0 || h.Step > math.MaxUint32 || len(h.Tokens) > 0xffff {
		return nil, fmt.Errorf("%w: hop head out of range", wire.ErrHopEncode)
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
		if len(h.Tokens) != h.NTokens || h.NTokens > wire.MaxVerifyRows {
			return nil, fmt.Errorf("%w: a verify hop needs one token per row, at most MaxVerifyRows", wire.ErrHopEncode)
		}
		flags |= HopVerify
	}
	if h.Pass.Set() {
		if err := h.Pass.Check(); err != nil {
			return nil, fmt.Errorf("%w: %v", wire.ErrHopEncode, err)
		}
		flags |= HopPassOrder
	}
	if h.Parents != nil {
		if !h.Verify || wire.CheckTree(h.Parents, h.NTokens) != nil {
			return nil, fmt.Errorf("%w: a tree needs a verify hop and a valid parent per row", wire.ErrHopEncode)
		}
		flags |= HopTree
	}
	if len(h.Keep) > 0 {
		if wire.CheckKeep(h.Keep, h.Position) != nil {
			return nil, fmt.Errorf("%w: keep slots out of range", wire.ErrHopEncode)
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
		if dst, err = AppendBinding(dst, h.Binding); err != nil {
			return nil, err
		}
		n := len(dst) - bstart - 2
		if n > wire.MaxBindingBytes {
			return nil, fmt.Errorf("%w: binding over its limit", wire.ErrHopEncode)
		}
		binary.BigEndian.PutUint16(dst[bstart:], uint16(n))
	}
	headLen := len(dst) - lenAt - 4
	if headLen > wire.MaxHopHead {
		return nil, fmt.Errorf("%w: hop head over its limit", wire.ErrHopEncode)
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
func ReadHopHead(r io.Reader, rest int, scratch []byte, numLayers int) (*wire.HopHead, int, error) {
	var lb [4]byte
	if rest < 4 {
		return nil, 0, ErrShortFrame
	}
	if _, err := io.ReadFull(r, lb[:]); err != nil {
		return nil, 0, shortErr(err)
	}
	hl := int(binary.BigEndian.Uint32(lb[:]))
	if hl > wire.MaxHopHead || hl > rest-4 {
		return nil, 0, fmt.Errorf("wire: hop head of %d bytes (limit %d, frame has %d)", hl, wire.MaxHopHead, rest-4)
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
func ReadHop(r io.Reader, n int, scratch []byte, numLayers int) (HopRoute, *wire.HopHead, int, error) {
	rt, rest, err := ReadHopRoute(r, n)
	if err != nil {
		return rt, nil, 0, err
	}
	h, pl, err := ReadHopHead(r, rest, scratch, numLayers)
	return rt, h, pl, err
}

// ParseHopHead decodes a Hop head (its b32 contents) and validates it.
func ParseHopHead(p []byte, numLayers int) (*wire.HopHead, error) {
	r := reader{b: p}
	flags := r.u8()
	h := &wire.HopHead{}
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
	if !wire.ValidSessionID(string(sess)) {
		return nil, fmt.Errorf("wire: session id: want 1-%d characters of [A-Za-z0-9._:-]", wire.MaxSessionIDLen)
	}
	if h.Position > wire.MaxPosition || h.NTokens < 1 || h.NTokens > wire.MaxHopTokens || h.Hidden < 1 || h.Hidden > wire.MaxHidden {
		return nil, fmt.Errorf("wire: hop shape %d,%d at position %d out of range", h.NTokens, h.Hidden, h.Position)
	}
	if wire.DTypeSize(h.DType) == 0 {
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
	if h.Verify = flags&HopVerify != 0; h.Verify && (nt != h.NTokens || h.NTokens > wire.MaxVerifyRows) {
		return nil, fmt.Errorf("wire: verify hop of %d rows with %d token ids (one per row, at most %d)", h.NTokens, nt, wire.MaxVerifyRows)
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
		h.Pass = wire.PassOrder{Seq: r.u32(), After: r.u32()}
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

// AppendHopReplyFrame appends a whole HopReply frame but its payload
// (activations), which the caller writes right after.
func AppendHopReplyFrame(dst []byte, stream uint64, a *wire.HopReply) ([]byte, error) {
	start := len(dst)
	dst = AppendHeader(dst, FrameHopReply, 0)
	dst = binary.BigEndian.AppendUint64(dst, stream)
	dst = binary.BigEndian.AppendUint16(dst, uint16(a.Status))
	dst = append(dst, a.Kind)
	payload := 0
	switch a.Kind {
	case wire.ReplyActivations:
		if a.EndLayer < 0 || a.EndLayer > wire.MaxLayerIndex || a.NTokens < 1 || a.Hidden < 1 || wire.DTypeSize(a.DType) == 0 ||
			len(a.Payload) != a.NTokens*a.Hidden*wire.DTypeSize(a.DType) {
			return nil, errors.New("wire: activations reply out of range")
		}
		dst = binary.BigEndian.AppendUint16(dst, uint16(a.EndLayer))
		dst = binary.BigEndian.AppendUint32(dst, uint32(a.NTokens))
		dst = binary.BigEndian.AppendUint32(dst, uint32(a.Hidden))
		dst = append(dst, a.DType)
		payload = len(a.Payload)
	case wire.ReplyToken:
		dst = binary.BigEndian.AppendUint32(dst, uint32(a.Token))
		dst = binary.BigEndian.AppendUint32(dst, math.Float32bits(a.Logprob))
		if l := a.Logprobs; l != nil {
			if len(l.Top) > wire.MaxTopLogprobs {
				return nil, errors.New("wire: token reply with too many top logprobs")
			}
			dst = binary.BigEndian.AppendUint32(dst, math.Float32bits(l.Logprob))
			dst = append(dst, uint8(len(l.Top)))
			for _, c := range l.Top {
				dst = binary.BigEndian.AppendUint32(dst, uint32(c.ID))
				dst = binary.BigEndian.AppendUint32(dst, math.Float32bits(c.Logprob))
			}
		}
	case wire.ReplyTokens:
		var err error
		if dst, err = AppendTokens(dst, a.Tokens); err != nil {
			return nil, err
		}
	case wire.ReplyError:
		if len(a.Body) > wire.MaxReplyBody {
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
func ReadHopReply(r io.Reader, n int, into func(stream uint64) ReplyBuffer) (uint64, *wire.HopReply, error) {
	var b [11]byte
	if n < len(b) {
		return 0, nil, ErrShortFrame
	}
	if _, err := io.ReadFull(r, b[:]); err != nil {
		return 0, nil, shortErr(err)
	}
	stream := binary.BigEndian.Uint64(b[:])
	a := &wire.HopReply{Status: int(binary.BigEndian.Uint16(b[8:])), Kind: b[10]}
	rest := n - len(b)
	switch a.Kind {
	case wire.ReplyActivations:
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
		if a.NTokens < 1 || a.NTokens > wire.MaxHopTokens || a.Hidden < 1 || a.Hidden > wire.MaxHidden || wire.DTypeSize(a.DType) == 0 ||
			int64(rest) != int64(a.NTokens)*int64(a.Hidden)*int64(wire.DTypeSize(a.DType)) {
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
	case wire.ReplyToken:
		// token and logprob, then optionally model logprob, n and n pairs
		if rest != 8 && (rest < 13 || (rest-13)%8 != 0 || (rest-13)/8 > wire.MaxTopLogprobs) {
			return stream, nil, fmt.Errorf("wire: token reply of %d bytes", rest)
		}
		var t [13 + 8*wire.MaxTopLogprobs]byte
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
			l := &wire.TokenLogprobs{Logprob: math.Float32frombits(binary.BigEndian.Uint32(t[8:]))}
			for i := 0; i < n; i++ {
				o := 13 + 8*i
				l.Top = append(l.Top, wire.Candidate{ID: int32(binary.BigEndian.Uint32(t[o:])), Logprob: math.Float32frombits(binary.BigEndian.Uint32(t[o+4:]))})
			}
			a.Logprobs = l
		}
	case wire.ReplyTokens:
		if rest > 2+8*wire.MaxVerifyRows {
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
	case wire.ReplyError:
		if rest > wire.MaxReplyBody {
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

func appendTree(dst []byte, parents []int32) []byte {
	for _, p := range parents {
		dst = append(dst, byte(p+1))
	}
	return dst
}

func appendKeep(dst []byte, keep []int32, pos int) []byte {
	base := int32(pos - len(keep))
	dst = append(dst, byte(len(keep)))
	for _, s := range keep {
		dst = append(dst, byte(s-base))
	}
	return dst
}

func (r *reader) tree(rows int) ([]int32, error) {
	b := r.take(rows)
	if r.err != nil {
		return nil, errors.New("wire: truncated hop tree")
	}
	parents := make([]int32, rows)
	for i, v := range b {
		parents[i] = int32(v) - 1
	}
	return parents, wire.CheckTree(parents, rows)
}

func (r *reader) keep(pos int) ([]int32, error) {
	n := int(r.u8())
	b := r.take(n)
	if r.err != nil {
		return nil, errors.New("wire: truncated hop keep")
	}
	if n == 0 || n > pos {
		return nil, fmt.Errorf("wire: keep of %d slots at position %d", n, pos)
	}
	keep := make([]int32, n)
	for j, v := range b {
		keep[j] = int32(pos-n) + int32(v)
	}
	return keep, wire.CheckKeep(keep, pos)
}

// AppendTokens encodes a wire.ReplyTokens body.
func AppendTokens(dst []byte, toks []wire.TokenReply) ([]byte, error) {
	if len(toks) < 1 || len(toks) > wire.MaxVerifyRows {
		return nil, fmt.Errorf("wire: %d tokens in a verify reply (1-%d)", len(toks), wire.MaxVerifyRows)
	}
	dst = binary.BigEndian.AppendUint16(dst, uint16(len(toks)))
	for _, t := range toks {
		dst = binary.BigEndian.AppendUint32(dst, uint32(t.Token))
		dst = binary.BigEndian.AppendUint32(dst, math.Float32bits(t.Logprob))
	}
	return dst, nil
}

// ParseTokens decodes a wire.ReplyTokens body of exactly its length.
func ParseTokens(p []byte) ([]wire.TokenReply, error) {
	if len(p) < 2 {
		return nil, errors.New("wire: truncated verify reply")
	}
	n := int(binary.BigEndian.Uint16(p))
	if n < 1 || n > wire.MaxVerifyRows || len(p) != 2+8*n {
		return nil, fmt.Errorf("wire: verify reply of %d bytes for %d tokens (1-%d)", len(p), n, wire.MaxVerifyRows)
	}
	out := make([]wire.TokenReply, n)
	for i := range out {
		q := p[2+8*i:]
		out[i] = wire.TokenReply{Token: int32(binary.BigEndian.Uint32(q)), Logprob: math.Float32frombits(binary.BigEndian.Uint32(q[4:]))}
	}
	return out, nil
}

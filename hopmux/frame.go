// Frames: the header, the relay tunnel frames and their codecs (layouts in
// doc.go).

package hopmux

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net/http"
)

// TunnelVersion is the tunnel protocol version carried in FrameServerChallenge,
// FrameClientHello and FrameServerInfo.
const TunnelVersion = 1

// FrameHeaderLen is the size of a frame header: type (1) + length (4).
const FrameHeaderLen = 5

// DefaultMaxFrame is the default largest payload accepted (16 MiB).
const DefaultMaxFrame = 16 << 20

// FrameType is a frame type.
type FrameType byte

const (
	// FrameServerChallenge, relay -> node, first frame on a tunnel:
	//   magic "MGTN" (4) | version u16 | nonce [32]
	FrameServerChallenge FrameType = 0x01
	// FrameClientHello, node -> relay, answer to the challenge:
	//   version u16 | flags u8 | peer id s8 | public key [32] | signature [64] |
	//   join token s16
	// The signature is over "meshgpu-relay-v1\n" + hex(nonce) + "\n" + peer id.
	FrameClientHello FrameType = 0x02
	// FrameServerInfo, relay -> node, registration accepted:
	//   version u16 | max frame u32 | max in-flight per peer u32 | ping interval ms u32
	FrameServerInfo FrameType = 0x03
	// FrameRequest, either direction:
	//   request id u64 | peer id s8 | method s8 | path s16 | header block | body (rest)
	// Sent to the relay the peer id is the target; sent by the relay it is the
	// source. FrameRequest ids are chosen by the sender and unique per connection.
	FrameRequest FrameType = 0x04
	// FrameResponse, either direction:
	//   request id u64 | status u16 | header block | body (rest)
	FrameResponse FrameType = 0x05
	// FrameError, either direction; a request that failed without an HTTP answer:
	//   request id u64 | code u16 (HTTP-like status) | message (rest, UTF-8)
	// FrameRequest id 0 is a connection-level error (e.g. registration refused).
	FrameError FrameType = 0x06
	// FramePing / FramePong, either direction: data [8]; FramePong echoes FramePing's data.
	FramePing FrameType = 0x07
	FramePong FrameType = 0x08
	// FrameCancel, either direction: request id u64. The sender no longer wants
	// the answer; the receiver stops the work if it can. No reply.
	FrameCancel FrameType = 0x09
	// FrameResponseStart, either direction: the head of a streamed answer (the
	// handler flushed before finishing); FrameResponseData frames follow, then
	// FrameResponseEnd, or FrameError if the stream breaks:
	//   request id u64 | status u16 | header block | body (rest)
	FrameResponseStart FrameType = 0x0a
	// FrameResponseData, either direction: more of a streamed answer:
	//   request id u64 | body (rest)
	FrameResponseData FrameType = 0x0b
	// FrameResponseEnd, either direction: the streamed answer is complete:
	//   request id u64
	FrameResponseEnd FrameType = 0x0c
	// FrameHop, either direction: one hop (layouts in doc.go, HopHead):
	//   stream id u64 | peer id s8 | head b32 | payload (rest)
	FrameHop FrameType = 0x0d
	// FrameHopReply, either direction: the answer to a Hop (HopReply):
	//   stream id u64 | status u16 | kind u8 | body (rest)
	FrameHopReply FrameType = 0x0e
)

func (t FrameType) String() string {
	switch t {
	case FrameServerChallenge:
		return "ServerChallenge"
	case FrameClientHello:
		return "ClientHello"
	case FrameServerInfo:
		return "ServerInfo"
	case FrameRequest:
		return "Request"
	case FrameResponse:
		return "Response"
	case FrameError:
		return "Error"
	case FramePing:
		return "Ping"
	case FramePong:
		return "Pong"
	case FrameCancel:
		return "Cancel"
	case FrameResponseStart:
		return "ResponseStart"
	case FrameResponseData:
		return "ResponseData"
	case FrameResponseEnd:
		return "ResponseEnd"
	case FrameHop:
		return "Hop"
	case FrameHopReply:
		return "HopReply"
	}
	return fmt.Sprintf("Type(0x%02x)", byte(t))
}

// TunnelMagic starts the FrameServerChallenge payload.
const TunnelMagic = "MGTN"

// ClientHello flags. FlagAcceptsRequests registers the connection as the
// way to reach its peer id; without it the connection only sends requests.
// FlagHopFrames: the node serves Hop frames on it.
const (
	FlagAcceptsRequests = 0x01
	FlagHopFrames       = 0x02
)

// ServerInfo features. FeatureHopFrames: the relay forwards Hop and
// HopReply frames (to peers that registered FlagHopFrames).
const FeatureHopFrames = 0x01

// ErrFrameTooLarge is returned for a frame whose length exceeds the maximum.
var ErrFrameTooLarge = errors.New("wire: frame exceeds the maximum frame size")

// ErrShortFrame is returned for a payload shorter than its layout.
var ErrShortFrame = errors.New("wire: truncated frame payload")

// ReadFrame reads one whole frame from r into a new payload slice of
// exactly its length, refusing (before allocating) a length over max. It
// returns io.EOF only when r ends exactly at a frame boundary. Activation
// paths read the header with ReadFrameHeader instead, and the payload
// straight into the buffer it belongs in.
func ReadFrame(r io.Reader, max int) (FrameType, []byte, error) {
	typ, n, err := ReadFrameHeader(r, max)
	if err != nil {
		return typ, nil, err
	}
	p := make([]byte, n)
	if _, err := io.ReadFull(r, p); err != nil {
		return typ, nil, shortErr(err)
	}
	return typ, p, nil
}

// ReadFrameHeader reads a frame's type and payload length, refusing a
// length over max (ErrFrameTooLarge). io.EOF means r ended cleanly before
// the frame.
func ReadFrameHeader(r io.Reader, max int) (FrameType, int, error) {
	var h [FrameHeaderLen]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		if err == io.ErrUnexpectedEOF {
			return 0, 0, ErrShortFrame
		}
		return 0, 0, err
	}
	n := binary.BigEndian.Uint32(h[1:])
	if uint64(n) > uint64(max) {
		return FrameType(h[0]), 0, ErrFrameTooLarge
	}
	return FrameType(h[0]), int(n), nil
}

// shortErr maps a payload cut off mid-way to ErrShortFrame.
func shortErr(err error) error {
	if err == io.EOF || err == io.ErrUnexpectedEOF {
		return ErrShortFrame
	}
	return err
}

// AppendHeader appends a frame header for a payload of n bytes.
func AppendHeader(dst []byte, t FrameType, n int) []byte {
	return binary.BigEndian.AppendUint32(append(dst, byte(t)), uint32(n))
}

// Frame builds a whole small frame (everything but FrameRequest/FrameResponse bodies).
func Frame(t FrameType, payload []byte) []byte {
	return append(AppendHeader(make([]byte, 0, FrameHeaderLen+len(payload)), t, len(payload)), payload...)
}

// TunnelChallenge is the FrameServerChallenge payload.
type TunnelChallenge struct {
	Version uint16
	Nonce   [32]byte
}

func (c *TunnelChallenge) Append(dst []byte) []byte {
	dst = append(dst, TunnelMagic...)
	dst = binary.BigEndian.AppendUint16(dst, c.Version)
	return append(dst, c.Nonce[:]...)
}

func ParseTunnelChallenge(p []byte) (TunnelChallenge, error) {
	var c TunnelChallenge
	if len(p) < 4+2+32 || string(p[:4]) != TunnelMagic {
		return c, errors.New("tunnel: not a meshgpu tunnel challenge")
	}
	c.Version = binary.BigEndian.Uint16(p[4:])
	copy(c.Nonce[:], p[6:38])
	return c, nil
}

// MaxTunnelHello bounds a ClientHello's payload (and a /ws registration
// message): a relay reads it before the sender has proved anything, so it
// must not be a frame of the full size. Its fields take under 400 bytes;
// the rest is room for a join token.
const MaxTunnelHello = 4 << 10

// TunnelHello is the FrameClientHello payload.
type TunnelHello struct {
	Version   uint16
	Flags     uint8
	PeerID    string
	PublicKey []byte // 32 bytes
	Signature []byte // 64 bytes
	JoinToken string
}

func (h *TunnelHello) Append(dst []byte) ([]byte, error) {
	if len(h.PublicKey) != 32 || len(h.Signature) != 64 {
		return nil, errors.New("tunnel: hello needs a 32-byte key and a 64-byte signature")
	}
	dst = binary.BigEndian.AppendUint16(dst, h.Version)
	dst = append(dst, h.Flags)
	var err error
	if dst, err = appendS8(dst, h.PeerID); err != nil {
		return nil, err
	}
	dst = append(dst, h.PublicKey...)
	dst = append(dst, h.Signature...)
	return appendS16(dst, h.JoinToken)
}

func ParseTunnelHello(p []byte) (TunnelHello, error) {
	var h TunnelHello
	r := reader{b: p}
	h.Version = r.u16()
	h.Flags = r.u8()
	h.PeerID = r.s8()
	h.PublicKey = r.bytes(32)
	h.Signature = r.bytes(64)
	h.JoinToken = r.s16()
	return h, r.err
}

// TunnelInfo is the FrameServerInfo payload.
type TunnelInfo struct {
	Version        uint16
	MaxFrame       uint32
	MaxInflight    uint32
	PingIntervalMs uint32
	Features       uint32 // absent (0) from relays older than hop frames
}

func (i *TunnelInfo) Append(dst []byte) []byte {
	dst = binary.BigEndian.AppendUint16(dst, i.Version)
	dst = binary.BigEndian.AppendUint32(dst, i.MaxFrame)
	dst = binary.BigEndian.AppendUint32(dst, i.MaxInflight)
	dst = binary.BigEndian.AppendUint32(dst, i.PingIntervalMs)
	return binary.BigEndian.AppendUint32(dst, i.Features)
}

func ParseTunnelInfo(p []byte) (TunnelInfo, error) {
	var i TunnelInfo
	r := reader{b: p}
	i.Version = r.u16()
	i.MaxFrame = r.u32()
	i.MaxInflight = r.u32()
	i.PingIntervalMs = r.u32()
	if r.err == nil && len(r.b) >= 4 {
		i.Features = r.u32()
	}
	return i, r.err
}

// TunnelRequest is a FrameRequest frame. Body aliases the frame buffer when parsed.
type TunnelRequest struct {
	ID     uint64
	Peer   string
	Method string
	Path   string
	Header http.Header
	Body   []byte
}

// AppendHead appends the frame header and every field but the body; the
// caller writes Body right after from its own buffer, so the frame is
// never assembled in a second buffer.
func (q *TunnelRequest) AppendHead(dst []byte) ([]byte, error) {
	start := len(dst)
	dst = AppendHeader(dst, FrameRequest, 0)
	dst = binary.BigEndian.AppendUint64(dst, q.ID)
	var err error
	if dst, err = appendS8(dst, q.Peer); err != nil {
		return nil, err
	}
	if dst, err = appendS8(dst, q.Method); err != nil {
		return nil, err
	}
	if dst, err = appendS16(dst, q.Path); err != nil {
		return nil, err
	}
	if dst, err = AppendHeaderBlock(dst, q.Header); err != nil {
		return nil, err
	}
	binary.BigEndian.PutUint32(dst[start+1:], uint32(len(dst)-start-FrameHeaderLen+len(q.Body)))
	return dst, nil
}

func ParseTunnelRequest(p []byte) (TunnelRequest, error) {
	var q TunnelRequest
	r := reader{b: p}
	q.ID = r.u64()
	q.Peer = r.s8()
	q.Method = r.s8()
	q.Path = r.s16()
	q.Header = r.headers()
	q.Body = r.rest()
	return q, r.err
}

// TunnelResponse is a FrameResponse frame. Body aliases the frame buffer when parsed.
type TunnelResponse struct {
	ID     uint64
	Status uint16
	Header http.Header
	Body   []byte
}

// AppendHead appends the frame header and every field but the body.
func (s *TunnelResponse) AppendHead(dst []byte) ([]byte, error) {
	return s.AppendHeadAs(dst, FrameResponse)
}

// AppendHeadAs is AppendHead for a FrameResponse or a FrameResponseStart frame (same layout).
func (s *TunnelResponse) AppendHeadAs(dst []byte, t FrameType) ([]byte, error) {
	start := len(dst)
	dst = AppendHeader(dst, t, 0)
	dst = binary.BigEndian.AppendUint64(dst, s.ID)
	dst = binary.BigEndian.AppendUint16(dst, s.Status)
	var err error
	if dst, err = AppendHeaderBlock(dst, s.Header); err != nil {
		return nil, err
	}
	binary.BigEndian.PutUint32(dst[start+1:], uint32(len(dst)-start-FrameHeaderLen+len(s.Body)))
	return dst, nil
}

func ParseTunnelResponse(p []byte) (TunnelResponse, error) {
	var s TunnelResponse
	r := reader{b: p}
	s.ID = r.u64()
	s.Status = r.u16()
	s.Header = r.headers()
	s.Body = r.rest()
	return s, r.err
}

// TunnelError is an FrameError frame.
type TunnelError struct {
	ID      uint64
	Code    uint16
	Message string
}

func (e *TunnelError) Append(dst []byte) []byte {
	dst = binary.BigEndian.AppendUint64(dst, e.ID)
	dst = binary.BigEndian.AppendUint16(dst, e.Code)
	return append(dst, e.Message...)
}

func ParseTunnelError(p []byte) (TunnelError, error) {
	var e TunnelError
	r := reader{b: p}
	e.ID = r.u64()
	e.Code = r.u16()
	e.Message = string(r.rest())
	return e, r.err
}

// DataHead is the header and request id of a FrameResponseData frame carrying
// n body bytes, which the caller writes right after.
func DataHead(id uint64, n int) []byte {
	return binary.BigEndian.AppendUint64(AppendHeader(make([]byte, 0, FrameHeaderLen+8), FrameResponseData, 8+n), id)
}

// ParseData splits a FrameResponseData payload.
func ParseData(p []byte) (uint64, []byte, error) {
	if len(p) < 8 {
		return 0, nil, ErrShortFrame
	}
	return binary.BigEndian.Uint64(p), p[8:], nil
}

// AppendID appends a bare request id (the FrameCancel and FrameResponseEnd payload).
func AppendID(dst []byte, id uint64) []byte { return binary.BigEndian.AppendUint64(dst, id) }

// ParseID reads a bare request id.
func ParseID(p []byte) (uint64, error) {
	if len(p) < 8 {
		return 0, ErrShortFrame
	}
	return binary.BigEndian.Uint64(p), nil
}

// AppendHeaderBlock appends the compact header block:
//
//	count u16 | count x (name s16 | value s16)
//
// A header with several values appears once per value.
func AppendHeaderBlock(dst []byte, h http.Header) ([]byte, error) {
	n := 0
	for _, vs := range h {
		n += len(vs)
	}
	if n > 0xffff {
		return nil, errors.New("tunnel: too many header values")
	}
	dst = binary.BigEndian.AppendUint16(dst, uint16(n))
	var err error
	for k, vs := range h {
		for _, v := range vs {
			if dst, err = appendS16(dst, k); err != nil {
				return nil, err
			}
			if dst, err = appendS16(dst, v); err != nil {
				return nil, err
			}
		}
	}
	return dst, nil
}

func appendS8(dst []byte, s string) ([]byte, error) {
	if len(s) > 0xff {
		return nil, fmt.Errorf("tunnel: field of %d bytes exceeds 255", len(s))
	}
	return append(append(dst, byte(len(s))), s...), nil
}

func appendS16(dst []byte, s string) ([]byte, error) {
	if len(s) > 0xffff {
		return nil, fmt.Errorf("tunnel: field of %d bytes exceeds 65535", len(s))
	}
	return append(binary.BigEndian.AppendUint16(dst, uint16(len(s))), s...), nil
}

// reader parses a payload; the first short read sets err and later reads
// return zero values, so parsers check once at the end.
type reader struct {
	b   []byte
	err error
}

func (r *reader) take(n int) []byte {
	if r.err != nil {
		return nil
	}
	if n > len(r.b) {
		r.err = ErrShortFrame
		return nil
	}
	p := r.b[:n:n]
	r.b = r.b[n:]
	return p
}

func (r *reader) u8() uint8 {
	if p := r.take(1); p != nil {
		return p[0]
	}
	return 0
}

func (r *reader) u16() uint16 {
	if p := r.take(2); p != nil {
		return binary.BigEndian.Uint16(p)
	}
	return 0
}

func (r *reader) u32() uint32 {
	if p := r.take(4); p != nil {
		return binary.BigEndian.Uint32(p)
	}
	return 0
}

func (r *reader) u64() uint64 {
	if p := r.take(8); p != nil {
		return binary.BigEndian.Uint64(p)
	}
	return 0
}

func (r *reader) bytes(n int) []byte { return r.take(n) }
func (r *reader) s8() string         { return string(r.take(int(r.u8()))) }
func (r *reader) s16() string        { return string(r.take(int(r.u16()))) }

func (r *reader) rest() []byte {
	if r.err != nil {
		return nil
	}
	p := r.b
	r.b = nil
	return p
}

func (r *reader) headers() http.Header {
	n := int(r.u16())
	if r.err != nil {
		return nil
	}
	// Each header takes at least 4 bytes, so the payload bounds the map
	// size whatever the count claims.
	h := make(http.Header, min(n, len(r.b)/4))
	for i := 0; i < n && r.err == nil; i++ {
		k := r.s16()
		v := r.s16()
		if r.err == nil {
			ck := http.CanonicalHeaderKey(k)
			h[ck] = append(h[ck], v)
		}
	}
	return h
}

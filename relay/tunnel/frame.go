// Package tunnel is the binary frame format of the relay's /tunnel endpoint:
// one persistent WebSocket per node, many hops multiplexed by request id,
// no JSON and no base64 on the activation path.
//
// Every frame is a 1-byte type, a 4-byte big-endian payload length and the
// payload (the layout of tailscale's DERP). One WebSocket binary message
// carries one or more whole frames. Readers skip frame types they do not
// know, so new frames can be added without a version bump; a change to an
// existing layout bumps Version.
//
// Strings are length-prefixed: s8 = u8 length + bytes, s16 = u16 length +
// bytes. Integers are big-endian.
package tunnel

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net/http"
)

// Version is the tunnel protocol version carried in ServerChallenge,
// ClientHello and ServerInfo.
const Version = 1

// HeaderLen is the size of a frame header: type (1) + length (4).
const HeaderLen = 5

// DefaultMaxFrame is the default largest payload accepted (16 MiB).
const DefaultMaxFrame = 16 << 20

// Type is a frame type.
type Type byte

const (
	// ServerChallenge, relay -> node, first frame on a tunnel:
	//   magic "MGTN" (4) | version u16 | nonce [32]
	ServerChallenge Type = 0x01
	// ClientHello, node -> relay, answer to the challenge:
	//   version u16 | flags u8 | peer id s8 | public key [32] | signature [64] |
	//   join token s16
	// The signature is over "meshgpu-relay-v1\n" + hex(nonce) + "\n" + peer id.
	ClientHello Type = 0x02
	// ServerInfo, relay -> node, registration accepted:
	//   version u16 | max frame u32 | max in-flight per peer u32 | ping interval ms u32
	ServerInfo Type = 0x03
	// Request, either direction:
	//   request id u64 | peer id s8 | method s8 | path s16 | header block | body (rest)
	// Sent to the relay the peer id is the target; sent by the relay it is the
	// source. Request ids are chosen by the sender and unique per connection.
	Request Type = 0x04
	// Response, either direction:
	//   request id u64 | status u16 | header block | body (rest)
	Response Type = 0x05
	// Error, either direction; a request that failed without an HTTP answer:
	//   request id u64 | code u16 (HTTP-like status) | message (rest, UTF-8)
	// Request id 0 is a connection-level error (e.g. registration refused).
	Error Type = 0x06
	// Ping / Pong, either direction: data [8]; Pong echoes Ping's data.
	Ping Type = 0x07
	Pong Type = 0x08
	// Cancel, either direction: request id u64. The sender no longer wants
	// the answer; the receiver stops the work if it can. No reply.
	Cancel Type = 0x09
	// ResponseStart, either direction: the head of a streamed answer (the
	// handler flushed before finishing); ResponseData frames follow, then
	// ResponseEnd, or Error if the stream breaks:
	//   request id u64 | status u16 | header block | body (rest)
	ResponseStart Type = 0x0a
	// ResponseData, either direction: more of a streamed answer:
	//   request id u64 | body (rest)
	ResponseData Type = 0x0b
	// ResponseEnd, either direction: the streamed answer is complete:
	//   request id u64
	ResponseEnd Type = 0x0c
)

func (t Type) String() string {
	switch t {
	case ServerChallenge:
		return "ServerChallenge"
	case ClientHello:
		return "ClientHello"
	case ServerInfo:
		return "ServerInfo"
	case Request:
		return "Request"
	case Response:
		return "Response"
	case Error:
		return "Error"
	case Ping:
		return "Ping"
	case Pong:
		return "Pong"
	case Cancel:
		return "Cancel"
	case ResponseStart:
		return "ResponseStart"
	case ResponseData:
		return "ResponseData"
	case ResponseEnd:
		return "ResponseEnd"
	}
	return fmt.Sprintf("Type(0x%02x)", byte(t))
}

// Magic starts the ServerChallenge payload.
const Magic = "MGTN"

// FlagAcceptsRequests in ClientHello registers the connection as the way to
// reach its peer id; without it the connection only sends requests.
const FlagAcceptsRequests = 0x01

// ErrTooLarge is returned for a frame whose length exceeds the maximum.
var ErrTooLarge = errors.New("tunnel: frame exceeds the maximum frame size")

// ErrShort is returned for a payload shorter than its layout.
var ErrShort = errors.New("tunnel: truncated frame payload")

// ReadFrame reads one frame from r. It returns io.EOF only when r ends
// exactly at a frame boundary. Payload is read into buf when it fits,
// otherwise into a new slice; max bounds the payload length.
func ReadFrame(r io.Reader, max int, buf []byte) (Type, []byte, error) {
	var h [HeaderLen]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		if err == io.ErrUnexpectedEOF {
			return 0, nil, ErrShort
		}
		return 0, nil, err
	}
	n := binary.BigEndian.Uint32(h[1:])
	if uint64(n) > uint64(max) {
		return Type(h[0]), nil, ErrTooLarge
	}
	var p []byte
	if int(n) <= cap(buf) {
		p = buf[:n]
	} else {
		p = make([]byte, n)
	}
	if _, err := io.ReadFull(r, p); err != nil {
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			return Type(h[0]), nil, ErrShort
		}
		return Type(h[0]), nil, err
	}
	return Type(h[0]), p, nil
}

// AppendHeader appends a frame header for a payload of n bytes.
func AppendHeader(dst []byte, t Type, n int) []byte {
	return binary.BigEndian.AppendUint32(append(dst, byte(t)), uint32(n))
}

// Frame builds a whole small frame (everything but Request/Response bodies).
func Frame(t Type, payload []byte) []byte {
	return append(AppendHeader(make([]byte, 0, HeaderLen+len(payload)), t, len(payload)), payload...)
}

// Challenge is the ServerChallenge payload.
type Challenge struct {
	Version uint16
	Nonce   [32]byte
}

func (c *Challenge) Append(dst []byte) []byte {
	dst = append(dst, Magic...)
	dst = binary.BigEndian.AppendUint16(dst, c.Version)
	return append(dst, c.Nonce[:]...)
}

func ParseChallenge(p []byte) (Challenge, error) {
	var c Challenge
	if len(p) < 4+2+32 || string(p[:4]) != Magic {
		return c, errors.New("tunnel: not a meshgpu tunnel challenge")
	}
	c.Version = binary.BigEndian.Uint16(p[4:])
	copy(c.Nonce[:], p[6:38])
	return c, nil
}

// Hello is the ClientHello payload.
type Hello struct {
	Version   uint16
	Flags     uint8
	PeerID    string
	PublicKey []byte // 32 bytes
	Signature []byte // 64 bytes
	JoinToken string
}

func (h *Hello) Append(dst []byte) ([]byte, error) {
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

func ParseHello(p []byte) (Hello, error) {
	var h Hello
	r := reader{b: p}
	h.Version = r.u16()
	h.Flags = r.u8()
	h.PeerID = r.s8()
	h.PublicKey = r.bytes(32)
	h.Signature = r.bytes(64)
	h.JoinToken = r.s16()
	return h, r.err
}

// Info is the ServerInfo payload.
type Info struct {
	Version        uint16
	MaxFrame       uint32
	MaxInflight    uint32
	PingIntervalMs uint32
}

func (i *Info) Append(dst []byte) []byte {
	dst = binary.BigEndian.AppendUint16(dst, i.Version)
	dst = binary.BigEndian.AppendUint32(dst, i.MaxFrame)
	dst = binary.BigEndian.AppendUint32(dst, i.MaxInflight)
	return binary.BigEndian.AppendUint32(dst, i.PingIntervalMs)
}

func ParseInfo(p []byte) (Info, error) {
	var i Info
	r := reader{b: p}
	i.Version = r.u16()
	i.MaxFrame = r.u32()
	i.MaxInflight = r.u32()
	i.PingIntervalMs = r.u32()
	return i, r.err
}

// Req is a Request frame. Body aliases the frame buffer when parsed.
type Req struct {
	ID     uint64
	Peer   string
	Method string
	Path   string
	Header http.Header
	Body   []byte
}

// AppendHead appends the frame header and every field but the body; the
// caller writes Body right after, so the body is never copied into a frame
// buffer.
func (q *Req) AppendHead(dst []byte) ([]byte, error) {
	start := len(dst)
	dst = AppendHeader(dst, Request, 0)
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
	binary.BigEndian.PutUint32(dst[start+1:], uint32(len(dst)-start-HeaderLen+len(q.Body)))
	return dst, nil
}

func ParseReq(p []byte) (Req, error) {
	var q Req
	r := reader{b: p}
	q.ID = r.u64()
	q.Peer = r.s8()
	q.Method = r.s8()
	q.Path = r.s16()
	q.Header = r.headers()
	q.Body = r.rest()
	return q, r.err
}

// Resp is a Response frame. Body aliases the frame buffer when parsed.
type Resp struct {
	ID     uint64
	Status uint16
	Header http.Header
	Body   []byte
}

// AppendHead appends the frame header and every field but the body.
func (s *Resp) AppendHead(dst []byte) ([]byte, error) { return s.AppendHeadAs(dst, Response) }

// AppendHeadAs is AppendHead for a Response or a ResponseStart frame (same layout).
func (s *Resp) AppendHeadAs(dst []byte, t Type) ([]byte, error) {
	start := len(dst)
	dst = AppendHeader(dst, t, 0)
	dst = binary.BigEndian.AppendUint64(dst, s.ID)
	dst = binary.BigEndian.AppendUint16(dst, s.Status)
	var err error
	if dst, err = AppendHeaderBlock(dst, s.Header); err != nil {
		return nil, err
	}
	binary.BigEndian.PutUint32(dst[start+1:], uint32(len(dst)-start-HeaderLen+len(s.Body)))
	return dst, nil
}

func ParseResp(p []byte) (Resp, error) {
	var s Resp
	r := reader{b: p}
	s.ID = r.u64()
	s.Status = r.u16()
	s.Header = r.headers()
	s.Body = r.rest()
	return s, r.err
}

// Err is an Error frame.
type Err struct {
	ID      uint64
	Code    uint16
	Message string
}

func (e *Err) Append(dst []byte) []byte {
	dst = binary.BigEndian.AppendUint64(dst, e.ID)
	dst = binary.BigEndian.AppendUint16(dst, e.Code)
	return append(dst, e.Message...)
}

func ParseErr(p []byte) (Err, error) {
	var e Err
	r := reader{b: p}
	e.ID = r.u64()
	e.Code = r.u16()
	e.Message = string(r.rest())
	return e, r.err
}

// DataHead is the header and request id of a ResponseData frame carrying
// n body bytes, which the caller writes right after.
func DataHead(id uint64, n int) []byte {
	return binary.BigEndian.AppendUint64(AppendHeader(make([]byte, 0, HeaderLen+8), ResponseData, 8+n), id)
}

// ParseData splits a ResponseData payload.
func ParseData(p []byte) (uint64, []byte, error) {
	if len(p) < 8 {
		return 0, nil, ErrShort
	}
	return binary.BigEndian.Uint64(p), p[8:], nil
}

// AppendID appends a bare request id (the Cancel and ResponseEnd payload).
func AppendID(dst []byte, id uint64) []byte { return binary.BigEndian.AppendUint64(dst, id) }

// ParseID reads a bare request id.
func ParseID(p []byte) (uint64, error) {
	if len(p) < 8 {
		return 0, ErrShort
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
		r.err = ErrShort
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

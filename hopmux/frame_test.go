package hopmux

import (
	"bytes"
	"errors"
	"io"
	"net/http"
	"reflect"
	"runtime"
	"testing"
)

func TestRequestRoundTrip(t *testing.T) {
	body := []byte{0x3f, 0x80, 0x00, 0x00, 0xbf, 0x80}
	q := TunnelRequest{ID: 1<<40 + 7, Peer: "mg-abc", Method: "POST", Path: "/forward",
		Header: http.Header{"X-Meshnet-Shape": {"3,1"}, "X-Multi": {"a", "b"}}, Body: body}
	head, err := q.AppendHead(nil)
	if err != nil {
		t.Fatal(err)
	}
	frame := append(head, body...)
	typ, p, err := ReadFrame(bytes.NewReader(frame), DefaultMaxFrame)
	if err != nil || typ != FrameRequest {
		t.Fatalf("ReadFrame: %v %v", typ, err)
	}
	got, err := ParseTunnelRequest(p)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, q) {
		t.Fatalf("round trip:\n got %+v\nwant %+v", got, q)
	}
}

func TestResponseAndSmallFramesRoundTrip(t *testing.T) {
	s := TunnelResponse{ID: 9, Status: 429, Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"x":1}`)}
	head, err := s.AppendHead(nil)
	if err != nil {
		t.Fatal(err)
	}
	_, p, err := ReadFrame(bytes.NewReader(append(head, s.Body...)), 1<<10)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := ParseTunnelResponse(p); err != nil || !reflect.DeepEqual(got, s) {
		t.Fatalf("resp: %+v %v", got, err)
	}
	h := TunnelHello{Version: TunnelVersion, Flags: FlagAcceptsRequests, PeerID: "mg-x", PublicKey: make([]byte, 32), Signature: bytes.Repeat([]byte{7}, 64), JoinToken: "tok"}
	hp, err := h.Append(nil)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := ParseTunnelHello(hp); err != nil || !reflect.DeepEqual(got, h) {
		t.Fatalf("hello: %+v %v", got, err)
	}
	dh := DataHead(77, 3)
	_, dp, err := ReadFrame(bytes.NewReader(append(dh, 1, 2, 3)), 100)
	if id, data, err2 := ParseData(dp); err != nil || err2 != nil || id != 77 || !bytes.Equal(data, []byte{1, 2, 3}) {
		t.Fatalf("data: %d %v %v %v", id, data, err, err2)
	}
	e := TunnelError{ID: 3, Code: 502, Message: "peer gone"}
	if got, err := ParseTunnelError(e.Append(nil)); err != nil || got != e {
		t.Fatalf("err: %+v %v", got, err)
	}
	c := TunnelChallenge{Version: TunnelVersion, Nonce: [32]byte{1, 2, 3}}
	if got, err := ParseTunnelChallenge(c.Append(nil)); err != nil || got != c {
		t.Fatalf("challenge: %+v %v", got, err)
	}
	i := TunnelInfo{Version: TunnelVersion, MaxFrame: 1 << 20, MaxInflight: 8, PingIntervalMs: 1000}
	if got, err := ParseTunnelInfo(i.Append(nil)); err != nil || got != i {
		t.Fatalf("info: %+v %v", got, err)
	}
}

// Every truncation of a valid payload must fail cleanly, never panic.
func TestTruncatedPayloadsFail(t *testing.T) {
	q := TunnelRequest{ID: 1, Peer: "p", Method: "POST", Path: "/f", Header: http.Header{"A": {"b"}}}
	head, _ := q.AppendHead(nil)
	p := head[FrameHeaderLen:]
	for n := 0; n < len(p); n++ {
		if _, err := ParseTunnelRequest(p[:n]); err == nil {
			t.Fatalf("ParseReq accepted a %d-byte prefix of %d", n, len(p))
		}
	}
	h := TunnelHello{PeerID: "mg-x", PublicKey: make([]byte, 32), Signature: make([]byte, 64)}
	hp, _ := h.Append(nil)
	for n := 0; n < len(hp); n++ {
		if _, err := ParseTunnelHello(hp[:n]); err == nil {
			t.Fatalf("ParseHello accepted a %d-byte prefix", n)
		}
	}
}

// A header count is a claim the payload must back: a 14-byte frame saying
// 65535 headers must not make the parser allocate for 65535.
func TestHeaderCountDoesNotDriveAllocation(t *testing.T) {
	p := []byte{0, 0, 0, 0, 0, 0, 0, 1, 0, 200, 0xff, 0xff} // id, status, count
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	const n = 20
	for i := 0; i < n; i++ {
		if _, err := ParseTunnelResponse(p); !errors.Is(err, ErrShortFrame) {
			t.Fatalf("ParseResp: %v, want ErrShort", err)
		}
	}
	runtime.ReadMemStats(&after)
	if per := (after.TotalAlloc - before.TotalAlloc) / n; per > 4<<10 {
		t.Fatalf("a truncated 12-byte payload allocated %d bytes", per)
	}
}

func TestReadFrameLimitsAndEOF(t *testing.T) {
	big := AppendHeader(nil, FrameRequest, 1<<20)
	if _, _, err := ReadFrame(bytes.NewReader(big), 1<<10); !errors.Is(err, ErrFrameTooLarge) {
		t.Fatalf("oversized frame: %v, want ErrTooLarge", err)
	}
	if _, _, err := ReadFrame(bytes.NewReader(nil), 10); err != io.EOF {
		t.Fatalf("empty: %v, want EOF", err)
	}
	if _, _, err := ReadFrame(bytes.NewReader(AppendHeader(nil, FramePing, 8)), 10); !errors.Is(err, ErrShortFrame) {
		t.Fatalf("short payload: %v", err)
	}
	// An unknown type is returned, not rejected, so callers can skip it.
	typ, p, err := ReadFrame(bytes.NewReader(Frame(0x7e, []byte("xy"))), 10)
	if err != nil || typ != 0x7e || string(p) != "xy" {
		t.Fatalf("unknown frame: %v %q %v", typ, p, err)
	}
}

func FuzzParse(f *testing.F) {
	q := TunnelRequest{ID: 1, Peer: "p", Method: "POST", Path: "/f", Header: http.Header{"A": {"b"}}, Body: []byte{1}}
	head, _ := q.AppendHead(nil)
	f.Add(append(head[FrameHeaderLen:], 1))
	f.Fuzz(func(t *testing.T, p []byte) {
		ParseTunnelRequest(p)
		ParseTunnelResponse(p)
		ParseTunnelHello(p)
		ParseTunnelError(p)
		ParseTunnelInfo(p)
		ParseTunnelChallenge(p)
	})
}

package hopmux

import (
	"bytes"
	"encoding/binary"
	"reflect"
	"strings"
	"testing"
	"time"

	"meshgpu/wire"
)

func sampleBinding() *wire.Binding {
	return &wire.Binding{StartLayer: 2, EndLayer: 3,
		Route:    []wire.Hop{{Endpoint: "http://127.0.0.1:7002", StartLayer: 4, EndLayer: 5, PeerID: "mg-b"}},
		Sampling: wire.SamplingParams{Temperature: 0.7, TopK: 40, TopP: 0.9, RepetitionPenalty: 1.1, Seed: 42},
		Ticket:   []byte("ticket")}
}

// readHop parses a whole Hop frame as a receiver does.
func readHop(t testing.TB, frame []byte, numLayers int) (HopRoute, *wire.HopHead, []byte, error) {
	t.Helper()
	r := bytes.NewReader(frame)
	typ, n, err := ReadFrameHeader(r, DefaultMaxFrame)
	if err != nil {
		return HopRoute{}, nil, nil, err
	}
	if typ != FrameHop {
		t.Fatalf("type %v", typ)
	}
	rt, rest, err := ReadHopRoute(r, n)
	if err != nil {
		return rt, nil, nil, err
	}
	h, pl, err := ReadHopHead(r, rest, nil, numLayers)
	if err != nil {
		return rt, nil, nil, err
	}
	payload := make([]byte, pl)
	if _, err := r.Read(payload); err != nil && pl > 0 {
		return rt, h, nil, err
	}
	return rt, h, payload, nil
}

func TestHopFrameRoundTrip(t *testing.T) {
	payload := bytes.Repeat([]byte{0x80, 0x3f}, 6)
	for i, bind := range []*wire.Binding{nil, sampleBinding(), nil, sampleBinding()} {
		h := &wire.HopHead{Session: "s-1", Position: 7, NTokens: 2, Hidden: 3, DType: wire.DTypeBF16, Step: 5,
			Deadline: time.UnixMilli(1_900_000_000_000), Tokens: []int32{11, -1}, Binding: bind}
		if i >= 2 {
			h.Pass = wire.PassOrder{Seq: 9, After: 6} // an ordered pass, with and without a binding
		}
		head, err := AppendHopFrame(nil, 99, "mg-peer", h, len(payload))
		if err != nil {
			t.Fatal(err)
		}
		rt, got, gotPayload, err := readHop(t, append(head, payload...), 6)
		if err != nil {
			t.Fatal(err)
		}
		if rt.Stream != 99 || rt.Peer != "mg-peer" || !reflect.DeepEqual(got, h) || !bytes.Equal(gotPayload, payload) {
			t.Fatalf("round trip:\n got %+v %+v %+v\nwant %+v", rt, got, got.Binding, h)
		}
		if got.PayloadLen() != int64(len(payload)) {
			t.Fatalf("PayloadLen %d", got.PayloadLen())
		}
	}
}

// A token reply whose length does not match its top-logprob count, or that
// claims more than MaxTopLogprobs, is refused.
func TestHopReplyTokenLengths(t *testing.T) {
	for _, body := range [][]byte{
		make([]byte, 9), make([]byte, 12), append(make([]byte, 12), 2), append(append(make([]byte, 12), 1), make([]byte, 16)...),
		append(append(make([]byte, 12), wire.MaxTopLogprobs+1), make([]byte, 8*(wire.MaxTopLogprobs+1))...),
	} {
		frame := AppendHeader(nil, FrameHopReply, 11+len(body))
		frame = binary.BigEndian.AppendUint64(frame, 1)
		frame = binary.BigEndian.AppendUint16(frame, 200)
		frame = append(frame, wire.ReplyToken)
		frame = append(frame, body...)
		r := bytes.NewReader(frame)
		_, n, err := ReadFrameHeader(r, 1<<10)
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := ReadHopReply(r, n, nil); err == nil {
			t.Errorf("a token reply of %d bytes was accepted", len(body))
		}
	}
}

func TestHopReplyRoundTrip(t *testing.T) {
	for _, a := range []*wire.HopReply{
		{Status: 200, Kind: wire.ReplyActivations, EndLayer: 5, NTokens: 1, Hidden: 2, DType: wire.DTypeF32, Payload: []byte{1, 2, 3, 4, 5, 6, 7, 8}},
		{Status: 200, Kind: wire.ReplyToken, Token: 1234, Logprob: -0.5},
		{Status: 200, Kind: wire.ReplyToken, Token: 9, Logprob: -0.25, Logprobs: &wire.TokenLogprobs{Logprob: -0.75}},
		{Status: 200, Kind: wire.ReplyToken, Token: 9, Logprob: -0.25, Logprobs: &wire.TokenLogprobs{Logprob: -0.75,
			Top: []wire.Candidate{{ID: 9, Logprob: -0.75}, {ID: 4000, Logprob: -1.5}}}},
		{Status: 404, Kind: wire.ReplyError, Body: []byte(`{"error":{"message":"m","type":"unknown_session"}}`)},
	} {
		head, err := AppendHopReplyFrame(nil, 7, a)
		if err != nil {
			t.Fatal(err)
		}
		r := bytes.NewReader(append(head, a.Payload...))
		typ, n, err := ReadFrameHeader(r, 1<<10)
		if err != nil || typ != FrameHopReply {
			t.Fatal(typ, err)
		}
		id, got, err := ReadHopReply(r, n, nil)
		if err != nil || id != 7 {
			t.Fatal(id, err)
		}
		if !reflect.DeepEqual(got, a) {
			t.Fatalf("got %+v want %+v", got, a)
		}
	}
}

// hopHeadBytes builds a head by hand, as a hostile peer would.
func hopHeadBytes(flags uint8, session string, pos, n, hidden uint32, dtype uint8, ntok uint16, extra []byte) []byte {
	b := []byte{flags, byte(len(session))}
	b = append(b, session...)
	b = binary.BigEndian.AppendUint32(b, pos)
	b = binary.BigEndian.AppendUint32(b, n)
	b = binary.BigEndian.AppendUint32(b, hidden)
	b = append(b, dtype)
	b = binary.BigEndian.AppendUint32(b, 0)
	b = binary.BigEndian.AppendUint64(b, 0)
	b = binary.BigEndian.AppendUint16(b, ntok)
	return append(b, extra...)
}

func TestHostileHopHeadsAreRefused(t *testing.T) {
	cases := map[string][]byte{
		"bad session":         hopHeadBytes(0, "a b", 0, 1, 4, wire.DTypeBF16, 0, nil),
		"empty session":       hopHeadBytes(0, "", 0, 1, 4, wire.DTypeBF16, 0, nil),
		"zero rows":           hopHeadBytes(0, "s", 0, 0, 4, wire.DTypeBF16, 0, nil),
		"huge hidden":         hopHeadBytes(0, "s", 0, 1, 1<<30, wire.DTypeBF16, 0, nil),
		"unknown dtype":       hopHeadBytes(0, "s", 0, 1, 4, 9, 0, nil),
		"tokens count ≠ rows": hopHeadBytes(0, "s", 0, 1, 4, wire.DTypeBF16, 2, make([]byte, 8)),
		"tokens claimed":      hopHeadBytes(0, "s", 0, 1, 4, wire.DTypeBF16, 1, nil),
		"binding claimed":     hopHeadBytes(HopBound, "s", 0, 1, 4, wire.DTypeBF16, 0, []byte{0xff, 0xff}),
		"trailing":            hopHeadBytes(0, "s", 0, 1, 4, wire.DTypeBF16, 0, []byte{1}),
		"truncated":           hopHeadBytes(0, "s", 0, 1, 4, wire.DTypeBF16, 0, nil)[:10],
		"pass order missing":  hopHeadBytes(HopPassOrder, "s", 0, 1, 4, wire.DTypeBF16, 0, []byte{0, 0, 0, 1}),
		"pass zero":           hopHeadBytes(HopPassOrder, "s", 0, 1, 4, wire.DTypeBF16, 0, make([]byte, 8)),
		"pass after itself":   hopHeadBytes(HopPassOrder, "s", 0, 1, 4, wire.DTypeBF16, 0, []byte{0, 0, 0, 3, 0, 0, 0, 3}),
	}
	for name, p := range cases {
		if _, err := ParseHopHead(p, 6); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := ParseHopHead(hopHeadBytes(0, "s", 0, 1, 4, wire.DTypeBF16, 0, nil), 6); err != nil {
		t.Fatalf("the well-formed control case was refused: %v", err)
	}
	if h, err := ParseHopHead(hopHeadBytes(HopPassOrder, "s", 0, 1, 4, wire.DTypeBF16, 0, []byte{0, 0, 0, 3, 0, 0, 0, 1}), 6); err != nil || h.Pass != (wire.PassOrder{Seq: 3, After: 1}) {
		t.Fatalf("the well-formed ordered pass: %+v, %v", h, err)
	}
	// A head length over the limit is refused before anything is read
	// into it, whatever the frame length claims.
	var f []byte
	f = binary.BigEndian.AppendUint32(f, wire.MaxHopHead+1)
	if _, _, err := ReadHopHead(bytes.NewReader(f), 1<<30, nil, 6); err == nil || !strings.Contains(err.Error(), "limit") {
		t.Fatalf("oversize head: %v", err)
	}
}

func TestHostileBindingsAreRefused(t *testing.T) {
	good, err := AppendBinding(nil, sampleBinding())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ParseBinding(good, 6); err != nil {
		t.Fatalf("control: %v", err)
	}
	mk := func(b *wire.Binding) []byte {
		p, err := AppendBinding(nil, b)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	off := sampleBinding()
	off.Route[0].StartLayer = 5 // not end+1
	beyond := sampleBinding()
	beyond.Route[0].EndLayer = 9
	badSamp := sampleBinding()
	badSamp.Sampling.TopP = 3
	relayURL := sampleBinding()
	relayURL.Route[0].Endpoint = "file:///etc/passwd"
	cases := map[string][]byte{
		"route not contiguous":  mk(off),
		"route beyond model":    mk(beyond),
		"sampling out of range": mk(badSamp),
		"endpoint not http":     mk(relayURL),
		"truncated":             good[:len(good)-1],
		"trailing":              append(append([]byte(nil), good...), 0),
		"version":               append([]byte{9}, good[1:]...),
		"oversize":              make([]byte, wire.MaxBindingBytes+1),
	}
	for name, p := range cases {
		if _, err := ParseBinding(p, 6); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

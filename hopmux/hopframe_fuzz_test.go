package hopmux

import (
	"bytes"
	"reflect"
	"testing"
	"time"

	"meshgpu/wire"
)

// FuzzHopFrame feeds arbitrary bytes to the receiver's Hop frame parser
// (ReadFrameHeader, ReadHopRoute, ReadHopHead, as connections use them):
// it must never panic, never allocate past the limits, and whatever it
// accepts must re-encode to a frame that parses to the same head.
func FuzzHopFrame(f *testing.F) {
	payload := bytes.Repeat([]byte{1, 2}, 8)
	for _, b := range []*wire.Binding{nil, sampleBinding()} {
		h := &wire.HopHead{Session: "s", Position: 3, NTokens: 2, Hidden: 4, DType: wire.DTypeBF16, Step: 1,
			Deadline: time.UnixMilli(1_900_000_000_000), Tokens: []int32{5, 6}, Binding: b}
		head, err := AppendHopFrame(nil, 7, "mg-x", h, len(payload))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(append(head, payload...))
	}
	f.Add([]byte{0x0d, 0, 0, 0, 13, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{0x0d, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, frame []byte) {
		r := bytes.NewReader(frame)
		typ, n, err := ReadFrameHeader(r, 1<<20)
		if err != nil || typ != FrameHop {
			return
		}
		rt, rest, err := ReadHopRoute(r, n)
		if err != nil {
			return
		}
		h, pl, err := ReadHopHead(r, rest, nil, 6)
		if err != nil {
			return
		}
		if pl < 0 || pl > n {
			t.Fatalf("payload length %d of a %d-byte frame", pl, n)
		}
		again, err := AppendHopFrame(nil, rt.Stream, rt.Peer, h, 0)
		if err != nil {
			t.Fatalf("an accepted head does not re-encode: %v (%+v)", err, h)
		}
		r2 := bytes.NewReader(again)
		_, n2, _ := ReadFrameHeader(r2, 1<<20)
		rt2, rest2, err := ReadHopRoute(r2, n2)
		if err != nil || rt2 != rt {
			t.Fatalf("route %+v -> %+v (%v)", rt, rt2, err)
		}
		h2, _, err := ReadHopHead(r2, rest2, nil, 6)
		if err != nil {
			t.Fatalf("the re-encoded head is refused: %v", err)
		}
		if !reflect.DeepEqual(h.Binding, h2.Binding) || h.Session != h2.Session || h.Position != h2.Position ||
			h.NTokens != h2.NTokens || h.Hidden != h2.Hidden || h.DType != h2.DType || h.Step != h2.Step || !reflect.DeepEqual(h.Tokens, h2.Tokens) {
			t.Fatalf("round trip changed the head:\n%+v\n%+v", h, h2)
		}
	})
}

// FuzzBinding: the per-session binding parser refuses or accepts any
// bytes without panicking, and what it accepts re-encodes to itself.
func FuzzBinding(f *testing.F) {
	good, _ := AppendBinding(nil, sampleBinding())
	f.Add(good)
	empty, _ := AppendBinding(nil, &wire.Binding{StartLayer: 0, EndLayer: 5})
	f.Add(empty)
	f.Add([]byte{1, 0, 0, 0, 5, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, p []byte) {
		b, err := ParseBinding(p, 6)
		if err != nil {
			return
		}
		again, err := AppendBinding(nil, b)
		if err != nil {
			t.Fatalf("an accepted binding does not re-encode: %v (%+v)", err, b)
		}
		b2, err := ParseBinding(again, 6)
		if err != nil || !reflect.DeepEqual(b, b2) {
			t.Fatalf("round trip: %+v -> %+v (%v)", b, b2, err)
		}
	})
}

// FuzzHopReply: the reply parser, as a hop's sender reads it.
func FuzzHopReply(f *testing.F) {
	for _, a := range []*wire.HopReply{
		{Status: 200, Kind: wire.ReplyActivations, EndLayer: 1, NTokens: 1, Hidden: 2, DType: wire.DTypeBF16, Payload: []byte{1, 2, 3, 4}},
		{Status: 200, Kind: wire.ReplyToken, Token: 3, Logprob: -1},
		{Status: 400, Kind: wire.ReplyError, Body: []byte(`{"error":{}}`)},
	} {
		head, _ := AppendHopReplyFrame(nil, 1, a)
		f.Add(append(head, a.Payload...))
	}
	f.Fuzz(func(t *testing.T, frame []byte) {
		r := bytes.NewReader(frame)
		typ, n, err := ReadFrameHeader(r, 1<<20)
		if err != nil || typ != FrameHopReply {
			return
		}
		ReadHopReply(r, n, nil)
	})
}

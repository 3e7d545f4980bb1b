package hopmux

import (
	"bytes"
	"encoding/binary"
	"reflect"
	"testing"
	"time"

	"meshgpu/wire"
)

// A verify hop and its tokens reply survive the frame codec.
func TestVerifyHopRoundTrip(t *testing.T) {
	h := &wire.HopHead{Session: "s-1", Position: 40, NTokens: 3, Hidden: 2, DType: wire.DTypeF32, Step: 9,
		Deadline: time.UnixMilli(1_900_000_000_000), Tokens: []int32{5, 6, 7}, Verify: true}
	payload := make([]byte, 3*2*4)
	head, err := AppendHopFrame(nil, 1, "", h, len(payload))
	if err != nil {
		t.Fatal(err)
	}
	_, got, _, err := readHop(t, append(head, payload...), 6)
	if err != nil || !reflect.DeepEqual(got, h) {
		t.Fatalf("verify head round trip: %+v, %v; want %+v", got, err, h)
	}
	a := &wire.HopReply{Status: 200, Kind: wire.ReplyTokens, Tokens: []wire.TokenReply{{Token: 6, Logprob: -0.1}, {Token: 4095, Logprob: -2}}}
	rb, err := AppendHopReplyFrame(nil, 3, a)
	if err != nil {
		t.Fatal(err)
	}
	r := bytes.NewReader(rb)
	_, n, err := ReadFrameHeader(r, 1<<10)
	if err != nil {
		t.Fatal(err)
	}
	if _, rep, err := ReadHopReply(r, n, nil); err != nil || !reflect.DeepEqual(rep, a) {
		t.Fatalf("tokens reply round trip: %+v, %v; want %+v", rep, err, a)
	}
	// The sender refuses what a receiver would.
	for _, bad := range []*wire.HopHead{
		{Session: "s", NTokens: 2, Hidden: 2, DType: wire.DTypeF32, Tokens: []int32{1}, Verify: true},
		{Session: "s", NTokens: wire.MaxVerifyRows + 1, Hidden: 2, DType: wire.DTypeF32, Tokens: make([]int32, wire.MaxVerifyRows+1), Verify: true},
	} {
		if _, err := AppendHopFrame(nil, 1, "", bad, 0); err == nil {
			t.Errorf("a verify head of %d rows with %d tokens was encoded", bad.NTokens, len(bad.Tokens))
		}
	}
	if _, err := AppendHopReplyFrame(nil, 1, &wire.HopReply{Status: 200, Kind: wire.ReplyTokens}); err == nil {
		t.Error("an empty tokens reply was encoded")
	}
}

// A hostile peer's verify heads and tokens replies are refused before
// anything is sized by them: a verify flag without one token per row, more
// rows than MaxVerifyRows (each costs the last node a vocabulary of
// logits), and replies whose count disagrees with their length.
func TestHostileVerifyFramesAreRefused(t *testing.T) {
	tokens := func(n int) []byte { return make([]byte, 4*n) }
	for name, head := range map[string][]byte{
		"no tokens":       hopHeadBytes(HopVerify, "s", 0, 3, 2, wire.DTypeF32, 0, nil),
		"too many rows":   hopHeadBytes(HopVerify, "s", 0, wire.MaxVerifyRows+1, 2, wire.DTypeF32, wire.MaxVerifyRows+1, tokens(wire.MaxVerifyRows+1)),
		"tokens not rows": hopHeadBytes(HopVerify, "s", 0, 3, 2, wire.DTypeF32, 2, tokens(2)),
	} {
		if _, err := ParseHopHead(head, 6); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if h, err := ParseHopHead(hopHeadBytes(HopVerify, "s", 0, 2, 2, wire.DTypeF32, 2, tokens(2)), 6); err != nil || !h.Verify {
		t.Errorf("a well-formed verify head: %+v, %v", h, err)
	}
	for name, body := range map[string][]byte{
		"empty":       {},
		"zero tokens": {0, 0},
		"short":       append([]byte{0, 2}, make([]byte, 8)...),
		"long":        append([]byte{0, 1}, make([]byte, 16)...),
		"too many":    append(binary.BigEndian.AppendUint16(nil, wire.MaxVerifyRows+1), make([]byte, 8*(wire.MaxVerifyRows+1))...),
	} {
		frame := AppendHeader(nil, FrameHopReply, 11+len(body))
		frame = binary.BigEndian.AppendUint64(frame, 1)
		frame = binary.BigEndian.AppendUint16(frame, 200)
		frame = append(frame, wire.ReplyTokens)
		frame = append(frame, body...)
		r := bytes.NewReader(frame)
		_, n, err := ReadFrameHeader(r, 1<<20)
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := ReadHopReply(r, n, nil); err == nil {
			t.Errorf("tokens reply %s: accepted", name)
		}
	}
}

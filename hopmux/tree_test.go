package hopmux

import (
	"bytes"
	"reflect"
	"strings"
	"testing"

	"meshgpu/wire"
)

// A verify hop with a tree and a keep round-trips; a hop without them is
// byte for byte today's frame (no tree and no keep flag).
func TestHopTreeRoundTrip(t *testing.T) {
	payload := bytes.Repeat([]byte{0x80, 0x3f}, 4*3)
	h := &wire.HopHead{Session: "s-1", Position: 9, NTokens: 4, Hidden: 3, DType: wire.DTypeBF16, Step: 2,
		Tokens: []int32{5, 6, 7, 8}, Verify: true, Parents: []int32{-1, 0, 1, 0}, Keep: []int32{11, 12}, Binding: sampleBinding()}
	frame, err := AppendHopFrame(nil, 3, "", h, len(payload))
	if err != nil {
		t.Fatal(err)
	}
	_, got, _, err := readHop(t, append(frame, payload...), 6)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, h) {
		t.Fatalf("round trip:\n got %+v\nwant %+v", got, h)
	}
	plain := *h
	plain.Parents, plain.Keep = nil, nil
	a, _ := AppendHopFrame(nil, 3, "", &plain, len(payload))
	if len(a) != len(frame)-4-3 {
		t.Errorf("a hop without tree and keep is %d bytes, with them %d: want 7 fewer", len(a), len(frame))
	}
	_, got, _, err = readHop(t, append(a, payload...), 6)
	if err != nil || got.Parents != nil || got.Keep != nil {
		t.Errorf("a chain hop decodes with tree %v keep %v (%v)", got.Parents, got.Keep, err)
	}
}

// Trees and keeps a peer could send to confuse a node's cache are refused
// on the wire: parents after their rows, a second root, slots moved
// backwards or out of order.
func TestHopTreeRefusesBadShapes(t *testing.T) {
	for _, c := range []struct {
		parents []int32
		want    string
	}{
		{[]int32{0, 0, 1}, "root"},
		{[]int32{-1, 1, 0}, "parent 1"},
		{[]int32{-1, 0, -1}, "parent -1"},
		{[]int32{-1, 0}, "2 parents for 3"},
	} {
		if err := wire.CheckTree(c.parents, 3); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("CheckTree(%v): %v, want %q", c.parents, err, c.want)
		}
	}
	for _, keep := range [][]int32{{9, 8}, {7}, {8, 8}, {8, 200}, make([]int32, 11)} {
		if err := wire.CheckKeep(keep, 10); err == nil {
			t.Errorf("CheckKeep(%v, 10) accepted", keep)
		}
	}
	if err := wire.CheckKeep([]int32{9, 12}, 10); err != nil {
		t.Errorf("a valid keep refused: %v", err)
	}

	// On the wire: a tree on a non-verify hop, and a bad parent byte.
	h := &wire.HopHead{Session: "s", Position: 3, NTokens: 2, Hidden: 1, DType: wire.DTypeF32, Tokens: []int32{1, 2}, Verify: true, Parents: []int32{-1, 0}}
	frame, err := AppendHopFrame(nil, 1, "", h, 8)
	if err != nil {
		t.Fatal(err)
	}
	frame = append(frame, make([]byte, 8)...)
	treeAt := bytes.Index(frame, []byte{0, 0, 0, 2, 0, 1}) + 4 // tokens end "... 0 0 0 2", then the tree "0 1"
	bad := bytes.Clone(frame)
	bad[treeAt+1] = 3 // row 1's parent is row 2
	if _, _, _, err := readHop(t, bad, 6); err == nil {
		t.Error("a tree whose row 1 has parent 2 was accepted")
	}
	h.Verify = false
	if _, err := AppendHopFrame(nil, 1, "", h, 8); err == nil {
		t.Error("a tree on a non-verify hop was encoded")
	}
}

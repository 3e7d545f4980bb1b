package node

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"meshgpu/hopmux"
	"meshgpu/internal/testenv"
	"meshgpu/wire"
)

// frameClient speaks hop frames to a node the way hopmux/doc.go describes
// them, with nothing from this package: an HTTP upgrade, then frames.
type frameClient struct {
	t  *testing.T
	c  net.Conn
	br *bufio.Reader
}

func dialFrames(t *testing.T, base string) *frameClient {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(c, "GET /hop HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: meshgpu-hop/2\r\n\r\n")
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 101 || resp.Header.Get("Upgrade") != "meshgpu-hop/2" {
		t.Fatalf("upgrade: %s %v", resp.Status, resp.Header)
	}
	return &frameClient{t: t, c: c, br: br}
}

// hop writes a Hop frame by hand: every field as doc.go lays it out.
func (f *frameClient) hop(stream uint64, session string, pos, rows int, binding []byte, payload []byte) {
	var head []byte
	flags := byte(0)
	if binding != nil {
		flags = 1
	}
	head = append(head, flags, byte(len(session)))
	head = append(head, session...)
	head = binary.BigEndian.AppendUint32(head, uint32(pos))
	head = binary.BigEndian.AppendUint32(head, uint32(rows))
	head = binary.BigEndian.AppendUint32(head, fkHidden)
	head = append(head, 2) // f32
	head = binary.BigEndian.AppendUint32(head, 0)
	head = binary.BigEndian.AppendUint64(head, uint64(time.Now().Add(5*time.Second).UnixMilli()))
	head = binary.BigEndian.AppendUint16(head, 0)
	if binding != nil {
		head = binary.BigEndian.AppendUint16(head, uint16(len(binding)))
		head = append(head, binding...)
	}
	var p []byte
	p = binary.BigEndian.AppendUint64(p, stream)
	p = append(p, 0) // no peer id on a direct connection
	p = binary.BigEndian.AppendUint32(p, uint32(len(head)))
	p = append(p, head...)
	p = append(p, payload...)
	f.raw(0x0d, p)
}

func (f *frameClient) raw(typ byte, payload []byte) {
	frame := binary.BigEndian.AppendUint32([]byte{typ}, uint32(len(payload)))
	if _, err := f.c.Write(append(frame, payload...)); err != nil {
		f.t.Fatal(err)
	}
}

// docBinding encodes a binding as doc.go lays it out.
func docBinding(start, end int, route string, sampling string) []byte {
	b := []byte{1}
	b = binary.BigEndian.AppendUint16(b, uint16(start))
	b = binary.BigEndian.AppendUint16(b, uint16(end))
	for _, s := range []string{route, sampling, ""} {
		b = binary.BigEndian.AppendUint16(b, uint16(len(s)))
		b = append(b, s...)
	}
	return b
}

type frameReply struct {
	stream uint64
	status int
	kind   byte
	body   []byte
}

func (f *frameClient) reply() frameReply {
	f.t.Helper()
	var h [5]byte
	if _, err := io.ReadFull(f.br, h[:]); err != nil {
		f.t.Fatalf("reading a reply: %v", err)
	}
	p := make([]byte, binary.BigEndian.Uint32(h[1:]))
	if _, err := io.ReadFull(f.br, p); err != nil {
		f.t.Fatal(err)
	}
	if h[0] != 0x0e {
		f.t.Fatalf("frame type 0x%02x, want HopReply", h[0])
	}
	return frameReply{stream: binary.BigEndian.Uint64(p), status: int(binary.BigEndian.Uint16(p[8:])), kind: p[10], body: p[11:]}
}

func f32Row(v float32) []byte {
	b := make([]byte, 0, fkHidden*4)
	for i := 0; i < fkHidden; i++ {
		b = binary.LittleEndian.AppendUint32(b, math.Float32bits(v))
	}
	return b
}

// A client written from hopmux/doc.go alone: the first hop without a binding
// is refused with 428, the bound one runs, and the next per-token hop runs
// under the stored binding; token and error replies are as documented.
func TestHopFramesFromTheDocs(t *testing.T) {
	testenv.CheckGoroutines(t)
	tail := &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab), PeerID: "tail"}
	f := dialFrames(t, startNode(t, tail))

	f.hop(1, "doc", 0, 1, nil, f32Row(7))
	if r := f.reply(); r.stream != 1 || r.status != 428 || r.kind != 3 || !strings.Contains(string(r.body), "binding_required") {
		t.Fatalf("unbound first hop: %+v %s", r, r.body)
	}
	f.hop(2, "doc", 0, 1, docBinding(3, 5, "", `{"temperature":0}`), f32Row(7))
	r := f.reply()
	if r.stream != 2 || r.status != 200 || r.kind != 2 || len(r.body) != 8 {
		t.Fatalf("bound hop: %+v %s", r, r.body)
	}
	// The fake stack adds 1 per layer: 7 + layers 3..5 = 10.
	if tok := int32(binary.BigEndian.Uint32(r.body)); tok != 10 {
		t.Fatalf("token %d, want 10", tok)
	}
	f.hop(3, "doc", 1, 1, nil, f32Row(10))
	if r := f.reply(); r.status != 200 || int32(binary.BigEndian.Uint32(r.body)) != 13 {
		t.Fatalf("per-token hop under the stored binding: %+v %s", r, r.body)
	}
	if n := tail.metrics.bindingsN.Load(); n != 1 {
		t.Fatalf("%d bindings counted, want 1", n)
	}
	// Unknown frame types are skipped; the connection still serves.
	f.raw(0x7f, []byte("future frame"))
	// A bad value in a well-formed hop is an error reply, and the
	// connection stays: a layer outside the node, a short payload.
	f.hop(4, "doc2", 0, 1, docBinding(1, 5, "", `{}`), f32Row(1))
	if r := f.reply(); r.status != 400 || !strings.Contains(string(r.body), "invalid_binding") {
		t.Fatalf("binding outside the shard: %+v %s", r, r.body)
	}
	f.hop(5, "doc", 2, 1, nil, f32Row(1)[:8])
	if r := f.reply(); r.status != 400 {
		t.Fatalf("short payload: %+v %s", r, r.body)
	}
	f.hop(6, "doc", 2, 1, nil, f32Row(13))
	if r := f.reply(); r.status != 200 || int32(binary.BigEndian.Uint32(r.body)) != 16 {
		t.Fatalf("after the refusals: %+v %s", r, r.body)
	}
}

// A peer that sends a malformed or oversized frame loses its connection
// (the node can no longer trust its framing), and the node keeps serving
// others.
func TestMalformedHopFrameClosesOnlyThatConnection(t *testing.T) {
	testenv.CheckGoroutines(t)
	tail := &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab), PeerID: "tail"}
	u := startNode(t, tail)
	for name, frame := range map[string][]byte{
		"head longer than the frame": append(binary.BigEndian.AppendUint32([]byte{0x0d}, 13), append(make([]byte, 9), 0xff, 0xff, 0xff, 0xff)...),
		"oversize frame":             binary.BigEndian.AppendUint32([]byte{0x0d}, hopmux.DefaultMaxFrame+1),
		"bad session in the head":    append(binary.BigEndian.AppendUint32([]byte{0x0d}, 9+4+3), append(make([]byte, 9), 0, 0, 0, 3, 0, 1, '!')...),
	} {
		f := dialFrames(t, u)
		if _, err := f.c.Write(frame); err != nil {
			t.Fatal(err)
		}
		f.c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if n, err := f.br.Read(make([]byte, 1)); err == nil || n > 0 {
			t.Fatalf("%s: the connection stayed open (read %d, %v)", name, n, err)
		}
	}
	good := dialFrames(t, u)
	good.hop(1, "ok", 0, 1, docBinding(3, 5, "", `{}`), f32Row(0))
	if r := good.reply(); r.status != 200 {
		t.Fatalf("a healthy connection after the bad ones: %+v %s", r, r.body)
	}
}

// A chain mixing protocol versions (a frame-speaking head, an old middle
// node that knows only POST /forward, a frame-speaking tail) generates the
// same tokens as an all-frames chain and an all-POST chain, and the head
// binds each session once, not per token.
func TestMixedProtocolChainsAgree(t *testing.T) {
	testenv.CheckGoroutines(t)
	run := func(oldMid, oldHead bool) ([]int32, *Server, *Server) {
		mid := &Server{StackForTesting: newFakeStack(2, 4, fkLayers, fkHidden, fkVocab), PeerID: "mid", DisableHopFrames: oldMid}
		tail := &Server{StackForTesting: newFakeStack(4, 5, fkLayers, fkHidden, fkVocab), PeerID: "tail"}
		route := []wire.Hop{{Endpoint: startNode(t, mid), StartLayer: 3, EndLayer: 4}, {Endpoint: startNode(t, tail), StartLayer: 5, EndLayer: 5}}
		head := &Server{StackForTesting: newFakeStack(0, 2, fkLayers, fkHidden, fkVocab), PeerID: "head", Logger: quietLogger(), DisableHopFrames: oldHead}
		t.Cleanup(func() { head.Close() })
		ids, ae := sixSteps(headPipeline(t, head, "mixed", route))
		if ae != nil {
			t.Fatalf("old mid %v, old head %v: %v", oldMid, oldHead, ae)
		}
		return ids, mid, tail
	}
	all, mid, tail := run(false, false)
	if n := mid.metrics.bindingsN.Load(); n != 1 {
		t.Errorf("all frames: the middle node got %d bindings for one session of 6 steps, want 1", n)
	}
	if n := tail.metrics.bindingsN.Load(); n != 1 {
		t.Errorf("all frames: the tail got %d bindings, want 1", n)
	}
	want := sixStepsWant()
	if fmt.Sprint(all) != fmt.Sprint(want) {
		t.Fatalf("all frames: %v, want %v", all, want)
	}
	for _, c := range []struct{ oldMid, oldHead bool }{{true, false}, {false, true}, {true, true}} {
		got, _, _ := run(c.oldMid, c.oldHead)
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("old mid %v, old head %v: %v, want %v", c.oldMid, c.oldHead, got, want)
		}
	}
}

// POST /forward written from docs/protocol.md alone (net/http and
// encoding/json, no code of this package): a two-hop chain answers the
// documented token JSON, and a route-less hop the documented activations.
func TestPostForwardFromTheDocs(t *testing.T) {
	testenv.CheckGoroutines(t)
	mid := &Server{StackForTesting: newFakeStack(2, 4, fkLayers, fkHidden, fkVocab), PeerID: "mid"}
	tail := &Server{StackForTesting: newFakeStack(4, 5, fkLayers, fkHidden, fkVocab), PeerID: "tail"}
	midURL, tailURL := startNode(t, mid), startNode(t, tail)
	hc := &http.Client{Timeout: 10 * time.Second}
	t.Cleanup(hc.CloseIdleConnections)
	post := func(url string, h map[string]string, body []byte) (*http.Response, []byte) {
		req, _ := http.NewRequest("POST", url+"/forward", bytes.NewReader(body))
		for k, v := range h {
			req.Header.Set(k, v)
		}
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, b
	}
	route, _ := json.Marshal([]map[string]any{{"endpoint": tailURL, "start_layer": 5, "end_layer": 5}})
	resp, b := post(midURL, map[string]string{
		"X-Meshnet-Session": "docs", "X-Meshnet-Shape": fmt.Sprintf("1,%d", fkHidden), "X-Meshnet-Dtype": "f32",
		"X-Meshnet-Start-Layer": "3", "X-Meshnet-End-Layer": "4", "X-Meshnet-Position": "0",
		"X-Meshnet-Route": string(route), "X-Meshnet-Sampling": `{"temperature":0,"step":0}`,
	}, f32Row(20))
	var tok struct {
		Token   *int32   `json:"token"`
		Logprob *float32 `json:"logprob"`
	}
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "application/json") || json.Unmarshal(b, &tok) != nil || tok.Token == nil || tok.Logprob == nil {
		t.Fatalf("chain: %d %s", resp.StatusCode, b)
	}
	if *tok.Token != 23 { // 20 + layers 3, 4 and 5
		t.Fatalf("token %d, want 23", *tok.Token)
	}
	resp, b = post(midURL, map[string]string{
		"X-Meshnet-Session": "docs2", "X-Meshnet-Shape": fmt.Sprintf("1,%d", fkHidden), "X-Meshnet-Dtype": "f32",
		"X-Meshnet-Start-Layer": "3", "X-Meshnet-End-Layer": "4", "X-Meshnet-Position": "0",
	}, f32Row(1))
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/octet-stream" ||
		resp.Header.Get("X-Meshnet-Shape") != fmt.Sprintf("1,%d", fkHidden) || resp.Header.Get("X-Meshnet-End-Layer") != "4" ||
		!bytes.Equal(b, f32Row(3)) {
		t.Fatalf("activations: %d %v %x", resp.StatusCode, resp.Header, b)
	}
	resp, b = post(midURL, map[string]string{"X-Meshnet-Session": "bad id!"}, nil)
	var eb struct {
		Error struct{ Message, Type, Hop string }
	}
	if resp.StatusCode != 400 || json.Unmarshal(b, &eb) != nil || eb.Error.Type != "invalid_header" || eb.Error.Hop != "mid" {
		t.Fatalf("bad session: %d %s", resp.StatusCode, b)
	}
}

// sixSteps runs a prefill of tokens 3, 4, 5 and five decode steps.
func sixSteps(p *pipeline) ([]int32, *apiError) {
	var out []int32
	id, _, ae := p.step(context.Background(), 0, []int32{3, 4, 5}, 0)
	for step := 1; ae == nil && step < 6; step++ {
		out = append(out, id)
		id, _, ae = p.step(context.Background(), 2+step, []int32{id}, step)
	}
	return append(out, id), ae
}

// sixStepsWant is what sixSteps gives through every layer once.
func sixStepsWant() []int32 {
	want := []int32{wantToken(5)}
	for len(want) < 6 {
		want = append(want, wantToken(want[len(want)-1]))
	}
	return want
}

// A hop that arrives past its deadline (a sender whose clock is behind)
// gets its 504 over the hop connection, naming this node, not silence
// until the sender's own timeout.
func TestLateHopFrameIsAnswered(t *testing.T) {
	testenv.CheckGoroutines(t)
	st := newFakeStack(3, 4, fkLayers, fkHidden, fkVocab)
	u := startNode(t, &Server{StackForTesting: st, PeerID: "tail"})
	hc := &HopClient{Logger: quietLogger()}
	t.Cleanup(func() { hc.Close() })
	payload := bytes.Repeat([]byte{0x80, 0x3f}, fkHidden)
	h := &wire.HopHead{Session: "late", Position: 0, NTokens: 1, Hidden: fkHidden, DType: wire.DTypeBF16,
		Deadline: time.Now().Add(-time.Second), Binding: &wire.Binding{StartLayer: 3, EndLayer: 4}}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	rep, err := hc.Do(ctx, u, h, payload, nil)
	if err != nil {
		t.Fatalf("a late hop got no answer: %v", err)
	}
	defer rep.ReleaseBuffer()
	if rep.Status != http.StatusGatewayTimeout || !strings.Contains(string(rep.Body), "hop_timeout") {
		t.Fatalf("a late hop: %d %s, want 504 hop_timeout", rep.Status, rep.Body)
	}
}

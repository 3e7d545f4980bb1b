package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"meshgpu/daemon"
	"meshgpu/hopmux"
	"meshgpu/internal/testenv"
	"meshgpu/openai"
	"meshgpu/tracker"
	"meshgpu/wire"
)

// blameMesh is gocoder-6m behind an in-process tracker: a head (0-2) and
// tails (3-5), all registered through the identity challenge, with audits
// off (what is tested is the failure path, not the audits).
type blameMesh struct {
	tr      *tracker.Server
	url     string
	hc      *http.Client
	head    *daemon.Node
	tails   []*daemon.Node
	started []*daemon.Node
}

func startBlameMesh(t *testing.T, tails int, tailCfg func(i int, c *daemon.Config)) *blameMesh {
	dir := testenv.GoCoder(t)
	be := openCPU(t)
	tr := tracker.NewServer(tracker.Config{Logger: quietLogger(), HeartbeatTimeout: time.Minute, Endpoints: tracker.AddrPolicy{AllowLoopback: true}})
	ts := httptest.NewServer(tr.Handler())
	t.Cleanup(ts.Close)
	m := &blameMesh{tr: tr, url: ts.URL, hc: newHTTPClient(t)}
	start := func(first, last int, tweak func(*daemon.Config)) *daemon.Node {
		c := daemon.Config{ModelDir: dir, Backend: be, Identity: newIdentity(t), First: first, Last: last, HopDType: "f32",
			MaxSessions: 8, MaxContext: 512, TrackerURL: ts.URL, HeartbeatInterval: time.Second, NoHopTLS: true, Logger: quietLogger()}
		if tweak != nil {
			tweak(&c)
		}
		n, err := daemon.Start(context.Background(), c)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { n.Close() })
		return n
	}
	m.head = start(0, 2, nil)
	for i := 0; i < tails; i++ {
		m.tails = append(m.tails, start(3, 5, func(c *daemon.Config) {
			if tailCfg != nil {
				tailCfg(i, c)
			}
		}))
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		var nodes struct {
			Nodes []tracker.PublicNode `json:"nodes"`
		}
		getJSON(t, m.hc, ts.URL+"/nodes", &nodes)
		if len(nodes.Nodes) == 1+tails {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the tracker lists %d nodes, want %d", len(nodes.Nodes), 1+tails)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return m
}

// bans is the tracker's current bans by peer id.
func (m *blameMesh) bans(t *testing.T) map[string]time.Time {
	t.Helper()
	b, err := m.tr.Registry().Store().Bans(context.Background(), time.Now())
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// chat posts a chat completion through the tracker and returns the status
// and body.
func (m *blameMesh) chat(t *testing.T, body map[string]any) (int, []byte) {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := m.hc.Post(m.url+"/v1/chat/completions", "application/json", strings.NewReader(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, out
}

func contentOf(t *testing.T, b []byte) string {
	t.Helper()
	var c openai.Completion
	if err := json.Unmarshal(b, &c); err != nil || len(c.Choices) != 1 || c.Choices[0].Message == nil || c.Choices[0].Message.Content == nil {
		t.Fatalf("not a chat completion: %s", b)
	}
	return *c.Choices[0].Message.Content
}

// Issue 27: one client request banned every tail. A 520-value enum schema
// (about 5 KB, under the 32 KiB the request may carry) overflowed the head's
// 4 KiB sampling field in the hop binding; the head answered 502 naming the
// tail, and the tracker banned each tail in turn, so every client got 503
// no_route for the ban's length. Now the binding carries what a valid
// request holds: the request gets its answer, no node is banned, and
// ordinary chats go on; a schema over the limit gets a 400 from the
// tracker before any route is tried, and bans nobody either.
func TestSchemaRequestBansNoNode(t *testing.T) {
	testenv.CheckGoroutines(t)
	m := startBlameMesh(t, 2, nil)
	enum := make([]string, 520)
	for i := range enum {
		enum[i] = fmt.Sprintf("item%03d", i)
	}
	schema := map[string]any{"type": "object", "properties": map[string]any{"v": map[string]any{"enum": enum}}, "required": []string{"v"}}
	if b, _ := json.Marshal(schema); len(b) < 4<<10 || len(b) > wire.MaxFormatBytes {
		t.Fatalf("schema of %d bytes: want one over the old 4 KiB field and under the request limit", len(b))
	}
	msgs := []map[string]any{{"role": "user", "content": "Pick an item."}}
	format := map[string]any{"type": "json_schema", "json_schema": map[string]any{"name": "pick", "schema": schema}}
	for i := 0; i < 3; i++ { // the attack, repeated: each would have banned another tail
		st, b := m.chat(t, map[string]any{"model": "gocoder-6m", "messages": msgs, "max_tokens": 40, "temperature": 0, "response_format": format})
		if st != 200 {
			t.Fatalf("the schema request, try %d: %d %s, want 200", i, st, b)
		}
		var doc struct {
			V string `json:"v"`
		}
		if c := contentOf(t, b); json.Unmarshal([]byte(c), &doc) != nil || !slices.Contains(enum, doc.V) {
			t.Fatalf("the schema request's answer %q is not a document of the schema", c)
		}
	}
	if b := m.bans(t); len(b) != 0 {
		t.Fatalf("a client's request banned nodes: %v", b)
	}

	big := make([]string, 5000)
	for i := range big {
		big[i] = fmt.Sprintf("item%04d", i)
	}
	bigFormat := map[string]any{"type": "json_schema", "json_schema": map[string]any{"name": "pick",
		"schema": map[string]any{"type": "object", "properties": map[string]any{"v": map[string]any{"enum": big}}}}}
	st, b := m.chat(t, map[string]any{"model": "gocoder-6m", "messages": msgs, "max_tokens": 8, "response_format": bigFormat})
	if we, ok := wire.DecodeError(st, b); st != 400 || !ok || we.Param != "response_format.json_schema.schema" {
		t.Fatalf("a schema over the limit: %d %s, want 400 naming the schema", st, b)
	}
	if b := m.bans(t); len(b) != 0 {
		t.Fatalf("a schema over the limit banned nodes: %v", b)
	}
	for i := 0; i < 3; i++ {
		if st, b := m.chat(t, map[string]any{"model": "gocoder-6m", "messages": msgs, "max_tokens": 8, "temperature": 0}); st != 200 {
			t.Fatalf("ordinary chat %d after the attack: %d %s", i, st, b)
		}
	}
}

// hopFront is a TCP front for a real node: it forwards every connection
// as is, except that on a hop connection (GET /hop, then hop frames) it
// hands each token answer to rewrite, with the head of the hop it answers
// (its session and sampling step), before passing it on. It is a tail that
// passed everything (registration, challenge) and then lies.
type hopFront struct {
	ln      net.Listener
	backend string
	// rewrite changes a token answer in place and says whether it lied.
	rewrite func(h *wire.HopHead, rep *wire.HopReply) bool
	lies    atomic.Int32
	mu      sync.Mutex
	conns   map[net.Conn]bool
	heads   map[net.Conn]map[uint64]*wire.HopHead // per connection, the hop each stream answers
	wg      sync.WaitGroup
}

// startNaNFront is a hopFront that rewrites each token's logprob to NaN.
func startNaNFront(t *testing.T, backend string) *hopFront {
	return startHopFront(t, backend, func(_ *wire.HopHead, rep *wire.HopReply) bool {
		rep.Logprob = float32(math.NaN())
		return true
	})
}

func startHopFront(t *testing.T, backend string, rewrite func(*wire.HopHead, *wire.HopReply) bool) *hopFront {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &hopFront{ln: ln, backend: backend, rewrite: rewrite, conns: map[net.Conn]bool{}, heads: map[net.Conn]map[uint64]*wire.HopHead{}}
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			f.wg.Add(1)
			go func() { defer f.wg.Done(); f.handle(c) }()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		f.mu.Lock()
		for c := range f.conns {
			c.Close()
		}
		f.mu.Unlock()
		f.wg.Wait()
	})
	return f
}

func (f *hopFront) track(cs ...net.Conn) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, c := range cs {
		f.conns[c] = true
	}
}

// copyLines copies HTTP header lines from r to w up to the blank line.
func copyLines(w io.Writer, r *bufio.Reader) error {
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			return err
		}
		if _, err := io.WriteString(w, line); err != nil {
			return err
		}
		if line == "\r\n" {
			return nil
		}
	}
}

// forwardHops copies hop frames from the head (cr) to the node (b) as
// they are, noting the head of each Hop frame under its stream.
func (f *hopFront) forwardHops(c net.Conn, cr *bufio.Reader, b net.Conn) {
	defer b.Close()
	if copyLines(b, cr) != nil {
		return
	}
	for {
		typ, n, err := hopmux.ReadFrameHeader(cr, hopmux.DefaultMaxFrame)
		if err != nil {
			return
		}
		buf := make([]byte, n)
		if _, err := io.ReadFull(cr, buf); err != nil {
			return
		}
		if typ == hopmux.FrameHop {
			r := bytes.NewReader(buf)
			if rt, rest, err := hopmux.ReadHopRoute(r, n); err == nil {
				if h, _, err := hopmux.ReadHopHead(r, rest, nil, 64); err == nil {
					f.mu.Lock()
					f.heads[c][rt.Stream] = h
					f.mu.Unlock()
				}
			}
		}
		if _, err := b.Write(append(hopmux.AppendHeader(nil, typ, n), buf...)); err != nil {
			return
		}
	}
}

func (f *hopFront) handle(c net.Conn) {
	defer c.Close()
	b, err := net.Dial("tcp", f.backend)
	if err != nil {
		return
	}
	defer b.Close()
	f.track(c, b)
	cr := bufio.NewReader(c)
	first, _ := cr.Peek(len("GET " + wire.HopPath + " "))
	if string(first) != "GET "+wire.HopPath+" " {
		f.wg.Add(1)
		go func() { defer f.wg.Done(); io.Copy(b, cr); b.Close() }()
		io.Copy(c, b)
		return
	}
	f.mu.Lock()
	f.heads[c] = map[uint64]*wire.HopHead{}
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		delete(f.heads, c)
		f.mu.Unlock()
	}()
	f.wg.Add(1)
	go func() { defer f.wg.Done(); f.forwardHops(c, cr, b) }()
	br := bufio.NewReader(b)
	if copyLines(c, br) != nil { // the 101 answer, as is
		return
	}
	for {
		typ, n, err := hopmux.ReadFrameHeader(br, hopmux.DefaultMaxFrame)
		if err != nil {
			return
		}
		if typ != hopmux.FrameHopReply {
			if _, err := c.Write(hopmux.AppendHeader(nil, typ, n)); err != nil {
				return
			}
			if _, err := io.CopyN(c, br, int64(n)); err != nil {
				return
			}
			continue
		}
		id, rep, err := hopmux.ReadHopReply(br, n, func(uint64) hopmux.ReplyBuffer { return hopmux.HeapBuffer })
		if err != nil {
			return
		}
		if rep.Kind == wire.ReplyToken {
			f.mu.Lock()
			h := f.heads[c][id]
			f.mu.Unlock()
			if h != nil && f.rewrite(h, rep) {
				f.lies.Add(1)
			}
		}
		head, err := hopmux.AppendHopReplyFrame(nil, id, rep)
		if err != nil {
			return
		}
		if _, err := c.Write(append(head, rep.Payload...)); err != nil {
			return
		}
	}
}

// Issue 27: a tail framed the head. A tail that answers hops with a NaN
// logprob made the head fail its JSON encoding (500 json: unsupported
// value: NaN) and report itself as the failed hop, and the tracker banned
// the only head. Now the head refuses the answer with a 502 naming the
// tail: the tracker bans the liar, replays on the honest tail, the head
// stays in service, and every chat succeeds.
func TestNaNTailIsRoutedAround(t *testing.T) {
	testenv.CheckGoroutines(t)
	var front *hopFront
	m := startBlameMesh(t, 2, func(i int, c *daemon.Config) {
		if i != 1 {
			return
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		front = startNaNFront(t, ln.Addr().String())
		c.Listener, c.Advertise = ln, "http://"+front.ln.Addr().String()
	})
	liar, honest, head := m.tails[1].PeerID(), m.tails[0].PeerID(), m.head.PeerID()
	msgs := []map[string]any{{"role": "user", "content": "Write a Go function that adds two numbers."}}
	body := map[string]any{"model": "gocoder-6m", "messages": msgs, "max_tokens": 16, "temperature": 0}
	var want string
	for round := 0; round < 10 && (front.lies.Load() == 0 || round < 3); round++ {
		// Pairs at once: the tracker spreads concurrent chats over both
		// tails, so the liar gets one whichever a lone chat would take.
		var wg sync.WaitGroup
		var got [2]string
		var status [2]int
		for k := range got {
			wg.Add(1)
			go func() {
				defer wg.Done()
				st, b := m.chat(t, body)
				status[k], got[k] = st, string(b)
				if st == 200 {
					got[k] = contentOf(t, b)
				}
			}()
		}
		wg.Wait()
		for k := range got {
			if status[k] != 200 {
				t.Fatalf("round %d: chat %d: %d %s (the liar lied %d times)", round, k, status[k], got[k], front.lies.Load())
			}
			if want == "" {
				want = got[k]
			}
			if got[k] != want {
				t.Fatalf("round %d: chat %d answered %q, the others %q", round, k, got[k], want)
			}
		}
	}
	if front.lies.Load() == 0 {
		t.Fatal("the liar never got a hop: the test tested nothing")
	}
	bans := m.bans(t)
	if _, ok := bans[liar]; !ok {
		t.Errorf("the lying tail %s is not banned: %v", liar, bans)
	}
	for _, id := range []string{head, honest} {
		if _, ok := bans[id]; ok {
			t.Errorf("honest node %s was banned for the liar's answer: %v", id, bans)
		}
	}
}

package node

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/tls"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"meshgpu/engine"
	"meshgpu/identity"
	"meshgpu/internal/metricstest"
	"meshgpu/internal/testenv"
	"meshgpu/native"
	"meshgpu/openai"
	"meshgpu/sample"
	"meshgpu/ticket"
	"meshgpu/wire"
)

func newID(t testing.TB) *identity.Identity {
	t.Helper()
	id, err := identity.New()
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// attackerListener counts every connection made to it (and closes it): a
// defence holds when it stays at zero.
func attackerListener(t *testing.T) (url string, conns *atomic.Int32) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	conns = new(atomic.Int32)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns.Add(1)
			c.Close()
		}
	}()
	t.Cleanup(func() { ln.Close(); <-done })
	return "http://" + ln.Addr().String(), conns
}

// ticketedGocoder is gocoder-6m over three real servers, head 0-2 (f32
// hops, its route from --peer), mid 3-4 and tail 5, which take only the
// head's tickets (--trust-head).
type ticketedGocoder struct {
	full            *engine.Model
	head, mid, tail *Server
	headID          *identity.Identity
	url, midURL     string
	tailURL         string
	golden          []goldenGen
}

func startTicketedGocoder(t *testing.T) *ticketedGocoder {
	dir, be, load := gocoderLoader(t)
	g := &ticketedGocoder{full: load(0, -1), golden: loadGolden(t, dir), headID: newID(t)}
	node := func(first, last int) *Server {
		id := newID(t)
		return &Server{Model: load(first, last), Backend: be, PeerID: id.PeerID, Identity: id, TrustedHeads: []string{g.headID.PeerID}}
	}
	g.mid, g.tail = node(3, 4), node(5, 5)
	g.midURL, g.tailURL = startNode(t, g.mid), startNode(t, g.tail)
	g.head = &Server{Model: load(0, 2), Backend: be, PeerID: g.headID.PeerID, Identity: g.headID, Peers: []string{g.midURL, g.tailURL}, HopDType: "f32"}
	g.url = startNode(t, g.head)
	return g
}

func post(t *testing.T, url string, body string, header map[string]string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// signTicket signs a ticket for session over route with key.
func signTicket(t *testing.T, key ed25519.PrivateKey, head, session string, route []wire.Hop) []byte {
	t.Helper()
	return signTicketFor(t, key, head, session, route, 1, time.Minute)
}

// signTicketFor is signTicket for choices sessions, expiring after ttl
// (negative: expired already, by -ttl).
func signTicketFor(t *testing.T, key ed25519.PrivateKey, head, session string, route []wire.Hop, choices int, ttl time.Duration) []byte {
	t.Helper()
	now := time.Now()
	tk := ticket.Ticket{SessionID: session, Head: head, IssuedAt: now.Add(min(ttl, 0) - time.Minute), Expiry: now.Add(ttl), Choices: choices}
	for _, h := range route {
		tk.Hops = append(tk.Hops, ticket.Hop{PeerID: h.PeerID, Endpoint: h.Endpoint, RelayAddr: h.RelayAddr, First: h.StartLayer, Last: h.EndLayer})
	}
	raw, err := ticket.Sign(tk, key)
	if err != nil {
		t.Fatal(err)
	}
	return raw
}

func passString(t *testing.T, raw []byte, keys [][]byte) string {
	t.Helper()
	b, err := ticket.Pass{Ticket: raw, Keys: keys}.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return ticket.String(b)
}

// The SSRF, prompt exfiltration and output injection: a client's
// X-Meshnet-Route on the OpenAI API, a forged ticket, a route header on
// POST /forward, and a binding whose route is not its ticket's all name an
// attacker's listener, which receives no connection at all; the mesh
// still answers as one model does.
func TestRouteFromRequestReachesNoAttacker(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startTicketedGocoder(t)
	evil, conns := attackerListener(t)
	evilRoute := fmt.Sprintf(`[{"endpoint":%q,"start_layer":3,"end_layer":5,"peer_id":"x"}]`, evil+"/x?leak=1")
	body := `{"prompt":"SECRET","max_tokens":3}`

	if st, b := post(t, g.url+"/v1/completions", body, map[string]string{wire.HeaderRoute: evilRoute}); st != 400 || !strings.Contains(b, wire.HeaderTicket) {
		t.Errorf("client route: %d %s, want 400 naming %s", st, b, wire.HeaderTicket)
	}
	// A ticket from a key the head does not trust, naming the attacker.
	forger := newID(t)
	evilHops := []wire.Hop{{Endpoint: evil, StartLayer: 3, EndLayer: 5, PeerID: forger.PeerID}}
	forged := signTicket(t, forger.Private, g.head.PeerID, "s1", evilHops)
	if st, b := post(t, g.url+"/v1/completions", body, map[string]string{wire.HeaderTicket: ticket.String(forged)}); st != 403 {
		t.Errorf("forged ticket: %d %s, want 403", st, b)
	}
	// The head's own key, but signed for another head's session: refused
	// by the head (not its session) and by the nodes (a head signs only its own).
	other := signTicket(t, g.headID.Private, forger.PeerID, "s2", evilHops)
	if st, b := post(t, g.url+"/v1/completions", body, map[string]string{wire.HeaderTicket: ticket.String(other)}); st != 403 {
		t.Errorf("ticket for another head: %d %s, want 403", st, b)
	}

	// POST /forward to a ticketed node: a route header alone, a forged
	// ticket, and the trusted head's ticket with another route in the binding.
	hop := hopReq{session: "s3", n: 1, hidden: g.mid.cfg.Hidden, dtype: native.F32, start: 3, end: 4, route: []wire.Hop{{Endpoint: evil, StartLayer: 5, EndLayer: 5, PeerID: "x"}}}
	if st, _, b := hop.send(t, http.DefaultClient, g.midURL); st != 403 {
		t.Errorf("POST /forward with a route and no ticket: %d %s", st, b)
	}
	midHops := []wire.Hop{{Endpoint: g.midURL, StartLayer: 3, EndLayer: 4, PeerID: g.mid.PeerID}, {Endpoint: evil, StartLayer: 5, EndLayer: 5, PeerID: "x"}}
	hop.header = map[string]string{wire.HeaderTicket: passString(t, signTicket(t, forger.Private, forger.PeerID, "s3", midHops), [][]byte{make([]byte, 32), make([]byte, 32)})}
	if st, _, b := hop.send(t, http.DefaultClient, g.midURL); st != 403 {
		t.Errorf("POST /forward with a forged ticket: %d %s", st, b)
	}
	honest := []wire.Hop{{Endpoint: g.midURL, StartLayer: 3, EndLayer: 4, PeerID: g.mid.PeerID}, {Endpoint: g.tailURL, StartLayer: 5, EndLayer: 5, PeerID: g.tail.PeerID}}
	hop.header = map[string]string{wire.HeaderTicket: passString(t, signTicket(t, g.headID.Private, g.headID.PeerID, "s3", honest), [][]byte{make([]byte, 32), make([]byte, 32)})}
	if st, _, b := hop.send(t, http.DefaultClient, g.midURL); st != 403 || !strings.Contains(string(b), "route is not the one the ticket names") {
		t.Errorf("POST /forward whose route is not its ticket's: %d %s", st, b)
	}

	// The mesh works, under the head's tickets, as one model does.
	gen := g.golden[0]
	pj, _ := json.Marshal(gen.PromptIDs)
	st, b := post(t, g.url+"/v1/completions", `{"prompt":`+string(pj)+`,"max_tokens":16,"temperature":0}`, nil)
	ref, err := g.full.Generate(context.Background(), gen.PromptIDs, engine.GenerateParams{MaxTokens: 16, Sampling: sample.Params{}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	var c openai.Completion
	json.Unmarshal([]byte(b), &c)
	if st != 200 || len(c.Choices) != 1 || c.Choices[0].Text == nil || *c.Choices[0].Text != ref.Text {
		t.Fatalf("ticketed mesh: %d %s, want the text %q", st, b, ref.Text)
	}
	time.Sleep(50 * time.Millisecond)
	if n := conns.Load(); n != 0 {
		t.Fatalf("the attacker's listener got %d connections", n)
	}
}

// sseIDs reads a stream's token ids (meshgpu.token) until [DONE].
type sseIDs struct {
	sc  *bufio.Scanner
	ids []int32
	err string
}

func (s *sseIDs) next(t *testing.T) bool {
	for s.sc.Scan() {
		data, ok := strings.CutPrefix(s.sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			return false
		}
		var c struct {
			openai.Completion
			Error *apiError `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			t.Fatalf("SSE %q: %v", data, err)
		}
		if c.Error != nil {
			s.err = c.Error.Message
			return false
		}
		if c.Meshgpu != nil {
			s.ids = append(s.ids, c.Meshgpu.Token)
			return true
		}
	}
	return false
}

// Sessions are owned: while a victim's stream runs, another client and
// the tail (a node on the same route, holding the ticket and its own key)
// try to DELETE, rewind (a hop at position 0) and probe (a hop inside the
// context, over POST /forward and over a new hop connection) the session
// on the mid node and the head. Every try is refused and the victim's
// tokens are the single model's.
func TestOwnedSessionsResistOtherClientsAndNodes(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startTicketedGocoder(t)
	gen := g.golden[0]
	const maxTokens = 48
	ref, err := g.full.Generate(context.Background(), gen.PromptIDs, engine.GenerateParams{MaxTokens: maxTokens, IgnoreEOS: true, Sampling: sample.Params{}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	pj, _ := json.Marshal(gen.PromptIDs)
	req, _ := http.NewRequest(http.MethodPost, g.url+"/v1/completions",
		strings.NewReader(`{"prompt":`+string(pj)+`,"max_tokens":`+strconv.Itoa(maxTokens)+`,"temperature":0,"ignore_eos":true,"stream":true}`))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	stream := &sseIDs{sc: bufio.NewScanner(resp.Body)}
	if !stream.next(t) {
		t.Fatalf("no first token: %d %s", resp.StatusCode, stream.err)
	}

	// What the tail knows: the session id and, from its binding (the one
	// the mid stored for it), the ticket and its own key.
	var sid string
	var tailPass ticket.Pass
	g.mid.sessions.mu.Lock()
	for id, s := range g.mid.sessions.m {
		sid = id
		s.lock <- struct{}{}
		tailPass, err = ticket.ParsePass(bytes.Clone(s.binding.Ticket))
		<-s.lock
	}
	g.mid.sessions.mu.Unlock()
	if sid == "" || err != nil || len(tailPass.Keys) != 1 {
		t.Fatalf("session %q on the mid node, tail pass %+v: %v", sid, tailPass, err)
	}
	// The tail holds its session while it attacks: the victim's generation
	// waits at the tail's next hop (the mid and the head are free to answer).
	tailSess := g.tail.sessions.lookup(sid)
	if tailSess == nil {
		t.Fatal("no session on the tail")
	}
	tailSess.acquire(context.Background())
	released := false
	release := func() {
		if !released {
			released = true
			tailSess.release()
		}
	}
	defer release()
	tailKey := tailPass.Keys[0]

	// Short timeouts: an attack that got through may wait for the session
	// the tail holds, which must fail the test, not hang it.
	hc := &http.Client{Timeout: 3 * time.Second}
	del := func(base string, key []byte) int {
		req, _ := http.NewRequest(http.MethodDelete, base+"/sessions/"+sid, nil)
		if key != nil {
			req.Header.Set(wire.HeaderSessionKey, sessionKeyHeader(key))
		}
		resp, err := hc.Do(req)
		if err != nil {
			t.Errorf("DELETE on %s: %v", base, err) // a DELETE that got through waits for the held session
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for what, st := range map[string]int{
		"client DELETE on mid":          del(g.midURL, nil),
		"client DELETE on tail":         del(g.tailURL, nil),
		"client DELETE on head":         del(g.url, nil),
		"tail DELETE on mid, its key":   del(g.midURL, tailKey),
		"tail DELETE on head, its key":  del(g.url, tailKey),
		"client DELETE on mid, a guess": del(g.midURL, make([]byte, 32)),
	} {
		if st != http.StatusForbidden {
			t.Errorf("%s: %d, want 403", what, st)
		}
	}
	tailRoute := []wire.Hop{{Endpoint: g.tailURL, StartLayer: 5, EndLayer: 5, PeerID: g.tail.PeerID}}
	for _, pos := range []int{0, 1} { // rewind, probe
		for name, keys := range map[string][][]byte{"tail's pass": tailPass.Keys, "tail's key twice": {tailKey, tailKey}} {
			hop := hopReq{session: sid, n: 1, hidden: g.mid.cfg.Hidden, dtype: native.F32, start: 3, end: 4, pos: pos, route: tailRoute,
				header: map[string]string{wire.HeaderTicket: passString(t, tailPass.Ticket, keys)}}
			if st, _, b := hop.send(t, hc, g.midURL); st != http.StatusForbidden {
				t.Errorf("tail's hop at position %d to mid with %s: %d %s", pos, name, st, b)
			}
		}
		// An unbound hop frame over a connection of its own.
		hcl := &HopClient{Logger: quietLogger()}
		payload := make([]byte, g.mid.cfg.Hidden*4)
		fctx, fcancel := context.WithTimeout(context.Background(), 3*time.Second)
		rep, err := hcl.Do(fctx, g.midURL, &wire.HopHead{Session: sid, Position: pos, NTokens: 1, Hidden: g.mid.cfg.Hidden,
			DType: wire.DTypeF32, Deadline: time.Now().Add(5 * time.Second)}, payload, nil)
		fcancel()
		hcl.Close()
		if err != nil || rep.Status != http.StatusPreconditionRequired {
			t.Errorf("unbound hop frame at position %d on a new connection: %v %+v", pos, err, rep)
		}
		// The head's own session takes no hop at all.
		hop := hopReq{session: sid, n: 1, hidden: g.head.cfg.Hidden, dtype: native.F32, start: 0, end: 2, pos: pos}
		if st, _, b := hop.send(t, hc, g.url); st != http.StatusForbidden {
			t.Errorf("hop at position %d to the head's session: %d %s", pos, st, b)
		}
	}
	if !g.mid.HasSession(sid) || !g.tail.HasSession(sid) {
		t.Fatal("the session is gone after the attacks")
	}
	release()
	for stream.next(t) {
	}
	if stream.err != "" || !equalIDs(stream.ids, ref.IDs, len(ref.IDs)) || len(stream.ids) != len(ref.IDs) {
		t.Fatalf("victim's stream (error %q): %d ids, want the single model's %d (first %v, want %v)", stream.err, len(stream.ids), len(ref.IDs), stream.ids[:min(8, len(stream.ids))], ref.IDs[:8])
	}
}

// ticketedPipeline is a fake head's pipeline over route under a ticket the
// head signs, as planSession does for a --route.
func ticketedPipeline(t *testing.T, head *Server, route []wire.Hop) (*pipeline, *sessionGrant) {
	t.Helper()
	head.Route = route
	head.Handler()
	headEnd, r, grant, ae := head.planSession(context.Background(), http.Header{}, 1)
	if ae != nil {
		t.Fatal(ae)
	}
	if grant.ticket == nil {
		t.Fatal("the head signed no ticket")
	}
	sess, ae := head.sessions.get(grant.id, 0)
	if ae != nil {
		t.Fatal(ae)
	}
	sess.local.Store(true)
	t.Cleanup(func() {
		head.sessions.remove(grant.id)
		head.deleteSessions(context.Background(), r, grant.id, grant.keys)
	})
	return &pipeline{s: head, sess: sess, id: grant.id, headEnd: headEnd, route: r, ticket: grant.pass, params: sample.Params{}, dtype: native.BF16}, grant
}

func fakeHead(t *testing.T) (*Server, *identity.Identity) {
	id := newID(t)
	head := &Server{StackForTesting: newFakeStack(0, 2, fkLayers, fkHidden, fkVocab), PeerID: id.PeerID, Identity: id, Logger: quietLogger()}
	t.Cleanup(func() { head.Close() })
	return head, id
}

// Squatting: a node taking tickets creates no session for unticketed hops
// (POST /forward with a binding, or unbound frames at position 0), so a
// flood of them leaves every slot to the legitimate session.
func TestSquattingDoesNotDenySessions(t *testing.T) {
	testenv.CheckGoroutines(t)
	head, headID := fakeHead(t)
	tail := &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab), PeerID: "tail", MaxSessions: 2, TrustedHeads: []string{headID.PeerID}}
	url := startNode(t, tail)
	hc := &HopClient{Logger: quietLogger()}
	defer hc.Close()
	for i := 0; i < 20; i++ {
		sid := fmt.Sprintf("squat-%d", i)
		hop := hopReq{session: sid, n: 1, hidden: fkHidden, dtype: native.F32, start: 3, end: 5}
		if st, _, b := hop.send(t, http.DefaultClient, url); st != http.StatusForbidden {
			t.Fatalf("unticketed POST /forward: %d %s", st, b)
		}
		rep, err := hc.Do(context.Background(), url, &wire.HopHead{Session: sid + "f", NTokens: 1, Hidden: fkHidden, DType: wire.DTypeF32,
			Deadline: time.Now().Add(5 * time.Second)}, make([]byte, fkHidden*4), nil)
		if err != nil || rep.Status != http.StatusPreconditionRequired {
			t.Fatalf("unbound frame at position 0: %v %+v", err, rep)
		}
		rep, err = hc.Do(context.Background(), url, &wire.HopHead{Session: sid + "b", NTokens: 1, Hidden: fkHidden, DType: wire.DTypeF32,
			Deadline: time.Now().Add(5 * time.Second), Binding: &wire.Binding{StartLayer: 3, EndLayer: 5}}, make([]byte, fkHidden*4), nil)
		if err != nil || rep.Status != http.StatusForbidden {
			t.Fatalf("unticketed binding frame: %v %+v", err, rep)
		}
	}
	if n := tail.sessions.len(); n != 0 {
		t.Fatalf("%d sessions squatted", n)
	}
	p, _ := ticketedPipeline(t, head, []wire.Hop{{Endpoint: url, StartLayer: 3, EndLayer: 5, PeerID: "tail"}})
	ids, ae := sixSteps(p)
	if ae != nil || !equalIDs(ids, sixStepsWant(), 6) {
		t.Fatalf("legitimate session: %v %v, want %v", ids, ae, sixStepsWant())
	}
}

// A ticket is checked for the node it reaches: its session, this node at
// these layers, a trusted issuer (a tracker's key for any head, a trusted
// head's key for its own sessions), and a fresh one from a tracker not yet
// heard of is checked again after asking the tracker.
func TestTicketChecks(t *testing.T) {
	trackerID, headID, otherHead := newID(t), newID(t), newID(t)
	var keys []ed25519.PublicKey
	var refreshes atomic.Int32
	n := &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab), PeerID: "n", TrustedHeads: []string{headID.PeerID},
		TicketIssuers: func() []ed25519.PublicKey { return keys },
		RefreshIssuers: func(context.Context) {
			refreshes.Add(1)
			keys = []ed25519.PublicKey{trackerID.Public}
		}}
	n.Handler()
	defer n.Close()
	route := []wire.Hop{{Endpoint: "http://127.0.0.1:1", StartLayer: 3, EndLayer: 5, PeerID: "n"}}
	key := make([]byte, 32)
	check := func(raw []byte, session string, start, end int) error {
		pass, _ := ticket.Pass{Ticket: raw, Keys: [][]byte{key}}.Encode()
		r := &hopRequest{session: session, start: start, end: end, ticket: pass}
		if _, ae := n.authorizeBinding(r, hopOrigin{}); ae != nil {
			return fmt.Errorf("%d %s", ae.Status, ae.Message)
		}
		return nil
	}
	for _, tc := range []struct {
		name       string
		raw        []byte
		session    string
		start, end int
		ok         bool
	}{
		{"trusted head, its session", signTicket(t, headID.Private, headID.PeerID, "a", route), "a", 3, 5, true},
		{"a choice of the session", signTicketFor(t, headID.Private, headID.PeerID, "a", route, 3, time.Minute), "a:1", 3, 5, true},
		{"a choice past the ticket's", signTicketFor(t, headID.Private, headID.PeerID, "a", route, 3, time.Minute), "a:3", 3, 5, false},
		{"a choice of a one-session ticket", signTicket(t, headID.Private, headID.PeerID, "a", route), "a:0", 3, 5, false},
		{"another session", signTicket(t, headID.Private, headID.PeerID, "a", route), "b", 3, 5, false},
		{"a look-alike session", signTicket(t, headID.Private, headID.PeerID, "a", route), "a:x", 3, 5, false},
		{"other layers", signTicket(t, headID.Private, headID.PeerID, "a", route), "a", 4, 5, false},
		{"trusted head, another head's session", signTicket(t, headID.Private, otherHead.PeerID, "a", route), "a", 3, 5, false},
		{"untrusted head", signTicket(t, otherHead.Private, otherHead.PeerID, "a", route), "a", 3, 5, false},
		{"tracker, after asking it", signTicket(t, trackerID.Private, otherHead.PeerID, "a", route), "a", 3, 5, true},
	} {
		err := check(tc.raw, tc.session, tc.start, tc.end)
		if (err == nil) != tc.ok {
			t.Errorf("%s: %v, want ok %v", tc.name, err, tc.ok)
		}
	}
	if r := refreshes.Load(); r != 1 {
		t.Errorf("asked the tracker %d times in a second, want 1", r)
	}
	// A node trusting nobody takes hops from loopback only.
	open := &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab), PeerID: "o"}
	for remote, ok := range map[string]bool{"127.0.0.1:5000": true, "[::1]:5000": true, "10.0.0.2:5000": false, "": false} {
		_, ae := open.authorizeBinding(&hopRequest{session: "s", start: 3, end: 5}, hopOrigin{remote: remote})
		if (ae == nil) != ok {
			t.Errorf("open node, hop from %q: %v, want ok %v", remote, ae, ok)
		}
	}
}

func bf16Bits(v float32) []byte {
	b := make([]byte, 2)
	binary.LittleEndian.PutUint16(b, uint16(math.Float32bits(v)>>16))
	return b
}

// Non-finite activations are refused with 422 naming the sender and
// counted; a middle node producing NaN is refused by the next one, and the
// head answers 502 naming it (a node fault, which the tracker routes
// around), never a token; NaN logits give no token.
func TestNonFiniteActivationsRefused(t *testing.T) {
	testenv.CheckGoroutines(t)
	tail := &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab), PeerID: "tail"}
	url := startNode(t, tail)
	for name, body := range map[string][]byte{
		"bf16 NaN":  bytes.Repeat(bf16Bits(float32(math.NaN())), fkHidden),
		"bf16 +Inf": append(bytes.Repeat(bf16Bits(1), fkHidden-1), bf16Bits(float32(math.Inf(1)))...),
		"f32 -Inf":  binary.LittleEndian.AppendUint32(make([]byte, 4*(fkHidden-1)), math.Float32bits(float32(math.Inf(-1)))),
	} {
		dt := native.BF16
		if strings.HasPrefix(name, "f32") {
			dt = native.F32
		}
		hop := hopReq{session: "nf-" + strings.NewReplacer(" ", "-", "+", "p").Replace(name), n: 1, hidden: fkHidden, dtype: dt, start: 3, end: 5, body: body}
		st, h, b := hop.send(t, http.DefaultClient, url)
		if st != http.StatusUnprocessableEntity || decodeError(t, st, h, b).Type != "non_finite_activations" {
			t.Errorf("%s: %d %s, want 422 non_finite_activations", name, st, b)
		}
	}
	if n, _ := metricstest.Value(metricstest.Scrape(t, http.DefaultClient, url+"/metrics"), "meshgpu_node_hops_non_finite_total"); n != 3 {
		t.Errorf("meshgpu_node_hops_non_finite_total = %v, want 3", n)
	}
	// Finite activations still give a token.
	if r := sendToken(t, hopReq{session: "fine", n: 1, hidden: fkHidden, dtype: native.F32, start: 3, end: 5}, http.DefaultClient, url); r.Token != 3 {
		t.Errorf("finite hop: token %d, want 3 (0 through three layers)", r.Token)
	}

	// A broken mid node on a ticketed route: the tail refuses its NaN
	// naming it (the ticket says who sends the tail's hops), the head
	// answers 502 naming the mid.
	headID := newID(t)
	head := &Server{StackForTesting: newFakeStack(0, 1, fkLayers, fkHidden, fkVocab), PeerID: headID.PeerID, Identity: headID, Logger: quietLogger()}
	t.Cleanup(func() { head.Close() })
	badStack := newFakeStack(2, 2, fkLayers, fkHidden, fkVocab)
	badStack.nanOut = true
	mid := &Server{StackForTesting: badStack, PeerID: "mid", TrustedHeads: []string{headID.PeerID}}
	midURL := startNode(t, mid)
	tail2 := &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab), PeerID: "tail", TrustedHeads: []string{headID.PeerID}}
	url2 := startNode(t, tail2)
	p, _ := ticketedPipeline(t, head, []wire.Hop{{Endpoint: midURL, StartLayer: 2, EndLayer: 2, PeerID: "mid"}, {Endpoint: url2, StartLayer: 3, EndLayer: 5, PeerID: "tail"}})
	_, _, ae := p.step(context.Background(), 0, []int32{1}, 0)
	if ae == nil || ae.Status != http.StatusBadGateway || ae.Type != "non_finite_activations" || ae.Hop != "mid" {
		t.Fatalf("chain through a NaN node: %+v, want 502 non_finite_activations naming mid", ae)
	}
	if n, _ := metricstest.Value(metricstest.Scrape(t, http.DefaultClient, url2+"/metrics"), "meshgpu_node_hops_non_finite_total"); n != 1 {
		t.Errorf("the tail counted %v non-finite hops, want 1", n)
	}

	// NaN logits: an error, not token 0.
	nanHead := newFakeStack(3, 5, fkLayers, fkHidden, fkVocab)
	nanHead.nanLogits = true
	nanTail := &Server{StackForTesting: nanHead, PeerID: "nan-tail"}
	nanURL := startNode(t, nanTail)
	st, h, b := hopReq{session: "nanlogits", n: 1, hidden: fkHidden, dtype: native.F32, start: 3, end: 5}.send(t, http.DefaultClient, nanURL)
	if st != http.StatusInternalServerError || decodeError(t, st, h, b).Type != "non_finite_logits" {
		t.Fatalf("NaN logits: %d %s, want 500 non_finite_logits", st, b)
	}
}

// serveSniffed serves s on 127.0.0.1 with TLS (id's key) and plain HTTP on
// one port, as a mesh node does.
func serveSniffed(t *testing.T, s *Server, id *identity.Identity) (string, *sniffListener) {
	t.Helper()
	if s.Logger == nil {
		s.Logger = quietLogger()
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tc, err := id.ServerTLSConfig(time.Now())
	if err != nil {
		t.Fatal(err)
	}
	sl := ServeTLSAndPlain(ln, tc).(*sniffListener)
	hs := &http.Server{Handler: s.Handler(), ReadHeaderTimeout: 5 * time.Second, ErrorLog: nil}
	done := make(chan struct{})
	go func() { defer close(done); hs.Serve(sl) }()
	t.Cleanup(func() { hs.Close(); <-done; s.Close() })
	return "http://" + ln.Addr().String(), sl
}

// Hops go over TLS pinned to the peer id the route names: a node whose
// certificate carries that key gets the hop encrypted; one presenting a
// certificate for another key (an impostor at the endpoint) gets no hop
// at all, and the hop fails; a peer serving no TLS gets plain hops.
func TestHopTLSPinnedToPeerID(t *testing.T) {
	testenv.CheckGoroutines(t)
	tailID, impostorID := newID(t), newID(t)
	tail := &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab), PeerID: tailID.PeerID, Identity: tailID}
	url, sl := serveSniffed(t, tail, tailID)
	impostor := &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab), PeerID: tailID.PeerID, Identity: impostorID}
	impURL, impLn := serveSniffed(t, impostor, impostorID)
	plainTail := &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab), PeerID: "plain-tail"}
	plainURL := startNode(t, plainTail)

	run := func(head *Server, hop wire.Hop, id string) ([]int32, *apiError) {
		return sixSteps(headPipeline(t, head, id, []wire.Hop{hop}))
	}
	head := &Server{StackForTesting: newFakeStack(0, 2, fkLayers, fkHidden, fkVocab), PeerID: "head", Logger: quietLogger()}
	t.Cleanup(func() { head.Close() })

	ids, ae := run(head, wire.Hop{Endpoint: url, StartLayer: 3, EndLayer: 5, PeerID: tailID.PeerID}, "tls-ok")
	if ae != nil || !equalIDs(ids, sixStepsWant(), 6) {
		t.Fatalf("pinned TLS hop: %v %v", ids, ae)
	}
	if n := sl.tlsConns.Load(); n != 1 {
		t.Errorf("the tail saw %d TLS connections, want 1 (the hop connection)", n)
	}
	_, ae = run(head, wire.Hop{Endpoint: impURL, StartLayer: 3, EndLayer: 5, PeerID: tailID.PeerID}, "tls-impostor")
	if ae == nil || ae.Type != "hop_unreachable" || !strings.Contains(ae.Message, "not the expected peer id") {
		t.Fatalf("impostor's certificate: %+v, want hop_unreachable naming the wrong peer", ae)
	}
	if impLn.tlsConns.Load() == 0 || impostor.sessions.len() != 0 || impostor.metrics.hopsOK.Load() != 0 {
		t.Errorf("the impostor got a hop: %d TLS connections, %d sessions, %d hops", impLn.tlsConns.Load(), impostor.sessions.len(), impostor.metrics.hopsOK.Load())
	}
	ids, ae = run(head, wire.Hop{Endpoint: plainURL, StartLayer: 3, EndLayer: 5, PeerID: "plain-tail"}, "plain")
	if ae != nil || !equalIDs(ids, sixStepsWant(), 6) {
		t.Fatalf("a peer without TLS: %v %v", ids, ae)
	}
	// --hop-tls=false: the same hop in the clear.
	lan := &Server{StackForTesting: newFakeStack(0, 2, fkLayers, fkHidden, fkVocab), PeerID: "lan-head", Logger: quietLogger(), NoHopTLS: true}
	t.Cleanup(func() { lan.Close() })
	before := sl.tlsConns.Load()
	if ids, ae := run(lan, wire.Hop{Endpoint: url, StartLayer: 3, EndLayer: 5, PeerID: tailID.PeerID}, "lan"); ae != nil || !equalIDs(ids, sixStepsWant(), 6) {
		t.Fatalf("plain hop with NoHopTLS: %v %v", ids, ae)
	}
	if sl.tlsConns.Load() != before {
		t.Error("NoHopTLS still dialed TLS")
	}
}

// The tracker frees a failed route's sessions without their keys, under a
// release its ticket key signs (ticket.SignRelease). A node on the route
// holds the ticket but not the issuer's key: its own signature, a stranger's,
// one for another session and a malformed one are all refused; the issuer's
// frees the session.
func TestSessionReleaseOnlyFromTheIssuer(t *testing.T) {
	testenv.CheckGoroutines(t)
	head, headID := fakeHead(t)
	tail := &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab), PeerID: "tail", TrustedHeads: []string{headID.PeerID}}
	url := startNode(t, tail)
	p, grant := ticketedPipeline(t, head, []wire.Hop{{Endpoint: url, StartLayer: 3, EndLayer: 5, PeerID: "tail"}})
	if _, _, ae := p.step(context.Background(), 0, []int32{3, 4, 5}, 0); ae != nil {
		t.Fatal(ae)
	}
	if !tail.HasSession(grant.id) {
		t.Fatal("no session on the tail")
	}
	del := func(release string) int {
		req, _ := http.NewRequest(http.MethodDelete, url+"/sessions/"+grant.id, nil)
		req.Header.Set(wire.HeaderSessionRelease, release)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	enc := base64.RawURLEncoding.EncodeToString
	stranger := newID(t)
	for what, release := range map[string]string{
		"a route node's own signature":  enc(ticket.SignRelease(stranger.Private, grant.id, grant.ticket)),
		"the issuer's, another session": enc(ticket.SignRelease(headID.Private, grant.id+"x", grant.ticket)),
		"not base64":                    "!!!",
		"too short":                     enc([]byte("sig")),
	} {
		if st := del(release); st != http.StatusForbidden {
			t.Errorf("release %s: %d, want 403", what, st)
		}
	}
	if !tail.HasSession(grant.id) {
		t.Fatal("the session is gone after the forged releases")
	}
	if st := del(enc(ticket.SignRelease(headID.Private, grant.id, grant.ticket))); st != http.StatusOK {
		t.Fatalf("the issuer's release: %d, want 200", st)
	}
	if tail.HasSession(grant.id) {
		t.Fatal("the session survived the issuer's release")
	}
}

// TestInRangeMatchesPerValueCheck: the word-at-a-time check agrees with
// comparing each value's magnitude to maxActivation, for a NaN, an Inf, the
// bound itself or the largest finite value at every position of bf16 and
// f32 rows of several lengths (tails included), and for values just below
// the bound.
func TestInRangeMatchesPerValueCheck(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	perValue := func(b []byte, bf16 bool) bool {
		for i := 0; i < len(b)/2; i++ {
			var v float32
			if bf16 {
				v = math.Float32frombits(uint32(binary.LittleEndian.Uint16(b[2*i:])) << 16)
			} else if 4*i+4 <= len(b) {
				v = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
			}
			if !(math.Abs(float64(v)) < maxActivation) {
				return false
			}
		}
		return true
	}
	for _, bf16 := range []bool{true, false} {
		size := 4
		// ±Inf, NaNs, ±2^20, the largest finite, 3e38
		bad := []uint32{0x7f800000, 0xff800000, 0x7fc00000, 0x7f800001, 0xffffffff, 0x49800000, 0xc9800000, 0x7f7fffff, math.Float32bits(3e38)}
		near := []uint32{0x497fffff, 0xc97fffff, 0x3f800000, 0} // just below 2^20, 1, 0
		if bf16 {
			size = 2
			bad = []uint32{0x7f80, 0xff80, 0x7fc0, 0x7f81, 0xffff, 0x4980, 0xc980, 0x7f7f}
			near = []uint32{0x497f, 0xc97f, 0x3f80, 0}
		}
		put := func(b []byte, i int, v uint32) {
			if bf16 {
				binary.LittleEndian.PutUint16(b[i*size:], uint16(v))
			} else {
				binary.LittleEndian.PutUint32(b[i*size:], v)
			}
		}
		for _, n := range []int{1, 3, 4, 5, 7, 8, 9, 33} {
			b := make([]byte, n*size)
			for i := 0; i < n; i++ {
				put(b, i, near[rng.IntN(len(near))])
			}
			if !inRange(b, bf16) || !perValue(b, bf16) {
				t.Fatalf("bf16=%v n=%d: values below the bound refused", bf16, n)
			}
			for i := 0; i < n; i++ {
				for _, v := range bad {
					c := bytes.Clone(b)
					put(c, i, v)
					if got, want := inRange(c, bf16), perValue(c, bf16); got != want || got {
						t.Fatalf("bf16=%v n=%d: %#x at %d: inRange %v, per value %v", bf16, n, v, i, got, want)
					}
				}
			}
		}
	}
}

// SplitTLS: a handshake offering wire.HopTLSProto (the pinned hop dialer)
// gets the identity certificate, any other client the operator's.
func TestSplitTLSServesTheIdentityToHopsOnly(t *testing.T) {
	id, err := identity.New()
	if err != nil {
		t.Fatal(err)
	}
	hop, err := id.ServerTLSConfig(time.Now())
	if err != nil {
		t.Fatal(err)
	}
	other, err := identity.New() // stands in for the operator's certificate
	if err != nil {
		t.Fatal(err)
	}
	api, err := other.ServerTLSConfig(time.Now())
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	tl := tls.NewListener(ln, SplitTLS(hop, api))
	go func() {
		for {
			c, err := tl.Accept()
			if err != nil {
				return
			}
			go func() { c.(*tls.Conn).Handshake(); c.Close() }()
		}
	}()
	dial := func(protos []string) string {
		cfg := &tls.Config{InsecureSkipVerify: true, NextProtos: protos}
		c, err := tls.Dial("tcp", ln.Addr().String(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		return identity.PeerID(c.ConnectionState().PeerCertificates[0].PublicKey.(ed25519.PublicKey))
	}
	if got := dial([]string{wire.HopTLSProto, "http/1.1"}); got != id.PeerID {
		t.Fatalf("a hop handshake got the certificate of %s, want the node's %s", got, id.PeerID)
	}
	if got := dial([]string{"h2", "http/1.1"}); got != other.PeerID {
		t.Fatalf("an API client got the certificate of %s, want the operator's", got)
	}
	if got := dial(nil); got != other.PeerID {
		t.Fatalf("a client without ALPN got the certificate of %s, want the operator's", got)
	}
}

package node

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"meshgpu/engine"
	"meshgpu/hopmux"
	"meshgpu/internal/linkdelay"
	"meshgpu/internal/metricstest"
	"meshgpu/internal/testenv"
	"meshgpu/relay"
	"meshgpu/sample"
	"meshgpu/wire"
)

// directGocoder is gocoder-6m over three real servers as in
// startTicketedGocoder, the head naming its endpoint in its tickets so the
// tail answers it directly; stopTail kills the tail.
type directGocoder struct {
	*ticketedGocoder
	stopTail func()
}

func startDirectGocoder(t *testing.T, headOpts ...func(*Server)) *directGocoder {
	dir, be, load := gocoderLoader(t)
	g := &ticketedGocoder{full: load(0, -1), golden: loadGolden(t, dir), headID: newID(t)}
	node := func(first, last int) *Server {
		id := newID(t)
		return &Server{Model: load(first, last), Backend: be, PeerID: id.PeerID, Identity: id, TrustedHeads: []string{g.headID.PeerID}, Logger: quietLogger()}
	}
	g.mid, g.tail = node(3, 4), node(5, 5)
	g.midURL = startNode(t, g.mid)
	var stop func()
	g.tailURL, stop = serve(t, g.tail.Handler())
	t.Cleanup(func() { g.tail.Close() })
	// The head's URL is known once it listens; ReplyEndpoint is read when
	// a request's ticket is signed, after this.
	// The head's own connections cross a WAN (the chain's first and last
	// legs), the tail's to it does not: the direct reply comes first.
	wan := &http.Transport{DialContext: (&linkdelay.Dialer{RTT: 10 * time.Millisecond}).DialContext}
	t.Cleanup(wan.CloseIdleConnections)
	g.head = &Server{Model: load(0, 2), Backend: be, PeerID: g.headID.PeerID, Identity: g.headID, Peers: []string{g.midURL, g.tailURL}, HopDType: "f32",
		HTTPClient: &http.Client{Transport: wan}}
	for _, o := range headOpts {
		o(g.head)
	}
	g.url = startNode(t, g.head)
	g.head.ReplyEndpoint = g.url
	return &directGocoder{ticketedGocoder: g, stopTail: func() { stop(); g.tail.Close() }}
}

// complete posts a greedy completion of n tokens and answers its text.
func complete(t *testing.T, url string, prompt []int32, n int, speculate string) string {
	t.Helper()
	pj, _ := json.Marshal(prompt)
	body := fmt.Sprintf(`{"prompt":%s,"max_tokens":%d,"temperature":0,"ignore_eos":true,"meshgpu":{"speculate":%q}}`, pj, n, speculate)
	st, b := post(t, url+"/v1/completions", body, nil)
	var c struct {
		Choices []struct {
			Text string `json:"text"`
		} `json:"choices"`
	}
	if err := json.Unmarshal([]byte(b), &c); st != 200 || err != nil || len(c.Choices) != 1 {
		t.Fatalf("completion: %d %s", st, b)
	}
	return c.Choices[0].Text
}

func metricOf(t *testing.T, url, name string, labels ...string) float64 {
	t.Helper()
	v, _ := metricstest.Value(metricstest.Scrape(t, http.DefaultClient, url+"/metrics"), name, labels...)
	return v
}

// Greedy output with direct replies is one model's and the chain's, plain
// and speculative (verify hops answer directly too); the head took the
// direct replies (it did not just wait for the chain), and no waiter or
// session is left behind.
func TestDirectRepliesKeepTheText(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startDirectGocoder(t)
	for i, gen := range g.golden[:2] {
		ref, err := g.full.Generate(context.Background(), gen.PromptIDs, engine.GenerateParams{MaxTokens: 24, IgnoreEOS: true, Sampling: sample.Params{}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		for _, spec := range []string{"off", "ngram"} {
			if got := complete(t, g.url, gen.PromptIDs, 24, spec); got != ref.Text {
				t.Errorf("prompt %d, speculate %s, direct replies: %q, want one model's %q", i, spec, got, ref.Text)
			}
		}
	}
	direct := metricOf(t, g.url, "meshgpu_node_direct_replies_total", "first=direct")
	sent := metricOf(t, g.tailURL, "meshgpu_node_direct_replies_sent_total", "result=ok")
	if direct == 0 || sent == 0 {
		t.Fatalf("the head took %v direct replies, the tail sent %v: the replies went along the chain only", direct, sent)
	}
	if n := metricOf(t, g.url, "meshgpu_node_direct_replies_refused_total", "reason=chain_disagrees"); n != 0 {
		t.Fatalf("%v chain answers disagreed with direct replies", n)
	}
	// The same request without the head's address in the ticket: the
	// chain path, the same text, and no direct reply sent.
	sends := func() float64 {
		for len(g.tail.replyPushes) > 0 { // the pushes still running
			time.Sleep(time.Millisecond)
		}
		return metricOf(t, g.tailURL, "meshgpu_node_direct_replies_sent_total")
	}
	g.head.ReplyEndpoint = ""
	before := sends()
	chain := complete(t, g.url, g.golden[0].PromptIDs, 24, "off")
	if after := sends(); after != before {
		t.Errorf("the tail sent %v direct replies under tickets naming no head address", after-before)
	}
	g.head.ReplyEndpoint = g.url
	if direct := complete(t, g.url, g.golden[0].PromptIDs, 24, "off"); chain != direct {
		t.Errorf("chain replies %q, direct replies %q", chain, direct)
	}
	if after := sends(); after-before != 24 {
		t.Errorf("the tail tried %v direct replies for 24 tokens", after-before)
	}
	if n := g.head.replies.len(); n != 0 {
		t.Errorf("%d direct-reply waiters left on the head", n)
	}
	waitSessions(t, http.DefaultClient, g.url, g.midURL, g.tailURL)
}

// inFlight keeps k passes in flight on a head whatever the round.
func inFlight(k int) func(*Server) {
	return func(s *Server) { s.SpeculateInFlight, s.inFlightFixed = k, k }
}

// Direct replies and passes in flight together (issue 17's equalities on
// the joined path): with three verify passes always in flight, each
// answered straight to the head, greedy ngram speculation gives one
// model's text and seeded sampling the text plain decoding draws with chain
// replies. Passes were dropped (the window really ran ahead and rolled
// back), the head went on with direct replies, every chain answer agreed,
// and no pass, waiter or session is left.
func TestDirectRepliesWithPassesInFlight(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startDirectGocoder(t, inFlight(3))
	for i, gen := range g.golden[:3] {
		ref, err := g.full.Generate(context.Background(), gen.PromptIDs, engine.GenerateParams{MaxTokens: 64, IgnoreEOS: true}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if got := complete(t, g.url, gen.PromptIDs, 64, "ngram"); got != ref.Text {
			t.Errorf("prompt %d, greedy, 3 in flight, direct replies: %q, want one model's %q", i, got, ref.Text)
		}
		for seed := 1; seed <= 2; seed++ {
			g.head.ReplyEndpoint = ""
			chain := sampledText(t, g.url, gen.PromptIDs, seed, "off")
			g.head.ReplyEndpoint = g.url
			if got := sampledText(t, g.url, gen.PromptIDs, seed, "ngram"); got != chain {
				t.Errorf("prompt %d seed %d, 3 in flight, direct replies: %q, plain with chain replies %q", i, seed, got, chain)
			}
		}
	}
	if n := metricOf(t, g.url, "meshgpu_node_speculative_dropped_passes_total"); n == 0 {
		t.Error("no pass was dropped: the window never ran ahead of a rejection")
	}
	if n := metricOf(t, g.url, "meshgpu_node_speculative_accepted_tokens_total", "mode=ngram"); n == 0 {
		t.Error("no draft accepted: the test ran plain decoding only")
	}
	if n := metricOf(t, g.url, "meshgpu_node_direct_replies_total", "first=direct"); n == 0 {
		t.Error("the head took no direct reply")
	}
	if n := metricOf(t, g.url, "meshgpu_node_direct_replies_refused_total", "reason=chain_disagrees"); n != 0 {
		t.Errorf("%v chain answers disagreed with direct replies", n)
	}
	if n := metricOf(t, g.url, "meshgpu_node_speculative_passes_in_flight"); n != 0 {
		t.Errorf("%v passes in flight after every generation ended", n)
	}
	if n := g.head.replies.len(); n != 0 {
		t.Errorf("%d direct-reply waiters left on the head", n)
	}
	waitSessions(t, http.DefaultClient, g.url, g.midURL, g.tailURL)
}

// sampledText is the text of a seeded completion at temperature 0.8.
func sampledText(t *testing.T, url string, prompt []int32, seed int, speculate string) string {
	t.Helper()
	pj, _ := json.Marshal(prompt)
	body := fmt.Sprintf(`{"prompt":%s,"max_tokens":32,"temperature":0.8,"seed":%d,"meshgpu":{"speculate":%q}}`, pj, seed, speculate)
	st, b := post(t, url+"/v1/completions", body, nil)
	var c struct {
		Choices []struct {
			Text string `json:"text"`
		} `json:"choices"`
	}
	if err := json.Unmarshal([]byte(b), &c); st != 200 || err != nil || len(c.Choices) != 1 {
		t.Fatalf("completion: %d %s", st, b)
	}
	return c.Choices[0].Text
}

// The tail dies while three passes are in flight, each waiting for its
// direct reply: the stream fails (the chain still tells the head), no
// waiter, pass or session is left, and the replay the tracker's failover
// sends (the prompt and the ids streamed, continue_ids) to another route
// with direct replies and passes in flight continues it: the ids before and
// after are one model's uninterrupted greedy ids.
func TestDirectRepliesFailoverWithPassesInFlight(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startDirectGocoder(t, inFlight(3))
	spare := startDirectGocoder(t, inFlight(3))
	const n = 160
	prompt := g.golden[0].PromptIDs
	ref, err := g.full.Generate(context.Background(), prompt, engine.GenerateParams{MaxTokens: n, IgnoreEOS: true}, nil)
	if err != nil {
		t.Fatal(err)
	}
	body := func(max int, cont []int32) map[string]any {
		ext := map[string]any{"speculate": "ngram"}
		if cont != nil {
			ext["continue_ids"] = cont
		}
		return map[string]any{"prompt": prompt, "max_tokens": max, "temperature": 0, "ignore_eos": true, "stream": true, "meshgpu": ext}
	}
	resp, err := postJSON(context.Background(), http.DefaultClient, g.url+"/v1/completions", body(n, nil))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	s := g.stopTailAfter(t, resp.Body, 8)
	for s.next(t) {
	}
	if s.err == "" || len(s.ids) >= n {
		t.Fatalf("the stream went on without its tail: %d tokens, error %q", len(s.ids), s.err)
	}
	before := s.ids
	r2, err := postJSON(context.Background(), http.DefaultClient, spare.url+"/v1/completions", body(n-len(before), before))
	if err != nil {
		t.Fatal(err)
	}
	rest := readStream(t, r2.Body, 0)
	r2.Body.Close()
	if rest.errMsg != "" || !rest.done {
		t.Fatalf("the replay: error %q, done %v", rest.errMsg, rest.done)
	}
	if got := append(slices.Clone(before), rest.ids...); !equalIDs(got, ref.IDs, max(len(got), len(ref.IDs))) {
		t.Fatalf("killed after %d ids, replayed: %v\nwant uninterrupted %v", len(before), got, ref.IDs)
	}
	for _, h := range []*directGocoder{g, spare} {
		if n := h.head.replies.len(); n != 0 {
			t.Errorf("%d direct-reply waiters left on a head", n)
		}
		if n := metricOf(t, h.url, "meshgpu_node_speculative_passes_in_flight"); n != 0 {
			t.Errorf("%v passes in flight on a head after its generation ended", n)
		}
	}
	if metricOf(t, spare.url, "meshgpu_node_direct_replies_total", "first=direct") == 0 {
		t.Error("the replay took no direct reply")
	}
	waitSessions(t, http.DefaultClient, g.url, g.midURL, spare.url, spare.midURL, spare.tailURL)
}

// The tail dies with the head on the direct path: the stream fails at
// once naming the tail (the chain answer of the middle still tells the
// head), not after a hop timeout, and nothing is left behind.
func TestDirectRepliesTailDies(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startDirectGocoder(t)
	pj, _ := json.Marshal(g.golden[0].PromptIDs)
	req, _ := http.NewRequest(http.MethodPost, g.url+"/v1/completions",
		strings.NewReader(`{"prompt":`+string(pj)+`,"max_tokens":400,"temperature":0,"ignore_eos":true,"stream":true}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	s := g.stopTailAfter(t, resp.Body, 4)
	start := time.Now()
	for s.next(t) {
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("the head took %v to notice the dead tail", took)
	}
	if s.err == "" || len(s.ids) >= 400 {
		t.Fatalf("the stream went on without its tail: %d tokens, error %q", len(s.ids), s.err)
	}
	if n := g.head.replies.len(); n != 0 {
		t.Errorf("%d direct-reply waiters left on the head", n)
	}
	waitSessions(t, http.DefaultClient, g.url, g.midURL)
}

// replyWaiterOn starts a head with one pass waiting at k for a direct
// reply under a fresh tail key; it answers the head's URL, the key and the
// waiter.
func replyWaiterOn(t *testing.T, k replyKey, verify bool) (string, []byte, *replyWaiter) {
	head, _ := fakeHead(t)
	url := startNode(t, head)
	key := make([]byte, 32)
	rand.Read(key)
	w := &replyWaiter{key: key, verify: verify, ch: make(chan []wire.TokenReply, 1)}
	if !head.replies.add(k, w) {
		t.Fatal("no waiter")
	}
	t.Cleanup(func() { head.replies.remove(k, w) })
	return url, key, w
}

// postReply POSTs d to the head at url and answers the status.
func postReply(t *testing.T, url string, d wire.DirectReply) int {
	b, _ := json.Marshal(d)
	resp, err := http.Post(url+wire.DirectReplyPath, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// Every attacker against POST /reply: no key (a forged MAC), the right key
// for another session or position, an answer changed after the MAC, a
// replay of an accepted reply, a flipped verify flag, an oversized body.
// Each is refused and counted, and only the authentic reply reaches the
// waiting pass, once.
func TestDirectReplyRefusesForgeries(t *testing.T) {
	testenv.CheckGoroutines(t)
	url, key, w := replyWaiterOn(t, replyKey{"s-victim", 7, 3, 0}, false)
	reply := func(session string, pos, step int, verify bool, answer string, mac []byte) wire.DirectReply {
		d := wire.DirectReply{Session: session, Position: pos, Step: step, Verify: verify, Answer: json.RawMessage(answer)}
		d.MAC = mac
		if mac == nil {
			d.MAC = wire.DirectReplyMAC(key, &d)
		}
		return d
	}
	send := func(d wire.DirectReply) int { return postReply(t, url, d) }
	other := make([]byte, 32)
	rand.Read(other)
	forged := reply("s-victim", 7, 3, false, `{"token":9,"logprob":-0.5}`, nil)
	forged.MAC = wire.DirectReplyMAC(other, &forged)
	changed := reply("s-victim", 7, 3, false, `{"token":9,"logprob":-0.5}`, nil)
	changed.Answer = json.RawMessage(`{"token":10,"logprob":-0.5}`)
	attacks := []struct {
		name string
		d    wire.DirectReply
		want int
	}{
		{"forged MAC (another key)", forged, 403},
		{"empty MAC", reply("s-victim", 7, 3, false, `{"token":9,"logprob":-0.5}`, []byte{}), 403},
		{"answer changed after the MAC", changed, 403},
		{"another session", reply("s-other", 7, 3, false, `{"token":9,"logprob":-0.5}`, nil), 404},
		{"another position", reply("s-victim", 8, 3, false, `{"token":9,"logprob":-0.5}`, nil), 404},
		{"another step", reply("s-victim", 7, 4, false, `{"token":9,"logprob":-0.5}`, nil), 404},
		{"verify flag flipped", reply("s-victim", 7, 3, true, `{"tokens":[{"token":9,"logprob":-0.5}]}`, nil), 404},
	}
	for _, a := range attacks {
		if st := send(a.d); st != a.want {
			t.Errorf("%s: %d, want %d", a.name, st, a.want)
		}
		select {
		case toks := <-w.ch:
			t.Fatalf("%s reached the pass: %+v", a.name, toks)
		default:
		}
	}
	b := bytes.Repeat([]byte("x"), wire.MaxDirectReply+1)
	if resp, err := http.Post(url+wire.DirectReplyPath, "application/json", bytes.NewReader(b)); err != nil || resp.StatusCode != 400 {
		t.Errorf("oversized body: %v %v", resp, err)
	} else {
		resp.Body.Close()
	}
	good := reply("s-victim", 7, 3, false, `{"token":9,"logprob":-0.5}`, nil)
	if st := send(good); st != 204 {
		t.Fatalf("the authentic reply: %d", st)
	}
	if toks := <-w.ch; len(toks) != 1 || toks[0].Token != 9 {
		t.Fatalf("delivered %+v", toks)
	}
	if st := send(good); st != 404 {
		t.Errorf("replayed reply: %d, want 404", st)
	}
	select {
	case toks := <-w.ch:
		t.Fatalf("the replay reached the pass: %+v", toks)
	default:
	}
	if n := metricOf(t, url, "meshgpu_node_direct_replies_refused_total", "reason=bad_mac"); n != 3 {
		t.Errorf("bad_mac refusals %v, want 3", n)
	}
	if n := metricOf(t, url, "meshgpu_node_direct_replies_refused_total", "reason=unknown"); n != 5 {
		t.Errorf("unknown refusals %v, want 5 (session, position, step, verify, replay)", n)
	}
}

// A pass in flight dropped after a rejection and the redo that replaces it
// can share a position and step (the pass before was accepted in full, but
// the guess at its bonus token was wrong). The dropped pass's authentic
// direct reply, arriving late or replayed, must not answer the redo: the
// reply names its pass, under the MAC, and the waiter takes its own pass's
// only.
func TestDroppedPassReplyDoesNotAnswerItsRedo(t *testing.T) {
	testenv.CheckGoroutines(t)
	const dropped, redo = 6, 7
	url, key, w := replyWaiterOn(t, replyKey{"s-victim", 12, 5, redo}, true)
	authentic := func(pass uint32, token int) wire.DirectReply {
		d := wire.DirectReply{Session: "s-victim", Position: 12, Step: 5, Pass: pass, Verify: true,
			Answer: json.RawMessage(fmt.Sprintf(`{"tokens":[{"token":%d,"logprob":-0.5}]}`, token))}
		d.MAC = wire.DirectReplyMAC(key, &d)
		return d
	}
	send := func(d wire.DirectReply) int { return postReply(t, url, d) }
	renumbered := authentic(dropped, 9)
	renumbered.Pass = redo // the dropped pass's tag, relabelled as the redo's
	for _, a := range []struct {
		name string
		d    wire.DirectReply
		want int
	}{
		{"the dropped pass's reply", authentic(dropped, 9), 404},
		{"the dropped pass's reply renumbered", renumbered, 403},
		{"an unordered reply for the position", authentic(0, 9), 404},
	} {
		if st := send(a.d); st != a.want {
			t.Errorf("%s: %d, want %d", a.name, st, a.want)
		}
		select {
		case toks := <-w.ch:
			t.Fatalf("%s answered the redo: %+v", a.name, toks)
		default:
		}
	}
	if st := send(authentic(redo, 4)); st != 204 {
		t.Fatalf("the redo's own reply: %d", st)
	}
	if toks := <-w.ch; len(toks) != 1 || toks[0].Token != 4 {
		t.Fatalf("delivered %+v, want the redo's token 4", toks)
	}
}

// The head waits for a bounded number of direct replies; past the bound a
// pass falls back to the chain answer.
func TestReplyWaitersBounded(t *testing.T) {
	var r replyWaiters
	for i := range maxReplyWaiters {
		if !r.add(replyKey{"s", i, i, 0}, &replyWaiter{}) {
			t.Fatalf("waiter %d refused", i)
		}
	}
	if r.add(replyKey{"s", -1, -1, 0}, &replyWaiter{}) {
		t.Fatal("a waiter past the bound was taken")
	}
	if r.add(replyKey{"s", 0, 0, 0}, &replyWaiter{}) {
		t.Fatal("a second waiter for one pass was taken")
	}
}

// A chain answer that arrives after the head went on with the direct
// reply and differs from it fails the generation, blaming the next hop;
// one that agrees passes, and a chain failure is the route's failure.
func TestLateChainAnswerIsChecked(t *testing.T) {
	p := &pipeline{s: &Server{metrics: newMetrics(prometheus.NewRegistry(), func() float64 { return 0 })},
		route: []wire.Hop{{Endpoint: "http://mid", StartLayer: 3, EndLayer: 4}, {Endpoint: "http://tail", StartLayer: 5, EndLayer: 5}}}
	c := &chainCall{pos: 9, taken: []wire.TokenReply{{Token: 4, Logprob: -1}}}
	if ae := p.checkChain(c, chainResult{res: &hopAnswer{token: &wire.TokenReply{Token: 4, Logprob: -1}}}); ae != nil {
		t.Fatalf("agreeing chain answer: %v", ae)
	}
	ae := p.checkChain(c, chainResult{res: &hopAnswer{token: &wire.TokenReply{Token: 5, Logprob: -1}}})
	if ae == nil || ae.Status != 502 || ae.Hop != "http://mid" {
		t.Fatalf("disagreeing chain answer: %+v, want a 502 naming the next hop", ae)
	}
	down := &apiError{Status: 502, Type: "hop_unreachable", Hop: "http://tail"}
	if ae := p.checkChain(c, chainResult{ae: down}); ae != down {
		t.Fatalf("failed chain: %+v", ae)
	}
}

// A tail behind the relay answers directly too: to the head's endpoint
// (the tail dials out), or, when the ticket names only the head's relay
// address, through the relay tunnel to the head. The tokens are the
// chain's and the head took direct replies both ways.
func TestDirectRepliesWithTheTailBehindTheRelay(t *testing.T) {
	testenv.CheckGoroutines(t)
	for _, viaRelay := range []bool{false, true} {
		head, headID := fakeHead(t)
		tail := &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab), PeerID: "tail", TrustedHeads: []string{headID.PeerID}}
		addr, rc := tunnelTail(t, tail, true)
		// The chain answer's way back is long (a WAN); the direct reply's
		// is not, so it comes first.
		head.Relay = slowReturn{rc, 50 * time.Millisecond}
		if viaRelay {
			headAddr, trc := tunnelTail(t, head, true)
			head.ReplyRelay, tail.Relay = headAddr, trc
		} else {
			head.ReplyEndpoint = startNode(t, head)
		}
		p, grant := ticketedPipeline(t, head, []wire.Hop{{RelayAddr: addr, StartLayer: 3, EndLayer: 5, PeerID: "tail"}})
		if p.direct = head.directKey(grant, p.route); p.direct == nil {
			t.Fatal("the head's ticket names no address")
		}
		ids, ae := sixSteps(p)
		if ae == nil {
			ae = p.settleChains()
		}
		p.closeChains()
		if ae != nil {
			t.Fatalf("relay %v: %v", viaRelay, ae)
		}
		if want := sixStepsWant(); !equalIDs(ids, want, len(want)) {
			t.Fatalf("relay %v: %v, want %v", viaRelay, ids, want)
		}
		if head.metrics.directN.Load() == 0 {
			t.Errorf("relay %v: the head took no direct reply (%d chain first)", viaRelay, head.metrics.chainFirstN.Load())
		}
	}
}

// slowReturn is a relay client whose hop answers come back late.
type slowReturn struct {
	*relay.Client
	wait time.Duration
}

func (s slowReturn) DoHop(ctx context.Context, relayAddr string, h *wire.HopHead, payload []byte, into hopmux.ReplyBuffer) (*wire.HopReply, error) {
	rep, err := s.Client.DoHop(ctx, relayAddr, h, payload, into)
	t := time.NewTimer(s.wait)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
	return rep, err
}

// Sampled output keeps its distribution on the direct path: with one seed,
// plain and speculative (ngram) decoding with direct replies draw the text
// plain decoding draws with chain replies (issue 17's equality of draws,
// sample.Verify, on the new path).
func TestDirectRepliesSampledMatchesChain(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startDirectGocoder(t)
	sampled := func(prompt []int32, seed int, speculate string) string {
		return sampledText(t, g.url, prompt, seed, speculate)
	}
	for i, gen := range g.golden[:2] {
		for seed := 1; seed <= 2; seed++ {
			g.head.ReplyEndpoint = ""
			chain := sampled(gen.PromptIDs, seed, "off")
			g.head.ReplyEndpoint = g.url
			for _, spec := range []string{"off", "ngram"} {
				if got := sampled(gen.PromptIDs, seed, spec); got != chain {
					t.Errorf("prompt %d seed %d speculate %s with direct replies: %q, chain replies %q", i, seed, spec, got, chain)
				}
			}
		}
	}
	if metricOf(t, g.url, "meshgpu_node_direct_replies_total", "first=direct") == 0 {
		t.Fatal("no direct reply taken")
	}
}

// stopTailAfter reads the stream body until k tokens arrived, then stops
// the tail; the caller reads on.
func (g *directGocoder) stopTailAfter(t *testing.T, body io.Reader, k int) *sseIDs {
	t.Helper()
	s := &sseIDs{sc: bufio.NewScanner(body)}
	for len(s.ids) < k && s.next(t) {
	}
	if len(s.ids) < k {
		t.Fatalf("stream ended after %d tokens: %s", len(s.ids), s.err)
	}
	g.stopTail()
	return s
}

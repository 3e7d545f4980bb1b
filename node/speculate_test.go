package node

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"testing"
	"time"

	"meshgpu/engine"
	"meshgpu/internal/metricstest"
	"meshgpu/internal/testenv"
	"meshgpu/native"
	"meshgpu/wire"
)

// specMesh is gocoder-6m on three nodes (0-1, 2-3, 4-5): heads over 0-1
// with f32 hops, one per speculation mode, sharing the middle and tail;
// the draft head drafts with the whole model. opts set up each head
// before it starts.
type specMesh struct {
	be        native.Backend
	full      *engine.Model
	heads     map[wire.SpeculateMode]*Server
	urls      map[wire.SpeculateMode]string
	mid, tail *Server
	route     []wire.Hop
	golden    []goldenGen
}

func startSpecMesh(t *testing.T, opts ...func(*Server)) *specMesh {
	dir := testenv.GoCoder(t)
	be, err := native.Open("cpu", native.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.Close() })
	load := func(first, last int) *engine.Model {
		m, err := engine.Load(dir, engine.Options{Backend: be, First: first, Last: last, MaxContext: 1024})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		return m
	}
	g := &specMesh{be: be, full: load(0, -1), golden: loadGolden(t, dir),
		heads: map[wire.SpeculateMode]*Server{}, urls: map[wire.SpeculateMode]string{}}
	g.mid = &Server{Model: load(2, 3), Backend: be, PeerID: "mid"}
	g.tail = &Server{Model: load(4, 5), Backend: be, PeerID: "tail"}
	g.route = []wire.Hop{{Endpoint: startNode(t, g.mid), StartLayer: 2, EndLayer: 3, PeerID: "mid"},
		{Endpoint: startNode(t, g.tail), StartLayer: 4, EndLayer: 5, PeerID: "tail"}}
	headModel := load(0, 1)
	for _, m := range []wire.SpeculateMode{wire.SpeculateOff, wire.SpeculateNGram, wire.SpeculateNGramTree, wire.SpeculateDraft} {
		s := &Server{Model: headModel, Backend: be, PeerID: "head-" + string(m), Route: g.route, HopDType: "f32", Speculate: m}
		if m == wire.SpeculateDraft {
			s.DraftModel = g.full
		}
		for _, o := range opts {
			o(s)
		}
		g.heads[m], g.urls[m] = s, startNode(t, s)
	}
	return g
}

func (g *specMesh) complete(t *testing.T, c *http.Client, mode wire.SpeculateMode, body map[string]any) streamed {
	t.Helper()
	body["stream"] = true
	resp, err := postJSON(context.Background(), c, g.urls[mode]+"/v1/completions", body)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s head answered %d", mode, resp.StatusCode)
	}
	s := readStream(t, resp.Body, 0)
	if s.errMsg != "" || !s.done {
		t.Fatalf("%s head: stream error %q, done %v", mode, s.errMsg, s.done)
	}
	return s
}

// counts scrapes the head's /metrics (promlint clean) for its drafted and
// accepted tokens.
func (g *specMesh) counts(t *testing.T, c *http.Client, mode wire.SpeculateMode) (drafted, accepted float64) {
	t.Helper()
	fams := metricstest.Scrape(t, c, g.urls[mode]+"/metrics")
	drafted, _ = metricstest.Value(fams, "meshgpu_node_speculative_draft_tokens_total", "mode="+string(mode))
	accepted, _ = metricstest.Value(fams, "meshgpu_node_speculative_accepted_tokens_total", "mode="+string(mode))
	if drafted > 0 {
		if n, _ := metricstest.Value(fams, "meshgpu_node_speculative_pass_tokens", "mode="+string(mode)); n == 0 {
			t.Errorf("speculate %s: drafts verified but no pass counted", mode)
		}
		if _, ok := metricstest.Value(fams, "meshgpu_node_speculative_draft_seconds", "mode="+string(mode)); !ok {
			t.Errorf("speculate %s: no draft cost series", mode)
		}
	}
	return drafted, accepted
}

// Greedy with f32 hops: for every golden prompt the text with ngram drafts
// and with a draft model (the model itself) equals plain decoding's, which
// equals the single-node reference; and the drafts were really verified
// (accepted tokens counted), so the equality is not plain decoding's twice.
// So it is one pass at a time and with three passes always in flight (each
// drafted as if the ones before were accepted, its first row a guess):
// there passes were dropped after rejections (the window was full and
// rolled back), and none is left in flight at the end. No session is
// left on any node.
func TestSpeculationGreedyMatchesPlain(t *testing.T) {
	testenv.CheckGoroutines(t)
	for _, k := range []int{1, 3} {
		t.Run("inflight-"+strconv.Itoa(k), func(t *testing.T) {
			g := startSpecMesh(t, func(s *Server) { s.SpeculateInFlight, s.inFlightFixed = k, k })
			c := &http.Client{Timeout: 120 * time.Second}
			defer c.CloseIdleConnections()
			for i, gen := range g.golden {
				ref, err := g.full.Generate(context.Background(), gen.PromptIDs, engine.GenerateParams{MaxTokens: 64}, nil)
				if err != nil {
					t.Fatal(err)
				}
				body := func() map[string]any {
					return map[string]any{"prompt": gen.PromptIDs, "max_tokens": 64, "temperature": 0}
				}
				off := g.complete(t, c, wire.SpeculateOff, body())
				if off.text != ref.Text || !equalIDs(off.ids, ref.IDs, max(len(off.ids), len(ref.IDs))) {
					t.Fatalf("prompt %d: plain mesh text %q, single node %q", i, off.text, ref.Text)
				}
				for _, m := range []wire.SpeculateMode{wire.SpeculateNGram, wire.SpeculateNGramTree, wire.SpeculateDraft} {
					s := g.complete(t, c, m, body())
					if s.text != off.text || !equalIDs(s.ids, off.ids, max(len(off.ids), len(s.ids))) {
						t.Errorf("prompt %d speculate %s: ids %v text %q\nwant ids %v text %q", i, m, s.ids, s.text, off.ids, off.text)
					}
				}
			}
			for _, m := range []wire.SpeculateMode{wire.SpeculateNGram, wire.SpeculateDraft} {
				d, a := g.counts(t, c, m)
				inFlight, dropped := g.inFlightCounts(t, c, m)
				t.Logf("speculate %s, %d in flight: %v drafts, %v accepted, %v passes dropped", m, k, d, a, dropped)
				if a == 0 {
					t.Errorf("speculate %s: no draft token was accepted (%v drafted)", m, d)
				}
				if m == wire.SpeculateDraft && a < 0.9*d {
					t.Errorf("the model drafting for itself had %v of %v drafts accepted, want at least 90%%", a, d)
				}
				if inFlight != 0 {
					t.Errorf("speculate %s: %v passes still in flight after every generation ended", m, inFlight)
				}
				if m == wire.SpeculateNGram && (k > 1) != (dropped > 0) {
					t.Errorf("speculate %s, %d in flight: %v passes dropped", m, k, dropped)
				}
			}
			// A request that turns speculation off is decoded plainly.
			d0, _ := g.counts(t, c, wire.SpeculateNGram)
			b := map[string]any{"prompt": g.golden[0].PromptIDs, "max_tokens": 32, "temperature": 0, "meshgpu": map[string]any{"speculate": "off"}}
			g.complete(t, c, wire.SpeculateNGram, b)
			if d1, _ := g.counts(t, c, wire.SpeculateNGram); d1 != d0 {
				t.Errorf(`"speculate":"off" still drafted %v tokens`, d1-d0)
			}
			var urls []string
			for _, u := range g.urls {
				urls = append(urls, u)
			}
			waitSessions(t, c, append(urls, g.route[0].Endpoint, g.route[1].Endpoint)...)
		})
	}
}

// Sampling at temperature 0.8: speculative sampling with one-hot drafts
// draws, at each step, the token plain decoding draws with the same seed
// (sample.Verify), so the texts of one seed agree, one pass at a time and
// with three passes in flight (each accepted token is still the draw of
// its step; passes were dropped, so the window was really full).
func TestSpeculationSamplingMatchesPlain(t *testing.T) {
	testenv.CheckGoroutines(t)
	for _, k := range []int{1, 3} {
		t.Run("inflight-"+strconv.Itoa(k), func(t *testing.T) {
			g := startSpecMesh(t, func(s *Server) { s.SpeculateInFlight, s.inFlightFixed = k, k })
			c := &http.Client{Timeout: 120 * time.Second}
			defer c.CloseIdleConnections()
			for i, gen := range g.golden[:2] {
				for seed := 1; seed <= 2; seed++ {
					body := func() map[string]any {
						return map[string]any{"prompt": gen.PromptIDs, "max_tokens": 48, "temperature": 0.8, "seed": seed}
					}
					off := g.complete(t, c, wire.SpeculateOff, body())
					for _, m := range []wire.SpeculateMode{wire.SpeculateNGram, wire.SpeculateNGramTree, wire.SpeculateDraft} {
						if s := g.complete(t, c, m, body()); s.text != off.text {
							t.Errorf("prompt %d seed %d speculate %s: %q, plain %q", i, seed, m, s.text, off.text)
						}
					}
				}
			}
			if _, a := g.counts(t, c, wire.SpeculateDraft); a == 0 {
				t.Error("no draft accepted while sampling")
			}
			if _, dropped := g.inFlightCounts(t, c, wire.SpeculateNGram); (k > 1) != (dropped > 0) {
				t.Errorf("%d in flight: %v passes dropped", k, dropped)
			}
		})
	}
}

// After a verify pass whose drafts are rejected, the next hop (at the
// accepted length) rolls every node's KV cache back to it: each node then
// holds the accepted tokens plus the row of that hop, and the token is
// the single node's.
func TestSpeculationRollsBackEveryNode(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startSpecMesh(t)
	head := g.heads[wire.SpeculateOff]
	prompt := g.golden[0].PromptIDs
	ref, err := g.full.Generate(context.Background(), prompt, engine.GenerateParams{MaxTokens: 4, IgnoreEOS: true}, nil)
	if err != nil {
		t.Fatal(err)
	}
	head.Handler()
	const id = "rollback"
	sess, ae := head.sessions.get(id, 0)
	if ae != nil {
		t.Fatal(ae)
	}
	defer func() {
		head.sessions.remove(id)
		head.deleteSessions(context.Background(), g.route, id, nil)
	}()
	p := &pipeline{s: head, sess: sess, id: id, headEnd: 1, route: g.route, dtype: native.F32}
	lens := func() [3]int {
		var out [3]int
		for i, s := range []*Server{head, g.mid, g.tail} {
			s.sessions.mu.Lock()
			ns := s.sessions.m[id]
			s.sessions.mu.Unlock()
			if ns == nil {
				t.Fatalf("node %d has no session %s", i, id)
			}
			out[i] = ns.kv.Len()
		}
		return out
	}
	ctx := context.Background()
	if tok, _, ae := p.step(ctx, 0, prompt, 0); ae != nil || tok != ref.IDs[0] {
		t.Fatalf("prefill: token %d, %v; want %d", tok, ae, ref.IDs[0])
	}
	P := len(prompt)
	vocab := int32(g.full.Config.Vocab)
	// One right draft, then two wrong ones.
	rows := []int32{ref.IDs[0], ref.IDs[1], (ref.IDs[2] + 1) % vocab, (ref.IDs[3] + 7) % vocab}
	toks, ae := p.pass(ctx, P, rows, 1, true)
	if ae != nil {
		t.Fatal(ae)
	}
	if len(toks) != 2 || toks[0].Token != ref.IDs[1] || toks[1].Token != ref.IDs[2] {
		t.Fatalf("verify answered %+v, want the accepted %d and the corrected %d", toks, ref.IDs[1], ref.IDs[2])
	}
	if got := lens(); got != [3]int{P + 4, P + 4, P + 4} {
		t.Fatalf("after the verify pass the nodes hold %v tokens, want %d each (every row ran)", got, P+4)
	}
	accepted := P + 2 // the prompt, ids 0 and 1
	tok, _, ae := p.step(ctx, accepted, []int32{ref.IDs[2]}, 3)
	if ae != nil || tok != ref.IDs[3] {
		t.Fatalf("after the rollback: token %d, %v; want %d", tok, ae, ref.IDs[3])
	}
	if got := lens(); got != [3]int{accepted + 1, accepted + 1, accepted + 1} {
		t.Fatalf("after the next hop the nodes hold %v tokens, want the accepted %d plus its row", got, accepted)
	}
}

// The node with the last layer verifies a well-formed verify hop (argmax
// of the fake stack: the row's token plus the layers it ran) and refuses,
// before computing, verify hops whose token ids are not one per row or
// that have more rows than wire.MaxVerifyRows (each costs a vocabulary of
// logits).
func TestVerifyHopOnTheTail(t *testing.T) {
	testenv.CheckGoroutines(t)
	tail := &Server{StackForTesting: newFakeStack(5, 5, fkLayers, fkHidden, fkVocab), PeerID: "tail", Logger: quietLogger()}
	url := startNode(t, tail)
	c := &http.Client{Timeout: 10 * time.Second}
	defer c.CloseIdleConnections()
	verify := func(session string, n int, tokens []int32) hopReq {
		sj, _ := json.Marshal(wire.Sampling{Tokens: tokens})
		return hopReq{session: session, n: n, hidden: fkHidden, dtype: native.F32, start: 5, end: -1, tokens: tokens,
			sampling: string(sj), header: map[string]string{wire.HeaderVerify: "1"}}
	}
	// rows carry 10, 11, 99: the tail (one layer) peaks at 11, 12, 100
	code, _, body := verify("v-ok", 3, []int32{10, 11, 99}).send(t, c, url)
	var rep wire.VerifyReply
	if code != 200 || json.Unmarshal(body, &rep) != nil || len(rep.Tokens) != 2 || rep.Tokens[0].Token != 11 || rep.Tokens[1].Token != 12 {
		t.Fatalf("verify hop: %d %s; want tokens 11 (the accepted draft) and 12", code, body)
	}
	for name, h := range map[string]hopReq{
		"ids not one per row": verify("v-ids", 3, []int32{10, 11}),
		"too many rows":       verify("v-rows", wire.MaxVerifyRows+1, make([]int32, wire.MaxVerifyRows+1)),
		"bad flag":            func() hopReq { h := verify("v-flag", 2, []int32{1, 2}); h.header[wire.HeaderVerify] = "yes"; return h }(),
	} {
		code, hd, body := h.send(t, c, url)
		if ae := decodeError(t, code, hd, body); code != 400 || ae.Type != "invalid_header" {
			t.Errorf("%s: %d %s, want 400 invalid_header", name, code, body)
		}
	}
	if n := tail.StackForTesting.(*fakeStack).forwards; n != 1 {
		t.Errorf("the tail ran %d forwards, want 1 (refused hops compute nothing)", n)
	}
}

// A head does not take a verify answer that rewrites its drafts (the
// caches on the route hold the drafts) or that has more tokens than rows.
func TestHeadRefusesForgedVerifyAnswers(t *testing.T) {
	testenv.CheckGoroutines(t)
	for name, answer := range map[string]string{
		"rewritten draft":   `{"tokens":[{"token":7,"logprob":0},{"token":8,"logprob":0}]}`,
		"more than rows":    `{"tokens":[{"token":2,"logprob":0},{"token":3,"logprob":0},{"token":4,"logprob":0},{"token":5,"logprob":0}]}`,
		"outside the vocab": `{"tokens":[{"token":100000,"logprob":0}]}`,
		"single token":      `{"token":3,"logprob":0}`,
	} {
		t.Run(name, func(t *testing.T) {
			forged, _ := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path != "/forward" {
					http.NotFound(w, r) // no hop frames: POST /forward
					return
				}
				io.Copy(io.Discard, r.Body)
				w.Header().Set("Content-Type", "application/json")
				io.WriteString(w, answer)
			}))
			head := &Server{StackForTesting: newFakeStack(0, 2, fkLayers, fkHidden, fkVocab), PeerID: "head", Logger: quietLogger()}
			t.Cleanup(func() { head.Close() })
			p := headPipeline(t, head, "forged", []wire.Hop{{Endpoint: forged, StartLayer: 3, EndLayer: 5}})
			_, ae := p.pass(context.Background(), 0, []int32{1, 2, 3}, 0, true)
			if ae == nil || ae.Status != http.StatusBadGateway || ae.Type != "bad_hop_response" || ae.Hop != forged {
				t.Fatalf("forged answer %s: %+v, want 502 bad_hop_response naming the hop", answer, ae)
			}
		})
	}
}

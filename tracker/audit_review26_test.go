package tracker

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"meshgpu/internal/testenv"
	"meshgpu/tracker/route"
	"meshgpu/wire"
)

// disputePair records liar and honest as disputing each other, as an
// audit that found them disagreeing with no third opinion leaves them.
func (m *auditMesh) disputePair(t *testing.T, a0, b0 string) {
	t.Helper()
	for _, p := range [][2]string{{a0, b0}, {b0, a0}} {
		if err := m.srv.Registry().SetStatus(context.Background(), NodeStatus{PeerID: m.peers[p[0]], Audit: AuditDisputed, With: m.peers[p[1]], Detail: "test"}); err != nil {
			t.Fatal(err)
		}
	}
	// The proxy sees disputes through the auditor's in-memory set, which
	// the next scan reads from the store (as another tracker's would be).
	eventually(t, "the dispute is seen", func() bool {
		a := m.srv.audit
		a.mu.Lock()
		defer a.mu.Unlock()
		return a.disputed[m.peers[a0]] != "" && a.disputed[m.peers[b0]] != ""
	})
}

// Review of issue 26, finding 6: a disputed liar behaves while every
// session through it is copied, passes its audits (the honest node is its
// referee) and starts lying once it is out of the dispute. A pass must not
// end a dispute: the liar stays disputed, its sessions stay copied, and
// once it lies every chat is the honest text or 503 audit_dispute. Before,
// the first pass made it "passed" (With cleared, copies ended) and its
// lies reached clients.
func TestDisputedLiarCannotPassItsWayOut(t *testing.T) {
	testenv.CheckGoroutines(t)
	var lying atomic.Bool
	head := &modelHead{}
	var liar string
	head.lies = func(tail, _ string, _ int) bool { return tail == liar && lying.Load() }
	m := newAuditMesh(t, AuditConfig{Rate: 1}, head, map[string]float64{"honest": 1, "liar": 1})
	liar = m.peers["liar"]
	m.disputePair(t, "liar", "honest")
	for i := range 10 {
		m.tryChat(t, fmt.Sprintf("behave %d", i), 6, nil)
	}
	deadline := time.Now().Add(10 * time.Second)
	for len(m.srv.audit.queue) > 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond) // the last audit's verdict
	if st := m.status(t, "liar"); st.Audit != AuditDisputed || st.With != m.peers["honest"] {
		t.Fatalf("the disputed liar passed its way out of the dispute: %+v", st)
	}
	lying.Store(true)
	wrong := 0
	for i := range 10 {
		prompt := fmt.Sprintf("now lie %d", i)
		ids, status, typ := m.tryChat(t, prompt, 6, nil)
		if status == 200 && !slices.Equal(ids, honestGen(prompt, nil, 6)) || status != 200 && typ != TypeAuditDispute {
			wrong++
		}
	}
	if wrong > 0 {
		t.Fatalf("%d of 10 chats after the liar started lying were wrong", wrong)
	}
}

// Review of issue 26, finding 8: an audit reads the node's status, replays
// for a while, and records its verdict. A failure recorded meanwhile (by
// another audit) must stand: before, the pass wrote back the status it had
// read, "passed", and the failed node was routed again.
func TestAuditPassDoesNotUndoAFailureMeanwhile(t *testing.T) {
	testenv.CheckGoroutines(t)
	idB := newIdentity(t)
	head := &modelHead{gate: make(chan struct{}), reached: make(chan struct{}), gateTail: idB.PeerID, gateAfter: 2}
	m := newAuditMesh(t, AuditConfig{Rate: 1e-9}, head, map[string]float64{"a": 1})
	a := m.srv.audit
	ctx := context.Background()
	nodes, statuses, err := a.view(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var na NodeRecord
	for _, n := range nodes {
		if n.PeerID == m.peers["a"] {
			na = n
		}
	}
	c, err := a.probationSession(ctx, na, nodes, statuses, nil)
	if err != nil {
		t.Fatal(err)
	}
	m.registerAs(t, idB, "b", m.hs.URL+"/b", 3, 5, 1)
	done := make(chan struct{})
	go func() { defer close(done); a.check(ctx, c) }()
	<-head.reached // the referee's replay is under way
	a.fail(ctx, m.peers["a"], "another audit failed it")
	close(head.gate)
	<-done
	if st := m.status(t, "a"); st.Audit != AuditFailed || st.Failures != 1 {
		t.Fatalf("the failure recorded during the replay was overwritten: %+v", st)
	}
}

// Review of issue 26, finding 9: a disputed node whose other disputant is
// gone served alone, uncopied (its copy needed that very node). Now every
// disputed hop is copied on any live replica that can check it, and
// refused when there is none: no chat carries the liar's text.
func TestDisputedHopWithoutItsOtherIsNotServedAlone(t *testing.T) {
	testenv.CheckGoroutines(t)
	var liar string
	head := &modelHead{}
	head.lies = func(tail, _ string, _ int) bool { return tail == liar }
	m := newAuditMesh(t, AuditConfig{Rate: 1e-9}, head, map[string]float64{"liar": 1})
	liar = m.peers["liar"]
	id := newIdentity(t)
	honest := &Client{URL: m.ts.URL, Identity: id, HTTP: m.hc}
	mustRegister(t, honest, reg(m.hs.URL+"/honest", 3, 5, 6, 1))
	m.peers["honest"] = id.PeerID
	m.disputePair(t, "liar", "honest")
	if err := honest.Deregister(context.Background()); err != nil {
		t.Fatal(err)
	}
	check := func(phase string) {
		for i := range 6 {
			prompt := fmt.Sprintf("%s %d", phase, i)
			ids, status, typ := m.tryChat(t, prompt, 6, nil)
			if status == 200 && !slices.Equal(ids, honestGen(prompt, nil, 6)) || status != 200 && typ != TypeAuditDispute {
				t.Fatalf("%s: chat %d: HTTP %d %s, ids %v: the disputed liar served alone", phase, i, status, typ, ids)
			}
		}
	}
	check("other gone")
	// Another replica of the range can check it: its copy runs there.
	m.register(t, "third", m.hs.URL+"/third", 3, 5, 1)
	check("third replica")
}

// Review of issue 26, finding 10: a dispute whose case this tracker does
// not hold (recorded by another tracker, dropped past the bound, or lost
// to an error) was never retried: both stayed disputed for good. Open
// disputes now come from the stored statuses, so a third replica settles
// it: the liar fails, the honest node does not.
func TestStoredDisputeIsRetried(t *testing.T) {
	testenv.CheckGoroutines(t)
	var liar string
	head := &modelHead{}
	head.lies = func(tail, _ string, _ int) bool { return tail == liar }
	m := newAuditMesh(t, AuditConfig{Rate: 1e-9}, head, map[string]float64{"liar": 1, "honest": 1})
	liar = m.peers["liar"]
	m.disputePair(t, "liar", "honest")
	m.register(t, "third", m.hs.URL+"/third", 3, 5, 1)
	m.waitStatus(t, "liar", AuditFailed)
	if st := m.status(t, "honest"); st.Audit == AuditFailed || st.Audit == AuditDisputed {
		t.Fatalf("honest after the third opinion: %+v", st)
	}
}

// tailCount counts the calls through tail.
func tailCount(h *modelHead, tail string) (n int) {
	for _, c := range h.snapshot() {
		if c.tail == tail {
			n++
		}
	}
	return n
}

// Review of issue 26, finding 11: a node that holds back every token and
// sends them in one burst looked instantaneous (time ran from the first
// token) and drew every session. Timed from the request's sending, its
// wait counts: it gets no more than its measured share.
func TestMeasuredSpeedCountsTheWaitBeforeABurst(t *testing.T) {
	testenv.CheckGoroutines(t)
	var burster string
	head := &modelHead{
		delay: func(tail string) time.Duration {
			if tail == burster {
				return 0
			}
			return 2 * time.Millisecond
		},
		hold: func(tail string) time.Duration {
			if tail == burster {
				return 60 * time.Millisecond
			}
			return 0
		},
	}
	m := newAuditMesh(t, AuditConfig{}, head, map[string]float64{"honest": 1})
	m.register(t, "burster", m.hs.URL+"/burster", 3, 5, 1)
	burster = m.peers["burster"]
	for i := range 6 {
		m.chat(t, fmt.Sprintf("warm up %d", i), 6, nil)
	}
	before := tailCount(head, burster)
	for i := range 24 {
		m.chat(t, fmt.Sprintf("measured %d", i), 6, nil)
	}
	if got := tailCount(head, burster) - before; got > 2 {
		t.Fatalf("the burster (measured %.3g ms/layer against %.3g) got %d of 24 sessions", m.srv.Registry().measuredMs(burster), m.srv.Registry().measuredMs(m.peers["honest"]), got)
	}
}

// Review of issue 26, finding 12: a node measured slow once was never
// routed again, so never re-measured. Exploration routes prefer the
// replicas measured slower: once it is fast, it is measured again.
func TestSlowOnceNodeIsMeasuredAgain(t *testing.T) {
	testenv.CheckGoroutines(t)
	var late string
	var slow atomic.Bool
	slow.Store(true)
	head := &modelHead{delay: func(tail string) time.Duration {
		if tail == late && slow.Load() {
			return 20 * time.Millisecond
		}
		return time.Millisecond
	}}
	m := newAuditMesh(t, AuditConfig{}, head, map[string]float64{"steady": 1})
	m.register(t, "late", m.hs.URL+"/late", 3, 5, 1)
	late = m.peers["late"]
	for i := range 10 {
		m.chat(t, fmt.Sprintf("warm up %d", i), 6, nil)
	}
	if m.srv.Registry().measuredMs(late) <= m.srv.Registry().measuredMs(m.peers["steady"]) {
		t.Fatal("the slow node was not measured slow: the test tests nothing")
	}
	slow.Store(false)
	before := tailCount(head, late)
	for i := range 40 {
		m.chat(t, fmt.Sprintf("later %d", i), 6, nil)
	}
	if tailCount(head, late) == before {
		t.Fatalf("the node measured slow once got none of 40 sessions (measured %.3g ms/layer)", m.srv.Registry().measuredMs(late))
	}
}

// Review of issue 26, finding 12: churn filled the speed map and every
// node after it stayed unmeasured, which counted as fastest (its 0.01
// hint against the others' 1): a boaster joining then drew every session.
// The least recently measured figures now make room.
func TestMeasuredSpeedsMakeRoomForNewNodes(t *testing.T) {
	testenv.CheckGoroutines(t)
	var boaster string
	head := &modelHead{delay: func(tail string) time.Duration {
		if tail == boaster {
			return 10 * time.Millisecond
		}
		return 0
	}}
	m := newAuditMesh(t, AuditConfig{}, head, nil)
	g := m.srv.Registry()
	for i := range maxMeasured {
		g.observe(route.Route{Hops: []wire.Hop{{PeerID: fmt.Sprintf("churn-%d", i), StartLayer: 0, EndLayer: 5}}}, 6, time.Millisecond)
	}
	m.register(t, "honest", m.hs.URL+"/honest", 3, 5, 1)
	m.register(t, "boaster", m.hs.URL+"/boaster", 3, 5, 0.01)
	boaster = m.peers["boaster"]
	for i := range 6 {
		m.chat(t, fmt.Sprintf("warm up %d", i), 6, nil)
	}
	before := tailCount(head, boaster)
	for i := range 24 {
		m.chat(t, fmt.Sprintf("measured %d", i), 6, nil)
	}
	if got := tailCount(head, boaster) - before; got > 2 {
		t.Fatalf("the boaster got %d of 24 sessions after churn filled the speed map (measured %v)", got, g.measuredMs(boaster))
	}
}

// Review of issue 26, finding 13 (in part): a probation session replayed
// a recent client request with the client's own seed (a replay a node can
// match against what it served) or, one time in four, one of six public
// built-in prompts. Once traffic exists it takes a recent prompt and
// always a fresh seed.
func TestProbationSessionsAreNotReplays(t *testing.T) {
	testenv.CheckGoroutines(t)
	head := &modelHead{}
	m := newAuditMesh(t, AuditConfig{Probation: true}, head, map[string]float64{"a": 1})
	m.waitStatus(t, "a", AuditUnaudited)
	for i := range 4 {
		m.chat(t, fmt.Sprintf("client %d", i), 6, map[string]any{"temperature": 0.8, "seed": 100 + i})
	}
	clients := head.snapshot()
	for i := range 4 {
		id := newIdentity(t)
		m.registerAs(t, id, fmt.Sprintf("n%d", i), m.hs.URL+fmt.Sprintf("/n%d", i), 3, 5, 1)
		m.waitStatus(t, fmt.Sprintf("n%d", i), AuditPassed)
	}
	probations := 0
	for _, c := range head.snapshot()[len(clients):] {
		if slices.Contains(probationPrompts, c.prompt) {
			t.Fatalf("a probation session with a built-in prompt after client traffic: %q", c.prompt)
		}
		for _, o := range clients {
			if o.prompt == c.prompt && c.seed != nil && o.seed != nil && *o.seed == *c.seed && c.continueIDs == nil && c.tail != o.tail {
				// a referee's replay of the probation session itself is fine;
				// a replay of the client's session is the tell
				t.Fatalf("a probation session replays client request %q with its seed %d", c.prompt, *c.seed)
			}
		}
		probations++
	}
	if probations == 0 {
		t.Fatal("no probation session ran: the test tests nothing")
	}
}

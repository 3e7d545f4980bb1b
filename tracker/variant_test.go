package tracker

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"meshgpu/internal/testenv"
	"meshgpu/openai"
	"meshgpu/tracker/route"
	"meshgpu/wire"
)

// testVariant is a well-formed variant whose fingerprint is the label's
// SHA-256.
func testVariant(label string) wire.Variant {
	sum := sha256.Sum256([]byte(label))
	return wire.Variant{Label: label, Fingerprint: hex.EncodeToString(sum[:])}
}

var (
	variantA = testVariant("bf16")
	variantB = testVariant("Q4_K_M")
)

// nodeOf registers a node of variant v and returns its peer id.
func (m *proxyMesh) nodeOf(t *testing.T, v wire.Variant, endpoint string, first, last int, ms float64) string {
	t.Helper()
	c := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: m.hc, Clock: m.clk.Now}
	r := reg(endpoint, first, last, 6, ms)
	r.Variant = v
	mustRegister(t, c, r)
	return c.Identity.PeerID
}

// checkOneVariant fails unless every hop of hops is a node of variant v.
func checkOneVariant(t *testing.T, what string, hops []wire.Hop, of map[string]wire.Variant, v wire.Variant) {
	t.Helper()
	for _, h := range hops {
		if got, ok := of[h.PeerID]; !ok || !got.Same(v) {
			t.Fatalf("%s: hop %s (%d-%d) is of variant %v in a route of %v", what, h.PeerID, h.StartLayer, h.EndLayer, got, v)
		}
	}
}

// A model with two variants whose nodes only together cover it serves
// nobody (the only chains mix weights); once each variant covers it, every
// route (GET /route and the proxy's) is of one variant, even where the
// cheapest chain would mix them, and each variant gets its share; a pinned
// ?variant= routes over that variant only.
func TestRoutesNeverMixVariants(t *testing.T) {
	testenv.CheckGoroutines(t)
	m := newProxyMesh(t, Config{})
	of := map[string]wire.Variant{}
	heads := map[string]*fakeHead{}
	headOf := map[*fakeHead]string{}
	addHead := func(v wire.Variant, first, last int, ms float64) string {
		h := &fakeHead{t: t}
		id := m.nodeOf(t, v, startHead(t, h).URL, first, last, ms)
		of[id], heads[id], headOf[h] = v, h, id
		return id
	}
	addTail := func(v wire.Variant, ms float64) string {
		id := m.nodeOf(t, v, fmt.Sprintf("http://127.0.0.1:1/tail%d", len(of)), 3, 5, ms)
		of[id] = v
		return id
	}
	// The fast head is bf16, the fast tail Q4_K_M: the cheapest chain.
	addHead(variantA, 0, 2, 0.5)
	addTail(variantB, 0.5)

	var rt route.Route
	if code := getJSON(t, m.hc, m.tracker.URL+"/route", &rt); code != 503 {
		t.Fatalf("GET /route with no variant covering the model: %d %+v, want 503", code, rt)
	}
	var am AvailabilityMap
	getJSON(t, m.hc, m.tracker.URL+"/map", &am)
	if am.Covered || len(am.Variants) != 2 || am.Variants[0].Covered || am.Variants[1].Covered || am.Layers[4].Replicas != 1 {
		t.Fatalf("map of two half variants: %+v", am)
	}
	if resp := m.post(t, "/v1/chat/completions", chatBody); resp.StatusCode != 503 {
		t.Fatalf("chat with no variant covering the model: %d, want 503", resp.StatusCode)
	}

	// Slower replicas complete both variants.
	addTail(variantA, 2)
	addHead(variantB, 0, 2, 2)
	count := map[string]int{}
	for seed := range 60 {
		var rt route.Route
		if code := getJSON(t, m.hc, fmt.Sprintf("%s/route?seed=%d", m.tracker.URL, seed), &rt); code != 200 {
			t.Fatalf("GET /route: %d", code)
		}
		checkOneVariant(t, fmt.Sprintf("seed %d", seed), rt.Hops, of, rt.Variant)
		count[rt.Variant.Label]++
	}
	if count["bf16"] == 0 || count["Q4_K_M"] == 0 {
		t.Fatalf("routes by variant %v: equal-cost variants should share", count)
	}
	for _, v := range []wire.Variant{variantA, variantB} {
		var rt route.Route
		getJSON(t, m.hc, m.tracker.URL+"/route?variant="+v.Fingerprint, &rt)
		if rt.Variant != v {
			t.Fatalf("pinned to %v: route of %v", v, rt.Variant)
		}
		checkOneVariant(t, "pinned", rt.Hops, of, v)
	}

	// The proxy: the head it calls and the route it gives are one variant,
	// and the answer names it.
	for i := range 12 {
		resp := m.post(t, "/v1/chat/completions", chatBody)
		res := readStream(t, resp.Body, true)
		if !res.done || res.errored != "" {
			t.Fatalf("chat %d: %+v", i, res)
		}
		got := wire.Variant{Label: resp.Header.Get(wire.HeaderVariantLabel), Fingerprint: resp.Header.Get(wire.HeaderVariant)}
		if got != variantA && got != variantB {
			t.Fatalf("chat %d: variant headers %+v", i, got)
		}
	}
	calls := 0
	for h, id := range headOf {
		for _, c := range h.Calls() {
			calls++
			checkOneVariant(t, "proxied route", append([]wire.Hop{{PeerID: id}}, c.route...), of, of[id])
		}
	}
	if calls != 12 {
		t.Fatalf("%d head calls for 12 chats", calls)
	}
}

// A generation that failed mid-stream resumes on its own variant, even
// when another variant is cheaper now: its tokens so far came from those
// weights. A generation that failed before its head sent anything may go
// to any variant.
func TestFailoverStaysOnTheVariant(t *testing.T) {
	testenv.CheckGoroutines(t)
	m := newProxyMesh(t, Config{TokenTimeout: 300 * time.Millisecond})
	dying := &fakeHead{t: t, fail: func(headCall) (int, string, string) { return 4, "abort", "" }}
	spareA, headB := &fakeHead{t: t}, &fakeHead{t: t}
	m.nodeOf(t, variantA, startHead(t, dying).URL, 0, 2, 0.1) // the cheapest route
	m.nodeOf(t, variantA, startHead(t, spareA).URL, 0, 2, 5)  // A's slow spare
	tailA := m.nodeOf(t, variantA, "http://127.0.0.1:1/tail", 3, 5, 0.1)
	m.nodeOf(t, variantB, startHead(t, headB).URL, 0, 2, 1) // cheaper than the spare
	m.nodeOf(t, variantB, "http://127.0.0.1:1/tailb", 3, 5, 1)

	resp := m.post(t, "/v1/chat/completions", chatBody)
	res := readStream(t, resp.Body, true)
	if !res.done || res.errored != "" || resp.Header.Get(wire.HeaderVariant) != variantA.Fingerprint {
		t.Fatalf("failover stream %+v, variant %q", res, resp.Header.Get(wire.HeaderVariant))
	}
	if n := len(headB.Calls()); n != 0 {
		t.Fatalf("the other variant's head got %d calls: the replay changed weights mid-generation", n)
	}
	c := spareA.Calls()
	if len(c) != 1 || len(c[0].continueIDs) != 4 || len(c[0].route) != 1 || c[0].route[0].PeerID != tailA {
		t.Fatalf("replay on the variant's spare: %+v", c)
	}

	// With the dying head banned (and A's tail out too: the tracker has
	// measured A's spare route fast since, measure.go), a request pinned to
	// nothing yet takes the other variant: B.
	if err := m.srv.Registry().Ban(context.Background(), tailA, time.Minute); err != nil {
		t.Fatal(err)
	}
	res = readStream(t, m.post(t, "/v1/chat/completions", chatBody).Body, true)
	if !res.done || len(headB.Calls()) != 1 {
		t.Fatalf("new request after the ban: %+v, B's head calls %d", res, len(headB.Calls()))
	}
}

// Assignment fills the coverage of the joiner's own variant: a Q4_K_M
// joiner starts at layer 0 although bf16 nodes hold it, a bf16 joiner
// takes bf16's gap; a reservation counts only for its variant; per-layer
// sizes decide how many layers fit.
func TestAssignFillsTheOwnVariant(t *testing.T) {
	m := newProxyMesh(t, Config{})
	m.nodeOf(t, variantA, "http://127.0.0.1:1/a", 0, 2, 1)
	assign := func(v wire.Variant, fp Footprint) AssignResponse {
		t.Helper()
		c := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: m.hc, Clock: m.clk.Now}
		a, err := c.Assign(context.Background(), AssignRequest{Model: "gocoder-6m", Variant: v, NumLayers: 6, MemoryBudget: 3 << 30, Footprint: fp, MsPerLayer: 1})
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
	uniform := Footprint{BytesPerLayer: 1 << 30}
	if a := assign(variantB, uniform); a.First != 0 || a.Last != 2 || a.NewlyCovered != 3 {
		t.Fatalf("Q4_K_M joiner: %+v, want 0-2 (bf16's layers are no coverage for it)", a)
	}
	if a := assign(variantA, uniform); a.First != 3 || a.Last != 5 {
		t.Fatalf("bf16 joiner: %+v, want bf16's gap 3-5 (the Q4_K_M reservation of 0-2 is not bf16's)", a)
	}
	// A file whose layers 3-5 take a quarter of a gigabyte each fits four
	// layers in the budget, where the uniform (largest) figure fits three.
	small := Footprint{BytesPerLayer: 1 << 30, HeadBytes: 1 << 30, LayerBytes: []int64{1 << 30, 1 << 30, 1 << 30, 256 << 20, 256 << 20, 256 << 20}}
	if a := assign(testVariant("Q2_K"), small); a.First != 1 || a.Last != 4 || a.NewlyCovered != 4 {
		t.Fatalf("per-layer sizes: %+v, want 1-4", a)
	}
	c := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: m.hc, Clock: m.clk.Now}
	for _, bad := range []AssignRequest{
		{Model: "gocoder-6m", NumLayers: 6, MemoryBudget: 1 << 30, Footprint: Footprint{BytesPerLayer: 1, LayerBytes: []int64{1, 2}}},
		{Model: "gocoder-6m", NumLayers: 6, MemoryBudget: 1 << 30, Footprint: uniform, Variant: wire.Variant{Fingerprint: "XYZ"}},
	} {
		var se *StatusError
		if _, err := c.Assign(context.Background(), bad); !errorsAs(err, &se) || se.Status != 400 {
			t.Errorf("assign %+v: %v, want 400", bad, err)
		}
	}
}

func (m *auditMesh) metrics(t *testing.T) string {
	t.Helper()
	resp, err := m.hc.Get(m.ts.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	return readAll(t, resp)
}

// metricValue is the value of one series in a Prometheus text body, 0
// when absent.
func metricValue(body, series string) float64 {
	for _, line := range strings.Split(body, "\n") {
		if rest, ok := strings.CutPrefix(line, series+" "); ok {
			var v float64
			fmt.Sscanf(rest, "%g", &v)
			return v
		}
	}
	return 0
}

func errorsAs(err error, se **StatusError) bool {
	if err == nil {
		return false
	}
	e, ok := err.(*StatusError)
	if ok {
		*se = e
	}
	return ok
}

// /map, /v1/models, /nodes and /api/mesh show the variants; a variant
// that does not cover the model is not served and not listed by
// /v1/models; registrations with malformed variants or layer sizes are
// refused.
func TestVariantsShown(t *testing.T) {
	m := newProxyMesh(t, Config{})
	a := m.nodeOf(t, variantA, "http://127.0.0.1:1/a", 0, 5, 1)
	b := m.nodeOf(t, variantB, "http://127.0.0.1:1/b", 0, 2, 1)
	var am AvailabilityMap
	getJSON(t, m.hc, m.tracker.URL+"/map", &am)
	if !am.Covered || len(am.Variants) != 2 {
		t.Fatalf("map: %+v", am)
	}
	for _, v := range am.Variants {
		switch v.Variant {
		case variantA:
			if !v.Covered || v.Nodes != 1 || v.Layers[5].Replicas != 1 {
				t.Errorf("bf16 in the map: %+v", v)
			}
		case variantB:
			if v.Covered || v.Nodes != 1 || v.Layers[5].Replicas != 0 || v.Layers[0].Replicas != 1 {
				t.Errorf("Q4_K_M in the map: %+v", v)
			}
		default:
			t.Errorf("unknown variant in the map: %+v", v)
		}
	}
	var list openai.ModelList
	getJSON(t, m.hc, m.tracker.URL+"/v1/models", &list)
	if len(list.Data) != 1 || list.Data[0].ID != "gocoder-6m" || list.Data[0].Meshgpu == nil ||
		len(list.Data[0].Meshgpu.Variants) != 1 || list.Data[0].Meshgpu.Variants[0] != variantA {
		t.Fatalf("/v1/models: %+v", list)
	}
	var nodes struct{ Nodes []PublicNode }
	getJSON(t, m.hc, m.tracker.URL+"/nodes", &nodes)
	var mv MeshView
	getJSON(t, m.hc, m.tracker.URL+"/api/mesh", &mv)
	want := map[string]wire.Variant{a: variantA, b: variantB}
	if len(nodes.Nodes) != 2 || len(mv.Nodes) != 2 || len(mv.Models) != 1 || len(mv.Models[0].Variants) != 2 {
		t.Fatalf("/nodes %+v, /api/mesh %+v", nodes, mv)
	}
	for i := range 2 {
		if nodes.Nodes[i].Variant != want[nodes.Nodes[i].PeerID] || mv.Nodes[i].Variant != want[mv.Nodes[i].PeerID] {
			t.Errorf("node %d: /nodes %+v, /api/mesh %+v", i, nodes.Nodes[i], mv.Nodes[i])
		}
	}

	c := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: m.hc, Clock: m.clk.Now}
	for _, mut := range []func(*Registration){
		func(r *Registration) { r.Variant = wire.Variant{Fingerprint: strings.Repeat("A", 64)} },
		func(r *Registration) { r.Variant = wire.Variant{Fingerprint: strings.Repeat("a", 63)} },
		func(r *Registration) { r.Variant = wire.Variant{Label: "<script>", Fingerprint: variantA.Fingerprint} },
		func(r *Registration) { r.LayerBytes = []int64{1, 2, 3} },
		func(r *Registration) { r.LayerBytes = []int64{1, 2, 3, 4, 5, -6} },
	} {
		r := reg("http://127.0.0.1:1/bad", 0, 5, 6, 1)
		mut(&r)
		var se *StatusError
		if _, err := c.Register(context.Background(), r); !errorsAs(err, &se) || se.Status != 400 {
			t.Errorf("registration %+v: %v, want 400", r, err)
		}
	}
}

// A node that comes back with other weights is new to its new variant's
// replicas: a pass earned on the old one is forgotten (probation again), a
// failure is not.
func TestNewVariantForgetsThePass(t *testing.T) {
	m := newProxyMesh(t, Config{})
	ctx := context.Background()
	register := func(c *Client, v wire.Variant) {
		r := reg("http://127.0.0.1:1/"+c.Identity.PeerID, 0, 5, 6, 1)
		r.Variant = v
		m.clk.Add(time.Millisecond)
		mustRegister(t, c, r)
	}
	passed := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: m.hc, Clock: m.clk.Now}
	failed := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: m.hc, Clock: m.clk.Now}
	register(passed, variantA)
	register(failed, variantA)
	reg := m.srv.Registry()
	until := m.clk.Now().Add(time.Hour)
	if err := reg.SetStatus(ctx, NodeStatus{PeerID: passed.Identity.PeerID, Audit: AuditPassed, Failures: 1}); err != nil {
		t.Fatal(err)
	}
	if err := reg.SetStatus(ctx, NodeStatus{PeerID: failed.Identity.PeerID, Audit: AuditFailed, Failures: 2, Until: until}); err != nil {
		t.Fatal(err)
	}
	register(passed, variantA) // the same weights: the pass stays
	st, _ := reg.Store().Statuses(ctx)
	if st[passed.Identity.PeerID].Audit != AuditPassed {
		t.Fatalf("same variant again: %+v", st[passed.Identity.PeerID])
	}
	register(passed, variantB)
	register(failed, variantB)
	st, _ = reg.Store().Statuses(ctx)
	if s := st[passed.Identity.PeerID]; s.Audit != "" || s.Failures != 1 {
		t.Errorf("pass after a variant change: %+v, want forgotten (failures kept)", s)
	}
	if s := st[failed.Identity.PeerID]; s.Audit != AuditFailed || s.Failures != 2 {
		t.Errorf("failure after a variant change: %+v, want kept", s)
	}

	// A pass names the variant it was earned on: a node whose record
	// expired and that comes back with other weights is new all the same.
	gone := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: m.hc, Clock: m.clk.Now}
	if err := reg.SetStatus(ctx, NodeStatus{PeerID: gone.Identity.PeerID, Audit: AuditPassed, Fingerprint: variantA.Fingerprint}); err != nil {
		t.Fatal(err)
	}
	register(gone, variantB) // no live record of it: only the status knows
	st, _ = reg.Store().Statuses(ctx)
	if s := st[gone.Identity.PeerID]; s.Audit != "" {
		t.Errorf("a pass on variant A kept by a fresh registration of variant B: %+v", s)
	}
}

// Audits compare only nodes of one variant. Two variants of one model
// whose numbers differ (the fake model's Q4_K_M tails compute other
// logits than its bf16 ones, as real quantizations do): new nodes alone in
// their variant serve unaudited instead of being compared with the other
// variant (which would dispute or fail honest nodes), a second node of a
// variant is audited against the first and passes, and sampled audits of
// real traffic replay only on routes of the audited route's variant.
func TestAuditsCompareOnlyOneVariant(t *testing.T) {
	testenv.CheckGoroutines(t)
	head := &modelHead{}
	inB := map[string]bool{}
	head.lies = func(tail, _ string, _ int) bool { return inB[tail] }
	m := &auditMesh{head: head, hc: httpClient(t), peers: map[string]string{}}
	m.hs = httptest.NewServer(head)
	t.Cleanup(m.hs.Close)
	m.srv, m.ts = startTracker(t, Config{Audit: AuditConfig{Probation: true, Rate: 1, Interval: 20 * time.Millisecond}})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); m.srv.RunAudits(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	of := map[string]wire.Variant{}
	add := func(name string, v wire.Variant, first, last int) {
		t.Helper()
		id := newIdentity(t)
		c := &Client{URL: m.ts.URL, Identity: id, HTTP: m.hc}
		r := reg(m.hs.URL+"/"+name, first, last, 6, 1)
		r.Variant = v
		mustRegister(t, c, r)
		m.peers[name], of[id.PeerID] = id.PeerID, v
		if v == variantB && first > 0 {
			inB[id.PeerID] = true
		}
	}
	add("headA", variantA, 0, 2)
	add("tailA", variantA, 3, 5)
	add("headB", variantB, 0, 2)
	add("tailB", variantB, 3, 5)
	for _, name := range []string{"headA", "tailA", "headB", "tailB"} {
		m.waitStatus(t, name, AuditUnaudited)
	}
	add("tailA2", variantA, 3, 5)
	add("tailB2", variantB, 3, 5)
	// Each tail passes against its own variant's other tail.
	for _, name := range []string{"tailA", "tailA2", "tailB", "tailB2"} {
		m.waitStatus(t, name, AuditPassed)
	}
	for i := range 8 {
		m.chat(t, fmt.Sprintf("prompt %d", i), 6, nil)
	}
	// The sampled audits (rate 1) run after their sessions: wait for each
	// queued one's result (the four probations gave one each).
	deadline := time.Now().Add(10 * time.Second)
	for {
		metrics := m.metrics(t)
		var results float64
		for _, r := range []string{"passed", "failed", "disputed", "inconclusive", "skipped"} {
			results += metricValue(metrics, fmt.Sprintf(`meshgpu_tracker_audits_total{result=%q}`, r))
		}
		if results >= metricValue(metrics, "meshgpu_tracker_audits_queued_total")+4 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("sampled audits did not finish:\n%s", metrics)
		}
		time.Sleep(20 * time.Millisecond)
	}
	for name := range m.peers {
		if st := m.status(t, name); st.Audit == AuditFailed || st.Audit == AuditDisputed || st.Audit == AuditProbation {
			t.Errorf("%s: %s (%s)", name, st.Audit, st.Detail)
		}
	}
	replays := 0
	for _, c := range head.snapshot() {
		name := strings.Trim(strings.TrimSuffix(c.path, "/v1/chat/completions"), "/")
		v, ok := of[m.peers[name]]
		if !ok {
			t.Fatalf("a call to %q", c.path)
		}
		checkOneVariant(t, "call to "+name, c.route, of, v)
		if c.top > 0 {
			replays++
		}
	}
	if replays == 0 {
		t.Fatal("no audit replayed anything: the test checks nothing")
	}
}

package tracker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"meshgpu/internal/testenv"
	"meshgpu/openai"
	"meshgpu/wire"
)

// clientFrom is an HTTP client whose connections come from ip (127.0.0.N,
// testenv.DialerFrom): another source address for the tracker's
// per-source limits.
func clientFrom(t *testing.T, ip string) *http.Client {
	tr := &http.Transport{DialContext: testenv.DialerFrom(t, ip).DialContext}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 10 * time.Second}
}

// countingServer answers every request with 500 naming no hop and counts
// them: a squatter's endpoint, which should get no traffic.
func countingServer(t *testing.T) (*httptest.Server, *atomic.Int64) {
	var n atomic.Int64
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.Add(1)
		wire.WriteError(w, errf(500, "server_error", "squatter"))
	}))
	t.Cleanup(ts.Close)
	return ts, &n
}

// chatWorks streams one chat through the tracker and checks it is the
// fake head's script.
func chatWorks(t *testing.T, m *proxyMesh, want streamResult) {
	t.Helper()
	got := readStream(t, m.post(t, "/v1/chat/completions", chatBody).Body, true)
	if got.text != want.text || !got.done || got.errored != "" {
		t.Fatalf("chat through the tracker: %+v, want the honest text %q", got, want.text)
	}
}

// The attack: right after a tracker restart, a registration of
// gocoder-6m with 7 layers comes before the honest nodes (6 layers). It
// used to hold: every honest node got 409 "model gocoder-6m has 7 layers"
// and the model was unserved while the squatter heartbeated. Now the
// honest nodes are admitted and routed, and the squatter gives way: with
// the honest nodes' own fingerprint (a claim anyone can copy), to the
// count that more sources, nodes or proven (audited) nodes hold; with
// another variant, it is a variant of its own that locks nothing.
func TestSquattedModelShapeDoesNotLockOutHonestNodes(t *testing.T) {
	testenv.CheckGoroutines(t)
	want := reference(t, "/v1/chat/completions", chatBody, true)
	honestVariant := testVariant("bf16")
	for _, tc := range []struct {
		name     string
		variant  wire.Variant
		sybils   int  // squatter nodes, each from its own address
		proven   bool // the honest head passed an audit
		givesWay bool // the squatter is left out of routes
	}{
		{"same fingerprint, one squatter", honestVariant, 1, false, true},
		{"same fingerprint, three squatters from three addresses against a proven head", honestVariant, 3, true, true},
		{"a variant of its own", wire.Variant{}, 1, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := newProxyMesh(t, Config{Limits: Limits{}.withDefaults()})
			squatter, hits := countingServer(t)
			var squatters []string
			for i := range tc.sybils {
				ip := fmt.Sprintf("127.0.0.%d", 2+i)
				c := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: clientFrom(t, ip), Clock: m.clk.Now}
				r := reg(strings.Replace(squatter.URL, "127.0.0.1", ip, 1), 0, 6, 7, 0.01) // cheaper than anyone
				r.Variant = tc.variant
				mustRegister(t, c, r)
				squatters = append(squatters, c.Identity.PeerID)
			}
			m.clk.Add(time.Second) // the honest nodes come later
			var honest []string
			for _, layers := range [][2]int{{0, 2}, {3, 5}} {
				c := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: m.hc, Clock: m.clk.Now}
				r := reg(startHead(t, &fakeHead{t: t}).URL, layers[0], layers[1], 6, 1)
				r.Variant = honestVariant
				if _, err := c.Register(context.Background(), r); err != nil {
					t.Fatalf("an honest node after the squatter: %v, want it admitted", err)
				}
				honest = append(honest, c.Identity.PeerID)
			}
			ctx := context.Background()
			if tc.proven {
				if err := m.srv.Registry().SetStatus(ctx, NodeStatus{PeerID: honest[0], Audit: AuditPassed, Fingerprint: honestVariant.Fingerprint}); err != nil {
					t.Fatal(err)
				}
			}
			for _, id := range honest {
				if ok, why, err := m.srv.Registry().Routable(ctx, id); err != nil || !ok {
					t.Fatalf("honest node %s: routable %v (%s, %v)", id, ok, why, err)
				}
			}
			for _, id := range squatters {
				ok, why, _ := m.srv.Registry().Routable(ctx, id)
				if tc.givesWay && (ok || !strings.Contains(why, "with 6 layers, not 7")) {
					t.Fatalf("squatter %s: routable %v (%q), want it giving way to 6 layers", id, ok, why)
				}
			}
			for range 3 {
				chatWorks(t, m, want)
			}
			var list openai.ModelList
			if getJSON(t, m.hc, m.tracker.URL+"/v1/models", &list); len(list.Data) != 1 || list.Data[0].ID != "gocoder-6m" {
				t.Fatalf("/v1/models: %+v", list)
			}
			if tc.givesWay && hits.Load() != 0 {
				t.Fatalf("the squatter's endpoint got %d requests; a shape that gives way is not routed", hits.Load())
			}
		})
	}
}

// The attack: right after a tracker restart one squatter, from one
// address, registers the honest fingerprint with 7 layers before the one
// honest node of 6. Proven nodes, addresses and nodes tie (none, one,
// one), and the earliest registration used to decide: the squatter was
// routed and the honest node gave way, for good with audits off. The
// tracker cannot tell which side lies, so a tie routes neither and says
// so; the first side that gets ahead (here the honest node passes an
// audit) is routed, and the squatter never gets a request.
func TestShapeTieRoutesNeitherSide(t *testing.T) {
	testenv.CheckGoroutines(t)
	want := reference(t, "/v1/chat/completions", chatBody, true)
	m := newProxyMesh(t, Config{Limits: Limits{}.withDefaults()})
	squatter, hits := countingServer(t)
	const ip = "127.0.0.2"
	sc := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: clientFrom(t, ip), Clock: m.clk.Now}
	r := reg(strings.Replace(squatter.URL, "127.0.0.1", ip, 1), 0, 6, 7, 0.01)
	r.Variant = testVariant("bf16")
	mustRegister(t, sc, r)
	m.clk.Add(time.Second) // the honest node comes later
	hc := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: m.hc, Clock: m.clk.Now}
	r = reg(startHead(t, &fakeHead{t: t}).URL, 0, 5, 6, 1)
	r.Variant = testVariant("bf16")
	mustRegister(t, hc, r)
	ctx := context.Background()
	for _, id := range []string{sc.Identity.PeerID, hc.Identity.PeerID} {
		if ok, why, err := m.srv.Registry().Routable(ctx, id); err != nil || ok || !strings.Contains(why, "neither is routed") {
			t.Fatalf("node %s of a tied layer count: routable %v (%q, %v), want neither side routed", id, ok, why, err)
		}
	}
	resp := m.post(t, "/v1/chat/completions", chatBody)
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 503 || !strings.Contains(string(body), "disagree on its layer count") {
		t.Fatalf("chat while the layer count ties: HTTP %d %s, want 503 saying why", resp.StatusCode, body)
	}
	if err := m.srv.Registry().SetStatus(ctx, NodeStatus{PeerID: hc.Identity.PeerID, Audit: AuditPassed, Fingerprint: r.Variant.Fingerprint}); err != nil {
		t.Fatal(err)
	}
	chatWorks(t, m, want)
	if ok, why, _ := m.srv.Registry().Routable(ctx, sc.Identity.PeerID); ok || !strings.Contains(why, "with 6 layers, not 7") {
		t.Fatalf("squatter once the honest node is proven: routable %v (%q), want it giving way to 6 layers", ok, why)
	}
	if hits.Load() != 0 {
		t.Fatalf("the squatter's endpoint got %d requests", hits.Load())
	}
}

// The attack: 300 registrations from 127.0.0.2-11, each a model of its
// own with 1024 layers, kept alive by heartbeats, once made /metrics
// 307,208 series (19.5 MB), /api/mesh 39 MB and /v1/models list 300
// attacker models. The caps per source and per tracker refuse most of
// them (429 / 503), and the honest model keeps serving.
func TestRegistrationFloodStaysBounded(t *testing.T) {
	testenv.CheckGoroutines(t)
	want := reference(t, "/v1/chat/completions", chatBody, true)
	m := newProxyMesh(t, Config{Limits: Limits{}.withDefaults()})
	m.node(t, startHead(t, &fakeHead{t: t}).URL, 0, 5, 1)
	accepted, refused := 0, map[int]int{}
	var flood []*Client
	for i := range 300 {
		ip := fmt.Sprintf("127.0.0.%d", 2+i%10)
		c := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: clientFrom(t, ip), Clock: m.clk.Now}
		r := reg(fmt.Sprintf("http://%s:%d", ip, 20000+i), 0, MaxLayers-1, MaxLayers, 1)
		r.Model = fmt.Sprintf("flood-%03d", i)
		_, err := c.Register(context.Background(), r)
		if err == nil {
			accepted++
			flood = append(flood, c)
			continue
		}
		refused[statusOf(err)]++
	}
	if accepted > 10*DefaultMaxModelsPerSource || refused[429]+refused[503] != 300-accepted {
		t.Fatalf("flood: %d accepted, refused by status %v; want at most %d accepted, the rest 429 or 503", accepted, refused, 10*DefaultMaxModelsPerSource)
	}
	for _, c := range flood { // heartbeats keep them alive
		if _, err := c.Heartbeat(context.Background(), Heartbeat{}); err != nil {
			t.Fatal(err)
		}
	}
	for _, path := range []string{"/metrics", "/api/mesh", "/v1/models"} {
		resp, err := m.hc.Get(m.tracker.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		n, _ := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || n > 2<<20 {
			t.Fatalf("GET %s after the flood: %d, %d bytes; want 200 under 2 MB", path, resp.StatusCode, n)
		}
		t.Logf("GET %s: %d bytes", path, n)
	}
	var list openai.ModelList
	if getJSON(t, m.hc, m.tracker.URL+"/v1/models", &list); len(list.Data) > DefaultMaxModels {
		t.Fatalf("/v1/models lists %d models, more than the cap %d", len(list.Data), DefaultMaxModels)
	}
	chatWorks(t, m, want)
	// Paging: the page's view of the nodes comes in bounded pages.
	var page MeshView
	getJSON(t, m.hc, m.tracker.URL+"/api/mesh?limit=5", &page)
	if len(page.Nodes) != 5 || page.NodesTotal != accepted+1 || page.NextOffset != 5 {
		t.Fatalf("/api/mesh?limit=5: %d nodes of %d, next %d; want 5 of %d, next 5", len(page.Nodes), page.NodesTotal, page.NextOffset, accepted+1)
	}
	if st := getJSON(t, m.hc, m.tracker.URL+"/api/mesh?limit=100000", nil); st != 400 {
		t.Fatalf("/api/mesh?limit=100000: %d, want 400", st)
	}
}

// The attack: one address registers 8 nodes of one model name, each with
// a fingerprint of its own and 1024 layers. Model names were capped per
// source, variants not, so the 8192 layers filled --max-tracker-layers
// and every new model (or new variant of a served one) got 503. The
// source's variants are bounded by their layers: past 1024 of them it
// gets 429, and a new model from another address registers and serves.
func TestOneAddressCannotFillTheTrackersLayers(t *testing.T) {
	testenv.CheckGoroutines(t)
	want := reference(t, "/v1/chat/completions", chatBody, true)
	m := newProxyMesh(t, Config{Limits: Limits{}.withDefaults()})
	const ip = "127.0.0.2"
	hc := clientFrom(t, ip)
	admitted := 0
	for i := range DefaultMaxTrackerLayers / MaxLayers {
		c := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: hc, Clock: m.clk.Now}
		r := reg(fmt.Sprintf("http://%s:%d", ip, 21000+i), 0, MaxLayers-1, MaxLayers, 1)
		r.Model, r.Variant = "squat", testVariant(fmt.Sprintf("v%d", i))
		_, err := c.Register(context.Background(), r)
		switch st := statusOf(err); {
		case err == nil:
			admitted++
		case st != 429:
			t.Fatalf("variant %d from one address: %v, want 429 (over its share)", i, err)
		}
	}
	if admitted != 1 {
		t.Fatalf("one address registered %d variants of %d layers; want 1 (--max-layers-per-source %d)", admitted, MaxLayers, DefaultMaxLayersPerSource)
	}
	c := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: m.hc, Clock: m.clk.Now}
	if _, err := c.Register(context.Background(), reg(startHead(t, &fakeHead{t: t}).URL, 0, 5, 6, 1)); err != nil {
		t.Fatalf("a new model from another address after the flood: %v, want it admitted", err)
	}
	chatWorks(t, m, want)
}

// Heartbeat figures of 1e308 (an infinite route cost), negative or past
// their bounds are refused with 400 naming the field, and change nothing.
func TestHeartbeatFiguresAreBounded(t *testing.T) {
	testenv.CheckGoroutines(t)
	m := newProxyMesh(t, Config{})
	h := startHead(t, &fakeHead{t: t})
	c := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: m.hc, Clock: m.clk.Now}
	mustRegister(t, c, reg(h.URL, 0, 5, 6, 1))
	before, _ := m.srv.Registry().Nodes(context.Background())
	for _, tc := range []struct {
		field string
		hb    Heartbeat
	}{
		{"stats.rpm1", Heartbeat{Stats: NodeStats{RPM1: 1e308}}},
		{"stats.tokens_per_sec", Heartbeat{Stats: NodeStats{TokensPerSec: 1e308}}},
		{"stats.hop_p99_ms", Heartbeat{Stats: NodeStats{HopP99Ms: -1}}},
		{"stats.sessions", Heartbeat{Stats: NodeStats{Sessions: 1 << 40}}},
		{"ms_per_layer", Heartbeat{MsPerLayer: 1e308}},
		{"free_memory", Heartbeat{FreeMemory: 1 << 62}},
	} {
		_, err := c.Heartbeat(context.Background(), tc.hb)
		var se *StatusError
		if !errors.As(err, &se) || se.Status != 400 || !strings.Contains(se.Message, tc.field) {
			t.Fatalf("heartbeat with %s out of range: %v, want 400 naming it", tc.field, err)
		}
	}
	after, _ := m.srv.Registry().Nodes(context.Background())
	if fmt.Sprint(before[0].Stats, before[0].MsPerLayer, before[0].FreeMemory) != fmt.Sprint(after[0].Stats, after[0].MsPerLayer, after[0].FreeMemory) {
		t.Fatalf("refused heartbeats changed the record: %+v -> %+v", before[0], after[0])
	}
	if _, err := c.Heartbeat(context.Background(), Heartbeat{Stats: NodeStats{RPM1: 60, TokensPerSec: 20}}); err != nil {
		t.Fatalf("an ordinary heartbeat: %v", err)
	}
	if _, err := m.srv.Registry().Route(context.Background(), "gocoder-6m", 0); err != nil {
		t.Fatalf("route after the refused heartbeats: %v", err)
	}
}

package tracker

import (
	"context"
	"io"
	"strings"
	"testing"
	"time"

	"meshgpu/internal/metricstest"
	"meshgpu/internal/testenv"
	"meshgpu/openai"
	"meshgpu/wire"
)

// The tracker lists and serves only models whose every layer is covered;
// an unknown model is 404 model_not_found as on a head; the coverage
// gauges follow the registrations; /metrics is promlint-clean.
func TestOnlyCoveredModelsAreServed(t *testing.T) {
	testenv.CheckGoroutines(t)
	m := newProxyMesh(t, Config{})
	h := startHead(t, &fakeHead{t: t})
	m.node(t, h.URL, 0, 2, 1)
	var list openai.ModelList
	var health struct{ Models []string }
	if getJSON(t, m.hc, m.tracker.URL+"/v1/models", &list); len(list.Data) != 0 {
		t.Errorf("/v1/models lists an uncovered model: %+v", list)
	}
	if getJSON(t, m.hc, m.tracker.URL+"/health", &health); len(health.Models) != 0 {
		t.Errorf("/health lists an uncovered model: %+v", health)
	}
	fams := metricstest.Scrape(t, m.hc, m.tracker.URL+"/metrics")
	if v, _ := metricstest.Value(fams, "meshgpu_tracker_model_layers_covered", "model=gocoder-6m"); v != 3 {
		t.Errorf("layers covered %v, want 3", v)
	}
	if v, ok := metricstest.Value(fams, "meshgpu_tracker_model_covered", "model=gocoder-6m"); !ok || v != 0 {
		t.Errorf("covered %v (present %v), want 0", v, ok)
	}
	for _, tc := range []struct {
		path, body string
		status     int
		code       string
	}{
		{"/v1/chat/completions", `{"model":"gocoder-6m","messages":[{"role":"user","content":"x"}]}`, 503, ""},
		{"/v1/chat/completions", `{"model":"gpt-4o","messages":[{"role":"user","content":"x"}]}`, 404, "model_not_found"},
	} {
		resp := m.post(t, tc.path, tc.body)
		b, _ := io.ReadAll(resp.Body)
		e, ok := wire.DecodeError(resp.StatusCode, b)
		if resp.StatusCode != tc.status || !ok || e.Code != tc.code {
			t.Errorf("%s: %d %s, want %d code %q", tc.body, resp.StatusCode, b, tc.status, tc.code)
		}
	}
	if st := getJSON(t, m.hc, m.tracker.URL+"/v1/models/gocoder-6m", nil); st != 503 {
		t.Errorf("GET /v1/models/gocoder-6m while uncovered: %d", st)
	}

	m.node(t, startHead(t, &fakeHead{t: t}).URL, 3, 5, 1) // one endpoint, one peer
	if getJSON(t, m.hc, m.tracker.URL+"/v1/models", &list); len(list.Data) != 1 || list.Data[0].ID != "gocoder-6m" || list.Data[0].Created != m.clk.Now().Unix() || list.Data[0].Object != "model" {
		t.Errorf("/v1/models once covered: %+v", list)
	}
	var one openai.Model
	if st := getJSON(t, m.hc, m.tracker.URL+"/v1/models/gocoder-6m", &one); st != 200 || one.ID != "gocoder-6m" || one.Created == 0 {
		t.Errorf("GET /v1/models/gocoder-6m: %d %+v", st, one)
	}
	if st := getJSON(t, m.hc, m.tracker.URL+"/v1/models/other", nil); st != 404 {
		t.Errorf("GET /v1/models/other: %d", st)
	}
	fams = metricstest.Scrape(t, m.hc, m.tracker.URL+"/metrics")
	if v, _ := metricstest.Value(fams, "meshgpu_tracker_model_layers_covered", "model=gocoder-6m"); v != 6 {
		t.Errorf("layers covered %v, want 6", v)
	}
	if v, _ := metricstest.Value(fams, "meshgpu_tracker_layer_replicas", "model=gocoder-6m", "layer=4"); v != 1 {
		t.Errorf("replicas of layer 4: %v", v)
	}
	for _, name := range []string{"meshgpu_build_info", "go_goroutines", "process_cpu_seconds_total"} {
		if _, ok := metricstest.Value(fams, name); !ok {
			t.Errorf("no %s", name)
		}
	}
}

// A banned node that registers again (a restart with the same key) is
// routed again at once, not after the ban.
func TestReRegistrationClearsTheBan(t *testing.T) {
	testenv.CheckGoroutines(t)
	m := newProxyMesh(t, Config{})
	c := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: m.hc, Clock: m.clk.Now}
	mustRegister(t, c, reg("http://127.0.0.1:9", 0, 5, 6, 1))
	m.srv.Registry().Ban(context.Background(), c.Identity.PeerID, time.Hour)
	if _, err := m.srv.Registry().Route(context.Background(), "gocoder-6m", 1); err == nil {
		t.Fatal("routed through a banned node")
	}
	m.clk.Add(time.Second)
	mustRegister(t, c, reg("http://127.0.0.1:9", 0, 5, 6, 1))
	r, err := m.srv.Registry().Route(context.Background(), "gocoder-6m", 1)
	if err != nil || len(r.Hops) != 1 || r.Hops[0].PeerID != c.Identity.PeerID {
		t.Fatalf("after re-registering: %+v %v", r, err)
	}
	// A replayed registration (an attacker resending the old body) proves
	// nothing and leaves a ban in place.
	m.srv.Registry().Ban(context.Background(), c.Identity.PeerID, time.Hour)
	body, _ := Sign(c.Identity, KindRegister, m.clk.Now(), ptr(reg("http://127.0.0.1:9", 0, 5, 6, 1)))
	if _, err := m.srv.Registry().Register(context.Background(), body); err == nil {
		t.Fatal("a registration with an old timestamp was accepted")
	}
	if _, err := m.srv.Registry().Route(context.Background(), "gocoder-6m", 1); err == nil || !strings.Contains(err.Error(), "banned") {
		t.Fatalf("a replayed registration cleared the ban: %v", err)
	}
}

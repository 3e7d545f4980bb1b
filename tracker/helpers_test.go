package tracker

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"meshgpu/identity"
)

// clock is a settable clock shared by tracker and clients.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func newClock() *clock { return &clock{t: time.Unix(1_800_000_000, 0)} }

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// startTracker runs a tracker on 127.0.0.1 and closes it with the test.
// Its nodes are fakes at loopback addresses: the address policy admits
// loopback, the identity challenge is off and the registration limits are
// out of the way (admission_test.go tests them with startStrictTracker),
// and so are the per-source caps (every test node registers from
// 127.0.0.1) unless cfg.Limits sets any (limits_test.go).
func startTracker(t *testing.T, cfg Config) (*Server, *httptest.Server) {
	t.Helper()
	cfg.Endpoints.AllowLoopback, cfg.SkipEndpointCheck = true, true
	if cfg.RegisterPerIP == 0 {
		cfg.RegisterPerIP, cfg.RegisterIPBurst, cfg.RegisterPerKey, cfg.RegisterKeyBurst = 1e9, 1e9, 1e9, 1e9
	}
	if cfg.Limits == (Limits{}) {
		cfg.Limits.MaxNodesPerSource, cfg.Limits.MaxModelsPerSource, cfg.Limits.MaxLayersPerSource = 1e6, 1e6, 1e6
	}
	return startStrictTracker(t, cfg)
}

// startStrictTracker runs a tracker with cfg as given.
func startStrictTracker(t *testing.T, cfg Config) (*Server, *httptest.Server) {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = quietLogger()
	}
	s := NewServer(cfg)
	ts := httptest.NewServer(s.Handler())
	t.Cleanup(func() {
		ts.Close()
		if tr, ok := http.DefaultTransport.(*http.Transport); ok {
			tr.CloseIdleConnections()
		}
	})
	return s, ts
}

func newIdentity(t testing.TB) *identity.Identity {
	t.Helper()
	id, err := identity.New()
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// httpClient has no idle pool left behind after the test.
func httpClient(t *testing.T) *http.Client {
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 10 * time.Second}
}

func getJSON(t *testing.T, hc *http.Client, url string, out any) int {
	t.Helper()
	resp, err := hc.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if out != nil {
		if err := json.Unmarshal(b, out); err != nil {
			t.Fatalf("GET %s: %v in %s", url, err, b)
		}
	}
	return resp.StatusCode
}

func reg(endpoint string, first, last, numLayers int, ms float64) Registration {
	return Registration{
		Endpoint: endpoint, Model: "gocoder-6m", NumLayers: numLayers, Layers: [2]int{first, last},
		Backend: "cpu", MemoryBudget: 8 << 30, FreeMemory: 8 << 30, MsPerLayer: ms,
		Footprint: Footprint{BytesPerLayer: 1 << 30},
	}
}

func mustRegister(t *testing.T, c *Client, r Registration) {
	t.Helper()
	if _, err := c.Register(context.Background(), r); err != nil {
		t.Fatalf("register %s: %v", fmt.Sprint(r.Layers), err)
	}
}

func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

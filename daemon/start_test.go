package daemon

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/native"
	"meshgpu/relay"
	"meshgpu/tracker"
)

// Start refuses what cannot work with an error that says why, promptly,
// and leaves nothing running.
func TestStartRefusesBadConfig(t *testing.T) {
	dir := testenv.GoCoder(t)
	testenv.CheckGoroutines(t)
	be, err := native.Open("cpu", native.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	id, err := identity.LoadOrCreate(filepath.Join(t.TempDir(), "k"))
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	rs := &relay.Server{JoinToken: "secret", Logger: log}
	hs := httptest.NewServer(rs.Handler())
	defer func() { rs.Close(); hs.Close() }()
	relayURL := "ws://" + strings.TrimPrefix(hs.URL, "http://")

	trs := tracker.NewServer(tracker.Config{JoinToken: "secret", Endpoints: tracker.AddrPolicy{AllowLoopback: true}, Logger: log})
	tr := httptest.NewServer(trs.Handler())
	defer tr.Close()

	base := Config{ModelDir: dir, Backend: be, Identity: id, Last: -1, Logger: log}
	for _, tc := range []struct {
		edit func(*Config)
		want string
	}{
		{func(c *Config) { c.Auto = true }, "tracker"},
		{func(c *Config) { c.NoListen = true }, "relay"},
		{func(c *Config) { c.RelayMode = "pigeon" }, "relay mode"},
		{func(c *Config) { c.First, c.Last = 4, 9 }, "layers 4-9"},
		{func(c *Config) { c.TrackerURL = "ftp://x" }, "tracker URL"},
		{func(c *Config) { c.RelayURL, c.RelayJoinToken, c.NoListen = relayURL, "wrong", true }, "relay"},
		{func(c *Config) { c.TrackerURL, c.TrackerJoinToken = tr.URL, "wrong" }, "join_token is missing or wrong"},
		{func(c *Config) { c.Auto, c.TrackerURL = true, "http://127.0.0.1:1" }, "asking the tracker"},
	} {
		c := base
		tc.edit(&c)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		start := time.Now()
		n, err := Start(ctx, c)
		cancel()
		if err == nil {
			n.Close()
			t.Errorf("%+v: started", c)
			continue
		}
		t.Logf("%s", err)
		if !strings.Contains(err.Error(), tc.want) || time.Since(start) > 5*time.Second {
			t.Errorf("error %q after %v; want it to name %q, promptly", err, time.Since(start), tc.want)
		}
	}
}

// A node whose tracker is not up yet starts anyway and registers once the
// tracker appears.
func TestStartBeforeTracker(t *testing.T) {
	dir := testenv.GoCoder(t)
	testenv.CheckGoroutines(t)
	be, err := native.Open("cpu", native.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	id, err := identity.LoadOrCreate(filepath.Join(t.TempDir(), "k"))
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	trackerURL := "http://" + ln.Addr().String()
	ln.Close() // nobody listens there yet
	n, err := Start(context.Background(), Config{ModelDir: dir, Backend: be, Identity: id, Last: -1, Logger: log,
		TrackerURL: trackerURL, HeartbeatInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	trs := tracker.NewServer(tracker.Config{Endpoints: tracker.AddrPolicy{AllowLoopback: true}, Logger: log})
	ln, err = net.Listen("tcp", strings.TrimPrefix(trackerURL, "http://"))
	if err != nil {
		t.Skipf("port taken meanwhile: %v", err)
	}
	hs := &http.Server{Handler: trs.Handler()}
	go hs.Serve(ln)
	defer hs.Close()
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		nodes, _ := trs.Registry().Nodes(context.Background())
		if len(nodes) == 1 && nodes[0].PeerID == id.PeerID && nodes[0].Endpoint == n.HopEndpoint() {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the node never registered with the late tracker")
		}
	}
}

// A node whose registration (and, with --auto, assignment) the tracker
// refuses with 409 does not exit: a squatter's registration of the model
// with another layer count used to make a freshly started `meshgpu run`
// exit on "409 model gocoder-6m has 7 layers". It starts, logs why it
// waits, and registers once the tracker stops refusing.
func TestStartRetriesAfterConflict(t *testing.T) {
	dir := testenv.GoCoder(t)
	testenv.CheckGoroutines(t)
	be, err := native.Open("cpu", native.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	var logs syncBuffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	trs := tracker.NewServer(tracker.Config{Endpoints: tracker.AddrPolicy{AllowLoopback: true}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	var refused atomic.Int64
	// The first two registrations and assignments get the 409 a tracker
	// gave while a squatter held the model's layer count.
	var calls sync.Map
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == "POST" && (r.URL.Path == "/register" || r.URL.Path == "/assign") {
			v, _ := calls.LoadOrStore(r.URL.Path, new(atomic.Int64))
			if v.(*atomic.Int64).Add(1) <= 2 {
				refused.Add(1)
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(409)
				io.WriteString(w, `{"error":{"message":"model gocoder-6m has 7 layers according to mg-squatter, not 6","type":"conflict_error"}}`)
				return
			}
		}
		trs.Handler().ServeHTTP(w, r)
	}))
	defer front.Close()
	for _, auto := range []bool{false, true} {
		id, err := identity.LoadOrCreate(filepath.Join(t.TempDir(), "k"))
		if err != nil {
			t.Fatal(err)
		}
		calls.Clear()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		n, err := Start(ctx, Config{ModelDir: dir, Backend: be, Identity: id, Last: -1, Logger: log, Auto: auto,
			TrackerURL: front.URL, HeartbeatInterval: 50 * time.Millisecond})
		cancel()
		if err != nil {
			t.Fatalf("auto %v: Start after a 409: %v, want it to keep retrying", auto, err)
		}
		for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			if _, ok, _ := trs.Registry().Store().Get(context.Background(), id.PeerID); ok {
				break
			}
			if time.Now().After(deadline) {
				n.Close()
				t.Fatalf("auto %v: the node never registered after the 409s", auto)
			}
		}
		n.Close()
	}
	if refused.Load() != 6 || !strings.Contains(logs.String(), "refuses this registration for now (conflict)") ||
		!strings.Contains(logs.String(), "refuses to assign layers for now") {
		t.Fatalf("%d refusals; log:\n%s", refused.Load(), logs.String())
	}
}

// syncBuffer is a bytes.Buffer safe for the node's goroutines to log into.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

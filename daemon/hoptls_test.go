package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"testing"

	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/native"
	"meshgpu/tracker"
)

// A node serving pinned hop TLS registers an https:// endpoint, so no peer
// given its route falls back to plain hops (node.TestHopTLSCannotBeDowngraded),
// and the tracker reaches it pinned to its peer id: its identity challenge
// and a proxied completion go over TLS. An attacker between the node and
// the tracker rewriting the endpoint to http:// breaks the registration's
// signature: the registration is refused, nothing is stored.
func TestNodeRegistersPinnedHTTPSEndpoint(t *testing.T) {
	dir := testenv.GoCoder(t)
	testenv.CheckGoroutines(t)
	be, err := native.Open("cpu", native.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	trs := tracker.NewServer(tracker.Config{Endpoints: tracker.AddrPolicy{AllowLoopback: true}, Logger: log})
	ts := httptest.NewServer(trs.Handler())
	defer ts.Close()

	id, err := identity.New()
	if err != nil {
		t.Fatal(err)
	}
	n, err := Start(context.Background(), Config{ModelDir: dir, Backend: be, Identity: id, Last: -1, Logger: log, TrackerURL: ts.URL})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	nodes, err := trs.Registry().Nodes(context.Background())
	if err != nil || len(nodes) != 1 {
		t.Fatalf("registry: %v %v", nodes, err)
	}
	if ep := nodes[0].Endpoint; !strings.HasPrefix(ep, "https://") || ep != n.HopEndpoint() || nodes[0].Verified != tracker.VerifiedEndpoint {
		t.Fatalf("registered endpoint %q verified %q; want %s verified at the endpoint", ep, nodes[0].Verified, n.HopEndpoint())
	}
	body := `{"model":"` + nodes[0].Model + `","prompt":"def add(a, b):","max_tokens":4,"temperature":0}`
	resp, err := http.Post(ts.URL+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var c struct {
		Choices []struct{ Text string } `json:"choices"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal(got, &c) != nil || len(c.Choices) != 1 {
		t.Fatalf("completion through the tracker to the https head: %d %s", resp.StatusCode, got)
	}

	// The attacker rewrites the registration on its way to the tracker.
	tu, _ := url.Parse(ts.URL)
	rp := httputil.NewSingleHostReverseProxy(tu)
	stripped := 0
	rp.Director = func(r *http.Request) {
		r.URL.Scheme, r.URL.Host, r.Host = tu.Scheme, tu.Host, tu.Host
		if r.Body == nil {
			return
		}
		b, _ := io.ReadAll(r.Body)
		if nb := bytes.ReplaceAll(b, []byte(`"https://`), []byte(`"http://`)); !bytes.Equal(nb, b) {
			stripped++
			b = nb
		}
		r.Body, r.ContentLength = io.NopCloser(bytes.NewReader(b)), int64(len(b))
	}
	mitm := httptest.NewServer(rp)
	defer mitm.Close()
	id2, err := identity.New()
	if err != nil {
		t.Fatal(err)
	}
	n2, err := Start(context.Background(), Config{ModelDir: dir, Backend: be, Identity: id2, Last: -1, Logger: log, TrackerURL: mitm.URL})
	if err == nil {
		n2.Close()
		t.Fatal("a registration stripped of https was accepted")
	}
	if stripped == 0 {
		t.Fatal("the attacker saw no https endpoint to strip")
	}
	nodes, _ = trs.Registry().Nodes(context.Background())
	for _, nd := range nodes {
		if nd.PeerID == id2.PeerID {
			t.Fatalf("the stripped registration was stored: %+v", nd)
		}
	}
}

// An --advertise https://HOST:PORT (a node whose port is reached under a
// name, or an operator writing what the port serves) is registered as
// given: it was registered as https://https://HOST:PORT, which no peer or
// challenge reaches. The tracker's challenge reaches it over pinned TLS.
func TestAdvertisedHTTPSEndpointRegisteredAsGiven(t *testing.T) {
	dir := testenv.GoCoder(t)
	testenv.CheckGoroutines(t)
	be, err := native.Open("cpu", native.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	trs := tracker.NewServer(tracker.Config{Endpoints: tracker.AddrPolicy{AllowLoopback: true}, Logger: log})
	ts := httptest.NewServer(trs.Handler())
	defer ts.Close()
	id, err := identity.New()
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	advertise := "https://" + ln.Addr().String()
	n, err := Start(context.Background(), Config{ModelDir: dir, Backend: be, Identity: id, Last: -1, Logger: log, TrackerURL: ts.URL,
		Listener: ln, Advertise: advertise})
	if err != nil {
		t.Fatalf("a node advertising %s: %v", advertise, err)
	}
	defer n.Close()
	nodes, err := trs.Registry().Nodes(context.Background())
	if err != nil || len(nodes) != 1 || nodes[0].Endpoint != advertise || nodes[0].Verified != tracker.VerifiedEndpoint {
		t.Fatalf("registry: %+v %v; want %s verified at the endpoint", nodes, err, advertise)
	}
	for _, e := range []struct{ in, want string }{
		{"http://10.0.0.1:7000", "https://10.0.0.1:7000"},
		{"https://node.example.org:7000", "https://node.example.org:7000"},
		{"http://[fd00::1]:7000", "https://[fd00::1]:7000"},
	} {
		if got := httpsOf(e.in); got != e.want {
			t.Errorf("httpsOf(%q) = %q, want %q", e.in, got, e.want)
		}
	}
}

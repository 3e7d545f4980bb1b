package tracker

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/wire"
)

// proving is a node's identity endpoint on 127.0.0.1: it answers the
// tracker's challenge as id, for model gocoder-6m and layers, with the
// identity package's real proof (node/identity.go serves the same).
func proving(t *testing.T, id *identity.Identity, layers [2]int) *httptest.Server {
	t.Helper()
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != identity.ProofPath {
			http.NotFound(w, r)
			return
		}
		q := r.URL.Query()
		p, err := id.Prove(q.Get("nonce"), q.Get("endpoint"), q.Get("tracker"), "gocoder-6m", layers)
		if err != nil {
			http.Error(w, err.Error(), 400)
			return
		}
		writeJSON(w, 200, p)
	}))
	t.Cleanup(ts.Close)
	return ts
}

func registerAs(t *testing.T, trackerURL string, id *identity.Identity, r Registration) error {
	t.Helper()
	c := &Client{URL: trackerURL, Identity: id, HTTP: httpClient(t)}
	_, err := c.Register(context.Background(), r)
	return err
}

func statusOf(err error) int {
	var se *StatusError
	if errors.As(err, &se) {
		return se.Status
	}
	return 0
}

func loopbackTracker(t *testing.T, cfg Config) string {
	cfg.Endpoints.AllowLoopback = true
	cfg.Self = TrackerInfo{PeerID: newIdentity(t).PeerID}
	_, ts := startStrictTracker(t, cfg)
	return ts.URL
}

// A registration naming another node's endpoint is refused: the endpoint
// answers the challenge as its own peer id. With the challenge off, the
// endpoint is still owned by the live peer that registered it first.
func TestRegistrationForAnotherNodesEndpointRefused(t *testing.T) {
	testenv.CheckGoroutines(t)
	victim, attacker := newIdentity(t), newIdentity(t)
	v := proving(t, victim, [2]int{0, 5})
	url := loopbackTracker(t, Config{})
	if err := registerAs(t, url, victim, reg(v.URL, 0, 5, 6, 1)); err != nil {
		t.Fatalf("the victim's own registration: %v", err)
	}
	if err := registerAs(t, url, attacker, reg(v.URL, 0, 5, 6, 1)); statusOf(err) != 403 {
		t.Fatalf("registration of the victim's endpoint by another key: %v, want 403", err)
	}
	// An endpoint that does not answer at all is not routed to either.
	dead := httptest.NewServer(http.NotFoundHandler())
	dead.Close()
	if err := registerAs(t, url, attacker, reg(dead.URL, 0, 5, 6, 1)); statusOf(err) != 422 {
		t.Fatalf("registration of a dead endpoint: %v, want 422", err)
	}

	_, ts := startTracker(t, Config{}) // challenge off
	if err := registerAs(t, ts.URL, victim, reg(v.URL, 0, 5, 6, 1)); err != nil {
		t.Fatal(err)
	}
	if err := registerAs(t, ts.URL, attacker, reg(v.URL+"/", 0, 5, 6, 1)); statusOf(err) != 409 {
		t.Fatalf("without the challenge, a second peer id for one endpoint: %v, want 409", err)
	}
}

// A node that restarts with a new key at its endpoint takes it over: the
// endpoint now answers as the new peer id, so the old record is stale.
func TestEndpointTakenOverByWhoAnswersThere(t *testing.T) {
	old, renewed := newIdentity(t), newIdentity(t)
	var current atomic.Pointer[identity.Identity]
	current.Store(old)
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		p, _ := current.Load().Prove(q.Get("nonce"), q.Get("endpoint"), q.Get("tracker"), "gocoder-6m", [2]int{0, 5})
		writeJSON(w, 200, p)
	}))
	defer ts.Close()
	url := loopbackTracker(t, Config{})
	if err := registerAs(t, url, old, reg(ts.URL, 0, 5, 6, 1)); err != nil {
		t.Fatal(err)
	}
	current.Store(renewed)
	if err := registerAs(t, url, renewed, reg(ts.URL, 0, 5, 6, 1)); err != nil {
		t.Fatalf("the endpoint's new key: %v", err)
	}
	var nodes struct{ Nodes []PublicNode }
	getJSON(t, httpClient(t), url+"/nodes", &nodes)
	if len(nodes.Nodes) != 1 || nodes.Nodes[0].PeerID != renewed.PeerID || nodes.Nodes[0].Verified != VerifiedEndpoint {
		t.Fatalf("nodes after the takeover: %+v", nodes.Nodes)
	}
}

// A registration for layers its endpoint does not serve is refused (the
// issue's reproduction: {"layers":[0,5]} for a node serving 3-5).
func TestRegistrationForLayersNotServedRefused(t *testing.T) {
	id := newIdentity(t)
	n := proving(t, id, [2]int{3, 5})
	url := loopbackTracker(t, Config{})
	if err := registerAs(t, url, id, reg(n.URL, 0, 5, 6, 1)); statusOf(err) != 403 || !strings.Contains(err.Error(), "3-5") {
		t.Fatalf("registration for layers 0-5 of a node serving 3-5: %v, want 403", err)
	}
	if err := registerAs(t, url, id, reg(n.URL, 3, 5, 6, 1)); err != nil {
		t.Fatalf("the served layers: %v", err)
	}
}

// Registrations naming link-local, unspecified or (by default) loopback
// and private addresses are refused, and the tracker never connects there.
func TestRegistrationAddressPolicy(t *testing.T) {
	testenv.CheckGoroutines(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var conns atomic.Int32
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns.Add(1)
			c.Close()
		}
	}()
	port := ln.Addr().(*net.TCPAddr).Port
	_, ts := startStrictTracker(t, Config{})
	for _, ep := range []string{
		"http://169.254.169.254/latest/meta-data", "http://[fe80::1]:80", "http://0.0.0.0:7001", "http://[::]:7001",
		fmt.Sprintf("http://127.0.0.1:%d", port), fmt.Sprintf("http://localhost:%d", port), "http://[::1]:7001",
		"http://10.0.0.1:7001", "http://192.168.1.5:7001", "http://100.100.100.200", "http://[fd00:ec2::254]",
	} {
		if err := registerAs(t, ts.URL, newIdentity(t), reg(ep, 0, 5, 6, 1)); statusOf(err) != 400 {
			t.Errorf("endpoint %s: %v, want 400", ep, err)
		}
	}
	r := reg("", 0, 5, 6, 1)
	r.RelayAddr = "ws://169.254.169.254/rpc/x"
	if err := registerAs(t, ts.URL, newIdentity(t), r); statusOf(err) != 400 {
		t.Errorf("relay_addr at the metadata address: %v, want 400", err)
	}
	if n := conns.Load(); n != 0 {
		t.Fatalf("the tracker connected %d times to a refused address", n)
	}
	// A LAN mesh's operator admits private ranges, never link-local.
	_, lan := startStrictTracker(t, Config{Endpoints: AddrPolicy{AllowPrivate: true}, SkipEndpointCheck: true})
	if err := registerAs(t, lan.URL, newIdentity(t), reg("http://10.0.0.1:7001", 0, 5, 6, 1)); err != nil {
		t.Errorf("private endpoint with AllowPrivate: %v", err)
	}
	if err := registerAs(t, lan.URL, newIdentity(t), reg("http://169.254.169.254", 0, 5, 6, 1)); statusOf(err) != 400 {
		t.Errorf("link-local with AllowPrivate: %v, want 400", err)
	}
}

// The proxy dials heads only at admitted addresses, at connect time: a
// record that names a refused address (a name that resolved elsewhere when
// it registered) gets no connection.
func TestProxyDialRefusesPolicyAddresses(t *testing.T) {
	var hits atomic.Int32
	h := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { hits.Add(1) }))
	defer h.Close()
	c := AddrPolicy{}.HTTPClient(2 * time.Second)
	if _, err := c.Get(h.URL); err == nil || hits.Load() != 0 {
		t.Fatalf("a loopback address was dialed under the strict policy: %v, %d hits", err, hits.Load())
	}
	if resp, err := (AddrPolicy{AllowLoopback: true}).HTTPClient(2 * time.Second).Get(h.URL); err != nil {
		t.Fatal(err)
	} else {
		resp.Body.Close()
	}
}

// Registrations are rate-limited per source address (fresh identities cost
// nothing) and per peer id.
func TestRegistrationRateLimits(t *testing.T) {
	_, ts := startStrictTracker(t, Config{Endpoints: AddrPolicy{AllowLoopback: true}, SkipEndpointCheck: true,
		RegisterPerIP: 0.001, RegisterIPBurst: 5, RegisterPerKey: 1e9, RegisterKeyBurst: 1e9})
	refused := 0
	for i := 0; i < 20; i++ {
		err := registerAs(t, ts.URL, newIdentity(t), reg(fmt.Sprintf("http://127.0.0.1:%d", 7000+i), 0, 5, 6, 1))
		if statusOf(err) == 429 {
			refused++
		} else if err != nil {
			t.Fatal(err)
		}
	}
	if refused != 15 {
		t.Fatalf("20 fresh identities from one address, burst 5: %d refused, want 15", refused)
	}
	// Goodbyes draw on the same budget: a flood of /deregister (each a
	// signature check and the registry's lock) is refused before either.
	gone := &Client{URL: ts.URL, Identity: newIdentity(t), HTTP: httpClient(t)}
	if err := gone.Deregister(context.Background()); statusOf(err) != 429 {
		t.Fatalf("a deregistration from the flooding address: %v, want 429", err)
	}
	_, ts = startStrictTracker(t, Config{Endpoints: AddrPolicy{AllowLoopback: true}, SkipEndpointCheck: true,
		RegisterPerIP: 1e9, RegisterIPBurst: 1e9, RegisterPerKey: 0.001, RegisterKeyBurst: 2})
	c := &Client{URL: ts.URL, Identity: newIdentity(t), HTTP: httpClient(t)}
	for i := 0; i < 3; i++ {
		_, err := c.Register(context.Background(), reg("http://127.0.0.1:7001", 0, 5, 6, 1))
		if i < 2 && err != nil || i == 2 && statusOf(err) != 429 {
			t.Fatalf("registration %d of one key, burst 2: %v", i+1, err)
		}
	}
}

// A head that answers the OpenAI endpoint with 404 (it is not a head, or
// an attacker registered it as one) is failed over, not passed through.
func TestProxyFailsOverFromHeadAnswering404(t *testing.T) {
	testenv.CheckGoroutines(t)
	want := reference(t, "/v1/chat/completions", chatBody, true)
	m := newProxyMesh(t, Config{})
	notHead := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		wire.WriteError(w, &wire.Error{Status: 404, Type: "not_found", Message: "no route POST " + r.URL.Path + " on this node"})
	}))
	defer notHead.Close()
	good := startHead(t, &fakeHead{t: t})
	bad := m.node(t, notHead.URL, 0, 5, 1) // faster: routed first
	m.node(t, good.URL, 0, 5, 2)
	got := readStream(t, m.post(t, "/v1/chat/completions", chatBody).Body, true)
	if got.text != want.text || !got.done || got.errored != "" {
		t.Fatalf("stream %+v, want text %q", got, want.text)
	}
	bans, _ := m.srv.Registry().Store().Bans(context.Background(), m.clk.Now())
	if _, ok := bans[bad]; !ok {
		t.Fatalf("the head that answered 404 is not banned: %v", bans)
	}
}

// Replays of a node's signed registration are refused before they spend
// its rate budget: an eavesdropper cannot lock a node out by replaying.
func TestReplayedRegistrationSpendsNoBudget(t *testing.T) {
	_, ts := startStrictTracker(t, Config{Endpoints: AddrPolicy{AllowLoopback: true}, SkipEndpointCheck: true,
		RegisterPerIP: 1e9, RegisterIPBurst: 1e9, RegisterPerKey: 0.001, RegisterKeyBurst: 2})
	id := newIdentity(t)
	hc := httpClient(t)
	body, _ := Sign(id, KindRegister, time.Now(), ptr(reg("http://127.0.0.1:7001", 0, 5, 6, 1)))
	if code, _ := postRaw(t, hc, ts.URL+"/register", body); code != 200 {
		t.Fatalf("first registration: %d", code)
	}
	for i := 0; i < 5; i++ {
		if code, _ := postRaw(t, hc, ts.URL+"/register", body); code != 401 {
			t.Fatalf("replay %d: %d, want 401", i, code)
		}
	}
	fresh, _ := Sign(id, KindRegister, time.Now().Add(time.Millisecond), ptr(reg("http://127.0.0.1:7001", 0, 5, 6, 1)))
	if code, out := postRaw(t, hc, ts.URL+"/register", fresh); code != 200 {
		t.Fatalf("the node's own next registration after replays: %d %v", code, out)
	}
}

package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"meshgpu/engine"
	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/model/chat"
	"meshgpu/tracker"
)

// wholeModelChat is the reference: greedy generation of the rendered chat
// on one in-process model holding every layer.
func wholeModelChat(t *testing.T, dir string, msgs []chat.Message, maxTokens int) *engine.Result {
	t.Helper()
	whole, err := engine.Load(dir, engine.Options{Backend: openCPU(t), First: 0, Last: -1, MaxContext: 512})
	if err != nil {
		t.Fatal(err)
	}
	defer whole.Close()
	rendered, err := whole.Template.Render(msgs, true)
	if err != nil {
		t.Fatal(err)
	}
	ref, err := whole.Generate(context.Background(), whole.Tokenizer.Encode(rendered, false),
		engine.GenerateParams{MaxTokens: maxTokens, IgnoreEOS: true}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return ref
}

func freePort(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return fmt.Sprint(ln.Addr().(*net.TCPAddr).Port)
}

// Issue 19, with real processes and a real etcd: two `meshgpu tracker
// --store etcd://` processes serve one mesh of two `meshgpu run` nodes that
// name both trackers. Chats through either tracker equal one in-process
// model's text. The mesh page of tracker B, rendered by headless Chromium,
// shows the model, every node's peer id and layer range, and a registrant's
// hostile backend name as text (no script runs). Tracker A is killed
// (SIGKILL); past the heartbeat timeout, chats through B still succeed and
// the map stays covered (the nodes heartbeat through B); A restarted on its
// port serves at once from the shared state. Finally a node is killed and
// the open page marks it gone within the timeout and one refresh.
func TestTwoTrackersOnEtcd(t *testing.T) {
	dir := testenv.GoCoder(t)
	testenv.CheckGoroutines(t)
	etcd := testenv.Etcd(t)
	const maxTokens = 40
	const hbTimeout = 3 * time.Second // room for a loaded 2-core CI machine: a node that misses it re-registers, which lifts its ban
	msgs := []chat.Message{{Role: "user", Content: "Write a Go function that adds two numbers."}}

	ref := wholeModelChat(t, dir, msgs, maxTokens)

	portA, portB := freePort(t), freePort(t)
	urlA, urlB := "http://127.0.0.1:"+portA, "http://127.0.0.1:"+portB
	startTracker := func(name, port string) *proc {
		p, _ := startProc(t, name, addrLine, "tracker", "--listen", "127.0.0.1:"+port, "--store", "etcd://"+etcd,
			"--etcd-prefix", "/e2e/", "--heartbeat-timeout", hbTimeout.String(), "--page-refresh", "500ms", "--token-timeout", "5s", "--audit-rate", "0", "--audit-probation=false")
		return p
	}
	trackerA := startTracker("tracker A", portA)
	startTracker("tracker B", portB)

	type node struct {
		p      *proc
		id     *identity.Identity
		layers string
	}
	var nodes []node
	for _, layers := range []string{"0-2", "3-5"} {
		key := filepath.Join(t.TempDir(), "node.key")
		id, err := identity.LoadOrCreate(key)
		if err != nil {
			t.Fatal(err)
		}
		p, got := startProc(t, "node "+layers, nodeLine, "run", "--model", dir, "--backend", "cpu", "--threads", "1", "--key", key,
			"--layers", layers, "--listen", "127.0.0.1:0", "--tracker", urlA+","+urlB, "--hop-dtype", "f32",
			"--max-context", "512", "--heartbeat-interval", "300ms")
		if got != layers {
			t.Fatalf("node holds %s, want %s", got, layers)
		}
		nodes = append(nodes, node{p, id, layers})
	}

	hc := newHTTPClient(t)
	body := map[string]any{"model": "gocoder-6m", "messages": msgs, "max_tokens": maxTokens,
		"temperature": 0, "ignore_eos": true, "stream": true}
	chatVia := func(what, base string) {
		t.Helper()
		got := postStream(t, hc, base+"/v1/chat/completions", body)
		if !got.done || got.err != "" || got.text != ref.Text {
			t.Fatalf("%s (done %v, error %q):\n%q\none in-process model:\n%q", what, got.done, got.err, got.text, ref.Text)
		}
	}
	covered := func(what, base string) {
		t.Helper()
		var m tracker.AvailabilityMap
		getJSON(t, hc, base+"/map?model=gocoder-6m", &m)
		if !m.Covered || m.NumLayers != 6 {
			t.Fatalf("%s: map %+v, want all 6 layers covered", what, m)
		}
	}
	chatVia("through tracker A", urlA)
	chatVia("through tracker B", urlB)

	// Bans are shared: a registrant claiming every layer at a tiny cost
	// (the cheapest route on both trackers) answers 500; tracker A bans it
	// while failing over, and tracker B stops routing to it.
	// It proves its identity (so the trackers admit it), then fails.
	badID := newIdentity(t)
	failing := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == identity.ProofPath {
			q := r.URL.Query()
			p, _ := badID.Prove(q.Get("nonce"), q.Get("endpoint"), q.Get("tracker"), "gocoder-6m", [2]int{0, 5})
			json.NewEncoder(w).Encode(p)
			return
		}
		http.Error(w, `{"error":{"message":"broken node","type":"server_error"}}`, 500)
	}))
	defer failing.Close()
	bad := &tracker.Client{URL: urlA, Fallbacks: []string{urlB}, Identity: badID, HTTP: hc, Logger: quietLogger()}
	badReg := tracker.Registration{Endpoint: failing.URL, Model: "gocoder-6m", NumLayers: 6, Layers: [2]int{0, 5}, Backend: "cpu", MsPerLayer: 0.001}
	actx, acancel := context.WithCancel(context.Background())
	an := &tracker.Announcer{Client: bad, Interval: 300 * time.Millisecond, Registration: func() tracker.Registration { return badReg },
		Stats: func() (tracker.NodeStats, int64) { return tracker.NodeStats{}, 0 }, Logger: quietLogger()}
	andone := make(chan error, 1)
	go func() { andone <- an.Run(actx) }()
	var stopOnce sync.Once
	stopBad := func() { stopOnce.Do(func() { acancel(); <-andone }) }
	defer stopBad()
	routeHead := func(base string, seed int) string {
		var r struct {
			Hops []struct {
				PeerID string `json:"peer_id"`
			} `json:"hops"`
		}
		getJSON(t, hc, fmt.Sprintf("%s/route?model=gocoder-6m&seed=%d", base, seed), &r)
		if len(r.Hops) == 0 {
			return ""
		}
		return r.Hops[0].PeerID
	}
	for deadline := time.Now().Add(5 * time.Second); routeHead(urlA, 0) != bad.Identity.PeerID || routeHead(urlB, 0) != bad.Identity.PeerID; {
		if time.Now().After(deadline) {
			t.Fatal("the cheap failing registrant is not the route's head on both trackers")
		}
		time.Sleep(50 * time.Millisecond)
	}
	chatVia("through tracker A, failing over from the broken node", urlA)
	mresp, err := hc.Get(urlA + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	failovers := metric(t, mresp.Body, "meshgpu_tracker_proxy_failovers_total")
	mresp.Body.Close()
	if failovers < 1 {
		t.Fatalf("tracker A counted %v failovers: the broken node was not tried", failovers)
	}
	for seed := 0; seed < 10; seed++ {
		if h := routeHead(urlB, seed); h == bad.Identity.PeerID {
			t.Fatalf("tracker B routes (seed %d) to the node tracker A banned", seed)
		}
	}

	// The page on B, with a registrant whose backend name is markup.
	br := startBrowser(t)
	xss := &tracker.Client{URL: urlB, Identity: newIdentity(t), HTTP: hc}
	hostile := `<img src=x onerror="__xss=1"><script>__xss=2</script>`
	// It proves its identity at its endpoint; only its backend name is hostile.
	xssNode := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		p, _ := xss.Identity.Prove(q.Get("nonce"), q.Get("endpoint"), q.Get("tracker"), "xss-model", [2]int{0, 1})
		json.NewEncoder(w).Encode(p)
	}))
	defer xssNode.Close()
	if _, err := xss.Register(context.Background(), tracker.Registration{Endpoint: xssNode.URL, Model: "xss-model",
		NumLayers: 2, Layers: [2]int{0, 1}, Backend: hostile, MsPerLayer: 1}); err != nil {
		t.Fatal(err)
	}
	br.navigate(urlB + "/")
	rowText := func(id string) string {
		return fmt.Sprintf(`(document.querySelector('tr[data-peer=%q]')||{innerText:''}).innerText`, id)
	}
	for _, n := range nodes {
		br.waitEval("node "+n.layers+" listed with its range", fmt.Sprintf(`%s.includes(%q) && %s.includes(%q)`,
			rowText(n.id.PeerID), n.id.PeerID, rowText(n.id.PeerID), strings.Replace(n.layers, "-", "–", 1)), 10*time.Second)
	}
	br.waitEval("the model name", `[...document.querySelectorAll('.model-name')].some(e => e.textContent === 'gocoder-6m')`, 5*time.Second)
	br.waitEval("the hostile backend shown as text", fmt.Sprintf(`[...document.querySelectorAll('td.backend')].some(e => e.textContent === %q)`,
		hostile), 5*time.Second)
	var injected bool
	br.eval(`window.__xss !== undefined || document.querySelector('#nodes img, #nodes script') !== null`, &injected)
	if injected {
		t.Fatal("a registrant's backend name became markup on the page")
	}
	shot := filepath.Join(t.TempDir(), "mesh-page.png")
	if p := os.Getenv("MESHGPU_SCREENSHOT"); p != "" {
		shot = p
	}
	br.waitEval("the banned node marked banned", fmt.Sprintf(`%s.includes('banned')`, rowText(bad.Identity.PeerID)), 5*time.Second)
	br.screenshot(shot)
	stopBad()

	// Tracker A dies; the nodes move to B.
	trackerA.kill()
	time.Sleep(hbTimeout + 500*time.Millisecond)
	covered("tracker B after tracker A died", urlB)
	chatVia("through tracker B after tracker A died", urlB)
	var v struct{ Nodes []tracker.NodeRecord }
	getJSON(t, hc, urlB+"/nodes", &v)
	for _, n := range nodes {
		if !strings.Contains(n.p.log(), "moving to the next tracker") {
			t.Errorf("node %s did not log moving to tracker B:\n%s", n.layers, n.p.log())
		}
	}
	if len(v.Nodes) != 2 {
		t.Fatalf("tracker B lists %d nodes after A died and the hostile registrant expired: %+v", len(v.Nodes), v.Nodes)
	}
	// Restarted, A serves at once from the shared state.
	startTracker("tracker A again", portA)
	covered("restarted tracker A", urlA)
	chatVia("through restarted tracker A", urlA)

	// A node dies: the open page marks it gone.
	br.waitEval("the expired registrant marked gone", fmt.Sprintf(`%s.includes('gone')`, rowText(xss.Identity.PeerID)), 5*time.Second)
	nodes[1].p.kill()
	br.waitEval("the killed node marked gone", fmt.Sprintf(`%s.includes('gone') && !%s.includes('gone')`,
		rowText(nodes[1].id.PeerID), rowText(nodes[0].id.PeerID)), hbTimeout+2*time.Second)
}

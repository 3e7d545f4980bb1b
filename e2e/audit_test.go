package e2e

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/model/chat"
	"meshgpu/tracker"
	"meshgpu/wire"
)

// scrambledCopy writes a copy of the model at dir into a temp directory
// also named after dir (so it registers as the same model) with the
// weights of layers 3-5 permuted: valid bf16 numbers, wrong arithmetic. A
// node serving it answers with a wrong model and says nothing.
func scrambledCopy(t *testing.T, dir string) string {
	t.Helper()
	out := modelCopy(t, dir, "model.safetensors")
	b, err := os.ReadFile(filepath.Join(dir, "model.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	n := binary.LittleEndian.Uint64(b[:8])
	var header map[string]json.RawMessage
	if err := json.Unmarshal(b[8:8+n], &header); err != nil {
		t.Fatal(err)
	}
	data := b[8+n:]
	scrambled := 0
	for name, raw := range header {
		if !regexp.MustCompile(`^model\.layers\.[345]\.(mlp|self_attn)\.`).MatchString(name) {
			continue
		}
		var info struct {
			DType   string   `json:"dtype"`
			Offsets [2]int64 `json:"data_offsets"`
		}
		if err := json.Unmarshal(raw, &info); err != nil || info.DType != "BF16" {
			t.Fatalf("tensor %s: %v (dtype %s)", name, err, info.DType)
		}
		w := data[info.Offsets[0]:info.Offsets[1]]
		// reverse the order of the bf16 elements
		for i, j := 0, len(w)/2-1; i < j; i, j = i+1, j-1 {
			w[2*i], w[2*i+1], w[2*j], w[2*j+1] = w[2*j], w[2*j+1], w[2*i], w[2*i+1]
		}
		scrambled++
	}
	if scrambled != 3*7 {
		t.Fatalf("scrambled %d tensors, want 21", scrambled)
	}
	if err := os.WriteFile(filepath.Join(out, "model.safetensors"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	return out
}

// nodeKeys makes a key file per name (so peer ids are known before the
// processes start: the tracker's --audit-trusted names one).
func nodeKeys(t *testing.T, names ...string) (map[string]string, map[string]*identity.Identity) {
	keys, ids := map[string]string{}, map[string]*identity.Identity{}
	for _, name := range names {
		keys[name] = filepath.Join(t.TempDir(), "node.key")
		id, err := identity.LoadOrCreate(keys[name])
		if err != nil {
			t.Fatal(err)
		}
		ids[name] = id
	}
	return keys, ids
}

// Issue 14, with real processes: a tracker, a head holding 0-2, an honest
// node and a liar both holding 3-5 (the liar serves a copy of gocoder-6m
// whose layers 3-5 are scrambled, under the same model name). The honest
// tail is the operator's trusted peer. Of 40 sequential chats through the
// tracker, every one from the 20th on equals one in-process honest model;
// the liar shows as failed in /nodes and in the tracker's metrics.
func TestAuditCatchesLyingNode(t *testing.T) {
	dir := testenv.GoCoder(t)
	testenv.CheckGoroutines(t)
	liarDir := scrambledCopy(t, dir)
	const maxTokens = 8
	const chats = 40

	keys, ids := nodeKeys(t, "head", "honest", "liar")
	tp, trackerAddr := startProc(t, "tracker", addrLine, "tracker", "--listen", "127.0.0.1:0", "--token-timeout", "10s",
		"--audit-rate", "0.1", "--audit-trusted", ids["honest"].PeerID)
	trackerURL := "http://" + trackerAddr
	run := func(name, modelDir, layers string) *proc {
		p, got := startProc(t, name, nodeLine, "run", "--model", modelDir, "--backend", "cpu", "--threads", "1", "--key", keys[name],
			"--layers", layers, "--listen", "127.0.0.1:0", "--tracker", trackerURL, "--hop-dtype", "f32",
			"--max-context", "512", "--heartbeat-interval", "500ms")
		if got != layers {
			t.Fatalf("%s holds %s, want %s", name, got, layers)
		}
		return p
	}
	run("head", dir, "0-2")
	run("honest", dir, "3-5")
	run("liar", liarDir, "3-5")

	hc := newHTTPClient(t)
	wrong := 0
	for i := range chats {
		msgs := []chat.Message{{Role: "user", Content: fmt.Sprintf("Write a Go function number %d that adds two numbers.", i)}}
		ref := wholeModelChat(t, dir, msgs, maxTokens)
		got := postStream(t, hc, trackerURL+"/v1/chat/completions", map[string]any{"model": "gocoder-6m", "messages": msgs,
			"max_tokens": maxTokens, "temperature": 0, "ignore_eos": true, "stream": true})
		if !got.done || got.err != "" {
			t.Fatalf("chat %d: done %v, error %q", i, got.done, got.err)
		}
		if got.text != ref.Text {
			wrong++
			if i >= 19 {
				t.Errorf("chat %d through the tracker:\n%q\none honest model:\n%q", i+1, got.text, ref.Text)
			}
		}
	}
	t.Logf("%d of %d chats differed from the honest model", wrong, chats)
	defer func() {
		if t.Failed() {
			t.Logf("tracker log:\n%s", tp.log())
		}
	}()

	var nodes struct {
		Nodes []tracker.PublicNode `json:"nodes"`
	}
	getJSON(t, hc, trackerURL+"/nodes", &nodes)
	audits := map[string]string{}
	for _, n := range nodes.Nodes {
		audits[n.PeerID] = n.Audit
		if n.PeerID == ids["liar"].PeerID {
			t.Logf("the liar's audit evidence: %s", n.AuditDetail)
		}
	}
	if audits[ids["liar"].PeerID] != tracker.AuditFailed || audits[ids["honest"].PeerID] == tracker.AuditFailed {
		t.Errorf("audit statuses in /nodes: liar %q, honest %q; want the liar failed, the honest not", audits[ids["liar"].PeerID], audits[ids["honest"].PeerID])
	}
	resp, err := hc.Get(trackerURL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if v := metric(t, strings.NewReader(string(body)), fmt.Sprintf(`meshgpu_tracker_audit_failures_total{peer=%q}`, ids["liar"].PeerID)); v < 1 {
		t.Errorf("meshgpu_tracker_audit_failures_total for the liar is %v, want >= 1", v)
	}
	if v := metric(t, strings.NewReader(string(body)), fmt.Sprintf(`meshgpu_tracker_audit_failures_total{peer=%q}`, ids["honest"].PeerID)); v != 0 {
		t.Errorf("the honest node has %v failed audits", v)
	}
}

// twoFaced is a test double of a node that lies only sometimes: it sits at
// the endpoint an honest `meshgpu run` advertises and forwards every hop to
// that node and to a second one serving the scrambled copy (so both keep
// their sessions' caches), then answers with the honest reply when honest
// says so and with the scrambled one otherwise.
type twoFaced struct {
	honest, liar string
	hc           *http.Client
	mu           sync.Mutex
	hops         map[string]int // hops per session
	honestFor    map[string]bool
	seen         map[[32]byte]bool // first-hop bodies (prompts) seen
	// honestHop says whether the n-th hop (1-based) of a session whose
	// first hop had digest first is answered honestly.
	honestHop func(tf *twoFaced, session string, n int, first [32]byte) bool
	lies      int
}

func (tf *twoFaced) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == wire.HopPath {
		// No hop frames: the head falls back to POST /forward, which this
		// double can read hop by hop.
		http.NotFound(w, r)
		return
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), 400)
		return
	}
	send := func(base string) (*http.Response, []byte, error) {
		req, _ := http.NewRequestWithContext(r.Context(), r.Method, base+r.URL.RequestURI(), bytes.NewReader(body))
		req.Header = r.Header.Clone()
		resp, err := tf.hc.Do(req)
		if err != nil {
			return nil, nil, err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return resp, b, err
	}
	target := tf.honest
	if (r.Method == http.MethodPost && r.URL.Path == "/forward") || r.Method == http.MethodDelete {
		session := r.Header.Get(wire.HeaderSession)
		tf.mu.Lock()
		tf.hops[session]++
		n := tf.hops[session]
		first := sha256.Sum256(body)
		if n == 1 {
			tf.honestFor[session] = tf.seen[first]
			tf.seen[first] = true
		}
		honest := r.Method == http.MethodDelete || tf.honestHop(tf, session, n, first)
		if !honest {
			tf.lies++
		}
		tf.mu.Unlock()
		hResp, hBody, hErr := send(tf.honest)
		lResp, lBody, lErr := send(tf.liar)
		resp, b, err := hResp, hBody, hErr
		if !honest {
			resp, b, err = lResp, lBody, lErr
		}
		if err != nil {
			http.Error(w, err.Error(), 502)
			return
		}
		for k, v := range resp.Header {
			w.Header()[k] = v
		}
		w.WriteHeader(resp.StatusCode)
		w.Write(b)
		return
	}
	resp, b, err := send(target)
	if err != nil {
		http.Error(w, err.Error(), 502)
		return
	}
	for k, v := range resp.Header {
		w.Header()[k] = v
	}
	w.WriteHeader(resp.StatusCode)
	w.Write(b)
}

// Issue 14: liars that are honest only sometimes are caught too. A node
// honest for the first 30 hops of each session (longer than a probation
// session) and one honest only for prompts it has seen before each stand
// behind the endpoint of an honest process, next to a trusted honest tail;
// the tracker audits every session. The liar is marked failed, and the
// chats after that equal one honest model.
func TestAuditCatchesPartTimeLiars(t *testing.T) {
	dir := testenv.GoCoder(t)
	testenv.CheckGoroutines(t)
	liarDir := scrambledCopy(t, dir)
	for _, tc := range []struct {
		name   string
		honest func(tf *twoFaced, session string, n int, first [32]byte) bool
	}{
		{"honest for the first 30 hops", func(_ *twoFaced, _ string, n int, _ [32]byte) bool { return n <= 30 }},
		{"honest for prompts seen before", func(tf *twoFaced, session string, _ int, _ [32]byte) bool { return tf.honestFor[session] }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const maxTokens = 40
			keys, ids := nodeKeys(t, "head", "trusted", "twofaced", "backend")
			tp, trackerAddr := startProc(t, "tracker", addrLine, "tracker", "--listen", "127.0.0.1:0", "--token-timeout", "10s",
				"--audit-rate", "1", "--audit-trusted", ids["trusted"].PeerID)
			trackerURL := "http://" + trackerAddr
			listenOf := func(p *proc) string {
				return "http://" + regexp.MustCompile(`msg="listening on (\S+)"`).FindStringSubmatch(p.log())[1]
			}
			args := func(name, modelDir, layers string, extra ...string) []string {
				return append([]string{"run", "--model", modelDir, "--backend", "cpu", "--threads", "1", "--key", keys[name],
					"--layers", layers, "--listen", "127.0.0.1:0", "--hop-dtype", "f32", "--max-context", "512", "--heartbeat-interval", "500ms"}, extra...)
			}
			startProc(t, "head", nodeLine, args("head", dir, "0-2", "--tracker", trackerURL)...)
			startProc(t, "trusted", nodeLine, args("trusted", dir, "3-5", "--tracker", trackerURL)...)
			// the scrambled backend is not registered: only the double reaches it
			lp, _ := startProc(t, "scrambled backend", nodeLine, args("backend", liarDir, "3-5")...)
			hc := newHTTPClient(t)
			tf := &twoFaced{liar: listenOf(lp), hc: hc, hops: map[string]int{}, honestFor: map[string]bool{}, seen: map[[32]byte]bool{}, honestHop: tc.honest}
			front := httptest.NewServer(tf)
			t.Cleanup(front.Close)
			port := freePort(t)
			tf.honest = "http://127.0.0.1:" + port
			// The double is a plain HTTP proxy in front of the node: its
			// hops cannot be pinned TLS (the node would register https).
			a := args("twofaced", dir, "3-5", "--tracker", trackerURL, "--advertise", front.URL, "--hop-tls=false")
			for i := range a {
				if a[i] == "127.0.0.1:0" {
					a[i] = "127.0.0.1:" + port
				}
			}
			startProc(t, "two-faced", nodeLine, a...)

			failed := -1
			for i := 0; i < 30; i++ {
				msgs := []chat.Message{{Role: "user", Content: fmt.Sprintf("Write Go function %d that sorts numbers.", i%3)}}
				ref := wholeModelChat(t, dir, msgs, maxTokens)
				// Two chats at once: the tracker spreads concurrent load over
				// the two equal replicas of 3-5, so the double gets traffic
				// whichever replica a lone chat would be routed to.
				var pair [2]stream
				var wg sync.WaitGroup
				for k := range pair {
					wg.Add(1)
					go func() {
						defer wg.Done()
						pair[k] = postStream(t, hc, trackerURL+"/v1/chat/completions", map[string]any{"model": "gocoder-6m", "messages": msgs,
							"max_tokens": maxTokens, "temperature": 0, "ignore_eos": true, "stream": true})
					}()
				}
				wg.Wait()
				for _, got := range pair {
					if !got.done || got.err != "" {
						t.Fatalf("chat %d: done %v, error %q", i, got.done, got.err)
					}
				}
				got := pair[0]
				if pair[1].text != got.text {
					got = pair[1] // compare the one that differs, if one does
				}
				var nodes struct {
					Nodes []tracker.PublicNode `json:"nodes"`
				}
				getJSON(t, hc, trackerURL+"/nodes", &nodes)
				for _, n := range nodes.Nodes {
					if n.PeerID == ids["twofaced"].PeerID && n.Audit == tracker.AuditFailed && failed < 0 {
						failed = i
					}
				}
				if failed >= 0 && i > failed+1 && got.text != ref.Text {
					t.Errorf("chat %d, after the liar failed its audit at chat %d, differs from one honest model:\n%q\n%q", i, failed, got.text, ref.Text)
				}
				if failed >= 0 && i > failed+2 {
					break
				}
				time.Sleep(200 * time.Millisecond) // audits run after real traffic
			}
			tf.mu.Lock()
			lies := tf.lies
			tf.mu.Unlock()
			if failed < 0 {
				t.Fatalf("the two-faced node (lied on %d hops) was never marked failed; tracker log:\n%s", lies, tp.log())
			}
			if lies == 0 {
				t.Fatalf("the double never lied: the test does not test anything")
			}
			t.Logf("failed at chat %d after %d lying hops", failed, lies)
		})
	}
}

// Issue 14, false alarms: a mesh of honest nodes that differ in hop dtype
// (a head sending bf16 activations, one sending f32) and CPU threads (1 and
// 2), every session audited, at temperature 0 and at 0.8 with and without
// a seed: 200 audited sessions, no failure and no dispute. The logprob differences seen are logged (the calibration in
// docs/security.md).
func TestAuditNoFalseAlarms(t *testing.T) {
	if testing.Short() {
		t.Skip("200 audited sessions")
	}
	dir := testenv.GoCoder(t)
	testenv.CheckGoroutines(t)
	tp, trackerAddr := startProc(t, "tracker", addrLine, "tracker", "--listen", "127.0.0.1:0", "--token-timeout", "10s",
		"--audit-rate", "1")
	trackerURL := "http://" + trackerAddr
	for i, n := range []struct{ layers, dtype, threads string }{
		{"0-2", "bf16", "1"}, {"0-2", "f32", "2"}, {"3-5", "f32", "1"}, {"3-5", "bf16", "2"},
	} {
		key := filepath.Join(t.TempDir(), "node.key")
		startProc(t, fmt.Sprintf("node %d", i), nodeLine, "run", "--model", dir, "--backend", "cpu", "--threads", n.threads, "--key", key,
			"--layers", n.layers, "--listen", "127.0.0.1:0", "--tracker", trackerURL, "--hop-dtype", n.dtype,
			"--max-context", "512", "--heartbeat-interval", "500ms")
	}
	hc := newHTTPClient(t)
	// audited waits until every queued audit has ended (the next chat
	// would make them yield) and counts the results.
	audited := func() (passed, failed, disputed float64, body string) {
		for end := time.Now().Add(time.Minute); ; time.Sleep(10 * time.Millisecond) {
			resp, err := hc.Get(trackerURL + "/metrics")
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			m := func(series string) float64 { return metric(t, bytes.NewReader(b), series) }
			res := func(result string) float64 { return m(fmt.Sprintf(`meshgpu_tracker_audits_total{result=%q}`, result)) }
			ended := res("passed") + res("failed") + res("disputed") + res("inconclusive") + res("skipped")
			if ended >= m("meshgpu_tracker_audits_queued_total") || time.Now().After(end) {
				return res("passed"), res("failed"), res("disputed"), string(b)
			}
		}
	}
	const sessions = 200
	deadline := time.Now().Add(8 * time.Minute)
	for i := 0; ; i++ {
		passed, failed, disputed, body := audited()
		if failed > 0 || disputed > 0 {
			t.Fatalf("honest nodes: %v failed and %v disputed audits; tracker log:\n%s", failed, disputed, tp.log())
		}
		if passed+failed+disputed >= sessions {
			var diffs []string
			for _, l := range strings.Split(body, "\n") {
				if strings.HasPrefix(l, "meshgpu_tracker_audit_logprob_diff") {
					diffs = append(diffs, l)
				}
			}
			t.Logf("%v audits passed; logprob differences:\n%s", passed, strings.Join(diffs, "\n"))
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("only %v audits passed before the deadline", passed)
		}
		msgs := []chat.Message{{Role: "user", Content: fmt.Sprintf("Write a Go function %d that parses a number.", i)}}
		req := map[string]any{"model": "gocoder-6m", "messages": msgs, "max_tokens": 6, "stream": true}
		switch i % 3 { // temperature 0, 0.8 with a seed, 0.8 with the tracker's seed
		case 0:
			req["temperature"] = 0
		case 1:
			req["temperature"], req["seed"] = 0.8, i
		case 2:
			req["temperature"] = 0.8
		}
		got := postStream(t, hc, trackerURL+"/v1/chat/completions", req)
		if !got.done || got.err != "" {
			t.Fatalf("chat %d: done %v, error %q", i, got.done, got.err)
		}
	}
}

package e2e

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/model/chat"
	"meshgpu/tracker"
)

// scrambledCopy writes a copy of the model at dir into a temp directory
// also named after dir (so it registers as the same model) with the
// weights of layers 3-5 permuted: valid bf16 numbers, wrong arithmetic. A
// node serving it answers with a wrong model and says nothing.
func scrambledCopy(t *testing.T, dir string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), filepath.Base(dir))
	if err := os.MkdirAll(out, 0o755); err != nil {
		t.Fatal(err)
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if e.IsDir() || e.Name() == "model.safetensors" {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(out, e.Name()), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
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

	keys := map[string]string{}
	ids := map[string]*identity.Identity{}
	for _, name := range []string{"head", "honest", "liar"} {
		keys[name] = filepath.Join(t.TempDir(), "node.key")
		id, err := identity.LoadOrCreate(keys[name])
		if err != nil {
			t.Fatal(err)
		}
		ids[name] = id
	}
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

package e2e

import (
	"fmt"
	"path/filepath"
	"slices"
	"testing"

	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/model/chat"
)

// A mesh of three `meshgpu run --model FILE.gguf` processes (layers 0-1,
// 2-3, 4-5 of the bf16 GGUF, nothing else given: tokenizer, template and
// config come from the file) answers a chat through the tracker with the
// text one in-process model of the safetensors directory writes (the same
// weights; f32 hops make the split bit-identical).
func TestGGUFMeshEqualsOneNode(t *testing.T) {
	dir := testenv.GoCoder(t)
	file := testenv.GoCoderGGUF(t, "bf16")
	testenv.CheckGoroutines(t)
	const maxTokens = 96
	msgs := []chat.Message{{Role: "user", Content: "Write a Go function that sums a slice of ints."}}
	ref := wholeModelChat(t, dir, msgs, maxTokens)

	_, trackerAddr := startProc(t, "tracker", addrLine, "tracker", "--listen", "127.0.0.1:0", "--audit-rate", "0", "--audit-probation=false")
	trackerURL := "http://" + trackerAddr
	for i, layers := range []string{"0-1", "2-3", "4-5"} {
		key := filepath.Join(t.TempDir(), "node.key")
		if _, err := identity.LoadOrCreate(key); err != nil {
			t.Fatal(err)
		}
		p, got := startProc(t, fmt.Sprintf("node %d", i), nodeLine, "run", "--model", file, "--layers", layers,
			"--backend", "cpu", "--threads", "1", "--key", key, "--tracker", trackerURL, "--listen", "127.0.0.1:0",
			"--hop-dtype", "f32", "--max-context", "512", "--heartbeat-interval", "500ms")
		if got != layers {
			t.Fatalf("node %d serves %s, want %s:\n%s", i, got, layers, p.log())
		}
	}
	hc := newHTTPClient(t)
	body := map[string]any{"model": "gocoder-6m", "messages": msgs, "max_tokens": maxTokens,
		"temperature": 0, "ignore_eos": true, "stream": true}
	got := postStream(t, hc, trackerURL+"/v1/chat/completions", body)
	if !got.done || got.err != "" || got.text != ref.Text || !slices.Equal(got.ids, ref.IDs) {
		t.Fatalf("through the tracker (done %v, error %q):\n%q\none in-process safetensors model:\n%q", got.done, got.err, got.text, ref.Text)
	}
}

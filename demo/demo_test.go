package demo

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"meshgpu/engine"
	"meshgpu/internal/testenv"
	"meshgpu/model/chat"
	"meshgpu/native"
)

func quiet() *slog.Logger {
	if os.Getenv("MESHGPU_DEMO_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// oneNode is the reference: the whole model in one stack in this process,
// greedy over the chat template's rendering of the demo's prompt (built
// here from the demo's defaults, not from what Run reports).
func oneNode(t *testing.T, dir string) *engine.Result {
	t.Helper()
	be, err := native.Open("cpu", native.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	m, err := engine.Load(dir, engine.Options{Backend: be, First: 0, Last: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	text, err := m.Template.Render([]chat.Message{{Role: "user", Content: DefaultPrompt}}, true)
	if err != nil {
		t.Fatal(err)
	}
	ref, err := m.Generate(context.Background(), m.Tokenizer.Encode(text, false), engine.GenerateParams{MaxTokens: DefaultMaxTokens}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(ref.IDs) == 0 {
		t.Fatal("the reference generated nothing: the comparison would prove nothing")
	}
	return ref
}

// checkMesh checks the demo's layout: three nodes splitting the model's
// six layers, the last with no listener, behind the relay.
func checkMesh(t *testing.T, res *Result) {
	t.Helper()
	var got []string
	for _, n := range res.Nodes {
		got = append(got, fmt.Sprintf("%d-%d", n.First, n.Last))
	}
	if fmt.Sprint(got) != "[0-1 2-3 4-5]" {
		t.Errorf("nodes hold %v; want [0-1 2-3 4-5]", got)
	}
	if len(res.Nodes) == 3 {
		tail := res.Nodes[2]
		if tail.URL != "" || tail.RelayAddr != res.RelayURL+"/rpc/"+tail.PeerID {
			t.Errorf("tail: url %q, relay addr %q; want no listener, reachable at %s/rpc/%s", tail.URL, tail.RelayAddr, res.RelayURL, tail.PeerID)
		}
		for _, n := range res.Nodes[:2] {
			if !strings.HasPrefix(n.URL, "http://127.0.0.1:") {
				t.Errorf("node %d-%d listens at %q; want 127.0.0.1", n.First, n.Last, n.URL)
			}
		}
	}
}

// The demo over gocoder-6m: the answer streamed through the tracker, three
// nodes and the relay equals one in-process node's greedy output (f32
// hops: the split is bit-identical on the CPU backend), the relay carried
// the hops to the tail, an OpenAI-style non-streaming request to the printed
// base URL gets the same answer, and cancelling the context (what Ctrl-C
// does) while it serves stops every server and goroutine.
func TestDemoGoCoderMatchesOneNodeAndStopsOnCancel(t *testing.T) {
	dir := testenv.GoCoder(t)
	ref := oneNode(t, dir)
	testenv.CheckGoroutines(t)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out bytes.Buffer
	var served *Result
	hc := &http.Client{Timeout: 60 * time.Second, Transport: &http.Transport{}}
	defer hc.Transport.(*http.Transport).CloseIdleConnections()
	res, err := Run(ctx, Options{Model: dir, Backend: "cpu", Threads: 1, Out: &out, Logger: quiet(),
		Serving: func(r *Result) {
			served = r
			defer cancel() // Ctrl-C
			relayBase := "http" + strings.TrimPrefix(r.RelayURL, "ws")
			if n := relayed(t, hc, relayBase); n < float64(len(ref.IDs)) {
				t.Errorf("the relay carried %v hops; want at least one per token (%d)", n, len(ref.IDs))
			}
			text, status := chatOnce(t, hc, r.TrackerURL+"/v1", r.ModelName)
			if status != 200 || text != ref.Text {
				t.Errorf("non-streaming request to %s/v1: status %d, text\n%q\nwant\n%q", r.TrackerURL, status, text, ref.Text)
			}
		}})
	if err != nil {
		t.Fatalf("Run: %v\n%s", err, out.String())
	}
	if served == nil {
		t.Fatalf("Run returned before serving:\n%s", out.String())
	}
	checkMesh(t, res)
	if res.Synthesized || res.ModelName != "gocoder-6m" {
		t.Errorf("model %q synthesized %v; want gocoder-6m", res.ModelName, res.Synthesized)
	}
	if res.Text != ref.Text || res.CompletionTokens != len(ref.IDs) || res.FinishReason != ref.FinishReason {
		t.Errorf("through the demo mesh (%d tokens, %s):\n%q\none node (%d tokens, %s):\n%q",
			res.CompletionTokens, res.FinishReason, res.Text, len(ref.IDs), ref.FinishReason, ref.Text)
	}
	printed := out.String()
	for _, want := range []string{ref.Text, res.TrackerURL + "/v1", "curl -N " + res.TrackerURL + "/v1/chat/completions",
		`base_url="` + res.TrackerURL + `/v1"`, "Ctrl-C", "stopping"} {
		if !strings.Contains(printed, want) {
			t.Errorf("the demo's output lacks %q:\n%s", want, printed)
		}
	}
	// Every listener is closed.
	for _, u := range []string{res.TrackerURL, "http" + strings.TrimPrefix(res.RelayURL, "ws"), res.Nodes[0].URL, res.Nodes[1].URL} {
		if c, err := net.DialTimeout("tcp", strings.TrimPrefix(u, "http://"), time.Second); err == nil {
			c.Close()
			t.Errorf("%s still accepts connections after the demo stopped", u)
		}
	}
}

// relayed sums the relay's successful relayed requests (tunnel and /rpc).
func relayed(t *testing.T, hc *http.Client, base string) float64 {
	t.Helper()
	resp, err := hc.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var sum float64
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		for _, path := range []string{"tunnel", "rpc"} {
			if rest, ok := strings.CutPrefix(sc.Text(), fmt.Sprintf(`meshgpu_relay_requests_total{path=%q,result="ok"} `, path)); ok {
				var v float64
				fmt.Sscanf(rest, "%g", &v)
				sum += v
			}
		}
	}
	return sum
}

// chatOnce is what an OpenAI client sends to the printed base URL.
func chatOnce(t *testing.T, hc *http.Client, base, model string) (string, int) {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"model": model, "max_tokens": DefaultMaxTokens, "temperature": 0,
		"messages": []map[string]string{{"role": "user", "content": DefaultPrompt}}})
	resp, err := hc.Post(base+"/chat/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var v struct {
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&v); err != nil || len(v.Choices) != 1 {
		return fmt.Sprintf("undecodable answer (%v)", err), resp.StatusCode
	}
	return v.Choices[0].Message.Content, resp.StatusCode
}

// With no model there (an empty directory) the demo synthesizes the tiny
// model into it and the mesh's answer equals one node's on that model.
func TestDemoSynthesizedMatchesOneNode(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "tiny")
	testenv.CheckGoroutines(t)
	var out bytes.Buffer
	res, err := Run(context.Background(), Options{Model: dir, Once: true, Backend: "cpu", Threads: 1, Out: &out, Logger: quiet()})
	if err != nil {
		t.Fatalf("Run: %v\n%s", err, out.String())
	}
	if !res.Synthesized || res.ModelDir != dir {
		t.Fatalf("model %s synthesized %v; want a model synthesized in %s", res.ModelDir, res.Synthesized, dir)
	}
	checkMesh(t, res)
	ref := oneNode(t, dir)
	if res.Text != ref.Text || res.CompletionTokens != len(ref.IDs) {
		t.Errorf("through the demo mesh (%d tokens):\n%q\none node (%d tokens):\n%q", res.CompletionTokens, res.Text, len(ref.IDs), ref.Text)
	}
	if !strings.Contains(out.String(), ref.Text) {
		t.Errorf("the printed answer lacks one node's text %q:\n%s", ref.Text, out.String())
	}
}

// A directory that holds something other than a model is refused before
// anything starts, and left as it was.
func TestDemoRefusesNonModelDirectory(t *testing.T) {
	testenv.CheckGoroutines(t)
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "notes.txt"), []byte("mine"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := Run(context.Background(), Options{Model: dir, Once: true, Backend: "cpu", Out: io.Discard, Logger: quiet()})
	if err == nil || !strings.Contains(err.Error(), "config.json") {
		t.Fatalf("Run on a non-model directory: %v; want an error naming config.json", err)
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		t.Errorf("the directory now holds %d entries; want it untouched", len(ents))
	}
	for _, o := range []Options{{BasePort: 65534}, {BasePort: -1}, {MaxTokens: -3}, {HopDType: "int8"}} {
		o.Model, o.Out = dir, io.Discard
		if _, err := Run(context.Background(), o); err == nil {
			t.Errorf("Run(%+v) accepted", o)
		}
	}
}

func TestSplitThree(t *testing.T) {
	for n, want := range map[int]string{3: "[[0 0] [1 1] [2 2]]", 6: "[[0 1] [2 3] [4 5]]", 7: "[[0 2] [3 4] [5 6]]",
		8: "[[0 2] [3 5] [6 7]]", 32: "[[0 10] [11 21] [22 31]]"} {
		got, err := splitThree(n)
		if err != nil || fmt.Sprint(got) != want {
			t.Errorf("splitThree(%d) = %v, %v; want %s", n, got, err, want)
		}
	}
	if _, err := splitThree(2); err == nil {
		t.Error("splitThree(2) accepted")
	}
}

// cancelOnAnswer cancels as soon as the first piece of the answer is
// printed: Ctrl-C in the middle of the stream.
type cancelOnAnswer struct {
	buf     bytes.Buffer
	cancel  context.CancelFunc
	started bool
}

func (w *cancelOnAnswer) Write(p []byte) (int, error) {
	if w.started && len(p) > 0 {
		w.cancel()
	}
	if bytes.Contains(p, []byte("answer (streamed")) {
		w.started = true
	}
	return w.buf.Write(p)
}

// Cancelling while the answer streams (Ctrl-C mid-answer) stops the
// stream and every server cleanly: Run returns nil and no goroutine is left.
func TestDemoCancelMidAnswer(t *testing.T) {
	dir := testenv.GoCoder(t)
	testenv.CheckGoroutines(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w := &cancelOnAnswer{cancel: cancel}
	start := time.Now()
	res, err := Run(ctx, Options{Model: dir, Backend: "cpu", Threads: 1, MaxTokens: 500, Out: w, Logger: quiet()})
	if err != nil {
		t.Fatalf("Run: %v\n%s", err, w.buf.String())
	}
	if !w.started || !strings.Contains(w.buf.String(), "(interrupted)") || res.CompletionTokens != 0 {
		t.Errorf("want the answer interrupted (%d tokens reported):\n%s", res.CompletionTokens, w.buf.String())
	}
	if d := time.Since(start); d > 15*time.Second {
		t.Errorf("stopping took %v", d)
	}
}

package node

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"meshgpu/engine"
	"meshgpu/internal/testenv"
	"meshgpu/native"
	"meshgpu/openai"
	"meshgpu/sample"
	"meshgpu/wire"
)

// goldenGen is one greedy continuation computed by HF transformers.
type goldenGen struct {
	Prompt    string  `json:"prompt"`
	PromptIDs []int32 `json:"prompt_ids"`
	FP32      struct {
		GreedyIDs  []int32 `json:"greedy_ids"`
		GreedyText string  `json:"greedy_text"`
	} `json:"fp32"`
}

// gocoderMesh is gocoder-6m split over three real servers with overlapping
// ranges 0-2, 2-4, 4-5, plus two heads over the same 0-2 model (one sends
// f32 hops, one bf16), and the whole model on one stack as the reference.
type gocoderMesh struct {
	full          *engine.Model
	headF32, head *Server
	f32URL, url   string // the heads
	mid, tail     string
	golden        []goldenGen
}

func loadGolden(t *testing.T, dir string) []goldenGen {
	b, err := os.ReadFile(filepath.Join(dir, "golden.json"))
	if err != nil {
		t.Fatal(err)
	}
	var g struct {
		Generations []goldenGen `json:"generations"`
	}
	if err := json.Unmarshal(b, &g); err != nil {
		t.Fatal(err)
	}
	if len(g.Generations) == 0 {
		t.Fatal("golden.json has no generations")
	}
	return g.Generations
}

// gocoderLoader opens the CPU backend and returns it with a loader of
// gocoder-6m layer ranges (last -1: the whole model), closed at cleanup.
func gocoderLoader(t *testing.T) (string, native.Backend, func(first, last int) *engine.Model) {
	dir := testenv.GoCoder(t)
	be, err := native.Open("cpu", native.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.Close() })
	return dir, be, func(first, last int) *engine.Model {
		m, err := engine.Load(dir, engine.Options{Backend: be, First: first, Last: last, MaxContext: 1024})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		return m
	}
}

func startGocoderMesh(t *testing.T) *gocoderMesh {
	dir, be, load := gocoderLoader(t)
	g := &gocoderMesh{full: load(0, -1), golden: loadGolden(t, dir)}
	headModel := load(0, 2)
	g.mid = startNode(t, &Server{Model: load(2, 4), Backend: be, PeerID: "mid"})
	g.tail = startNode(t, &Server{Model: load(4, 5), Backend: be, PeerID: "tail"})
	g.headF32 = &Server{Model: headModel, Backend: be, PeerID: "head-f32", Peers: []string{g.mid, g.tail}, HopDType: "f32"}
	g.f32URL = startNode(t, g.headF32)
	g.head = &Server{Model: headModel, Backend: be, PeerID: "head", Peers: []string{g.tail, g.mid}}
	g.url = startNode(t, g.head)
	return g
}

func (g *gocoderMesh) reference(t *testing.T, prompt []int32, maxTokens int) *engine.Result {
	res, err := g.full.Generate(context.Background(), prompt, engine.GenerateParams{MaxTokens: maxTokens, Sampling: sample.Params{}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// streamed is a parsed SSE response.
type streamed struct {
	ids    []int32
	text   string
	events int // data events before [DONE]
	done   bool
	finish string
	usage  *openai.Usage
	errMsg string
}

func postJSON(ctx context.Context, c *http.Client, url string, body any) (*http.Response, error) {
	b, _ := json.Marshal(body)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(b))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	return c.Do(req)
}

// readStream reads SSE events; stopAfter > 0 returns after that many.
func readStream(t *testing.T, r io.Reader, stopAfter int) streamed {
	var s streamed
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			continue
		}
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			t.Fatalf("SSE line without data: %q", line)
		}
		if data == "[DONE]" {
			s.done = true
			break
		}
		s.events++
		var c struct {
			openai.Completion
			Error *apiError `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			t.Fatalf("SSE event %q: %v", data, err)
		}
		if c.Error != nil {
			s.errMsg = c.Error.Message
			break
		}
		if c.Meshgpu != nil {
			s.ids = append(s.ids, c.Meshgpu.Token)
		}
		for _, ch := range c.Choices {
			if ch.Text != nil {
				s.text += *ch.Text
			}
			if ch.Delta != nil && ch.Delta.Content != nil {
				s.text += *ch.Delta.Content
			}
			if ch.FinishReason != nil {
				s.finish = *ch.FinishReason
			}
		}
		if c.Usage != nil {
			s.usage = c.Usage
		}
		if stopAfter > 0 && s.events >= stopAfter {
			break
		}
	}
	return s
}

// The acceptance test of the mesh: for every golden prompt, three nodes with
// overlapping ranges give the single-node text at temperature 0 (64
// tokens); with f32 hops the ids are identical, with bf16 hops the first 16.
func TestMeshMatchesSingleNode(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startGocoderMesh(t)
	c := &http.Client{Timeout: 60 * time.Second}
	defer c.CloseIdleConnections()
	for i, gen := range g.golden {
		ref := g.reference(t, gen.PromptIDs, 64)
		// The reference is itself checked against HF transformers.
		if !equalIDs(ref.IDs, gen.FP32.GreedyIDs, len(ref.IDs)) {
			t.Errorf("prompt %d: single node ids differ from golden fp32 greedy ids", i)
		}
		// f32 hops, streamed: ids and text identical.
		resp, err := postJSON(context.Background(), c, g.f32URL+"/v1/completions", map[string]any{
			"prompt": gen.PromptIDs, "max_tokens": 64, "temperature": 0, "stream": true})
		if err != nil {
			t.Fatal(err)
		}
		s := readStream(t, resp.Body, 0)
		resp.Body.Close()
		if s.errMsg != "" || !s.done {
			t.Fatalf("prompt %d f32: stream error %q, done %v", i, s.errMsg, s.done)
		}
		if !equalIDs(s.ids, ref.IDs, max(len(ref.IDs), len(s.ids))) || s.text != ref.Text {
			t.Errorf("prompt %d f32 hops: ids %v text %q\nwant ids %v text %q", i, s.ids, s.text, ref.IDs, ref.Text)
		}
		// bf16 hops (the default), not streamed, prompt as text.
		var out openai.Completion
		resp, err = postJSON(context.Background(), c, g.url+"/v1/completions", map[string]any{
			"prompt": gen.Prompt, "max_tokens": 64, "temperature": 0})
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || json.Unmarshal(body, &out) != nil || len(out.Choices) != 1 || out.Choices[0].Text == nil {
			t.Fatalf("prompt %d bf16: %d %s", i, resp.StatusCode, body)
		}
		if out.Usage == nil || out.Usage.PromptTokens != len(gen.PromptIDs) || out.Usage.CompletionTokens != ref.CompletionTokens {
			t.Errorf("prompt %d bf16: usage %+v, want %d prompt and %d completion tokens", i, out.Usage, len(gen.PromptIDs), ref.CompletionTokens)
		}
		// bf16 ids via a stream: the first 16 equal the reference.
		resp, err = postJSON(context.Background(), c, g.url+"/v1/completions", map[string]any{
			"prompt": gen.PromptIDs, "max_tokens": 64, "temperature": 0, "stream": true})
		if err != nil {
			t.Fatal(err)
		}
		sb := readStream(t, resp.Body, 0)
		resp.Body.Close()
		if !equalIDs(sb.ids, ref.IDs, 16) {
			t.Errorf("prompt %d bf16 hops: first 16 ids %v, want %v", i, sb.ids[:min(16, len(sb.ids))], ref.IDs[:16])
		}
		if sb.text != *out.Choices[0].Text {
			t.Errorf("prompt %d bf16: streamed text %q differs from the non-streamed %q", i, sb.text, *out.Choices[0].Text)
		}
	}
	waitSessions(t, c, g.f32URL, g.url, g.mid, g.tail)
}

func equalIDs(a, b []int32, n int) bool {
	if len(a) < n || len(b) < n {
		return false
	}
	for i := 0; i < n; i++ {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// SSE with a real client: one event per token, a final chunk with the
// finish reason and usage, then [DONE]; chat streams chat.completion.chunk.
// A client that hangs up mid-stream frees the session on every node.
func TestStreamingAndDisconnect(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startGocoderMesh(t)
	c := &http.Client{Timeout: 60 * time.Second}
	defer c.CloseIdleConnections()

	gen := g.golden[0]
	ref := g.reference(t, gen.PromptIDs, 24)
	resp, err := postJSON(context.Background(), c, g.url+"/v1/completions", map[string]any{
		"prompt": gen.PromptIDs, "max_tokens": 24, "temperature": 0, "stream": true, "stream_options": map[string]any{"include_usage": true}})
	if err != nil {
		t.Fatal(err)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("Content-Type %q", ct)
	}
	s := readStream(t, resp.Body, 0)
	resp.Body.Close()
	if !s.done || s.finish != ref.FinishReason || s.usage == nil || s.usage.CompletionTokens != ref.CompletionTokens {
		t.Fatalf("stream: done %v finish %q usage %+v; want finish %q, %d tokens", s.done, s.finish, s.usage, ref.FinishReason, ref.CompletionTokens)
	}
	if len(s.ids) != ref.CompletionTokens {
		t.Errorf("%d token events for %d tokens", len(s.ids), ref.CompletionTokens)
	}
	// Token events + finish chunk + usage chunk (+ one held-back text piece at most).
	if s.events < len(s.ids)+2 || s.events > len(s.ids)+3 {
		t.Errorf("%d events for %d tokens", s.events, len(s.ids))
	}

	// Chat: deltas with the assistant role first.
	resp, err = postJSON(context.Background(), c, g.url+"/v1/chat/completions", map[string]any{
		"messages": []map[string]string{{"role": "user", "content": "write a Go function"}}, "max_tokens": 12, "stream": true, "seed": 7})
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !bytes.Contains(raw, []byte(`"object":"chat.completion.chunk"`)) ||
		!bytes.Contains(raw, []byte(`"role":"assistant"`)) || !bytes.HasSuffix(bytes.TrimSpace(raw), []byte("data: [DONE]")) {
		t.Fatalf("chat stream: %d %s", resp.StatusCode, raw)
	}

	// Hang up after three events of a long generation.
	ctx, cancel := context.WithCancel(context.Background())
	resp, err = postJSON(ctx, c, g.url+"/v1/completions", map[string]any{
		"prompt": gen.PromptIDs, "max_tokens": 900, "temperature": 0, "stream": true, "ignore_eos": true})
	if err != nil {
		t.Fatal(err)
	}
	if s := readStream(t, resp.Body, 3); s.events != 3 {
		t.Fatalf("got %d events before hanging up", s.events)
	}
	for _, u := range []string{g.url, g.mid, g.tail} {
		if n := sessionsOn(t, c, u); n != 1 {
			t.Errorf("mid-stream %s holds %d sessions, want 1", u, n)
		}
	}
	cancel()
	resp.Body.Close()
	waitSessions(t, c, g.url, g.mid, g.tail)
}

// Bad hops against the middle node of a real mesh get 4xx JSON errors while
// a completion runs through that node and stays identical to one node's.
func TestBadHopsDuringRealGeneration(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startGocoderMesh(t)
	c := &http.Client{Timeout: 60 * time.Second}
	defer c.CloseIdleConnections()
	gen := g.golden[1]
	ref := g.reference(t, gen.PromptIDs, 64)

	var wg sync.WaitGroup
	stop := make(chan struct{})
	bad := make(chan string, 1)
	wg.Add(1)
	go func() {
		defer wg.Done()
		ok := hopReq{session: "evil", n: 1, hidden: 256, dtype: native.BF16, start: 3, end: -1, pos: 0}
		cases := []hopReq{
			with(ok, func(h *hopReq) { h.header = map[string]string{wire.HeaderShape: "1,255"} }),
			with(ok, func(h *hopReq) { h.body = make([]byte, 100) }),
			with(ok, func(h *hopReq) { h.start = 1 }),
			with(ok, func(h *hopReq) { h.pos = 9 }),
			with(ok, func(h *hopReq) {
				h.header = map[string]string{wire.HeaderRoute: `[{"endpoint":"gopher://x","start_layer":5}]`}
			}),
		}
		for n := 0; ; n++ {
			select {
			case <-stop:
				bad <- ""
				return
			default:
			}
			st, hdr, b := cases[n%len(cases)].send(t, c, g.mid)
			if st < 400 || st >= 500 || !strings.HasPrefix(hdr.Get("Content-Type"), "application/json") {
				bad <- fmt.Sprintf("bad hop %d: %d %s", n%len(cases), st, b)
				return
			}
		}
	}()
	resp, err := postJSON(context.Background(), c, g.url+"/v1/completions", map[string]any{
		"prompt": gen.PromptIDs, "max_tokens": 64, "temperature": 0})
	close(stop)
	wg.Wait()
	if msg := <-bad; msg != "" {
		t.Fatal(msg)
	}
	if err != nil {
		t.Fatal(err)
	}
	var out openai.Completion
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if json.Unmarshal(body, &out) != nil || len(out.Choices) != 1 || out.Choices[0].Text == nil || *out.Choices[0].Text != ref.Text {
		t.Fatalf("completion during bad hops: %s\nwant text %q", body, ref.Text)
	}
	waitSessions(t, c, g.url, g.mid, g.tail)
}

// OpenAI error shapes: malformed requests get 400 JSON naming the param.
func TestOpenAIErrors(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startGocoderMesh(t)
	c := &http.Client{Timeout: 30 * time.Second}
	defer c.CloseIdleConnections()
	cases := []struct {
		path, body string
		status     int
		param      string
	}{
		{"/v1/completions", `{"prompt":`, 400, ""},
		{"/v1/completions", `{}`, 400, "prompt"},
		{"/v1/completions", `{"prompt":[1,99999]}`, 400, "prompt"},
		{"/v1/completions", `{"prompt":"x","max_tokens":0}`, 400, "max_tokens"},
		{"/v1/completions", `{"prompt":"x","max_tokens":5000}`, 400, "max_tokens"},
		{"/v1/completions", `{"prompt":"x","n":17}`, 400, "n"},
		{"/v1/completions", `{"prompt":"x","stop":7}`, 400, "stop"},
		{"/v1/completions", `{"prompt":"x","temperature":-1}`, 400, "temperature"},
		{"/v1/chat/completions", `{"messages":[]}`, 400, "messages"},
	}
	for _, tc := range cases {
		resp, err := c.Post(g.url+tc.path, "application/json", strings.NewReader(tc.body))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.status {
			t.Errorf("%s %s: %d %s", tc.path, tc.body, resp.StatusCode, b)
			continue
		}
		e := decodeError(t, resp.StatusCode, resp.Header, b)
		if e.Param != tc.param {
			t.Errorf("%s %s: param %q, want %q", tc.path, tc.body, e.Param, tc.param)
		}
	}
	// A route header from a client is refused: only a ticket names a route.
	req, _ := http.NewRequest(http.MethodPost, g.url+"/v1/completions", strings.NewReader(`{"prompt":"x"}`))
	req.Header.Set(wire.HeaderRoute, fmt.Sprintf(`[{"endpoint":%q,"start_layer":3,"end_layer":4}]`, g.mid))
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 400 || !strings.Contains(string(b), wire.HeaderTicket) {
		t.Errorf("client route: %d %s", resp.StatusCode, b)
	}
	var models struct {
		Data []struct{ ID string } `json:"data"`
	}
	getJSON(t, c, g.url+"/v1/models", &models)
	if len(models.Data) != 1 || models.Data[0].ID != "gocoder-6m" {
		t.Errorf("/v1/models: %+v", models)
	}
}

// A resumed request (prompt + continue_ids of an earlier attempt) continues
// the same seeded sequence: the proxy's failover replays without a seam.
func TestContinueIDs(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startGocoderMesh(t)
	c := &http.Client{Timeout: 60 * time.Second}
	defer c.CloseIdleConnections()
	run := func(body map[string]any) streamed {
		body["stream"] = true
		resp, err := postJSON(context.Background(), c, g.url+"/v1/completions", body)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		return readStream(t, resp.Body, 0)
	}
	prompt := g.golden[2].PromptIDs
	whole := run(map[string]any{"prompt": prompt, "max_tokens": 20, "temperature": 0.9, "seed": 42, "ignore_eos": true})
	if len(whole.ids) != 20 {
		t.Fatalf("got %d ids", len(whole.ids))
	}
	rest := run(map[string]any{"prompt": prompt, "max_tokens": 12, "temperature": 0.9, "seed": 42, "ignore_eos": true,
		"meshgpu": map[string]any{"continue_ids": whole.ids[:8]}})
	if !equalIDs(rest.ids, whole.ids[8:], 12) {
		t.Fatalf("continuation %v, want %v", rest.ids, whole.ids[8:])
	}
	if rest.usage == nil || rest.usage.PromptTokens != len(prompt) || rest.usage.CompletionTokens != 12 {
		t.Errorf("usage %+v", rest.usage)
	}
}

// The repetition penalty needs the token history on the node that samples:
// over f32 hops it must give the single node's ids exactly.
func TestRepetitionPenaltyAcrossMesh(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startGocoderMesh(t)
	c := &http.Client{Timeout: 60 * time.Second}
	defer c.CloseIdleConnections()
	gen := g.golden[0] // greedy output repeats itself: the penalty changes it
	p := sample.Params{Temperature: 0, RepetitionPenalty: 1.5}
	ref, err := g.full.Generate(context.Background(), gen.PromptIDs, engine.GenerateParams{MaxTokens: 40, Sampling: p}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if equalIDs(ref.IDs, gen.FP32.GreedyIDs, len(ref.IDs)) {
		t.Fatal("the penalty did not change the greedy ids; the test would prove nothing")
	}
	resp, err := postJSON(context.Background(), c, g.f32URL+"/v1/completions", map[string]any{
		"prompt": gen.PromptIDs, "max_tokens": 40, "temperature": 0, "repetition_penalty": 1.5, "stream": true})
	if err != nil {
		t.Fatal(err)
	}
	s := readStream(t, resp.Body, 0)
	resp.Body.Close()
	if !equalIDs(s.ids, ref.IDs, max(len(s.ids), len(ref.IDs))) {
		t.Fatalf("mesh ids %v\nwant %v", s.ids, ref.IDs)
	}
}

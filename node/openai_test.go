package node

import (
	"context"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"meshgpu/internal/metricstest"
	"meshgpu/internal/testenv"
	"meshgpu/native"
	"meshgpu/openai"
)

// post sends body and decodes a 200 JSON answer.
func postOK(t *testing.T, c *http.Client, url string, body any) (openai.Completion, http.Header) {
	t.Helper()
	resp, err := postJSON(context.Background(), c, url, body)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("%s: %d %s", url, resp.StatusCode, b)
	}
	var out openai.Completion
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatalf("%s: %v: %s", url, err, b)
	}
	return out, resp.Header
}

// goldenLogits is the HF fp32 logits row after each golden prompt.
func goldenLogits(t *testing.T) [][]float64 {
	b, err := os.ReadFile(filepath.Join(testenv.GoCoder(t), "golden.json"))
	if err != nil {
		t.Fatal(err)
	}
	var g struct {
		Generations []struct {
			FP32 struct {
				All []float64 `json:"last_logits_all"`
			} `json:"fp32"`
		} `json:"generations"`
	}
	if err := json.Unmarshal(b, &g); err != nil {
		t.Fatal(err)
	}
	out := make([][]float64, len(g.Generations))
	for i, gen := range g.Generations {
		out[i] = gen.FP32.All // nil where golden.json has no full row
	}
	return out
}

func logSoftmax(x []float64) []float64 {
	mx := math.Inf(-1)
	for _, v := range x {
		mx = math.Max(mx, v)
	}
	var s float64
	for _, v := range x {
		s += math.Exp(v - mx)
	}
	out := make([]float64, len(x))
	for i, v := range x {
		out[i] = v - mx - math.Log(s)
	}
	return out
}

// The first token's logprobs, computed on the tail of a three-node mesh,
// match HF's logits of golden.json: the same top 5 ids and log-softmax
// values, on both endpoints, streamed and not.
func TestLogprobsMatchGolden(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startGocoderMesh(t)
	c := &http.Client{Timeout: 60 * time.Second}
	defer c.CloseIdleConnections()
	logits := goldenLogits(t)
	checked := 0
	for i, gen := range g.golden {
		if logits[i] == nil {
			continue
		}
		checked++
		ref := logSoftmax(logits[i])
		order := make([]int, len(ref))
		for k := range order {
			order[k] = k
		}
		sort.SliceStable(order, func(a, b int) bool { return ref[order[a]] > ref[order[b]] })
		out, _ := postOK(t, c, g.f32URL+"/v1/completions", map[string]any{"prompt": gen.PromptIDs, "max_tokens": 3, "temperature": 0, "logprobs": 5})
		b, _ := json.Marshal(out.Choices[0].Logprobs)
		var lp openai.CompletionLogprobs
		if err := json.Unmarshal(b, &lp); err != nil || len(lp.Tokens) != 3 || len(lp.TopLogprobs) != 3 || len(lp.TextOffset) != 3 {
			t.Fatalf("prompt %d: logprobs %s", i, b)
		}
		first := g.full.Tokenizer.Decode([]int32{gen.FP32.GreedyIDs[0]}, false)
		if lp.Tokens[0] != first || math.Abs(lp.TokenLogprobs[0]-ref[gen.FP32.GreedyIDs[0]]) > 0.02 {
			t.Errorf("prompt %d: first token %q logprob %v, HF %q %v", i, lp.Tokens[0], lp.TokenLogprobs[0], first, ref[gen.FP32.GreedyIDs[0]])
		}
		for _, id := range order[:5] {
			tok := g.full.Tokenizer.Decode([]int32{int32(id)}, false)
			got, ok := lp.TopLogprobs[0][tok]
			if !ok || math.Abs(got-ref[id]) > 0.02 {
				t.Errorf("prompt %d: top logprob of %q (id %d) = %v (present %v), HF %v", i, tok, id, got, ok, ref[id])
			}
		}
		// chat shape, streamed: every content chunk carries its token's logprobs
		resp, err := postJSON(context.Background(), c, g.url+"/v1/chat/completions", map[string]any{
			"messages": []map[string]any{{"role": "user", "content": gen.Prompt}}, "max_tokens": 4, "temperature": 0,
			"logprobs": true, "top_logprobs": 3, "stream": true})
		if err != nil {
			t.Fatal(err)
		}
		sr := openai.NewSSEReader(resp.Body, 0)
		n := 0
		for {
			d, err := sr.Next()
			if err != nil || d == openai.SSEDone {
				break
			}
			var ch struct {
				Choices []struct {
					Logprobs *openai.ChatLogprobs `json:"logprobs"`
					Finish   *string              `json:"finish_reason"`
				} `json:"choices"`
			}
			json.Unmarshal([]byte(d), &ch)
			if len(ch.Choices) == 0 || ch.Choices[0].Finish != nil {
				continue
			}
			l := ch.Choices[0].Logprobs
			if l == nil || len(l.Content) != 1 || len(l.Content[0].TopLogprobs) != 3 || l.Content[0].Logprob > 0 ||
				l.Content[0].TopLogprobs[0].Logprob < l.Content[0].TopLogprobs[2].Logprob {
				t.Fatalf("prompt %d: chunk logprobs %s", i, d)
			}
			n++
		}
		resp.Body.Close()
		if n == 0 {
			t.Errorf("prompt %d: no streamed chunk had logprobs", i)
		}
	}
	if checked == 0 {
		t.Fatal("golden.json has no last_logits_all to compare with")
	}
}

// greedyWithPenalties is an independent reference: the full model on one
// stack, logits read each step, OpenAI's penalties applied here by hand.
func greedyWithPenalties(t *testing.T, g *gocoderMesh, prompt []int32, n int, presence, frequency float64) []int32 {
	m := g.full
	cfg := m.Stack.Config()
	sess, err := m.Stack.NewSession(len(prompt) + n)
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	logits := make([]float32, cfg.Vocab)
	counts := map[int32]int{}
	var out []int32
	tokens, pos := prompt, 0
	for len(out) < n {
		row := cfg.Hidden * 4
		act := make([]byte, len(tokens)*row)
		if err := m.Stack.Embed(tokens, native.F32, act); err != nil {
			t.Fatal(err)
		}
		if err := m.Stack.Forward([]native.Step{{Session: sess, Pos: pos, NTokens: len(tokens)}}, 0, cfg.NumLayers-1, native.F32, act, act); err != nil {
			t.Fatal(err)
		}
		if err := m.Stack.Logits(1, native.F32, act[(len(tokens)-1)*row:], logits); err != nil {
			t.Fatal(err)
		}
		best, bestV := -1, math.Inf(-1)
		for id, l := range logits {
			v := float64(l)
			if c := counts[int32(id)]; c > 0 {
				v -= frequency*float64(c) + presence
			}
			if v > bestV {
				best, bestV = id, v
			}
		}
		out = append(out, int32(best))
		counts[int32(best)]++
		pos += len(tokens)
		tokens = []int32{int32(best)}
	}
	return out
}

// Presence and frequency penalties, applied on the tail node from the token
// history the head sends, give what the hand-written reference gives, and
// change the output (the golden greedy continuations repeat themselves).
func TestPresenceFrequencyPenalties(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startGocoderMesh(t)
	c := &http.Client{Timeout: 60 * time.Second}
	defer c.CloseIdleConnections()
	gen := g.golden[0]
	const n = 24
	for _, tc := range []struct{ presence, frequency float64 }{{0, 1.5}, {1.2, 0}, {0.5, 0.8}} {
		want := greedyWithPenalties(t, g, gen.PromptIDs, n, tc.presence, tc.frequency)
		resp, err := postJSON(context.Background(), c, g.f32URL+"/v1/completions", map[string]any{"prompt": gen.PromptIDs, "max_tokens": n,
			"temperature": 0, "ignore_eos": true, "presence_penalty": tc.presence, "frequency_penalty": tc.frequency, "stream": true})
		if err != nil {
			t.Fatal(err)
		}
		got := readStream(t, resp.Body, 0)
		resp.Body.Close()
		if !equalIDs(got.ids, want, n) {
			t.Errorf("presence %v frequency %v: %v, reference %v", tc.presence, tc.frequency, got.ids, want)
		}
		if equalIDs(got.ids, gen.FP32.GreedyIDs[:n], n) {
			t.Errorf("presence %v frequency %v: same as without penalties", tc.presence, tc.frequency)
		}
	}
}

// n choices, batched prompts and echo give, choice by choice, what the
// single requests give; usage counts each prompt once.
func TestChoicesPromptsEcho(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startGocoderMesh(t)
	c := &http.Client{Timeout: 60 * time.Second}
	defer c.CloseIdleConnections()
	single := func(body map[string]any) string {
		out, _ := postOK(t, c, g.url+"/v1/completions", body)
		return *out.Choices[0].Text
	}
	p0, p1 := g.golden[0].Prompt, g.golden[1].Prompt
	out, _ := postOK(t, c, g.url+"/v1/completions", map[string]any{"prompt": []string{p0, p1}, "n": 2, "max_tokens": 6, "temperature": 1.5, "seed": 7})
	if len(out.Choices) != 4 {
		t.Fatalf("%d choices, want 4", len(out.Choices))
	}
	distinct := map[string]bool{}
	for i, ch := range out.Choices {
		prompt := []string{p0, p1}[i/2]
		want := single(map[string]any{"prompt": prompt, "max_tokens": 6, "temperature": 1.5, "seed": int64(openai.ChoiceSeed(7, i%2))})
		if ch.Index != i || *ch.Text != want {
			t.Errorf("choice %d (index %d): %q, the single request gives %q", i, ch.Index, *ch.Text, want)
		}
		distinct[*ch.Text] = true
	}
	if len(distinct) < 3 {
		t.Errorf("choices are not distinct draws: %v", distinct)
	}
	np0 := len(g.full.Tokenizer.Encode(p0, true))
	np1 := len(g.full.Tokenizer.Encode(p1, true))
	if out.Usage.PromptTokens != np0+np1 || out.Usage.CompletionTokens != 24 {
		t.Errorf("usage %+v, want %d prompt and 24 completion tokens", out.Usage, np0+np1)
	}
	// echo: the prompt, then the text
	plain := single(map[string]any{"prompt": p0, "max_tokens": 5, "temperature": 0})
	echoed := single(map[string]any{"prompt": p0, "max_tokens": 5, "temperature": 0, "echo": true})
	if echoed != p0+plain {
		t.Errorf("echo: %q, want %q", echoed, p0+plain)
	}
	// streamed n=2: chunks of both indices, each with its own finish
	resp, err := postJSON(context.Background(), c, g.url+"/v1/chat/completions", map[string]any{
		"messages": []map[string]any{{"role": "user", "content": p0}}, "n": 2, "max_tokens": 4, "seed": 3, "stream": true,
		"stream_options": map[string]any{"include_usage": true}})
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sr := openai.NewSSEReader(resp.Body, 0)
	finishes, roles := map[int]int{}, map[int]int{}
	var usage *openai.Usage
	for {
		d, err := sr.Next()
		if err != nil {
			t.Fatalf("stream ended without [DONE]: %v", err)
		}
		if d == openai.SSEDone {
			break
		}
		var ch openai.Completion
		if err := json.Unmarshal([]byte(d), &ch); err != nil {
			t.Fatal(err)
		}
		if ch.Usage != nil {
			usage = ch.Usage
		}
		for _, x := range ch.Choices {
			if x.FinishReason != nil {
				finishes[x.Index]++
			}
			if x.Delta != nil && x.Delta.Role == "assistant" {
				roles[x.Index]++
			}
		}
	}
	if finishes[0] != 1 || finishes[1] != 1 || roles[0] != 1 || roles[1] != 1 || usage == nil || usage.CompletionTokens != 8 {
		t.Errorf("n=2 stream: finishes %v roles %v usage %+v", finishes, roles, usage)
	}
}

// The Vercel AI SDK sends content as a list of text parts; the answer is
// the string form's.
func TestContentPartsAnswerAsString(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startGocoderMesh(t)
	c := &http.Client{Timeout: 60 * time.Second}
	defer c.CloseIdleConnections()
	body := func(content any) map[string]any {
		return map[string]any{"messages": []map[string]any{{"role": "system", "content": "You write Go."}, {"role": "user", "content": content}},
			"max_tokens": 8, "temperature": 0}
	}
	str, _ := postOK(t, c, g.url+"/v1/chat/completions", body("Write a loop.\nIn Go."))
	parts, _ := postOK(t, c, g.url+"/v1/chat/completions", body([]map[string]any{{"type": "text", "text": "Write a loop."}, {"type": "text", "text": "In Go."}}))
	if *str.Choices[0].Message.Content != *parts.Choices[0].Message.Content || str.Usage.PromptTokens != parts.Usage.PromptTokens {
		t.Errorf("parts answer %q (%d prompt tokens), string %q (%d)", *parts.Choices[0].Message.Content, parts.Usage.PromptTokens,
			*str.Choices[0].Message.Content, str.Usage.PromptTokens)
	}
}

// Ids are random and unique, x-request-id comes back, /v1/models has
// created and /v1/models/{id} answers; a prompt too long says so.
func TestOpenAISurface(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startGocoderMesh(t)
	c := &http.Client{Timeout: 60 * time.Second}
	defer c.CloseIdleConnections()
	ids := map[string]bool{}
	for i := 0; i < 3; i++ {
		out, h := postOK(t, c, g.url+"/v1/completions", map[string]any{"prompt": "x", "max_tokens": 1})
		if ids[out.ID] || !strings.HasPrefix(out.ID, "cmpl-") || len(out.ID) < 20 || h.Get("X-Request-Id") == "" {
			t.Errorf("id %q (seen %v), request id %q", out.ID, ids[out.ID], h.Get("X-Request-Id"))
		}
		ids[out.ID] = true
	}
	req, _ := http.NewRequest("GET", g.url+"/v1/models", nil)
	req.Header.Set("X-Request-Id", "mine-1")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var list openai.ModelList
	json.NewDecoder(resp.Body).Decode(&list)
	resp.Body.Close()
	if resp.Header.Get("X-Request-Id") != "mine-1" || len(list.Data) != 1 || list.Data[0].Created == 0 {
		t.Errorf("models %+v, request id %q", list, resp.Header.Get("X-Request-Id"))
	}
	for _, tc := range []struct {
		path   string
		status int
	}{{"/v1/models/gocoder-6m", 200}, {"/v1/models/other", 404}} {
		resp, err := c.Get(g.url + tc.path)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.status {
			t.Errorf("%s: %d %s", tc.path, resp.StatusCode, b)
		}
	}
	long := strings.Repeat("func main() { println(1) }\n", 200)
	resp, err = postJSON(context.Background(), c, g.url+"/v1/completions", map[string]any{"prompt": long})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 400 || !strings.Contains(string(b), "shorten the prompt") || strings.Contains(string(b), "-") && strings.Contains(string(b), "asks for -") {
		t.Errorf("long prompt: %d %s", resp.StatusCode, b)
	}
	resp, err = postJSON(context.Background(), c, g.url+"/v1/completions", map[string]any{"prompt": "x", "max_tokens": 1023})
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 400 || !strings.Contains(string(b), "ask for at most") {
		t.Errorf("max_tokens over the room: %d %s", resp.StatusCode, b)
	}
}

// A head without a route is not ready: /ready and the OpenAI endpoints say
// 503 with the reason; with its peers it is ready.
func TestReadiness(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startGocoderMesh(t)
	c := &http.Client{Timeout: 60 * time.Second}
	defer c.CloseIdleConnections()
	lonely := startNode(t, &Server{Model: g.head.Model, PeerID: "lonely"})
	for _, tc := range []struct {
		url    string
		status int
	}{{g.url + "/ready", 200}, {g.tail + "/ready", 200}, {lonely + "/ready", 503}, {lonely + "/health", 200}} {
		resp, err := c.Get(tc.url)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.status {
			t.Errorf("%s: %d %s, want %d", tc.url, resp.StatusCode, b, tc.status)
		}
	}
	resp, err := postJSON(context.Background(), c, lonely+"/v1/chat/completions", map[string]any{"messages": []map[string]any{{"role": "user", "content": "hi"}}})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 503 || !strings.Contains(string(b), "--peer") {
		t.Errorf("no route: %d %s", resp.StatusCode, b)
	}
}

// The head's /metrics is promlint-clean and its serving series move with a
// request: time to first token, inter-token latency, request duration,
// prompt and generation tokens; running and waiting are back to 0.
func TestServingMetrics(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startGocoderMesh(t)
	c := &http.Client{Timeout: 60 * time.Second}
	defer c.CloseIdleConnections()
	before := metricstest.Scrape(t, c, g.url+"/metrics")
	out, _ := postOK(t, c, g.url+"/v1/completions", map[string]any{"prompt": g.golden[0].PromptIDs, "max_tokens": 5, "temperature": 0, "ignore_eos": true})
	after := metricstest.Scrape(t, c, g.url+"/metrics")
	for _, tc := range []struct {
		name  string
		delta float64
	}{
		{"meshgpu_node_time_to_first_token_seconds", 1},
		{"meshgpu_node_inter_token_latency_seconds", 4},
		{"meshgpu_node_request_duration_seconds", 1},
		{"meshgpu_node_prompt_tokens_total", float64(out.Usage.PromptTokens)},
		{"meshgpu_node_generation_tokens_total", 5},
	} {
		b, _ := metricstest.Value(before, tc.name)
		a, ok := metricstest.Value(after, tc.name)
		if !ok || a-b != tc.delta {
			t.Errorf("%s moved by %v (present %v), want %v", tc.name, a-b, ok, tc.delta)
		}
	}
	for _, name := range []string{"meshgpu_node_requests_running", "meshgpu_node_requests_waiting"} {
		if v, ok := metricstest.Value(after, name); !ok || v != 0 {
			t.Errorf("%s = %v (present %v) after the request", name, v, ok)
		}
	}
	for _, name := range []string{"meshgpu_build_info", "go_goroutines", "process_resident_memory_bytes"} {
		if _, ok := metricstest.Value(after, name); !ok {
			t.Errorf("no %s", name)
		}
	}
	// while a stream runs, it counts as running
	resp, err := postJSON(context.Background(), c, g.url+"/v1/completions", map[string]any{"prompt": "x", "max_tokens": 50, "stream": true, "ignore_eos": true})
	if err != nil {
		t.Fatal(err)
	}
	sr := openai.NewSSEReader(resp.Body, 0)
	sr.Next()
	during := metricstest.Scrape(t, c, g.url+"/metrics")
	resp.Body.Close()
	if v, _ := metricstest.Value(during, "meshgpu_node_requests_running"); v != 1 {
		t.Errorf("running = %v during a stream, want 1", v)
	}
	metricstest.Scrape(t, c, g.tail+"/metrics")
}

package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"

	"meshgpu/daemon"
	"meshgpu/identity"
	"meshgpu/internal/schemacheck"
	"meshgpu/internal/testenv"
	"meshgpu/openai"
	"meshgpu/tracker"
	"meshgpu/wire"
)

// openaiMesh is gocoder-6m split over a head (0-2, with the tail as its
// --peer) and a tail (3-5), both registered at an in-process tracker: the
// same generations are reachable directly on the head and through the
// tracker's proxy.
type openaiMesh struct {
	head, tracker string
	hc            *http.Client
}

func startOpenAIMesh(t *testing.T) *openaiMesh {
	return startOpenAIMeshIn(t, testenv.GoCoder(t))
}

// qwenTemplateModel is gocoder-6m's files with Qwen2.5-Instruct's chat
// template (model/chat/testdata), which renders tools.
func qwenTemplateModel(t *testing.T) string {
	src := testenv.GoCoder(t)
	dir := modelCopy(t, src, "chat_template.jinja")
	tmpl, err := os.ReadFile(filepath.Join(testenv.RepoRoot(), "model", "chat", "testdata", "qwen2.5-instruct.jinja"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "chat_template.jinja"), tmpl, 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

func startOpenAIMeshIn(t *testing.T, dir string) *openaiMesh {
	be := openCPU(t)
	tr := tracker.NewServer(tracker.Config{Logger: quietLogger(), HeartbeatTimeout: time.Minute, Endpoints: tracker.AddrPolicy{AllowLoopback: true}})
	ts := httptest.NewServer(tr.Handler())
	t.Cleanup(ts.Close)
	// The tail takes the tracker's tickets and, for the head's own --peer
	// route, the head's (--trust-head).
	headID := newIdentity(t)
	start := func(id *identity.Identity, first, last int, peers, trust []string) *daemon.Node {
		n, err := daemon.Start(context.Background(), daemon.Config{ModelDir: dir, Backend: be, Identity: id,
			First: first, Last: last, Peers: peers, TrustHeads: trust, HopDType: "f32", MaxSessions: 8, MaxContext: 512,
			TrackerURL: ts.URL, HeartbeatInterval: time.Second, Logger: quietLogger()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { n.Close() })
		return n
	}
	tail := start(newIdentity(t), 3, 5, nil, []string{headID.PeerID})
	head := start(headID, 0, 2, []string{tail.URL()}, nil)
	m := &openaiMesh{head: head.URL(), tracker: ts.URL, hc: newHTTPClient(t)}
	deadline := time.Now().Add(20 * time.Second)
	for {
		var list openai.ModelList
		getJSON(t, m.hc, ts.URL+"/v1/models", &list)
		if len(list.Data) == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the tracker never listed the model: %+v", list)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return m
}

// recorded is one request the official SDK sent (testdata/openai-sdk, made
// with record.mjs against a capturing server; see docs/protocol.md).
type recorded struct {
	SDK  string         `json:"sdk"`
	Path string         `json:"path"`
	Body map[string]any `json:"body"`
}

func loadRecorded(t *testing.T) map[string]recorded {
	files, err := filepath.Glob("testdata/openai-sdk/*.json")
	if err != nil || len(files) == 0 {
		t.Fatalf("no recorded SDK requests: %v", err)
	}
	out := map[string]recorded{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var r recorded
		if err := json.Unmarshal(b, &r); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		out[strings.TrimSuffix(filepath.Base(f), ".json")] = r
	}
	return out
}

// reply is what a server answered.
type reply struct {
	status int
	header http.Header
	body   []byte
	events []string // SSE data, [DONE] included
}

func send(t *testing.T, hc *http.Client, base, path string, body any, header map[string]string) reply {
	t.Helper()
	b, _ := json.Marshal(body)
	req, _ := http.NewRequest(http.MethodPost, base+strings.TrimPrefix(path, "/v1")+"", bytes.NewReader(b))
	req.URL.Path = path
	req.Header.Set("Content-Type", "application/json")
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	r := reply{status: resp.StatusCode, header: resp.Header}
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		sr := openai.NewSSEReader(resp.Body, 0)
		for {
			d, err := sr.Next()
			if err != nil {
				break
			}
			r.events = append(r.events, d)
		}
		return r
	}
	r.body, _ = io.ReadAll(resp.Body)
	return r
}

// The checks below are what the OpenAI SDKs read: field names and JSON
// types of the published API reference.
type shape map[string]any

func isInt(v any) bool {
	f, ok := v.(float64)
	return ok && f == float64(int64(f))
}

func checkCompletion(t *testing.T, name string, chat, chunk bool, v shape) {
	t.Helper()
	want := openai.Object(chat, chunk)
	if v["object"] != want {
		t.Errorf("%s: object %v, want %s", name, v["object"], want)
	}
	prefix := openai.IDPrefix(chat)
	if id, _ := v["id"].(string); !strings.HasPrefix(id, prefix) {
		t.Errorf("%s: id %v, want %s...", name, v["id"], prefix)
	}
	if !isInt(v["created"]) || v["created"].(float64) < 1.7e9 {
		t.Errorf("%s: created %v", name, v["created"])
	}
	if _, ok := v["model"].(string); !ok {
		t.Errorf("%s: model %v", name, v["model"])
	}
	choices, ok := v["choices"].([]any)
	if !ok {
		t.Fatalf("%s: choices %v", name, v["choices"])
	}
	for _, c := range choices {
		c := c.(map[string]any)
		if !isInt(c["index"]) {
			t.Errorf("%s: choice index %v", name, c["index"])
		}
		if f, has := c["finish_reason"]; !has {
			t.Errorf("%s: choice without finish_reason", name)
		} else if f != nil && f != "stop" && f != "length" && f != "tool_calls" {
			t.Errorf("%s: finish_reason %v", name, f)
		}
		if _, has := c["logprobs"]; !has {
			t.Errorf("%s: choice without logprobs (null or an object)", name)
		}
		switch {
		case chat && chunk:
			d, ok := c["delta"].(map[string]any)
			if !ok {
				t.Errorf("%s: chunk choice without delta: %v", name, c)
			} else if s, has := d["content"]; has {
				if _, ok := s.(string); !ok {
					t.Errorf("%s: delta content %v", name, s)
				}
			}
		case chat:
			m, ok := c["message"].(map[string]any)
			if !ok || m["role"] != "assistant" {
				t.Errorf("%s: message %v", name, c["message"])
			} else if _, ok := m["content"].(string); !ok {
				t.Errorf("%s: message content %v", name, m["content"])
			}
		default:
			if _, ok := c["text"].(string); !ok {
				t.Errorf("%s: text %v", name, c["text"])
			}
		}
	}
	if u, has := v["usage"]; has && u != nil {
		u := u.(map[string]any)
		for _, k := range []string{"prompt_tokens", "completion_tokens", "total_tokens"} {
			if !isInt(u[k]) {
				t.Errorf("%s: usage.%s %v", name, k, u[k])
			}
		}
		if u["total_tokens"].(float64) != u["prompt_tokens"].(float64)+u["completion_tokens"].(float64) {
			t.Errorf("%s: usage %v does not add up", name, u)
		}
	}
}

func checkChatLogprobs(t *testing.T, name string, lp any, top int) {
	t.Helper()
	m, ok := lp.(map[string]any)
	if !ok {
		t.Errorf("%s: logprobs %v", name, lp)
		return
	}
	content, ok := m["content"].([]any)
	if !ok || len(content) == 0 {
		t.Errorf("%s: logprobs.content %v", name, m["content"])
		return
	}
	for _, e := range content {
		e := e.(map[string]any)
		_, okTok := e["token"].(string)
		l, okLP := e["logprob"].(float64)
		tl, okTop := e["top_logprobs"].([]any)
		if _, okB := e["bytes"].([]any); !okTok || !okLP || l > 0 || !okTop || len(tl) != top || !okB {
			t.Errorf("%s: logprob entry %v", name, e)
		}
	}
}

// TestOpenAISDKRequests replays every recorded SDK request on the head and
// on the tracker; each answer parses as the SDK expects, and the head's and
// the tracker's greedy answers are the same text.
func TestOpenAISDKRequests(t *testing.T) {
	testenv.CheckGoroutines(t)
	m := startOpenAIMesh(t)
	recs := loadRecorded(t)
	names := make([]string, 0, len(recs))
	for n := range recs {
		names = append(names, n)
	}
	sort.Strings(names)
	texts := map[string]map[string]string{}
	for _, name := range names {
		rec := recs[name]
		chat := strings.HasSuffix(rec.Path, "/chat/completions")
		for _, target := range []struct{ label, base string }{{"head", m.head}, {"tracker", m.tracker}} {
			label := name + " on the " + target.label
			r := send(t, m.hc, target.base, rec.Path, rec.Body, map[string]string{"X-Request-Id": "sdk-" + name})
			if r.header.Get("X-Request-Id") != "sdk-"+name {
				t.Errorf("%s: X-Request-Id %q", label, r.header.Get("X-Request-Id"))
			}
			switch name {
			case "chat-image":
				checkRefusal(t, label, r, 400, "messages[0].content[1].type")
				continue
			case "chat-tools":
				checkRefusal(t, label, r, 400, "tools")
				continue
			}
			if r.status != 200 {
				t.Errorf("%s: %d %s", label, r.status, r.body)
				continue
			}
			var text strings.Builder
			if stream, _ := rec.Body["stream"].(bool); stream {
				if len(r.events) < 2 || r.events[len(r.events)-1] != openai.SSEDone {
					t.Errorf("%s: stream %q does not end with [DONE]", label, r.events)
					continue
				}
				sawUsage := false
				for _, ev := range r.events[:len(r.events)-1] {
					var v shape
					if err := json.Unmarshal([]byte(ev), &v); err != nil {
						t.Fatalf("%s: event %q: %v", label, ev, err)
					}
					checkCompletion(t, label, chat, true, v)
					if v["usage"] != nil {
						sawUsage = true
					}
					for _, c := range v["choices"].([]any) {
						c := c.(map[string]any)
						if chat {
							d := c["delta"].(map[string]any)
							s, _ := d["content"].(string)
							text.WriteString(s)
							if name == "chat-logprobs-stream" && s != "" {
								checkChatLogprobs(t, label, c["logprobs"], 2)
							}
						} else {
							text.WriteString(c["text"].(string))
						}
					}
				}
				if so, _ := rec.Body["stream_options"].(map[string]any); so != nil && so["include_usage"] == true && !sawUsage {
					t.Errorf("%s: include_usage but no usage chunk", label)
				}
			} else {
				var v shape
				if err := json.Unmarshal(r.body, &v); err != nil {
					t.Fatalf("%s: %v: %s", label, err, r.body)
				}
				checkCompletion(t, label, chat, false, v)
				choices := v["choices"].([]any)
				want := 1
				if n, ok := rec.Body["n"].(float64); ok {
					want = int(n)
				}
				if p, ok := rec.Body["prompt"].([]any); ok {
					if _, isStr := p[0].(string); isStr {
						want *= len(p)
					}
				}
				if len(choices) != want {
					t.Errorf("%s: %d choices, want %d", label, len(choices), want)
				}
				for i, c := range choices {
					c := c.(map[string]any)
					if int(c["index"].(float64)) != i {
						t.Errorf("%s: choice %d has index %v", label, i, c["index"])
					}
					if chat {
						text.WriteString(c["message"].(map[string]any)["content"].(string))
					} else {
						text.WriteString(c["text"].(string))
					}
					text.WriteString("|")
				}
				switch name {
				case "chat-logprobs":
					checkChatLogprobs(t, label, choices[0].(map[string]any)["logprobs"], 3)
				case "completions-logprobs":
					lp, _ := choices[0].(map[string]any)["logprobs"].(map[string]any)
					toks, _ := lp["tokens"].([]any)
					tops, _ := lp["top_logprobs"].([]any)
					offs, _ := lp["text_offset"].([]any)
					if len(toks) != 4 || len(tops) != 4 || len(offs) != 4 {
						t.Errorf("%s: completions logprobs %v", label, lp)
					}
				case "chat-json-object", "chat-json-schema":
					content := choices[0].(map[string]any)["message"].(map[string]any)["content"].(string)
					var doc any
					if err := json.Unmarshal([]byte(content), &doc); err != nil || choices[0].(map[string]any)["finish_reason"] != "stop" {
						t.Errorf("%s: %q is not a finished JSON document: %v", label, content, err)
					} else if name == "chat-json-schema" {
						rf := rec.Body["response_format"].(map[string]any)["json_schema"].(map[string]any)["schema"].(map[string]any)
						if err := schemacheck.Validate(rf, doc); err != nil {
							t.Errorf("%s: %s: %v", label, content, err)
						}
					} else if _, ok := doc.(map[string]any); !ok {
						t.Errorf("%s: %q is not an object", label, content)
					}
				case "completions-batch-echo":
					for i, c := range choices {
						prompt := rec.Body["prompt"].([]any)[i/2].(string)
						if !strings.HasPrefix(c.(map[string]any)["text"].(string), prompt) {
							t.Errorf("%s: choice %d does not echo %q", label, i, prompt)
						}
					}
				}
			}
			if texts[name] == nil {
				texts[name] = map[string]string{}
			}
			texts[name][target.label] = text.String()
		}
		if tx := texts[name]; tx != nil && rec.Body["temperature"] == 0.0 && tx["head"] != tx["tracker"] {
			t.Errorf("%s: head %q, tracker %q", name, tx["head"], tx["tracker"])
		}
	}
	// The Vercel AI SDK's list of text parts answers as the string does.
	for _, target := range []string{"head", "tracker"} {
		if p, s := texts["vercel-parts"][target], texts["vercel-string"][target]; p != s || p == "" {
			t.Errorf("%s: Vercel parts %q, string %q", target, p, s)
		}
		if p, s := texts["chat-parts"][target], texts["chat"][target]; p != s || p == "" {
			t.Errorf("%s: one text part %q, string %q", target, p, s)
		}
	}
}

func checkRefusal(t *testing.T, label string, r reply, status int, param string) {
	t.Helper()
	e, ok := wire.DecodeError(r.status, r.body)
	if r.status != status || !ok || e.Param != param || e.Type != wire.TypeInvalidRequest {
		t.Errorf("%s: %d %s, want %d naming param %q", label, r.status, r.body, status, param)
	}
}

// TestHeadAndTrackerAgreeOnBadRequests runs every bad request against the
// head and the tracker: the same status and the same error JSON.
func TestHeadAndTrackerAgreeOnBadRequests(t *testing.T) {
	testenv.CheckGoroutines(t)
	m := startOpenAIMesh(t)
	msgs := []any{map[string]any{"role": "user", "content": "hi"}}
	chat := func(extra map[string]any) map[string]any {
		b := map[string]any{"model": "gocoder-6m", "messages": msgs}
		for k, v := range extra {
			b[k] = v
		}
		return b
	}
	comp := func(extra map[string]any) map[string]any {
		b := map[string]any{"model": "gocoder-6m", "prompt": "package main"}
		for k, v := range extra {
			b[k] = v
		}
		return b
	}
	cases := []struct {
		name   string
		path   string
		body   any
		status int
		param  string
	}{
		{"unknown model", "/v1/chat/completions", chat(map[string]any{"model": "gpt-4o"}), 404, "model"},
		{"unknown model completions", "/v1/completions", comp(map[string]any{"model": "nope"}), 404, "model"},
		{"max_tokens 0", "/v1/completions", comp(map[string]any{"max_tokens": 0}), 400, "max_tokens"},
		{"max_completion_tokens -1", "/v1/chat/completions", chat(map[string]any{"max_completion_tokens": -1}), 400, "max_completion_tokens"},
		{"max_tokens string", "/v1/completions", comp(map[string]any{"max_tokens": "8"}), 400, "max_tokens"},
		{"max_tokens over the context", "/v1/completions", comp(map[string]any{"max_tokens": 100000}), 400, "max_tokens"},
		{"prompt over the context", "/v1/completions", comp(map[string]any{"prompt": strings.Repeat("func main() {}\n", 400)}), 400, "prompt"},
		{"chat over the context", "/v1/chat/completions", chat(map[string]any{"messages": []any{map[string]any{"role": "user", "content": strings.Repeat("func main() {}\n", 400)}}}), 400, "messages"},
		{"no messages", "/v1/chat/completions", map[string]any{"model": "gocoder-6m", "messages": []any{}}, 400, "messages"},
		{"messages not a list", "/v1/chat/completions", map[string]any{"model": "gocoder-6m", "messages": "hi"}, 400, "messages"},
		{"bad role", "/v1/chat/completions", map[string]any{"messages": []any{map[string]any{"role": "bot", "content": "x"}}}, 400, "messages[0].role"},
		{"image part", "/v1/chat/completions", map[string]any{"messages": []any{map[string]any{"role": "user", "content": []any{
			map[string]any{"type": "image_url", "image_url": map[string]any{"url": "x"}}}}}}, 400, "messages[0].content[0].type"},
		{"no prompt", "/v1/completions", map[string]any{"model": "gocoder-6m"}, 400, "prompt"},
		{"prompt id outside the vocabulary", "/v1/completions", comp(map[string]any{"prompt": []any{1, 99999}}), 400, "prompt"},
		{"n 0", "/v1/completions", comp(map[string]any{"n": 0}), 400, "n"},
		{"n 17", "/v1/chat/completions", chat(map[string]any{"n": 17}), 400, "n"},
		{"temperature", "/v1/completions", comp(map[string]any{"temperature": -1}), 400, "temperature"},
		{"top_p", "/v1/completions", comp(map[string]any{"top_p": 1.5}), 400, "top_p"},
		{"presence_penalty", "/v1/chat/completions", chat(map[string]any{"presence_penalty": 3}), 400, "presence_penalty"},
		{"frequency_penalty", "/v1/chat/completions", chat(map[string]any{"frequency_penalty": -2.5}), 400, "frequency_penalty"},
		{"stop", "/v1/completions", comp(map[string]any{"stop": 7}), 400, "stop"},
		{"best_of", "/v1/completions", comp(map[string]any{"best_of": 3}), 400, "best_of"},
		{"suffix", "/v1/completions", comp(map[string]any{"suffix": "}"}), 400, "suffix"},
		{"logit_bias", "/v1/completions", comp(map[string]any{"logit_bias": map[string]any{"5": 10}}), 400, "logit_bias"},
		{"chat logprobs number", "/v1/chat/completions", chat(map[string]any{"logprobs": 3}), 400, "logprobs"},
		{"top_logprobs alone", "/v1/chat/completions", chat(map[string]any{"top_logprobs": 2}), 400, "top_logprobs"},
		{"completions logprobs 21", "/v1/completions", comp(map[string]any{"logprobs": 21}), 400, "logprobs"},
		{"echo with logprobs", "/v1/completions", comp(map[string]any{"echo": true, "logprobs": 1}), 400, "logprobs"},
		{"stream_options without stream", "/v1/chat/completions", chat(map[string]any{"stream_options": map[string]any{"include_usage": true}}), 400, "stream_options"},
		{"response_format type", "/v1/chat/completions", chat(map[string]any{"response_format": map[string]any{"type": "xml"}}), 400, "response_format.type"},
		{"unsupported schema keyword", "/v1/chat/completions", chat(map[string]any{"response_format": map[string]any{"type": "json_schema",
			"json_schema": map[string]any{"name": "x", "schema": map[string]any{"type": "string", "pattern": "^a"}}}}), 400, "response_format.json_schema.schema"},
		{"schema too deep", "/v1/chat/completions", chat(map[string]any{"response_format": map[string]any{"type": "json_schema",
			"json_schema": map[string]any{"name": "x", "schema": deepSchema(40)}}}), 400, "response_format.json_schema.schema"},
		{"schema too large", "/v1/chat/completions", chat(map[string]any{"response_format": map[string]any{"type": "json_schema",
			"json_schema": map[string]any{"name": "x", "schema": wideSchema(3000)}}}), 400, "response_format.json_schema.schema"},
		{"ignore_eos with a format", "/v1/chat/completions", chat(map[string]any{"ignore_eos": true, "response_format": map[string]any{"type": "json_object"}}), 400, "ignore_eos"},
		{"tool_choice names no tool", "/v1/chat/completions", chat(map[string]any{"tools": []any{map[string]any{"type": "function", "function": map[string]any{"name": "f"}}},
			"tool_choice": map[string]any{"type": "function", "function": map[string]any{"name": "g"}}}), 400, "tool_choice"},
		{"tools", "/v1/chat/completions", chat(map[string]any{"tools": []any{map[string]any{"type": "function", "function": map[string]any{"name": "f"}}}}), 400, "tools"},
		{"tool type", "/v1/chat/completions", chat(map[string]any{"tools": []any{map[string]any{"type": "retrieval"}}}), 400, "tools[0].type"},
		{"not JSON", "/v1/completions", json.RawMessage(`{"prompt":`), 400, ""},
		{"an array", "/v1/completions", []any{1, 2}, 400, ""},
	}
	for _, tc := range cases {
		var got [2]reply
		var errs [2]*wire.Error
		for i, base := range []string{m.head, m.tracker} {
			got[i] = send(t, m.hc, base, tc.path, tc.body, nil)
			e, ok := wire.DecodeError(got[i].status, got[i].body)
			if !ok {
				t.Errorf("%s on %s: %d %s is not an error body", tc.name, []string{"head", "tracker"}[i], got[i].status, got[i].body)
				continue
			}
			errs[i] = e
		}
		if errs[0] == nil || errs[1] == nil {
			continue
		}
		if got[0].status != tc.status || errs[0].Param != tc.param {
			t.Errorf("%s: head %d param %q (%s), want %d param %q", tc.name, got[0].status, errs[0].Param, errs[0].Message, tc.status, tc.param)
		}
		if got[0].status != got[1].status || !reflect.DeepEqual(errs[0], errs[1]) {
			t.Errorf("%s: head %d %s, tracker %d %s", tc.name, got[0].status, got[0].body, got[1].status, got[1].body)
		}
	}
}

// A forced tool call through the tracker arrives as the head sends it:
// tool_calls with finish_reason "tool_calls", streamed or assembled.
func TestToolCallsThroughTheTracker(t *testing.T) {
	testenv.CheckGoroutines(t)
	m := startOpenAIMeshIn(t, qwenTemplateModel(t))
	tools := []any{map[string]any{"type": "function", "function": map[string]any{"name": "get_weather",
		"parameters": map[string]any{"type": "object", "properties": map[string]any{"city": map[string]any{"type": "string", "maxLength": 16}}, "required": []any{"city"}}}}}
	for _, stream := range []bool{false, true} {
		body := map[string]any{"model": "gocoder-6m", "messages": []any{map[string]any{"role": "user", "content": "Weather in Paris?"}},
			"tools": tools, "tool_choice": "required", "max_tokens": 80, "temperature": 0, "stream": stream}
		var answers [2]string
		for i, base := range []string{m.head, m.tracker} {
			r := send(t, m.hc, base, "/v1/chat/completions", body, nil)
			var calls []any
			finish := any(nil)
			if stream {
				for _, ev := range r.events {
					var v shape
					if json.Unmarshal([]byte(ev), &v) != nil {
						continue
					}
					for _, c := range asList(v["choices"]) {
						c := c.(map[string]any)
						if d, ok := c["delta"].(map[string]any); ok {
							calls = append(calls, asList(d["tool_calls"])...)
						}
						if c["finish_reason"] != nil {
							finish = c["finish_reason"]
						}
					}
				}
			} else {
				var v shape
				if err := json.Unmarshal(r.body, &v); err != nil {
					t.Fatalf("%d %s", r.status, r.body)
				}
				c := asList(v["choices"])[0].(map[string]any)
				calls, finish = asList(c["message"].(map[string]any)["tool_calls"]), c["finish_reason"]
			}
			if finish != "tool_calls" || len(calls) != 1 {
				t.Errorf("stream %v via %d: finish %v calls %v", stream, i, finish, calls)
				continue
			}
			f := calls[0].(map[string]any)["function"].(map[string]any)
			var args map[string]any
			if f["name"] != "get_weather" || json.Unmarshal([]byte(f["arguments"].(string)), &args) != nil || args["city"] == nil {
				t.Errorf("stream %v via %d: call %v", stream, i, calls[0])
			}
			answers[i] = f["arguments"].(string)
		}
		if answers[0] != answers[1] {
			t.Errorf("stream %v: head %s, tracker %s", stream, answers[0], answers[1])
		}
	}
}

func asList(v any) []any { l, _ := v.([]any); return l }

// The tracker answers as the head: a schema goes upstream as written (its
// property order is the document's), and n seeded choices and batched
// prompts, split into one request per choice, are the head's choices with
// the same usage.
func TestTrackerAnswersAsTheHead(t *testing.T) {
	testenv.CheckGoroutines(t)
	m := startOpenAIMesh(t)
	schema := json.RawMessage(`{"type":"object","properties":{"zeta":{"type":"integer"},"alpha":{"type":"string","maxLength":5}},"required":["zeta","alpha"]}`)
	body := map[string]any{"model": "gocoder-6m", "messages": []any{map[string]any{"role": "user", "content": "Write a loop."}},
		"max_tokens": 60, "temperature": 0, "response_format": map[string]any{"type": "json_schema", "json_schema": map[string]any{"name": "o", "schema": schema}}}
	var got [2]string
	for i, base := range []string{m.head, m.tracker} {
		var v openai.Completion
		r := send(t, m.hc, base, "/v1/chat/completions", body, nil)
		if err := json.Unmarshal(r.body, &v); err != nil || len(v.Choices) != 1 {
			t.Fatalf("%d %s", r.status, r.body)
		}
		got[i] = *v.Choices[0].Message.Content
	}
	if got[0] != got[1] || !strings.HasPrefix(got[0], `{"zeta":`) {
		t.Errorf("head %s, tracker %s; want the same document, zeta first", got[0], got[1])
	}
	// n seeded choices and batched prompts: the tracker's one request per
	// choice gives the head's choices
	for _, tc := range []struct {
		path string
		body map[string]any
	}{
		{"/v1/chat/completions", map[string]any{"messages": []any{map[string]any{"role": "user", "content": "Write a loop."}}, "n": 3, "seed": 11,
			"temperature": 1.3, "max_tokens": 8}},
		{"/v1/completions", map[string]any{"prompt": []any{"package main\n", "func main() {"}, "n": 2, "seed": 4, "temperature": 1.3, "max_tokens": 6}},
	} {
		var texts [2][]string
		var usage [2]openai.Usage
		for i, base := range []string{m.head, m.tracker} {
			var v openai.Completion
			r := send(t, m.hc, base, tc.path, tc.body, nil)
			if err := json.Unmarshal(r.body, &v); err != nil || v.Usage == nil {
				t.Fatalf("%d %s", r.status, r.body)
			}
			for k, c := range v.Choices {
				if c.Index != k {
					t.Errorf("%s via %d: choice %d has index %d", tc.path, i, k, c.Index)
				}
				if c.Message != nil {
					texts[i] = append(texts[i], *c.Message.Content)
				} else {
					texts[i] = append(texts[i], *c.Text)
				}
			}
			usage[i] = *v.Usage
		}
		if strings.Join(texts[0], "|") != strings.Join(texts[1], "|") || usage[0] != usage[1] {
			t.Errorf("%s: head %q %+v, tracker %q %+v", tc.path, texts[0], usage[0], texts[1], usage[1])
		}
	}
}

// deepSchema nests n objects: an attacker's schema to make the automaton
// recurse.
func deepSchema(n int) map[string]any {
	s := map[string]any{"type": "string"}
	for i := 0; i < n; i++ {
		s = map[string]any{"type": "object", "properties": map[string]any{"a": s}, "required": []any{"a"}}
	}
	return s
}

// wideSchema has n properties: too big to travel with each step.
func wideSchema(n int) map[string]any {
	props := map[string]any{}
	for i := 0; i < n; i++ {
		props[fmt.Sprintf("property_%05d", i)] = map[string]any{"type": "integer"}
	}
	return map[string]any{"type": "object", "properties": props}
}

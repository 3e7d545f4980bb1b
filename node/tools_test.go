package node

import (
	"context"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"meshgpu/engine"
	"meshgpu/internal/schemacheck"
	"meshgpu/internal/testenv"
	"meshgpu/model/chat"
	"meshgpu/native"
	"meshgpu/openai"
)

var testTools = []map[string]any{
	{"type": "function", "function": map[string]any{"name": "get_weather", "description": "Weather of a city",
		"parameters": map[string]any{"type": "object", "properties": map[string]any{"city": map[string]any{"type": "string", "maxLength": 20},
			"unit": map[string]any{"enum": []any{"C", "F"}}}, "required": []any{"city"}}}},
	{"type": "function", "function": map[string]any{"name": "add",
		"parameters": map[string]any{"type": "object", "properties": map[string]any{"a": map[string]any{"type": "integer"}, "b": map[string]any{"type": "integer"}},
			"required": []any{"a", "b"}, "additionalProperties": false}}},
}

// toolsHead is a head over gocoder-6m's layers 0-2 rendering with
// Qwen2.5-Instruct's template (model/chat/testdata), routed through the
// mesh's mid and tail, so the tail samples the constrained calls.
func toolsHead(t *testing.T, g *gocoderMesh) string {
	dir := testenv.GoCoder(t)
	be, err := native.Open("cpu", native.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.Close() })
	m, err := engine.Load(dir, engine.Options{Backend: be, First: 0, Last: 2, MaxContext: 1024})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	src, err := os.ReadFile(filepath.Join(testenv.RepoRoot(), "model", "chat", "testdata", "qwen2.5-instruct.jinja"))
	if err != nil {
		t.Fatal(err)
	}
	if m.Template, err = chat.Parse(string(src), "", "<|im_end|>"); err != nil {
		t.Fatal(err)
	}
	return startNode(t, &Server{Model: m, Backend: be, PeerID: "qwen-head", Peers: []string{g.mid, g.tail}})
}

func toolSchema(name string) map[string]any {
	for _, tl := range testTools {
		f := tl["function"].(map[string]any)
		if f["name"] == name {
			b, _ := json.Marshal(f["parameters"])
			var m map[string]any
			json.Unmarshal(b, &m)
			return m
		}
	}
	return nil
}

// Forced tool calls (tool_choice "required" or named) on every golden
// prompt come back as tool_calls with finish_reason "tool_calls", naming a
// tool whose schema the arguments match; streamed too; "auto" answers
// either way in OpenAI's shape.
func TestToolCalls(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startGocoderMesh(t)
	head := toolsHead(t, g)
	c := &http.Client{Timeout: 120 * time.Second}
	defer c.CloseIdleConnections()
	for pi, gen := range g.golden {
		for _, choice := range []any{"required", map[string]any{"type": "function", "function": map[string]any{"name": "add"}}} {
			for _, stream := range []bool{false, true} {
				body := map[string]any{"messages": []map[string]any{{"role": "user", "content": gen.Prompt}}, "tools": testTools,
					"tool_choice": choice, "max_tokens": 200, "temperature": 0.7, "seed": int64(pi), "stream": stream}
				msg, finish := toolAnswer(t, c, head, body)
				if finish != "tool_calls" || len(msg.ToolCalls) == 0 {
					t.Errorf("prompt %d %v stream %v: finish %q, message %+v", pi, choice, stream, finish, msg)
					continue
				}
				call := msg.ToolCalls[0]
				if _, named := choice.(map[string]any); named && call.Function.Name != "add" || call.Type != "function" || call.ID == "" {
					t.Errorf("prompt %d %v: call %+v", pi, choice, call)
				}
				var args any
				if err := json.Unmarshal([]byte(call.Function.Arguments), &args); err != nil {
					t.Errorf("prompt %d: arguments %q: %v", pi, call.Function.Arguments, err)
					continue
				}
				if err := schemacheck.Validate(toolSchema(call.Function.Name), args); err != nil {
					t.Errorf("prompt %d: %s(%s): %v", pi, call.Function.Name, call.Function.Arguments, err)
				}
			}
		}
		// auto: a message or calls, in the right shape
		msg, finish := toolAnswer(t, c, head, map[string]any{"messages": []map[string]any{{"role": "user", "content": gen.Prompt}},
			"tools": testTools, "max_tokens": 30, "temperature": 0})
		if finish == "tool_calls" && len(msg.ToolCalls) == 0 || finish != "tool_calls" && msg.Content == nil {
			t.Errorf("prompt %d auto: finish %q message %+v", pi, finish, msg)
		}
		for _, call := range msg.ToolCalls {
			var args any
			if err := json.Unmarshal([]byte(call.Function.Arguments), &args); err != nil {
				t.Errorf("prompt %d auto: arguments %q", pi, call.Function.Arguments)
			} else if err := schemacheck.Validate(toolSchema(call.Function.Name), args); err != nil {
				t.Errorf("prompt %d auto: %s(%s): %v", pi, call.Function.Name, call.Function.Arguments, err)
			}
		}
	}
	// a conversation holding a call and its answer renders and generates
	msg, _ := toolAnswer(t, c, head, map[string]any{"tools": testTools, "max_tokens": 5, "messages": []map[string]any{
		{"role": "user", "content": "Weather in Paris?"},
		{"role": "assistant", "content": nil, "tool_calls": []any{map[string]any{"id": "call_1", "type": "function",
			"function": map[string]any{"name": "get_weather", "arguments": `{"city":"Paris"}`}}}},
		{"role": "tool", "tool_call_id": "call_1", "content": `{"temp":21}`}}})
	if msg.Role != "assistant" {
		t.Errorf("after a tool answer: %+v", msg)
	}
}

func toolAnswer(t *testing.T, c *http.Client, base string, body map[string]any) (openai.ChatMessage, string) {
	t.Helper()
	if body["stream"] != true {
		out, _ := postOK(t, c, base+"/v1/chat/completions", body)
		return *out.Choices[0].Message, *out.Choices[0].FinishReason
	}
	resp, err := postJSON(context.Background(), c, base+"/v1/chat/completions", body)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var msg openai.ChatMessage
	finish := ""
	sr := openai.NewSSEReader(resp.Body, 0)
	for {
		d, err := sr.Next()
		if err != nil || d == openai.SSEDone {
			break
		}
		var ch openai.Completion
		if json.Unmarshal([]byte(d), &ch) != nil {
			t.Fatalf("event %q", d)
		}
		for _, x := range ch.Choices {
			if x.Delta != nil {
				if x.Delta.Role != "" {
					msg.Role = x.Delta.Role
				}
				if x.Delta.Content != nil {
					s := ""
					if msg.Content != nil {
						s = *msg.Content
					}
					s += *x.Delta.Content
					msg.Content = &s
				}
				msg.ToolCalls = append(msg.ToolCalls, x.Delta.ToolCalls...)
			}
			if x.FinishReason != nil {
				finish = *x.FinishReason
			}
		}
	}
	return msg, finish
}

package e2e

import (
	"encoding/json"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"meshgpu/internal/testenv"
)

// Issue 30: tools can be tried on the bundled model. Its ChatML template
// renders no tools (400); `meshgpu run --chat-template-file
// docs/examples/chatml-tools.jinja` (the template the docs show) makes a
// forced tool call return tool_calls, through plain HTTP and the official
// openai SDK when it is installed.
func TestChatTemplateFileMakesToolsWork(t *testing.T) {
	dir := testenv.GoCoder(t)
	tmpl := filepath.Join(testenv.RepoRoot(), "docs", "examples", "chatml-tools.jinja")
	start := func(name string, extra ...string) string {
		args := append([]string{"run", "--model", dir, "--backend", "cpu", "--threads", "1", "--key", filepath.Join(t.TempDir(), "k"),
			"--listen", "127.0.0.1:0"}, extra...)
		p, _ := startProc(t, name, nodeLine, args...)
		return "http://" + regexp.MustCompile(`msg="listening on (\S+)"`).FindStringSubmatch(p.log())[1]
	}
	plain := start("node with the model's template")
	withTools := start("node with --chat-template-file", "--chat-template-file", tmpl)
	hc := newHTTPClient(t)
	body := map[string]any{"model": "gocoder-6m", "max_tokens": 64, "temperature": 0,
		"messages": []any{map[string]any{"role": "user", "content": "What is the weather in Paris?"}},
		"tools": []any{map[string]any{"type": "function", "function": map[string]any{"name": "get_weather",
			"parameters": map[string]any{"type": "object", "properties": map[string]any{"city": map[string]any{"type": "string", "maxLength": 16}}, "required": []any{"city"}}}}},
		"tool_choice": map[string]any{"type": "function", "function": map[string]any{"name": "get_weather"}}}

	if r := send(t, hc, plain, "/v1/chat/completions", body, nil); r.status != 400 || !strings.Contains(string(r.body), "does not render tools") {
		t.Fatalf("tools with the model's own template: %d %s; want 400 saying the template renders no tools", r.status, r.body)
	}
	r := send(t, hc, withTools, "/v1/chat/completions", body, nil)
	var out struct {
		Choices []struct {
			FinishReason string `json:"finish_reason"`
			Message      struct {
				ToolCalls []struct {
					Function struct{ Name, Arguments string } `json:"function"`
				} `json:"tool_calls"`
			} `json:"message"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(r.body, &out); err != nil || r.status != 200 || len(out.Choices) != 1 {
		t.Fatalf("forced tool call with --chat-template-file: %d %s", r.status, r.body)
	}
	c := out.Choices[0]
	var args map[string]any
	if c.FinishReason != "tool_calls" || len(c.Message.ToolCalls) != 1 || c.Message.ToolCalls[0].Function.Name != "get_weather" ||
		json.Unmarshal([]byte(c.Message.ToolCalls[0].Function.Arguments), &args) != nil || args["city"] == nil {
		t.Fatalf("forced tool call: %s; want one get_weather call with a city", r.body)
	}
	t.Logf("tool call: %s(%s)", c.Message.ToolCalls[0].Function.Name, c.Message.ToolCalls[0].Function.Arguments)

	t.Run("openai SDK", func(t *testing.T) {
		res := runSDK(t, openaiSDK(t), withTools, "tools")
		if res.FinishReason != "tool_calls" || len(res.ToolCalls) != 1 || res.ToolCalls[0].Function.Name != "get_weather" || res.ToolCalls[0].ID == "" {
			t.Fatalf("SDK tool call: %+v", res)
		}
	})
}

package chat

import (
	"os"
	"strings"
	"testing"

	"meshgpu/internal/testenv"
)

// Qwen2.5-Instruct's published template (testdata) renders tools and
// tool calls; gocoder-6m's ChatML template does not render tools.
func TestTemplatesThatRenderTools(t *testing.T) {
	src, err := os.ReadFile("testdata/qwen2.5-instruct.jinja")
	if err != nil {
		t.Fatal(err)
	}
	qwen, err := Parse(string(src), "", "<|im_end|>")
	if err != nil {
		t.Fatal(err)
	}
	if !qwen.RendersTools() {
		t.Fatal("the Qwen2.5 template does not render tools")
	}
	if p, s, k := qwen.ToolSyntax(); p != "<tool_call>\n" || s != "\n</tool_call>" || k != "arguments" {
		t.Errorf("Qwen2.5 tool syntax %q %q %q", p, s, k)
	}
	tools := []any{map[string]any{"type": "function", "function": map[string]any{"name": "get_weather",
		"parameters": map[string]any{"type": "object", "properties": map[string]any{"city": map[string]any{"type": "string"}}}}}}
	out, err := qwen.RenderTools([]Message{
		{Role: "user", Content: "Weather in Paris?"},
		{Role: "assistant", ToolCalls: []ToolCall{{ID: "call_1", Name: "get_weather", Arguments: map[string]any{"city": "Paris"}}}},
		{Role: "tool", Content: `{"temp":21}`, ToolCallID: "call_1"},
	}, tools, true)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`<tools>`, `"name": "get_weather"`, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
		"<tool_response>\n{\"temp\":21}\n</tool_response>", "<|im_start|>assistant\n"} {
		if !strings.Contains(out, want) {
			t.Errorf("rendered template lacks %q:\n%s", want, out)
		}
	}
	chatml, err := Load(testenv.GoCoder(t))
	if err != nil {
		t.Fatal(err)
	}
	if chatml.RendersTools() {
		t.Error("gocoder-6m's ChatML template claims to render tools")
	}
}

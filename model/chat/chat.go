// Package chat renders a model's Jinja chat template (from
// chat_template.jinja or tokenizer_config.json) the way Hugging Face
// transformers' apply_chat_template does, using github.com/ardanlabs/jinja,
// which applies HF's trim_blocks and lstrip_blocks settings.
package chat

import (
	"encoding/json"
	"errors"
	"fmt"
	"meshgpu/model/tokenizer"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/ardanlabs/jinja"
)

// Message is one turn of a conversation. ToolCalls (an assistant's calls)
// and ToolCallID (a tool's answer) reach templates that render them.
type Message struct {
	Role       string     `json:"role"`
	Content    string     `json:"content"`
	ToolCalls  []ToolCall `json:"tool_calls,omitempty"`
	ToolCallID string     `json:"tool_call_id,omitempty"`
}

// ToolCall is a function call of an assistant message. Arguments is the
// decoded JSON object, as Hugging Face templates expect.
type ToolCall struct {
	ID        string
	Name      string
	Arguments any
}

// ErrNoTemplate is returned by Load and FromGGUF when the model ships no
// chat template.
var ErrNoTemplate = errors.New("chat: the model has no chat template (no chat_template.jinja or chat_template in tokenizer_config.json, or no tokenizer.chat_template in its GGUF)")

// Template is a compiled chat template; safe for concurrent use.
type Template struct {
	tmpl     *jinja.Template
	src      string
	bosToken string
	eosToken string

	probe       sync.Once
	rendersTool bool
}

// tokenizerConfig is the part of tokenizer_config.json a template needs.
type tokenizerConfig struct {
	ChatTemplate json.RawMessage     `json:"chat_template"`
	BOSToken     tokenizer.TokenName `json:"bos_token"`
	EOSToken     tokenizer.TokenName `json:"eos_token"`
}

// Load reads dir/chat_template.jinja, or else the chat_template of
// dir/tokenizer_config.json (a string, or a list of {name, template} of
// which "default" is taken). bos_token and eos_token come from
// tokenizer_config.json. It returns (nil, ErrNoTemplate) when there is no
// template.
func Load(dir string) (*Template, error) {
	var cfg tokenizerConfig
	cfgPath := filepath.Join(dir, "tokenizer_config.json")
	data, err := os.ReadFile(cfgPath)
	switch {
	case err == nil:
		if err := json.Unmarshal(data, &cfg); err != nil {
			return nil, fmt.Errorf("chat: %s: %v", cfgPath, err)
		}
	case !errors.Is(err, os.ErrNotExist):
		return nil, fmt.Errorf("chat: %w", err)
	}
	src, err := os.ReadFile(filepath.Join(dir, "chat_template.jinja"))
	if err == nil {
		return parseNamed(string(src), string(cfg.BOSToken), string(cfg.EOSToken), "chat_template.jinja")
	}
	if !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("chat: %w", err)
	}
	tmpl, err := configTemplate(cfg.ChatTemplate)
	if err != nil {
		return nil, fmt.Errorf("chat: %s: %w", cfgPath, err)
	}
	if tmpl == "" {
		return nil, ErrNoTemplate
	}
	return parseNamed(tmpl, string(cfg.BOSToken), string(cfg.EOSToken), cfgPath)
}

// configTemplate extracts the template text of tokenizer_config's
// chat_template field ("" when absent).
func configTemplate(raw json.RawMessage) (string, error) {
	s := strings.TrimSpace(string(raw))
	if s == "" || s == "null" {
		return "", nil
	}
	var str string
	if err := json.Unmarshal(raw, &str); err == nil {
		return str, nil
	}
	var list []struct {
		Name     string `json:"name"`
		Template string `json:"template"`
	}
	if err := json.Unmarshal(raw, &list); err != nil {
		return "", errors.New("chat_template: want a string or a list of {name, template}")
	}
	for _, e := range list {
		if e.Name == "default" {
			return e.Template, nil
		}
	}
	return "", nil
}

// Parse compiles a template; bosToken and eosToken are exposed to it as
// bos_token and eos_token.
func Parse(src string, bosToken, eosToken string) (*Template, error) {
	return parseNamed(src, bosToken, eosToken, "template")
}

func parseNamed(src, bos, eos, name string) (*Template, error) {
	tmpl, err := jinja.Compile(src)
	if err != nil {
		return nil, fmt.Errorf("chat: %s: %w", name, err)
	}
	return &Template{tmpl: tmpl, src: src, bosToken: bos, eosToken: eos}, nil
}

// Render formats msgs; addGenerationPrompt appends the header that starts
// the assistant's reply.
func (t *Template) Render(msgs []Message, addGenerationPrompt bool) (out string, err error) {
	return t.RenderTools(msgs, nil, addGenerationPrompt)
}

// probeTool is a tool only a template that renders tools shows.
const probeTool = "meshgpu_probe_tool_5f3a"

// RendersTools reports whether the template shows the tools variable to
// the model (Llama 3.1+, Qwen2.5 and the like do; many do not): it renders
// a conversation with a probe tool and looks for its name.
func (t *Template) RendersTools() bool {
	t.probe.Do(func() {
		tool := map[string]any{"type": "function", "function": map[string]any{"name": probeTool, "description": "probe",
			"parameters": map[string]any{"type": "object", "properties": map[string]any{}}}}
		out, err := t.RenderTools([]Message{{Role: "user", Content: "hi"}}, []any{tool}, true)
		t.rendersTool = err == nil && strings.Contains(out, probeTool)
	})
	return t.rendersTool
}

// ToolSyntax is how the template's model writes a tool call: the JSON
// document {"name": ..., argsKey: {...}} between prefix and suffix. Hermes
// style templates (Qwen2.5 and others that mention <tool_call>) wrap it in
// <tool_call> tags with "arguments"; otherwise it is bare JSON with
// "parameters", as Llama 3.1 writes it.
func (t *Template) ToolSyntax() (prefix, suffix, argsKey string) {
	if strings.Contains(t.src, "<tool_call>") {
		return "<tool_call>\n", "\n</tool_call>", "arguments"
	}
	return "", "", "parameters"
}

// RenderTools is Render with tools (the decoded JSON of OpenAI's tools
// list) given to the template as tools.
func (t *Template) RenderTools(msgs []Message, tools []any, addGenerationPrompt bool) (out string, err error) {
	// The template engine is third-party code fed user text; a panic in it
	// must come back as an error, not take the server down.
	defer func() {
		if r := recover(); r != nil {
			out, err = "", fmt.Errorf("chat: render: template engine failed: %v", r)
		}
	}()
	list := make([]jinja.Value, len(msgs))
	for i, m := range msgs {
		d := jinja.NewDict()
		d.AsDict().Set("role", jinja.NewString(m.Role))
		d.AsDict().Set("content", jinja.NewString(m.Content))
		if len(m.ToolCalls) > 0 {
			calls := make([]any, len(m.ToolCalls))
			for k, c := range m.ToolCalls {
				calls[k] = map[string]any{"id": c.ID, "type": "function", "function": map[string]any{"name": c.Name, "arguments": c.Arguments}}
			}
			d.AsDict().Set("tool_calls", jinja.FromGoValue(calls))
		}
		if m.ToolCallID != "" {
			d.AsDict().Set("tool_call_id", jinja.NewString(m.ToolCallID))
		}
		list[i] = d
	}
	vars := map[string]jinja.Value{
		"messages":              jinja.NewList(list),
		"add_generation_prompt": jinja.NewBool(addGenerationPrompt),
		"bos_token":             jinja.NewString(t.bosToken),
		"eos_token":             jinja.NewString(t.eosToken),
	}
	if len(tools) > 0 {
		vars["tools"] = jinja.FromGoValue(tools)
	}
	out, err = t.tmpl.RenderValues(vars)
	if err != nil {
		return "", fmt.Errorf("chat: render: %w", err)
	}
	return out, nil
}

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

	"github.com/ardanlabs/jinja"
)

// Message is one turn of a conversation.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// ErrNoTemplate is returned by Load when the model ships no chat template.
var ErrNoTemplate = errors.New("chat: the model has no chat template (no chat_template.jinja and no chat_template in tokenizer_config.json)")

// Template is a compiled chat template; safe for concurrent use.
type Template struct {
	tmpl     *jinja.Template
	bosToken string
	eosToken string
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
	return &Template{tmpl: tmpl, bosToken: bos, eosToken: eos}, nil
}

// Render formats msgs; addGenerationPrompt appends the header that starts
// the assistant's reply.
func (t *Template) Render(msgs []Message, addGenerationPrompt bool) (out string, err error) {
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
		list[i] = d
	}
	out, err = t.tmpl.RenderValues(map[string]jinja.Value{
		"messages":              jinja.NewList(list),
		"add_generation_prompt": jinja.NewBool(addGenerationPrompt),
		"bos_token":             jinja.NewString(t.bosToken),
		"eos_token":             jinja.NewString(t.eosToken),
	})
	if err != nil {
		return "", fmt.Errorf("chat: render: %w", err)
	}
	return out, nil
}

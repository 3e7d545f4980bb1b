package chat

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"meshgpu/internal/testenv"
	"meshgpu/model/tokenizer"
)

type templateCase struct {
	Messages []Message `json:"messages"`
	Rendered string    `json:"rendered"`
	IDs      []int32   `json:"ids"`
}

// TestGoCoderTemplate renders golden.json's chat cases and encodes them to
// the ids transformers' apply_chat_template(tokenize=True) produced.
func TestGoCoderTemplate(t *testing.T) {
	dir := testenv.GoCoder(t)
	var g struct {
		Cases []templateCase `json:"chat_template_cases"`
	}
	data, err := os.ReadFile(filepath.Join(dir, "golden.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, &g); err != nil {
		t.Fatal(err)
	}
	if len(g.Cases) == 0 {
		t.Fatal("golden.json has no chat_template_cases")
	}
	tmpl, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	tok, err := tokenizer.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	for i, c := range g.Cases {
		got, err := tmpl.Render(c.Messages, true)
		if err != nil {
			t.Fatalf("case %d: %v", i, err)
		}
		if got != c.Rendered {
			t.Errorf("case %d rendered\n%q\nwant\n%q", i, got, c.Rendered)
		}
		// The rendered text carries its own special tokens; the template
		// adds no BOS, and transformers encodes it without adding one.
		if ids := tok.Encode(c.Rendered, false); !slices.Equal(ids, c.IDs) {
			t.Errorf("case %d ids\n got %v\nwant %v", i, ids, c.IDs)
		}
	}
}

func TestLoadNoTemplate(t *testing.T) {
	dir := t.TempDir()
	if _, err := Load(dir); !errors.Is(err, ErrNoTemplate) {
		t.Fatalf("empty dir: got %v, want ErrNoTemplate", err)
	}
	os.WriteFile(filepath.Join(dir, "tokenizer_config.json"), []byte(`{"eos_token": "</s>"}`), 0o644)
	if tm, err := Load(dir); !errors.Is(err, ErrNoTemplate) || tm != nil {
		t.Fatalf("config without template: got %v, %v; want nil, ErrNoTemplate", tm, err)
	}
}

func TestLoadFromConfig(t *testing.T) {
	for name, field := range map[string]string{
		"string": `"{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"`,
		"list": `[{"name": "tool_use", "template": "wrong"},
		          {"name": "default", "template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"}]`,
	} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			cfg := `{"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>", "chat_template": ` + field + `}`
			if err := os.WriteFile(filepath.Join(dir, "tokenizer_config.json"), []byte(cfg), 0o644); err != nil {
				t.Fatal(err)
			}
			tm, err := Load(dir)
			if err != nil {
				t.Fatal(err)
			}
			got, err := tm.Render([]Message{{Role: "user", Content: "a"}, {Role: "assistant", Content: "b"}}, false)
			if err != nil {
				t.Fatal(err)
			}
			if want := "<s>[user]a</s>[assistant]b</s>"; got != want {
				t.Fatalf("got %q, want %q", got, want)
			}
		})
	}
}

func TestBadTemplates(t *testing.T) {
	if _, err := Parse("{% for m in messages %}", "", ""); err == nil {
		t.Error("unclosed for: want a parse error")
	}
	tm, err := Parse("{{ raise_exception('only user and assistant roles are supported') }}", "", "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tm.Render([]Message{{Role: "tool", Content: "x"}}, false); err == nil {
		t.Error("raise_exception: want an error")
	}
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "tokenizer_config.json"), []byte(`{"chat_template": 42}`), 0o644)
	if _, err := Load(dir); err == nil || errors.Is(err, ErrNoTemplate) {
		t.Errorf("chat_template 42: got %v, want a clear error", err)
	}
	os.WriteFile(filepath.Join(dir, "tokenizer_config.json"), []byte(`{"chat_template": "x"`), 0o644)
	if _, err := Load(dir); err == nil {
		t.Error("truncated tokenizer_config.json: want an error")
	}
}

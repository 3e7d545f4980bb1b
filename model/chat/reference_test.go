package chat

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
)

// TestReferenceTemplates renders Llama-2/3, Qwen2 and TinyLlama style
// templates (testdata/*.jinja, written from the public formats) and
// compares with the renderings of @huggingface/jinja, the JavaScript port
// of the engine transformers uses (testdata/cases.json; regenerate with a
// small node script calling new Template(src).render(...)).
func TestReferenceTemplates(t *testing.T) {
	var ref struct {
		Cases []struct {
			Template            string    `json:"template"`
			BOSToken            string    `json:"bos_token"`
			EOSToken            string    `json:"eos_token"`
			Messages            []Message `json:"messages"`
			AddGenerationPrompt bool      `json:"add_generation_prompt"`
			Rendered            string    `json:"rendered"`
			Error               bool      `json:"error"`
		} `json:"cases"`
	}
	data, err := os.ReadFile("testdata/cases.json")
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, &ref); err != nil {
		t.Fatal(err)
	}
	if len(ref.Cases) == 0 {
		t.Fatal("no cases")
	}
	for i, c := range ref.Cases {
		src, err := os.ReadFile(filepath.Join("testdata", c.Template))
		if err != nil {
			t.Fatal(err)
		}
		tm, err := Parse(string(src), c.BOSToken, c.EOSToken)
		if err != nil {
			t.Fatalf("%s: %v", c.Template, err)
		}
		got, err := tm.Render(c.Messages, c.AddGenerationPrompt)
		switch {
		case c.Error && err == nil:
			t.Errorf("case %d (%s): want an error (the reference raised), got %q", i, c.Template, got)
		case !c.Error && err != nil:
			t.Errorf("case %d (%s): %v", i, c.Template, err)
		case !c.Error && got != c.Rendered:
			t.Errorf("case %d (%s, add_generation_prompt=%v):\n got %q\nwant %q", i, c.Template, c.AddGenerationPrompt, got, c.Rendered)
		}
	}
}

package chat

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"meshgpu/internal/testenv"
	"meshgpu/model/gguf"
	"meshgpu/model/tokenizer"
)

// TestGGUFGoCoderTemplate renders golden.json's chat cases with the
// template llama.cpp's converter wrote into the bf16 GGUF, byte for byte
// as transformers rendered them, and encodes them with the GGUF's own
// tokenizer to the ids transformers produced.
func TestGGUFGoCoderTemplate(t *testing.T) {
	var g struct {
		Cases []templateCase `json:"chat_template_cases"`
	}
	data, err := os.ReadFile(filepath.Join(testenv.GoCoder(t), "golden.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, &g); err != nil {
		t.Fatal(err)
	}
	if len(g.Cases) == 0 {
		t.Fatal("golden.json has no chat_template_cases")
	}
	m, err := gguf.Open(testenv.Shared(t, "models/gocoder-6m-gguf/gocoder-6m-bf16.gguf"))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	tmpl, err := FromGGUF(m.File)
	if err != nil {
		t.Fatal(err)
	}
	tok, err := tokenizer.FromGGUF(m.File)
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
		if ids := tok.Encode(got, false); !slices.Equal(ids, c.IDs) {
			t.Errorf("case %d ids\n got %v\nwant %v", i, ids, c.IDs)
		}
	}
	if tmpl.bosToken != "<|begin_of_text|>" || tmpl.eosToken != "<|end_of_text|>" {
		t.Errorf("bos_token %q eos_token %q", tmpl.bosToken, tmpl.eosToken)
	}
}

func parseGGUF(t *testing.T, kv ...gguf.KV) *gguf.File {
	t.Helper()
	var buf bytes.Buffer
	if _, err := gguf.Write(&buf, kv, nil, nil); err != nil {
		t.Fatal(err)
	}
	f, err := gguf.Parse(bytes.NewReader(buf.Bytes()), int64(buf.Len()))
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// TestGGUFTemplateMetadata: bos_token and eos_token come from the token
// list; a missing template is ErrNoTemplate; bad metadata is an error.
func TestGGUFTemplateMetadata(t *testing.T) {
	tokens := gguf.KV{Key: "tokenizer.ggml.tokens", Value: gguf.Strings([]string{"<unk>", "<s>", "</s>"})}
	bos := gguf.KV{Key: "tokenizer.ggml.bos_token_id", Value: gguf.Uint32(1)}
	eos := gguf.KV{Key: "tokenizer.ggml.eos_token_id", Value: gguf.Uint32(2)}
	src := func(s string) gguf.KV { return gguf.KV{Key: "tokenizer.chat_template", Value: gguf.String(s)} }

	tm, err := FromGGUF(parseGGUF(t, tokens, bos, eos, src("{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}")))
	if err != nil {
		t.Fatal(err)
	}
	if got, err := tm.Render([]Message{{Role: "user", Content: "hi"}}, false); err != nil || got != "<s>hi</s>" {
		t.Fatalf("Render = %q, %v; want %q", got, err, "<s>hi</s>")
	}
	if _, err := FromGGUF(parseGGUF(t, tokens, bos, eos)); err != ErrNoTemplate {
		t.Fatalf("no template: %v, want ErrNoTemplate", err)
	}
	if _, err := FromGGUF(parseGGUF(t, tokens, src(""))); !errors.Is(err, ErrNoTemplate) {
		t.Fatalf("empty template: %v, want ErrNoTemplate", err)
	}
	for _, c := range []struct {
		name    string
		kv      []gguf.KV
		wantErr string
	}{
		{"template not a string", []gguf.KV{tokens, {Key: "tokenizer.chat_template", Value: gguf.Uint32(7)}}, "tokenizer.chat_template is 7 (uint32), not a string"},
		{"bos out of range", []gguf.KV{tokens, src("x"), {Key: "tokenizer.ggml.bos_token_id", Value: gguf.Uint32(3)}}, "tokenizer.ggml.bos_token_id is 3, outside the 3 tokens"},
		{"eos without tokens", []gguf.KV{src("x"), eos}, "tokenizer.ggml.eos_token_id is 2, outside the 0 tokens"},
		{"eos negative", []gguf.KV{tokens, src("x"), {Key: "tokenizer.ggml.eos_token_id", Value: gguf.Int32(-2)}}, "not a token id"},
		{"template does not compile", []gguf.KV{tokens, src("{% for %}")}, "gguf tokenizer.chat_template"},
	} {
		_, err := FromGGUF(parseGGUF(t, c.kv...))
		if err == nil || !strings.Contains(err.Error(), c.wantErr) || !strings.HasPrefix(err.Error(), "chat: ") {
			t.Errorf("%s: error %v, want one containing %q", c.name, err, c.wantErr)
		}
	}
}

package tokenizer

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"meshgpu/internal/testenv"
)

// TestGoCoderSpecialTokens checks BOS/EOS and the special-token queries
// against generation_config.json, written by transformers independently
// of tokenizer.json.
func TestGoCoderSpecialTokens(t *testing.T) {
	dir := testenv.GoCoder(t)
	tok, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	var gen struct {
		BOS int32 `json:"bos_token_id"`
		EOS int32 `json:"eos_token_id"`
	}
	readJSON(t, filepath.Join(dir, "generation_config.json"), &gen)
	if bos, ok := tok.BOS(); !ok || bos != gen.BOS {
		t.Errorf("BOS() = %d, %v; want %d", bos, ok, gen.BOS)
	}
	if eos := tok.EOS(); !slices.Equal(eos, []int32{gen.EOS}) {
		t.Errorf("EOS() = %v; want [%d]", eos, gen.EOS)
	}
	var cfg struct {
		VocabSize int `json:"vocab_size"`
	}
	readJSON(t, filepath.Join(dir, "config.json"), &cfg)
	if tok.VocabSize() != cfg.VocabSize {
		t.Errorf("VocabSize() = %d, config.json vocab_size %d", tok.VocabSize(), cfg.VocabSize)
	}
	for _, name := range []string{"<|im_start|>", "<|im_end|>", "<|begin_of_text|>"} {
		id, ok := tok.TokenID(name)
		if !ok || !tok.IsSpecial(id) {
			t.Errorf("TokenID(%q) = %d, %v; IsSpecial %v", name, id, ok, tok.IsSpecial(id))
		}
	}
	if id, ok := tok.TokenID("package"); !ok || tok.IsSpecial(id) {
		t.Errorf("TokenID(package) = %d, %v, special %v", id, ok, tok.IsSpecial(id))
	}
	if _, ok := tok.TokenID("no such token"); ok {
		t.Error("TokenID of a missing token succeeded")
	}
	// Skipping special tokens drops the chat markers.
	ids := tok.Encode("<|im_start|>user\nhi<|im_end|>", true)
	if got := tok.Decode(ids, true); got != "user\nhi" {
		t.Errorf("Decode(skipSpecial) = %q", got)
	}
}

// TestAddBOSConfig: an explicit add_bos_token in tokenizer_config.json
// overrides the post-processor, as transformers' Llama tokenizers do.
func TestAddBOSConfig(t *testing.T) {
	src := testenv.Shared(t, "tokenizers/spm-llama2/tokenizer.json")
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	base, err := LoadFile(src, "")
	if err != nil {
		t.Fatal(err)
	}
	plain := base.Encode("hello", false)
	bos, _ := base.TokenID("<s>")
	eos, _ := base.TokenID("</s>")
	if got := base.Encode("hello", true); !slices.Equal(got, append([]int32{bos}, plain...)) {
		t.Fatalf("default: %v", got)
	}
	if got := base.EOS(); !slices.Equal(got, []int32{eos}) {
		t.Fatalf("EOS without config = %v, want [%d]", got, eos)
	}
	noBOS, err := LoadFile(src, write("a.json", `{"bos_token": "<s>", "add_bos_token": false, "add_eos_token": true, "eos_token": {"content": "</s>"}}`))
	if err != nil {
		t.Fatal(err)
	}
	if got := noBOS.Encode("hello", true); !slices.Equal(got, append(slices.Clone(plain), eos)) {
		t.Fatalf("add_bos_token false, add_eos_token true: %v", got)
	}
	// Without a post-processor, add_bos_token adds BOS.
	var doc map[string]json.RawMessage
	readJSON(t, src, &doc)
	doc["post_processor"] = json.RawMessage("null")
	data, _ := json.Marshal(doc)
	tj := write("tokenizer.json", string(data))
	none, err := LoadFile(tj, "")
	if err != nil {
		t.Fatal(err)
	}
	if got := none.Encode("hello", true); !slices.Equal(got, plain) {
		t.Fatalf("no post-processor, no config: %v", got)
	}
	with, err := LoadFile(tj, write("b.json", `{"bos_token": "<s>", "add_bos_token": true}`))
	if err != nil {
		t.Fatal(err)
	}
	if got := with.Encode("hello", true); !slices.Equal(got, append([]int32{bos}, plain...)) {
		t.Fatalf("add_bos_token true: %v", got)
	}
}

// TestEmptyTextWithoutAddedTokens: with no added tokens to split on, empty
// text still encodes to nothing (Metaspace must not prepend "▁" to it).
func TestEmptyTextWithoutAddedTokens(t *testing.T) {
	src := testenv.Shared(t, "tokenizers/spm-metaspace/tokenizer.json")
	ref, err := LoadFile(src, "")
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]json.RawMessage
	readJSON(t, src, &doc)
	doc["added_tokens"] = json.RawMessage("[]")
	data, _ := json.Marshal(doc)
	tok, err := parse(data, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := tok.Encode("", false); len(got) != 0 {
		t.Fatalf("Encode(\"\") = %v, want nothing", got)
	}
	for _, s := range []string{" ", "a b", " leading"} {
		if got, want := tok.Encode(s, false), ref.Encode(s, false); !slices.Equal(got, want) {
			t.Errorf("Encode(%q) = %v, want %v as with added tokens", s, got, want)
		}
	}
}

package tokenizer

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"meshgpu/internal/testenv"
)

// TestHostileFiles: broken tokenizer.json / tokenizer_config.json files are
// refused with an error naming what is wrong, and nothing panics.
func TestHostileFiles(t *testing.T) {
	good, err := os.ReadFile(testenv.Shared(t, "tokenizers/spm-llama2/tokenizer.json"))
	if err != nil {
		t.Fatal(err)
	}
	// edit returns good with doc[key] replaced (model.X for model fields).
	edit := func(key, value string) string {
		var doc map[string]json.RawMessage
		if err := json.Unmarshal(good, &doc); err != nil {
			t.Fatal(err)
		}
		if field, ok := strings.CutPrefix(key, "model."); ok {
			var model map[string]json.RawMessage
			json.Unmarshal(doc["model"], &model)
			model[field] = json.RawMessage(value)
			doc["model"], _ = json.Marshal(model)
		} else {
			doc[key] = json.RawMessage(value)
		}
		out, err := json.Marshal(doc)
		if err != nil {
			t.Fatalf("%s=%s: %v", key, value, err)
		}
		return string(out)
	}
	cases := []struct {
		name, tokenizer, config, wantErr string
	}{
		{"empty", "", "", "not a valid tokenizer.json"},
		{"truncated", string(good[:len(good)/2]), "", "not a valid tokenizer.json"},
		{"not an object", "[1,2]", "", "not a valid tokenizer.json"},
		{"no model", `{"added_tokens": []}`, "", `"model" is missing`},
		{"model is a number", edit("model", "5"), "", "model"},
		{"unigram", edit("model.type", `"Unigram"`), "", `"Unigram" is not supported`},
		{"vocab is a list", edit("model.vocab", "[1]"), "", "model"},
		{"vocab id negative", edit("model.vocab", `{"a": -1}`), "", "outside"},
		{"vocab id huge", edit("model.vocab", `{"a": 1000000000000}`), "", "outside"},
		{"vocab id fractional", edit("model.vocab", `{"a": 1.5}`), "", "model"},
		{"duplicate ids", edit("model.vocab", `{"a": 0, "b": 0}`), "", "id 0 is given to both"},
		{"merges unknown token", edit("model.merges", `[["▁", "nosuchtoken"]]`), "", `token "nosuchtoken" is not in the vocab`},
		{"merges result missing", edit("model.merges", `["e ▁"]`), "", "merged token"},
		{"merge without space", edit("model.merges", `["ab"]`), "", `want "left right"`},
		{"merges wrong type", edit("model.merges", `{"a": 1}`), "", "merges: want a list"},
		{"merge triple", edit("model.merges", `[["a","b","c"]]`), "", "merges[0]"},
		{"unk missing", edit("model.unk_token", `"<nope>"`), "", "unk_token"},
		{"added id missing", edit("added_tokens", `[{"content": "<x>"}]`), "", "added_tokens[0]"},
		{"added id string", edit("added_tokens", `[{"id": "7", "content": "<x>"}]`), "", "added_tokens"},
		{"added empty", edit("added_tokens", `[{"id": 7, "content": ""}]`), "", "empty content"},
		{"normalizer unknown", edit("normalizer", `{"type": "Precompiled"}`), "", `normalizer type "Precompiled" is not supported`},
		{"normalizer no type", edit("normalizer", `{"x": 1}`), "", `missing "type"`},
		{"bad split regex", edit("pre_tokenizer", `{"type": "Split", "pattern": {"Regex": "(["}, "behavior": "Isolated"}`), "", "bad regex"},
		{"bad split behavior", edit("pre_tokenizer", `{"type": "Split", "pattern": {"String": " "}, "behavior": "Sideways"}`), "", "behavior"},
		{"metaspace long replacement", edit("pre_tokenizer", `{"type": "Metaspace", "replacement": "ab"}`), "", "replacement"},
		{"decoder unknown", edit("decoder", `{"type": "CTC"}`), "", `decoder type "CTC"`},
		{"decoder wrong type", edit("decoder", `"ByteLevel"`), "", "decoder"},
		{"template unknown token", edit("post_processor", `{"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<z>"}}], "special_tokens": {}}`), "", `"<z>" is not in special_tokens`},
		{"template id out of range", edit("post_processor", `{"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>"}}], "special_tokens": {"<s>": {"ids": [99999]}}}`), "", "outside the vocab"},
		{"config bos unknown", string(good), `{"bos_token": "<nope>"}`, `bos_token "<nope>"`},
		{"config bos number", string(good), `{"bos_token": 5}`, "tokenizer_config"},
		{"config truncated", string(good), `{"bos_token": "<s>"`, "tokenizer_config"},
	}
	dir := t.TempDir()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tj := filepath.Join(dir, "tokenizer.json")
			if err := os.WriteFile(tj, []byte(c.tokenizer), 0o644); err != nil {
				t.Fatal(err)
			}
			tc := ""
			if c.config != "" {
				tc = filepath.Join(dir, "tokenizer_config.json")
				os.WriteFile(tc, []byte(c.config), 0o644)
			}
			tok, err := LoadFile(tj, tc)
			if err == nil {
				t.Fatalf("loaded (vocab %d); want an error containing %q", tok.VocabSize(), c.wantErr)
			}
			if !strings.Contains(err.Error(), c.wantErr) || !strings.Contains(err.Error(), "tokenizer") {
				t.Fatalf("error %q does not say %q", err, c.wantErr)
			}
			if strings.Contains(err.Error(), "\n") {
				t.Fatalf("error is not one line: %q", err)
			}
		})
	}
	if _, err := Load(filepath.Join(dir, "missing")); err == nil || !strings.Contains(err.Error(), "no such file") {
		t.Fatalf("missing dir: %v", err)
	}
}

// TestHostileIDs: Decode skips ids outside the vocab instead of panicking.
func TestHostileIDs(t *testing.T) {
	tok, _ := goCoderCases(t)
	ids := []int32{-1, 1 << 30, int32(tok.VocabSize()), 1061}
	if got, want := tok.Decode(ids, false), tok.Decode([]int32{1061}, false); got != want {
		t.Fatalf("Decode with bad ids = %q, want %q", got, want)
	}
	d := tok.NewStreamDecoder(true)
	for _, id := range ids {
		d.Add(id)
	}
	d.Flush()
	if tok.IsSpecial(-5) || tok.IsSpecial(1<<30) {
		t.Fatal("IsSpecial of a bad id")
	}
}

package tokenizer

import (
	"bytes"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"meshgpu/internal/testenv"
	"meshgpu/model/gguf"
)

// openGGUF opens a shared GGUF file and builds its tokenizer.
func openGGUF(t testing.TB, rel string) *Tokenizer {
	t.Helper()
	m, err := gguf.Open(testenv.Shared(t, rel))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	tok, err := FromGGUF(m.File)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// parseGGUF writes kv as a GGUF file in memory and parses it back.
func parseGGUF(t testing.TB, kv []gguf.KV) *gguf.File {
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

// TestGGUFGoCoderGolden: the vocab llama.cpp's converter wrote into the
// GGUF files (model gpt2, pre llama-bpe) encodes and decodes golden.json's
// cases as Hugging Face tokenizers did on the original tokenizer.json.
func TestGGUFGoCoderGolden(t *testing.T) {
	_, cases := goCoderCases(t)
	var gen struct {
		BOS int32 `json:"bos_token_id"`
		EOS int32 `json:"eos_token_id"`
	}
	readJSON(t, filepath.Join(testenv.GoCoder(t), "generation_config.json"), &gen)
	for _, file := range []string{"gocoder-6m-bf16.gguf", "gocoder-6m-q4_k_m.gguf"} {
		t.Run(file, func(t *testing.T) {
			tok := openGGUF(t, "models/gocoder-6m-gguf/"+file)
			checkCases(t, tok, cases)
			if bos, ok := tok.BOS(); !ok || bos != gen.BOS {
				t.Errorf("BOS() = %d, %v; want %d", bos, ok, gen.BOS)
			}
			if eos := tok.EOS(); !slices.Equal(eos, []int32{gen.EOS}) {
				t.Errorf("EOS() = %v; want [%d]", eos, gen.EOS)
			}
		})
	}
}

// TestGGUFMatchesTokenizerJSON: the GGUF tokenizer and the one loaded
// from the safetensors directory's tokenizer.json agree on a page of Go
// source (line by line and whole), on every token and its specialness,
// and on decoding.
func TestGGUFMatchesTokenizerJSON(t *testing.T) {
	fromJSON, cases := goCoderCases(t)
	fromGGUF := openGGUF(t, "models/gocoder-6m-gguf/gocoder-6m-bf16.gguf")
	text, err := os.ReadFile(testenv.Shared(t, "models/gocoder-6m-gguf/ppl-text.txt"))
	if err != nil {
		t.Fatal(err)
	}
	texts := append(strings.SplitAfter(string(text), "\n"), string(text),
		"IT'S WE'LL <|im_start|><|im_end|>x<|end_of_text|>", "\r\n\r\n  \t\u00a0\u2028 ١٢٣٤ 12345678", "\xff\xfe broken \xc3")
	for _, c := range cases {
		texts = append(texts, c.Text)
	}
	for _, s := range texts {
		for _, special := range []bool{true, false} {
			want := fromJSON.Encode(s, special)
			got := fromGGUF.Encode(s, special)
			if !slices.Equal(got, want) {
				t.Fatalf("Encode(%.60q, %v)\n gguf %v\n json %v", s, special, got, want)
			}
			for _, skip := range []bool{true, false} {
				if g, w := fromGGUF.Decode(got, skip), fromJSON.Decode(want, skip); g != w {
					t.Fatalf("Decode(Encode(%.60q, %v), %v): gguf %q, json %q", s, special, skip, g, w)
				}
			}
		}
	}
	if fromGGUF.VocabSize() != fromJSON.VocabSize() {
		t.Fatalf("VocabSize: gguf %d, json %d", fromGGUF.VocabSize(), fromJSON.VocabSize())
	}
	for id := int32(0); id < int32(fromJSON.VocabSize()); id++ {
		g, _ := fromGGUF.Token(id)
		w, _ := fromJSON.Token(id)
		if g != w || fromGGUF.IsSpecial(id) != fromJSON.IsSpecial(id) {
			t.Fatalf("token %d: gguf %q special %v, json %q special %v", id, g, fromGGUF.IsSpecial(id), w, fromJSON.IsSpecial(id))
		}
	}
}

// spmGGUF writes the vocab of a SentencePiece-style tokenizer.json as a
// GGUF of model "llama", the way llama.cpp's converter writes a
// SentencePiece model: tokens in id order, token types (<unk> unknown,
// other special added tokens control, <0xNN> byte, the rest normal) and a
// score per token. The tokenizer.json has merges instead of scores, so a
// token made by merges[r] scores -r: earlier merges score higher, which is
// how SentencePiece scores the pieces its BPE trainer makes. Tokens no
// merge makes (single characters, bytes, specials) score 0; no merge
// yields them, so their score is never consulted.
//
// The test stays independent: FromGGUF sees only scores and has to
// recover the merge order from them (all splits of every token, as
// llama.cpp's score-driven merging allows), and the ids it is checked
// against were computed by Hugging Face tokenizers, not by this package.
func spmGGUF(t testing.TB, dir string) *gguf.File {
	t.Helper()
	var doc struct {
		Model struct {
			Vocab  map[string]int32 `json:"vocab"`
			Merges [][2]string      `json:"merges"`
		} `json:"model"`
		AddedTokens []struct {
			ID      int32  `json:"id"`
			Content string `json:"content"`
			Special bool   `json:"special"`
		} `json:"added_tokens"`
	}
	readJSON(t, filepath.Join(dir, "tokenizer.json"), &doc)
	tokens := make([]string, len(doc.Model.Vocab))
	types := make([]int64, len(tokens))
	scores := make([]float64, len(tokens))
	for s, id := range doc.Model.Vocab {
		tokens[id], types[id] = s, 1
		if _, ok := byteToken(s); ok {
			types[id] = 6
		}
	}
	for _, a := range doc.AddedTokens {
		if !a.Special || tokens[a.ID] != a.Content {
			t.Fatalf("added token %d %q is not a special token of the vocab", a.ID, a.Content)
		}
		types[a.ID] = 3
		if a.Content == "<unk>" {
			types[a.ID] = 2
		}
	}
	made := map[int32]bool{}
	for r, mg := range doc.Model.Merges {
		id := doc.Model.Vocab[mg[0]+mg[1]]
		if !made[id] {
			made[id], scores[id] = true, -float64(r)
		}
	}
	return parseGGUF(t, []gguf.KV{
		{Key: "tokenizer.ggml.model", Value: gguf.String("llama")},
		{Key: "tokenizer.ggml.tokens", Value: gguf.Strings(tokens)},
		{Key: "tokenizer.ggml.scores", Value: gguf.Floats(gguf.TypeFloat32, scores)},
		{Key: "tokenizer.ggml.token_type", Value: gguf.Ints(gguf.TypeInt32, types)},
		{Key: "tokenizer.ggml.bos_token_id", Value: gguf.Uint32(uint32(doc.Model.Vocab["<s>"]))},
		{Key: "tokenizer.ggml.eos_token_id", Value: gguf.Uint32(uint32(doc.Model.Vocab["</s>"]))},
		{Key: "tokenizer.ggml.unknown_token_id", Value: gguf.Uint32(uint32(doc.Model.Vocab["<unk>"]))},
		// add_bos_token and add_space_prefix are left out: llama.cpp's
		// defaults for a "llama" vocab (both on) are what Llama 2 does.
	})
}

// TestGGUFSPMGolden checks a "llama" GGUF against the Hugging Face
// encodings of spm-llama2, whose tokenizer.json (Prepend "▁" to each
// stretch of text, spaces to "▁") behaves as llama.cpp's SentencePiece
// tokenizer with add_space_prefix.
func TestGGUFSPMGolden(t *testing.T) {
	_, cases := spmCases(t, "spm-llama2")
	f := spmGGUF(t, testenv.Shared(t, "tokenizers/spm-llama2"))
	tok, err := FromGGUF(f)
	if err != nil {
		t.Fatal(err)
	}
	checkCases(t, tok, cases)
	if bos, _ := tok.BOS(); bos != 1 || !slices.Equal(tok.EOS(), []int32{2}) {
		t.Errorf("BOS %d EOS %v, want 1 [2]", bos, tok.EOS())
	}
	if got := tok.Decode(tok.Encode("<s>hi</s>", true), true); got != "hi" {
		t.Errorf("Decode skipping specials = %q, want %q", got, "hi")
	}
}

// TestGGUFSPMMetaspaceGolden does the same with spm-metaspace, the same
// vocab and merges behind a Metaspace pre-tokenizer with prepend_scheme
// "first" (transformers' legacy=false Llama): "▁" only at the start of the
// text, and not when the text starts with a space. GGUF cannot say
// "first"; llama.cpp prefixes every stretch of text. So the cases where
// the schemes differ (text starting with a space, text after a special
// token) are checked against spm-llama2's encoding of the same text, the
// behaviour a GGUF carries; the rest against spm-metaspace's.
func TestGGUFSPMMetaspaceGolden(t *testing.T) {
	_, cases := spmCases(t, "spm-metaspace")
	_, legacy := spmCases(t, "spm-llama2")
	byText := map[string]goldenCase{}
	for _, c := range legacy {
		byText[c.Text] = c
	}
	tok, err := FromGGUF(spmGGUF(t, testenv.Shared(t, "tokenizers/spm-metaspace")))
	if err != nil {
		t.Fatal(err)
	}
	var same, differ []goldenCase
	for _, c := range cases {
		if strings.HasPrefix(c.Text, " ") || strings.Contains(c.Text, "<s>") || strings.Contains(c.Text, "</s>") {
			l, ok := byText[c.Text]
			if !ok {
				t.Fatalf("spm-llama2 has no case %q", c.Text)
			}
			differ = append(differ, l)
			continue
		}
		same = append(same, c)
	}
	if len(same) < len(cases)/2 || len(differ) == 0 {
		t.Fatalf("%d cases as metaspace, %d as llama2", len(same), len(differ))
	}
	checkCases(t, tok, same)
	checkCases(t, tok, differ)
}

// TestGGUFSPMMatchesTokenizerJSON compares the "llama" GGUF tokenizer with
// the tokenizer.json it was written from on a page of Go source.
// Score-driven merging may merge a pair no merge rule names (a token has
// several splits), so this is a check that the derived order is faithful
// on real text, beside the golden cases.
func TestGGUFSPMMatchesTokenizerJSON(t *testing.T) {
	dir := testenv.Shared(t, "tokenizers/spm-llama2")
	fromJSON, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	fromGGUF, err := FromGGUF(spmGGUF(t, dir))
	if err != nil {
		t.Fatal(err)
	}
	text, err := os.ReadFile(testenv.Shared(t, "models/gocoder-6m-gguf/ppl-text.txt"))
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.SplitAfter(string(text), "\n")
	bad := 0
	for _, s := range lines {
		got, want := fromGGUF.Encode(s, true), fromJSON.Encode(s, true)
		if !slices.Equal(got, want) {
			bad++
			t.Errorf("Encode(%.60q)\n gguf %v\n json %v", s, got, want)
		}
		if g, w := fromGGUF.Decode(got, false), fromJSON.Decode(want, false); g != w {
			t.Errorf("Decode: gguf %q, json %q", g, w)
		}
	}
	if bad > 0 {
		t.Logf("%d of %d lines differ", bad, len(lines))
	}
}

// tinyVocab is a byte-level vocab small enough to write by hand: the
// byte-level forms of "a", "b", " " and their merges, and two specials.
func tinyVocab(extra ...gguf.KV) []gguf.KV {
	kv := []gguf.KV{
		{Key: "tokenizer.ggml.model", Value: gguf.String("gpt2")},
		{Key: "tokenizer.ggml.tokens", Value: gguf.Strings([]string{"<s>", "</s>", "a", "b", "Ġ", "ab", "Ġab", "<tool>"})},
		{Key: "tokenizer.ggml.token_type", Value: gguf.Ints(gguf.TypeInt32, []int64{3, 3, 1, 1, 1, 1, 1, 4})},
		{Key: "tokenizer.ggml.merges", Value: gguf.Strings([]string{"a b", "Ġ ab"})},
		{Key: "tokenizer.ggml.bos_token_id", Value: gguf.Uint32(0)},
		{Key: "tokenizer.ggml.eos_token_id", Value: gguf.Uint32(1)},
	}
	// An extra entry replaces the one with its key; drop's remove it.
	for _, e := range extra {
		key, del := strings.CutPrefix(e.Key, "-")
		i := slices.IndexFunc(kv, func(x gguf.KV) bool { return x.Key == key })
		if del {
			if i >= 0 {
				kv = slices.Delete(kv, i, i+1)
			}
			continue
		}
		if i >= 0 {
			kv[i] = e
		} else {
			kv = append(kv, e)
		}
	}
	return kv
}

// drop, given to tinyVocab, removes key.
func drop(key string) gguf.KV { return gguf.KV{Key: "-" + key} }

// TestGGUFDefaults: BOS is added as llama.cpp does when
// tokenizer.ggml.add_bos_token is absent (on for Llama 3's split, off for
// GPT-2's and Qwen2's), the keys override it, control tokens are special
// and user-defined ones are not.
func TestGGUFDefaults(t *testing.T) {
	cases := []struct {
		name string
		kv   []gguf.KV
		want []int32
	}{
		{"gpt2 default", tinyVocab(), []int32{6, 7, 4, 2}},
		{"llama-bpe default", tinyVocab(gguf.KV{Key: "tokenizer.ggml.pre", Value: gguf.String("llama-bpe")}), []int32{0, 6, 7, 4, 2}},
		{"qwen2 default", tinyVocab(gguf.KV{Key: "tokenizer.ggml.pre", Value: gguf.String("qwen2")}), []int32{6, 7, 4, 2}},
		{"add_bos false", tinyVocab(gguf.KV{Key: "tokenizer.ggml.pre", Value: gguf.String("llama3")},
			gguf.KV{Key: "tokenizer.ggml.add_bos_token", Value: gguf.Bool(false)}), []int32{6, 7, 4, 2}},
		{"add_bos and add_eos", tinyVocab(gguf.KV{Key: "tokenizer.ggml.add_bos_token", Value: gguf.Bool(true)},
			gguf.KV{Key: "tokenizer.ggml.add_eos_token", Value: gguf.Bool(true)}), []int32{0, 6, 7, 4, 2, 1}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tok, err := FromGGUF(parseGGUF(t, c.kv))
			if err != nil {
				t.Fatal(err)
			}
			if got := tok.Encode(" ab<tool> a", true); !slices.Equal(got, c.want) {
				t.Fatalf("Encode = %v, want %v", got, c.want)
			}
			if got := tok.Encode(" ab<tool> a", false); !slices.Equal(got, []int32{6, 7, 4, 2}) {
				t.Fatalf("Encode without specials = %v", got)
			}
			ids := []int32{0, 6, 7, 4, 2, 1}
			if got := tok.Decode(ids, false); got != "<s> ab<tool> a</s>" {
				t.Fatalf("Decode = %q", got)
			}
			if got := tok.Decode(ids, true); got != " ab<tool> a" {
				t.Fatalf("Decode skipping specials = %q", got)
			}
		})
	}
}

// TestGGUFHostile: broken tokenizer metadata gets one clear error each,
// naming the key, and nothing panics.
func TestGGUFHostile(t *testing.T) {
	str := func(k, v string) gguf.KV { return gguf.KV{Key: k, Value: gguf.String(v)} }
	u32 := func(k string, v uint32) gguf.KV { return gguf.KV{Key: k, Value: gguf.Uint32(v)} }
	ints := func(k string, v ...int64) gguf.KV { return gguf.KV{Key: k, Value: gguf.Ints(gguf.TypeInt32, v)} }
	floats := func(k string, v ...float64) gguf.KV {
		return gguf.KV{Key: k, Value: gguf.Floats(gguf.TypeFloat32, v)}
	}
	nan := func() float64 { z := 0.0; return z / z }()
	llama := []gguf.KV{str("tokenizer.ggml.model", "llama"), floats("tokenizer.ggml.scores", 0, 0, 0, 0, 0, -1, -2, 0)}
	cases := []struct {
		name    string
		kv      []gguf.KV
		wantErr string
	}{
		{"no metadata", nil, "tokenizer.ggml.model is missing"},
		{"model missing", tinyVocab(drop("tokenizer.ggml.model")), "tokenizer.ggml.model is missing"},
		{"model unknown", tinyVocab(str("tokenizer.ggml.model", "bert")), `tokenizer.ggml.model "bert" is not supported`},
		{"model not a string", tinyVocab(u32("tokenizer.ggml.model", 2)), "tokenizer.ggml.model is 2 (uint32), not a string"},
		{"pre unknown", tinyVocab(str("tokenizer.ggml.pre", "deepseek-llm")), `tokenizer.ggml.pre "deepseek-llm" is not supported (supported: "default", "gpt-2", "gpt2", "llama-bpe"`},
		{"tokens missing", tinyVocab(drop("tokenizer.ggml.tokens")), "tokenizer.ggml.tokens is missing"},
		{"tokens empty", tinyVocab(strs("tokenizer.ggml.tokens")), "tokenizer.ggml.tokens is empty"},
		{"tokens not strings", tinyVocab(ints("tokenizer.ggml.tokens", 1, 2)), "tokenizer.ggml.tokens is [2 × int32], not an array of strings"},
		{"token_type short", tinyVocab(ints("tokenizer.ggml.token_type", 3, 3, 1)), "tokenizer.ggml.token_type has 3 entries for 8 tokens"},
		{"token_type unknown", tinyVocab(ints("tokenizer.ggml.token_type", 3, 3, 1, 1, 9, 1, 1, 4)), "tokenizer.ggml.token_type[4] is 9"},
		{"token_type strings", tinyVocab(strs("tokenizer.ggml.token_type", "a")), "tokenizer.ggml.token_type is [1 × string], not an array of integers"},
		{"scores long", tinyVocab(floats("tokenizer.ggml.scores", 0, 0, 0, 0, 0, 0, 0, 0, 0)), "tokenizer.ggml.scores has 9 entries for 8 tokens"},
		{"scores NaN", tinyVocab(floats("tokenizer.ggml.scores", 0, 0, 0, nan, 0, 0, 0, 0)), "tokenizer.ggml.scores[3] is NaN"},
		{"scores missing for llama", tinyVocab(str("tokenizer.ggml.model", "llama")), "tokenizer.ggml.scores is missing"},
		{"bos out of range", tinyVocab(u32("tokenizer.ggml.bos_token_id", 8)), "tokenizer.ggml.bos_token_id is 8, outside the 8 tokens"},
		{"eos out of range", tinyVocab(u32("tokenizer.ggml.eos_token_id", 1<<31)), "tokenizer.ggml.eos_token_id is 2147483648, outside the 8 tokens"},
		{"bos negative", tinyVocab(gguf.KV{Key: "tokenizer.ggml.bos_token_id", Value: gguf.Int32(-1)}), "tokenizer.ggml.bos_token_id is -1 (int32), not a token id"},
		{"eos a string", tinyVocab(str("tokenizer.ggml.eos_token_id", "</s>")), "tokenizer.ggml.eos_token_id is </s> (string), not a token id"},
		{"unk out of range", tinyVocab(u32("tokenizer.ggml.unknown_token_id", 99)), "tokenizer.ggml.unknown_token_id is 99"},
		{"merges missing", tinyVocab(drop("tokenizer.ggml.merges")), "tokenizer.ggml.merges is missing"},
		{"merge names unknown token", tinyVocab(strs("tokenizer.ggml.merges", "a b", "Ġ zz")), `tokenizer.ggml.merges[1] "Ġ zz": "zz" is not in tokenizer.ggml.tokens`},
		{"merged token unknown", tinyVocab(strs("tokenizer.ggml.merges", "b a")), `tokenizer.ggml.merges[0] "b a": "ba" is not in tokenizer.ggml.tokens`},
		{"merge without space", tinyVocab(strs("tokenizer.ggml.merges", "ab")), `tokenizer.ggml.merges[0] is "ab", not "left right"`},
		{"merge trailing space", tinyVocab(strs("tokenizer.ggml.merges", "a ")), `tokenizer.ggml.merges[0] is "a ", not "left right"`},
		{"add_bos not a bool", tinyVocab(u32("tokenizer.ggml.add_bos_token", 1)), "tokenizer.ggml.add_bos_token is 1 (uint32), not a bool"},
		{"add_bos without bos", tinyVocab(drop("tokenizer.ggml.bos_token_id"), gguf.KV{Key: "tokenizer.ggml.add_bos_token", Value: gguf.Bool(true)}),
			"tokenizer.ggml.bos_token_id is missing"},
		{"add_eos without eos", tinyVocab(drop("tokenizer.ggml.eos_token_id"), gguf.KV{Key: "tokenizer.ggml.add_eos_token", Value: gguf.Bool(true)}),
			"tokenizer.ggml.eos_token_id is missing"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tok, err := FromGGUF(parseGGUF(t, c.kv))
			if err == nil {
				t.Fatalf("built a tokenizer (vocab %d); want an error containing %q", tok.VocabSize(), c.wantErr)
			}
			if !strings.Contains(err.Error(), c.wantErr) || !strings.HasPrefix(err.Error(), "tokenizer: gguf: ") {
				t.Fatalf("error %q does not say %q", err, c.wantErr)
			}
			if strings.Contains(err.Error(), "\n") {
				t.Fatalf("error is not one line: %q", err)
			}
		})
	}
	// The llama variant of the tiny vocab builds: the failures above are
	// the keys', not the vocab's.
	if _, err := FromGGUF(parseGGUF(t, tinyVocab(llama...))); err != nil {
		t.Fatal(err)
	}
}

// TestGGUFPreNames: each tokenizer.ggml.pre name selects its model's
// split, told apart by how digits group and whether a word that is a
// token is taken whole (Llama 3's ignore_merges).
func TestGGUFPreNames(t *testing.T) {
	kv := func(pre string) []gguf.KV {
		return []gguf.KV{
			{Key: "tokenizer.ggml.model", Value: gguf.String("gpt2")},
			{Key: "tokenizer.ggml.pre", Value: gguf.String(pre)},
			{Key: "tokenizer.ggml.tokens", Value: gguf.Strings([]string{"1", "2", "3", "12", "123", "b", "bb"})},
			{Key: "tokenizer.ggml.merges", Value: gguf.Strings([]string{"1 2", "12 3"})},
		}
	}
	cases := []struct {
		pre    string
		digits []int32
	}{
		{"llama-bpe", []int32{4}}, // \p{N}{1,3}
		{"qwen2", []int32{0, 1, 2}},
		{"gpt2", []int32{4}},
		{"smollm", []int32{0, 1, 2}},
		{"starcoder", []int32{0, 1, 2}},
	}
	for _, c := range cases {
		tok, err := FromGGUF(parseGGUF(t, kv(c.pre)))
		if err != nil {
			t.Fatalf("%s: %v", c.pre, err)
		}
		if got := tok.Encode("123", false); !slices.Equal(got, c.digits) {
			t.Errorf("%s: Encode(123) = %v, want %v", c.pre, got, c.digits)
		}
		if got := tok.Encode("bb", false); c.pre == "llama-bpe" && !slices.Equal(got, []int32{6}) {
			t.Errorf("%s: Encode(bb) = %v, want [6] (the word is a token)", c.pre, got)
		} else if c.pre != "llama-bpe" && !slices.Equal(got, []int32{5, 5}) {
			t.Errorf("%s: Encode(bb) = %v, want [5 5] (no merge makes bb)", c.pre, got)
		}
	}
}

// FuzzFromGGUF feeds mutated GGUF files to FromGGUF: an error or a
// tokenizer that encodes and decodes without panicking. Seeds: the tiny
// vocab as "gpt2" and as "llama".
func FuzzFromGGUF(f *testing.F) {
	llama := []gguf.KV{
		{Key: "tokenizer.ggml.model", Value: gguf.String("llama")},
		{Key: "tokenizer.ggml.scores", Value: gguf.Floats(gguf.TypeFloat32, []float64{0, 0, 0, 0, 0, -1, -2, 0})},
		{Key: "tokenizer.ggml.add_space_prefix", Value: gguf.Bool(false)},
	}
	for _, kv := range [][]gguf.KV{tinyVocab(), tinyVocab(llama...)} {
		var buf bytes.Buffer
		if _, err := gguf.Write(&buf, kv, nil, nil); err != nil {
			f.Fatal(err)
		}
		f.Add(buf.Bytes())
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		g, err := gguf.Parse(bytes.NewReader(data), int64(len(data)))
		if err != nil {
			return
		}
		tok, err := FromGGUF(g)
		if err != nil {
			if strings.Contains(err.Error(), "\n") {
				t.Fatalf("error is not one line: %q", err)
			}
			return
		}
		exercise(t, tok)
	})
}

// TestGGUFOddVocab: a string given to two ids (llama.cpp encodes it as
// the later) and an empty last token (which nothing encodes to) still
// decode; eot_token_id joins EOS.
func TestGGUFOddVocab(t *testing.T) {
	tok, err := FromGGUF(parseGGUF(t, tinyVocab(
		strs("tokenizer.ggml.tokens", "<s>", "</s>", "a", "b", "Ġ", "ab", "Ġab", "<tool>", "a", "<|eot|>", ""),
		gguf.KV{Key: "tokenizer.ggml.token_type", Value: gguf.Ints(gguf.TypeInt32, []int64{3, 3, 1, 1, 1, 1, 1, 4, 1, 3, 5})},
		gguf.KV{Key: "tokenizer.ggml.eot_token_id", Value: gguf.Uint32(9)},
	)))
	if err != nil {
		t.Fatal(err)
	}
	if tok.VocabSize() != 11 {
		t.Errorf("VocabSize = %d, want 11", tok.VocabSize())
	}
	if got := tok.Encode("a", false); !slices.Equal(got, []int32{8}) {
		t.Errorf("Encode(a) = %v, want [8]", got)
	}
	if got := tok.Decode([]int32{2, 8, 10, 9}, false); got != "aa<|eot|>" {
		t.Errorf("Decode = %q", got)
	}
	if got := tok.Decode([]int32{2, 8, 10, 9}, true); got != "aa" {
		t.Errorf("Decode skipping specials = %q", got)
	}
	if !slices.Equal(tok.EOS(), []int32{1, 9}) {
		t.Errorf("EOS = %v, want [1 9]", tok.EOS())
	}
}

// strs is a string array entry.
func strs(k string, v ...string) gguf.KV { return gguf.KV{Key: k, Value: gguf.Strings(v)} }

package tokenizer

import (
	"encoding/json"
	"slices"
	"testing"

	"meshgpu/internal/testenv"
)

// variant is a shared tokenizer.json with some parts replaced; see
// testdata/variants.json.
type variant struct {
	Name        string                     `json:"name"`
	Base        string                     `json:"base"`
	Set         map[string]json.RawMessage `json:"set"`
	Model       map[string]json.RawMessage `json:"model"`
	AddedTokens []json.RawMessage          `json:"added_tokens"`
}

var variantBases = map[string]string{
	"gocoder":       "models/gocoder-6m/tokenizer.json",
	"spm-llama2":    "tokenizers/spm-llama2/tokenizer.json",
	"spm-metaspace": "tokenizers/spm-metaspace/tokenizer.json",
}

// buildVariant returns the tokenizer.json bytes of v.
func buildVariant(t testing.TB, v variant) []byte {
	t.Helper()
	var doc map[string]json.RawMessage
	readJSON(t, testenv.Shared(t, variantBases[v.Base]), &doc)
	for k, val := range v.Set {
		doc[k] = val
	}
	var model map[string]json.RawMessage
	if err := json.Unmarshal(doc["model"], &model); err != nil {
		t.Fatal(err)
	}
	for k, val := range v.Model {
		model[k] = val
	}
	var added []json.RawMessage
	if err := json.Unmarshal(doc["added_tokens"], &added); err != nil {
		t.Fatal(err)
	}
	added = append(added, v.AddedTokens...)
	var err error
	if doc["model"], err = json.Marshal(model); err != nil {
		t.Fatal(err)
	}
	if doc["added_tokens"], err = json.Marshal(added); err != nil {
		t.Fatal(err)
	}
	data, err := json.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

type referenceCase struct {
	Text               string  `json:"text"`
	IDsWithBOS         []int32 `json:"ids_with_bos"`
	IDsNoSpecial       []int32 `json:"ids_no_special"`
	Decoded            string  `json:"decoded"`
	DecodedSkipSpecial string  `json:"decoded_skip_special"`
}

func loadReference(t testing.TB) map[string]struct {
	variant
	cases []referenceCase
} {
	var vs struct {
		Variants []variant `json:"variants"`
	}
	readJSON(t, "testdata/variants.json", &vs)
	var ref struct {
		Results []struct {
			Variant string          `json:"variant"`
			Cases   []referenceCase `json:"cases"`
		} `json:"results"`
	}
	readJSON(t, "testdata/reference.json", &ref)
	out := map[string]struct {
		variant
		cases []referenceCase
	}{}
	for _, v := range vs.Variants {
		for _, r := range ref.Results {
			if r.Variant == v.Name {
				out[v.Name] = struct {
					variant
					cases []referenceCase
				}{v, r.Cases}
			}
		}
	}
	if len(out) != len(vs.Variants) || len(out) == 0 {
		t.Fatalf("reference.json covers %d of %d variants", len(out), len(vs.Variants))
	}
	return out
}

// TestReferenceVariants compares with Hugging Face tokenizers (npm
// tokenizers@0.23.2) on extra texts and on variants exercising
// ignore_merges, lstrip/rstrip/single_word/normalized added tokens, NFC,
// split behaviors, Metaspace split and decoder, and no byte fallback.
func TestReferenceVariants(t *testing.T) {
	for name, v := range loadReference(t) {
		t.Run(name, func(t *testing.T) {
			tok, err := parse(buildVariant(t, v.variant), nil)
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range v.cases {
				if got := tok.Encode(c.Text, true); !slices.Equal(got, c.IDsWithBOS) {
					t.Errorf("Encode(%q, true)\n got %v\nwant %v", c.Text, got, c.IDsWithBOS)
				}
				if got := tok.Encode(c.Text, false); !slices.Equal(got, c.IDsNoSpecial) {
					t.Errorf("Encode(%q, false)\n got %v\nwant %v", c.Text, got, c.IDsNoSpecial)
				}
				if got := tok.Decode(c.IDsNoSpecial, false); got != c.Decoded {
					t.Errorf("Decode(%v, false) = %q, want %q", c.IDsNoSpecial, got, c.Decoded)
				}
				if got := tok.Decode(c.IDsWithBOS, true); got != c.DecodedSkipSpecial {
					t.Errorf("Decode(%v, true) = %q, want %q", c.IDsWithBOS, got, c.DecodedSkipSpecial)
				}
			}
		})
	}
}

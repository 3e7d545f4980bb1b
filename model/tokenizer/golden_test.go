package tokenizer

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"meshgpu/internal/testenv"
)

// goldenCase is one tokenizer case computed by Hugging Face tokenizers.
type goldenCase struct {
	Text         string   `json:"text"`
	IDsWithBOS   []int32  `json:"ids_with_bos"`
	IDsNoSpecial []int32  `json:"ids_no_special"`
	Tokens       []string `json:"tokens"`
	Decoded      string   `json:"decoded"`
}

func readJSON(t testing.TB, path string, v any) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

func goCoderCases(t testing.TB) (*Tokenizer, []goldenCase) {
	dir := testenv.GoCoder(t)
	tok, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	var g struct {
		Cases []goldenCase `json:"tokenizer_cases"`
	}
	readJSON(t, filepath.Join(dir, "golden.json"), &g)
	if len(g.Cases) == 0 {
		t.Fatal("golden.json has no tokenizer_cases")
	}
	return tok, g.Cases
}

func spmCases(t testing.TB, name string) (*Tokenizer, []goldenCase) {
	dir := testenv.Shared(t, filepath.Join("tokenizers", name))
	tok, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	var g struct {
		Cases []goldenCase `json:"cases"`
	}
	readJSON(t, filepath.Join(dir, "golden.json"), &g)
	if len(g.Cases) == 0 {
		t.Fatalf("%s golden.json has no cases", name)
	}
	return tok, g.Cases
}

// checkCases compares encodings and decodings with the reference.
func checkCases(t *testing.T, tok *Tokenizer, cases []goldenCase) {
	for _, c := range cases {
		name := c.Text
		if len(name) > 40 {
			name = name[:40]
		}
		t.Run(name, func(t *testing.T) {
			if got := tok.Encode(c.Text, true); !slices.Equal(got, c.IDsWithBOS) {
				t.Errorf("Encode(%q, true)\n got %v\nwant %v", c.Text, got, c.IDsWithBOS)
			}
			if got := tok.Encode(c.Text, false); !slices.Equal(got, c.IDsNoSpecial) {
				t.Errorf("Encode(%q, false)\n got %v\nwant %v", c.Text, got, c.IDsNoSpecial)
			}
			if c.Tokens != nil {
				var got []string
				for _, id := range c.IDsNoSpecial {
					s, _ := tok.Token(id)
					got = append(got, s)
				}
				if !slices.Equal(got, c.Tokens) && !(len(got) == 0 && len(c.Tokens) == 0) {
					t.Errorf("tokens of %q\n got %q\nwant %q", c.Text, got, c.Tokens)
				}
			}
			if got := tok.Decode(c.IDsNoSpecial, false); got != c.Decoded {
				t.Errorf("Decode(ids_no_special) = %q, want %q", got, c.Decoded)
			}
		})
	}
}

func TestGoCoderGolden(t *testing.T) {
	tok, cases := goCoderCases(t)
	checkCases(t, tok, cases)
}

func TestSPMLlama2Golden(t *testing.T) {
	tok, cases := spmCases(t, "spm-llama2")
	checkCases(t, tok, cases)
}

func TestSPMMetaspaceGolden(t *testing.T) {
	tok, cases := spmCases(t, "spm-metaspace")
	checkCases(t, tok, cases)
}

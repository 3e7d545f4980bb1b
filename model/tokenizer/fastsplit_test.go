package tokenizer

import (
	"slices"
	"strings"
	"testing"

	"github.com/dlclark/regexp2"
)

func splitBoth(t testing.TB, pattern, s string) (fast, slow []string) {
	f := fastSplitter(pattern)
	if f == nil {
		t.Fatalf("no fast splitter for %q", pattern)
	}
	r := regexSplitter(regexp2.MustCompile(pattern, regexp2.None), "Isolated", false)
	for _, p := range f([]piece{{s, true}}) {
		fast = append(fast, p.text)
	}
	for _, p := range r([]piece{{s, true}}) {
		slow = append(slow, p.text)
	}
	return fast, slow
}

var splitSamples = []string{
	"", " ", "  ", "\n", " \n ", "a  b", "a \n\n b", "x\r\n\r\ny", "\t\tfoo", " \tfoo",
	"it's IT'S we'LL they'Re I'd 'm 'x ''s '", "12345 1 22 333 4444 ٣٤٥٦ ⅔½",
	" !!\n\n?", "(a)", "a\u00a0b\u2003c\u3000d\u0085e", "emoji 👩‍👩‍👧 🚀!", "\xff\xfeab\xc3",
	"func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {\n\treturn\n}\n",
	"trailing   ", "   leading", "x  \n  y", "'ſ 'K 'ﬅ",
}

// TestFastSplitMatchesRegex holds the hand-written splitters to regexp2's
// output on tricky samples and on the bench text.
func TestFastSplitMatchesRegex(t *testing.T) {
	for _, pattern := range []string{llama3Pattern, qwen2Pattern, gpt2Pattern} {
		for _, s := range append(slices.Clone(splitSamples), benchText) {
			fast, slow := splitBoth(t, pattern, s)
			if !slices.Equal(fast, slow) {
				t.Errorf("pattern %.20q on %q:\nfast %q\nslow %q", pattern, s, fast, slow)
			}
		}
	}
}

func FuzzFastSplit(f *testing.F) {
	for _, s := range splitSamples {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		for _, pattern := range []string{llama3Pattern, qwen2Pattern, gpt2Pattern} {
			fast, slow := splitBoth(t, pattern, s)
			if !slices.Equal(fast, slow) {
				t.Fatalf("on %q:\nfast %q\nslow %q", s, fast, slow)
			}
			if strings.Join(fast, "") != s {
				t.Fatalf("pieces do not cover %q", s)
			}
		}
	})
}

package wire

import "testing"

func TestParseSpeculateMode(t *testing.T) {
	for in, want := range map[string]SpeculateMode{"": SpeculateOff, "off": SpeculateOff, "ngram": SpeculateNGram, "draft": SpeculateDraft} {
		if got, err := ParseSpeculateMode(in); err != nil || got != want {
			t.Errorf("%q: %q, %v", in, got, err)
		}
	}
	for _, in := range []string{"on", "NGRAM", "draft "} {
		if _, err := ParseSpeculateMode(in); err == nil {
			t.Errorf("%q accepted", in)
		}
	}
}

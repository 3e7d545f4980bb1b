package tokenizer

import (
	"strings"
	"testing"
	"unicode/utf8"
)

// FuzzEncodeDecode: on the gocoder (byte-level) tokenizer Decode(Encode(s))
// gives s back for any valid UTF-8 s, streaming gives the same text, and
// nothing panics on any input; the SentencePiece-style tokenizers must not
// panic either and must stream what they decode. Seeds: the golden texts.
func FuzzEncodeDecode(f *testing.F) {
	tok, cases := goCoderCases(f)
	for _, c := range cases {
		f.Add(c.Text)
	}
	spm1, spmCases1 := spmCases(f, "spm-llama2")
	spm2, _ := spmCases(f, "spm-metaspace")
	for _, c := range spmCases1 {
		f.Add(c.Text)
	}
	f.Add("\xff\xfe<|im_start|>\xc3")
	f.Fuzz(func(t *testing.T, s string) {
		ids := tok.Encode(s, false)
		withBOS := tok.Encode(s, true)
		if b, _ := tok.BOS(); len(withBOS) != len(ids)+1 || withBOS[0] != b {
			t.Fatalf("Encode(%q, true) = %v, want BOS + %v", s, withBOS, ids)
		}
		got := tok.Decode(ids, false)
		if utf8.ValidString(s) && got != s {
			t.Fatalf("Decode(Encode(%q)) = %q", s, got)
		}
		if !utf8.ValidString(got) {
			t.Fatalf("Decode gave invalid UTF-8 %q", got)
		}
		if st := stream(tok, ids); utf8.ValidString(s) && st != s {
			t.Fatalf("stream of Encode(%q) = %q", s, st)
		}
		for _, sp := range []*Tokenizer{spm1, spm2} {
			ids := sp.Encode(s, true)
			for _, id := range ids {
				if id < 0 || int(id) >= sp.VocabSize() {
					t.Fatalf("id %d out of range", id)
				}
			}
			dec := sp.Decode(ids, false)
			if st := stream(sp, ids); utf8.ValidString(s) && st != dec {
				t.Fatalf("spm stream %q != Decode %q", st, dec)
			}
		}
	})
}

func stream(tok *Tokenizer, ids []int32) string {
	d := tok.NewStreamDecoder(false)
	var b strings.Builder
	for _, id := range ids {
		b.WriteString(d.Add(id))
	}
	b.WriteString(d.Flush())
	return b.String()
}

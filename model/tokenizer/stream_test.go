package tokenizer

import (
	"strings"
	"testing"
	"unicode/utf8"
)

// streamAll feeds ids one by one and checks every piece is whole UTF-8.
func streamAll(t *testing.T, tok *Tokenizer, ids []int32, skip bool) string {
	t.Helper()
	d := tok.NewStreamDecoder(skip)
	var b strings.Builder
	for i, id := range ids {
		piece := d.Add(id)
		if !utf8.ValidString(piece) {
			t.Fatalf("piece %d %q is not valid UTF-8", i, piece)
		}
		if r, _ := utf8.DecodeLastRuneInString(piece); r == utf8.RuneError && piece != "" {
			t.Fatalf("piece %d %q ends in U+FFFD: half a character was emitted", i, piece)
		}
		b.WriteString(piece)
	}
	b.WriteString(d.Flush())
	return b.String()
}

// TestStreamMatchesDecode: streaming each golden case's ids reproduces
// Decode of all ids and the reference text; the emoji and CJK cases split
// characters across tokens (byte-level pieces and <0xNN> byte fallback).
func TestStreamMatchesDecode(t *testing.T) {
	type set struct {
		name  string
		tok   *Tokenizer
		cases []goldenCase
	}
	var sets []set
	tok, cases := goCoderCases(t)
	sets = append(sets, set{"gocoder", tok, cases})
	for _, name := range []string{"spm-llama2", "spm-metaspace"} {
		tok, cases := spmCases(t, name)
		sets = append(sets, set{name, tok, cases})
	}
	splitRunes := 0
	for _, s := range sets {
		for _, c := range s.cases {
			for _, skip := range []bool{false, true} {
				ids := c.IDsWithBOS
				want := s.tok.Decode(ids, skip)
				if !skip && s.tok.Decode(c.IDsNoSpecial, false) != c.Decoded {
					t.Fatalf("%s %q: Decode disagrees with the reference", s.name, c.Text)
				}
				if got := streamAll(t, s.tok, ids, skip); got != want {
					t.Errorf("%s %q skip=%v: stream %q, Decode %q", s.name, c.Text, skip, got, want)
				}
			}
			for _, id := range c.IDsNoSpecial {
				// A token holding part of a character decodes alone to U+FFFD.
				if strings.ContainsRune(s.tok.Decode([]int32{id}, false), utf8.RuneError) && !strings.ContainsRune(c.Text, utf8.RuneError) {
					splitRunes++
				}
			}
		}
	}
	if splitRunes == 0 {
		t.Fatal("no case has a token holding part of a character; the test proves nothing")
	}
}

// TestStreamHoldsPartialRune checks the stream emits the rocket emoji
// only once all four of its byte tokens arrived.
func TestStreamHoldsPartialRune(t *testing.T) {
	tok, _ := spmCases(t, "spm-llama2")
	var ids []int32
	for _, b := range []byte("🚀") {
		id, ok := tok.TokenID(byteTokenName(b))
		if !ok {
			t.Fatalf("no byte token for %#x", b)
		}
		ids = append(ids, id)
	}
	d := tok.NewStreamDecoder(false)
	for i, id := range ids[:3] {
		if got := d.Add(id); got != "" {
			t.Fatalf("after byte %d: emitted %q before the character was complete", i, got)
		}
	}
	if got := d.Add(ids[3]); got != "🚀" {
		t.Fatalf("after the last byte: got %q, want the emoji", got)
	}
	// A truncated character comes out as U+FFFD on Flush, as Decode has it.
	d = tok.NewStreamDecoder(false)
	d.Add(ids[0])
	d.Add(ids[1])
	if got, want := d.Flush(), tok.Decode(ids[:2], false); got != want || got != "\uFFFD\uFFFD" {
		t.Fatalf("Flush of a truncated character = %q, want %q", got, want)
	}
}

func byteTokenName(b byte) string {
	const hex = "0123456789ABCDEF"
	return "<0x" + string(hex[b>>4]) + string(hex[b&15]) + ">"
}

// TestStreamCode streams a longer generation-like text, token by token.
func TestStreamCode(t *testing.T) {
	tok, _ := goCoderCases(t)
	ids := tok.Encode(benchText, true)
	if got, want := streamAll(t, tok, ids, true), tok.Decode(ids, true); got != want || got != benchText {
		t.Fatalf("stream differs from Decode (or Decode from the text): %d vs %d bytes", len(got), len(want))
	}
}
